"""Taking a backend that answers correctly but slowly out of rotation.

Failures, open breakers and failed health checks all miss one fault: a backend that answers
every request correctly, only ten times slower. Routing by ``latency.LatencyTracker.cost``
sends it less; this takes it out.

``SlowOutlierDetector``, as Envoy's success-rate outlier detection with latency
instead of errors: a backend whose recent time per token stays above ``factor`` times the
median of the *other* backends for ``for_s``, on at least ``min_samples`` observations, and
above the absolute floor ``min_tpot_s``, is ejected. Its signal is not the routing's peak EWMA
but the median of the last ``window_s`` of observations: an ejection is costly, and a peak
that decays over ten seconds would turn one 300 ms stall into one, as would any average that
one stream stuck for twenty seconds can drag up. The median moves only when most recent
tokens were slow, which is what a slow engine does to every stream it runs.

An ejected backend receives no traffic, so no observations come to say it has recovered.
Probes do: the gateway's health loop times a one-token generation on every backend each
interval (``observe_probe``). An ejected backend returns once its ejection time (``base_s``,
doubling with each ejection, capped at ``max_s``) is over *and* its last ``readmit_probes``
probes were not slow against the other backends' probes. Coming back on a timer alone while
still slow would put requests on it again and again for as long as the fault lasts; gating
on probes keeps it out exactly while it is slow, and lets it back within two probe intervals
of its recovery. Without probes (none since the ejection, or none lately) it returns on the
timer, as Envoy's ejections do. As ``OutlierDetector``: never more than
``max_ejected_share`` of the pool out, never the last available backend.

Pure: the clock is the tracker's; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from poise.resilience.latency import LatencyTracker, median_or_none


@dataclass(frozen=True, slots=True)
class SlowEjectionConfig:
    factor: float = 3.0  # slower than this many times the others' median: an outlier
    for_s: float = 1.5  # for at least this long
    min_samples: int = 5  # on at least this many TPOT observations meanwhile
    min_tpot_s: float = 0.05  # and never below this: fast backends may differ by large ratios
    max_ejected_share: float = 0.5
    # The shortest ejection, doubling with each one. Short, because probes, not the timer,
    # decide when it is really back: the timer only keeps a flapping backend out a while.
    base_s: float = 2.0
    max_s: float = 30.0
    readmit_probes: int = 2  # consecutive probes that must not be slow before it returns
    min_probe_s: float = 0.1  # a probe this fast is never slow (it includes a round trip)
    # No probe since the ejection, or none this recent: no evidence, the timer alone decides.
    probe_stale_s: float = 10.0
    forgive_s: float = 60.0  # this long back in rotation and not slow: ejections forgotten

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError("factor must be above 1")
        if self.for_s < 0 or self.min_samples < 0 or self.min_tpot_s < 0 or self.min_probe_s < 0:
            raise ValueError("for_s, min_samples, min_tpot_s and min_probe_s must be >= 0")
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError("ejection times must satisfy 0 < base_s <= max_s")
        if not 0 <= self.max_ejected_share <= 1:
            raise ValueError("max_ejected_share must be in [0, 1]")
        if self.readmit_probes < 1 or self.probe_stale_s <= 0 or self.forgive_s <= 0:
            raise ValueError("readmit_probes, probe_stale_s and forgive_s must be positive")


@dataclass(slots=True)
class _Verdict:
    over_since: float | None = None  # slow against the others since; None: not now
    samples_at_over: int = 0  # the TPOT count then
    ratio: float = 0.0  # its latest ratio to the others' median, while over
    ejected_at: float | None = None  # None: in rotation
    ejected_until: float = 0.0  # the shortest stay out; probes may make it longer
    times_ejected: int = 0
    calm_since: float = 0.0  # in rotation and not over since


@dataclass(frozen=True, slots=True)
class SlowChanges:
    ejected: list[str] = field(default_factory=list)
    returned: list[str] = field(default_factory=list)


class SlowOutlierDetector:
    """Ejects backends whose time per token is an outlier; see the module's docstring.

    ``update`` judges and ejects: call it where routing decides (it is cheap for a pool of
    tens) and after each round of probes. ``is_ejected`` also lets a backend return, lazily,
    as ``OutlierDetector.is_ejected`` does.
    """

    def __init__(
        self,
        tracker: LatencyTracker,
        config: SlowEjectionConfig,
        backends: Iterable[str] = (),
    ) -> None:
        if config.readmit_probes > tracker.config.probe_history:
            raise ValueError("readmit_probes cannot exceed the probes the tracker keeps")
        self.tracker = tracker
        self.config = config
        self.clock = tracker.clock  # one clock for the estimates and the verdicts
        self._verdicts: dict[str, _Verdict] = {}
        self._returned: list[str] = []  # returned lazily, not yet reported by ``update``
        # What the last ``update`` said could take traffic (None: all): a dead backend's last
        # timings are no reference for a live one's.
        self._available: set[str] | None = None
        self.ejections_total = 0
        for url in backends:
            self.add(url)

    def add(self, url: str) -> None:
        self.tracker.add(url)
        self._verdicts.setdefault(url, _Verdict(calm_since=self.clock()))

    def remove(self, url: str) -> None:
        """A backend leaves. Should only ejected ones remain, they are let back: a slow
        backend serves better than none."""
        self._verdicts.pop(url, None)
        self.tracker.remove(url)
        if url in self._returned:
            self._returned.remove(url)
        if self._verdicts and all(v.ejected_at is not None for v in self._verdicts.values()):
            for other in list(self._verdicts):
                self._return(other, self.clock())
                self._returned.append(other)

    def is_ejected(self, url: str) -> bool:
        v = self._verdicts.get(url)
        if v is None or v.ejected_at is None:
            return False
        if self._may_return(url, v):
            self._return(url, self.clock())
            self._returned.append(url)
            return False
        return True

    def ejected_for(self, url: str) -> float | None:
        """At least how many more seconds this backend is out; None when it is not. Past the
        shortest stay, while the probes still hold it out: ``base_s`` (a lower bound that
        each call renews, for verdicts shared with other gateways)."""
        if not self.is_ejected(url):
            return None
        left = self._verdicts[url].ejected_until - self.clock()
        return left if left > 0 else self.config.base_s

    @property
    def ejected(self) -> list[str]:
        return [url for url in list(self._verdicts) if self.is_ejected(url)]

    def ratio(self, url: str) -> float | None:
        """Its recent TPOT over the median of the other backends' in rotation; None when
        either is unknown (diagnostics)."""
        mine = self.tracker.recent_tpot(url)
        ref = self._reference(url, self.tracker.recent_tpot)
        if mine is None or ref is None:
            return None
        return math.inf if ref <= 0 else mine / ref

    def slow_backends(self) -> list[str]:
        """Backends judged slow now, worst first: the ejected ones, then those in rotation
        that meet the criteria but that the guards keep in."""
        ejected = self.ejected  # first: who may return does, and is judged with the rest
        return ejected + self._judge(self.clock())

    def update(self, available: Iterable[str] | None = None) -> SlowChanges:
        """Let back who may return, judge the rest, eject the slow ones the guards allow.

        ``available``: the backends that could take traffic but for this detector (healthy,
        breaker not open, not ejected for failures); None: all of them. The last of them in
        rotation is never ejected.
        """
        now = self.clock()
        for url in list(self._verdicts):
            self.is_ejected(url)  # lets back those that may return
        returned, self._returned = self._returned, []
        self._available = None if available is None else set(available)
        pool = set(self._verdicts) if available is None else self._available & set(self._verdicts)
        ejected: list[str] = []
        for url in self._judge(now):
            if self._may_eject(url, pool):
                self._eject(url, now)
                ejected.append(url)
        return SlowChanges(ejected, returned)

    # -- internals ---------------------------------------------------------------------------

    def _in_rotation(self) -> list[str]:
        return [url for url, v in self._verdicts.items() if v.ejected_at is None]

    def _reference(self, url: str, series: Callable[[str], float | None]) -> float | None:
        """The median of the other backends in rotation that can take traffic."""
        return median_or_none(
            value
            for other in self._in_rotation()
            if other != url
            and (self._available is None or other in self._available)
            and (value := series(other)) is not None
        )

    def _judge(self, now: float) -> list[str]:
        """Refresh each in-rotation backend's standing; those slow for long enough, worst
        first."""
        c = self.config
        slow: list[str] = []
        for url in self._in_rotation():
            v = self._verdicts[url]
            mine = self.tracker.recent_tpot(url)
            ref = self._reference(url, self.tracker.recent_tpot)
            over = (
                mine is not None
                and ref is not None
                and mine >= c.min_tpot_s
                and mine > c.factor * ref
            )
            if not over:
                v.over_since = None
                if v.times_ejected and now - v.calm_since >= c.forgive_s:
                    v.times_ejected = 0
                continue
            assert mine is not None and ref is not None
            v.ratio = math.inf if ref <= 0 else mine / ref
            v.calm_since = now
            if v.over_since is None:
                v.over_since = now
                v.samples_at_over = self.tracker.tpot_samples(url)
            samples = self.tracker.tpot_samples(url) - v.samples_at_over
            if now - v.over_since >= c.for_s and samples >= c.min_samples:
                slow.append(url)
        slow.sort(key=lambda u: self._verdicts[u].ratio, reverse=True)
        return slow

    def _may_eject(self, url: str, pool: set[str]) -> bool:
        out = sum(v.ejected_at is not None for v in self._verdicts.values())
        if out + 1 > self.config.max_ejected_share * len(self._verdicts):
            return False
        return any(
            other != url and self._verdicts[other].ejected_at is None for other in pool
        )  # never the last one standing

    def _eject(self, url: str, now: float) -> None:
        c = self.config
        v = self._verdicts[url]
        v.times_ejected += 1
        v.ejected_at = now
        doublings = min(v.times_ejected - 1, 32)  # past the cap long before; no overflow
        v.ejected_until = now + min(c.base_s * 2**doublings, c.max_s)
        v.over_since = None
        self.ejections_total += 1

    def _may_return(self, url: str, v: _Verdict) -> bool:
        c = self.config
        now = self.clock()
        if v.ejected_at is None:
            return True
        if now < v.ejected_until:
            return False
        probes = self.tracker.probes(url, since=v.ejected_at)
        if not probes or now - probes[-1][0] > c.probe_stale_s:
            return True  # no evidence either way: the timer decides, as Envoy's does
        if len(probes) < c.readmit_probes:
            return False
        ref = self._reference(url, self.tracker.probe)
        if ref is None:
            return True  # nothing to compare with
        limit = max(c.min_probe_s, c.factor * ref)
        return all(seconds <= limit for _, seconds in probes[-c.readmit_probes :])

    def _return(self, url: str, now: float) -> None:
        v = self._verdicts[url]
        if v.ejected_at is None:
            return
        v.ejected_at = None
        v.over_since = None
        v.calm_since = now
        self.tracker.reset(url)  # back with a clean slate, not the slowness it left with
