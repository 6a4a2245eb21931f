"""The gateway's Prometheus metrics (``poise_gateway_`` prefix, base units, bounded labels).

Events (requests, attempts, retries, sheds, probes) are counters and histograms moved where
they happen. Live state (queues, in flight, breakers, ejections, the retry budget, Redis) is read
at scrape time by a collector, so a gauge can never drift from the state it reports. The
registry is injected: two gateways in one process, or a test, never share one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from poise.gateway.autoscaling import Autoscaling
from poise.gateway.core import GatewayCore
from poise.gateway.record import RequestRecord
from poise.resilience.breaker import BreakerState
from poise.resilience.success import LATENCY_BOUNDS

if TYPE_CHECKING:
    from poise.gateway.pool import Backend


class MetricsSource(GatewayCore, Protocol):
    """What the scrape-time gauges read: the shared state and the autoscaling advice."""

    autoscaling: Autoscaling


BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
LATENCY_BUCKETS = LATENCY_BOUNDS  # formula 2 reads the same histogram
_VERSION = re.compile(r"v\d+")
MAX_ROUTES = 64  # distinct route labels; the bound on the series a client's paths can make
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, gateway: MetricsSource, registry: CollectorRegistry | None = None) -> None:
        self.gw = gateway
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "poise_gateway_requests",
            "Requests answered, by model, the backend that answered (- for none), outcome and "
            "route (the path, an id in it as {id}).",
            ["model", "backend", "outcome", "route"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "poise_gateway_queue_wait_seconds",
            "Time in the gateway's admission queue before going to a pool.",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "poise_gateway_time_to_first_token_seconds",
            "From the request's arrival to the first byte of a streamed answer.",
            ["model", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "poise_gateway_request_duration_seconds",
            "From the request's arrival to its last byte, successful answers.",
            ["model", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream = Counter(
            "poise_gateway_upstream_attempts",
            "Attempts on backends, by outcome (ok, error, overloaded, timeout, connect_error, "
            "deadline).",
            ["backend", "outcome"],
            registry=r,
        )
        self.retries = Counter("poise_gateway_retries", "Retries made.", ["model"], registry=r)
        self.budget_exhausted = Counter(
            "poise_gateway_retry_budget_exhausted",
            "Retries not made because the gateway-wide retry budget was spent.",
            registry=r,
        )
        self.shed = Counter(
            "poise_gateway_shed",
            "Requests refused by the admission queue, by reason (shed, queue_full, queue_ttl, "
            "deadline, shedding: every backend refusing its priority for load a moment ago, "
            "slo_ttft: a request's first-token objective passed while it waited).",
            ["model", "reason"],
            registry=r,
        )
        self.limited = Counter(
            "poise_gateway_rate_limited",
            "Requests refused by a rate limit, by the limit (scope and kind).",
            ["limit"],
            registry=r,
        )
        self.fallbacks = Counter(
            "poise_gateway_fallbacks",
            "Requests answered by a fallback, by the model asked for and kind (model, cache).",
            ["model", "kind"],
            registry=r,
        )
        self.resumes = Counter(
            "poise_gateway_stream_migrations",
            "Streams continued on another backend after breaking mid-way, by result and mode "
            "(exact: from the token position, on deterministic poise replicas, greedy or "
            "seeded: the unbroken answer; position: from the token position without that "
            "guarantee; approximate: from the text sent, on another engine).",
            ["result", "mode"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "poise_gateway_breaker_transitions",
            "Circuit breaker state changes, by the state entered.",
            ["backend", "to"],
            registry=r,
        )
        self.probes = Counter(
            "poise_gateway_health_probes",
            "Active health checks, by backend and result (ok, failed).",
            ["backend", "result"],
            registry=r,
        )
        self.shared_errors = Counter(
            "poise_gateway_shared_verdict_errors",
            "Rounds of sharing breaker/ejection verdicts through Redis that failed.",
            registry=r,
        )
        self.remote_verdicts = Counter(
            "poise_gateway_remote_verdicts",
            "Backends taken out of rotation on another gateway's verdict.",
            registry=r,
        )
        self.limits_fallback = Counter(
            "poise_gateway_ratelimit_fallbacks",
            "Rate-limit checks that found Redis unreachable and fell back to local limits.",
            registry=r,
        )
        r.register(_LiveState(gateway))
        self._routes: set[str] = set()

    # ----- events -----
    def finished(self, record: RequestRecord) -> None:
        model = record.model or "-"
        route = self.route(record.path)
        self.requests.labels(model, record.backend or "-", record.outcome, route).inc()
        if record.queue_s is not None:
            self.queue_wait.labels(model).observe(record.queue_s)
        if record.outcome == "ok":
            if record.ttft_s is not None:
                self.ttft.labels(model, route).observe(record.ttft_s)
            if record.e2e_s is not None:
                self.e2e.labels(model, route).observe(record.e2e_s)
        if record.retries:
            self.retries.labels(model).inc(record.retries)
        if record.fallback is not None:
            self.fallbacks.labels(model, record.fallback.split(":")[0]).inc()
        self.gw.success.finished(record)

    def route(self, path: str) -> str:
        """The route label of a path: each segment that looks like an id (a digit in it, but
        not a version such as v1; or long) as ``{id}``; past ``MAX_ROUTES`` distinct ones (a
        client may send any path), "other"."""
        route = "/".join("{id}" if _is_id(s) else s for s in path.split("/"))
        if route not in self._routes:
            if len(self._routes) >= MAX_ROUTES:
                return "other"
            self._routes.add(route)
        return route

    def upstream_outcome(self, backend: Backend, outcome: str, first: bool, recovery: str) -> None:
        self.upstream.labels(backend.url, outcome).inc()
        self.gw.success.attempted(backend.model, backend.url, outcome, first, recovery)

    def retry_budget_exhausted(self) -> None:
        self.budget_exhausted.inc()

    def breaker_changed(self, backend: Backend, to: BreakerState) -> None:
        self.breaker_transitions.labels(backend.url, to.value).inc()

    def probed(self, backend: Backend, ok: bool) -> None:
        self.probes.labels(backend.url, "ok" if ok else "failed").inc()

    def ratelimit_fallback(self) -> None:
        self.limits_fallback.inc()

    def admission_refused(self, model: str, reason: str) -> None:
        self.shed.labels(model, reason).inc()
        self.gw.success.refused(model, reason)

    def stream_resumed(self, ok: bool, mode: str) -> None:
        self.resumes.labels("resumed" if ok else "failed", mode).inc()

    def rate_limited(self, limit: str) -> None:
        self.limited.labels(limit).inc()


def _is_id(segment: str) -> bool:
    if len(segment) > 40:
        return True
    return any(c.isdigit() for c in segment) and _VERSION.fullmatch(segment) is None


class _LiveState(Collector):
    """Gauges read from the gateway's state at scrape time."""

    def __init__(self, gateway: MetricsSource) -> None:
        self.gw = gateway

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gw = self.gw
        queued = GaugeMetricFamily(
            "poise_gateway_queued_requests",
            "Requests waiting in the admission queue.",
            labels=["model"],
        )
        inflight = GaugeMetricFamily(
            "poise_gateway_inflight_requests",
            "Requests let through to a pool and not yet finished.",
            labels=["model"],
        )
        backends = GaugeMetricFamily(
            "poise_gateway_backends", "Backends configured, by model.", labels=["model"]
        )
        ejected = GaugeMetricFamily(
            "poise_gateway_backends_ejected",
            "Backends ejected by outlier detection now, by model.",
            labels=["model"],
        )
        ejections = CounterMetricFamily(
            "poise_gateway_ejections", "Outlier ejections so far, by model.", labels=["model"]
        )
        for model, gate in gw.gates.items():
            queued.add_metric([model], len(gate.line))
            inflight.add_metric([model], gate.admitted)
        for model, pool in gw.pools.items():
            backends.add_metric([model], len(pool.backends))
            ejected.add_metric([model], sum(pool.outliers.is_ejected(b.url) for b in pool.backends))
            ejections.add_metric([model], pool.outliers.ejections_total)
        yield from (queued, inflight, backends, ejected, ejections)

        state = GaugeMetricFamily(
            "poise_gateway_breaker_state", "0 closed, 1 half-open, 2 open.", labels=["backend"]
        )
        healthy = GaugeMetricFamily(
            "poise_gateway_backend_healthy", "1 while active checks pass.", labels=["backend"]
        )
        busy = GaugeMetricFamily(
            "poise_gateway_backend_inflight",
            "Gateway attempts in flight per backend.",
            labels=["backend"],
        )
        for pool in gw.pools.values():
            for b in pool.backends:
                state.add_metric([b.url], BREAKER_VALUE[b.breaker.state])
                healthy.add_metric([b.url], 1.0 if b.healthy else 0.0)
                busy.add_metric([b.url], b.inflight)
        yield from (state, healthy, busy)

        yield GaugeMetricFamily(
            "poise_gateway_retries_in_flight",
            "Retries in flight now.",
            value=gw.budget.active_retries,
        )
        yield GaugeMetricFamily(
            "poise_gateway_retries_peak_concurrent",
            "The most retries ever in flight at once (the retry budget bounds it).",
            value=gw.budget.peak_retries,
        )
        yield from _autoscale_families(gw)
        predicted = GaugeMetricFamily(
            "poise_gateway_predicted_success_probability",
            "Formula 2: the probability that a request succeeds end to end, from each "
            "component's measured failures over the last minute (terms in /debug/state).",
            labels=["model"],
        )
        basis = GaugeMetricFamily(
            "poise_gateway_predicted_success_requests",
            "The requests of the last minute the predicted success probability is made from.",
            labels=["model"],
        )
        for model, e in gw.success.estimates().items():
            predicted.add_metric([model], e.probability)
            basis.add_metric([model], e.requests)
        yield from (predicted, basis)
        if gw.limits.shared is not None:  # only where Redis is configured
            yield GaugeMetricFamily(
                "poise_gateway_ratelimit_redis_up",
                "1 while shared (Redis) rate limits answer; 0 while limits are local.",
                value=float(gw.limits.redis_up),
            )


def _autoscale_families(gw: MetricsSource) -> Iterator[GaugeMetricFamily]:
    """Formula 5's inputs and output per model, for KEDA, an HPA or a person."""
    families = {
        "desired": GaugeMetricFamily(
            "poise_gateway_desired_replicas",
            "Replicas the load needs now (formula 5, after tolerance and the scale-down window).",
            labels=["model"],
        ),
        "arrival": GaugeMetricFamily(
            "poise_gateway_autoscale_arrival_rate",
            "Requests arriving per second (smoothed), formula 5's lambda.",
            labels=["model"],
        ),
        "service": GaugeMetricFamily(
            "poise_gateway_autoscale_service_rate",
            "Requests one replica completes per second, measured while requests wait (mu).",
            labels=["model"],
        ),
        "queue": GaugeMetricFamily(
            "poise_gateway_autoscale_queue",
            "Requests waiting: the gateway's queue and the backends' own (Q).",
            labels=["model"],
        ),
        "serving": GaugeMetricFamily(
            "poise_gateway_autoscale_serving_replicas",
            "Backends the gateway routes to, as the decision saw them.",
            labels=["model"],
        ),
    }
    for model, scaling in gw.autoscaling.models.items():
        d = scaling.decision
        if d is None:
            continue
        families["desired"].add_metric([model], d.desired)
        families["arrival"].add_metric([model], d.arrival_rate)
        if d.service_rate is not None:
            families["service"].add_metric([model], d.service_rate)
        families["queue"].add_metric([model], d.queue)
        families["serving"].add_metric([model], d.replicas)
    yield from families.values()
