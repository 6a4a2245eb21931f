"""One proxied request, start to end: auth, limits, the queue, a pool, fallbacks, the answer.

It reads only what it needs from a body (model, stream, max_tokens, the prompt's leading text
for affinity) and forwards the bytes as they came, so whatever a backend understands passes
through. Every answer it makes itself is in OpenAI's error shape.

Each request keeps a ``RequestRecord``; when the request ends, on every path, the record moves
the metrics, writes the one log line per request and closes the request's span.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from poise.asgi import CancelOnDisconnect, ClientGoneError, EventStreamResponse
from poise.gateway.autoscaling import Autoscaling
from poise.gateway.config import KeySettings
from poise.gateway.core import GatewayCore
from poise.gateway.forward import Attempt, Forwarder, Upstream, output_tokens
from poise.gateway.metrics import GatewayMetrics
from poise.gateway.pool import Backend, affinity_key
from poise.gateway.record import RequestRecord
from poise.gateway.request_body import (
    estimate_tokens,
    max_output_tokens,
    parse_body,
    prompt_text,
    resumable,
)
from poise.gateway.response_cache import ResponseCache, cache_key
from poise.gateway.stream import StreamPosition, relay
from poise.observability import tracing as tr
from poise.observability.logs import ms
from poise.observability.tracing import Tracing
from poise.protocol import ATTEMPT_COUNT_HEADER, STREAM_TOKENS_HEADER, APIError
from poise.resilience.ratelimit import Charge

log = logging.getLogger("poise.gateway.access")

Proxy = Callable[[Request, str], Awaitable[Response]]
REQUEST_ID_HEADER = "x-request-id"
_ids = random.Random()
# Usage sits at the end of a completion; a search of the tail is cheaper than parsing it all.
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


class Gateway(GatewayCore, Protocol):
    """What a proxied request uses of the gateway, besides the shared state."""

    metrics: GatewayMetrics
    tracing: Tracing
    forwarder: Forwarder | None  # None until the gateway has started
    autoscaling: Autoscaling
    caches: dict[str, ResponseCache]  # the models that keep answers to fall back on

    def authenticate(self, request: Request) -> KeySettings | None: ...

    def charges(self, key: KeySettings | None, model: str, tokens: float) -> list[Charge]: ...

    def deadline(self, request: Request) -> float: ...


def make_proxy(gw: Gateway) -> Proxy:
    """The handler of the proxied routes, bound to one gateway."""

    async def proxy(request: Request, path: str) -> Response:
        # Unique, not secret: random bits, without uuid4's system call per request.
        rid = request.headers.get(REQUEST_ID_HEADER) or f"{_ids.getrandbits(128):032x}"
        record = RequestRecord(rid, path, time.perf_counter())
        span = None
        if gw.tracing.tracer is not None:
            span = gw.tracing.tracer.start_span(
                f"gateway {path}",
                context=gw.tracing.extract(request.headers),
                kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": "POST", "url.path": path},
            )
        try:
            response = await _handle(gw, request, path, record, span)
        except APIError as exc:
            record.failed(exc)
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except ClientGoneError:
            record.status, record.outcome = 499, "client_gone"
            response = Response(status_code=499)
        except BaseException:
            record.outcome = "error"
            _finish(gw, record, span)
            raise
        response.headers[REQUEST_ID_HEADER] = rid
        if not isinstance(response, EventStreamResponse):
            _finish(gw, record, span)
        return response

    return proxy


def _finish(gw: Gateway, record: RequestRecord, span: trace.Span | None) -> None:
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
            "queue_ms": ms(record.queue_s),
            "ttft_ms": ms(record.ttft_s),
            "duration_ms": ms(time.perf_counter() - record.arrived),
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "error": record.error,
        },
    )


async def _handle(
    gw: Gateway, request: Request, path: str, record: RequestRecord, span: trace.Span | None
) -> Response:
    key = gw.authenticate(request)
    record.key = key.name if key else None
    raw = await request.body()
    data = parse_body(raw)
    model = record.model = data["model"]
    if model not in gw.pools:
        raise APIError(
            404, f"the model {model!r} does not exist", param="model", code="model_not_found"
        )
    gw.autoscaling.arrived(model)
    deadline = gw.deadline(request)
    text = prompt_text(data)
    estimate = estimate_tokens(data, text)
    charges = gw.charges(key, model, estimate)
    limit_headers: dict[str, str] = {}
    charged_shared = False
    if charges:
        checked = await gw.limits.check(charges)
        decision, charged_shared = checked.decision, checked.shared
        limit_headers = decision.headers()  # on every answer, as OpenAI sends them
        if not decision.allowed:
            gw.metrics.rate_limited(decision.refused_by or "")
            raise APIError(
                429,
                f"rate limit reached for {decision.refused_by}",
                code="rate_limit_exceeded",
                headers=decision.headers(),
            )
    headers = {"content-type": "application/json", REQUEST_ID_HEADER: record.request_id}
    priority = key.priority if key else 0
    asked = data.get("priority")
    # A client may lower its own importance below its key's (0 without a key), never raise
    # it: the header is the floor a poise replica holds the body's priority to.
    is_int = isinstance(asked, int) and not isinstance(asked, bool)
    if is_int and asked > priority:
        priority = asked
    headers["x-priority"] = str(priority)
    if is_int and asked != priority:
        # The body says it too, for a backend that reads only the body (vLLM). A body without
        # one is left so (a vLLM not scheduling by priority refuses the field), and one that is
        # no integer goes on as it came, for the backend to refuse.
        data = {**data, "priority": priority}
        raw = json.dumps(data).encode()
    record.priority = priority
    if span is not None:
        tr.set_attributes(
            span,
            {
                tr.OPERATION: "chat" if path.endswith("chat/completions") else "text_completion",
                tr.REQUEST_MODEL: model,
                tr.MAX_TOKENS: data.get("max_tokens"),
                tr.TEMPERATURE: data.get("temperature"),
            },
        )
        if gw.tracing.record_content:
            span.set_attribute(tr.PROMPT_TEXT, text)
    else:
        for name in ("traceparent", "tracestate"):
            if name in request.headers:
                headers[name] = request.headers[name]
    gate = gw.gates[model]
    stream = record.stream = data.get("stream") is True
    can_resume = stream and resumable(data)
    if can_resume:
        headers[STREAM_TOKENS_HEADER] = "1"
    affinity = affinity_key(text)
    cache = gw.caches.get(model)
    ckey = cache_key(path, data) if cache is not None else None
    entered = False

    def ended() -> None:
        gw.budget.request_ended()
        gate.leave()

    journeys: list[Attempt] = []
    try:
        with CancelOnDisconnect(request.receive):
            queued_at = time.perf_counter()
            admission = _child(gw, span, "gateway admission", {"poise.priority": priority})
            try:
                await gate.enter(priority, deadline)
            finally:
                if admission is not None:
                    admission.end()
                record.queue_s = time.perf_counter() - queued_at
            entered = True
            gw.budget.request_started()
            upstream, served_by = await _with_fallback(
                gw, model, data, raw, path, headers, deadline, stream, affinity, span, journeys
            )
    except ClientGoneError:
        if entered:
            ended()
        raise
    except APIError as exc:
        record.retries = sum(j.retries for j in journeys)
        if not entered:
            raise
        ended()
        cached = cache.get(ckey) if cache is not None and ckey is not None else None
        if cached is None or exc.status not in (429, 502, 503):
            raise
        log.warning("model %s: every pool failed (%s); answered from the cache", model, exc)
        record.status, record.outcome, record.fallback = 200, "ok", "cache"
        body, stored_headers = cached
        return Response(body, 200, {**stored_headers, **limit_headers, "x-poise-fallback": "cache"})
    except BaseException:
        if entered:
            ended()
        raise
    record.retries = sum(j.retries for j in journeys)
    record.backend = upstream.backend.url if upstream.backend is not None else None
    # Upstream attempts before this answer, as Envoy's x-envoy-attempt-count: a client (or
    # poise chaos) can tell an answer that needed a retry or a fallback from a first-try one.
    extra = {**limit_headers, ATTEMPT_COUNT_HEADER: str(record.retries + len(journeys))}
    if served_by != model:
        extra["x-poise-fallback"] = record.fallback = f"model:{served_by}"
    if upstream.body is not None:
        ended()
        record.status = upstream.status
        record.outcome = "ok" if upstream.status < 400 else _upstream_outcome(upstream.status)
        if upstream.status == 200:
            tail = upstream.body[-400:]
            record.output_tokens = output_tokens(upstream.body)
            record.input_tokens = _int(_PROMPT_TOKENS.search(tail))
            if charges:
                await _reconcile(gw, charges, charged_shared, upstream.body)
            if cache is not None and ckey is not None and served_by == model:
                cache.put(ckey, upstream.body, upstream.headers)
        return Response(upstream.body, upstream.status, {**upstream.headers, **extra})

    async def resume(position: StreamPosition, failed: Backend | None) -> Upstream:
        assert gw.forwarder is not None
        state = {
            "token_ids": position.token_ids,
            "text_chars": position.text_chars,
            "id": position.id,
            "created": position.created,
        }
        body = json.dumps({**data, "model": served_by, "poise_resume": state}).encode()
        journey = Attempt(tried=[failed] if failed is not None else [], span=span)
        return await gw.forwarder.send(
            gw.pools[served_by], path, body, headers, deadline, True, affinity, journey
        )

    async def events() -> AsyncIterator[bytes]:
        position = StreamPosition()
        record.status, record.outcome = 200, "ok"
        record.ttft_s = time.perf_counter() - record.arrived
        try:
            async for chunk in relay(
                upstream,
                gw.settings.timeouts.stream_idle_s,
                resume if can_resume else None,
                on_resume=gw.metrics.stream_resumed,
                position=position,
            ):
                yield chunk
        except BaseException:
            record.outcome = "client_gone"
            raise
        finally:
            ended()
            if position.failed:
                record.outcome, record.error = "upstream_error", position.failed
            if position.noted:
                record.output_tokens = len(position.token_ids)
            record.e2e_s = time.perf_counter() - record.arrived
            _finish(gw, record, span)
            if charges and position.noted:
                # The notes counted the tokens generated: charge those, not max_tokens.
                # (The prompt's share stays estimated: a stream does not say it.)
                used = estimate - max_output_tokens(data) + len(position.token_ids)
                await _adjust_tokens(gw, charges, charged_shared, used)

    response = EventStreamResponse(events())
    for k, v in extra.items():
        response.headers[k] = v
    return response


def _child(
    gw: Gateway, parent: trace.Span | None, name: str, attrs: dict[str, Any]
) -> trace.Span | None:
    if parent is None or gw.tracing.tracer is None:
        return None
    return gw.tracing.tracer.start_span(
        name, context=trace.set_span_in_context(parent), attributes=attrs
    )


def _int(match: re.Match[bytes] | None) -> int | None:
    return None if match is None else int(match.group(1))


def _upstream_outcome(status: int) -> str:
    return "client_error" if status < 500 else "upstream_error"


async def _with_fallback(
    gw: Gateway,
    model: str,
    data: dict[str, Any],
    raw: bytes,
    path: str,
    headers: dict[str, str],
    deadline: float,
    stream: bool,
    affinity: bytes | None,
    span: trace.Span | None,
    journeys: list[Attempt],
) -> tuple[Upstream, str]:
    assert gw.forwarder is not None
    chain = [model, *gw.settings.models[model].fallback]
    last: APIError | None = None
    for i, name in enumerate(chain):
        body = raw if i == 0 else json.dumps({**data, "model": name}).encode()
        journey = Attempt(span=span)
        journeys.append(journey)
        try:
            upstream = await gw.forwarder.send(
                gw.pools[name], path, body, headers, deadline, stream, affinity, journey
            )
        except APIError as exc:
            if exc.status not in (429, 502, 503):
                raise
            last = exc
            continue
        return upstream, name
    assert last is not None
    raise last


async def _reconcile(gw: Gateway, charges: list[Charge], shared: bool, body: bytes) -> None:
    try:
        used = float(json.loads(body)["usage"]["total_tokens"])
    except (ValueError, KeyError, TypeError):
        return
    await _adjust_tokens(gw, charges, shared, used)


async def _adjust_tokens(gw: Gateway, charges: list[Charge], shared: bool, used: float) -> None:
    """Give back (or charge) the difference between the estimate taken and the real use, in the
    store that took the estimate."""
    for c in charges:
        if c.kind == "tokens":
            await gw.limits.adjust(Charge(c.key, c.limit, used - c.cost, c.kind), shared)
