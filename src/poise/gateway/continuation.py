"""Continuing a broken stream of any OpenAI-compatible backend from what the client has seen.

A poise backend notes the token ids of every event, and another poise replica resumes from
exactly there (``stream``). Other engines send text only, so the gateway keeps a ``Transcript``
of each such stream - the text the client has received, about one token an event - and when the
stream breaks, asks another backend for the rest of the same answer:
- completions: the prompt followed by the text sent, ``max_tokens`` less what was sent;
- chat: the conversation with the partial answer as the final assistant message, which the
  engine continues (``continue_final_message`` on vLLM, SGLang and poise; a prefilled final
  assistant message on llama-server). TGI and hosted ``openai`` backends cannot, and are never
  chosen to continue a chat (``continued_body`` is None for them).

The continuation is approximate: the continued text is tokenized afresh, and sampling is not
replayed, so with greedy decoding it is usually, not always, the text an unbroken run gives.
It is marked: the relay sends the comment ``: x-poise-resumed: approximate`` where it switches,
each later event carries ``"poise_resumed": "approximate"`` (the response's headers are long
gone by then), and the gateway counts it. Nothing the client has seen is sent again: the resumed
stream takes the first stream's id and creation time, and its opening role chunk is dropped.

A request that cannot be continued by text (several choices, log probabilities, echo, a
``suffix``, tools or a structured-output constraint, a prompt that is not one string) breaks with
an explicit error event, as does a stream that has sent tool calls or reasoning; one that broke
before anything of the answer was sent is simply sent again.

The transcript also takes the usage the gateway asked for (``stream_options.include_usage``,
added for backends whose kind honours it) so that the rate limits are charged what was used,
and drops the usage chunk again when the client did not ask for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from poise.gateway.backend_kind import Kind, traits

RESUMED_COMMENT = b": x-poise-resumed: approximate\n\n"
# Request fields that tie the answer to something text alone cannot carry on.
_NOT_CONTINUABLE = (
    "tools",
    "functions",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "suffix",
)


def continuable(path: str, data: dict[str, Any]) -> bool:
    """Whether a stream of this request can be continued from its text on another engine."""
    if data.get("n") not in (None, 1) or data.get("logprobs") or data.get("echo"):
        return False
    if data.get("top_logprobs"):
        return False
    for name in _NOT_CONTINUABLE:
        value = data.get(name)
        if value is None or value == []:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        return False
    if path.endswith("chat/completions"):
        return isinstance(data.get("messages"), list)
    prompt = data.get("prompt")
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
    )


@dataclass(slots=True)
class Transcript:
    """What the client has received of a stream that carries no token notes, and its usage."""

    chat: bool
    strip_usage: bool  # the client did not ask for the usage chunk: the gateway did
    # Nothing asked or sent that text cannot carry on (``continuable``; tool calls, reasoning)
    continuable: bool = True
    text: str = ""
    events: int = 0  # events that carried text: about one token each
    # The client has received something of the answer (text, tool calls, reasoning): a
    # continuation can no longer start it afresh.
    sent_any: bool = False
    id: str | None = None
    created: int | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    approximate: bool = False  # it has been continued from its text at least once
    resumed_events: int = 0  # events before the latest approximate continuation
    _drop_role: bool = field(default=False, repr=False)

    def resumed(self) -> None:
        """A continuation begins: its events take this stream's identity."""
        self.approximate = True
        self.resumed_events = self.events
        self._drop_role = self.chat

    def observe(self, event: bytes) -> bytes:
        """The event as the client gets it (rewritten after a continuation; empty: dropped)."""
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = self._usage(usage)
        if choices == [] and usage is not None:
            if self.strip_usage:
                return b""
            if self.approximate:
                chunk["usage"] = self.usage
                return self._stamped(chunk)
            return event
        if self.id is None:
            self.id, self.created, self.model = (
                chunk.get("id"),
                chunk.get("created"),
                chunk.get("model"),
            )
        text = self._text(choices)
        if text:
            self.text += text
            self.events += 1
            self.sent_any = True
        if not self.approximate:
            return event
        if self._drop_role and not text and _role_only(choices):
            return b""
        self._drop_role = False
        return self._stamped(chunk)

    def _text(self, choices: Any) -> str:
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return ""
        choice = choices[0]
        if len(choices) > 1 or choice.get("index", 0) != 0:
            self.continuable = False
        if not self.chat:
            text = choice.get("text")
            return text if isinstance(text, str) else ""
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        if delta.get("tool_calls") or delta.get("function_call") or delta.get("reasoning_content"):
            self.continuable = False
            self.sent_any = True
        content = delta.get("content")
        return content if isinstance(content, str) else ""

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """After a continuation, the answer's usage: what was sent before it counts as output,
        not as prompt (the continuation's prompt held it)."""
        if not self.approximate:
            return usage
        before = self.resumed_events
        out = dict(usage)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            out["prompt_tokens"] = max(0, prompt - before)
            out["completion_tokens"] = completion + before
        return out

    def _stamped(self, chunk: dict[str, Any]) -> bytes:
        if self.id is not None:
            chunk["id"] = self.id
        if self.created is not None:
            chunk["created"] = self.created
        if self.model is not None:
            chunk["model"] = self.model
        chunk["poise_resumed"] = "approximate"
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    def used_tokens(self) -> int | None:
        """Total tokens used, from the usage when the backend sent it."""
        if self.usage is None:
            return None
        total = self.usage.get("total_tokens")
        return total if isinstance(total, int) else None


def _role_only(choices: Any) -> bool:
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return isinstance(delta, dict) and not choices[0].get("finish_reason")


def with_stream_usage(data: dict[str, Any]) -> dict[str, Any]:
    """The request asking for the usage chunk at the end of its stream."""
    options = data.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**data, "stream_options": options}


def asks_usage(data: dict[str, Any]) -> bool:
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def continued_body(
    data: dict[str, Any], path: str, transcript: Transcript, kind: Kind | None
) -> dict[str, Any] | None:
    """The request that continues ``transcript`` on a backend of ``kind``; None when that kind
    cannot continue it."""
    if not transcript.sent_any:
        return data  # nothing of the answer seen yet: the same request, from the start
    if not transcript.continuable or not continuable(path, data):
        return None
    body = dict(data)
    for name in ("max_tokens", "max_completion_tokens"):
        most = body.get(name)
        if isinstance(most, int) and not isinstance(most, bool):
            # Never below one: the continuation must answer something, even if it ends at once.
            body[name] = max(1, most - transcript.events)
    if not transcript.chat:
        prompt = data["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + transcript.text
        return body
    how = traits(kind).chat
    if how == "none":
        return None
    messages = list(data["messages"])
    last = messages[-1] if messages else None
    if data.get("continue_final_message") and isinstance(last, dict):
        # The client was already continuing its own final assistant message: it grows.
        content = last.get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": transcript.text}]
        else:
            content = (content if isinstance(content, str) else "") + transcript.text
        messages[-1] = {**last, "content": content}
    else:
        messages.append({"role": "assistant", "content": transcript.text})
    body["messages"] = messages
    if how == "continue_final_message":
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return body
