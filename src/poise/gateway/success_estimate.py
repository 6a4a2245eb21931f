"""The gateway's live formula 2 (``poise.resilience.success``): each component's counts, over a
sliding window for the live estimate and since start for whoever compares two readings.

Fed where things happen: a request's end (its model, its outcome, its duration), each attempt's
verdict on a backend and whether it was the request's first, each rate-limit check against
Redis, each turn to the answer cache. Read by ``/metrics`` (the estimate per model), by
``/debug/state`` (the estimate with its terms, and the running totals ``poise chaos`` and
``poise bench`` take the difference of over a run).
"""

from __future__ import annotations

import bisect
import secrets
from collections import deque
from collections.abc import Callable

from poise.gateway.config import GatewaySettings
from poise.gateway.record import RequestRecord
from poise.gateway.stream import MAX_RESUMES
from poise.resilience.success import (
    LATENCY_BOUNDS,
    Estimate,
    SuccessPolicy,
    Tally,
    estimate,
)

WINDOW_S = 60.0  # the live estimate's memory: a minute, as a rate over 1m would be
SLOT_S = 5.0  # the window moves by this much: it spans the last 60 to 65 s
REFRESH_S = 1.0  # an estimate is computed at most this often (a scrape, /debug/state polls)
# Attempt verdicts that count against a backend; "overloaded" is a 429; "deadline" is the
# request's own time running out (the deadline term's), not the backend's.
_FAILED = frozenset({"error", "timeout", "connect_error"})
# How each failure is recovered (``Outcome.done``'s ``recovery``), as BackendCounts counts it.
_RECOVERED_BY = {"retry": "failed", "move": "moved", "resume": "broken", "none": "final"}
# Request outcomes that are neither a success nor the system's failure: the client's doing (a
# request over its key's quota included).
_NOT_COUNTED = frozenset({"client_error", "client_gone", "rate_limited"})


def policy_of(settings: GatewaySettings) -> SuccessPolicy:
    r = settings.retry
    return SuccessPolicy(
        timeout_s=None,  # each request against its own deadline: every completed one met it
        max_retries=r.max_retries,
        budget_ratio=r.budget_ratio,
        budget_min_per_s=r.budget_min_per_s,
        budget_window_s=r.budget_window_s,
        max_resumes=MAX_RESUMES,
        fallbacks={name: tuple(m.fallback) for name, m in settings.models.items()},
    )


class SuccessTallies:
    def __init__(self, policy: SuccessPolicy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self.started = clock()
        self.boot = secrets.token_hex(8)  # this run's: totals of another start from zero
        self._slots: deque[tuple[float, Tally]] = deque()
        self._retired = Tally()  # the slots that have left the window, for the totals
        self._estimated: tuple[float, dict[str, Estimate]] | None = None

    def _slot(self) -> Tally:
        """The current slot, where an event is counted (once: the totals are summed on
        reading)."""
        now = self.clock()
        if not self._slots or now - self._slots[-1][0] >= SLOT_S:
            self._slots.append((now, Tally()))
            while self._slots and now - self._slots[0][0] >= WINDOW_S + SLOT_S:
                self._retired.add(self._slots.popleft()[1])
        return self._slots[-1][1]

    # ----- events -----
    def finished(self, record: RequestRecord) -> None:
        if record.model is None or record.outcome in _NOT_COUNTED:
            return
        outcome = record.outcome
        m = self._slot().model(record.model)
        m.requests += 1
        if outcome == "ok" and record.e2e_s is not None:
            m.latency[bisect.bisect_left(LATENCY_BOUNDS, record.e2e_s)] += 1
        elif outcome == "timeout":
            m.missed_deadline += 1

    def refused(self, model: str, reason: str) -> None:
        """The admission queue refused a request (it ends as one more ``finished``). One whose
        deadline passed while it waited ends as a timeout: the deadline term counts it."""
        if reason == "deadline":
            return
        self._slot().model(model).refused += 1

    def sent(self, model: str, routed: bool) -> None:
        """A request was sent to the model's pool (``routed``: it found a backend there)."""
        m = self._slot().model(model)
        m.sent += 1
        m.unroutable += not routed

    def attempted(self, model: str, backend: str, outcome: str, first: bool, recovery: str) -> None:
        if outcome == "ok":
            kind = "ok"
        elif outcome == "overloaded":
            kind = "overloaded" if recovery == "move" else "final"
        elif outcome in _FAILED:
            kind = _RECOVERED_BY[recovery]
        else:
            return  # the request's deadline: not the backend's doing
        b = self._slot().model(model).backend(backend)
        b.first += first
        setattr(b, kind, getattr(b, kind) + 1)

    def limits_checked(self, redis_answered: bool) -> None:
        """A rate-limit check with Redis configured: Redis answered it, or the local limits."""
        tally = self._slot()
        tally.redis_checks += 1
        tally.redis_failed += not redis_answered

    def cache_tried(self, model: str, answered: bool) -> None:
        m = self._slot().model(model)
        m.cache_tried += 1
        m.cache_answered += answered

    # ----- readings -----
    def window(self) -> Tally:
        """The slots begun within the last ``WINDOW_S + SLOT_S`` (the time since start, if
        less), as one tally."""
        now = self.clock()
        span = WINDOW_S + SLOT_S
        out = Tally()
        for at, slot in self._slots:
            if now - at < span:
                out.add(slot)
        out.seconds = min(span, now - self.started)
        return out

    def totals(self) -> Tally:
        """Everything since the gateway started; ``seconds``: its time since."""
        out = Tally(boot=self.boot)
        out.add(self._retired)
        for _, slot in self._slots:
            out.add(slot)
        out.seconds = self.clock() - self.started
        return out

    def estimates(self) -> dict[str, Estimate]:
        """Formula 2 per model over the window, computed at most once each ``REFRESH_S``."""
        now = self.clock()
        if self._estimated is None or now - self._estimated[0] >= REFRESH_S:
            self._estimated = (now, estimate(self.window(), self.policy))
        return self._estimated[1]
