"""The gateway's Prometheus metrics: outcomes, retries, breakers, ejections, limits, fallbacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from poise.resilience.breaker import BreakerState

if TYPE_CHECKING:
    from poise.gateway.admission import PoolGate
    from poise.gateway.app import Gateway
    from poise.gateway.pool import Backend

BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class GatewayMetrics:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "poise_gateway_requests",
            "Requests answered, by model and status.",
            ["model", "status"],
            registry=r,
        )
        self.upstream = Counter(
            "poise_gateway_upstream_attempts",
            "Attempts on backends, by outcome.",
            ["backend", "outcome"],
            registry=r,
        )
        self.retries = Counter("poise_gateway_retries", "Retries made.", registry=r)
        self.admission = Counter(
            "poise_gateway_admission_refused",
            "Requests refused by the gateway's admission queue, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.limits_fallback = Counter(
            "poise_gateway_ratelimit_fallbacks",
            "Rate-limit checks that found Redis unreachable and fell back to local limits.",
            registry=r,
        )
        Gauge(
            "poise_gateway_ratelimit_redis_up",
            "1 while shared (Redis) rate limits answer; 0 while limits are local.",
            registry=r,
        ).set_function(lambda: float(self.gateway.limits.redis_up))
        self.resumes = Counter(
            "poise_gateway_stream_resumes",
            "Streams continued on another backend after breaking mid-way, by result.",
            ["result"],
            registry=r,
        )
        self.limited = Counter(
            "poise_gateway_rate_limited",
            "Requests refused by a rate limit.",
            ["limit"],
            registry=r,
        )
        self.fallbacks = Counter(
            "poise_gateway_fallbacks",
            "Requests served by a fallback model.",
            ["model", "fallback"],
            registry=r,
        )
        self.breaker = Gauge(
            "poise_gateway_breaker_state",
            "0 closed, 1 half-open, 2 open.",
            ["backend"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "poise_gateway_breaker_transitions",
            "Circuit breaker state changes, by the state entered.",
            ["backend", "to"],
            registry=r,
        )
        Gauge(
            "poise_gateway_retries_peak_concurrent",
            "The most retries ever in flight at once (the retry budget bounds it).",
            registry=r,
        ).set_function(lambda: self.gateway.budget.peak_retries)
        self.healthy = Gauge(
            "poise_gateway_backend_healthy", "1 when active checks pass.", ["backend"], registry=r
        )
        Gauge(
            "poise_gateway_retry_budget_refused", "Retries refused by the budget.", registry=r
        ).set_function(lambda: self.gateway.budget.refused_total)
        self.ejections = Gauge(
            "poise_gateway_ejections",
            "Outlier ejections so far, by model.",
            ["model"],
            registry=r,
        )
        self.inflight = Gauge(
            "poise_gateway_backend_inflight",
            "Gateway requests in flight per backend.",
            ["backend"],
            registry=r,
        )

    def answered(self, model: str | None, status: int) -> None:
        self.requests.labels(model or "-", str(status)).inc()

    def upstream_outcome(self, backend: Backend, outcome: str) -> None:
        self.upstream.labels(backend.url, outcome).inc()
        self.inflight.labels(backend.url).set(backend.inflight)
        pool = self.gateway.pools.get(backend.model)
        if pool is not None:
            self.ejections.labels(backend.model).set(pool.outliers.ejections_total)

    def breaker_changed(self, backend: Backend, to: BreakerState) -> None:
        self.breaker.labels(backend.url).set(BREAKER_VALUE[to])
        self.breaker_transitions.labels(backend.url, to.value).inc()

    def health_changed(self, backend: Backend, healthy: bool) -> None:
        self.healthy.labels(backend.url).set(1 if healthy else 0)

    def retried(self, n: int) -> None:
        if n:
            self.retries.inc(n)

    def watch_gates(self, gates: dict[str, PoolGate]) -> None:
        waiting = Gauge(
            "poise_gateway_queue_waiting",
            "Requests waiting in the gateway's admission queue.",
            ["model"],
            registry=self.registry,
        )
        admitted = Gauge(
            "poise_gateway_admitted",
            "Requests let through to a pool and not yet finished.",
            ["model"],
            registry=self.registry,
        )
        for model, gate in gates.items():
            waiting.labels(model).set_function(lambda g=gate: len(g.line))
            admitted.labels(model).set_function(lambda g=gate: g.admitted)

    def ratelimit_fallback(self) -> None:
        self.limits_fallback.inc()

    def admission_refused(self, model: str, reason: str) -> None:
        self.admission.labels(model, reason).inc()

    def stream_resumed(self, ok: bool) -> None:
        self.resumes.labels("resumed" if ok else "failed").inc()

    def rate_limited(self, limit: str) -> None:
        self.limited.labels(limit).inc()

    def fell_back(self, model: str, fallback: str) -> None:
        self.fallbacks.labels(model, fallback).inc()
