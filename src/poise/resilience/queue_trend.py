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

- The queue is **filling** while the requests that arrived over the last ``interval_s`` (refused
  or not) outnumber those *served* by more than a slack plus ``margin`` of the served; or do
  so over the last ``long_interval_s`` while the short interval still holds more arrivals than
  served (so a flood that is over leaves no hangover). Served are the requests that started,
  or those that finished where more did: when a batch shrinks faster than its queue's prefills
  start, the room is there all the same. A closed loop of clients that each send again when
  answered sends a wave as a wave of answers ends; counted against starts alone, that wave
  looked like a flood on a host whose prefills start a request a few times a second, and its
  refusals (each sent again, and counted again) kept the loop refused while one request
  waited. The slack is ``slack_s`` of starts at the measured pace, at least one request and at
  most ``slack``: on a slow host two requests are seconds of waiting. The longer window
  catches an excess too small for the short one to show there: at about 1.5x the capacity of
  a host that starts a request a second, a 5 s window held about three arrivals more than
  starts, short of the slack and margin one arrival in three, and each such arrival was
  admitted to wait seconds past the target. Only while the queue fills are newcomers that
  would wait past the target refused. A queue that drains (a burst being served, a closed
  loop) is not filling, however long it is. A request refused for its own size (a smaller one
  would have been taken) is withdrawn from the count: it is no demand on the queue the
  smaller ones join.
- A **burst** is a run of arrivals, each within ``burst_gap_s`` of the one before, that began
  while arrivals were calm (the queue not filling), at least ``burst_min`` strong and coming
  ``burst_factor`` times faster than the server starts requests or more (any such run while
  that rate is unknown). A batch job's requests sent at once reach a server hundreds a second,
  even through a gateway on a busy machine; a flood of interactive clients arrives at a few
  times the service rate. While a run is fast enough but still short of ``burst_min`` it has
  the benefit of the doubt; once it is seen to be a burst, its members and those that keep
  coming in the same run, for up to ``burst_max_s``, are not refused for their wait (their own
  deadline still holds). A burst is bounded, so its members are not counted as demand: arrivals
  and starts are both counted from its end, and what follows it is judged on its own.
- A run that begins while requests of a better priority are coming (over the last interval) is
  no burst either: this priority gets only what they leave, its start rate says little, and a
  batch flood's first half second let in fifty requests per replica that then waited out the
  flood behind the interactive traffic and failed at their deadlines.
- A run that begins while the queue is filling is no burst: under a flood the queue hovers
  around its target, and an allowance at each crossing would let the flood in by turns.
- Once a whole priority has been refused for load, a gateway in front holds such requests back
  for a moment (they never arrive): the queue then counts as filling for ``shed_s`` whatever
  the counts say (``shed``), a few of the gateway's holds; under a flood the next refusal
  renews it. (Held for a whole interval, one marginal refusal after a flood renewed itself:
  each refused the next interactive request that would wait a little past the target, while
  as many started as arrived.)

No library counts this: rate limiters bound arrivals alone, and CoDel implementations act on
packets' sojourn times. Pure, with the clock injected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrendConfig:
    interval_s: float = 5.0  # arrivals and those served are compared over this much ...
    long_interval_s: float = 20.0  # ... and over this much
    margin: float = 0.1  # arrivals may exceed the served by this share of them ...
    slack: int = 2  # ... plus at most this many, before the queue counts as filling: ...
    slack_s: float = 0.25  # ... this long of starts at the measured pace (at least one)
    burst_gap_s: float = 0.1  # a burst's members arrive at most this far apart ...
    burst_min: int = 8  # ... at least this many of them ...
    burst_factor: float = 5.0  # ... this many times faster than requests start, or more ...
    burst_max_s: float = 0.5  # ... and its members come within this long of its first
    shed_s: float = 1.0  # after a whole priority is refused, filling for this long

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.burst_gap_s < 0 or self.burst_max_s < 0 or self.shed_s < 0:
            raise ValueError(
                "interval_s must be positive, burst_gap_s, burst_max_s and shed_s not negative"
            )
        if self.long_interval_s < self.interval_s:
            raise ValueError("long_interval_s must be at least interval_s")
        if self.margin < 0 or self.slack < 1 or self.slack_s < 0 or self.burst_min < 1:
            raise ValueError("margin and slack_s >= 0, slack and burst_min >= 1")
        if self.burst_factor < 0:
            raise ValueError("burst_factor must not be negative")


class QueueTrend:
    def __init__(self, config: TrendConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        horizons = (config.interval_s, config.long_interval_s)
        self._arrivals = _Times(horizons)  # a burst's members left out
        self._starts = _Times(horizons)  # since the last burst ended
        self._finishes = _Times(horizons)  # of requests that had started; the same way
        self._service_rate: float | None = None  # requests started per second, last told
        self._long = False
        self._last_arrival = float("-inf")
        self._run_since = float("-inf")  # the first of the run of arrivals going on
        self._run_size = 0
        self._run_calm = False  # the queue was not filling when the run began
        self._dense = False  # the run comes fast enough to be a burst
        self._burst = False  # the run is a burst
        self._shedding_until = float("-inf")  # filling, whatever the counts, until then

    # ----- what happens -----
    def arrival(
        self, count: int, long: bool, service_rate: float | None = None, outranked: bool = False
    ) -> None:
        """``count`` requests arrived together; ``long``: they would wait past the target;
        ``service_rate``: requests started per second while busy, when known; ``outranked``:
        requests of a better priority are coming too, and this one's start rate is only what
        they leave (no run that begins now is a burst)."""
        now = self.clock()
        self._prune(now)
        previous, self._last_arrival = self._last_arrival, now
        self._long = long
        self._service_rate = service_rate  # None: not measured lately, nor kept from then
        new_run = now - previous > self.config.burst_gap_s
        if self._burst:
            if not new_run and now - self._run_since <= self.config.burst_max_s:
                self._run_size += count
                return  # a member of the burst going on
            self._end_burst(previous)
        if new_run:
            self._run_since, self._run_size = now, 0
            self._run_calm = not outranked and not self._filling_at(now)
        self._run_size += count
        self._dense = self._run_is_dense(now, service_rate)
        self._arrivals.add(now, count)
        if self._run_calm and self._dense and self._run_size >= self.config.burst_min:
            self._burst = True  # its members so far are no demand either
            self._arrivals.drop_since(self._run_since)

    def withdraw(self, count: int) -> None:
        """The last ``count`` arrivals were refused for their own size, not for the queue: a
        smaller request would have been taken, so they are no demand on the queue the smaller
        ones join (long prompts refused on a short KV pool made it look filling, and the
        short requests beside them were refused for waits of half a second)."""
        self._arrivals.drop_last(count)

    def shed(self) -> None:
        """A whole priority was refused for load: a gateway in front now holds such requests
        back for a moment, and they never arrive here. The demand is there all the same, so
        the queue counts as filling for ``shed_s``, and no run is a burst meanwhile."""
        self._shedding_until = self.clock() + self.config.shed_s

    def start(self) -> None:
        """A waiting request started."""
        now = self.clock()
        self._prune(now)
        self._starts.add(now)

    def finish(self) -> None:
        """A request that had started ended (answered, aborted, failed)."""
        now = self.clock()
        self._prune(now)
        self._finishes.add(now)

    # ----- what it says -----
    @property
    def bursting(self) -> bool:
        """The last arrival belongs to a run seen to be a burst (not merely given the doubt)."""
        return self._burst

    @property
    def in_burst(self) -> bool:
        """The last arrival belongs to a burst, or to a run that may still prove to be one."""
        return self._burst or (
            self._run_calm and self._dense and self._run_size < self.config.burst_min
        )

    @property
    def filling(self) -> bool:
        return self.filling_past(())

    def filling_past(self, passed: Sequence[float]) -> bool:
        """Filling for a newcomer that will start past the requests that arrived at ``passed``
        (waiting for room it does not need): their arrivals are left out."""
        now = self.clock()
        self._prune(now)
        return self._filling_at(now, passed)

    @property
    def active(self) -> bool:
        """Requests of this priority arrived or started over the last interval."""
        self._prune(self.clock())
        horizon = self.config.interval_s
        return bool(self._arrivals.count(horizon) or self._starts.count(horizon))

    @property
    def quiet(self) -> bool:
        """Nothing counted over the long interval, no burst going on and no shedding:
        forgetting it loses nothing."""
        now = self.clock()
        self._prune(now)
        # A burst ends only at its priority's next arrival: long after its last member, it is
        # over all the same.
        burst_over = now - self._last_arrival > self.config.burst_max_s
        return (
            not self._arrivals.count(self.config.long_interval_s)
            and not self._starts.count(self.config.long_interval_s)
            and not self._finishes.count(self.config.long_interval_s)
            and (not self._burst or burst_over)
            and now >= self._shedding_until
        )

    @property
    def last_arrival(self) -> float:
        return self._last_arrival

    def counts(self, long: bool = False) -> tuple[int, int]:
        """(arrivals, served) counted over the last interval (``long``: the long one)."""
        self._prune(self.clock())
        horizon = self.config.long_interval_s if long else self.config.interval_s
        return self._arrivals.count(horizon), self._served(horizon)

    def filling_over(self) -> float | None:
        """The interval over which the counts say the queue fills (the short one first), or
        None (it may still count as filling after a shed)."""
        now = self.clock()
        self._prune(now)
        return self._filling_over(now, ())

    @property
    def state(self) -> str:
        """burst, short, filling or draining: for metrics and /debug/state."""
        if self._burst and self.clock() - self._last_arrival <= self.config.burst_gap_s:
            return "burst"
        if not self._long:
            return "short"
        return "filling" if self.filling else "draining"

    # ----- inside -----
    def _run_is_dense(self, now: float, service_rate: float | None) -> bool:
        """The run comes ``burst_factor`` times faster than requests start (any run, while
        that rate is unknown)."""
        if service_rate is None:
            return True
        span = max(now - self._run_since, 1e-3)
        return self._run_size / span >= self.config.burst_factor * service_rate

    def _end_burst(self, last_member: float) -> None:
        self._burst = False
        self._run_calm = False  # a run that outlasts its burst is a flood, not a second burst
        # Demand is counted from its end: the starts before it served the burst.
        self._starts.drop_until(last_member)
        self._finishes.drop_until(last_member)
        self._arrivals.clear()

    def _slack(self) -> float:
        c = self.config
        if self._service_rate is None:
            return float(c.slack)
        return max(1.0, min(float(c.slack), c.slack_s * self._service_rate))

    def _filling_at(self, now: float, passed: Sequence[float] = ()) -> bool:
        return now < self._shedding_until or self._filling_over(now, passed) is not None

    def _filling_over(self, now: float, passed: Sequence[float]) -> float | None:
        """The window whose counts say the queue fills: the short one; else the long one,
        while the short one still holds more arrivals than served (a flood that is over
        leaves no hangover)."""
        short, long = self.config.interval_s, self.config.long_interval_s
        excess = self._excess(now, short, passed)
        if excess > self._allowed(short):
            return short
        if excess > 0 and self._excess(now, long, passed) > self._allowed(long):
            return long
        return None

    def _allowed(self, horizon: float) -> float:
        """How far arrivals may outnumber those served over ``horizon`` before the queue
        fills: the slack plus the margin of the served."""
        return self._slack() + self.config.margin * self._served(horizon)

    def _served(self, horizon: float) -> int:
        """Starts over ``horizon``, or answers where more ended: a batch that shrank made
        room its queue will take, however slowly the newcomers' prefills start."""
        return max(self._starts.count(horizon), self._finishes.count(horizon))

    def _excess(self, now: float, horizon: float, passed: Sequence[float]) -> int:
        """Arrivals over those served in the last ``horizon``, less arrivals at ``passed``."""
        since = now - horizon
        arrivals = self._arrivals.count(horizon) - sum(1 for t in passed if t > since)
        return arrivals - self._served(horizon)

    def _prune(self, now: float) -> None:
        self._arrivals.prune(now)
        self._starts.prune(now)
        self._finishes.prune(now)


class _Times:
    """The times of events over each of a few horizons, a queue per horizon, so that each count
    is a length: under a flood of hundreds a second, counting one long queue's tail on every
    arrival would cost more than the admission decision itself."""

    def __init__(self, horizons: Sequence[float]) -> None:
        self.horizons = tuple(horizons)
        self._times = {h: deque[float]() for h in self.horizons}

    def add(self, at: float, count: int = 1) -> None:
        for times in self._times.values():
            times.extend([at] * count)

    def count(self, horizon: float) -> int:
        return len(self._times[horizon])

    def drop_last(self, count: int) -> None:
        for times in self._times.values():
            for _ in range(min(count, len(times))):
                times.pop()

    def drop_since(self, since: float) -> None:
        for times in self._times.values():
            while times and times[-1] >= since:
                times.pop()

    def drop_until(self, until: float) -> None:
        for times in self._times.values():
            while times and times[0] <= until:
                times.popleft()

    def clear(self) -> None:
        for times in self._times.values():
            times.clear()

    def prune(self, now: float) -> None:
        for horizon, times in self._times.items():
            while times and times[0] <= now - horizon:
                times.popleft()


# Trends kept for priorities seen lately; past this many, those that have gone quiet are
# dropped (a client may send any priority value), and past the hard bound the one longest
# without an arrival.
_MAX_TRENDS = 16
_HARD_MAX_TRENDS = 256


class PriorityTrends:
    """A ``QueueTrend`` per priority: a flood of batch work fills its own queue, not the
    interactive one beside it. Requests of a priority queue behind those of a better one, so
    a priority's queue fills when its own arrivals outrun its starts or a better one's do."""

    def __init__(self, config: TrendConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._trends: dict[int, QueueTrend] = {}

    def of(self, priority: int) -> QueueTrend:
        trend = self._trends.get(priority)
        if trend is None:
            if len(self._trends) >= _MAX_TRENDS:
                for p in [p for p, t in self._trends.items() if t.quiet]:
                    del self._trends[p]
            if len(self._trends) >= _HARD_MAX_TRENDS:
                del self._trends[min(self._trends, key=lambda p: self._trends[p].last_arrival)]
            trend = self._trends[priority] = QueueTrend(self.config, self.clock)
        return trend

    def __len__(self) -> int:
        return len(self._trends)

    def outranked(self, priority: int) -> bool:
        """Requests of a better priority arrived or started over the last interval (their
        answers ending take nothing from this one)."""
        return any(p < priority and t.active for p, t in self._trends.items())

    def filling(self, priority: int, passed: Sequence[float] = ()) -> bool:
        """Whether the queue a newcomer of this priority joins fills: its own priority's, left
        out the arrivals (at ``passed``) it will start past, or a better one's."""
        return any(
            t.filling_past(passed if p == priority else ())
            for p, t in self._trends.items()
            if p <= priority
        )

    def counts(self, priority: int | None = None, long: bool = False) -> tuple[int, int]:
        """(arrivals, served: see ``QueueTrend.counts``) of this priority and better (None:
        of all) over the last interval (``long``: the long one)."""
        pairs = [
            t.counts(long) for p, t in self._trends.items() if priority is None or p <= priority
        ]
        return sum(a for a, _ in pairs), sum(s for _, s in pairs)

    def filling_over(self, priority: int) -> float:
        """The interval over which this priority's queue (or a better one's) fills, for a
        refusal's message: the short one unless only the long one says so."""
        found = [t.filling_over() for p, t in self._trends.items() if p <= priority]
        return min((h for h in found if h is not None), default=self.config.interval_s)

    @property
    def state(self) -> str:
        """The most pressing state of any priority (filling, burst, draining, short)."""
        states = {t.state for t in self._trends.values()}
        return next((s for s in ("filling", "burst", "draining") if s in states), "short")
