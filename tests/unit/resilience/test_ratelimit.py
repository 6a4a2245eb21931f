"""GCRA limits on a fake clock: bursts, steady rates, atomic multi-limit, reconciliation."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from poise.resilience.ratelimit import Charge, Limit, RateLimiter


def req(key: str, rpm: float, burst: float | None = None) -> Charge:
    return Charge(f"{key}:rpm", Limit(rpm, burst), 1, "requests")


def test_a_burst_then_the_steady_rate(clock):
    rl = RateLimiter(clock)
    for _ in range(60):
        assert rl.check([req("a", 60)]).allowed
    refused = rl.check([req("a", 60)])
    assert not refused.allowed and 0 < refused.retry_after_s <= 1.0
    assert refused.headers()["retry-after"] == "1"
    clock.advance(1.0)
    assert rl.check([req("a", 60)]).allowed
    assert not rl.check([req("a", 60)]).allowed


def test_keys_are_independent(clock):
    rl = RateLimiter(clock)
    assert rl.check([req("a", 1)]).allowed
    assert not rl.check([req("a", 1)]).allowed
    assert rl.check([req("b", 1)]).allowed


def test_all_limits_or_none_are_taken(clock):
    rl = RateLimiter(clock)
    tokens = Charge("a:tpm", Limit(100), 80, "tokens")
    assert rl.check([req("a", 10), tokens]).allowed
    refused = rl.check([req("a", 10), tokens])
    assert not refused.allowed and refused.refused_by == "a:tpm"
    # The refused request did not spend a request slot: 9 remain of 10.
    d = rl.check([req("a", 10)])
    assert d.allowed and d.headers()["x-ratelimit-remaining-requests"] == "8"


def test_a_cost_above_the_burst_can_never_pass(clock):
    rl = RateLimiter(clock)
    d = rl.check([Charge("a:tpm", Limit(100), 101, "tokens")])
    assert not d.allowed and math.isinf(d.retry_after_s)
    assert "retry-after" not in d.headers()


def test_reconciliation_gives_back_and_charges(clock):
    rl = RateLimiter(clock)
    estimate = Charge("a:tpm", Limit(100), 100, "tokens")
    assert rl.check([estimate]).allowed
    assert not rl.check([Charge("a:tpm", Limit(100), 10, "tokens")]).allowed
    rl.adjust(Charge("a:tpm", Limit(100), -60, "tokens"))  # only 40 were used
    assert rl.check([Charge("a:tpm", Limit(100), 60, "tokens")]).allowed
    rl.adjust(Charge("a:tpm", Limit(100), -1000, "tokens"))  # never below a full bucket
    d = rl.check([Charge("a:tpm", Limit(100), 1, "tokens")])
    assert d.headers()["x-ratelimit-remaining-tokens"] == "99"


def test_headers_show_the_tightest_limit(clock):
    rl = RateLimiter(clock)
    d = rl.check([req("key", 100), req("model", 10)])
    h = d.headers()
    assert h["x-ratelimit-limit-requests"] == "10"
    assert h["x-ratelimit-remaining-requests"] == "9"
    assert h["x-ratelimit-reset-requests"] == "6.000s"


@settings(max_examples=200)
@given(
    rpm=st.integers(1, 600),
    gaps=st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=300),
)
def test_never_more_than_burst_plus_rate_times_elapsed(rpm, gaps):
    """The defining bound of GCRA: in any run, admitted <= burst + rate * elapsed."""
    now = [0.0]
    rl = RateLimiter(lambda: now[0])
    admitted = 0
    for gap in gaps:
        now[0] += gap
        admitted += rl.check([req("k", rpm)]).allowed
    assert admitted <= rpm + rpm * now[0] / 60.0 + 1e-6
