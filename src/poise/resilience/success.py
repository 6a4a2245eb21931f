"""SPEC formula 2: the probability that a request succeeds end to end, from what each component
was measured to do.

    P = (1 − p_redis·(1 − r_fallback)) · (1 − p_admission) · P(L ≤ T) · [1 − (1 − C)·(1 − r_cache)]

over the requests within their key's rate limits (one refused by its own quota is the client's
doing, as a 4xx is, and counts neither way), term by term, each measured over the same
requests (a ``Tally``):

- ``p_redis · (1 − r_fallback)``: Redis, where configured, is a component whose failures the
  local fallback recovers whole (a check Redis cannot answer is answered by the gateway's own
  limiter): ``p_redis`` is the share of checks it did not answer and ``r_fallback`` the share of
  those the local limits answered, so the term is 1 as long as every failed check fell back.
- ``p_admission``: the share of the requests that the admission queue refused (full, shed, its
  TTL or their deadline passed while waiting).
- ``P(L ≤ T)``: the share of the admitted requests that finished within the deadline ``T``,
  read from the latency distribution of the completed ones (a histogram), with the requests that
  ran out of time counted past every bound. At the gateway's own deadline every completed
  request is within it; at a shorter ``T``, the histogram says how many would not have been.
- ``C``: the backends' stage, fallback models included: ``1 − Π_m (1 − (1 − u_m) · B_m)`` over
  the model and its fallbacks, ``u_m`` the share of requests that found no backend to send to
  and ``B_m`` the share that one of its backends answered, retries included:
  - a request's first attempt goes to backend i with the share ``w_i`` of first attempts it got,
    and ends ok, failed (5xx, timeout, connection) or refused for load (429), each with that
    backend's measured share of attempts;
  - a failed attempt is retried, within ``max_retries`` and with probability ``g`` (the retry
    budget's grant), on another backend (the same one only if there is no other), picked in
    proportion to the first attempts; each backend's outcomes are independent of the last's;
  - a 429 moves the request at once, outside the budget, to a backend it has not tried; none
    left, and it fails. Moves count against ``max_retries`` as retries do, as in the forwarder.
  - ``g = min(1, allowance / wanted)``: the retries the budget allows over the tally's span S,
    ``max(min_per_s · max(S, window_s), ratio · n)`` with n the admitted requests (every model:
    the budget is the gateway's), against those the failures ask for (the same walk with every
    retry granted). The budget's bound on retries in flight at once is not modelled.
- ``r_cache``: the share of the requests every pool failed that the answer cache served.

Independence is the assumption that makes the product a probability: a request's chance at one
component does not depend on what another did to it. It fails where one cause hits several
components at once (a gateway restart refuses at the gateway and breaks the streams through it)
or where the failures cluster in time within the window (a retry lands on the backend that has
just gone down too). What the estimate cannot see at all, such as a connection to the gateway
itself breaking, is outside it.

Pure: the caller tallies what happened (``Tally``) and gives the policy; the walk over backends
is exact (every path of at most ``max_retries + 1`` attempts), so its cost grows as the cube of
the backends of a pool: about a millisecond for 10 backends.
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
    """One backend's attempts: how many were a request's first, and how they ended."""

    first: int = 0
    ok: int = 0
    failed: int = 0  # a 5xx, a timeout, a connection refused or broken
    overloaded: int = 0  # a 429: the request moves to another backend

    @property
    def attempts(self) -> int:
        return self.ok + self.failed + self.overloaded


def _latency_buckets() -> list[int]:
    return [0] * (len(LATENCY_BOUNDS) + 1)


@dataclass(slots=True)
class ModelCounts:
    """What the requests for one model came to."""

    requests: int = 0  # ended, whatever the outcome (not those their client gave up on)
    refused: int = 0  # by the admission queue
    unroutable: int = 0  # admitted, with no backend to send to
    missed_deadline: int = 0  # admitted, and ran out of time
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
    redis_failed: int = 0  # ... that Redis did not answer
    redis_fell_back: int = 0  # ... that the local limiter answered instead

    def model(self, name: str) -> ModelCounts:
        counts = self.models.get(name)
        if counts is None:
            counts = self.models[name] = ModelCounts()
        return counts

    def add(self, other: Tally, sign: int = 1) -> None:
        """Adds ``other``'s counts and time to these (``sign`` -1: takes them away)."""
        self.seconds += sign * other.seconds
        self.redis_checks += sign * other.redis_checks
        self.redis_failed += sign * other.redis_failed
        self.redis_fell_back += sign * other.redis_fell_back
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
                int(d["redis_fell_back"]),
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
    the first of successive samples of them to the last. Totals whose time went back are a
    restarted gateway's, counted from zero: all of them is growth."""
    total = Tally()
    last: Tally | None = None
    for cur in samples:
        if last is not None:
            total.add(cur)
            if cur.seconds >= last.seconds:
                total.add(last, -1)
        last = cur
    return total


@dataclass(frozen=True, slots=True)
class SuccessPolicy:
    """What the gateway does about failures, as the estimate needs it."""

    timeout_s: float = 600.0  # T: the deadline of a request that asks for none
    max_retries: int = 2
    budget_ratio: float = 0.2
    budget_min_per_s: float = 1.0
    budget_window_s: float = 10.0
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a model's, in order

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SuccessPolicy:
        try:
            return cls(
                float(d["timeout_s"]),
                int(d["max_retries"]),
                float(d["budget_ratio"]),
                float(d["budget_min_per_s"]),
                float(d["budget_window_s"]),
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
    redis_recovered: float  # r_fallback: of those, the share the local limits answered
    refused: float  # p_admission
    within_deadline: float  # P(L <= T)
    unroutable: float  # u: no backend to send to
    first_attempt: float  # one attempt's success, the first pick's odds
    backends: float  # B: after retries and moves
    budget_grant: float  # g
    with_fallbacks: float  # C: after the fallback models
    cache_recovered: float  # r_cache

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def estimate(tally: Tally, policy: SuccessPolicy) -> dict[str, Estimate]:
    """Formula 2 for every model of the tally with requests in it."""
    grant = _budget_grant(tally, policy)
    stages = {name: _stage(m, policy, grant) for name, m in tally.models.items()}
    redis_p = _share(tally.redis_failed, tally.redis_checks)
    redis_r = _share(tally.redis_fell_back, tally.redis_failed, empty=1.0)
    out = {}
    for name, m in tally.models.items():
        if m.requests <= 0:
            continue
        chain = [name, *policy.fallbacks.get(name, ())]
        # A fallback model with no requests of its own in the tally has shown nothing: 0.
        all_fail = math.prod(1 - stages[n][2] if n in stages else 1.0 for n in chain)
        p_redis = redis_p * (1 - redis_r)
        p_admission = _share(m.refused, m.requests)
        within = within_deadline(m.latency, m.missed_deadline, policy.timeout_s)
        cache = _share(m.cache_answered, m.cache_tried)
        first, backends, _ = stages[name]
        p = (1 - p_redis) * (1 - p_admission) * within * (1 - all_fail * (1 - cache))
        out[name] = Estimate(
            probability=p,
            requests=m.requests,
            redis_unavailable=redis_p,
            redis_recovered=redis_r,
            refused=p_admission,
            within_deadline=within,
            unroutable=_share(m.unroutable, m.admitted),
            first_attempt=first,
            backends=backends,
            budget_grant=grant,
            with_fallbacks=1 - all_fail,
            cache_recovered=cache,
        )
    return out


def within_deadline(latency: list[int], missed: int, timeout_s: float) -> float:
    """P(L <= T): the share of the histogram's requests (and ``missed``, past every bound)
    within ``timeout_s``, linear within the bucket it falls in. Those past the last bound
    completed, so within any T beyond it."""
    total = sum(latency) + missed
    if total <= 0:
        return 1.0
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


def _stage(m: ModelCounts, policy: SuccessPolicy, grant: float) -> tuple[float, float, float]:
    """(first attempt, B, (1 - u) · B) of one model."""
    first, _ = _walk(m.backends, 0, 1.0)
    success, _ = _walk(m.backends, policy.max_retries, grant)
    return first, success, (1 - _share(m.unroutable, m.admitted)) * success


def _budget_grant(tally: Tally, policy: SuccessPolicy) -> float:
    if tally.seconds <= 0:
        return 1.0
    admitted = sum(max(0, m.admitted) for m in tally.models.values())
    wanted = sum(
        max(0, m.admitted - m.unroutable) * _walk(m.backends, policy.max_retries, 1.0)[1]
        for m in tally.models.values()
    )
    if wanted <= 0:
        return 1.0
    # Over a span shorter than the budget's window the floor is the whole window's.
    floor = policy.budget_min_per_s * max(tally.seconds, policy.budget_window_s)
    return min(1.0, max(floor, policy.budget_ratio * admitted) / wanted)


def _walk(
    backends: dict[str, BackendCounts], max_retries: int, grant: float
) -> tuple[float, float]:
    """(the share of requests a backend answered, the retries their failures asked for): every
    path of attempts the forwarder may take, weighted by its odds."""
    urls = tuple(sorted(u for u, b in backends.items() if b.attempts > 0))
    if not urls:
        return 1.0, 0.0  # no attempt made: nothing has failed
    odds = {
        u: (b.ok / b.attempts, b.failed / b.attempts, b.overloaded / b.attempts)
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
        candidates: tuple[str, ...], tried: frozenset[str], retries: int
    ) -> tuple[float, float]:
        success = asked = 0.0
        for u, share in picks(candidates):
            ok, failed, overloaded = odds[u]
            s, a = ok, 0.0
            if retries < max_retries:
                # A failure: to another backend than this one (itself when there is no other).
                others = tuple(v for v in urls if v != u) or (u,)
                sub_s, sub_a = attempt(others, tried | {u}, retries + 1)
                s += failed * grant * sub_s
                a += failed * (1 + grant * sub_a)
                # A refusal for load: at once to one it has not tried; none left, it fails.
                untried = tuple(v for v in urls if v not in tried and v != u)
                if untried:
                    sub_s, sub_a = attempt(untried, tried | {u}, retries + 1)
                    s += overloaded * sub_s
                    a += overloaded * sub_a
            success += share * s
            asked += share * a
        return success, asked

    return attempt(urls, frozenset(), 0)


@dataclass(frozen=True, slots=True)
class RunSuccess:
    """A run's predicted success (formula 2 from the gateway's counts over the run) beside the
    share of its requests its clients saw succeed."""

    predicted: float | None  # None: the gateway did not say (not poise, or it saw no request)
    observed: float | None  # None: no request that counts
    model: str | None = None  # the model the prediction is for: the run's busiest
    terms: dict[str, Any] | None = None  # the estimate, term by term
    difference_pp: float | None = None  # predicted minus observed, in percentage points

    @classmethod
    def of(
        cls,
        predicted: float | None,
        observed: float | None,
        model: str | None = None,
        terms: dict[str, Any] | None = None,
    ) -> RunSuccess:
        diff = None if predicted is None or observed is None else 100 * (predicted - observed)
        return cls(predicted, observed, model, terms, diff)


def run_success(
    tallies: Sequence[Tally], policy: SuccessPolicy | None, succeeded: int, counted: int
) -> RunSuccess:
    """``tallies``: the gateway's running totals read through the run, the first before its
    first request and the last after its last answer; ``succeeded`` of ``counted`` requests
    succeeded as the clients saw them."""
    observed = succeeded / counted if counted > 0 else None
    if policy is None or len(tallies) < 2:
        return RunSuccess.of(None, observed)
    estimates = estimate(increase(tallies), policy)
    if not estimates:
        return RunSuccess.of(None, observed)
    model, e = max(estimates.items(), key=lambda kv: kv[1].requests)
    return RunSuccess.of(e.probability, observed, model, e.as_dict())
