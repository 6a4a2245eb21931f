"""Rate limits in requests and tokens per minute: GCRA, checked and taken atomically.

GCRA (the generic cell rate algorithm) keeps one number per key and limit, the *theoretical
arrival time* (TAT): when the bucket would be empty again if nothing more came. A request of
cost ``c`` moves it to ``max(TAT, now) + c·T`` (``T`` = seconds per unit) and is allowed while
that stays within the burst window ``burst·T`` of now. Unlike a fixed window it has no edge at
which twice the limit can pass, and unlike a token bucket it needs no refill timer.

A request is checked against all its limits (per key and per model, requests and tokens) and
takes from all or none, so a request refused by its token limit does not spend a request slot.
Tokens are estimated at admission (prompt + max_tokens) and reconciled when the request ends:
``adjust`` gives back what was not used or charges what was used beyond the estimate.

The state is a plain dict so that the same arithmetic runs in Redis where several gateways must
share one budget (``poise.gateway.redis_gcra``). No library offered multi-limit atomic GCRA
with reconciliation and OpenAI's ``x-ratelimit-*`` numbers; it is small and pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limit:
    per_minute: float
    burst: float | None = None  # how much may pass at once; default: a minute's worth

    def __post_init__(self) -> None:
        if not self.per_minute > 0:
            raise ValueError("a rate limit must be positive")
        if self.burst is not None and self.burst < 1:
            raise ValueError("a burst must be at least 1")

    @property
    def interval_s(self) -> float:
        return 60.0 / self.per_minute

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else self.per_minute


@dataclass(frozen=True, slots=True)
class Charge:
    """One limit a request must pass: ``key`` names the bucket (e.g. ``key:alice:tokens``)."""

    key: str
    limit: Limit
    cost: float
    kind: str = "requests"  # requests | tokens: which x-ratelimit-* headers it feeds


@dataclass(frozen=True, slots=True)
class LimitState:
    kind: str
    limit: float
    remaining: float
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float  # 0 when allowed; inf when the cost exceeds the burst itself
    refused_by: str | None  # the key of the first limit that refused
    states: tuple[LimitState, ...]

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, from the tightest limit of each kind."""
        out: dict[str, str] = {}
        for kind in ("requests", "tokens"):
            states = [s for s in self.states if s.kind == kind]
            if not states:
                continue
            tight = min(states, key=lambda s: s.remaining / s.limit)
            out[f"x-ratelimit-limit-{kind}"] = str(int(tight.limit))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(tight.remaining + 1e-6)))
            out[f"x-ratelimit-reset-{kind}"] = f"{tight.reset_s:.3f}s"
        if not self.allowed and math.isfinite(self.retry_after_s):
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def gcra(tat: float, now: float, charge: Charge) -> tuple[bool, float, float, LimitState]:
    """One limit: (allowed, new TAT if taken, retry after, state after). Pure arithmetic."""
    t = charge.limit.interval_s
    window = charge.limit.capacity * t
    base = max(tat, now)
    new_tat = base + charge.cost * t
    allowed = new_tat - now <= window + 1e-9
    if charge.cost > charge.limit.capacity:
        retry = math.inf
    else:
        retry = 0.0 if allowed else new_tat - now - window
    after = new_tat if allowed else base
    state = LimitState(
        kind=charge.kind,
        limit=charge.limit.capacity,
        remaining=max(0.0, (window - (after - now)) / t),
        reset_s=max(0.0, after - now),
    )
    return allowed, new_tat, retry, state


class RateLimiter:
    """In-process limits; one gateway's view. Keys unused for a long time are forgotten."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._tat: dict[str, float] = {}
        self._last_sweep = clock()

    def check(self, charges: Sequence[Charge]) -> RateDecision:
        now = self.clock()
        self._sweep(now)
        results = [gcra(self._tat.get(c.key, now), now, c) for c in charges]
        refused = [(c, r) for c, r in zip(charges, results, strict=True) if not r[0]]
        if refused:
            return RateDecision(
                False,
                max(r[2] for _, r in refused),
                refused[0][0].key,
                tuple(r[3] for r in results),
            )
        for c, r in zip(charges, results, strict=True):
            self._tat[c.key] = r[1]
        return RateDecision(True, 0.0, None, tuple(r[3] for r in results))

    def adjust(self, charge: Charge) -> None:
        """Reconcile: a positive cost charges more, a negative one gives back (never below now)."""
        now = self.clock()
        tat = max(now, self._tat.get(charge.key, now))
        self._tat[charge.key] = max(now, tat + charge.cost * charge.limit.interval_s)

    def _sweep(self, now: float) -> None:
        # A TAT in the past means a full bucket, the same as no entry: drop them now and then.
        if now - self._last_sweep < 60.0:
            return
        self._last_sweep = now
        for key in [k for k, tat in self._tat.items() if tat <= now]:
            del self._tat[key]
