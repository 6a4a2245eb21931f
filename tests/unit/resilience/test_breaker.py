"""The breaker's state machine on a fake clock (SPEC formula 4)."""

import pytest

from poise.resilience.breaker import BreakerConfig, BreakerState, CallTiming, CircuitBreaker


def quick(duration_s=0.1, **kw):
    return CallTiming(duration_s, **kw)


def calls(b, outcomes, duration_s=0.1):
    for ok in outcomes:
        permit = b.acquire()
        assert permit
        b.record(permit, ok, quick(duration_s))


def make(clock, **kw):
    changes = []
    cfg = BreakerConfig(**{"min_calls": 4, "window_size": 10, "open_s": 5, **kw})
    return CircuitBreaker(cfg, clock, lambda a, b: changes.append((a, b))), changes


def test_error_rate_opens_only_after_min_calls(clock):
    b, changes = make(clock)
    calls(b, [False] * 3)
    assert b.state is BreakerState.CLOSED  # 3 failures, but fewer than min_calls
    calls(b, [False])
    assert b.state is BreakerState.OPEN and not b.acquire()
    assert changes == [(BreakerState.CLOSED, BreakerState.OPEN)]


def test_slow_calls_open_it_too(clock):
    b, _ = make(clock, slow_call_s=1.0, slow_call_rate=0.5)
    for d in (0.1, 2.0, 0.1, 3.0):
        b.record(b.acquire(), True, quick(d, longest_silence_s=d))
    assert b.state is BreakerState.OPEN


def test_a_long_answer_is_not_a_slow_call(clock):
    """Slowness is the backend's silence and its time per token, never the answer's length."""
    b, _ = make(clock, slow_call_s=10.0, slow_token_s=0.5, slow_call_rate=0.5)
    for _ in range(8):  # 2,000 tokens at 50 ms each: 100 s, never more than 1 s silent
        b.record(b.acquire(), True, CallTiming(100.0, longest_silence_s=1.0, output_tokens=2000))
    assert b.state is BreakerState.CLOSED
    # Silent for as long as slow_call_s before the first byte: slow however short the answer.
    for _ in range(4):
        b.record(b.acquire(), True, CallTiming(10.5, longest_silence_s=10.5, output_tokens=1))
    assert b.state is BreakerState.CLOSED  # 4 slow of the last 10
    # 20 tokens in 25 s (1.25 s each, never 10 s silent): slow by its time per token.
    b.record(b.acquire(), True, CallTiming(25.0, longest_silence_s=2.0, output_tokens=20))
    assert b.state is BreakerState.OPEN  # 5 slow of the last 10 >= 0.5


def test_half_open_lets_a_few_probes_and_closes_on_success(clock):
    b, changes = make(clock, half_open_calls=2)
    calls(b, [False] * 4)
    clock.advance(4.9)
    assert not b.allows()
    clock.advance(0.2)
    assert b.state is BreakerState.HALF_OPEN
    p1, p2 = b.acquire(), b.acquire()
    assert p1 and p2
    assert not b.acquire()  # only two probes at a time
    b.record(p1, True, quick())
    assert b.state is BreakerState.HALF_OPEN
    b.record(p2, True, quick())
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
    b.record(b.acquire(), False, quick())
    assert b.state is BreakerState.OPEN and b.times_opened == 2
    clock.advance(5)
    assert b.state is BreakerState.HALF_OPEN


def test_an_abandoned_probe_gives_its_permit_back(clock):
    b, _ = make(clock, half_open_calls=1)
    calls(b, [False] * 4)
    clock.advance(5)
    probe = b.acquire()
    assert probe
    assert not b.acquire()
    b.release(probe)
    assert b.acquire()


def test_calls_from_before_the_opening_are_not_probe_results(clock):
    """Calls let through while closed that end while half-open neither count as probes nor
    free the real probes' permits."""
    b, _ = make(clock, half_open_calls=1, min_calls=4)
    old = [b.acquire() for _ in range(3)]  # slow calls, still running
    calls(b, [False] * 4)  # opens
    clock.advance(5)
    assert b.state is BreakerState.HALF_OPEN
    probe = b.acquire()
    assert probe and not b.acquire()
    b.record(old[0], True, quick())  # a success from before: not the probe's result
    b.release(old[1])  # nor does an old abandoned call give a probe permit back
    assert b.state is BreakerState.HALF_OPEN and not b.acquire()
    b.record(old[2], False, quick())
    assert b.state is BreakerState.HALF_OPEN  # an old failure does not reopen it either
    b.record(probe, True, quick())
    assert b.state is BreakerState.CLOSED


def test_old_failures_age_out_of_the_window(clock):
    b, _ = make(clock, window_s=10)
    calls(b, [False] * 3)
    clock.advance(11)
    calls(b, [True] * 3 + [False])
    assert b.state is BreakerState.CLOSED  # 1 failure in 4 recent calls


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        BreakerConfig(failure_rate=0)
