"""The breaker's state machine on a fake clock (SPEC formula 4)."""

import pytest

from poise.resilience.breaker import BreakerConfig, BreakerState, CircuitBreaker


def calls(b, outcomes, duration_s=0.1):
    for ok in outcomes:
        assert b.acquire()
        b.record(ok, duration_s)


def make(clock, **kw):
    changes = []
    cfg = BreakerConfig(**{"min_calls": 4, "window_size": 10, "open_s": 5, **kw})
    return CircuitBreaker(cfg, clock, lambda a, b: changes.append((a, b))), changes


def test_error_rate_opens_only_after_min_calls(clock):
    b, changes = make(clock)
    for _ in range(3):
        assert b.acquire()
        b.record(False, 0.1)
    assert b.state is BreakerState.CLOSED  # 3 failures, but fewer than min_calls
    b.acquire()
    b.record(False, 0.1)
    assert b.state is BreakerState.OPEN and not b.acquire()
    assert changes == [(BreakerState.CLOSED, BreakerState.OPEN)]


def test_slow_calls_open_it_too(clock):
    b, _ = make(clock, slow_call_s=1.0, slow_call_rate=0.5)
    for d in (0.1, 2.0, 0.1, 3.0):
        b.acquire()
        b.record(True, d)
    assert b.state is BreakerState.OPEN


def test_half_open_lets_a_few_probes_and_closes_on_success(clock):
    b, changes = make(clock, half_open_calls=2)
    calls(b, [False] * 4)
    clock.advance(4.9)
    assert not b.allows()
    clock.advance(0.2)
    assert b.state is BreakerState.HALF_OPEN
    assert b.acquire() and b.acquire()
    assert not b.acquire()  # only two probes at a time
    b.record(True, 0.1)
    assert b.state is BreakerState.HALF_OPEN
    b.record(True, 0.1)
    assert b.state is BreakerState.CLOSED
    # The old failures were forgotten: one new failure does not reopen it.
    calls(b, [False])
    assert b.state is BreakerState.CLOSED
    assert [c[1] for c in changes] == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_a_failed_probe_reopens_and_waits_again(clock):
    b, _ = make(clock, half_open_calls=1)
    calls(b, [False] * 4)
    clock.advance(5)
    assert b.acquire()
    b.record(False, 0.1)
    assert b.state is BreakerState.OPEN and b.times_opened == 2
    clock.advance(5)
    assert b.state is BreakerState.HALF_OPEN


def test_an_abandoned_probe_gives_its_permit_back(clock):
    b, _ = make(clock, half_open_calls=1)
    calls(b, [False] * 4)
    clock.advance(5)
    assert b.acquire()
    assert not b.acquire()
    b.release()
    assert b.acquire()


def test_old_failures_age_out_of_the_window(clock):
    b, _ = make(clock, window_s=10)
    calls(b, [False] * 3)
    clock.advance(11)
    calls(b, [True] * 3 + [False])
    assert b.state is BreakerState.CLOSED  # 1 failure in 4 recent calls


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        BreakerConfig(failure_rate=0)
