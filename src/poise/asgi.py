"""ASGI pieces the framework does not give us: a body-size guard, API-key auth, an SSE response
that aborts its work the moment the client leaves, and a way to run a handler until either it
finishes or the client disconnects.

Starlette's ``StreamingResponse`` notices a disconnect only when a write fails, which for a
request still queued behind others can be minutes; the engine would keep its blocks that long.
Here a listener on ``receive`` cancels the work as soon as ``http.disconnect`` arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poise.protocol import error_body

T = TypeVar("T")


class ClientGoneError(Exception):
    """The client disconnected before the response was ready."""


async def _error(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client leaves first, cancel it and raise ``ClientGoneError``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGoneError


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        # No body attribute: Starlette would announce a content-length of 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def pump() -> None:
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.events.aclose()  # type: ignore[attr-defined]

        task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                await task


RECEIVED_AT = "poise.received_at"  # scope key: when the request reached the app (perf_counter)


class GuardMiddleware:
    """Refuses bodies over the limit with 413 and, when keys are set, /v1 calls without one."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_keys: Sequence[str]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_keys = [k.encode() for k in api_keys]

    def _authorized(self, scope: Scope) -> bool:
        if not self.api_keys or not scope["path"].startswith("/v1/"):
            return True
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
                return any(hmac.compare_digest(given, key) for key in self.api_keys)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_AT] = time.perf_counter()
        if not self._authorized(scope):
            await _error(
                send,
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                "invalid_api_key",
            )
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _error(
                    send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
                )
                return
        # Read the body up front, bounded, so no handler ever sees an oversized one.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _error(
                    send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str) -> uvicorn.Config:
    """Logging set up and uvicorn configured the same way for a replica and a gateway."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A line per health check and per forwarded request is noise, not news.
    quiet = max(logging.WARNING, logging.getLevelName(log_level.upper()))
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(quiet)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        # Nothing here reads the client's address, so X-Forwarded-* need no parsing per request.
        proxy_headers=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=30,
    )
