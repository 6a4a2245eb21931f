"""Admission control: serve every burst that drains, shed a flood, judge each request by its own
deadline, shed by priority.

A replica that accepts everything turns a flood into minutes of queueing for everyone; one that
refuses whatever would wait a little turns away a batch job's burst that it would have served in
seconds. So a long wait alone refuses nothing here. A newcomer is refused at once (429 and a
``Retry-After``, so that a gateway can send it elsewhere) when:

- it is predicted to start after its own deadline (``X-Request-Deadline-Ms`` or the server's
  default timeout), or, when it runs to its max_tokens (``Need.exact``), too late to produce
  them before it: it cannot be served in time;
- the queue is *filling*, that is more requests of its priority or a better one arrive than
  start or finish (``queue_trend``: counted per priority, so a batch flood fills the batch
  queue, not the interactive one beside it), and it is predicted to wait longer than
  ``queue_target_s``.
  Under a flood this keeps the queue about the target deep, so the requests admitted keep
  their time to first token; a burst that drains, or a closed loop of clients that each send
  again when answered, is served however long the queue it makes. While the queue fills, a
  request that would fill more than ``BIG_FACTOR`` times the KV blocks of the typical request
  is refused whatever its wait: under a flood the requests that want the most are shed
  first (the engine, for its part, makes them wait for room in the pool before the short
  ones);
- it brings its own latency objective (``Objective``: ``x-slo-ttft-ms``, ``x-slo-tpot-ms``)
  and is predicted to miss it: its first token later than asked, or steps slower than its time
  per token, filling queue or not. One whose first-token objective is several times the target
  (``patient_factor``) is held to it instead of ``queue_target_s`` (the server's objective for
  requests that say none), so a client that accepts a wait of seconds (a batch job, an eval
  harness) is served behind a flood it can wait out;
- the queue's hard bounds (requests, prompt tokens) are reached and nothing of a lower priority
  waits that could be shed for it.

The decision happens before any expensive work and needs only what this object has seen: who
is waiting, how fast waiting requests have been starting, and the server's own forecast of when
running slots and KV blocks free up (``forecast``).

The service-rate estimate is the mean interval between the last ``rate_window`` pairs of
consecutive starts, counted only while someone was waiting throughout (idle time says nothing
about capacity, and neither does the first start after it: that is latency, not spacing), and no
older than ``rate_max_age_s``: intervals from a slow spell long past (a fault, another load)
would otherwise refuse today's work, and refusals make no new samples to correct them. It is
kept apart for typical requests and for large ones (``start_pace``): large requests wait for
room in the KV pool while smaller ones start past them, so neither kind's pace says anything of
the other's. A large newcomer's wait also counts the large requests held for room ahead of it,
each holding the pool for its own output's time (``Need.hold_s``). Starts come in bursts (one
engine step may start several requests, then none for a while), so a short-memory average swings
low right after a burst; admission acts on those lows, which biases it towards taking too much.
A plain mean over a few dozen intervals is steadier than an exponential one with the same
responsiveness. A newcomer's wait is at least how long the requests of each kind ahead of it
have gone without a start of their kind, so a stalled engine stops admitting instead of trusting
an old, fast rate. Predictions err, mostly short (a request's own prefill is in its wait to the
first token, and chunked prompts share steps), so the error measured on the last requests
predicted near the target (its 90th percentile, at most half the target) is added to a
newcomer's prediction before it is held against the target: the target holds on whatever host
this runs.

Priorities follow vLLM: lower values run first. A request is only queued behind those with a
value at most its own, and the slot forecast counts the running requests of a lower priority as
slots it can take (the engine's cap counts only its priority and better, and the lower ones sit
out steps for it), so a high-priority request may be admitted
when a low-priority one would be refused; and when a bound is hit, waiting requests of strictly
lower priority are shed (worst first, newest first) to make room, and their owners are told with
the same 429.

No library offers this: rate limiters bound arrivals, not a queue whose drain rate is measured;
the policy is small, pure and takes its clock as an argument so it is tested without sleeping.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from poise.resilience.queue_trend import PriorityTrends, TrendConfig
from poise.resilience.start_pace import StartPace

# Under a flood, a request that would fill more than this many times the KV blocks of the
# typical request is refused whatever its wait: the requests that want the most are
# shed before the short ones.
BIG_FACTOR = 2.0


def is_large(blocks: int, typical: int) -> bool:
    """More than ``BIG_FACTOR`` times the typical request's blocks (none is while the typical
    request is not known): such a request waits for room in the pool, and is shed first."""
    return bool(typical) and blocks > BIG_FACTOR * typical


class Forecast(Protocol):
    """The server's forecast of its running slots and KV pool (``poise.engine.forecast``)."""

    def wait_s(
        self, position: int, priority: int | None = None, blocks: int = 0, own: int = 0
    ) -> float:
        """Seconds until the ``position``-th in line of ``priority`` has a slot and the KV
        blocks of ``blocks`` (its own, ``own`` each, and those ahead of it)."""
        ...

    def preemptible(self, priority: int | None) -> int:
        """Running requests that one of ``priority`` may take the place of."""
        ...

    @property
    def typical_footprint(self) -> int:
        """The typical request's KV footprint, in blocks (0: not known)."""
        ...

    @property
    def busy_step_s(self) -> float:
        """The recent wall time of one step while requests run: their time per token (0 while
        none runs)."""
        ...

    def fits_now(self, blocks: int) -> bool:
        """Whether a request of ``blocks`` would start now as far as the KV pool and the
        running slots a large request must leave to others go."""
        ...

    def fit_together(self, blocks: int, retaken: bool = True) -> int:
        """How many requests of ``blocks`` the pool holds at once, with what large requests
        leave to others (at least 1); ``retaken``: what the typical running requests give
        back is taken again by new ones (they keep arriving), so it is not counted."""
        ...


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = True  # off: admit everything (bounds and predictions still reported)
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 1 << 20  # prompt tokens admitted but not yet started
    # While the queue fills, refuse what is predicted to wait longer; None: never for a wait
    # (the deadline and the hard bounds still hold).
    queue_target_s: float | None = None
    trend: TrendConfig = field(default_factory=TrendConfig)
    rate_window: int = 32  # start intervals averaged for the service rate
    rate_max_age_s: float = 30.0  # ... none older than this
    # How far actual waits ran past the predicted ones lately (this quantile of the last
    # error_window requests predicted near the target) is added to a prediction before it is
    # held against the target: the predictions' bias on this host, its own prefill included.
    error_window: int = 64
    error_quantile: float = 0.9
    # A request's own first-token objective is held against its wait plus this quantile of the
    # same errors: such a client counts misses, and a one-in-ten margin missed one in fifty.
    objective_quantile: float = 0.99
    # A first-token objective at least this many times queue_target_s is a patient client's:
    # it is held to that instead of the target while the queue fills. One within a few times
    # the target is held to both: at the edge of a flood's standing queue waits err by more
    # than the margin learnt (held to its 1 s objective alone, 10 of 240 admitted W2 requests
    # missed it at three times the capacity, in clusters; held to the target too, none).
    patient_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1 or self.max_waiting_tokens < 1:
            raise ValueError("admission bounds must be at least 1")
        if self.rate_window < 1 or self.rate_max_age_s <= 0:
            raise ValueError("rate_window must be at least 1 and rate_max_age_s positive")
        if self.error_window < 1 or not 0 <= self.error_quantile <= 1:
            raise ValueError("error_window must be at least 1 and error_quantile in [0, 1]")
        if not 0 <= self.objective_quantile <= 1:
            raise ValueError("objective_quantile must be in [0, 1]")
        if self.patient_factor < 0:
            raise ValueError("patient_factor must not be negative")
        if self.queue_target_s is not None and self.queue_target_s < 0:
            raise ValueError("queue_target_s must not be negative")


@dataclass(frozen=True, slots=True)
class Need:
    """What one request of a group takes once it starts."""

    blocks: int = 0  # the KV blocks it is projected to fill (0: not told)
    hold_s: float = 0.0  # how long it is expected to hold them: its output at today's step time
    exact: bool = False  # it runs to its max_tokens: hold_s is what it needs before its deadline


@dataclass(frozen=True, slots=True)
class Objective:
    """A request's own latency objective (``x-slo-ttft-ms``, ``x-slo-tpot-ms``): its first
    token by ``first_token_by`` (on the admission clock), each next one within
    ``per_token_s``. Judged once, at admission: what is predicted to miss it is refused at once,
    whether or not the queue fills, so that its client can go elsewhere; what is admitted runs
    to its end."""

    first_token_by: float | None = None
    per_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class Ticket:
    key: str
    prompt_tokens: int
    priority: int
    arrival: float
    blocks: int = 0  # the KV blocks it is projected to fill (0: not told)
    hold_s: float = 0.0  # ... and for how long, once started
    exact: bool = False  # ... which it needs before its deadline
    large: bool = False  # more than BIG_FACTOR times the typical request: it waits for room
    predicted: float = 0.0  # its wait as predicted at admission
    teaches: bool = False  # its actual wait is a sample of the predictions' error
    counted: bool = True  # an arrival the queue's trend counted (a continuation is not)

    @property
    def shed_order(self) -> tuple[int, float]:
        return (self.priority, self.arrival)


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    reason: str | None  # queue_full, queue_tokens_full, deadline, overloaded, slo_ttft, slo_tpot
    predicted_wait_s: float
    retry_after_s: float  # whole seconds, at least 1, when refused; 0 when admitted
    shed: tuple[str, ...] = ()  # keys of waiting requests dropped to make room
    # Refused for load whatever its size: any request of this priority or worse would be now
    # (a gateway may hold such requests back for a moment); False when its own size decided.
    sheds_priority: bool = False
    large: bool = False  # refused under a flood for its KV footprint, not its wait


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        clock: Callable[[], float],
        forecast: Callable[[], Forecast] | None = None,
    ) -> None:
        """``forecast()``: the server's own forecast now (``poise.engine.forecast``), or None
        when it has none."""
        self.config = config
        self.clock = clock
        self.forecast = forecast
        self.trends = PriorityTrends(config.trend, clock)
        self.waiting: dict[str, Ticket] = {}
        self.waiting_tokens = 0
        self._running: dict[str, int] = {}  # started and counted: key -> priority, until it ends
        # The pace of typical starts and of large ones (False, True), measured apart: large
        # requests wait for room in the pool while smaller ones start past them.
        self._pace = {
            large: StartPace(config.rate_window, config.rate_max_age_s, clock)
            for large in (False, True)
        }
        self._errors: dict[int, deque[tuple[float, float]]] = {}  # (when, error) by priority
        self._last_typical_arrival: float | None = None

    # ----- what the server asks -----
    @property
    def saturated(self) -> bool:
        c = self.config
        return (
            len(self.waiting) >= c.max_waiting_requests
            or self.waiting_tokens >= c.max_waiting_tokens
        )

    def ahead(self, priority: int) -> int:
        """Waiting requests that a new one of this priority would queue behind."""
        return sum(1 for t in self.waiting.values() if t.priority <= priority)

    def predicted_wait(self, priority: int, group_size: int = 1, group_blocks: int = 0) -> float:
        """Seconds until a group of this priority (filling ``group_blocks`` of KV), arriving
        now, would start: the most pessimistic of the measured start paces, the server's
        forecast of slots and blocks for its last member, and (for a large request) the time
        the large requests held for room ahead of it will hold the pool."""
        ahead = [t for t in self.waiting.values() if t.priority <= priority]
        by_slots = by_held = 0.0
        preemptible = 0
        if self.forecast is not None:
            forecast = self.forecast()
            # The engine starts smaller requests past one that does not fit the pool: those
            # ahead that are larger than this group's own and do not fit now are no wait.
            own = -(-group_blocks // max(1, group_size))
            held = [t for t in ahead if t.large and not forecast.fits_now(t.blocks)]
            ahead = [t for t in ahead if t.blocks <= own or forecast.fits_now(t.blocks)]
            blocks = group_blocks + sum(t.blocks for t in ahead)
            by_slots = forecast.wait_s(len(ahead) + group_size, priority, blocks, own)
            preemptible = forecast.preemptible(priority)
            # Held large requests no larger than this one start before it, each holding the
            # pool for its run: on a short pool one at a time, and the smaller requests that
            # start past them meanwhile make it no sooner.
            before = [t for t in held if t.blocks <= own]
            if before:
                retaken = self._typical_coming()
                by_held = sum(t.hold_s for t in before) / forecast.fit_together(own, retaken)
        else:
            held = []
        # Those ahead that will take a lower priority's slot do not wait for the pace of
        # starts (which the lower priority's long outputs set).
        paced = min(len(ahead), max(0, len(ahead) + group_size - 1 - preemptible))
        held_keys = {t.key for t in held}
        paced_held = min(paced, sum(1 for t in ahead if t.key in held_keys))
        by_rate = max(self._paced_s(False, paced - paced_held), self._paced_s(True, paced_held))
        return max(by_slots, by_rate, by_held)

    def _typical_coming(self) -> bool:
        """Whether typical requests still arrive (one within the trend's interval): then what
        the typical running ones give back is no room for large ones (new ones take it); in a
        burst that drains it is."""
        last = self._last_typical_arrival
        return last is not None and self.clock() - last <= self.config.trend.interval_s

    def _paced_s(self, large: bool, count: int) -> float:
        """The wait behind ``count`` of a kind at its measured pace, and at least as long as
        that kind has gone without a start."""
        if not count:
            return 0.0
        pace = self._pace[large]
        waiting = any(t.large == large for t in self.waiting.values())
        stalled = pace.stalled_s(waiting)
        interval = pace.interval_s(waiting) if large else pace.mean_interval_s
        return max(count * (interval or 0.0), stalled)

    def admit(
        self,
        keys: Sequence[str],
        prompt_tokens: Sequence[int],
        priority: int = 0,
        deadline: float | None = None,
        continuation: bool = False,
        needs: Sequence[Need] | None = None,
        objective: Objective | None = None,
    ) -> Decision:
        """Admit a group (the n choices of one HTTP request) whole, or none of it.

        ``deadline``: when it must be done; one that runs to its max_tokens (``Need.exact``)
        must start that long before it. ``objective``: its own latency objective.

        ``continuation``: the rest of a generation that was admitted elsewhere and lost its
        replica mid-stream. Its client already has its first token, so the predicted-wait
        rules (which guard time to first token) do not apply; refusing it would end a stream
        the system had taken on. The hard bounds on the queue still do."""
        if len(keys) != len(prompt_tokens) or not keys:
            raise ValueError("one prompt length per key, at least one key")
        now = self.clock()
        needs = needs or [Need()] * len(keys)
        blocks = [need.blocks for need in needs]
        wait = self.predicted_wait(priority, len(keys), sum(blocks))
        target = self.config.queue_target_s
        # A burst's members, waits far from the target, and requests larger than the typical
        # one (which wait for room in the pool by design) say nothing of the error there.
        typical = self.forecast().typical_footprint if self.forecast is not None else 0
        teaches = (
            not continuation
            and (target is None or wait <= 2 * target)
            and (not typical or max(blocks) <= typical)
        )
        tickets = [
            Ticket(
                k,
                n,
                priority,
                now,
                need.blocks,
                need.hold_s,
                need.exact,
                large=is_large(need.blocks, typical),
                predicted=wait,
                teaches=teaches,
                counted=not continuation,
            )
            for k, n, need in zip(keys, prompt_tokens, needs, strict=True)
        ]
        if not continuation and not any(t.large for t in tickets):
            self._last_typical_arrival = now
        judged = None if continuation else objective  # the objective this arrival is held to
        if not self.config.enabled:
            # The client's own objective is still its to set: only the server's are off.
            refusal = None if judged is None else self._judge_objective(judged, wait, priority)
            if refusal is not None:
                return refusal
            self._enqueue(tickets)
            return Decision(True, None, wait, 0.0)
        if not continuation:
            big = self._big(blocks, priority)
            refusal = self._judge_wait(tickets, wait, deadline, big, self._patient(objective))
            if refusal is None and judged is not None:
                refusal = self._judge_objective(judged, wait, priority)
                trend = self.trends.of(priority)
                # A burst's members are not counted; while the queue fills, it is demand as
                # any other.
                if refusal and not trend.bursting and not self.trends.filling(priority):
                    trend.withdraw(len(tickets))
            if refusal is not None:
                if refusal.sheds_priority:
                    self.trends.of(priority).shed()
                return refusal
            if self.trends.of(priority).bursting:
                tickets = [replace(t, teaches=False) for t in tickets]
        shed = self._make_room(len(tickets), sum(prompt_tokens), priority)
        if shed is None:
            reason = (
                "queue_full"
                if len(self.waiting) + len(tickets) > self.config.max_waiting_requests
                else "queue_tokens_full"
            )
            excess = len(self.waiting) + len(tickets) - self.config.max_waiting_requests
            refusal = self._refuse(reason, wait, max(1, excess) * self._interval_estimate())
            if reason == "queue_full":  # it refuses any newcomer of this priority or worse
                self.trends.of(priority).shed()
                refusal = replace(refusal, sheds_priority=True)
            return refusal
        for ticket in shed:
            self._remove(ticket.key)
        self._enqueue(tickets)
        return Decision(True, None, wait, 0.0, tuple(t.key for t in shed))

    @property
    def patient_s(self) -> float | None:
        """A first-token objective that leaves at least this long is a patient client's, held
        to it instead of the target (None: no target, so none is refused for its wait)."""
        target = self.config.queue_target_s
        return None if target is None else self.config.patient_factor * target

    def _patient(self, objective: Objective | None) -> bool:
        """Its first-token objective leaves at least ``patient_s``: it is held to that, not to
        the target (see ``AdmissionConfig.patient_factor``)."""
        patient = self.patient_s
        if objective is None or objective.first_token_by is None or patient is None:
            return False
        return objective.first_token_by - self.clock() >= patient

    def _judge_wait(
        self, tickets: list[Ticket], wait: float, deadline: float | None, big: bool, patient: bool
    ) -> Decision | None:
        """The refusal a newcomer's group (predicted to wait ``wait``; under a flood, ``big``
        for its size) earns, if any (see the module's rules). ``patient``: its own first-token
        objective, which it is held to instead of ``queue_target_s``, is a patient client's: it
        is not refused for a wait it accepts."""
        count, priority = len(tickets), tickets[0].priority
        target = self.config.queue_target_s
        margin = self.wait_error(priority)
        long = target is not None and wait + margin > target
        interval = self.mean_start_interval_s
        trend = self.trends.of(priority)
        trend.arrival(
            count, long, 1.0 / interval if interval else None, self.trends.outranked(priority)
        )
        if deadline is not None:
            left = deadline - self.clock()
            run = max((t.hold_s for t in tickets if t.exact), default=0.0)
            if wait + run >= left:
                if not trend.bursting and self.predicted_wait(priority) < left:
                    # A request of no size or length would have been taken: long requests
                    # refused for their own length made the short ones' queue look filling.
                    trend.withdraw(count)
                return self._refuse("deadline", wait, wait)
        passed = self._passed(priority, max(t.blocks for t in tickets))
        too_long = long and not patient
        if (too_long or big) and not trend.in_burst and self.trends.filling(priority, passed):
            assert target is not None
            if not too_long:  # its size alone: the flood's largest go first
                trend.withdraw(count)
                return replace(self._refuse("overloaded", wait, 1.0), large=True)
            smallest = self.predicted_wait(priority)  # one request, of no blocks
            whole = smallest + margin > target
            if not whole:  # a smaller request would have been taken
                trend.withdraw(count)
            return replace(self._refuse("overloaded", wait, wait - target), sheds_priority=whole)
        return None

    def _judge_objective(self, objective: Objective, wait: float, priority: int) -> Decision | None:
        """The refusal a request predicted to miss its own objective earns, if any: its first
        token later than asked (its wait, plus how far first tokens of its priority have lately
        come after their predicted starts: their own prefill and the steps they share), or a
        step time now longer than its time per token. While the queue does not fill, the
        caller withdraws its arrival from the trend, as one refused for its own deadline is:
        the same request without its objective would have been taken, so its refusal says
        nothing of whether the queue fills (counted, two such refusals made the next request
        without one look like a flood's)."""
        refusal = None
        first_token = wait + self._error_quantile(priority, self.config.objective_quantile)
        left = None if objective.first_token_by is None else objective.first_token_by - self.clock()
        step_s = self.forecast().busy_step_s if self.forecast is not None else 0.0
        if left is not None and first_token > left:
            refusal = self._refuse("slo_ttft", first_token, first_token - left)
        elif objective.per_token_s is not None and step_s > objective.per_token_s:
            refusal = self._refuse("slo_tpot", wait, 1.0)
        return refusal

    def _passed(self, priority: int, own: int) -> list[float]:
        """When the waiting requests of this priority that one of ``own`` blocks would start
        past arrived: larger than it and short of room in the pool now (the engine starts
        smaller ones past them). Their arrivals are no queue it joins: long prompts admitted to
        wait for room on a short KV pool made it look filling, and the short requests beside
        them were refused."""
        if self.forecast is None:
            return []
        forecast = self.forecast()
        return [
            t.arrival
            for t in self.waiting.values()
            if t.priority == priority
            and t.counted
            and t.blocks > own
            and not forecast.fits_now(t.blocks)
        ]

    def _big(self, blocks: Sequence[int], priority: int) -> bool:
        """Under a flood, to be refused for its size: more than ``BIG_FACTOR`` times the typical
        running request's blocks, with no worse priority running whose place it could take
        (an interactive request is not shed for a batch flood), and a target set."""
        if self.forecast is None or self.config.queue_target_s is None:
            return False
        forecast = self.forecast()
        typical = forecast.typical_footprint
        return is_large(max(blocks), typical) and forecast.preemptible(priority) == 0

    # ----- what the server reports -----
    def started(self, key: str) -> float | None:
        """The request left the queue by starting to run: one more sample of the start rate.
        Returns how much longer it waited than predicted (None: it was not waiting)."""
        ticket = self._remove(key)
        if ticket is None:
            return None
        if ticket.counted:
            self.trends.of(ticket.priority).start()
            self._running[key] = ticket.priority
        now = self.clock()
        error = now - ticket.arrival - ticket.predicted
        if ticket.teaches:
            self._errors.setdefault(ticket.priority, deque(maxlen=self.config.error_window))
            self._errors[ticket.priority].append((now, error))
        kind = ticket.large
        self._pace[kind].started(any(t.large == kind for t in self.waiting.values()))
        return error

    def wait_error(self, priority: int) -> float:
        """How far waits of this priority ran past their predictions lately, at
        ``error_quantile`` (at least 0; 0 until there are a few samples). Per priority: batch
        work that sits out steps for interactive work is late by design, and says nothing of
        the interactive predictions."""
        error = self._error_quantile(priority)
        # Never past half the target: a request predicted to start within the other half is
        # not refused for its wait, whatever a bad spell taught (the queue is then short, and
        # what made waits run long is elsewhere: a pool short of blocks, a slow step).
        target = self.config.queue_target_s
        return error if target is None else min(error, target / 2)

    def left(self, key: str, answered: bool = False) -> None:
        """The request ended: ``answered`` (it ran to its end), or not (an abort, a timeout,
        an error, or shed from the queue before it started).

        An answer of a request that had started counts as served for the best priority
        waiting then (the engine gives the slot to it), or its own if none waits; a request
        cut short does not: an engine that stalls ends its running requests at their
        deadlines while nothing starts, and that is no room made."""
        self._remove(key)
        priority = self._running.pop(key, None)
        if priority is None or not answered:
            return
        best = min((t.priority for t in self.waiting.values()), default=priority)
        self.trends.of(best).finish()

    def _error_quantile(self, priority: int, quantile: float | None = None) -> float:
        """How far waits of this priority ran past their predictions lately, at ``quantile``
        (``error_quantile`` unless given), at least 0 (0 until there are a few samples).

        For a request's own objective (``quantile`` given) none older than ``rate_max_age_s``
        counts: what a slow spell taught would otherwise refuse every request whose objective
        it fails, and refusals teach nothing new. The target's margin keeps them all: capped at
        half the target, it cannot refuse everything, and aged, a priority whose requests are
        mostly refused (a batch flood's) would be left with no margin at all."""
        samples = self._errors.get(priority, ())
        since = -math.inf if quantile is None else self.clock() - self.config.rate_max_age_s
        errors = [e for at, e in samples if at >= since]
        if len(errors) < 8:
            return 0.0
        q = self.config.error_quantile if quantile is None else quantile
        ordered = sorted(errors)
        return max(0.0, ordered[int(q * (len(ordered) - 1))])

    @property
    def mean_start_interval_s(self) -> float | None:
        """The typical requests' mean interval between starts (None: not measured lately)."""
        return self._pace[False].mean_interval_s

    def paces(self) -> dict[str, dict[str, float | int | None]]:
        """Each kind's measured pace of starts, its stall and how many of it wait (for
        ``/debug/state``)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for large, name in ((False, "typical"), (True, "large")):
            waiting = sum(1 for t in self.waiting.values() if t.large == large)
            pace = self._pace[large]
            out[name] = {
                "waiting": waiting,
                "mean_interval_s": pace.mean_interval_s,
                "stalled_s": round(pace.stalled_s(bool(waiting)), 3),
            }
        return out

    # ----- inside -----
    def _interval_estimate(self) -> float:
        return self._paced_s(False, 1)

    def _make_room(self, count: int, tokens: int, priority: int) -> list[Ticket] | None:
        c = self.config
        n, used = len(self.waiting), self.waiting_tokens
        if count > c.max_waiting_requests or tokens > c.max_waiting_tokens:
            return None
        shed: list[Ticket] = []
        victims = sorted(
            (t for t in self.waiting.values() if t.priority > priority),
            key=lambda t: t.shed_order,
            reverse=True,
        )
        for victim in victims:
            if n + count <= c.max_waiting_requests and used + tokens <= c.max_waiting_tokens:
                break
            shed.append(victim)
            n -= 1
            used -= victim.prompt_tokens
        if n + count <= c.max_waiting_requests and used + tokens <= c.max_waiting_tokens:
            return shed
        return None

    def _enqueue(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            if not any(t.large == ticket.large for t in self.waiting.values()):
                # None of its kind waited: a stall is timed from now, not from before the idle
                # time, and the first start is no sample of the pace (arrival to start is the
                # engine's latency, a step or two, which every request ahead shares; counted,
                # an idle tiny model's 100 ms made four requests ahead "wait" 0.4 s).
                self._pace[ticket.large].queued(ticket.arrival)
            self.waiting[ticket.key] = ticket
            self.waiting_tokens += ticket.prompt_tokens

    def _remove(self, key: str) -> Ticket | None:
        ticket = self.waiting.pop(key, None)
        if ticket is not None:
            self.waiting_tokens -= ticket.prompt_tokens
        return ticket

    def _refuse(self, reason: str, wait: float, retry_after: float) -> Decision:
        return Decision(False, reason, wait, float(max(1, math.ceil(retry_after))))
