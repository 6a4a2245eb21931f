"""A model's pool of backends and the choice of one for each attempt.

Eligible: marked healthy by the active checks, not ejected by outlier detection, breaker not
open. When no backend passes all of these, the pool routes in panic, as Envoy does below its
panic threshold: to every backend whose breaker lets calls through. Health checks and ejection
are evidence about one backend judged alone; when they have taken out every backend, they are
more likely wrong (probes timing out while a restarted neighbour loads on the same cores) than
all the backends dead, and a request sent to a dead one fails over in milliseconds, where
"no healthy backend" fails it for sure. So the last live backend never leaves rotation.

Among those, power of two choices on load: the gateway's own requests in flight (at a poise
replica, those of a worse priority than the request's count for a tenth: the replica pauses and
preempts them for it; on another engine than poise, its own count of running requests when that
is more) plus the waiting
requests it reports (its ``/metrics``, under its kind's names: ``health``), scaled by weight
and by its latency cost (peak EWMA of time to first token and per output token against the
pool's median, work outstanding included: see ``poise.resilience.latency``), so that a
backend gone slow or silent loses the choice at once; a backend whose report is stale counts
as busy, since silence is not evidence of idleness. One whose time per token stays several
times the others' is taken out (``poise.resilience.slow_ejection``) until its probes say it is
fast again. A backend that has answered its latest attempts with errors is judged on its load
alone until outlier detection has its verdict (``Pool._rather``): its latency cost dates from
before its failures, and must not keep from it the attempts that verdict needs.

Prefix affinity: a request carries the hash chain of its prompt's leading blocks
(``poise.gateway.prefix``); the pool prefers the backends that have seen the longest run of
those blocks (with none, the first block's rendezvous hash), so the prefix cache there gets the
hits. The affinity choice is taken unless it is clearly busier than the least loaded backend;
when a backend leaves, only its prefixes move.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from poise.gateway.backend_kind import Kind
from poise.gateway.config import BackendSettings, GatewaySettings
from poise.gateway.prefix import Affinity, PrefixIndex
from poise.resilience.breaker import BreakerConfig, BreakerState, CircuitBreaker
from poise.resilience.ejection import EjectionConfig, OutlierDetector
from poise.resilience.latency import LatencyConfig, LatencyTracker
from poise.resilience.slow_ejection import SlowEjectionConfig, SlowOutlierDetector

log = logging.getLogger("poise.gateway")

STALE_LOAD_PENALTY = 1000.0
AFFINITY_SLACK = 4.0  # requests in flight by which the affinity choice may exceed the least
SLOW_UPDATE_S = 0.1  # how often routing re-judges slowness


# Refusals for load a backend must give within a hold before the gateway holds that priority
# back itself: a flood's come by the dozen in that time, while a lone one is usually marginal
# (a newcomer predicted just past the target behind one or two waiting), and holding on it
# refused the next interactive request at every backend for nothing.
SHED_CONFIRM = 2

# What one of the gateway's attempts at a poise replica of a worse priority than the request
# being routed counts for in its load, against one for an attempt of its priority or better:
# the replica pauses and preempts such work for it, but what runs of it still fills part of
# each step (``lower_priority_share``), so of two replicas with as much of its own priority in
# flight the one with less of the rest is the better.
WORSE_PRIORITY_WEIGHT = 0.1


@dataclass(slots=True)
class ReportedLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    processed: float | None = None  # its count of tokens prefilled and generated, if exported
    at: float | None = None  # when it was read; None: never


@dataclass(eq=False)
class Backend:
    model: str
    settings: BackendSettings
    breaker: CircuitBreaker
    inflight: int = 0
    # Of those, the attempts by the priority they carry (one sent without any is in
    # ``inflight`` alone): a poise replica serves a better priority before a worse one, so
    # a request waits there behind the work of its own priority and better, not the rest.
    inflight_by_priority: dict[int, int] = field(default_factory=dict)
    healthy: bool = True
    health_streak: int = 0  # consecutive probe results in the direction of a change
    checked: bool = False  # an active check has given a verdict (the first one counts at once)
    passed_at: float | None = None  # when an active check last passed; None: never
    load: ReportedLoad = field(default_factory=ReportedLoad)
    source: str | None = None  # the DNS name it was discovered from; None: listed
    kind: Kind | None = None  # its engine, as configured or detected; None: not known yet
    # A poise replica in its deterministic mode, and the fingerprint of its arithmetic (its
    # health answer says both; None: not deterministic): a stream it continues goes on as it
    # would have without the break if it came from a replica of the same fingerprint.
    numerics: str | None = None
    retired: bool = False  # no longer discovered: out of routing, gone once idle
    # Its health answer says it is draining (a poise replica after SIGTERM): down for new
    # work, but what it holds finishes there and is not cut off.
    draining: bool = False
    # Work in flight here that can move elsewhere without the client noticing (attempts still
    # waiting for their first byte, streams that can be resumed), each with how to cut it off:
    # when the health checks find the backend dead, that work should not wait for it.
    movable: dict[object, Callable[[], None]] = field(default_factory=dict)
    # Its latest attempts, in a row, that it answered with an error status (a 5xx sent in
    # place of any output); any other verdict ends the run, and so does its ejection.
    error_answers: int = 0
    # A poise replica that refused a request for load (its queue filling, or full) refuses
    # that request's priority and worse for a moment: once it has said so ``SHED_CONFIRM``
    # times, the gateway does not send it more of them until ``shed_until`` (see
    # ``note_shedding``). Such refusals since the hold began, by the priority they named.
    shed_counts: dict[int, int] = field(default_factory=dict)
    shed_until: float = 0.0
    # ... sparing a request whose first-token objective leaves at least this long (None: none)
    shed_spares_s: float | None = None

    def sheds(self, priority: int, now: float, first_token_left_s: float | None = None) -> bool:
        """Whether it refused this priority or a better one for load a moment ago, more than
        once (``SHED_CONFIRM``): refusals of a worse priority say nothing of this one. A
        request whose first-token objective leaves ``first_token_left_s`` is not shed where
        that is at least what the backend spares (a patient client's)."""
        if now >= self.shed_until:
            return False
        spares = self.shed_spares_s
        if first_token_left_s is not None and spares is not None and first_token_left_s >= spares:
            return False
        return sum(n for p, n in self.shed_counts.items() if p <= priority) >= SHED_CONFIRM

    def attempt_started(self, priority: int | None) -> None:
        self.inflight += 1
        if priority is not None:
            self.inflight_by_priority[priority] = self.inflight_by_priority.get(priority, 0) + 1

    def attempt_ended(self, priority: int | None) -> None:
        self.inflight -= 1
        if priority is not None:
            left = self.inflight_by_priority.get(priority, 0) - 1
            if left > 0:
                self.inflight_by_priority[priority] = left
            else:
                self.inflight_by_priority.pop(priority, None)

    def inflight_worse_than(self, priority: int) -> int:
        """The gateway's attempts in flight here of a worse priority than ``priority``."""
        return sum(n for p, n in self.inflight_by_priority.items() if p > priority)

    def outranks(self, priority: int) -> bool:
        """Whether an attempt of a better priority than ``priority`` is in flight here."""
        return any(p < priority for p in self.inflight_by_priority)

    def note_shedding(
        self, priority: int, now: float, hold_s: float, spares_s: float | None = None
    ) -> None:
        """It refused a request of ``priority`` for load (any of that priority or worse would
        be now, but one whose first-token objective leaves ``spares_s``): count it towards
        holding them back for ``hold_s``, long enough to spare it a flood's requests and short
        enough that its state (it changes within a step or two) is asked again soon."""
        if now >= self.shed_until:
            self.shed_counts.clear()
        self.shed_counts[priority] = self.shed_counts.get(priority, 0) + 1
        self.shed_until = max(self.shed_until, now + hold_s)
        self.shed_spares_s = spares_s

    def cut_off(self) -> int:
        """Cut off the movable work in flight here; how much there was."""
        cuts = list(self.movable.values())
        self.movable.clear()
        for cut in cuts:
            cut()
        return len(cuts)

    @property
    def url(self) -> str:
        return self.settings.base


class Pool:
    def __init__(
        self,
        model: str,
        settings: GatewaySettings,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        on_breaker_change: Callable[[Backend, BreakerState], None] | None = None,
    ) -> None:
        self.model = model
        self.clock = clock
        self.rng = rng or random.Random()
        self.stale_after_s = 3 * settings.health.interval_s + settings.health.timeout_s
        self._breaker_config = BreakerConfig(**settings.breaker.model_dump())
        self._on_breaker_change = on_breaker_change
        self._remote_out: dict[str, float] = {}  # url -> clock time: another gateway's verdict
        self.outliers = OutlierDetector(
            [], EjectionConfig(**settings.ejection.model_dump()), clock, self.rng
        )
        self.latency = LatencyTracker(LatencyConfig(), clock)
        slow = settings.slow_ejection
        self.slow: SlowOutlierDetector | None = None
        if slow.enabled:
            knobs = slow.model_dump(exclude={"enabled"})
            self.slow = SlowOutlierDetector(self.latency, SlowEjectionConfig(**knobs))
        self._slow_judged_at = -float("inf")
        self.prefixes = PrefixIndex()
        self.backends: list[Backend] = []
        for bs in settings.models[model].backends:
            if bs.discovery == "static":
                self.add(bs)

    def add(self, settings: BackendSettings, source: str | None = None) -> Backend:
        """A backend joins. One discovered later starts unchecked but not trusted: out of
        routing until its first health check passes."""
        backend = Backend(
            self.model,
            settings,
            CircuitBreaker(self._breaker_config, self.clock),
            source=source,
            kind=settings.kind,
        )
        if source is not None:
            backend.healthy = False
        if self._on_breaker_change is not None:
            on_change = self._on_breaker_change
            backend.breaker.on_change = lambda _a, to: on_change(backend, to)
        self.backends.append(backend)
        self.outliers.add(backend.url)
        self.latency.add(backend.url)
        if self.slow is not None:
            self.slow.add(backend.url)
        return backend

    def retire(self, backend: Backend) -> None:
        """No longer discovered: no new attempts; what it holds finishes (see ``sweep``)."""
        backend.retired = True

    def sweep(self) -> list[Backend]:
        """Drop retired backends that hold nothing any more; the ones dropped."""
        gone = [b for b in self.backends if b.retired and b.inflight == 0]
        for b in gone:
            self.backends.remove(b)
            self.outliers.remove(b.url)
            self._remote_out.pop(b.url, None)
            if self.slow is not None:
                self.slow.remove(b.url)
            self.latency.remove(b.url)
            self.prefixes.forget(b.url)
        return gone

    def eligible(self, exclude: frozenset[Backend] = frozenset()) -> list[Backend]:
        """The backends new attempts may go to (less ``exclude``); in panic, see above."""
        self.judge_slowness()
        trusted = [b for b in self.backends if self.trusted(b)]
        if trusted:
            return [b for b in trusted if b not in exclude]
        return [b for b in self.panic_set() if b not in exclude]

    def trusted(self, b: Backend) -> bool:
        """Every check passes: healthy, not ejected, breaker closed, not out elsewhere."""
        return self._available(b) and (self.slow is None or not self.slow.is_ejected(b.url))

    def _available(self, b: Backend) -> bool:
        """Every check but slowness passes."""
        return (
            not b.retired
            and b.healthy
            and not self.outliers.is_ejected(b.url)
            and b.breaker.allows()
            and not self.out_remotely(b.url)
        )

    def judge_slowness(self, force: bool = False) -> list[str]:
        """Eject the backends slow against the others (at most every ``SLOW_UPDATE_S``);
        the URLs newly ejected."""
        now = self.clock()
        if self.slow is None or (not force and now - self._slow_judged_at < SLOW_UPDATE_S):
            return []
        self._slow_judged_at = now
        changes = self.slow.update([b.url for b in self.backends if self._available(b)])
        for url in changes.returned:  # its estimates were reset as it returned
            log.warning("backend %s is fast again: back in rotation", url)
        for url in changes.ejected:
            ratio = self.slow.ratio(url)
            log.warning(
                "backend %s is slow (%s the others' time per token): out of rotation",
                url,
                "?" if ratio is None else f"{ratio:.1f}x",
            )
        return changes.ejected

    def slow_ejected(self, b: Backend) -> bool:
        return self.slow is not None and self.slow.is_ejected(b.url)

    def panic_set(self) -> list[Backend]:
        return [b for b in self.backends if not b.retired and b.breaker.allows()]

    @property
    def in_panic(self) -> bool:
        return not any(self.trusted(b) for b in self.backends) and bool(self.panic_set())

    def out_remotely(self, url: str) -> bool:
        until = self._remote_out.get(url)
        if until is None:
            return False
        if self.clock() >= until:
            del self._remote_out[url]
            return False
        return True

    def remote_out(self, url: str, until: float) -> bool:
        """Another gateway's verdict: ``url`` is out until ``until`` (this clock). Returns
        True when it newly takes the backend out here; never the last backend standing."""
        backend = next((b for b in self.backends if b.url == url), None)
        if backend is None or until <= self.clock():
            return False
        known = self.out_remotely(url)
        trusted = [b for b in self.backends if self.trusted(b)]
        if not known and backend in trusted and len(trusted) <= 1:
            return False
        self._remote_out[url] = max(until, self._remote_out.get(url, 0.0))
        return not known

    def older_than_a_report_may_be(self, at: float | None) -> bool:
        """Whether a backend's load report (or passed check) read at ``at`` is stale."""
        return at is not None and self.clock() - at > self.stale_after_s

    def judge(self, b: Backend, ok: bool, error_answer: bool = False) -> bool:
        """One attempt's verdict on ``b``, for outlier detection and routing; True when it
        ejected ``b``. ``error_answer``: the failure is an error status ``b`` answered with
        (not a timeout, a refused connection or a stream broken part way)."""
        ejected = self.outliers.record(b.url, ok)
        # While it is out nothing accrues: it returns with a clean record, as in ``outliers``.
        out = ejected or self.outliers.is_ejected(b.url)
        b.error_answers = b.error_answers + 1 if error_answer and not ok and not out else 0
        return ejected

    def score(self, b: Backend, priority: int | None = None) -> float:
        return self.latency.cost(b.url) * self.load_score(b, priority)

    def load_score(self, b: Backend, priority: int | None = None) -> float:
        """``score`` without the latency cost: work there (in flight and reported) plus one,
        over its weight. For a request of ``priority`` at a poise replica, the gateway's
        attempts there of a worse one count for ``WORSE_PRIORITY_WEIGHT`` each: the replica
        pauses and preempts them for it (they only break ties between replicas with as much
        of its own priority in flight; see docs/admission.md, the flood on a slow spell)."""
        load = b.load
        # A nearly full KV cache means preemptions soon: as bad as a queue of ten.
        reported = load.waiting + (10.0 if load.kv_usage > 0.95 else 0.0)
        running = float(b.inflight)
        if priority is not None and b.kind == "poise":
            running -= (1.0 - WORSE_PRIORITY_WEIGHT) * b.inflight_worse_than(priority)
        if self.older_than_a_report_may_be(load.at):
            reported += STALE_LOAD_PENALTY
        elif b.kind != "poise":
            # Another engine's batch takes nearly all it is sent, so little ever waits there:
            # what it runs counts, as the gateway's own requests there or its own count,
            # whichever is more (other clients load it too; its count lags by up to a round).
            # A poise replica queues what it cannot run now, so its waiting count says it,
            # and its running one counts the gateway's probes.
            running = max(running, load.running)
        return (running + reported + 1) / b.settings.weight

    def outranked(self, b: Backend, priority: int | None) -> bool:
        """Whether an attempt of ``priority`` at ``b`` starts outranked: ``b`` is a poise
        replica (which serves a better priority first) and the gateway has an attempt of a
        better priority in flight anywhere in the pool. Judged on the pool, not on ``b``:
        judged on each backend, one with no better work in flight is timed by its worse
        streams and the others by their better ones, and the difference alone would keep the
        better priority off it."""
        if priority is None or b.kind != "poise":
            return False
        return any(other.outranks(priority) for other in self.backends)

    def pick(
        self,
        affinity: Affinity | None = None,
        exclude: frozenset[Backend] = frozenset(),
        unable: frozenset[Backend] = frozenset(),
        priority: int | None = None,
    ) -> Backend | None:
        """One backend for the next attempt, or None when none may take it.

        ``exclude``: backends already tried for this request; they are used again only when
        nothing else is eligible. ``unable``: backends that cannot serve it at all (an engine
        that cannot continue a chat by text); never chosen. ``priority``: the request's, which
        decides what load counts against a backend (``load_score``).
        """
        candidates = [b for b in self.eligible(exclude) if b not in unable] or [
            b for b in self.eligible() if b not in unable
        ]
        if not candidates:
            return None
        chosen = (
            candidates[0] if len(candidates) == 1 else self._choose(candidates, affinity, priority)
        )
        if affinity is not None:
            self.prefixes.record(affinity, chosen.url)
        return chosen

    def _choose(
        self, candidates: list[Backend], affinity: Affinity | None, priority: int | None
    ) -> Backend:
        least = min(self.score(b, priority) for b in candidates)
        if affinity is not None:
            preferred = self._by_prefix(candidates, affinity, priority)
            if self.score(preferred, priority) <= least + AFFINITY_SLACK:
                return preferred
        a, b = self.rng.sample(candidates, 2)
        return a if self._rather(a, b, priority) else b

    def _rather(self, a: Backend, b: Backend, priority: int | None = None) -> bool:
        """Whether ``a`` takes the attempt rather than ``b``: the lower score, unless one of
        them has answered its latest attempts with errors and is not yet ejected for it
        (``error_answers`` short of ``consecutive_failures``). Then they are compared on load
        alone, and a tie goes to the one answering with errors.

        A failed attempt is no latency sample, so the latency cost of a backend answering
        with errors is that of its last good answers, however long ago: were it above the
        others', the router would send it requests only when the others are busier, and
        outlier detection, which counts its failures in a row, would wait on that for its
        verdict (a replica answering 500 to everything stayed in rotation for its whole
        5 s fault, 3 requests reaching it). As its failures are answered at once, its load
        stays low, so it gets the next attempts until it is ejected (at most
        ``consecutive_failures``, each retried elsewhere) or it answers well again, as an
        Envoy least-request balancer would send them. Past that limit (ejection refused by
        ``max_ejected_share`` or as the last backend standing), it is scored as usual; its
        breaker's failure rate is what takes it out then."""
        limit = self.outliers.config.consecutive_failures
        ea = 0 < a.error_answers < limit
        eb = 0 < b.error_answers < limit
        if not (ea or eb):
            return self.score(a, priority) <= self.score(b, priority)
        la, lb = self.load_score(a, priority), self.load_score(b, priority)
        if la != lb:
            return la < lb
        return ea and a.error_answers >= b.error_answers

    def _by_prefix(
        self, candidates: list[Backend], affinity: Affinity, priority: int | None
    ) -> Backend:
        """The least loaded of the backends that have seen the longest run of the prompt's
        leading blocks; with none, the first block's rendezvous choice."""
        matched = {b: self.prefixes.matched(affinity, b.url) for b in candidates}
        longest = max(matched.values())
        if longest == 0:
            return max(candidates, key=lambda b: _rendezvous(affinity[0], b.url))
        return min(
            (b for b in candidates if matched[b] == longest),
            key=lambda b: self.score(b, priority),
        )


def _rendezvous(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")
