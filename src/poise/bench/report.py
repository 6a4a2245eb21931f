"""A benchmark's arithmetic: per-request records in, the summary out. Pure.

Definitions (as vLLM's ``benchmark_serving`` and DistServe use them):
- TTFT: send to the first content chunk; ITL: the gaps between content chunks;
- TPOT = (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- SLO attainment: the share of *completed* requests meeting every given SLO;
- goodput: completed requests meeting every SLO, per second of the run.
Rejected (429/503) and failed requests are reported apart and count as missing the SLO in
goodput's numerator, so shedding can never hide inside it: goodput counts what clients got.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from poise.resilience.success import RunSuccess

REJECTED_STATUS = frozenset({429, 503})


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in seconds from the run's start."""

    sent_at: float
    status: int  # 0: no HTTP answer (connection error)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    error: str | None = None
    # How it failed, when it did: "status" (an HTTP error), "error_event" (an error in the
    # stream), "refused" (no connection), "dropped" (the connection broke), "truncated" (the
    # stream ended without [DONE]), "timeout" (no whole answer in time), "bad_payload".
    failure: str | None = None
    attempts: int | None = None  # upstream attempts, from a gateway's x-poise-attempt-count
    connect_retries: int = 0  # resends after a connection failed before any answer
    drop_resends: int = 0  # of those, after an accepted connection broke (not a refused one)
    abandoned: bool = False  # the client walked away on purpose (chaos)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.e2e_s is not None

    @property
    def rejected(self) -> bool:
        return self.status in REJECTED_STATUS

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        if not self.completed or n is None or n < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=1,tpot=0.1,e2e=20`` (seconds; ``ms`` suffix for milliseconds)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, raw = part.partition("=")
            if name not in ("ttft", "tpot", "e2e") or not raw:
                raise ValueError(f"bad SLO {part!r}: want ttft=, tpot= or e2e= in seconds")
            values[name + "_s"] = float(raw[:-2]) / 1000 if raw.endswith("ms") else float(raw)
        return cls(**values)

    def met_by(self, r: Record) -> bool:
        if not r.completed:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        tpot = r.tpot_s
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        return self.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= self.e2e_s)


@dataclass(frozen=True, slots=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Stats | None:
        if not values:
            return None
        s = sorted(values)
        return cls(sum(s) / len(s), _pct(s, 50), _pct(s, 90), _pct(s, 99))


def _pct(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    duration_s: float
    sent: int
    completed: int
    rejected: int
    failed: int
    request_throughput: float  # completed per second
    output_token_throughput: float
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    slo_attainment: float | None  # among completed; None without an SLO
    goodput: float | None  # requests per second meeting the SLO; None without an SLO
    success: RunSuccess | None = None  # formula 2's prediction beside the share that completed

    def with_success(self, success: RunSuccess) -> Summary:
        return replace(self, success=success)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: list[Record], duration_s: float, slo: SLO | None = None) -> Summary:
    done = [r for r in records if r.completed]
    rejected = sum(r.rejected for r in records)
    good = sum(slo.met_by(r) for r in done) if slo is not None else None
    tokens = sum(r.output_tokens or 0 for r in done)
    return Summary(
        duration_s=duration_s,
        sent=len(records),
        completed=len(done),
        rejected=rejected,
        failed=len(records) - len(done) - rejected,
        request_throughput=len(done) / duration_s,
        output_token_throughput=tokens / duration_s,
        ttft=Stats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Stats.of([t for r in done if (t := r.tpot_s) is not None]),
        itl=Stats.of([g for r in done for g in r.itl_s]),
        e2e=Stats.of([r.e2e_s for r in done if r.e2e_s is not None]),
        slo_attainment=None if good is None or not done else good / len(done),
        goodput=None if good is None else good / duration_s,
    )
