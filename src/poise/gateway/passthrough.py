"""Every other route a backend serves, forwarded as it came: ``/v1/*`` except the completions
routes (``proxy``) and ``/v1/models`` (the gateway's own), and vLLM's ``/tokenize`` and
``/detokenize`` at the root. Embeddings, the Responses API, audio, files: whatever the backend
answers, in any method.

The body goes byte for byte with the client's Content-Type (JSON, multipart, anything), under the
same body-size limit, keys, rate limits, admission queue and deadline as the completions routes.
A JSON body is read (strictly, as on the completions routes) only for its ``model``, ``stream``
and ``priority``; it is rewritten only to hold ``priority`` to the key's floor or to rename the
model for a backend that serves it under another name.

Which pool: the model the body names (a JSON body's string ``model``, or a multipart body's
text field ``model``; an unknown one is the completions routes' 404). A body that names none (no
body, another type, no such field) goes to the gateway's default model: the first one its
configuration lists (the only one, usually). No fallback to another model: another model's
embeddings or tokens are not the same answer.

Retries go to another backend only for a call that may be repeated (``IDEMPOTENT``: GET, HEAD,
OPTIONS, and the POST routes that compute without keeping anything). Any other call is sent
again only when no connection to its backend could be made; otherwise the backend's answer is
the client's as it is (a 5xx, a 429 included), and a failure after sending is a 502. A backend's
status and body pass back untouched; an event stream is relayed as it comes, never buffered.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace

from poise.asgi import CancelOnDisconnect, EventStreamResponse
from poise.gateway.forward import Attempt, Call, first_token_due, objective_headers
from poise.gateway.handling import (
    REQUEST_ID_HEADER,
    Charged,
    Gateway,
    admit,
    answered,
    charge,
    finish,
    handled,
    held_priority,
    require_model,
)
from poise.gateway.record import RequestRecord
from poise.gateway.request_body import body_model
from poise.gateway.stream import StreamPosition, relay_as_is
from poise.gateway.upstream import Upstream
from poise.observability import tracing as tr
from poise.protocol import ATTEMPT_COUNT_HEADER, DEADLINE_HEADER

Passthrough = Callable[[Request], Awaitable[Response]]

ROOT_ROUTES = frozenset({"/tokenize", "/detokenize"})  # vLLM serves these outside /v1
OWN_ROUTES = frozenset({"/v1/models"})  # answered by the gateway itself
# Calls that change nothing where they run, so another backend may be asked again.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
IDEMPOTENT_POSTS = frozenset(
    {"/tokenize", "/detokenize", "/v1/embeddings", "/v1/rerank", "/v1/score"}
)
# Not the client's to send on: the connection's own, the gateway's key (a backend has its own,
# set per backend), what the gateway sets itself, and poise's internal headers.
_DROPPED = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-connection",
        "authorization",
        "accept-encoding",  # the relay reads events: the backend answers uncompressed
        "x-priority",
        REQUEST_ID_HEADER,
        DEADLINE_HEADER,
    }
)
_MAX_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def passes_through(path: str) -> bool:
    """A path forwarded by this module, unless a route of its own (completions) takes it first.

    ``path`` is the decoded one. A path with an empty, ``.`` or ``..`` segment (``%2e%2e``
    decodes to one) is no route: the URL the backend is sent would resolve it, and
    ``/v1/../admin/faults`` would reach the replica's own routes with the gateway's key."""
    segments = path.split("/")[1:]
    if any(part in ("", ".", "..") for part in segments):
        return False
    return (path.startswith("/v1/") and path not in OWN_ROUTES) or path in ROOT_ROUTES


def idempotent(method: str, path: str) -> bool:
    return method in IDEMPOTENT_METHODS or (method == "POST" and path in IDEMPOTENT_POSTS)


def make_passthrough(gw: Gateway) -> Passthrough:
    """The handler of the passthrough routes, bound to one gateway."""

    async def passthrough(request: Request) -> Response:
        path = request.url.path
        return await handled(
            gw, request, path, lambda record, span: _handle(gw, request, path, record, span)
        )

    return passthrough


async def _handle(
    gw: Gateway, request: Request, path: str, record: RequestRecord, span: trace.Span | None
) -> Response:
    assert gw.forwarder is not None
    key = gw.authenticate(request)
    record.key = key.name if key else None
    raw = await request.body()
    named, data = body_model(raw, request.headers.get("content-type"))
    model = record.model = next(iter(gw.pools)) if named is None else named
    require_model(gw, model)
    gw.autoscaling.arrived(model)
    deadline = gw.deadline(request)
    objective = objective_headers(request.headers, gw.clock())
    record.first_token_by = first_token_due(objective)
    charged = await charge(gw, key, model, _estimate(raw, data))
    priority, held = held_priority(key, data)
    if held is not None:
        data, raw = held, json.dumps(held).encode()
    record.priority = priority
    headers = _passed_headers(request.headers)
    headers.update(objective)
    headers[REQUEST_ID_HEADER] = record.request_id
    headers["x-priority"] = str(priority)
    if span is not None:
        tr.set_attributes(span, {tr.REQUEST_MODEL: model})
    stream = record.stream = data is not None and data.get("stream") is True
    method = request.method
    call = Call(
        method,
        idempotent=idempotent(method, path),
        rename=named is not None and data is not None,
        stream_by_type=True,
    )
    query = request.url.query
    target = f"{path}?{query}" if query else path
    gate = gw.gates[model]
    journey = Attempt(span=span)
    entered = False

    def ended() -> None:
        gw.budget.request_ended()
        gate.leave(priority)

    try:
        with CancelOnDisconnect(request.receive):
            await admit(gw, model, priority, deadline, record, span)
            entered = True
            gw.budget.request_started()
            upstream = await gw.forwarder.send(
                gw.pools[model], target, raw, headers, deadline, stream, None, journey, call
            )
    except BaseException:
        record.retries = journey.retries
        if entered:
            ended()
        raise
    record.retries = journey.retries
    record.backend = upstream.backend.url if upstream.backend is not None else None
    extra = {**charged.headers, ATTEMPT_COUNT_HEADER: str(journey.retries + 1)}
    if upstream.body is not None:
        ended()
        await answered(gw, record, upstream, charged)
        return Response(upstream.body, upstream.status, {**upstream.headers, **extra})
    return _streamed(gw, upstream, record, span, charged, extra, ended)


def _streamed(
    gw: Gateway,
    upstream: Upstream,
    record: RequestRecord,
    span: trace.Span | None,
    charged: Charged,
    extra: dict[str, str],
    ended: Callable[[], None],
) -> Response:
    """The backend's event stream, relayed; the record is finished when it ends. Its charges
    stay as estimated: a stream the gateway does not read does not say what it used."""

    async def events() -> AsyncIterator[bytes]:
        position = StreamPosition()
        record.status, record.outcome = 200, "ok"
        record.ttft_s = time.perf_counter() - record.arrived
        try:
            async for chunk in relay_as_is(upstream, gw.settings.timeouts.stream_idle_s, position):
                yield chunk
        except BaseException:
            record.outcome = "client_gone"
            raise
        finally:
            ended()
            if position.failed:
                record.outcome, record.error = "upstream_error", position.failed
            record.e2e_s = time.perf_counter() - record.arrived
            finish(gw, record, span)

    response = EventStreamResponse(events())
    response.headers.update({**upstream.headers, **extra})
    return response


def _passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in headers.items()
        if k not in _DROPPED and not k.startswith("x-poise-")  # lower case, as ASGI gives them
    }


def _estimate(raw: bytes, data: dict[str, Any] | None) -> float:
    """Tokens to charge before the answer: a JSON body's length (about four bytes a token)
    and the most it says it may generate; nothing for a body the gateway cannot read (the
    request itself still counts against requests per minute). A whole answer's usage, when it
    says one, corrects it."""
    if data is None:
        return 0.0
    most = next((data[f] for f in _MAX_OUTPUT_FIELDS if isinstance(data.get(f), int)), 0)
    return len(raw) / 4 + max(0, most)
