"""The stream relay: token notes stripped, a broken poise stream resumed from exactly where the
client stands, other backends' broken streams ended with an explicit error."""

from __future__ import annotations

import json

import httpx
import pytest

from poise.gateway.config import BackendSettings
from poise.gateway.continuation import RESUMED_COMMENT, Transcript
from poise.gateway.pool import Backend
from poise.gateway.stream import StreamPosition, relay, resumed_mode
from poise.gateway.upstream import Upstream
from poise.protocol import APIError, token_note
from poise.resilience.breaker import BreakerConfig, CircuitBreaker


class FakeOutcome:
    def __init__(self) -> None:
        self.result: str | None = None
        self.recovery: str | None = None  # what the gateway does about a failure
        self.timer = None

    def done(self, outcome: str, recovery: str = "retry") -> None:
        if self.result is None:
            self.result, self.recovery = outcome, recovery

    def abandon(self) -> None:
        self.result = self.result or "abandoned"


def event(text: str, rid: str = "cmpl-1", finish: str | None = None) -> bytes:
    body = {
        "id": rid,
        "created": 7,
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def upstream(parts: list[bytes], fail_with: Exception | None = None) -> Upstream:
    async def chunks():
        for p in parts[1:]:
            yield p
        if fail_with is not None:
            raise fail_with

    return Upstream(200, {}, None, parts[0], chunks(), None, None, FakeOutcome())  # type: ignore[arg-type]


async def collect(stream) -> bytes:
    return b"".join([c async for c in stream])


def texts(raw: bytes) -> list[str]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {") and b'"choices"' in line:
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return out


async def test_notes_are_stripped_and_a_whole_stream_passes():
    parts = [
        token_note([5, 6], 3) + event("abc"),
        token_note([7], 5) + event("de", finish="length"),
        b"data: [DONE]\n\n",
    ]
    up = upstream(parts)
    raw = await collect(relay(up, 5.0))
    assert b"poise-tokens" not in raw
    assert texts(raw) == ["abc", "de"] and raw.endswith(b"data: [DONE]\n\n")
    assert up.outcome.result == "ok"


async def test_a_broken_noted_stream_resumes_from_what_the_client_has():
    # The break comes with half an event buffered: that event never reached the client.
    first = upstream(
        [token_note([5, 6], 3) + event("abc"), token_note([7], 5) + b'data: {"id"'],
        httpx.RemoteProtocolError("peer closed"),
    )
    seen: list[tuple[list[int], int, str | None]] = []

    async def resume(position: StreamPosition, failed) -> Upstream:
        seen.append((list(position.token_ids), position.text_chars, position.id))
        return upstream(
            [
                token_note([7], 5) + event("de"),
                token_note([8], 6) + event("f", finish="length"),
                b"data: [DONE]\n\n",
            ]
        )

    resumed: list[bool] = []
    position = StreamPosition()
    raw = await collect(
        relay(first, 5.0, resume, on_resume=lambda ok, _: resumed.append(ok), position=position)
    )
    assert seen == [([5, 6], 3, "cmpl-1")]
    # What the client got in all, for the token limits: across both backends.
    assert position.token_ids == [5, 6, 7, 8] and position.text_chars == 6
    assert texts(raw) == ["abc", "de", "f"] and raw.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in raw and resumed == [True]
    # Formula 2 counts the break as a failure a resume recovers, not a retry.
    assert (first.outcome.result, first.outcome.recovery) == ("error", "resume")


async def test_an_error_event_from_a_dying_engine_is_resumed_too():
    dying = b'data: {"error":{"message":"engine core exited","code":"unhealthy"},"status_code":503}'
    first = upstream([token_note([1], 1) + event("a"), dying + b"\n\n" + b"data: [DONE]\n\n"])

    async def resume(position, failed):
        assert position.token_ids == [1]
        return upstream([token_note([2], 2) + event("b", finish="length"), b"data: [DONE]\n\n"])

    raw = await collect(relay(first, 5.0, resume))
    assert texts(raw) == ["a", "b"] and b"engine core exited" not in raw


async def test_an_end_without_done_is_a_break_not_an_ending():
    first = upstream([token_note([1], 1) + event("a")])  # clean EOF, no [DONE]
    calls = []

    async def resume(position, failed):
        calls.append(position.token_ids)
        raise APIError(503, "no healthy backend")

    raw = await collect(relay(first, 5.0, resume))
    assert calls == [[1]]
    tail = raw.split(b"\n\n")
    assert b'"error"' in tail[-3] and b"could not be resumed" in tail[-3]
    assert raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("resume_given", [False, True])
async def test_a_stream_without_notes_ends_with_an_explicit_error(resume_given):
    up = upstream([event("abc")], httpx.ReadError("reset"))

    async def resume(position, failed):  # pragma: no cover - must not be called
        raise AssertionError("a backend without notes cannot be resumed")

    raw = await collect(relay(up, 5.0, resume if resume_given else None))
    assert texts(raw) == ["abc"]
    assert b"failed mid-stream" in raw and raw.endswith(b"data: [DONE]\n\n")
    assert (up.outcome.result, up.outcome.recovery) == ("error", "none")  # nothing recovers it


async def test_a_stalled_stream_is_a_break():
    async def stalled():
        import asyncio

        await asyncio.sleep(10)
        yield b""

    up = Upstream(
        200, {}, None, token_note([1], 1) + event("a"), stalled(), None, None, FakeOutcome()
    )  # type: ignore[arg-type]

    async def resume(position, failed):
        return upstream([token_note([2], 2) + event("b"), b"data: [DONE]\n\n"])

    raw = await collect(relay(up, 0.05, resume))
    assert texts(raw) == ["a", "b"]


async def test_the_relay_times_the_backend_by_its_tokens():
    from poise.resilience.latency import LatencyConfig, LatencyTracker

    now = [0.0]
    tracker = LatencyTracker(LatencyConfig(), lambda: now[0], ["http://b"])
    parts = [
        token_note([5], 1) + event("a"),
        token_note([6, 7], 3) + event("bc"),
        token_note([8], 4) + event("d", finish="length"),
        b"data: [DONE]\n\n",
    ]

    async def chunks():
        for p in parts[1:]:
            now[0] += 0.1  # each read 100 ms after the one before
            yield p

    up = Upstream(200, {}, None, parts[0], chunks(), None, None, FakeOutcome())  # type: ignore[arg-type]
    now[0] = 0.4  # the first token came 400 ms after the attempt began
    up.outcome.timer = tracker.stream("http://b")
    up.outcome.timer.started = 0.0
    await collect(relay(up, 5.0))
    assert tracker.ttft("http://b") == pytest.approx(0.4)
    # Peak EWMA of 50 ms (two tokens in one read) then 100 ms per token: the peak holds.
    assert tracker.tpot("http://b") == pytest.approx(0.1)
    assert tracker.tpot_samples("http://b") == 2


def chat(content: str | None = None, rid: str = "c1", role: bool = False, **delta) -> bytes:
    d = {**({"role": "assistant"} if role else {}), **delta}
    if content is not None:
        d["content"] = content
    body = {"id": rid, "created": 7, "model": "m", "choices": [{"index": 0, "delta": d}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def contents(raw: bytes) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {") and b'"choices"' in line
    ]


async def test_a_stream_without_notes_continues_from_the_text_sent():
    """Another engine's chat stream: continued as one stream, the comment where it switched,
    no second role chunk, the first stream's id, the usage the gateway asked for dropped."""
    transcript = Transcript(chat=True, strip_usage=True)
    first = upstream(
        [chat("", role=True) + chat("Hel"), chat("lo")], httpx.RemoteProtocolError("peer closed")
    )
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    seen = []

    async def resume(position: StreamPosition, failed) -> Upstream:
        seen.append(position.transcript.text)
        position.mode = "approximate"  # what the proxy's resume decides by the backend it got
        position.transcript.resumed()
        return upstream(
            [
                chat("", rid="c2", role=True) + chat(" there", rid="c2"),
                chat("!", rid="c2", finish_reason=None),
                b'data: {"id": "c2", "choices": [], "usage": ' + json.dumps(usage).encode()
                + b"}\n\n" + b"data: [DONE]\n\n",
            ]
        )  # fmt: skip

    results: list[tuple[bool, str]] = []
    position = StreamPosition(transcript=transcript)
    raw = await collect(
        relay(first, 5.0, resume, on_resume=lambda *r: results.append(r), position=position)
    )
    assert seen == ["Hello"] and results == [(True, "approximate")]
    chunks = contents(raw)
    assert [c["id"] for c in chunks] == ["c1"] * len(chunks)
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello there!"
    before, after = raw.split(RESUMED_COMMENT)
    assert b'"Hel"' in before and b'"lo"' in before and b'" there"' in after
    assert [c.get("poise_resumed") for c in contents(after)] == ["approximate"] * 2
    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")
    # Its usage counts the two events sent before the break as output.
    assert transcript.usage == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


async def test_a_stream_that_sent_a_tool_call_is_not_sent_again():
    """The call's arguments cannot be continued by text, and sending the request again would
    give the client the call twice: an explicit error instead."""
    call = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]}
    first = upstream([chat(None, role=True) + chat(None, **call)], httpx.ReadError("reset"))

    async def resume(position, failed):  # pragma: no cover - must not be called
        raise AssertionError("a tool call cannot be continued")

    position = StreamPosition(transcript=Transcript(chat=True, strip_usage=True))
    raw = await collect(relay(first, 5.0, resume, position=position))
    assert b"failed mid-stream" in raw and raw.endswith(b"data: [DONE]\n\n")


async def test_a_stream_that_broke_before_any_answer_is_asked_again():
    first = upstream([chat("", role=True)], httpx.ReadError("reset"))
    calls = []

    async def resume(position, failed):
        calls.append(position.transcript.sent_any)
        position.mode = "approximate"
        position.transcript.resumed()
        return upstream([chat("", rid="c2", role=True) + chat("hi", rid="c2"), b"data: [DONE]\n\n"])

    position = StreamPosition(transcript=Transcript(chat=True, strip_usage=True))
    raw = await collect(relay(first, 5.0, resume, position=position))
    assert calls == [False]
    chunks = contents(raw)
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "hi"]


def test_a_resume_counts_as_exact_only_between_replicas_of_one_arithmetic():
    """Greedy or seeded, every producer and the taker deterministic with one fingerprint:
    exact. Anything else continues from the token position without that claim."""

    def replica(numerics: str | None) -> Backend:
        breaker = CircuitBreaker(BreakerConfig(), lambda: 0.0)
        b = Backend("m", BackendSettings.model_validate({"url": "http://r"}), breaker)
        b.numerics = numerics
        return b

    a, a2, other, plain = replica("f1"), replica("f1"), replica("f2"), replica(None)
    position = StreamPosition()
    position.resumes = 1
    position.produced_by(a)
    assert resumed_mode(True, position.numerics, a2) == "exact"
    assert resumed_mode(False, position.numerics, a2) == "position"  # an unseeded draw
    assert resumed_mode(True, position.numerics, other) == "position"  # another build
    assert resumed_mode(True, position.numerics, plain) == "position"
    assert resumed_mode(True, position.numerics, None) == "position"
    position.resumes = 2
    position.produced_by(a2)  # the taker broke in turn: the same arithmetic throughout
    assert resumed_mode(True, position.numerics, a) == "exact"
    position.resumes = 3
    position.produced_by(other)  # a producer of another arithmetic: never exact again
    assert resumed_mode(True, position.numerics, a) == "position"
    fresh = StreamPosition()
    fresh.resumes = 1
    fresh.produced_by(None)  # the first producer is not known
    assert resumed_mode(True, fresh.numerics, a) == "position"
    fresh.resumes = 1
    fresh.produced_by(plain)  # not deterministic
    assert resumed_mode(True, fresh.numerics, plain) == "position"


async def test_a_stream_the_backend_ends_with_its_own_error_is_not_an_answer():
    # A poise replica whose deadline header ran out ends the stream with a 504 event: the client
    # gets no answer; the request ran out of time, which is not its backend's failure.
    timed_out = (
        b'data: {"error":{"message":"the request\'s deadline passed before it completed",'
        b'"code":"timeout"},"status_code":504}'
    )
    up = upstream([token_note([1], 1) + event("a"), timed_out + b"\n\n" + b"data: [DONE]\n\n"])

    async def resume(position, failed):  # pragma: no cover - must not be called
        raise AssertionError("a deadline that passed is not resumed")

    position = StreamPosition()
    raw = await collect(relay(up, 5.0, resume, position=position))
    assert b"deadline passed" in raw and raw.endswith(b"data: [DONE]\n\n")
    assert position.failed_status == 504 and "deadline passed" in (position.failed or "")
    assert up.outcome.result == "deadline"


async def test_an_error_ended_stream_is_read_on_the_fast_path_and_never_resumed():
    # No notes, no transcript: the relay passes batches on unread, but not an error event.
    ended = b'data: {"error":{"message":"bad grammar state","code":400},"status_code":400}'
    up = upstream([event("abc"), ended + b"\n\n"], httpx.ReadError("reset"))  # then it drops

    async def resume(position, failed):  # pragma: no cover - must not be called
        raise AssertionError("an answer its backend ended is not resumed")

    position = StreamPosition()
    raw = await collect(relay(up, 5.0, resume, position=position))
    assert texts(raw) == ["abc"] and b"bad grammar state" in raw
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"error"') == 1
    assert position.failed_status == 400 and up.outcome.result == "ok"  # not its health
