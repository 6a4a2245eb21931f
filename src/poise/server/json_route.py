"""FastAPI routes whose JSON body is read by ``protocol_body``'s rules, not Starlette's.

FastAPI reads a body with ``json.loads`` on the raw bytes, which lets through what breaks later
(lone surrogates, UTF-16, ``NaN``, nesting to the recursion limit), and turns anything else it
cannot read into "There was an error parsing the body". Here the body is read first, strictly,
and a refusal says what is wrong; FastAPI then validates the value already read.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from poise.protocol_body import read_json_body


class _ReadRequest(Request):
    """A request whose body's JSON value was read already."""

    value: Any = None

    async def json(self) -> Any:
        return self.value


class StrictJsonRoute(APIRoute):
    """A route that reads its body with ``read_json_body`` (an ``APIError`` 400 when it fails).

    The content type was checked by ``GuardMiddleware`` (JSON, or none), so the app runs with
    ``strict_content_type=False`` and a body without one is read as JSON too, as the gateway
    reads it.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle

        async def read_then_handle(request: Request) -> Response:
            read = _ReadRequest(request.scope, request.receive)
            body = await read.body()
            if body:
                read.value = read_json_body(body)
            return await handle(read)

        return read_then_handle
