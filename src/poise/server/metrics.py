"""Prometheus metrics of one replica, under vLLM's names so existing dashboards read them.

Gauges that mirror engine state (running, waiting, KV usage, prefix-cache counters) are read at
scrape time by a collector instead of being pushed from the step loop: the loop pays nothing and a
scrape always sees the current value. Latency histograms and outcome counters are updated by the
server as outputs arrive. Each app gets its own registry, so two apps in one process (tests) do
not collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from poise.engine.outputs import KVPicture

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    room_waits: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    step_errors: int
    seconds_since_progress: float
    healthy: bool
    ready: bool
    admission_waiting: int
    admission_waiting_tokens: int
    predicted_wait_s: float
    kv: KVPicture = field(default_factory=KVPicture)
    kv_headroom_blocks: int = 0  # free blocks less what running requests will grow into
    queue_state: str = "short"  # short, burst, draining, filling (resilience.queue_trend)


class _EngineCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model = model
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.snapshot()
        labels = ["model_name"]
        v = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(v, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(v, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV blocks held (0-1).", s.kv_usage)
        yield counter("vllm:num_preemptions", "Preemptions (recompute).", s.preemptions)
        yield counter(
            "poise_kv_cache_room_waits",
            "Requests held back at least once because the KV pool had no room for them.",
            s.room_waits,
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up.", s.prefix_queried_tokens
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found.", s.prefix_hit_tokens)
        yield counter("poise_engine_step_errors", "Engine steps that raised.", s.step_errors)
        yield gauge(
            "poise_engine_seconds_since_progress",
            "Seconds since the step loop last finished a step while it had work (0 when idle).",
            s.seconds_since_progress,
        )
        yield gauge(
            "poise_engine_healthy", "1 if the watchdog finds the engine healthy.", s.healthy
        )
        yield gauge(
            "poise_replica_ready",
            "1 when /ready says ready (loaded, not draining, healthy, not saturated).",
            s.ready,
        )
        yield gauge(
            "poise_admission_waiting_requests",
            "Requests admitted but not started.",
            s.admission_waiting,
        )
        yield gauge(
            "poise_admission_waiting_prompt_tokens",
            "Prompt tokens of requests admitted but not started.",
            s.admission_waiting_tokens,
        )
        yield gauge(
            "poise_admission_predicted_wait_seconds",
            "Predicted queueing time of a priority-0 request arriving now.",
            s.predicted_wait_s,
        )
        state = GaugeMetricFamily(
            "poise_admission_queue_state",
            "1 for the admission queue's state: short (no wait past the target), burst, "
            "draining (long, fewer arriving than starting) or filling (shedding).",
            labels=[*labels, "state"],
        )
        for name in QUEUE_STATES:
            state.add_metric([*v, name], float(s.queue_state == name))
        yield state
        yield gauge(
            "poise_kv_cache_unused_slots",
            "Token slots in KV blocks held by running requests that hold no token.",
            s.kv.unused_slots,
        )
        yield gauge(
            "poise_kv_cache_fragmentation_ratio",
            "Share of the token slots held by running requests that hold no token (0-1).",
            s.kv.fragmentation,
        )
        queued = GaugeMetricFamily(
            "poise_kv_cache_queued_blocks",
            "KV blocks the waiting requests need to start: never started, and preempted ones "
            "to be computed again (they hold none: their full blocks stay in the prefix cache "
            "until evicted).",
            labels=[*labels, "state"],
        )
        queued.add_metric([*v, "waiting"], s.kv.waiting_blocks)
        queued.add_metric([*v, "preempted"], s.kv.preempted_blocks)
        yield queued
        yield gauge(
            "poise_kv_cache_headroom_blocks",
            "Free KV blocks less those the running requests will still grow into.",
            s.kv_headroom_blocks,
        )


WAIT_ERROR_BUCKETS = (-2.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
QUEUE_STATES = ("short", "burst", "draining", "filling")
REFUSAL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1)


class ServerMetrics:
    def __init__(self, model: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self.registry.register(_EngineCollector(model, snapshot))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            m,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            m,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            m,
            registry=r,
            buckets=E2E_BUCKETS,
        )
        self.refusal_latency = Histogram(
            "poise_refusal_latency_seconds",
            "From the request reaching the app to its 429 leaving it: how fast refusals are.",
            m,
            registry=r,
            buckets=REFUSAL_BUCKETS,
        )
        self.wait_error = Histogram(
            "poise_admission_wait_error_seconds",
            "How much longer a request waited for its first token than admission predicted "
            "(negative: shorter).",
            m,
            registry=r,
            buckets=WAIT_ERROR_BUCKETS,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", m, registry=r
        )
        self.outcomes = Counter(
            "poise_requests_finished",
            "Engine requests by how they ended.",
            [*m, "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "poise_requests_rejected",
            "Requests refused before any work, by reason.",
            [*m, "reason"],
            registry=r,
        )
        self.http = Counter(
            "poise_http_responses",
            "HTTP responses by route and status.",
            [*m, "route", "status"],
            registry=r,
        )
        self.started_at = time.time()

    def finished(self, reason: str, prompt_tokens: int) -> None:
        self.outcomes.labels(self.model, reason).inc()
        if reason in ("stop", "length", "abort"):
            self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()
