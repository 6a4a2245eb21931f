"""What the handlers of forwarded requests share: the completions routes (``proxy``) and every
other backend route (``passthrough``).

One request's id, record and span, and its end on every path (``handled``, ``finish``: the
metrics, the one log line per request, the span closed); its model's pool (404 for an unknown
one); its rate-limit charges and their correction once the answer says what it used; its
priority held to its key's floor; its wait in the admission queue.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from poise.asgi import ClientGoneError, EventStreamResponse
from poise.gateway.autoscaling import Autoscaling
from poise.gateway.config import KeySettings
from poise.gateway.core import GatewayCore
from poise.gateway.forward import Forwarder
from poise.gateway.metrics import GatewayMetrics
from poise.gateway.record import RequestRecord
from poise.gateway.response_cache import ResponseCache
from poise.gateway.upstream import Upstream, output_tokens
from poise.observability import tracing as tr
from poise.observability.logs import ms
from poise.observability.tracing import Tracing
from poise.protocol import APIError
from poise.resilience.ratelimit import Charge

log = logging.getLogger("poise.gateway.access")

REQUEST_ID_HEADER = "x-request-id"
_ids = random.Random()
# Usage sits at the end of an answer; a search of the tail is cheaper than parsing it all.
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


class Gateway(GatewayCore, Protocol):
    """What a forwarded request uses of the gateway, besides the shared state."""

    metrics: GatewayMetrics
    tracing: Tracing
    forwarder: Forwarder | None  # None until the gateway has started
    autoscaling: Autoscaling
    caches: dict[str, ResponseCache]  # the models that keep answers to fall back on

    def authenticate(self, request: Request) -> KeySettings | None: ...

    def charges(self, key: KeySettings | None, model: str, tokens: float) -> list[Charge]: ...

    def deadline(self, request: Request) -> float: ...


Handle = Callable[[RequestRecord, trace.Span | None], Awaitable[Response]]


async def handled(gw: Gateway, request: Request, path: str, handle: Handle) -> Response:
    """``handle``'s answer, or the error it raised in OpenAI's shape; either way the request's
    record is finished once (a stream's when the stream ends) and its answer carries its id."""
    # Unique, not secret: random bits, without uuid4's system call per request.
    rid = request.headers.get(REQUEST_ID_HEADER) or f"{_ids.getrandbits(128):032x}"
    record = RequestRecord(rid, path, time.perf_counter())
    span = None
    if gw.tracing.tracer is not None:
        span = gw.tracing.tracer.start_span(
            f"gateway {path}",
            context=gw.tracing.extract(request.headers),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": path},
        )
    try:
        response = await handle(record, span)
    except APIError as exc:
        record.failed(exc)
        response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
    except ClientGoneError:
        record.status, record.outcome = 499, "client_gone"
        response = Response(status_code=499)
    except BaseException:
        record.outcome = "error"
        finish(gw, record, span)
        raise
    response.headers[REQUEST_ID_HEADER] = rid
    if not isinstance(response, EventStreamResponse):
        finish(gw, record, span)
    return response


def finish(gw: Gateway, record: RequestRecord, span: trace.Span | None) -> None:
    if record.e2e_s is None and record.outcome == "ok":
        record.e2e_s = time.perf_counter() - record.arrived
    if record.outcome == "ok" and record.model is not None:
        gw.autoscaling.completed(record.model)
    gw.metrics.finished(record)
    if span is not None:
        tr.set_attributes(
            span,
            {
                "http.response.status_code": record.status,
                tr.REQUEST_MODEL: record.model,
                tr.INPUT_TOKENS: record.input_tokens,
                tr.OUTPUT_TOKENS: record.output_tokens,
                "poise.request_id": record.request_id,
                "poise.outcome": record.outcome,
                "poise.backend": record.backend,
                "poise.retries": record.retries,
                "poise.resumed": record.resumed,
                "poise.fallback": record.fallback,
            },
        )
        if record.status >= 500:
            span.set_status(trace.StatusCode.ERROR, record.error)
        span.end()
    # One line per request: what an operator greps for. Never the prompt or the answer.
    if not log.isEnabledFor(logging.INFO):
        return
    log.info(
        "request",
        extra={
            "request_id": record.request_id,
            "trace_id": tr.trace_id(span),
            "path": record.path,
            "model": record.model,
            "key": record.key,
            "priority": record.priority,
            "stream": record.stream,
            "status": record.status,
            "outcome": record.outcome,
            "backend": record.backend,
            "fallback": record.fallback,
            "retries": record.retries,
            "resumed": record.resumed,
            "queue_ms": ms(record.queue_s),
            "ttft_ms": ms(record.ttft_s),
            "duration_ms": ms(time.perf_counter() - record.arrived),
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "error": record.error,
        },
    )


def require_model(gw: Gateway, model: str) -> None:
    if model not in gw.pools:
        raise APIError(
            404, f"the model {model!r} does not exist", param="model", code="model_not_found"
        )


@dataclass(slots=True)
class Charged:
    """The rate-limit charges a request took, in which store, and the headers every answer to
    it carries (as OpenAI sends them)."""

    charges: list[Charge] = field(default_factory=list)
    shared: bool = False  # in Redis: corrections go back there
    headers: dict[str, str] = field(default_factory=dict)


async def charge(gw: Gateway, key: KeySettings | None, model: str, tokens: float) -> Charged:
    """The request's charges taken, or a 429 naming the limit that refused it."""
    charges = gw.charges(key, model, tokens)
    if not charges:
        return Charged()
    checked = await gw.limits.check(charges)
    decision = checked.decision
    if not decision.allowed:
        gw.metrics.rate_limited(decision.refused_by or "")
        raise APIError(
            429,
            f"rate limit reached for {decision.refused_by}",
            code="rate_limit_exceeded",
            headers=decision.headers(),
        )
    return Charged(charges, checked.shared, decision.headers())


def held_priority(
    key: KeySettings | None, data: dict[str, Any] | None
) -> tuple[int, dict[str, Any] | None]:
    """The request's priority, and the body rewritten to say it where it must (else None).

    A client may lower its own importance below its key's (0 without a key), never raise it:
    the priority is the floor a poise replica holds the body's to (sent as ``x-priority``).
    The body says it too, for a backend that reads only the body (vLLM). A body without one is
    left so (a vLLM not scheduling by priority refuses the field), and one that is no integer
    goes on as it came, for the backend to refuse.
    """
    priority = key.priority if key else 0
    asked = data.get("priority") if data is not None else None
    if data is None or not isinstance(asked, int) or isinstance(asked, bool):
        return priority, None
    if asked >= priority:
        return asked, None
    return priority, {**data, "priority": priority}


def child(
    gw: Gateway, parent: trace.Span | None, name: str, attrs: dict[str, Any]
) -> trace.Span | None:
    if parent is None or gw.tracing.tracer is None:
        return None
    return gw.tracing.tracer.start_span(
        name, context=trace.set_span_in_context(parent), attributes=attrs
    )


async def admit(
    gw: Gateway,
    model: str,
    priority: int,
    deadline: float,
    record: RequestRecord,
    span: trace.Span | None,
) -> None:
    """Through the model's admission queue (then ``gw.gates[model].leave(priority)`` once
    done)."""
    queued_at = time.perf_counter()
    admission = child(gw, span, "gateway admission", {"poise.priority": priority})
    try:
        await gw.gates[model].enter(priority, deadline, record.first_token_by)
    finally:
        if admission is not None:
            admission.end()
        record.queue_s = time.perf_counter() - queued_at


async def answered(gw: Gateway, record: RequestRecord, up: Upstream, charged: Charged) -> None:
    """A whole answer's status and usage, into the record and the rate-limit charges."""
    assert up.body is not None
    record.status = up.status
    record.outcome = "ok" if up.status < 400 else upstream_outcome(up.status)
    if up.status == 200:
        record.output_tokens = output_tokens(up.body)
        match = _PROMPT_TOKENS.search(up.body[-400:])
        record.input_tokens = None if match is None else int(match.group(1))
        if charged.charges:
            await reconcile(gw, charged, up.body)


def upstream_outcome(status: int) -> str:
    return "client_error" if status < 500 else "upstream_error"


async def reconcile(gw: Gateway, charged: Charged, body: bytes) -> None:
    try:
        used = float(json.loads(body)["usage"]["total_tokens"])
    except (ValueError, KeyError, TypeError):
        return
    await adjust_tokens(gw, charged, used)


async def adjust_tokens(gw: Gateway, charged: Charged, used: float) -> None:
    """Give back (or charge) the difference between the estimate taken and the real use, in the
    store that took the estimate."""
    for c in charged.charges:
        if c.kind == "tokens":
            await gw.limits.adjust(Charge(c.key, c.limit, used - c.cost, c.kind), charged.shared)
