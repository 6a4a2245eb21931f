"""Tool calls in a model's own words, for ``tool_choice: "auto"``: one parser per model family.

Each family writes its calls its own way, as its chat template teaches it:
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
  Qwen2.5, SmolLM and other ChatML models);
- ``llama3_json``: a whole answer that is one JSON object, or several joined by ``;``, of
  ``{"name": ..., "parameters": {...}}``, after an optional ``<|python_tag|>`` (Llama 3.1+);
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}``.

The parser is chosen from the chat template (the marker it writes) unless the server names one
(``--tool-call-parser``). A parser reads the text with special tokens kept (the markers of
Llama and Mistral are special tokens). Text that does not hold a well-formed call is content,
as vLLM's parsers return it: a malformed call is never half-reported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: list[ParsedCall]


def _call_from(obj: object, arguments_key: str) -> ParsedCall | None:
    """A call has a name and its arguments (an object, or JSON text of one), as vLLM's parsers
    require: ``{"name": "Bob", "age": 3}`` is an answer that is JSON, not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if arguments_key not in obj and "arguments" not in obj:
        return None
    args = obj.get(arguments_key, obj.get("arguments"))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text, [])
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call_from(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return Parsed(text, [])
        calls.append(call)
    content = text[:start].strip()
    return Parsed(content or None, calls)


def _json_objects(text: str) -> list[object] | None:
    """Objects written one after another (optionally ``;``-separated), or None."""
    decoder = json.JSONDecoder()
    out, at = [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return out
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        out.append(obj)


def parse_llama3_json(text: str) -> Parsed:
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    objects = _json_objects(body)
    calls = [_call_from(o, "parameters") for o in objects or []]
    if not calls or any(c is None for c in calls):
        return Parsed(text, [])
    return Parsed(None, [c for c in calls if c is not None])


def parse_mistral(text: str) -> Parsed:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return Parsed(text, [])
    objects = _json_objects(text[start + len("[TOOL_CALLS]") :])
    flat: list[object] = []
    for o in objects or []:
        flat.extend(o if isinstance(o, list) else [o])
    calls = [_call_from(o, "arguments") for o in flat]
    if not calls or any(c is None for c in calls):
        return Parsed(text, [])
    content = text[:start].strip()
    return Parsed(content or None, [c for c in calls if c is not None])


PARSE: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
# Where a call may begin, in the text a parser reads: content streams until one shows.
MARKERS = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]"}


def detect_parser(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format asks for, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None
