"""Latency per backend, as the routing cost of a peak-EWMA balancer.

Failures, open breakers and failed health checks all miss one fault: a backend that answers
every request correctly, only ten times slower. Two policies see it.

*Routing* (``LatencyTracker.cost``), as Finagle's and Linkerd's peak-EWMA balancers: each
backend keeps a peak EWMA of its time to first token (TTFT) and of its time per output token
(TPOT). A value above the estimate replaces it at once (the peak); a lower one pulls it down
with weight ``1 - exp(-dt/tau)``, dt the time since the last one, so that the estimate is
pessimistic at once and forgiving slowly. Work still outstanding counts too: a request that
has waited longer than the estimate for its first token, or a stream whose current gap
between tokens is longer than the estimate, raises it to that age, since a backend that has
stopped produces no observations at all.

Only requests of typical size time a backend (``LatencyConfig.large_factor``): a long prompt's
first token takes its prefill, or its wait for KV room, whatever the backend's speed, and a long
request preempted for short ones has a gap of seconds. When one replica happened to hold the
long requests of kv-exhaustion, its TTFT read 6-7 s and the other took every short request
until its pool ran out. A large request's tokens still show the backend alive, and its open
wait counts, but for no longer than the backend has gone without giving any stream a token:
a hung backend is seen as before, one that holds a long request for room while it streams to
the others is not. So with a request that a better priority outranks (the router says which:
at a poise replica, while the gateway has a better one in flight): the replica pauses and
preempts it for the better one, and a batch flood's requests waiting seconds there read as a
slow replica, which sent the interactive requests beside them elsewhere.

The cost is the backend's estimate relative to the
pool's median, a dimensionless multiplier of the pool's load score::

    score = cost × (inflight + waiting + 1) / weight

(Linkerd's ``ewma × (pending + 1)``, in units the pool's other terms already use: a backend
as fast as the pool's median costs 1, one ten times slower costs as ten requests in flight.
The ``+ 1`` is what lets an idle slow backend lose against an idle fast one.)

Taking a slow backend out of rotation is ``slow_ejection``'s business, on these estimates.

Pure: the clock is injected; no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType


class TimeEwma:
    """An exponentially weighted moving average whose weights follow time, not counts.

    A new value ``x`` observed ``dt`` seconds after the previous one moves the estimate by
    ``(x - estimate) × (1 - exp(-dt/tau_s))``: a value that stood for long counts for much,
    a burst of values in the same instant barely more than one. The first value is taken as
    it is. The base of ``PeakEwma``; symmetric, it suits a smoothed value that may be
    pulled up as easily as down.
    """

    __slots__ = ("_at", "_value", "clock", "count", "tau_s")

    def __init__(self, tau_s: float, clock: Callable[[], float]) -> None:
        if not tau_s > 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self.clock = clock
        self._value: float | None = None
        self._at: float | None = None
        self.count = 0  # values observed since the last reset

    @property
    def value(self) -> float | None:
        """The estimate; None before the first value."""
        return self._value

    @property
    def at(self) -> float | None:
        """When the last value was observed; None before the first."""
        return self._at

    def observe(self, x: float) -> None:
        if math.isnan(x):
            raise ValueError("an observation cannot be NaN")
        x = max(0.0, x)  # a clock that stepped back must not make a negative latency
        now = self.clock()
        if self._value is None or self._at is None:
            self._value = x
        else:
            weight = math.exp(-max(0.0, now - self._at) / self.tau_s)  # of the old estimate
            self._value = self._blend(self._value, x, weight)
        self._at = now
        self.count += 1

    def _blend(self, old: float, x: float, weight: float) -> float:
        return old * weight + x * (1.0 - weight)

    def estimate(self, pending_s: float = 0.0) -> float | None:
        """The estimate, raised to ``pending_s``: the age of work outstanding, a lower bound
        on the value it will bring. None when there is neither."""
        return _raised(self._value, pending_s)

    def reset(self) -> None:
        self._value = None
        self._at = None
        self.count = 0


class PeakEwma(TimeEwma):
    """Finagle's peak EWMA: a value above the estimate becomes the estimate at once; a lower
    one pulls it down as ``TimeEwma`` does. Right after an observation the estimate is never
    below it: quick to believe a backend got slow, slow to believe it got fast."""

    __slots__ = ()

    def _blend(self, old: float, x: float, weight: float) -> float:
        if x > old:
            return x
        return max(x, old * weight + x * (1.0 - weight))  # never below it, rounding included


# Served requests' sizes known before any request counts as large.
SIZES_KNOWN = 8


def _raised(value: float | None, pending_s: float) -> float | None:
    if value is None:
        return pending_s if pending_s > 0 else None
    return max(value, pending_s)


def median_or_none(values: Iterable[float]) -> float | None:
    vs = list(values)
    return statistics.median(vs) if vs else None


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    # Linkerd's and Finagle's decay: a slow moment steers traffic away for some seconds.
    tau_s: float = 10.0
    # The ejection signal: the median TPOT of this many seconds of observations (the last
    # ones there are), at most ``window_max`` of them. A backend that turns slow is seen once
    # its slow tokens outnumber the fast ones of the window: within about ``window_s``.
    window_s: float = 1.0
    window_max: int = 256
    # Below these, differences do not steer routing: 8 ms against 16 ms per token is noise
    # of a small model, not a slow backend.
    ttft_floor_s: float = 0.05
    tpot_floor_s: float = 0.02
    # No floor on the cost: the floors above already bound how cheap a fast backend gets, and
    # with one median for all, two backends' costs stand in the ratio of their estimates, as
    # in Linkerd. A ceiling keeps one hung stream's age from swamping the other terms.
    max_cost: float = 100.0
    # An estimate nobody has confirmed for this long is forgotten: a backend avoided for being
    # slow gets tried again, and an idle one's old value does not judge the others.
    stale_s: float = 60.0
    probe_history: int = 8  # probe latencies kept per backend
    # Only a request of typical size times a backend: at most ``large_factor`` times the
    # median size of the pool's last ``sizes_window`` requests served (its body, which grows
    # with its prompt).
    large_factor: float = 2.0
    sizes_window: int = 64

    def __post_init__(self) -> None:
        if self.tau_s <= 0 or self.window_s <= 0 or self.stale_s <= 0:
            raise ValueError("tau_s, window_s and stale_s must be positive")
        if self.window_max < 1:
            raise ValueError("window_max must be at least 1")
        if self.ttft_floor_s <= 0 or self.tpot_floor_s <= 0:
            raise ValueError("latency floors must be positive")
        if self.max_cost < 1:
            raise ValueError("max_cost must be at least 1")
        if self.probe_history < 1 or self.sizes_window < 1:
            raise ValueError("probe_history and sizes_window must be at least 1")
        if self.large_factor < 1:
            raise ValueError("large_factor must be at least 1")


@dataclass(slots=True)
class _Series:
    ttft: PeakEwma
    tpot: PeakEwma
    recent: deque[tuple[float, float]]  # (when observed, seconds per token)
    probe: PeakEwma
    probes: deque[tuple[float, float]]  # (when observed, seconds)
    streams: set[StreamTimer] = field(default_factory=set)
    tpot_count: int = 0  # TPOT observations since added or reset
    progress_at: float | None = None  # when any token last came from it; None: never


class StreamTimer:
    """Times one attempt's stream on one backend: TTFT from its start to the first tokens,
    TPOT from each later read. While it is open its age counts as outstanding work.

    Call ``tokens(n)`` once per read from the backend with the number of output tokens it
    brought (events without tokens: 0, or do not call): the events of one read arrive
    together, and timing each of them would add zeros. ``close()`` when the attempt ends,
    however it ends; a context manager does that.
    """

    __slots__ = (
        "_read_at", "_tracker", "backend_s", "closed", "count", "last", "longest_wait", "size",
        "started", "untimed", "url",
    )  # fmt: skip

    def __init__(
        self,
        tracker: LatencyTracker,
        url: str,
        started: float,
        size: int | None = None,
        outranked: bool = False,
    ) -> None:
        self._tracker = tracker
        self.url = url
        self.started = started
        self.size = size  # the request's (its body's length); None: not known
        # Times nothing: a large request (``LatencyConfig.large_factor``), or an outranked one
        # (``LatencyTracker.stream``).
        self.untimed = outranked or tracker.is_large(size)
        self.last: float | None = None  # when tokens last came; None: none yet
        self.count = 0  # output tokens so far
        # Time spent waiting on the backend's reads, and the longest such wait. A relay blocked
        # on a slow client does not read, so this is the backend's time, not the client's.
        self.backend_s = 0.0
        self.longest_wait = 0.0
        self._read_at: float | None = started  # the first read (to the first byte) is under way
        self.closed = False

    def read_begun(self) -> None:
        self._read_at = self._tracker.clock()

    def read_ended(self) -> None:
        if self._read_at is not None:
            wait = self._tracker.clock() - self._read_at
            self._read_at = None
            self.backend_s += wait
            self.longest_wait = max(self.longest_wait, wait)

    def tokens(self, n: int = 1) -> None:
        if self.closed or n <= 0:
            return
        now = self._tracker.clock()
        if self.last is None:
            self._tracker.served(self.size)
        if self.untimed:
            self._tracker.progress(self.url)
        elif self.last is None:
            self._tracker.observe_ttft(self.url, now - self.started)
        else:
            self._tracker.observe_tpot(self.url, (now - self.last) / n)
        self.count += n
        self.last = now

    def waits(self, now: float) -> tuple[float, float]:
        """(all the time spent waiting on the backend, the longest wait), counting a read
        still under way at ``now``."""
        current = 0.0 if self._read_at is None else now - self._read_at
        return self.backend_s + current, max(self.longest_wait, current)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._tracker._close(self)

    def __enter__(self) -> StreamTimer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LatencyTracker:
    """Latency estimates per backend URL and the routing cost they give.

    Observations for a URL not added (or removed) are ignored, so that a late one cannot bring
    a departed backend back.
    """

    def __init__(
        self,
        config: LatencyConfig,
        clock: Callable[[], float],
        backends: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.clock = clock
        self._series: dict[str, _Series] = {}
        self._sizes: deque[int] = deque(maxlen=config.sizes_window)  # the latest requests'
        for url in backends:
            self.add(url)

    def add(self, url: str) -> None:
        if url in self._series:
            return
        c, clock = self.config, self.clock
        self._series[url] = _Series(
            PeakEwma(c.tau_s, clock),
            PeakEwma(c.tau_s, clock),
            deque(maxlen=c.window_max),
            PeakEwma(c.tau_s, clock),
            deque(maxlen=c.probe_history),
        )

    def remove(self, url: str) -> None:
        self._series.pop(url, None)

    def __contains__(self, url: object) -> bool:
        return url in self._series

    @property
    def urls(self) -> list[str]:
        return list(self._series)

    # -- observations ------------------------------------------------------------------------

    def observe_ttft(self, url: str, seconds: float) -> None:
        s = self._series.get(url)
        if s is not None:
            s.ttft.observe(seconds)
            s.progress_at = self.clock()

    def observe_tpot(self, url: str, seconds: float) -> None:
        """Seconds per output token, as seen between two reads of a stream."""
        s = self._series.get(url)
        if s is not None:
            s.tpot.observe(seconds)
            s.recent.append((self.clock(), max(0.0, seconds)))
            s.tpot_count += 1
            s.progress_at = self.clock()

    def observe_probe(self, url: str, seconds: float) -> None:
        """A successful health probe's latency (a one-token generation). Kept apart from the
        traffic's series: a probe skips the queue and pays a round trip, so it is compared
        only with other probes. Failed probes are not observed; the health loop judges them."""
        s = self._series.get(url)
        if s is not None:
            s.probe.observe(seconds)
            s.probes.append((self.clock(), max(0.0, seconds)))

    def stream(self, url: str, size: int | None = None, outranked: bool = False) -> StreamTimer:
        """A timer for one attempt's stream, started now; ``size``: the request's (its body's
        length), which decides whether the stream times the backend (``large_factor``).
        ``outranked``: a better priority was being served when it began (``Pool.outranked``);
        it times nothing either, as a large one: its wait for a first token and its gaps are
        what its rank costs, not the backend's speed."""
        timer = StreamTimer(self, url, self.clock(), size, outranked)
        s = self._series.get(url)
        if s is not None:
            s.streams.add(timer)
        return timer

    def is_large(self, size: int | None) -> bool:
        """Whether a request of ``size`` is more than ``large_factor`` times the median of the
        latest served (False while fewer than a handful are known, or with no size)."""
        sizes = self._sizes
        if size is None or len(sizes) < SIZES_KNOWN:
            return False
        return size > self.config.large_factor * statistics.median(sizes)

    def served(self, size: int | None) -> None:
        """A request of ``size`` got its first token: one of the sizes "typical" is read from
        (served ones: a refused attempt comes back many times)."""
        if size is not None:
            self._sizes.append(size)

    def progress(self, url: str) -> None:
        """A token came from ``url`` that times nothing (a large or outranked request's)."""
        s = self._series.get(url)
        if s is not None:
            s.progress_at = self.clock()

    def _close(self, timer: StreamTimer) -> None:
        s = self._series.get(timer.url)
        if s is not None:
            s.streams.discard(timer)

    def reset(self, url: str) -> None:
        """Forget the traffic's estimates (a backend back from ejection starts afresh, not
        with the slowness it was ejected for). Probes and open streams stay."""
        s = self._series.get(url)
        if s is not None:
            s.ttft.reset()
            s.tpot.reset()
            s.recent.clear()
            s.tpot_count = 0

    # -- estimates ---------------------------------------------------------------------------

    def _fresh(self, series: TimeEwma) -> float | None:
        if series.at is None or self.clock() - series.at > self.config.stale_s:
            return None
        return series.value

    def _pending(self, s: _Series) -> tuple[float, float]:
        """The oldest wait for a first token, and the longest current gap between tokens; a
        large or outranked request's no longer than the backend has gone without giving any
        stream a token."""
        now = self.clock()
        idle = math.inf if s.progress_at is None else now - s.progress_at
        first = gap = 0.0
        for t in s.streams:
            wait = now - (t.started if t.last is None else t.last)
            if t.untimed:
                wait = min(wait, idle)
            if t.last is None:
                first = max(first, wait)
            else:
                gap = max(gap, wait)
        return first, gap

    def ttft(self, url: str) -> float | None:
        """Peak-EWMA time to first token, raised to the oldest wait for one."""
        s = self._series.get(url)
        if s is None:
            return None
        first, _ = self._pending(s)
        return _raised(self._fresh(s.ttft), first)

    def tpot(self, url: str) -> float | None:
        """Peak-EWMA time per output token, raised to the longest gap now open."""
        s = self._series.get(url)
        if s is None:
            return None
        _, gap = self._pending(s)
        return _raised(self._fresh(s.tpot), gap)

    def recent_tpot(self, url: str) -> float | None:
        """The ejection signal: the median TPOT of the observations in the ``window_s`` up to
        the newest one; None when there is none, or the newest is stale. Observations only,
        no outstanding work: a client reading slowly holds its stream's gap open too, and
        that is not the backend's fault. An idle backend keeps the value it last had."""
        s = self._series.get(url)
        if s is None or not s.recent:
            return None
        newest = s.recent[-1][0]
        if self.clock() - newest > self.config.stale_s:
            return None
        since = newest - self.config.window_s
        return statistics.median(v for at, v in s.recent if at >= since)

    def tpot_samples(self, url: str) -> int:
        """TPOT observations since the backend was added or last reset."""
        s = self._series.get(url)
        return 0 if s is None else s.tpot_count

    def probe(self, url: str) -> float | None:
        """Peak-EWMA probe latency."""
        s = self._series.get(url)
        return None if s is None else self._fresh(s.probe)

    def probes(self, url: str, since: float = -math.inf) -> list[tuple[float, float]]:
        """The kept probe latencies observed at or after ``since``: (when, seconds), oldest
        first."""
        s = self._series.get(url)
        return [] if s is None else [p for p in s.probes if p[0] >= since]

    def cost(self, url: str) -> float:
        """The load-score multiplier: ``max(ttft ratio, tpot ratio)``, each ratio this
        backend's estimate (outstanding work included) over the pool's median estimate, both
        first raised to the floor; at most ``max_cost``. 1.0 without data. The median is over
        all backends, this one included: with one reference for all, the costs of any two
        stand in the ratio of their estimates.

        Use as ``score = cost(url) × (inflight + waiting + 1) / weight``.
        """
        s = self._series.get(url)
        if s is None:
            return 1.0
        c = self.config
        mine = (self.ttft(url), self.tpot(url))
        refs = (
            median_or_none(
                v for o in self._series.values() if (v := self._fresh(o.ttft)) is not None
            ),
            median_or_none(
                v for o in self._series.values() if (v := self._fresh(o.tpot)) is not None
            ),
        )
        ratios = [
            max(m, floor) / max(ref if ref is not None else floor, floor)
            for m, ref, floor in zip(mine, refs, (c.ttft_floor_s, c.tpot_floor_s), strict=True)
            if m is not None
        ]
        if not ratios:
            return 1.0
        return min(c.max_cost, max(ratios))
