"""The gateway's process: its state (pools, gates, limits, forwarder), routes and lifespan.

What one proxied request goes through is ``proxy``'s business (the completions routes) or
``passthrough``'s (every other route a backend serves); here are the routes the gateway answers
itself, which come first (models, health, readiness, metrics, version, the admin routes of
``admin``), and what the gateway holds for its whole life.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from poise.asgi import ErrorShield, GuardMiddleware
from poise.gateway import admin
from poise.gateway.admission import PoolGate
from poise.gateway.autoscaling import Autoscaling
from poise.gateway.config import GatewaySettings, KeySettings
from poise.gateway.debug_state import gateway_state
from poise.gateway.discovery import DnsBackends, Resolver, resolve
from poise.gateway.forward import Forwarder, Timeouts
from poise.gateway.health import watch
from poise.gateway.limits import GatewayLimits
from poise.gateway.metrics import GatewayMetrics
from poise.gateway.passthrough import make_passthrough
from poise.gateway.pool import Backend, Pool
from poise.gateway.proxy import make_proxy
from poise.gateway.response_cache import ResponseCache
from poise.gateway.routes import ProxiedRoutes, forwarded
from poise.gateway.shared_verdicts import SharedVerdicts
from poise.gateway.success_estimate import SuccessTallies, policy_of
from poise.observability.tracing import Tracing, otlp_provider
from poise.protocol import DEADLINE_HEADER, APIError, deadline_budget_s
from poise.protocol_body import read_json_body
from poise.resilience.autoscale import AutoscaleConfig
from poise.resilience.ratelimit import Charge, Limit
from poise.resilience.retry import RetryBudget, RetryPolicy
from poise.version import __version__

log = logging.getLogger("poise.gateway")


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
        resolver: Resolver = resolve,
    ) -> None:
        self.settings = settings
        self.resolver = resolver
        self.clock = time.monotonic
        self.success = SuccessTallies(policy_of(settings), self.clock)
        self.metrics = GatewayMetrics(self, registry)
        self.tracing = Tracing(
            tracer_provider
            if tracer_provider is not None
            else otlp_provider("poise-gateway", settings.otlp_endpoint),
            record_content=settings.trace_content,
        )
        self.pools = {
            name: Pool(name, settings, self.clock, on_breaker_change=self.metrics.breaker_changed)
            for name in settings.models
        }
        self.gates = {
            name: PoolGate(
                pool,
                settings.admission,
                self.clock,
                self.metrics.admission_refused,
                # A request the pool would refuse may still have a fallback model or a stored
                # answer: it goes on to the forwarder, which knows them, not refused at the gate.
                hold_shedding=not (m.fallback or m.cache_fallback),
            )
            for (name, pool), m in zip(self.pools.items(), settings.models.values(), strict=True)
        }
        self.caches = {
            name: ResponseCache(m.cache_fallback.max_entries, m.cache_fallback.ttl_s, self.clock)
            for name, m in settings.models.items()
            if m.cache_fallback is not None
        }
        self.keys = {k.key: k for k in settings.keys}
        self.limits = GatewayLimits(
            settings.rate_limits,
            self.clock,
            on_fallback=self.metrics.ratelimit_fallback,
            on_checked=self.success.limits_checked,
        )
        r = settings.retry
        self.budget = RetryBudget(
            r.budget_ratio,
            r.budget_min_concurrent,
            r.budget_window_s,
            r.budget_min_per_s,
            self.clock,
        )
        self.policy = RetryPolicy(r.max_retries, r.base_s, max(r.cap_s, r.base_s))
        a = settings.autoscale
        self.autoscaling = Autoscaling(
            self, AutoscaleConfig(**a.model_dump(exclude={"interval_s"})), a.interval_s
        )
        self.shared: SharedVerdicts | None = None
        if self.limits.client is not None:
            self.shared = SharedVerdicts(
                self.limits.client,
                self.pools,
                settings.health.interval_s,
                self.clock,
                prefix=settings.rate_limits.key_prefix + "verdicts:",
                on_error=self.metrics.shared_errors.inc,
                on_applied=self.metrics.remote_verdicts.inc,
            )
        self._watchers: dict[Backend, asyncio.Task[None]] = {}  # health checks, per backend
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
            on_sent=self.success.sent,
            on_budget_exhausted=self.metrics.retry_budget_exhausted,
            tracing=self.tracing,
        )
        for pool in self.pools.values():
            for b in pool.backends:
                self.watch(b)
        discovered = [
            DnsBackends(pool, bs, self.watch, self._unwatch, self.resolver)
            for name, pool in self.pools.items()
            for bs in self.settings.models[name].backends
            if bs.discovery == "dns"
        ]
        for d in discovered:
            await d.refresh()  # the first answer before serving, not a beat later
        return [
            *(asyncio.create_task(d.run()) for d in discovered),
            asyncio.create_task(self.autoscaling.run()),
            *([] if self.shared is None else [asyncio.create_task(self.shared.run())]),
        ]

    def watch(self, backend: Backend) -> None:
        assert self.client is not None
        pool = self.pools[backend.model]

        def on_down(b: Backend) -> None:
            # Only when another backend is trusted: in panic the work has nowhere better to go.
            # Not for a backend drained on purpose (here, or by its own SIGTERM): what it holds
            # finishes there.
            if (
                not b.retired
                and not b.draining
                and any(pool.trusted(o) for o in pool.backends if o is not b)
            ):
                moved = b.cut_off()
                if moved:
                    log.warning("moved %d request(s) off %s, which went down", moved, b.url)

        self._watchers[backend] = asyncio.create_task(
            watch(
                self.client,
                backend,
                self.settings.health,
                self.metrics.probed,
                self.clock,
                on_down,
                pool.latency,
            )
        )

    def _unwatch(self, backend: Backend) -> None:
        task = self._watchers.pop(backend, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        for task in self._watchers.values():
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
        if self.session is not None:
            await self.session.close()
        await self.limits.aclose()  # the Redis client too, shared verdicts' included
        self.tracing.shutdown()

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

    def authorize_admin(self, request: Request) -> None:
        """``/admin/backends`` takes backends out of rotation: not for any tenant's key. From
        loopback (``poise up``, an operator on the host) a valid key (or none, when the gateway
        has no keys) will do; from anywhere else only a key marked ``admin``."""
        key = self.authenticate(request)
        client = request.client.host if request.client is not None else ""
        if _is_loopback(client) or (key is not None and key.admin):
            return
        raise APIError(
            403,
            "the admin routes need a key marked admin, or a client on this host",
            code="forbidden",
        )

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


def create_gateway_app(
    settings: GatewaySettings,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
    resolver: Resolver = resolve,
) -> ASGIApp:
    gw = Gateway(settings, registry, tracer_provider, resolver)

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
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # An unknown path or method: in OpenAI's shape too, not FastAPI's {"detail": ...}.
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)

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
        serving = {
            m: sum(b.checked and p.trusted(b) for b in p.backends) for m, p in gw.pools.items()
        }
        ok = all(serving.values())
        return JSONResponse(
            {"status": "ready" if ok else "degraded", "eligible_backends": serving},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/autoscale")
    async def autoscale() -> JSONResponse:
        # Advice, not a secret: open like /metrics, which carries the same numbers.
        return JSONResponse(gw.autoscaling.state())

    @app.get("/debug/state")
    async def debug_state(request: Request) -> JSONResponse:
        gw.authenticate(request)  # protected like the API
        return JSONResponse(gateway_state(gw))

    @app.get("/admin/backends")
    async def admin_backends(request: Request) -> JSONResponse:
        gw.authorize_admin(request)
        return JSONResponse(admin.backends_state(gw))

    @app.post("/admin/backends/drain")
    async def admin_drain(request: Request) -> JSONResponse:
        # Out of routing when this answers; what the backend holds goes on to its end.
        gw.authorize_admin(request)
        return JSONResponse(await admin.drain(gw, admin.parse_ref(await _json(request))))

    @app.post("/admin/backends/restore")
    async def admin_restore(request: Request) -> JSONResponse:
        # Back in routing once a health check passes.
        gw.authorize_admin(request)
        return JSONResponse(admin.restore(gw, admin.parse_ref(await _json(request))))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__, "role": "gateway"})

    guarded = GuardMiddleware(
        ProxiedRoutes(app, make_proxy(gw), make_passthrough(gw)),
        max_body_bytes=settings.max_body_bytes,
        api_keys=[],
        body_timeout_s=settings.body_timeout_s,
        forwarded=forwarded,
    )
    return ErrorShield(guarded, log)


async def _json(request: Request) -> object:
    # The proxied routes' strict reader, not Starlette's ``request.json()``: that one nests as
    # deep as the C stack allows (a RecursionError, a plain-text 500 and a dropped connection)
    # and takes NaN and lone surrogates; this answers 400 in OpenAI's shape for each.
    return read_json_body(await request.body())


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4 loopback as an IPv6 socket reports it (::ffff:127.0.0.1)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
