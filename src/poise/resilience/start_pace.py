"""How fast the waiting requests of one kind start: the measured pace behind a predicted wait.

A replica's waiting requests are of two kinds that start at different paces. Typical ones start
as running slots and a step's prompt room allow, a few per step. A request much larger than the
typical one (a long prompt and output) waits for room in the KV pool, and on a short pool the
engine starts the smaller ones past it: it starts when a request as large as itself ends, every
few seconds at best. Measured together, the gaps between typical starts while a large request
was held counted as the pace of the queue (on a short pool, half a second between short
arrivals read as half a second per request ahead) and short requests were refused for waits
they did not have; the large requests, for their part, were promised the typical pace and
admitted in numbers that then waited past their deadlines. So each kind keeps its own pace.

An interval between two starts of a kind counts only while a request of that kind waited
throughout (idle time says nothing of capacity, and neither does the first start after it:
that is a step's latency, shared by all that arrive together), and none older than
``max_age_s`` (a slow spell long past would otherwise refuse today's work, and refusals make no
samples to correct it). How long the kind's waiting requests have gone without a start bounds
any newcomer's wait from below: a stalled engine, or large requests that never find room, stop
being promised an old, fast pace.

Pure, with the clock injected; no library measures a pace this way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class StartPace:
    def __init__(self, window: int, max_age_s: float, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.max_age_s = max_age_s
        self._intervals: deque[tuple[float, float]] = deque(maxlen=window)  # (at, seconds)
        self._last_start: float | None = None
        self._waited_since_last_start = False

    def queued(self, at: float) -> None:
        """One of this kind began to wait where none of it was waiting: a stall is timed
        from here, and the first start after it is no interval."""
        self._last_start = at
        self._waited_since_last_start = False

    def started(self, still_waiting: bool) -> None:
        """One of this kind started; ``still_waiting``: others of its kind wait on."""
        now = self.clock()
        if self._last_start is not None and self._waited_since_last_start:
            self._intervals.append((now, max(0.0, now - self._last_start)))
        self._last_start = now
        self._waited_since_last_start = still_waiting

    @property
    def mean_interval_s(self) -> float | None:
        horizon = self.clock() - self.max_age_s
        while self._intervals and self._intervals[0][0] < horizon:
            self._intervals.popleft()
        if not self._intervals:
            return None
        return sum(s for _, s in self._intervals) / len(self._intervals)

    def interval_s(self, waiting: bool) -> float | None:
        """The mean interval, the interval still open counted as one more where it is already
        longer: starts of large requests come in clumps (several when a long one ends, then
        none for seconds), and the mean of the closed intervals alone promised the clump's
        pace in the middle of a gap."""
        mean = self.mean_interval_s
        stalled = self.stalled_s(waiting)
        if mean is None:
            return None
        if stalled <= mean:
            return mean
        return (mean * len(self._intervals) + stalled) / (len(self._intervals) + 1)

    def stalled_s(self, waiting: bool) -> float:
        """How long this kind's waiting requests (``waiting``: there are some) have gone
        without a start: a lower bound on a newcomer's wait behind them.

        Not multiplied by the requests ahead: an engine starts the waiting requests of a step
        together, so a pause between starts says the next batch is late, not that each
        request ahead will take that long again."""
        if waiting and self._last_start is not None:
            return self.clock() - self._last_start
        return 0.0
