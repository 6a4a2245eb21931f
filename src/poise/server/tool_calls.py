"""Tool calling: which tools a chat request allows, how its answer is held to them, and how the
answer is shaped as OpenAI's ``tool_calls``, whole or streamed.

- ``none``: tools reach the chat template, the answer is content.
- a named function: the answer is that function's arguments, forced by structured output
  against its ``parameters`` schema (OpenAI answers these with ``finish_reason: "stop"``).
- ``required``: the answer is a JSON list of ``{"name", "parameters"}``, forced against the
  tools' schemas as vLLM forces it: one to ``MAX_PARALLEL_CALLS`` calls (exactly one without
  ``parallel_tool_calls``).
- ``auto`` (the default with tools): the model's own format, read by the parser of its family
  (``tool_parsers``). Content streams until a call may be starting; from there the answer is
  held and parsed when it ends. A call of a ``strict`` tool whose arguments break its schema,
  or of a function not offered, is no call: the answer is content.

Streamed calls go out as OpenAI streams them: a first fragment with the call's index, id, type,
name and empty arguments, then arguments fragments. A call's id derives from the response id and
its place, so a stream resumed on another replica (the gateway's failover) keeps the ids, and
``ToolStream`` is a function of the text so far, so the resumed one is primed with what the
client already has and goes on from the same state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from poise.engine.errors import InvalidRequestError
from poise.engine.structured import GuidedDecoding, compile_guided
from poise.protocol import ChatCompletionRequest, Tool
from poise.server.tool_parsers import MARKERS, PARSE, Parsed, ParsedCall, detect_parser

ToolMode = Literal["none", "auto", "required", "named"]
# Calls in one forced answer: a bound, so that a model that would go on listing calls (a
# random-weight one does) still ends its list, and its answer parses, within max_tokens.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[Tool]
    parser: str | None = None  # auto: the family's format
    name: str | None = None  # named: the function
    parallel: bool = True


def plan_tools(
    body: ChatCompletionRequest, configured_parser: str | None, template: str | None
) -> ToolPlan | None:
    """The request's tool mode, or None without tools; 400s for what cannot be honoured."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise InvalidRequestError(
                "parallel_tool_calls needs tools", param="parallel_tool_calls"
            )
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        parser = configured_parser or detect_parser(template)
        if parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) needs the model\'s tool-call '
                "format, and this model's chat template writes none poise knows; start the "
                'server with --tool-call-parser, or ask for tool_choice "required" or a '
                "named function, which structured output enforces",
                param="tool_choice",
            )
        return ToolPlan("auto", body.tools, parser=parser, parallel=parallel)
    if choice == "none":
        return ToolPlan("none", body.tools)
    if choice == "required":
        return ToolPlan("required", body.tools, parallel=parallel)
    name = choice.function.name  # type: ignore[union-attr]
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the tools",
            param="tool_choice",
        )
    return ToolPlan("named", body.tools, name=name, parallel=parallel)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_guided(plan: ToolPlan) -> GuidedDecoding | None:
    """The grammar that forces a required or named call; None for the other modes."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t.function.name == plan.name)
        return compile_guided("json_schema", _parameters(tool), "tools")
    if plan.mode != "required":
        return None
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in plan.tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_PARALLEL_CALLS if plan.parallel else 1,
        "items": {"anyOf": call},
    }
    return compile_guided("json_schema", schema, "tools")


def _strictly_valid(tool: Tool, call: ParsedCall) -> bool:
    """A ``strict`` tool's calls match its parameters: what auto mode cannot force, it checks
    (forced modes hold every tool to its schema anyway)."""
    if not tool.function.strict:
        return True
    try:
        jsonschema.validate(json.loads(call.arguments), _parameters(tool))
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def call_id(response_id: str, choice: int, k: int) -> str:
    digest = hashlib.sha256(f"{response_id}:{choice}:{k}".encode()).hexdigest()
    return "call_" + digest[:24]


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [
        ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
        for i in items
        if isinstance(i, dict) and "name" in i and "parameters" in i
    ]


def parse_answer(plan: ToolPlan, text: str, text_with_specials: str) -> Parsed:
    """The answer's content and calls, by the plan's mode."""
    if plan.mode == "named":
        return Parsed(None, [ParsedCall(plan.name or "", text)])
    if plan.mode == "required":
        calls = _required_calls(text)
        return Parsed(text, []) if not calls else Parsed(None, calls)
    if plan.mode == "auto":
        assert plan.parser is not None
        parsed = PARSE[plan.parser](text_with_specials)
        tools = {t.function.name: t for t in plan.tools}
        if not parsed.calls or any(
            c.name not in tools or not _strictly_valid(tools[c.name], c) for c in parsed.calls
        ):
            # A call of a function the request did not offer, or one whose arguments break a
            # strict tool's schema, is no call: the text is content.
            return Parsed(text, [])
        calls = parsed.calls if plan.parallel else parsed.calls[:1]
        return Parsed(parsed.content, calls)
    return Parsed(text, [])


def _call_body(response_id: str, choice: int, k: int, call: ParsedCall) -> dict[str, Any]:
    return {
        "id": call_id(response_id, choice, k),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def shape_message(
    plan: ToolPlan, response_id: str, choice: int, text: str, with_specials: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole answer as OpenAI's message, and its finish reason."""
    parsed = parse_answer(plan, text, with_specials)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [
            _call_body(response_id, choice, k, c) for k, c in enumerate(parsed.calls)
        ]
        if plan.mode != "named" and reason == "stop":
            reason = "tool_calls"
    return message, reason


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's deltas under a tool plan; a function of the text fed so far."""

    plan: ToolPlan
    response_id: str
    choice: int
    marker_token: int | None = None  # a parser's marker that is a special token
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content or arguments
    holding: bool = False
    calls_sent: int = 0
    header_sent: bool = False

    def feed(self, delta_text: str, delta_ids: list[int]) -> list[dict[str, Any]]:
        """The deltas this much more text gives, before the answer ends."""
        self.text += delta_text
        mode = self.plan.mode
        if mode == "none":
            return self._content_upto(len(self.text))
        if mode == "named":
            if not delta_text:
                return []
            out = []
            if not self.header_sent:
                self.header_sent = True
                named = ParsedCall(self.plan.name or "", "")
                head = _call_body(self.response_id, self.choice, 0, named)
                out.append({"tool_calls": [{"index": 0, **head}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            self.sent = len(self.text)
            return out
        if mode == "required":
            return []  # a list of calls: shaped once it is whole
        assert self.plan.parser is not None
        marker = MARKERS[self.plan.parser]
        if (
            self.marker_token is not None
            and self.marker_token in delta_ids
            and marker not in self.text
        ):
            self.holding = True  # the marker is a special token, absent from the text
        if self.holding:
            return []
        if self.plan.parser == "llama3_json":
            # Its calls are the whole answer: one that starts as JSON is held.
            if self.text.lstrip().startswith(marker):
                self.holding = True
                return []
            return self._content_upto(len(self.text) if self.text.strip() else 0)
        at = self.text.find(marker)
        if at >= 0:
            self.holding = True
            return self._content_upto(at)
        # Keep back a tail that may yet grow into the marker.
        keep = next(
            (
                k
                for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                if self.text.endswith(marker[:k])
            ),
            0,
        )
        return self._content_upto(len(self.text) - keep)

    def _content_upto(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece = self.text[self.sent : end]
        self.sent = end
        return [{"content": piece}]

    def finish(
        self, with_specials: str, reason: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas the end of the answer gives, and its finish reason."""
        mode = self.plan.mode
        if mode in ("none", "named"):
            return self._content_upto(len(self.text)) if mode == "none" else [], reason
        parsed = parse_answer(self.plan, self.text, with_specials)
        if not parsed.calls:
            return self._content_upto(len(self.text)), reason
        # Content before a call went out as it came; what follows the marker is the calls.
        out: list[dict[str, Any]] = []
        for k, call in enumerate(parsed.calls):
            head = _call_body(self.response_id, self.choice, k, ParsedCall(call.name, ""))
            out.append({"tool_calls": [{"index": k, **head}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        self.sent = len(self.text)
        return out, "tool_calls" if reason == "stop" else reason
