"""One streamed request against any OpenAI-compatible endpoint, timed as the client sees it.

TTFT is taken at the first event that carries text, not at the response headers (a server may
send those early); each later text event adds an inter-token gap. Output tokens come from the
usage the server reports (``stream_options.include_usage``); a server that does not report it
gets the number of text events instead, which is the token count for servers that send one
token per event. A stream that ends without ``[DONE]``, or with an error event, is a failure.
"""

from __future__ import annotations

import json
import time

import aiohttp

from poise.bench.report import Record
from poise.bench.workload import Item


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


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    t0: float,
) -> Record:
    """Send now; ``t0`` is the run's start (perf_counter), the record's times are from it."""
    start = time.perf_counter()
    record = Record(sent_at=start - t0, status=0)
    last: float | None = None
    events = 0
    done = False
    try:
        async with session.post(url, json=body, headers=headers) as r:
            record.status = r.status
            if r.status != 200:
                record.error = (await r.text())[:300]
                return record
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
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.e2e_s = time.perf_counter() - start
    if record.output_tokens is None:
        record.output_tokens = events
    if not done and record.error is None:
        record.error = "the stream ended without [DONE]"
    return record


def _has_text(event: dict[str, object]) -> bool:
    for choice in event.get("choices") or []:  # type: ignore[union-attr]
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False
