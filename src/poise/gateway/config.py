"""The gateway's YAML: models and their backend pools, keys, limits, and every policy's knobs.

    models:                             # the first is the default: where a passthrough
      demo:                             # request naming no model goes (gateway.passthrough)
        backends:
          - url: http://127.0.0.1:8001
          - url: http://poise-replicas.default.svc:8000
            discovery: dns              # every address the name resolves to, re-resolved
            dns_refresh_s: 5
          - url: http://127.0.0.1:8002
            weight: 2
            api_key: secret-of-that-backend
            model: demo-v2                # the name that backend serves it under (optional)
          - url: http://127.0.0.1:8003
            kind: vllm                  # poise, vllm, sglang, llamacpp, tgi or openai;
                                        # detected when left out
        fallback: [demo-small]          # other models to try when this pool cannot serve
        cache_fallback: {max_entries: 1000, ttl_s: 600}   # then a stored deterministic answer
        requests_per_minute: 6000       # per-model limits (optional)
        tokens_per_minute: 2000000
    keys:                               # no keys: the gateway is open
      - key: sk-team-a
        name: team-a
        priority: 0                     # lower is more important, as in vLLM
        admin: false                    # true: may drain and restore backends remotely
        requests_per_minute: 600
        tokens_per_minute: 200000
    timeouts: {connect_s: 2, first_byte_s: 30, stream_idle_s: 30, total_s: 600}
    retry: {max_retries: 2, base_s: 0.05, cap_s: 2, budget_ratio: 0.2, budget_min_concurrent: 3,
            budget_window_s: 10, budget_min_per_s: 1}   # retries: <= 20 % of requests in
                                 # flight (or 3) and of those of the last 10 s (or 10)
    breaker: {failure_rate: 0.5, slow_call_rate: 0.8, slow_call_s: 10, slow_token_s: 1,
              min_calls: 10, open_s: 10}   # slow: silent 10 s, or over 10 s + 1 s a token
    ejection: {consecutive_failures: 5, base_s: 30, max_s: 300, max_ejected_share: 0.5}
    slow_ejection: {factor: 3, for_s: 1.5, min_tpot_s: 0.05}   # per-token time vs the others'
    health: {interval_s: 0.5, timeout_s: 1, healthy_after: 2, unhealthy_after: 2}
    admission: {max_inflight_per_backend: 64, max_backend_waiting: 64, max_queue: 512,
                queue_ttl_s: 0.3}               # a queue, best priority first, when saturated
    rate_limits: {redis_url: redis://127.0.0.1:6379/0}   # shared by every gateway; optional
    autoscale: {target_latency_s: 2, safety_factor: 1.2, min_replicas: 1, max_replicas: 8,
                scale_down_window_s: 120}      # the advice on /autoscale and in /metrics
    log_format: json                    # auto (console on a terminal), json or console
    log_levels: {poise.gateway.health: debug}
    otlp_endpoint: http://127.0.0.1:4318   # traces over OTLP/HTTP; off when unset

An invalid file fails at start with every problem named by its dotted key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, model_validator

from poise.config import read_config_file, validate_settings
from poise.gateway.backend_kind import Kind


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendSettings(_Strict):
    url: HttpUrl
    weight: float = Field(default=1.0, gt=0)
    api_key: str | None = None
    model: str | None = None  # the name this backend serves the model under, when different
    # Its engine: how it is probed, where its load is read, how its broken streams continue
    # (``backend_kind``). Left out: detected from what the server says about itself.
    kind: Kind | None = None
    # "dns": the URL's host names a set of backends, one per address it resolves to (as
    # Envoy's STRICT_DNS; a Kubernetes headless Service), resolved again every dns_refresh_s.
    discovery: Literal["static", "dns"] = "static"
    dns_refresh_s: float = Field(default=5.0, gt=0)

    @property
    def base(self) -> str:
        return str(self.url).rstrip("/")


class CacheFallbackSettings(_Strict):
    max_entries: int = Field(default=1000, ge=1)
    ttl_s: float = Field(default=600.0, gt=0)


class ModelSettings(_Strict):
    backends: list[BackendSettings] = Field(min_length=1)
    fallback: list[str] = Field(default_factory=list)
    # Last resort, opt-in: the stored answer to an identical deterministic request.
    cache_fallback: CacheFallbackSettings | None = None
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)


class KeySettings(_Strict):
    key: str = Field(min_length=8)
    name: str
    priority: int = 0
    admin: bool = False  # may use /admin/backends from anywhere (else: loopback only)
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)


class TimeoutSettings(_Strict):
    connect_s: float = Field(default=2.0, gt=0)
    first_byte_s: float = Field(default=60.0, gt=0)
    stream_idle_s: float = Field(default=30.0, gt=0)
    total_s: float = Field(default=600.0, gt=0)


class RetrySettings(_Strict):
    max_retries: int = Field(default=2, ge=0, le=10)
    base_s: float = Field(default=0.05, ge=0)
    cap_s: float = Field(default=2.0, ge=0)
    budget_ratio: float = Field(default=0.2, ge=0, le=1)
    budget_min_concurrent: int = Field(default=3, ge=0)
    budget_window_s: float = Field(default=10.0, gt=0)  # retries over it <= ratio x requests
    budget_min_per_s: float = Field(default=1.0, ge=0)  # ... or this many a second, if more


class BreakerSettings(_Strict):
    failure_rate: float = Field(default=0.5, gt=0, le=1)
    slow_call_rate: float = Field(default=0.8, gt=0, le=1)
    # Slow: silent this long (before the first byte, or mid-stream), or longer in all than
    # slow_call_s plus slow_token_s per output token. Never the length of an answer alone.
    slow_call_s: float = Field(default=30.0, gt=0)
    slow_token_s: float = Field(default=1.0, gt=0)
    window_size: int = Field(default=50, ge=1)
    window_s: float = Field(default=60.0, gt=0)
    min_calls: int = Field(default=10, ge=1)
    open_s: float = Field(default=10.0, gt=0)
    half_open_calls: int = Field(default=3, ge=1)


class EjectionSettings(_Strict):
    consecutive_failures: int = Field(default=5, ge=1)
    base_s: float = Field(default=30.0, gt=0)
    max_s: float = Field(default=300.0, gt=0)
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)
    jitter_s: float = Field(default=1.0, ge=0)


class SlowEjectionSettings(_Strict):
    """A backend whose time per output token stays ``factor`` times the others' is taken out
    (``poise.resilience.slow_ejection``); probes let it back once it is fast again."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1)
    for_s: float = Field(default=1.5, ge=0)
    min_tpot_s: float = Field(default=0.05, ge=0)  # never for a per-token time below this
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)
    base_s: float = Field(default=2.0, gt=0)
    max_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _times(self) -> SlowEjectionSettings:
        if self.base_s > self.max_s:
            raise ValueError("slow_ejection.base_s is above slow_ejection.max_s")
        return self


class HealthSettings(_Strict):
    # A stopped backend is out after two unanswered rounds: within about 3 s.
    interval_s: float = Field(default=0.5, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    healthy_after: int = Field(default=2, ge=1)
    unhealthy_after: int = Field(default=2, ge=1)
    generate_probe: bool = True  # a real one-token generation (else /health); see health


class RateLimitSettings(_Strict):
    redis_url: str | None = None  # shared limits across gateways; None: in-process only
    redis_timeout_s: float = Field(default=0.25, gt=0)
    redis_retry_s: float = Field(default=2.0, gt=0)  # after a failure, local limits this long
    key_prefix: str = "poise:rl:"


class AdmissionSettings(_Strict):
    max_inflight_per_backend: int = Field(default=64, ge=1)
    max_backend_waiting: float = Field(default=64, ge=0)  # a backend reporting more is full
    max_kv_usage: float = Field(default=0.98, gt=0, le=1)
    max_queue: int = Field(default=512, ge=0)
    # How long a request may wait here for room in a saturated pool (a share of a chat user's
    # 1 s time to first token); what cannot get through sooner is refused (429) while it can go
    # elsewhere. Poise replicas judge their own queues (bursts served, floods shed), so their
    # pools are bounded here by max_inflight_per_backend alone.
    queue_ttl_s: float = Field(default=0.3, gt=0)


class AutoscaleSettings(_Strict):
    """Formula 5's knobs: desired = ceil(α (λ + Q / T) / μ), μ measured."""

    target_latency_s: float = Field(default=2.0, gt=0)
    safety_factor: float = Field(default=1.2, gt=0)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=8, ge=1)
    scale_down_window_s: float = Field(default=120.0, ge=0)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    service_rate_prior: float | None = Field(default=None, gt=0)
    rate_halflife_s: float = Field(default=5.0, ge=0)  # smoothing of the arrival rate
    interval_s: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscale.min_replicas is above autoscale.max_replicas")
        return self


class GatewaySettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    models: dict[str, ModelSettings] = Field(min_length=1)
    keys: list[KeySettings] = Field(default_factory=list)
    timeouts: TimeoutSettings = TimeoutSettings()
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    ejection: EjectionSettings = EjectionSettings()
    slow_ejection: SlowEjectionSettings = SlowEjectionSettings()
    health: HealthSettings = HealthSettings()
    admission: AdmissionSettings = AdmissionSettings()
    rate_limits: RateLimitSettings = RateLimitSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    # A client that sends headers and then stalls is answered 408 this long after them.
    body_timeout_s: float = Field(default=30.0, gt=0)
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a terminal
    log_levels: dict[str, str] = Field(default_factory=dict)  # by logger name
    otlp_endpoint: str | None = None  # tracing off unless this or OTEL_EXPORTER_OTLP_ENDPOINT
    trace_content: bool = False  # record prompt text in spans

    @model_validator(mode="after")
    def _references(self) -> GatewaySettings:
        for name, model in self.models.items():
            for other in model.fallback:
                if other not in self.models:
                    raise ValueError(f"models.{name}.fallback names an unknown model {other!r}")
                if other == name:
                    raise ValueError(f"models.{name}.fallback names the model itself")
        seen: set[str] = set()
        for k in self.keys:
            if k.key in seen:
                raise ValueError(f"keys: the key of {k.name!r} is listed twice")
            seen.add(k.key)
        return self


def load_gateway_settings(path: str | Path | None, overrides: dict[str, Any]) -> GatewaySettings:
    raw = read_config_file(path) if path is not None else {}
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return validate_settings(GatewaySettings, raw, "gateway config")
