"""The autoscaling decision (SPEC formula 5): how many replicas the load needs, now.

    desired = ceil( α · (λ + Q / T) / μ )

λ is the arrival rate, Q the requests waiting, T the target latency (the backlog must drain
within it), μ one replica's service rate and α a safety factor. (Replicas take time to
start, and a backlog cannot drain before they serve; planning the drain over the start-up time
instead of T was tried in ``benchmarks/autoscale_sim.py`` and lost attainment in spikes for
little saving, so the formula stays as it is.)

μ is measured, not configured: while requests wait (every replica busy), completions per
replica per second *is* the service rate; while nothing waits, throughput is only a floor
under it. Until the first measurement a prior serves, and without one the size holds: no queue
means no evidence that more is needed.

The recommendation then goes through what keeps Kubernetes' HPA from flapping: a change within
``tolerance`` of the current count is no change; scaling up is immediate, scaling down takes
the highest recommendation of the last ``scale_down_window_s`` (so one quiet moment does not
drain a replica that the next burst needs); and the answer stays within the bounds.

Pure: the clock is injected, and the caller feeds counters (arrivals, completions) it reads
anywhere - a gateway, a simulation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    target_latency_s: float = 2.0  # T: a backlog must drain within this
    safety_factor: float = 1.2  # α
    min_replicas: int = 1
    max_replicas: int = 8
    scale_down_window_s: float = 120.0
    tolerance: float = 0.1
    rate_halflife_s: float = 5.0  # smoothing of λ
    service_halflife_s: float = 30.0  # smoothing of μ
    service_rate_prior: float | None = None  # μ until it is measured

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscale: 1 <= min_replicas <= max_replicas")
        if self.target_latency_s <= 0 or self.safety_factor <= 0:
            raise ValueError("autoscale: target_latency_s and safety_factor must be positive")
        if self.scale_down_window_s < 0 or not 0 <= self.tolerance < 1:
            raise ValueError("autoscale: scale_down_window_s >= 0 and 0 <= tolerance < 1")


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int  # what to run now
    recommended: int  # this instant's recommendation, before the scale-down window
    raw: float | None  # α·(λ + Q/T)/μ before rounding; None until μ is known
    arrival_rate: float  # λ, requests per second
    service_rate: float | None  # μ, requests per second per replica
    queue: float  # Q
    replicas: int  # what was running when it was decided
    reason: str


def _blend(old: float | None, new: float, dt: float, halflife_s: float) -> float:
    if old is None or halflife_s <= 0:
        return new
    keep = 0.5 ** (dt / halflife_s)
    return keep * old + (1 - keep) * new


class Autoscaler:
    def __init__(self, config: AutoscaleConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.arrival_rate = 0.0
        self._started = clock()
        self.service_rate: float | None = config.service_rate_prior
        self._measured = False
        self._throughput: float | None = None  # completions per replica per second, smoothed
        self._last: tuple[float, int, int] | None = None  # time, arrivals, completions
        self._first_reading = 0.0
        self._history: deque[tuple[float, int]] = deque()  # (time, recommendation)
        self._queue = 0.0
        self._replicas = config.min_replicas
        self.desired = config.min_replicas

    def observe(
        self,
        arrivals_total: int,
        completed_total: int,
        waiting: float,
        replicas: int,
        starting: int = 0,
    ) -> None:
        """One reading at ``clock()``: the counters (monotonic totals), the backlog, the
        replicas serving, and those started but not serving yet (they count towards the size
        the deployment already has, not towards what it completes)."""
        now = self.clock()
        self._queue = max(0.0, waiting)
        self._replicas = max(0, replicas) + max(0, starting)
        if self._last is not None:
            t0, a0, c0 = self._last
            dt = now - t0
            if dt <= 0:
                return
            c = self.config
            arrivals, done = max(0, arrivals_total - a0), max(0, completed_total - c0)
            first_rate = self._last[0] == self._first_reading
            self.arrival_rate = _blend(
                None if first_rate else self.arrival_rate, arrivals / dt, dt, c.rate_halflife_s
            )
            if replicas > 0:
                per_replica = done / dt / replicas
                self._throughput = _blend(self._throughput, per_replica, dt, c.service_halflife_s)
                if waiting > 0 and done > 0:
                    # Saturated: what they complete is what they can complete.
                    first = not self._measured
                    self.service_rate = _blend(
                        None if first else self.service_rate, per_replica, dt, c.service_halflife_s
                    )
                    self._measured = True
                elif self._measured and self._throughput > (self.service_rate or 0.0):
                    # Idle capacity: a floor under what saturation measured. Never a value of
                    # its own: with replicas half idle, throughput per replica is λ/N, and
                    # α·λ/(λ/N) = α·N would ask for more replicas for ever.
                    self.service_rate = self._throughput
        else:
            self._first_reading = now
        self._last = (now, arrivals_total, completed_total)

    def decide(self) -> Decision:
        c, now = self.config, self.clock()
        current = self._replicas
        mu = self.service_rate
        if mu is None or mu <= 0:
            recommended, raw, reason = max(current, c.min_replicas), None, "no service rate yet"
        else:
            drain = self._queue / c.target_latency_s
            raw = c.safety_factor * (self.arrival_rate + drain) / mu
            recommended = math.ceil(raw - 1e-9)
            reason = "load"
            if current > 0 and abs(raw / current - 1) <= c.tolerance:
                recommended, reason = current, "within tolerance"
        recommended = min(c.max_replicas, max(c.min_replicas, recommended))
        self._history.append((now, recommended))
        while self._history and self._history[0][0] < now - c.scale_down_window_s:
            self._history.popleft()
        desired = recommended
        if recommended < current:
            # Down only as far as every recommendation of the window allows, and not before a
            # whole window has been seen (a scaler that just started knows too little).
            if now - self._started < c.scale_down_window_s:
                desired = current
            else:
                desired = min(current, max(r for _, r in self._history))
            if desired > recommended:
                reason = "scale-down window"
        self.desired = desired
        return Decision(
            desired, recommended, raw, self.arrival_rate, mu, self._queue, current, reason
        )
