"""The forwarded routes, served straight from ASGI in front of FastAPI's: which paths they are,
and which handler takes each."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from poise.gateway.passthrough import Passthrough, passes_through
from poise.gateway.proxy import Proxy
from poise.protocol import APIError

log = logging.getLogger("poise.gateway")


PROXIED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def forwarded(path: str) -> bool:
    """A passthrough route: any other route of a backend's (``passthrough``)."""
    return path not in PROXIED_PATHS and passes_through(path)


class ProxiedRoutes:
    """The forwarded routes served straight from ASGI: the two completions routes (``proxy``)
    and every other backend route (``passthrough``); the gateway's own go to FastAPI.

    Written by hand because FastAPI's layers (routing, dependency solving, its exception and
    telemetry middleware) were a measurable share of the latency the gateway adds to every
    request, and these routes need none of them: the body is forwarded as it came.
    """

    def __init__(self, app: ASGIApp, handler: Proxy, passthrough: Passthrough) -> None:
        self.app = app
        self.handler = handler
        self.passthrough = passthrough

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path in PROXIED_PATHS or passes_through(path)):
            await self.app(scope, receive, send)
            return
        if path in PROXIED_PATHS and scope["method"] != "POST":  # not the backend's to judge
            err = APIError(405, "Method Not Allowed", headers={"Allow": "POST"})
            response = JSONResponse(err.body(), status_code=405, headers=err.headers)
            await response(scope, receive, send)
            return
        try:
            if path in PROXIED_PATHS:
                response = await self.handler(Request(scope, receive), path)
            else:
                response = await self.passthrough(Request(scope, receive))
        except Exception as exc:
            log.exception("unhandled error on %s", path)
            err = APIError(500, f"internal error: {type(exc).__name__}")
            response = JSONResponse(err.body(), status_code=500)
        await response(scope, receive, send)
