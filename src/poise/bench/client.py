"""One streamed request against any OpenAI-compatible endpoint, timed as the client sees it.

TTFT is taken at the first event that carries text, not at the response headers (a server may
send those early); each later text event adds an inter-token gap. Output tokens come from the
usage the server reports (``stream_options.include_usage``); a server that does not report it
gets the number of text events instead, which is the token count for servers that send one
token per event. A stream that ends without ``[DONE]``, or with an error event, is a failure,
and each failure names its kind: an explicit error (a status, an error event) is told apart
from a connection that broke or a stream cut short, which a client cannot tell from a loss.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from poise.bench.report import Record
from poise.bench.workload import Item
from poise.protocol import ATTEMPT_COUNT_HEADER


def request_body(model: str, item: Item, chat: bool, ignore_eos: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": item.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and poise's extension: exactly max_tokens
    return body


@dataclass(frozen=True, slots=True)
class SendOptions:
    """How one request behaves beyond the body: its time limit, resends, walking away.

    ``retry_connect``: resend while the connection fails before any answer (refused, reset
    before the status line) until the time limit, with a doubling backoff, as the OpenAI SDK
    does for connection errors. Each resend counts in ``Record.connect_retries``; one after
    a connection the server had accepted and then broke (it may have begun the work: a
    client cannot tell) counts in ``Record.drop_resends`` too, apart from one after a refused
    connection (nothing was sent). ``abandon_after_s``: close the connection at that time, as
    a client that gave up would (chaos's disconnect storm).
    """

    timeout_s: float = 600.0
    retry_connect: bool = False
    abandon_after_s: float | None = None


DEFAULT_OPTIONS = SendOptions()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` for a key, nothing without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client_session() -> aiohttp.ClientSession:
    """A session without a pool limit or a timeout of its own: ``send`` times each request."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
    )


_RETRY_BASE_S = 0.1
_RETRY_CAP_S = 1.0


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    t0: float,
    options: SendOptions = DEFAULT_OPTIONS,
) -> Record:
    """Send now; ``t0`` is the run's start (perf_counter), the record's times are from it."""
    start = time.perf_counter()
    record = Record(sent_at=start - t0, status=0)
    abandoning = options.abandon_after_s is not None and options.abandon_after_s < options.timeout_s
    limit = options.abandon_after_s if abandoning else options.timeout_s
    try:
        async with asyncio.timeout(limit):
            await _exchange(session, url, body, headers, record, start, options)
    except TimeoutError:
        if abandoning:
            record.abandoned = True
            record.failure, record.error = None, "abandoned by the client"
        elif record.status == 0 and record.failure in ("refused", "dropped"):
            pass  # resent until the time ran out: it failed as the last try did
        else:
            record.failure = "timeout"
            record.error = f"no whole answer within {options.timeout_s:g}s"
    return record


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    record: Record,
    start: float,
    options: SendOptions,
) -> None:
    backoff = _RETRY_BASE_S
    while True:
        try:
            await _once(session, url, body, headers, record, start)
            return
        except aiohttp.ClientConnectionError as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError)
            record.failure = "refused" if refused and record.status == 0 else "dropped"
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            if options.retry_connect and record.status == 0:
                # No answer began: nothing was received, so sending again duplicates nothing
                # the client saw. The time limit around this loop bounds the resends.
                await asyncio.sleep(backoff)
                backoff = min(_RETRY_CAP_S, 2 * backoff)
                record.connect_retries += 1
                if not refused:
                    record.drop_resends += 1
                record.failure = record.error = None
                continue
            return
        except (aiohttp.ClientError, ValueError) as exc:
            record.failure = "bad_payload"
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            return


async def _once(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    record: Record,
    start: float,
) -> None:
    last: float | None = None
    events = 0
    done = False
    async with session.post(url, json=body, headers=headers) as r:
        record.status = r.status
        attempts = r.headers.get(ATTEMPT_COUNT_HEADER)
        record.attempts = int(attempts) if attempts and attempts.isdigit() else None
        if r.status != 200:
            record.failure = "status"
            record.error = (await r.text())[:300]
            return
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    record.failure = "error_event"
                    record.error = str(event["error"].get("message", event["error"]))[:300]
                    continue
                if event.get("usage"):
                    record.output_tokens = int(event["usage"]["completion_tokens"])
                if _has_text(event):
                    now = time.perf_counter()
                    events += 1
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
    record.e2e_s = time.perf_counter() - start
    if record.output_tokens is None:
        record.output_tokens = events
    if not done and record.error is None:
        record.failure = "truncated"
        record.error = "the stream ended without [DONE]"


def _has_text(event: dict[str, object]) -> bool:
    for choice in event.get("choices") or []:  # type: ignore[union-attr]
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False
