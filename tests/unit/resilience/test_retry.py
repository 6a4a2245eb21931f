"""Backoff with full jitter, the deadline cap, and the retry budget."""

import random

from hypothesis import given
from hypothesis import strategies as st

from poise.resilience.retry import RetryBudget, RetryPolicy


@given(st.integers(0, 5), st.integers(0, 1000))
def test_backoff_is_within_the_jittered_envelope(retry, seed):
    p = RetryPolicy(max_retries=10, base_s=0.1, cap_s=1.0)
    d = p.delay_s(retry, random.Random(seed))
    assert d is not None and 0 <= d <= min(1.0, 0.1 * 2**retry)


def test_retry_after_is_respected_and_the_deadline_caps():
    p = RetryPolicy(max_retries=3, base_s=0.1, cap_s=1.0, min_attempt_s=0.1)
    rng = random.Random(1)
    assert p.delay_s(0, rng, retry_after_s=2.0) == 2.0
    assert p.delay_s(0, rng, retry_after_s=2.0, time_left_s=2.05) is None
    assert p.delay_s(0, rng, time_left_s=0.05) is None
    assert p.delay_s(3, rng) is None  # out of retries


def test_the_budget_caps_retries_at_a_share_of_active_requests():
    b = RetryBudget(ratio=0.2, min_concurrent=3, min_per_s=0.3)
    for _ in range(50):
        b.request_started()
    granted = sum(b.try_retry() for _ in range(50))
    assert granted == 10 and b.refused_total == 40
    b.retry_ended()
    assert not b.try_retry()  # room in flight, but the window's share is spent


def test_a_quiet_gateway_may_still_retry():
    b = RetryBudget(ratio=0.2, min_concurrent=3)
    b.request_started()
    assert [b.try_retry() for _ in range(4)] == [True, True, True, False]


def test_over_the_window_retries_stay_a_share_of_requests(clock):
    """In flight never more than the floor, yet one after another they would be unbounded:
    the window caps them at ratio x the requests it saw."""
    b = RetryBudget(ratio=0.2, min_concurrent=3, window_s=10.0, min_per_s=0.3, clock=clock)
    granted = 0
    for _ in range(100):  # one request at a time, each failing and wanting a retry
        b.request_started()
        if b.try_retry():
            granted += 1
            b.retry_ended()
        b.request_ended()
        clock.advance(0.05)
    assert granted == 20  # 0.2 x 100 requests, all within the window
    clock.advance(10.0)  # the window has passed: a quiet gateway may retry again
    b.request_started()
    assert b.try_retry()


def test_a_gateway_that_never_retries_keeps_only_the_windows_requests(clock):
    b = RetryBudget(window_s=10.0, clock=clock)
    for _ in range(20_000):  # 100 requests a second for 200 s, none retried
        b.request_started()
        b.request_ended()
        clock.advance(0.01)
    assert len(b._requests) <= 1001
