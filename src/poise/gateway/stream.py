"""Relaying a committed stream to the client, with mid-stream failover.

Events go to the client whole, so that an error event can always follow cleanly. A poise
backend asked for token notes (``STREAM_TOKENS_HEADER``) puts one before each event: the
event's new token ids and the characters of text sent so far. The relay strips the notes and
keeps the position of what the client has received. Should the stream then break (connection
lost, no data for ``stream_idle_s``, an error event from a dying engine, or an end without
``[DONE]``), the relay asks for the rest on another backend (``resume``, which the proxy
builds): from exactly that position on a poise replica (``poise_resume``), so that the client
sees one uninterrupted stream with the same id and, on deterministic replicas with greedy or
seeded sampling, the same text as a run that never broke (counted ``exact``, else
``position``); from the text the client has seen on any other engine (``continuation``),
marked as approximate. A stream of another engine is read through its ``Transcript`` (the text
sent, the usage) when the pool may continue it. A stream that cannot be continued ends with an
explicit error event and ``[DONE]``. Never a silent truncation, never text twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import httpx

from poise.gateway.continuation import RESUMED_COMMENT, Transcript
from poise.gateway.pool import Backend
from poise.gateway.upstream import Upstream
from poise.protocol import TOKEN_NOTE_PREFIX, APIError, error_body, parse_token_note

log = logging.getLogger("poise.gateway")
MAX_RESUMES = 2  # continuations of one broken stream

DONE_EVENT = b"data: [DONE]\n\n"
_ERROR_EVENT = b'data: {"error"'
# Statuses in a backend's error event that another backend may well not share.
_RESUMABLE_ERRORS = frozenset({500, 502, 503})


@dataclass(slots=True)
class StreamPosition:
    """What the client has received so far, in the backend's own terms."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    id: str | None = None
    created: int | None = None
    noted: bool = False  # the backend sends token notes: it can be resumed exactly
    resumes: int = 0
    failed: str | None = None  # the error event the stream ended with, if it did
    # Its status, when the backend sent it and it ended the answer there (a deadline passing
    # at the backend, say): the stream reached its end, but not an answer.
    failed_status: int | None = None
    # The text sent, for a stream another engine may continue; None: only poise backends.
    transcript: Transcript | None = None
    # How the latest resume continued: "exact" (from the token position, on deterministic
    # replicas of one arithmetic, greedy or seeded: the answer an unbroken run gives),
    # "position" (from the token position, without that guarantee) or "approximate" (from the
    # text, on another engine).
    mode: str = "exact"
    # The numerics fingerprint every backend that produced this stream's tokens shares (their
    # deterministic mode's, ``Backend.numerics``); None: none, or not one.
    numerics: str | None = None

    def can_resume(self) -> bool:
        if self.noted:
            return True
        t = self.transcript
        return t is not None and (t.continuable or not t.sent_any)

    def produced_by(self, backend: Backend | None) -> None:
        """``backend`` produced the tokens up to the break being resumed (the ``resumes``-th)."""
        numerics = backend.numerics if backend is not None else None
        if self.resumes <= 1:  # the first backend: its fingerprint
            self.numerics = numerics
        elif numerics != self.numerics:  # another arithmetic took part: none is shared
            self.numerics = None


def resumed_mode(reproducible: bool, produced: str | None, taker: Backend | None) -> str:
    """How a continuation from the token position counts: "exact" only where it gives the
    bits an unbroken run would have, that is a greedy or seeded request (``reproducible``)
    continued on a deterministic replica of the same arithmetic as every one that produced
    it (``produced``: their shared fingerprint); else "position"."""
    same = taker is not None and taker.numerics is not None and taker.numerics == produced
    return "exact" if reproducible and same else "position"


Resume = Callable[[StreamPosition, Backend | None], Awaitable[Upstream]]


class StreamBrokeError(Exception):
    """The backend's stream ended in a way the client must not see as an ending."""


async def _batches(upstream: Upstream, idle_s: float) -> AsyncIterator[bytes]:
    """Whole events as they arrive: every complete event of a read at once, never a part."""
    assert upstream.chunks is not None
    pending = upstream.first_chunk
    while True:
        cut = pending.rfind(b"\n\n")
        if cut >= 0:
            yield pending[: cut + 2]
            pending = pending[cut + 2 :]
        timer = upstream.outcome.timer if upstream.outcome is not None else None
        if timer is not None:
            timer.read_begun()  # this wait is the backend's; a slow client's is not
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(upstream.chunks, None)
        except TimeoutError:
            raise StreamBrokeError(f"no data from the backend for {idle_s:g}s") from None
        finally:
            if timer is not None:
                timer.read_ended()
        if chunk is None:
            break
        pending += chunk
    if pending.strip():
        yield pending


def _split(batch: bytes) -> list[bytes]:
    events = batch.split(b"\n\n")
    out = [e + b"\n\n" for e in events[:-1]]
    if events[-1]:
        out.append(events[-1])
    return out


def _backend_error(event: bytes) -> tuple[int, str]:
    try:
        body = json.loads(event[6:])
        error = body["error"]
        # poise says the status beside the error; vLLM and SGLang as the error's code
        status = body.get("status_code") or error.get("code")
        status = status if isinstance(status, int) and 400 <= status < 600 else 500
        return status, str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return 500, event[:200].decode(errors="replace")


async def relay(
    upstream: Upstream,
    idle_s: float,
    resume: Resume | None = None,
    max_resumes: int = MAX_RESUMES,
    on_resume: Callable[[bool, str], None] | None = None,
    position: StreamPosition | None = None,
) -> AsyncIterator[bytes]:
    """``position``: pass one to read, once the stream is over, what the client received."""
    position = position if position is not None else StreamPosition()
    transcript = position.transcript
    announce = False  # a continuation by text begins: say so before its first event
    while True:
        current = upstream
        assert current.outcome is not None
        done = ok = registered = False
        try:
            if announce:
                announce = False
                yield RESUMED_COMMENT  # a comment: clients skip it; a reader can see it
            timer = current.outcome.timer
            async for batch in _batches(current, idle_s):
                fast = transcript is None and not position.noted
                # An error event is read whatever the path: it ends the answer.
                if fast and not batch.startswith(TOKEN_NOTE_PREFIX) and _ERROR_EVENT not in batch:
                    if timer is not None:
                        timer.tokens(batch.count(b"data: {"))  # an event a token, about
                    done = done or batch.rstrip().endswith(DONE_EVENT.rstrip())
                    yield batch  # nothing to read of it: passed on as it came, whole events
                    continue
                resumable = resume is not None and position.can_resume()
                if resumable != registered and current.backend and current.response is not None:
                    # Resumable from here: if its backend is found dead, the relay should
                    # not wait for stream_idle_s; closing the response breaks the read now.
                    # One that can no longer be continued (it sent a tool call) runs to its end.
                    if resumable:
                        current.backend.movable[current] = current.response.close
                    else:
                        current.backend.movable.pop(current, None)
                    registered = resumable
                # Read event by event: strip the notes, keep the position, watch for its end.
                # The batch goes out in one piece; only a read from the backend can break it.
                out: list[bytes] = []
                broke: str | None = None
                tokens = 0
                for event in _split(batch):
                    if event.startswith(TOKEN_NOTE_PREFIX):
                        note, _, event = event.partition(b"\n")
                        # After a continuation by text, the notes count another request's
                        # tokens: no exact resume from them.
                        if transcript is None or not transcript.approximate:
                            ids, chars = parse_token_note(note)
                            position.noted = True
                            position.token_ids += ids
                            position.text_chars = chars
                            tokens += len(ids)
                    if event.startswith(_ERROR_EVENT):
                        status, message = _backend_error(event)
                        if status in _RESUMABLE_ERRORS:
                            broke = f"the backend failed mid-stream ({status}): {message}"
                            break
                        # Passed on as the backend's own word; the answer ends there.
                        position.failed = f"the backend ended the stream ({status}): {message}"
                        position.failed_status = status
                        done = True
                    if event == DONE_EVENT:
                        done = True
                    elif event.startswith(b"data: {"):
                        if position.id is None:
                            head = json.loads(event[6:])
                            position.id, position.created = head.get("id"), head.get("created")
                        if transcript is not None:
                            sent = transcript.events
                            event = transcript.observe(event)
                            if not position.noted:
                                tokens += transcript.events - sent
                            if not event:
                                continue  # the usage the gateway asked for, not the client
                    out.append(event)
                if timer is not None:
                    timer.tokens(tokens)
                if out:
                    yield b"".join(out)
                if broke is not None:
                    raise StreamBrokeError(broke)
            if not done:  # an ending the client could take for a complete answer
                raise StreamBrokeError("the backend's stream ended without [DONE]")
            ok = True
            return
        except (aiohttp.ClientError, httpx.TransportError, StreamBrokeError, ValueError) as exc:
            failed = current.backend
            where = failed.url if failed else "the backend"
            log.warning("stream from %s broke after it began: %s", where, exc)
            if position.failed_status is not None:
                # Its backend had already ended the answer with an error: nothing to resume.
                current.outcome.done(*_verdict(position.failed_status))
                yield DONE_EVENT
                return
            resumable = (
                resume is not None and position.can_resume() and position.resumes < max_resumes
            )
            current.outcome.done("error", recovery="resume" if resumable else "none")
            if not resumable:
                position.failed = f"the backend failed mid-stream: {exc}"
                yield _error_event(502, position.failed)
                return
            position.resumes += 1
            try:
                upstream = await resume(position, failed)
            except APIError as err:
                if on_resume is not None:
                    on_resume(False, position.mode)
                position.failed = f"the backend failed mid-stream and could not be resumed: {err}"
                position.failed_status = err.status  # a deadline passing: the request's 504
                yield _error_event(err.status, position.failed)
                return
            if on_resume is not None:
                on_resume(True, position.mode)
            log.info(
                "resumed a stream (%s) on %s after %d events",
                position.mode,
                upstream.backend.url if upstream.backend else "?",
                len(position.token_ids)
                if position.noted
                else transcript.events
                if transcript
                else 0,
            )
            announce = position.mode == "approximate"
        finally:
            if current.backend is not None:
                current.backend.movable.pop(current, None)
            current.close(reusable=ok)
            if ok:
                current.outcome.done(*_verdict(position.failed_status))
            else:
                current.outcome.abandon()  # no-op when already counted as an error


def _verdict(status: int | None) -> tuple[str, str]:
    """A whole stream's verdict on its backend (and what could recover it): the error it ended
    with, if any. A 504 is the request's deadline passing there, a 4xx not a sign of its health:
    neither counts against it."""
    if status is None or status < 500:
        return "ok", "none"
    return ("deadline", "none") if status == 504 else ("error", "none")


async def relay_as_is(
    upstream: Upstream, idle_s: float, position: StreamPosition
) -> AsyncIterator[bytes]:
    """A stream of a route the gateway does not read (``passthrough``): its events passed on as
    they come, whole. Nothing is expected of its ending, and it is never resumed: a break
    (connection lost, no data for ``idle_s``) ends it with an error event, and
    ``position.failed`` says why."""
    assert upstream.outcome is not None
    timer = upstream.outcome.timer
    ok = False
    try:
        async for batch in _batches(upstream, idle_s):
            if timer is not None:
                timer.tokens(batch.count(b"data: "))  # an event a token, about
            yield batch
        ok = True
    except (aiohttp.ClientError, StreamBrokeError) as exc:
        where = upstream.backend.url if upstream.backend else "the backend"
        log.warning("stream from %s broke after it began: %s", where, exc)
        upstream.outcome.done("error", recovery="none")  # never resumed
        position.failed = f"the backend failed mid-stream: {exc}"
        body = error_body(502, position.failed, code="upstream_error")
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
    finally:
        upstream.close(reusable=ok)
        if ok:
            upstream.outcome.done("ok")
        else:
            upstream.outcome.abandon()  # no-op when already counted as an error


def _error_event(status: int, message: str) -> bytes:
    body = error_body(status, message, code="upstream_error")
    return b"data: " + json.dumps(body).encode() + b"\n\n" + DONE_EVENT
