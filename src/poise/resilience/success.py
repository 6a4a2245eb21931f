"""SPEC formula 2: the probability that a request succeeds end to end, from what each component
was measured to do.

    P = (1 − p_admission) · P(L ≤ T) · [1 − (1 − C)·(1 − r_cache)]

over the requests that are the system's to serve (one refused by its key's own quota, a 4xx,
one whose client left: the client's doing, counted neither way), each term measured over the
same requests (a ``Tally``):

- Redis, where configured, is a component the gateway never fails a request for: a rate-limit
  check Redis does not answer is answered by the gateway's own limiter. Its term is therefore
  1; ``p_redis``, the share of checks it did not answer, is reported to show that it was down.
- ``p_admission``: the share of the requests that the admission queue refused (full, shed, its
  TTL). One whose deadline passed while it waited is the deadline term's.
- ``P(L ≤ T)``: the share of the requests that finished within their deadline: the completed
  ones (each within its own) against those that ran out of time, in the queue or after. Given
  a ``T`` for every request (``SuccessPolicy.timeout_s``, a what-if), it is read from the
  completed requests' latency histogram instead, linear inside the bucket ``T`` falls in.
- ``C``: the backends' stage, fallback models included: ``1 − Π_m (1 − (1 − u_m) · B_m)`` over
  the model and its fallbacks, ``u_m`` the share of the requests sent to pool m that found no
  backend to send to, and ``B_m`` the share that one of its backends answered:
  - a request's first attempt goes to backend i with the share ``w_i`` of first attempts it got
    and ends, with that backend's measured shares of attempts: ok; failed before anything
    reached the client (a 5xx, a timeout, a connection error); cut off, its backend found dead;
    refused for load (429); broken mid-stream where a resume is possible; or failed for good
    (nothing may send it again: a non-retryable status, a call that may not be repeated, a
    stream that cannot be resumed);
  - a failure is retried, within ``max_retries`` and with probability ``g`` (the retry budget's
    grant), on another backend (the same one only if there is no other), picked in proportion to
    the first attempts; each attempt's outcome is independent of the last's;
  - a 429 moves the request at once, outside the budget, to a backend it has not tried (none
    left: it fails); moves count against ``max_retries`` as retries do, as in the forwarder;
  - a cut-off moves it at once, outside policy and budget, to another backend (the walk
    follows ``MAX_MOVES`` such moves a journey; the forwarder, as many as the deadline allows);
  - a broken stream is resumed on another backend, at most ``max_resumes`` times, as a new
    journey with retries of its own;
  - ``g = min(1, allowance / wanted)``: the retries the budget allows over the tally's span S,
    ``max(min_per_s · max(S, window_s), ratio · n)`` with n the admitted requests (every model:
    the budget is the gateway's), against those the failures ask for (the same walk with every
    retry granted). The budget's bound on retries in flight at once is not modelled.
- ``r_cache``: the share of the requests every pool failed that the answer cache served.

Independence is the assumption that makes the product a probability: a request's chance at one
component does not depend on what another did to it. It fails where one cause hits several
components at once (a gateway restart refuses at the gateway and breaks the streams through it;
backends that fill up together refuse a moved request as they refused the first) or where the
failures cluster in time within the span (a retry lands on the backend that has just gone down
too). What the gateway cannot see, such as a connection to the gateway itself breaking, is
outside it.

Pure: the caller tallies what happened (``Tally``) and gives the policy. The walk over backends
follows every path of attempts for pools of up to ``EXACT_BACKENDS`` backends and
``EXACT_PATHS`` paths, and otherwise remembers only the last backend tried
(``_walk_by_last``), whose cost is linear in backends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import Any

# The bounds of the latency histogram, seconds: those of the gateway's request durations.
LATENCY_BOUNDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(slots=True)
class BackendCounts:
    """One backend's attempts: how many were a request's first, and how they ended, by what
    the gateway could do about it."""

    first: int = 0
    ok: int = 0
    failed: int = 0  # before anything reached the client: retried, within policy and budget
    moved: int = 0  # cut off (found dead) or never connected to: moved at once, outside budget
    overloaded: int = 0  # a 429: moved at once to a backend not yet tried, outside the budget
    broken: int = 0  # a stream broken after it began, that can be resumed on another backend
    final: int = 0  # a failure that reaches the client as it is (nothing may retry it)

    @property
    def attempts(self) -> int:
        return self.ok + self.failed + self.moved + self.overloaded + self.broken + self.final


def _latency_buckets() -> list[int]:
    return [0] * (len(LATENCY_BOUNDS) + 1)


@dataclass(slots=True)
class ModelCounts:
    """What the requests for one model came to, and what its pool did with those sent to it
    (its own, and other models' falling back to it)."""

    requests: int = 0  # ended, whatever the outcome (not the client's doing: 4xx, gone, quota)
    refused: int = 0  # by the admission queue: full, shed, its TTL (not a deadline: below)
    missed_deadline: int = 0  # ran out of time, in the queue or after
    sent: int = 0  # requests sent to the pool (retries and resumes not again)
    unroutable: int = 0  # ... that found no backend to send to
    # The completed requests' durations, per bucket of LATENCY_BOUNDS; the last: past them all.
    latency: list[int] = field(default_factory=_latency_buckets)
    cache_tried: int = 0  # every pool failed, and the model keeps an answer cache
    cache_answered: int = 0
    backends: dict[str, BackendCounts] = field(default_factory=dict)

    @property
    def admitted(self) -> int:
        return self.requests - self.refused

    def backend(self, url: str) -> BackendCounts:
        counts = self.backends.get(url)
        if counts is None:
            counts = self.backends[url] = BackendCounts()
        return counts


@dataclass(slots=True)
class Tally:
    """What every component did over ``seconds``: the inputs of the estimate."""

    seconds: float = 0.0
    models: dict[str, ModelCounts] = field(default_factory=dict)
    redis_checks: int = 0  # rate-limit checks with Redis configured
    redis_failed: int = 0  # ... that Redis did not answer (the local limits did)
    boot: str = ""  # the counting gateway's run: totals of another run start from zero

    def model(self, name: str) -> ModelCounts:
        counts = self.models.get(name)
        if counts is None:
            counts = self.models[name] = ModelCounts()
        return counts

    def add(self, other: Tally, sign: int = 1) -> None:
        """Adds ``other``'s counts and time to these (``sign`` -1: takes them away); the boot
        stays this tally's."""
        self.seconds += sign * other.seconds
        self.redis_checks += sign * other.redis_checks
        self.redis_failed += sign * other.redis_failed
        for name, theirs in other.models.items():
            mine = self.model(name)
            _add_ints(mine, theirs, sign)
            mine.latency = [a + sign * b for a, b in zip(mine.latency, theirs.latency, strict=True)]
            for url, b in theirs.backends.items():
                _add_ints(mine.backend(url), b, sign)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        """The tally a ``as_dict`` wrote (a gateway's ``/debug/state``); ValueError if not."""
        try:
            models = {
                name: ModelCounts(
                    **{k: int(v) for k, v in m.items() if k not in ("latency", "backends")},
                    latency=[int(v) for v in m["latency"]],
                    backends={
                        url: BackendCounts(**{k: int(v) for k, v in b.items()})
                        for url, b in m["backends"].items()
                    },
                )
                for name, m in d["models"].items()
            }
            tally = cls(
                float(d["seconds"]),
                models,
                int(d["redis_checks"]),
                int(d["redis_failed"]),
                str(d.get("boot", "")),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a success tally: {exc}") from None
        if any(len(m.latency) != len(LATENCY_BOUNDS) + 1 for m in models.values()):
            raise ValueError("not a success tally: a latency histogram of other bounds")
        return tally


def _add_ints(mine: Any, theirs: Any, sign: int = 1) -> None:
    for f in fields(mine):
        value = getattr(theirs, f.name)
        if isinstance(value, int):
            setattr(mine, f.name, getattr(mine, f.name) + sign * value)


def increase(samples: Iterable[Tally]) -> Tally:
    """What a gateway's running totals (``seconds``: its time since it started) grew by from
    the first of successive samples of them to the last. Totals of another run of the gateway
    (``boot``), or whose time went back, are a restarted gateway's, counted from zero: all of
    them is growth."""
    total = Tally()
    last: Tally | None = None
    for cur in samples:
        if last is not None:
            total.add(cur)
            if cur.boot == last.boot and cur.seconds >= last.seconds:
                total.add(last, -1)
        last = cur
    return total


@dataclass(frozen=True, slots=True)
class SuccessPolicy:
    """What the gateway does about failures, as the estimate needs it."""

    # T for P(L <= T): None, each request's own deadline (the gateway's reading: a completed
    # request met its own); a number, what-if every request had this deadline (the histogram).
    timeout_s: float | None = None
    max_retries: int = 2
    budget_ratio: float = 0.2
    budget_min_per_s: float = 1.0
    budget_window_s: float = 10.0
    max_resumes: int = 2  # continuations of one broken stream
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a model's, in order

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SuccessPolicy:
        try:
            timeout = d["timeout_s"]
            return cls(
                None if timeout is None else float(timeout),
                int(d["max_retries"]),
                float(d["budget_ratio"]),
                float(d["budget_min_per_s"]),
                float(d["budget_window_s"]),
                int(d["max_resumes"]),
                {str(k): tuple(map(str, v)) for k, v in d["fallbacks"].items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a success policy: {exc}") from None


@dataclass(frozen=True, slots=True)
class Estimate:
    """Formula 2 for one model, with each of its terms."""

    probability: float
    requests: int  # the tally's requests for the model
    redis_unavailable: float  # p_redis: the share of limit checks Redis did not answer
    refused: float  # p_admission
    within_deadline: float  # P(L <= T)
    unroutable: float  # u: no backend to send to, among the requests sent to the pool
    first_attempt: float  # one attempt's success, the first pick's odds
    backends: float  # B: after retries, moves and resumes
    budget_grant: float  # g
    with_fallbacks: float  # C: after the fallback models
    cache_recovered: float  # r_cache

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def estimate(tally: Tally, policy: SuccessPolicy) -> dict[str, Estimate]:
    """Formula 2 for every model of the tally with requests in it."""
    grant = _budget_grant(tally, policy)
    walks = {name: _walk(m.backends, policy, grant) for name, m in tally.models.items()}
    redis_p = _share(tally.redis_failed, tally.redis_checks)
    out = {}
    for name, m in tally.models.items():
        if m.requests <= 0:
            continue
        chain = [name, *policy.fallbacks.get(name, ())]
        # A pool sent nothing in the tally has shown nothing: it recovers nothing.
        all_fail = math.prod(
            1 - _routed(tally.models[n], walks[n][0])
            if n in tally.models and tally.models[n].sent > 0
            else 1.0
            for n in chain
        )
        p_admission = _share(m.refused, m.requests)
        within = within_deadline(m.latency, m.missed_deadline, policy.timeout_s)
        cache = _share(m.cache_answered, m.cache_tried)
        # Redis's term is 1: every check it does not answer, the local limits answer.
        p = (1 - p_admission) * within * (1 - all_fail * (1 - cache))
        out[name] = Estimate(
            probability=p,
            requests=m.requests,
            redis_unavailable=redis_p,
            refused=p_admission,
            within_deadline=within,
            unroutable=_share(m.unroutable, m.sent),
            first_attempt=_first_attempt(m.backends),
            backends=walks[name][0],
            budget_grant=grant,
            with_fallbacks=1 - all_fail,
            cache_recovered=cache,
        )
    return out


def within_deadline(latency: list[int], missed: int, timeout_s: float | None = None) -> float:
    """P(L <= T): the share of the histogram's requests and the ``missed`` ones (past every
    bound) within their deadline. ``timeout_s`` None: each within its own, that is, every
    completed one; a number: within that, linear inside the bucket it falls in, those past the
    last bound within any T beyond it."""
    total = sum(latency) + missed
    if total <= 0:
        return 1.0
    if timeout_s is None:
        return sum(latency) / total
    within, lower = 0.0, 0.0
    for bound, count in zip(LATENCY_BOUNDS, latency, strict=False):
        if timeout_s >= bound:
            within += count
        elif timeout_s > lower:
            within += count * (timeout_s - lower) / (bound - lower)
        lower = bound
    if timeout_s >= LATENCY_BOUNDS[-1]:
        within += latency[-1]
    return within / total


def _share(part: float, whole: float, empty: float = 0.0) -> float:
    return part / whole if whole > 0 else empty


def _routed(m: ModelCounts, backends: float) -> float:
    """(1 - u) · B: a request sent to the pool found a backend, and one answered it."""
    return (1 - _share(m.unroutable, m.sent)) * backends


def _first_attempt(backends: dict[str, BackendCounts]) -> float:
    firsts = sum(b.first for b in backends.values() if b.attempts > 0)
    if firsts <= 0:
        return 1.0
    return sum(b.first * b.ok / b.attempts for b in backends.values() if b.attempts > 0) / firsts


def _budget_grant(tally: Tally, policy: SuccessPolicy) -> float:
    if tally.seconds <= 0:
        return 1.0
    admitted = sum(max(0, m.admitted) for m in tally.models.values())
    wanted = sum(
        max(0, m.sent - m.unroutable) * _walk(m.backends, policy, 1.0)[1]
        for m in tally.models.values()
    )
    if wanted <= 0:
        return 1.0
    # Over a span shorter than the budget's window the floor is the whole window's.
    floor = policy.budget_min_per_s * max(tally.seconds, policy.budget_window_s)
    return min(1.0, max(floor, policy.budget_ratio * admitted) / wanted)


EXACT_BACKENDS = 6  # the most backends a pool may have for the walk that remembers them all
EXACT_PATHS = 5000  # ... and the most paths (backends ** (max_retries + 1)) it may walk
MAX_MOVES = 2  # moves off dead backends the walk follows in one journey


def _walk(
    backends: dict[str, BackendCounts], policy: SuccessPolicy, grant: float
) -> tuple[float, float]:
    """(B: the share of requests sent to the pool that a backend answered, the retries their
    failures asked the budget for): every path of attempts the forwarder may take, weighted by
    its odds.

    A path is cut where the forwarder stops: ``max_retries`` retries and moves for load,
    ``max_resumes`` resumes of a broken stream (and ``MAX_MOVES`` moves off dead backends,
    which the forwarder bounds only by the deadline). The walk remembers every backend a
    journey tried (a refusal for load moves only to one not tried) for pools of at most
    ``EXACT_BACKENDS`` backends and ``EXACT_PATHS`` paths: its states are the subsets of the
    backends. Beyond, it is ``_walk_by_last``'s, which remembers only the last.
    """
    urls = tuple(sorted(u for u, b in backends.items() if b.attempts > 0))
    if not urls:
        return 1.0, 0.0  # no attempt made: nothing has failed
    if len(urls) > EXACT_BACKENDS or len(urls) ** (policy.max_retries + 1) > EXACT_PATHS:
        return _walk_by_last(backends, urls, policy, grant)
    odds = {
        u: tuple(n / b.attempts for n in (b.ok, b.failed, b.moved, b.overloaded, b.broken))
        for u, b in backends.items()
        if b.attempts > 0
    }
    firsts = {u: backends[u].first for u in urls}
    if not any(firsts.values()):
        firsts = {u: backends[u].attempts for u in urls}

    def picks(candidates: tuple[str, ...]) -> list[tuple[str, float]]:
        weight = sum(firsts[u] for u in candidates)
        if weight <= 0:  # none of them was ever a first pick: equally likely
            return [(u, 1 / len(candidates)) for u in candidates]
        return [(u, firsts[u] / weight) for u in candidates if firsts[u] > 0]

    @cache
    def attempt(
        candidates: tuple[str, ...], tried: frozenset[str], retries: int, resumes: int, moves: int
    ) -> tuple[float, float]:
        success = asked = 0.0
        for u, share in picks(candidates):
            ok, failed, moved, overloaded, broken = odds[u]
            now_tried = tried | {u}
            # Anyone but this one (itself when there is no other), or one not tried yet.
            others = tuple(v for v in urls if v != u) or (u,)
            untried = tuple(v for v in urls if v != u and v not in tried)
            s, a = ok, 0.0
            # Only the branches a backend's odds can take: a healthy pool is walked at once.
            if failed and retries < policy.max_retries:
                sub_s, sub_a = attempt(others, now_tried, retries + 1, resumes, moves)
                s += failed * grant * sub_s
                a += failed * (1 + grant * sub_a)
            if overloaded and untried and retries < policy.max_retries:
                sub_s, sub_a = attempt(untried, now_tried, retries + 1, resumes, moves)
                s += overloaded * sub_s
                a += overloaded * sub_a
            if moved and moves < MAX_MOVES:  # as after a failure: anyone but the last
                sub_s, sub_a = attempt(others, now_tried, retries, resumes, moves + 1)
                s += moved * sub_s
                a += moved * sub_a
            if broken and resumes < policy.max_resumes:
                # A new journey, on another backend, with the retries of a new one.
                sub_s, sub_a = attempt(others, frozenset({u}), 0, resumes + 1, moves)
                s += broken * sub_s
                a += broken * sub_a
            success += share * s
            asked += share * a
        return success, asked

    return attempt(urls, frozenset(), 0, 0, 0)


def _walk_by_last(
    backends: dict[str, BackendCounts],
    urls: tuple[str, ...],
    policy: SuccessPolicy,
    grant: float,
) -> tuple[float, float]:
    """``_walk`` for a large pool or many retries, remembering only the last backend tried:
    every next attempt (a move for load too) goes to any backend but the last. A state's odds
    are then the same for every backend but the last, so each state costs one pass over the
    backends: O(backends · retries · resumes · moves)."""
    counts = [backends[u] for u in urls]
    weights = [b.first for b in counts]
    if not any(weights):
        weights = [b.attempts for b in counts]
    total_weight = sum(weights)
    odds = [
        [n / b.attempts for n in (b.ok, b.failed, b.moved, b.overloaded, b.broken)] for b in counts
    ]

    @cache
    def each(retries: int, resumes: int, moves: int) -> list[tuple[float, float]]:
        """Per backend: (success, retries asked) of an attempt on it in this state."""
        out = []
        for j, (ok, failed, moved, overloaded, broken) in enumerate(odds):
            s, a = ok, 0.0
            if retries < policy.max_retries:
                sub_s, sub_a = elsewhere(j, retries + 1, resumes, moves)
                s += failed * grant * sub_s + overloaded * sub_s
                a += failed * (1 + grant * sub_a) + overloaded * sub_a
            if moves < MAX_MOVES:
                sub_s, sub_a = elsewhere(j, retries, resumes, moves + 1)
                s, a = s + moved * sub_s, a + moved * sub_a
            if resumes < policy.max_resumes:
                sub_s, sub_a = elsewhere(j, 0, resumes + 1, moves)
                s, a = s + broken * sub_s, a + broken * sub_a
            out.append((s, a))
        return out

    @cache
    def anywhere(retries: int, resumes: int, moves: int) -> tuple[float, float]:
        values = each(retries, resumes, moves)
        return (
            sum(w * v[0] for w, v in zip(weights, values, strict=True)),
            sum(w * v[1] for w, v in zip(weights, values, strict=True)),
        )

    def elsewhere(j: int, retries: int, resumes: int, moves: int) -> tuple[float, float]:
        """An attempt on any backend but ``j`` (``j`` itself when there is no other)."""
        own = each(retries, resumes, moves)[j]
        rest = total_weight - weights[j]
        if rest <= 0:
            return own
        s, a = anywhere(retries, resumes, moves)
        return (s - weights[j] * own[0]) / rest, (a - weights[j] * own[1]) / rest

    s, a = anywhere(0, 0, 0)
    return s / total_weight, a / total_weight


@dataclass(frozen=True, slots=True)
class RunSuccess:
    """A run's predicted success (formula 2 from the gateway's counts over the run) beside the
    share of its requests its clients saw succeed."""

    predicted: float | None  # None: the gateway did not say (not poise, or it saw no request)
    observed: float | None  # None: no request that counts
    model: str | None = None  # the model the prediction is for
    terms: dict[str, Any] | None = None  # the estimate, term by term
    difference_pp: float | None = None  # predicted minus observed, in percentage points
    counts: dict[str, Any] | None = None  # the model's counts over the run, the terms' inputs

    @classmethod
    def of(
        cls,
        predicted: float | None,
        observed: float | None,
        model: str | None = None,
        terms: dict[str, Any] | None = None,
        counts: dict[str, Any] | None = None,
    ) -> RunSuccess:
        diff = None if predicted is None or observed is None else 100 * (predicted - observed)
        return cls(predicted, observed, model, terms, diff, counts)


def run_success(
    tallies: Sequence[Tally],
    policy: SuccessPolicy | None,
    succeeded: int,
    counted: int,
    model: str | None = None,
) -> RunSuccess:
    """``tallies``: the gateway's running totals read through the run, the first before its
    first request and the last after its last answer; ``succeeded`` of ``counted`` requests
    succeeded as the clients saw them; ``model``: the one they asked for (else the busiest)."""
    observed = succeeded / counted if counted > 0 else None
    if policy is None or len(tallies) < 2:
        return RunSuccess.of(None, observed)
    grown = increase(tallies)
    estimates = estimate(grown, policy)
    if not estimates:
        return RunSuccess.of(None, observed)
    if model not in estimates:
        model = max(estimates, key=lambda name: estimates[name].requests)
    e = estimates[model]
    counts = asdict(grown.models[model])
    return RunSuccess.of(e.probability, observed, model, e.as_dict(), counts)
