"""What one proxied request did: the record its metrics, log line and span are made from."""

from __future__ import annotations

from dataclasses import dataclass

from poise.protocol import APIError

# An APIError's code, as the outcome label of the request counter.
_OUTCOMES = {
    "rate_limit_exceeded": "rate_limited",
    "queue_full": "shed",
    "shed": "shed",
    "overloaded": "overloaded",
    "no_backend": "no_backend",
    "upstream_error": "upstream_error",
    "timeout": "timeout",
}


@dataclass(slots=True)
class RequestRecord:
    """What one request did, for its metrics, its log line and its span."""

    request_id: str
    path: str
    arrived: float  # perf_counter
    model: str | None = None
    key: str | None = None
    priority: int = 0
    # When its first token is due by its own objective (x-slo-ttft-ms), on the gateway's clock:
    # replicas spare a patient one when they shed its priority, and it waits in the gateway's
    # line no longer.
    first_token_by: float | None = None
    stream: bool = False
    status: int = 0
    outcome: str = "error"
    backend: str | None = None
    fallback: str | None = None
    retries: int = 0
    resumed: str | None = None  # how its stream was continued after a break, if it was
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    def failed(self, exc: APIError) -> None:
        self.status = exc.status
        default = "shed" if exc.status == 429 else "client_error" if exc.status < 500 else "error"
        self.outcome = _OUTCOMES.get(exc.code or "", default)
        self.error = str(exc.body()["error"]["message"])[:300]
