"""Formula 2 on scripted component counts, against values worked out by hand."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise.resilience.success import (
    LATENCY_BOUNDS,
    BackendCounts,
    SuccessPolicy,
    Tally,
    _walk,
    _walk_by_last,
    estimate,
    increase,
    within_deadline,
)

SECOND = LATENCY_BOUNDS.index(1.0)  # the bucket (0.5, 1] s
TEN = LATENCY_BOUNDS.index(10.0)  # the bucket (5, 10] s


def two_backends(
    a_fails: float, b_fails: float, requests: int = 100, seconds: float = 100.0
) -> Tally:
    """Requests split evenly between a and b, each failing its share of attempts."""
    t = Tally(seconds=seconds)
    m = t.model("m")
    m.requests = m.sent = requests
    m.latency[SECOND] = requests
    for url, fails in (("a", a_fails), ("b", b_fails)):
        failed = round(1000 * fails)
        m.backends[url] = BackendCounts(first=requests // 2, ok=1000 - failed, failed=failed)
    return t


def p(t: Tally, **policy: object) -> float:
    return estimate(t, SuccessPolicy(**policy))["m"].probability  # type: ignore[arg-type]


def test_one_failing_backend_of_two_without_retries_loses_its_half():
    e = estimate(two_backends(1.0, 0.0), SuccessPolicy(max_retries=0))["m"]
    assert e.first_attempt == 0.5 and e.backends == 0.5 and e.probability == 0.5


def test_one_failing_backend_of_two_with_retries_recovers_on_the_other():
    # A failure on a is retried on b, which answers: all succeed (1 request/s: within budget).
    e = estimate(two_backends(1.0, 0.0), SuccessPolicy())["m"]
    assert e.first_attempt == 0.5 and e.budget_grant == 1.0 and e.probability == 1.0


def test_retries_alternate_between_two_partly_failing_backends():
    t = two_backends(0.5, 0.1)
    # One retry: from a, b's 0.9; from b, a's 0.5.
    assert p(t, max_retries=1) == pytest.approx(0.5 * (0.5 + 0.5 * 0.9) + 0.5 * (0.9 + 0.1 * 0.5))
    # Two: the second goes back to the first backend (not the last one tried).
    from_a = 0.5 + 0.5 * (0.9 + 0.1 * 0.5)
    from_b = 0.9 + 0.1 * (0.5 + 0.5 * 0.9)
    assert p(t, max_retries=2) == pytest.approx(0.5 * from_a + 0.5 * from_b)


def test_the_retry_budget_caps_what_retries_recover_under_load():
    # 100 requests a second, half failing on a: 50 retries a second wanted, 20 allowed
    # (ratio 0.2 of 100): 40 % of the failures are retried.
    e = estimate(two_backends(1.0, 0.0, requests=10_000), SuccessPolicy())["m"]
    assert e.budget_grant == pytest.approx(0.4)
    assert e.probability == pytest.approx(0.5 + 0.5 * 0.4)


def test_a_refusal_for_load_moves_outside_the_budget_to_an_untried_backend():
    t = Tally(seconds=1.0)
    m = t.model("m")
    m.requests = m.sent = m.latency[SECOND] = 10_000
    m.backends["a"] = BackendCounts(first=5000, overloaded=100)
    m.backends["b"] = BackendCounts(first=5000, ok=100)
    # The budget would allow 20 % of the failures; moves need none of it.
    assert p(t) == 1.0
    assert p(t, max_retries=0) == 0.5  # a move counts as a retry
    m.backends["b"] = BackendCounts(first=5000, overloaded=100)
    assert p(t) == 0.0  # every backend refused: the client hears 429


def test_a_timeout_shorter_than_the_latency_tail_loses_the_tail():
    t = Tally(seconds=100.0)
    m = t.model("m")
    m.requests = m.sent = 100
    m.latency[SECOND] = 90  # within a second
    m.latency[TEN] = 10  # between 5 and 10 s
    m.backends["a"] = BackendCounts(first=100, ok=100)
    assert p(t, timeout_s=5.0) == pytest.approx(0.9)
    assert p(t, timeout_s=7.5) == pytest.approx(0.95)  # halfway through the tail's bucket
    assert p(t, timeout_s=600.0) == 1.0
    assert p(t) == 1.0  # each within its own deadline: every one that completed
    m.missed_deadline = 25  # and some ran out of time altogether
    assert p(t, timeout_s=600.0) == p(t) == pytest.approx(100 / 125)
    assert p(t, timeout_s=5.0) == pytest.approx(90 / 125)


def test_redis_down_with_the_local_fallback_costs_nothing():
    up = two_backends(0.0, 0.4)
    up.redis_checks = 1000
    down = two_backends(0.0, 0.4)
    down.redis_checks = down.redis_failed = 1000
    e = estimate(down, SuccessPolicy(max_retries=0))["m"]
    assert e.redis_unavailable == 1.0  # seen: every check went to the local limits
    assert e.probability == p(up, max_retries=0) == pytest.approx(0.5 + 0.5 * 0.6)


def test_admission_deadline_and_unroutable_multiply():
    t = two_backends(0.0, 0.0)
    m = t.model("m")
    # Of 100 requests: 10 refused by the queue; of the 90 sent to the pool, 9 found no backend;
    # 72 completed and 9 ran out of time.
    m.refused, m.sent, m.unroutable, m.missed_deadline = 10, 90, 9, 9
    m.latency[SECOND] = 72
    e = estimate(t, SuccessPolicy())["m"]
    assert (e.refused, e.unroutable, e.within_deadline) == pytest.approx((0.1, 0.1, 72 / 81))
    assert e.probability == pytest.approx(0.9 * 0.9 * 72 / 81)


def test_fallback_models_and_the_cache_recover_what_the_pool_lost():
    t = two_backends(1.0, 1.0)  # model m: every attempt fails
    spare = t.model("spare")
    spare.requests = spare.sent = spare.latency[SECOND] = 10
    spare.backends["c"] = BackendCounts(first=10, ok=8, failed=2)
    once = {"max_retries": 0}
    assert p(t, **once) == 0.0
    assert p(t, fallbacks={"m": ("spare",)}, **once) == pytest.approx(0.8)
    t.model("m").cache_tried, t.model("m").cache_answered = 10, 5
    assert p(t, **once) == pytest.approx(0.5)
    assert p(t, fallbacks={"m": ("spare",)}, **once) == pytest.approx(1 - 0.2 * 0.5)
    # A fallback model with no traffic of its own has shown nothing: it adds nothing; nor one
    # whose requests were all refused by its queue (none was sent to its pool).
    t.model("queued").requests = t.model("queued").refused = 5
    for idle in ("idle", "queued"):
        assert p(t, fallbacks={"m": (idle,)}, **once) == pytest.approx(0.5)


def test_within_deadline_counts_past_the_last_bound_as_completed():
    buckets = [0] * (len(LATENCY_BOUNDS) + 1)
    buckets[-1] = 4  # took over 80 s, and completed
    assert within_deadline(buckets, 1, 120.0) == pytest.approx(0.8)
    assert within_deadline(buckets, 1, 40.0) == 0.0
    assert within_deadline([0] * len(buckets), 0, 1.0) == 1.0  # nothing seen: nothing missed


def test_increase_takes_the_growth_and_counts_a_restart_from_zero():
    def at(seconds: float, requests: int, ok: int) -> Tally:
        t = Tally(seconds=seconds, boot=boot)
        t.model("m").requests = requests
        t.model("m").backend("a").ok = ok
        return t

    boot = "one"
    first = [at(10, 100, 90), at(20, 150, 140)]
    boot = "two"  # restarted: its time went back
    second = [at(3, 7, 7), at(8, 20, 19)]
    boot = "three"  # restarted, and up longer by the next reading than the last one was
    third = [at(9, 4, 4)]
    grown = increase([*first, *second, *third])
    # 50 between the first two; then 7, and 13 more; then 4.
    assert grown.models["m"].requests == 50 + 7 + 13 + 4
    assert grown.models["m"].backends["a"].ok == 50 + 7 + 12 + 4
    assert grown.seconds == 10 + 3 + 5 + 9
    assert Tally.from_dict(grown.as_dict()) == grown
    with pytest.raises(ValueError):
        Tally.from_dict({"models": {}})


rates = st.floats(0, 1)


@given(rates, rates, rates, st.integers(0, 3))
def test_more_retries_never_predict_less_when_the_budget_allows(a, b, c, retries):
    t = Tally(seconds=1000.0)
    m = t.model("m")
    m.requests = m.sent = m.latency[SECOND] = 100
    for url, fails, first in (("a", a, 50), ("b", b, 30), ("c", c, 20)):
        failed = round(100 * fails)
        m.backends[url] = BackendCounts(first=first, ok=100 - failed, failed=failed)
    fewer, more = p(t, max_retries=retries), p(t, max_retries=retries + 1)
    assert 0.0 <= fewer <= more + 1e-12 <= 1.0 + 1e-12


def test_the_walk_follows_what_the_forwarder_can_do_about_each_failure():
    def pool(**a_odds: int) -> Tally:
        t = two_backends(0.0, 0.0)
        t.model("m").backends["a"] = BackendCounts(first=50, **a_odds)
        return t

    # a fails half its attempts, b none; whatever a did, b answers what reaches it.
    for kind in ("failed", "moved", "overloaded", "broken"):
        assert p(pool(ok=50, **{kind: 50})) == 1.0, kind
    # Nothing may retry a final failure (a non-retryable 5xx, a broken stream that cannot be
    # resumed, a call that may not be sent twice).
    assert p(pool(ok=50, final=50)) == pytest.approx(0.75)
    # Retries are the policy's, moves off a dead backend and resumes are not.
    assert p(pool(ok=50, failed=50), max_retries=0) == pytest.approx(0.75)
    assert p(pool(ok=50, moved=50), max_retries=0) == 1.0
    assert p(pool(ok=50, broken=50), max_retries=0) == 1.0
    assert p(pool(ok=50, broken=50), max_retries=0, max_resumes=0) == pytest.approx(0.75)


def test_a_large_pool_is_walked_in_bounded_time():
    import time

    t = Tally(seconds=60.0)
    m = t.model("m")
    m.requests = m.sent = m.latency[SECOND] = 6400
    for i in range(64):
        m.backends[f"b{i:02}"] = BackendCounts(first=100, ok=90, failed=5, overloaded=3, broken=2)
    t0 = time.perf_counter()
    e = estimate(t, SuccessPolicy(max_retries=10))["m"]
    assert time.perf_counter() - t0 < 2.0
    assert 0.99 < e.probability <= 1.0


@given(rates, rates, st.integers(0, 4), st.integers(0, 2))
def test_the_walk_by_the_last_backend_agrees_with_the_exact_one_on_two(a, b, retries, resumes):
    # On two backends, "any but the last" is "the other": both walks take the same paths.
    backends = {
        "a": BackendCounts(first=60, ok=round(100 * (1 - a)), failed=round(50 * a),
                           moved=round(20 * a), broken=round(30 * a)),
        "b": BackendCounts(first=40, ok=round(100 * (1 - b)), failed=round(100 * b)),
    }  # fmt: skip
    policy = SuccessPolicy(max_retries=retries, max_resumes=resumes)
    exact = _walk(backends, policy, 0.7)
    by_last = _walk_by_last(backends, ("a", "b"), policy, 0.7)
    assert by_last == pytest.approx(exact)
