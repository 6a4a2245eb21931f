"""What the engine's outputs become on the wire: a whole OpenAI answer, or its SSE stream.

Streaming responses wait for the first output before sending headers, so anything that fails
before a token exists (admission, deadline, a failed step) still gets its proper HTTP status;
after the first byte a failure becomes an SSE error event followed by ``data: [DONE]``. A chat
answer under a tool plan is shaped by ``tool_calls``; a stream for the gateway carries a token
note before each event (``STREAM_TOKENS_HEADER``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from poise.engine.outputs import RequestOutput
from poise.protocol import APIError, token_note
from poise.server.replica import Prepared, Replica
from poise.server.tool_calls import ToolPlan, ToolStream, shape_message

DONE = b"data: [DONE]\n\n"


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Call:
    """One HTTP request in flight: its engine requests, ``n`` per prompt, in choice order."""

    replica: Replica
    group: list[Prepared]
    n: int
    chat: bool
    response_id: str
    created: int
    model: str
    notes: bool = False  # a token note before each event (for the gateway's failover)
    sent_chars: int = 0  # resumed: characters the client already has
    resumed: bool = False
    tools: ToolPlan | None = None  # chat with tools: answers shaped as tool calls

    def with_specials(self, token_ids: list[int]) -> str:
        """The text a tool-call parser reads: special tokens kept (markers), the end dropped."""
        eos = self.replica.engine.intake.limits.eos_token_ids
        kept = [t for t in token_ids if t not in eos]
        return self.replica.engine.tokenizer.decode(kept, skip_special_tokens=False)

    def tool_stream(self, index: int) -> ToolStream | None:
        if self.tools is None:
            return None
        # A marker that is a special token is dropped from the streamed text: seen by its id.
        words = {"mistral": "[TOOL_CALLS]", "hermes": "<tool_call>"}.get(self.tools.parser or "")
        marker = None if words is None else self.replica.engine.tokenizer.token_to_id(words)
        stream = ToolStream(self.tools, self.response_id, index, marker)
        if self.resumed:  # what the client has: the same state as the stream it continues
            request = self.group[index].request
            prior = self.replica.engine.tokenizer.decode(request.output_token_ids)
            stream.feed(prior[: self.sent_chars], request.output_token_ids)
        return stream

    @property
    def prompt_tokens(self) -> int:
        return sum(p.request.num_prompt_tokens for p in self.group[:: self.n])

    def token_text(self, token_id: int) -> str:
        return self.replica.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, entries: list[dict[int, float]], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for entry in entries:
            chosen, lp = next(iter(entry.items()))
            text = self.token_text(chosen)
            tokens.append(text)
            token_lps.append(lp)
            tops.append({self.token_text(t): v for t, v in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: list[dict[int, float]], top: int) -> dict[str, Any]:
        content = []
        for entry in entries:
            items = list(entry.items())
            chosen, lp = items[0]
            text = self.token_text(chosen)
            alts = sorted(items, key=lambda kv: -kv[1])[:top]
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (s := self.token_text(t)),
                            "logprob": v,
                            "bytes": list(s.encode()),
                        }
                        for t, v in alts
                    ],
                }
            )
        return {"content": content}


def _choice_body(
    call: Call, index: int, out: RequestOutput, top: int | None, echo: str
) -> dict[str, Any]:
    c = out.outputs[0]
    if call.chat:
        message: dict[str, Any] = {"role": "assistant", "content": echo + c.text}
        reason = c.finish_reason
        if call.tools is not None:
            message, reason = shape_message(
                call.tools, call.response_id, index, c.text, call.with_specials(c.token_ids), reason
            )
        return {
            "index": index,
            "message": message,
            "logprobs": call.chat_logprobs(c.logprobs, top or 0)
            if c.logprobs is not None
            else None,
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
        }
    return {
        "index": index,
        "text": echo + c.text,
        "logprobs": call.completion_logprobs(c.logprobs, len(echo))
        if c.logprobs is not None
        else None,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }


async def collect(call: Call, top: int | None, echo: list[str]) -> dict[str, Any]:
    last: dict[int, RequestOutput] = {}
    async with aclosing(call.replica.run(call.group)) as outputs:
        async for i, out in outputs:
            last[i] = out
    choices = [
        _choice_body(call, i, last[i], top, echo[i // call.n] if echo else "")
        for i in range(len(call.group))
    ]
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in last.values())
    return {
        "id": call.response_id,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": call.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": call.prompt_tokens + completion_tokens,
        },
    }


async def stream_events(call: Call, top: int | None, include_usage: bool) -> AsyncIterator[bytes]:
    """Headers go out only after the first output, so early failures keep their status."""
    outputs = call.replica.run(call.group)
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        await outputs.aclose()
        raise APIError(500, "the engine returned no output", code="engine_error") from None
    except BaseException:
        await outputs.aclose()
        raise
    return _events(call, outputs, first, top, include_usage)


async def _events(
    call: Call,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
    top: int | None,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    head = {"id": call.response_id, "object": obj, "created": call.created, "model": call.model}
    usage_field = {"usage": None} if include_usage else {}
    sent_logprobs = [0] * len(call.group)
    completion_tokens = [0] * len(call.group)
    sent_chars = call.sent_chars
    tool_streams = [call.tool_stream(i) for i in range(len(call.group))] if call.chat else []

    def chunk(i: int, out: RequestOutput) -> bytes:
        c = out.outputs[0]
        completion_tokens[i] = len(c.token_ids)
        lp = None
        if c.logprobs is not None:
            entries = c.logprobs[sent_logprobs[i] :]
            sent_logprobs[i] = len(c.logprobs)
            lp = (
                call.chat_logprobs(entries, top or 0)
                if call.chat
                else call.completion_logprobs(entries, 0)
            )
        reason = c.finish_reason if out.finished else None
        tools = tool_streams[i] if tool_streams else None
        if tools is not None:
            deltas = tools.feed(c.delta_text, c.delta_token_ids)
            if out.finished:
                more, reason = tools.finish(call.with_specials(c.token_ids), reason)
                deltas += more
            event = b"".join(
                sse({**head, "choices": [_chunk_choice(i, d, None, None)], **usage_field})
                for d in deltas[:-1]
            )
            last = _chunk_choice(i, deltas[-1] if deltas else {}, lp, reason)
            if out.finished:
                last["stop_reason"] = c.stop_reason
            event += sse({**head, "choices": [last], **usage_field})
        else:
            if call.chat:
                delta = {"content": c.delta_text} if c.delta_text or not out.finished else {}
                choice = _chunk_choice(i, delta, lp, reason)
            else:
                choice = {"index": i, "text": c.delta_text, "logprobs": lp, "finish_reason": reason}
            if out.finished:
                choice["stop_reason"] = c.stop_reason
            event = sse({**head, "choices": [choice], **usage_field})
        if not call.notes:
            return event
        nonlocal sent_chars
        sent_chars += len(c.delta_text)
        return token_note(c.delta_token_ids, sent_chars) + event

    try:
        if call.chat and not call.resumed:
            for i in range(len(call.group)):
                role = {"role": "assistant", "content": ""}
                if call.notes:
                    yield token_note([], sent_chars)
                yield sse(
                    {
                        **head,
                        "choices": [
                            {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                        ],
                        **usage_field,
                    }
                )
        yield chunk(*first)
        async for i, out in outputs:
            yield chunk(i, out)
        if include_usage:
            total = sum(completion_tokens)
            usage = {
                "prompt_tokens": call.prompt_tokens,
                "completion_tokens": total,
                "total_tokens": call.prompt_tokens + total,
            }
            yield sse({**head, "choices": [], "usage": usage})
    except APIError as exc:  # after the first byte: say so in the stream, never just stop
        yield sse(exc.body() | {"status_code": exc.status})
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield DONE


def _chunk_choice(
    index: int, delta: dict[str, Any], logprobs: Any, reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
