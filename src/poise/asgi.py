"""ASGI pieces the framework does not give us: a body guard (size, type, time to arrive), API-key
auth, a last handler that answers an unexpected error without dropping the connection, an SSE
response that aborts its work the moment the client leaves, and a way to cancel a handler's work
when the client disconnects.

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
from collections.abc import AsyncIterator, Callable, Sequence

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poise.protocol import error_body


class ClientGoneError(Exception):
    """The client disconnected before the response was ready."""


async def _error(
    send: Send,
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    close: bool = False,
) -> None:
    """An error answer in OpenAI's shape; ``close``: and the connection closes after it."""
    body = json.dumps(error_body(status, message, param, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class CancelOnDisconnect:
    """``with CancelOnDisconnect(receive):`` cancels the block when the client disconnects.

    The block then ends in ``ClientGoneError`` (an outer cancellation still wins). One watcher
    task per block, cancelling the request's own task the way ``asyncio.timeout`` does, rather
    than running the work in a task of its own beside the watcher and an ``asyncio.wait``: on the
    gateway's path those extra tasks were a measurable share of the latency it adds.
    """

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False
        self._open = False

    def __enter__(self) -> CancelOnDisconnect:
        task = asyncio.current_task()
        assert task is not None, "CancelOnDisconnect needs a running task"
        self._task = task
        self._open = True
        self._watcher = asyncio.ensure_future(wait_disconnect(self.receive))
        self._watcher.add_done_callback(self._watcher_done)
        return self

    def _watcher_done(self, watcher: asyncio.Future[None]) -> None:
        # Callbacks and task steps never interleave: while the block is open the task is
        # suspended inside it, so the cancellation lands inside the block.
        if self._open and not watcher.cancelled() and watcher.exception() is None:
            self.gone = True
            self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        self._open = False
        self._watcher.cancel()
        if self.gone and self._task.uncancel() == 0:
            raise ClientGoneError from None


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

        # A client that left, or a socket that broke, ends the stream: nobody is reading.
        try:
            with contextlib.suppress(ClientGoneError, OSError), CancelOnDisconnect(receive):
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


RECEIVED_AT = "poise.received_at"  # scope key: when the request reached the app (perf_counter)


# What an API key guards when keys are set (vLLM's /tokenize and /detokenize too).
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/tokenize", "/detokenize")


def is_json_type(content_type: bytes) -> bool:
    """``application/json`` or ``application/*+json``, in UTF-8 if a charset is named."""
    media, *params = content_type.lower().split(b";")
    media = media.strip()
    if media != b"application/json" and not (
        media.startswith(b"application/") and media.endswith(b"+json")
    ):
        return False
    for param in params:
        name, _, value = param.strip().partition(b"=")
        if name == b"charset" and value.strip(b'" ') not in (b"utf-8", b"utf8"):
            return False
    return True


class GuardMiddleware:
    """What a request passes before anything parses it. When keys are set, a call to the API
    (``/v1/``) or the live state (``/debug/``) needs one (else 401). A body has a JSON content
    type or none (else 415), at most ``max_body_bytes`` (else 413), all of it within
    ``body_timeout_s`` of the headers (else 408, and the connection closes: a client that sends
    headers and stalls holds nothing longer than that).

    ``forwarded``: the paths whose bodies are passed on as they came (the gateway's passthrough
    routes): any content type, and the same bounds on the body whatever the method."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        api_keys: Sequence[str],
        body_timeout_s: float = 30.0,
        forwarded: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_keys = [k.encode() for k in api_keys]
        self.body_timeout_s = body_timeout_s
        self.forwarded = forwarded

    def _authorized(self, scope: Scope) -> bool:
        if not self.api_keys or not scope["path"].startswith(PROTECTED_PREFIXES):
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
        forwarded = self.forwarded is not None and self.forwarded(scope["path"])
        if scope["method"] not in ("POST", "PUT", "PATCH") and not forwarded:
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _error(
                    send, 413, f"the request body is larger than {limit} bytes", "body_too_large"
                )
                return
            if name == b"content-type" and not forwarded and not is_json_type(value):
                shown = value.decode("latin-1")[:100]
                await _error(
                    send,
                    415,
                    f"the request body must be JSON (Content-Type: application/json), not {shown}",
                    "unsupported_media_type",
                    param="Content-Type",
                )
                return
        # Read the body up front, bounded in size and time, so no handler ever sees an
        # oversized one or waits on a client that stopped sending.
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await _error(
                            send,
                            413,
                            f"the request body is larger than {limit} bytes",
                            "body_too_large",
                        )
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _error(
                send,
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                "body_timeout",
                close=True,
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ErrorShield:
    """The last word on an exception that no handler took: logged, and answered with a 500 in
    OpenAI's shape on a connection that stays usable.

    Starlette's last handler re-raises once it has answered, and uvicorn then drops the
    connection: a keep-alive client (the gateway's pool) found its next request reset. Once
    the answer has begun there is no status left to send: then the exception goes on, and the
    dropped connection is what tells the client its answer is broken.
    """

    def __init__(self, app: ASGIApp, log: logging.Logger) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            self.log.exception("unhandled error on %s", scope.get("path"))
            await _error(send, 500, f"internal error: {type(exc).__name__}")


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn configured the same way for a replica and a gateway (logging is ours)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,  # observability.logs formats every line, uvicorn's too
        access_log=False,  # poise writes its own line per request, with what matters
        # Nothing here reads the client's address, so X-Forwarded-* need no parsing per request.
        proxy_headers=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=30,
    )
