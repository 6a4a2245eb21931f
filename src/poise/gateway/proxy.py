"""One proxied request, start to end: auth, limits, the queue, a pool, fallbacks, the answer.

It reads only what it needs from a body (model, stream, max_tokens, the prompt's leading text
for affinity) and forwards the bytes as they came, so whatever a backend understands passes
through. Every answer it makes itself is in OpenAI's error shape.

Each request keeps a ``RequestRecord``; when the request ends, on every path, the record moves
the metrics, writes the one log line per request and closes the request's span (``handling``,
which the other backend routes, ``passthrough``, share).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace

from poise.asgi import CancelOnDisconnect, ClientGoneError, EventStreamResponse
from poise.gateway.backend_kind import traits
from poise.gateway.continuation import (
    Transcript,
    asks_usage,
    continuable,
    continued_body,
    with_stream_usage,
)
from poise.gateway.forward import Attempt, BodyFor, first_token_due, objective_headers
from poise.gateway.handling import (
    REQUEST_ID_HEADER,
    Gateway,
    adjust_tokens,
    admit,
    answered,
    charge,
    finish,
    handled,
    held_priority,
    require_model,
)
from poise.gateway.pool import Backend
from poise.gateway.prefix import Affinity, affinity_of
from poise.gateway.record import RequestRecord
from poise.gateway.request_body import (
    estimate_tokens,
    max_output_tokens,
    parse_body,
    prompt_text,
    resumable,
)
from poise.gateway.response_cache import cache_key
from poise.gateway.stream import StreamPosition, relay, resumed_mode
from poise.gateway.upstream import Upstream
from poise.observability import tracing as tr
from poise.protocol import (
    ATTEMPT_COUNT_HEADER,
    CONTINUATION_HEADER,
    STREAM_TOKENS_HEADER,
    APIError,
)

log = logging.getLogger("poise.gateway.access")

Proxy = Callable[[Request, str], Awaitable[Response]]


def make_proxy(gw: Gateway) -> Proxy:
    """The handler of the proxied routes, bound to one gateway."""

    async def proxy(request: Request, path: str) -> Response:
        return await handled(
            gw, request, path, lambda record, span: _handle(gw, request, path, record, span)
        )

    return proxy


async def _handle(
    gw: Gateway, request: Request, path: str, record: RequestRecord, span: trace.Span | None
) -> Response:
    key = gw.authenticate(request)
    record.key = key.name if key else None
    raw = await request.body()
    data = parse_body(raw)
    model = record.model = data["model"]
    require_model(gw, model)
    gw.autoscaling.arrived(model)
    deadline = gw.deadline(request)
    objective = objective_headers(request.headers, gw.clock())
    record.first_token_by = first_token_due(objective)
    text = prompt_text(data)
    estimate = estimate_tokens(data, text)
    charged = await charge(gw, key, model, estimate)
    priority, held = held_priority(key, data)
    if held is not None:
        data, raw = held, json.dumps(held).encode()
    headers = {
        "content-type": "application/json",
        REQUEST_ID_HEADER: record.request_id,
        "x-priority": str(priority),
        **objective,
    }
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
    # Greedy or seeded: an answer a deterministic replica gives again, draw for draw.
    reproducible = data.get("temperature") == 0 or data.get("seed") is not None
    if can_resume:
        headers[STREAM_TOKENS_HEADER] = "1"
    chain = [model, *gw.settings.models[model].fallback]
    transcript = None
    if stream and any(b.kind != "poise" for name in chain for b in gw.pools[name].backends):
        # Another engine may serve it: read its stream for the text sent and the usage.
        transcript = Transcript(
            chat=path.endswith("chat/completions"),
            strip_usage=not asks_usage(data),
            continuable=continuable(path, data),
        )
    affinity = affinity_of(data)
    cache = gw.caches.get(model)
    ckey = cache_key(path, data) if cache is not None else None
    entered = False

    def ended() -> None:
        gw.budget.request_ended()
        gate.leave(priority)

    journeys: list[Attempt] = []
    try:
        with CancelOnDisconnect(request.receive):
            await admit(gw, model, priority, deadline, record, span)
            entered = True
            gw.budget.request_started()
            upstream, served_by = await _with_fallback(
                gw, chain, data, raw, path, headers, deadline, transcript, affinity, span, journeys
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
        if cache is not None and exc.status in (429, 502, 503):
            gw.success.cache_tried(model, answered=cached is not None)
        if cached is None or exc.status not in (429, 502, 503):
            raise
        log.warning("model %s: every pool failed (%s); answered from the cache", model, exc)
        record.status, record.outcome, record.fallback = 200, "ok", "cache"
        body, stored_headers = cached
        return Response(
            body, 200, {**stored_headers, **charged.headers, "x-poise-fallback": "cache"}
        )
    except BaseException:
        if entered:
            ended()
        raise
    record.retries = sum(j.retries for j in journeys)
    record.backend = upstream.backend.url if upstream.backend is not None else None
    # Upstream attempts before this answer, as Envoy's x-envoy-attempt-count: a client (or
    # poise chaos) can tell an answer that needed a retry or a fallback from a first-try one.
    extra = {**charged.headers, ATTEMPT_COUNT_HEADER: str(record.retries + len(journeys))}
    if served_by != model:
        extra["x-poise-fallback"] = record.fallback = f"model:{served_by}"
    if upstream.body is not None:
        ended()
        await answered(gw, record, upstream, charged)
        if upstream.status == 200 and cache is not None and ckey is not None and served_by == model:
            cache.put(ckey, upstream.body, upstream.headers)
        return Response(upstream.body, upstream.status, {**upstream.headers, **extra})

    async def resume(position: StreamPosition, failed: Backend | None) -> Upstream:
        assert gw.forwarder is not None
        pool = gw.pools[served_by]
        if failed is not None:
            await gw.forwarder.wait_for_another(pool, failed, deadline)
        exact = position.noted and can_resume  # from the token position
        position.produced_by(failed)

        # While a poise replica can take it, the resume from the token position; another
        # engine only without.
        takers = [b for b in pool.eligible() if b.kind == "poise" and b is not failed]
        exact_only = exact and bool(takers)
        # What a failure is counted as.
        mode = resumed_mode(reproducible, position.numerics, takers[0]) if exact_only else None
        position.mode = mode or "approximate"

        def body_for(backend: Backend) -> bytes | None:
            if exact and backend.kind == "poise":
                state = {
                    "token_ids": position.token_ids,
                    "text_chars": position.text_chars,
                    "id": position.id,
                    "created": position.created,
                }
                resumed = {**data, "model": served_by, "poise_resume": state}
                if transcript is not None:  # it reads (and drops) the usage chunk
                    resumed = with_stream_usage(resumed)
                return json.dumps(resumed).encode()
            if transcript is None or exact_only:
                return None
            continued = continued_body(data, path, transcript, backend.kind)
            if continued is None:
                return None
            continued = {**continued, "model": served_by}
            if traits(backend.kind).stream_usage:
                continued = with_stream_usage(continued)
            return json.dumps(continued).encode()

        journey = Attempt(tried=[failed] if failed is not None else [], span=span)
        # A stream the client is receiving: a replica admits it past its wait bounds.
        sent = {**headers, CONTINUATION_HEADER: "1"}
        up = await gw.forwarder.send(pool, path, body_for, sent, deadline, True, affinity, journey)
        if exact and up.backend is not None and up.backend.kind == "poise":
            position.mode = resumed_mode(reproducible, position.numerics, up.backend)
        else:
            assert transcript is not None
            position.mode = "approximate"
            position.noted, position.token_ids = False, []
            transcript.resumed()
        if record.resumed != "approximate":
            record.resumed = position.mode
        return up

    async def events() -> AsyncIterator[bytes]:
        position = StreamPosition(transcript=transcript)
        record.status, record.outcome = 200, "ok"
        record.ttft_s = time.perf_counter() - record.arrived
        try:
            async for chunk in relay(
                upstream,
                gw.settings.timeouts.stream_idle_s,
                resume if can_resume or transcript is not None else None,
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
                record.outcome, record.error = _stream_outcome(position), position.failed
            used = _used_tokens(record, position, estimate - max_output_tokens(data))
            record.e2e_s = time.perf_counter() - record.arrived
            finish(gw, record, span)
            if charged.charges and used is not None:
                # What the stream used, not max_tokens: the usage the backend reported, else
                # the tokens noted or the events sent (with the prompt's share estimated).
                await adjust_tokens(gw, charged, used)

    response = EventStreamResponse(events())
    for k, v in extra.items():
        response.headers[k] = v
    return response


async def _with_fallback(
    gw: Gateway,
    chain: list[str],
    data: dict[str, Any],
    raw: bytes,
    path: str,
    headers: dict[str, str],
    deadline: float,
    transcript: Transcript | None,
    affinity: Affinity | None,
    span: trace.Span | None,
    journeys: list[Attempt],
) -> tuple[Upstream, str]:
    assert gw.forwarder is not None
    stream = data.get("stream") is True
    last: APIError | None = None
    for i, name in enumerate(chain):
        body: bytes | BodyFor = raw if i == 0 else json.dumps({**data, "model": name}).encode()
        if transcript is not None and transcript.strip_usage:
            body = _asking_usage(data, name, body)
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


def _asking_usage(data: dict[str, Any], name: str, plain: bytes | BodyFor) -> BodyFor:
    """The stream's body for each backend: asking for the usage chunk where its kind honours
    ``stream_options.include_usage`` (the relay drops that chunk: the client did not ask)."""
    asking = json.dumps(with_stream_usage({**data, "model": name})).encode()

    def body_for(backend: Backend) -> bytes:
        if traits(backend.kind).stream_usage:
            return asking
        return plain if isinstance(plain, bytes) else asking

    return body_for


def _used_tokens(record: RequestRecord, position: StreamPosition, prompt: float) -> float | None:
    """The tokens a stream used (``prompt``: the estimate of its prompt's share), into the
    record too; None when nothing says."""
    transcript = position.transcript
    usage = transcript.usage if transcript is not None else None
    if usage is not None:
        completion, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
        record.output_tokens = completion if isinstance(completion, int) else None
        record.input_tokens = prompt_tokens if isinstance(prompt_tokens, int) else None
        used = transcript.used_tokens() if transcript is not None else None
        if used is not None:
            return used
    if position.noted:
        record.output_tokens = len(position.token_ids)
        return prompt + len(position.token_ids)
    if transcript is not None:
        record.output_tokens = transcript.events
        return prompt + transcript.events
    return None


def _stream_outcome(position: StreamPosition) -> str:
    """A stream that ended in an error: a deadline passing is the request's time running out;
    anything else, a failure upstream (a request accepted with 200 and ended by an error is
    no answer, whatever status the error says: some engines say 400 for their own failures)."""
    return "timeout" if position.failed_status == 504 else "upstream_error"
