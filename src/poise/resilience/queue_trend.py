"""Whether a long queue drains or fills: a burst is served, a flood is shed.

A queue is good when it drains. A batch job that sends 64 requests at once makes them wait
behind each other for a while, and refusing any of them gains nothing: no more are coming than
the server starts, and the last of them is answered sooner than if it had been refused and sent
again. A queue is bad when it stands or grows because more arrive than start: every newcomer
then waits longer than the one before, and refusing early is what keeps the admitted requests
inside their objective. CoDel (Nichols and Jacobson) tells the two apart by time alone: it acts
only when the queueing delay has stayed above its target for a whole interval. A replica knows
more than a router's buffer does, namely how many requests arrived (refused ones too: they are
demand) and how many started, so here the trend is counted rather than inferred from the delay.

The rules, for a queue whose newcomers are predicted to wait past the target (a *long* queue):

- A long queue that begins while arrivals are calm begins as a **burst**: the requests that
  arrived together just before it turned long, and those that keep arriving together after
  (each within ``burst_gap_s`` of the one before, for at most ``burst_max_s``), are its
  members. A batch job's requests sent at once reach a server within a millisecond or two of
  each other; a flood's arrive spread out. Members are not refused for their wait (their own
  deadline still holds), and a burst is bounded, so they are not counted as demand afterwards:
  arrivals and starts are both counted from its end, and what follows it is judged on its own.
- Afterwards the queue is **filling** while the requests that arrived over the last
  ``interval_s`` (refused or not) outnumber those that started by more than ``slack`` plus
  ``margin`` of the starts. Only then are newcomers that would wait past the target refused. A
  queue that drains (a burst being served, a closed loop of clients that each send again when
  answered) is not filling, however long it is.
- A long queue that begins while the queue is filling begins no burst: under a flood the queue
  hovers around its target, and an allowance at each crossing would let the flood in by turns.

No library counts this: rate limiters bound arrivals alone, and CoDel implementations act on
packets' sojourn times. Pure, with the clock injected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrendConfig:
    interval_s: float = 5.0  # arrivals and starts are compared over this much of the past
    burst_gap_s: float = 0.02  # a burst's members arrive at most this far apart ...
    burst_max_s: float = 1.0  # ... and within this long of its first
    margin: float = 0.1  # arrivals may exceed starts by this share of the starts ...
    slack: int = 2  # ... plus this many, before the queue counts as filling

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.burst_gap_s < 0 or self.burst_max_s < 0:
            raise ValueError(
                "interval_s must be positive, burst_gap_s and burst_max_s not negative"
            )
        if self.margin < 0 or self.slack < 0:
            raise ValueError("margin and slack must not be negative")


class QueueTrend:
    def __init__(self, config: TrendConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._arrivals: deque[float] = deque()  # arrival times, a burst's members left out
        self._starts: deque[float] = deque()
        self._long = False
        self._last_arrival = float("-inf")
        self._together_since = float("-inf")  # the first of the arrivals coming together now
        self._burst_since: float | None = None  # the first member of the burst going on
        self._counted_from = float("-inf")  # nothing before this counts: a burst ended then

    # ----- what happens -----
    def arrival(self, count: int, long: bool) -> None:
        """``count`` requests arrived together; ``long``: they would wait past the target."""
        now = self.clock()
        c = self.config
        previous, self._last_arrival = self._last_arrival, now
        if now - previous > c.burst_gap_s:
            self._together_since = now
        if self._burst_since is not None:
            if (
                self._together_since == self._burst_since
                and now - self._burst_since <= c.burst_max_s
            ):
                return  # a member of the burst going on
            self._burst_since = None
            self._counted_from = previous  # it ended with the arrival before this one
        self._prune(now)
        if not long:
            self._long = False
        elif not self._long:
            self._long = True
            # Calm is judged without the arrivals that came together with this one: a burst's
            # first members found the queue short and were counted before it turned long.
            head = self._together_since
            if not self._exceeds(sum(1 for t in self._arrivals if t < head)):
                while self._arrivals and self._arrivals[-1] >= head:
                    self._arrivals.pop()
                self._burst_since = head
                return
        self._arrivals.extend([now] * count)

    def start(self) -> None:
        """A waiting request started."""
        now = self.clock()
        self._prune(now)
        self._starts.append(now)

    # ----- what it says -----
    @property
    def in_burst(self) -> bool:
        """The last arrival was a member of a burst (and nothing has ended it since)."""
        return self._burst_since is not None

    @property
    def filling(self) -> bool:
        self._prune(self.clock())
        return self._exceeds(len(self._arrivals))

    def counts(self) -> tuple[int, int]:
        """(arrivals counted, starts) over the last interval."""
        self._prune(self.clock())
        return len(self._arrivals), len(self._starts)

    @property
    def state(self) -> str:
        """short, burst, filling or draining: for metrics and /debug/state."""
        if not self._long:
            return "short"
        if self.in_burst:
            return "burst"
        return "filling" if self.filling else "draining"

    # ----- inside -----
    def _exceeds(self, arrivals: int) -> bool:
        c = self.config
        starts = len(self._starts)
        return arrivals > starts + c.slack + c.margin * starts

    def _prune(self, now: float) -> None:
        # A burst's members are not demand to hold against what follows it: arrivals and
        # starts are both counted from its end, so the queue it made drains on its own.
        horizon = max(now - self.config.interval_s, self._counted_from)
        for times in (self._arrivals, self._starts):
            while times and times[0] <= horizon:
                times.popleft()
