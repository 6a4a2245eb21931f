"""The gateway's HTTP front: auth, rate limits, deadline, then a pool, then a fallback.

It reads only what it needs from a body (model, stream, max_tokens, the prompt's leading text
for affinity) and forwards the bytes as they came, so whatever a backend understands passes
through. Every answer it makes itself is in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from poise.asgi import CancelOnDisconnect, ClientGoneError, EventStreamResponse, GuardMiddleware
from poise.gateway.admission import PoolGate
from poise.gateway.config import GatewaySettings, KeySettings
from poise.gateway.forward import Attempt, Forwarder, Timeouts, Upstream
from poise.gateway.health import watch
from poise.gateway.limits import GatewayLimits
from poise.gateway.metrics import GatewayMetrics
from poise.gateway.pool import Backend, Pool, affinity_key
from poise.gateway.response_cache import ResponseCache, cache_key
from poise.gateway.stream import StreamPosition, relay
from poise.protocol import DEADLINE_HEADER, STREAM_TOKENS_HEADER, APIError, deadline_budget_s
from poise.resilience.ratelimit import Charge, Limit
from poise.resilience.retry import RetryBudget, RetryPolicy
from poise.version import __version__

log = logging.getLogger("poise.gateway")


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.clock = time.monotonic
        self.metrics = GatewayMetrics(self)
        self.pools = {
            name: Pool(name, settings, self.clock, on_breaker_change=self.metrics.breaker_changed)
            for name in settings.models
        }
        self.gates = {
            name: PoolGate(pool, settings.admission, self.clock, self.metrics.admission_refused)
            for name, pool in self.pools.items()
        }
        self.metrics.watch_gates(self.gates)
        self.caches = {
            name: ResponseCache(m.cache_fallback.max_entries, m.cache_fallback.ttl_s, self.clock)
            for name, m in settings.models.items()
            if m.cache_fallback is not None
        }
        self.keys = {k.key: k for k in settings.keys}
        self.limits = GatewayLimits(
            settings.rate_limits, self.clock, on_fallback=self.metrics.ratelimit_fallback
        )
        r = settings.retry
        self.budget = RetryBudget(r.budget_ratio, r.budget_min_concurrent)
        self.policy = RetryPolicy(r.max_retries, r.base_s, max(r.cap_s, r.base_s))
        self.client: httpx.AsyncClient | None = None  # health checks
        self.session: aiohttp.ClientSession | None = None  # forwarding: the hot path
        self.forwarder: Forwarder | None = None

    async def start(self) -> list[asyncio.Task[None]]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits, timeout=None)
        # aiohttp for forwarding: about half httpx's cost per request on this path. Bodies
        # pass as they came: no compression asked for, none undone.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        t = self.settings.timeouts
        self.forwarder = Forwarder(
            self.session,
            self.policy,
            self.budget,
            Timeouts(t.connect_s, t.first_byte_s),
            self.clock,
            on_outcome=self.metrics.upstream_outcome,
        )
        return [
            asyncio.create_task(
                watch(self.client, b, self.settings.health, self.metrics.health_changed, self.clock)
            )
            for pool in self.pools.values()
            for b in pool.backends
        ]

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.session is not None:
            await self.session.close()
        await self.limits.aclose()

    # ----- one request -----
    def authenticate(self, request: Request) -> KeySettings | None:
        if not self.keys:
            return None
        auth = request.headers.get("authorization", "")
        key = self.keys.get(auth[7:].strip()) if auth[:7].lower() == "bearer " else None
        if key is None:
            raise APIError(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                code="invalid_api_key",
            )
        return key

    def charges(self, key: KeySettings | None, model: str, tokens: float) -> list[Charge]:
        m = self.settings.models[model]
        scopes = [(f"model:{model}", m.requests_per_minute, m.tokens_per_minute)]
        if key is not None:  # first, so that a refusal names the key's own limit
            scopes.insert(0, (f"key:{key.name}", key.requests_per_minute, key.tokens_per_minute))
        out = []
        for scope, rpm, tpm in scopes:
            if rpm is not None:
                out.append(Charge(scope + ":rpm", Limit(rpm), 1, "requests"))
            if tpm is not None:
                out.append(Charge(scope + ":tpm", Limit(tpm), tokens, "tokens"))
        return out

    def deadline(self, request: Request) -> float:
        total = self.settings.timeouts.total_s
        asked = deadline_budget_s(request.headers.get(DEADLINE_HEADER))
        return self.clock() + (total if asked is None else min(total, asked))


def _parse(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    if not isinstance(data.get("model"), str):
        raise APIError(400, "model is required", param="model")
    return data


def _resumable(data: dict[str, Any]) -> bool:
    """One streamed choice without logprobs: what a poise backend can resume mid-stream."""
    return (data.get("n") in (None, 1)) and not data.get("logprobs") and not data.get("echo")


def _prompt_text(data: dict[str, Any]) -> str:
    if "messages" in data and isinstance(data["messages"], list):
        parts = []
        for m in data["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
        return "\n".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:512]


def _max_output_tokens(data: dict[str, Any]) -> float:
    max_tokens = data.get("max_tokens") or data.get("max_completion_tokens") or 256
    n = data.get("n") or 1
    try:
        return float(max_tokens) * float(n)
    except (TypeError, ValueError):
        return 256.0


def _estimate_tokens(data: dict[str, Any], text: str) -> float:
    """Prompt (about four characters a token) plus the most the answer may use."""
    return len(text) / 4 + _max_output_tokens(data)


Proxy = Callable[[Request, str], Awaitable[Response]]


def create_gateway_app(settings: GatewaySettings) -> ASGIApp:
    gw = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = await gw.start()
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gw.stop()

    app = FastAPI(title="poise gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        gw.metrics.answered(None, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def proxy(request: Request, path: str) -> Response:
        key = gw.authenticate(request)
        raw = await request.body()
        data = _parse(raw)
        model = data["model"]
        if model not in gw.pools:
            raise APIError(
                404, f"the model {model!r} does not exist", param="model", code="model_not_found"
            )
        deadline = gw.deadline(request)
        text = _prompt_text(data)
        estimate = _estimate_tokens(data, text)
        charges = gw.charges(key, model, estimate)
        limit_headers: dict[str, str] = {}
        if charges:
            decision = await gw.limits.check(charges)
            limit_headers = decision.headers()  # on every answer, as OpenAI sends them
            if not decision.allowed:
                gw.metrics.rate_limited(decision.refused_by or "")
                raise APIError(
                    429,
                    f"rate limit reached for {decision.refused_by}",
                    code="rate_limit_exceeded",
                    headers=decision.headers(),
                )
        headers = {"content-type": "application/json"}
        priority = key.priority if key else 0
        if priority:
            asked = data.get("priority")
            # A client may lower its own importance below its key's, never raise it.
            if isinstance(asked, int) and asked > priority:
                priority = asked
            headers["x-priority"] = str(priority)
        for name in ("traceparent", "tracestate", "x-request-id"):
            if name in request.headers:
                headers[name] = request.headers[name]
        gate = gw.gates[model]
        stream = data.get("stream") is True
        resumable = stream and _resumable(data)
        if resumable:
            headers[STREAM_TOKENS_HEADER] = "1"
        affinity = affinity_key(text)
        cache = gw.caches.get(model)
        ckey = cache_key(path, data) if cache is not None else None
        entered = False

        def ended() -> None:
            gw.budget.request_ended()
            gate.leave()

        try:
            with CancelOnDisconnect(request.receive):
                await gate.enter(priority, deadline)
                entered = True
                gw.budget.request_started()
                upstream, served_by = await _with_fallback(
                    gw, model, data, raw, path, headers, deadline, stream, affinity
                )
        except ClientGoneError:
            if entered:
                ended()
            return Response(status_code=499)
        except APIError as exc:
            if not entered:
                raise
            ended()
            cached = cache.get(ckey) if cache is not None and ckey is not None else None
            if cached is None or exc.status not in (429, 502, 503):
                raise
            gw.metrics.fell_back(model, "cache")
            gw.metrics.answered(model, 200)
            log.warning("model %s: every pool failed (%s); answered from the cache", model, exc)
            body, stored_headers = cached
            return Response(
                body, 200, {**stored_headers, **limit_headers, "x-poise-fallback": "cache"}
            )
        except BaseException:
            if entered:
                ended()
            raise
        extra = dict(limit_headers)
        if served_by != model:
            extra["x-poise-fallback"] = f"model:{served_by}"
        if upstream.body is not None:
            ended()
            gw.metrics.answered(served_by, upstream.status)
            if upstream.status == 200:
                if charges:
                    await _reconcile(gw, charges, upstream.body)
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
            journey = Attempt(tried=[failed] if failed is not None else [])
            return await gw.forwarder.send(
                gw.pools[served_by], path, body, headers, deadline, True, affinity, journey
            )

        async def events() -> AsyncIterator[bytes]:
            position = StreamPosition()
            try:
                async for chunk in relay(
                    upstream,
                    settings.timeouts.stream_idle_s,
                    resume if resumable else None,
                    on_resume=gw.metrics.stream_resumed,
                    position=position,
                ):
                    yield chunk
            finally:
                ended()
                gw.metrics.answered(served_by, 200)
                if charges and position.noted:
                    # The notes counted the tokens generated: charge those, not max_tokens.
                    # (The prompt's share stays estimated: a stream does not say it.)
                    used = estimate - _max_output_tokens(data) + len(position.token_ids)
                    await _adjust_tokens(gw, charges, used)

        response = EventStreamResponse(events())
        for k, v in extra.items():
            response.headers[k] = v
        return response

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "poise"}
            for m in settings.models
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # Ready once every model has a backend that an active check has seen serving.
        serving = {m: sum(b.checked for b in p.eligible()) for m, p in gw.pools.items()}
        ok = all(serving.values())
        return JSONResponse(
            {"status": "ready" if ok else "degraded", "eligible_backends": serving},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__, "role": "gateway"})

    front = GuardMiddleware(
        ProxiedRoutes(app, gw, proxy), max_body_bytes=settings.max_body_bytes, api_keys=[]
    )
    return front


PROXIED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class ProxiedRoutes:
    """The two proxied routes served straight from ASGI; everything else goes to FastAPI.

    Written by hand because FastAPI's layers (routing, dependency solving, its exception and
    telemetry middleware) were a measurable share of the latency the gateway adds to every
    request, and these routes need none of them: the body is forwarded as it came.
    """

    def __init__(self, app: ASGIApp, gw: Gateway, handler: Proxy) -> None:
        self.app = app
        self.gw = gw
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope["method"] != "POST" or path not in PROXIED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            response = await self.handler(Request(scope, receive), path)
        except APIError as exc:
            self.gw.metrics.answered(None, exc.status)
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except Exception as exc:
            log.exception("unhandled error on %s", path)
            err = APIError(500, f"internal error: {type(exc).__name__}")
            response = JSONResponse(err.body(), status_code=500)
        await response(scope, receive, send)


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
) -> tuple[Upstream, str]:
    assert gw.forwarder is not None
    chain = [model, *gw.settings.models[model].fallback]
    last: APIError | None = None
    for i, name in enumerate(chain):
        body = raw if i == 0 else json.dumps({**data, "model": name}).encode()
        journey = Attempt()
        try:
            upstream = await gw.forwarder.send(
                gw.pools[name], path, body, headers, deadline, stream, affinity, journey
            )
        except APIError as exc:
            gw.metrics.retried(journey.retries)
            if exc.status not in (429, 502, 503):
                raise
            last = exc
            continue
        gw.metrics.retried(journey.retries)
        if i > 0:
            gw.metrics.fell_back(model, name)
        return upstream, name
    assert last is not None
    raise last


async def _reconcile(gw: Gateway, charges: list[Charge], body: bytes) -> None:
    try:
        used = float(json.loads(body)["usage"]["total_tokens"])
    except (ValueError, KeyError, TypeError):
        return
    await _adjust_tokens(gw, charges, used)


async def _adjust_tokens(gw: Gateway, charges: list[Charge], used: float) -> None:
    """Give back (or charge) the difference between the estimate taken and the real use."""
    for c in charges:
        if c.kind == "tokens":
            await gw.limits.adjust(Charge(c.key, c.limit, used - c.cost, c.kind))
