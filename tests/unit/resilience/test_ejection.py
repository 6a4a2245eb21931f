"""Outlier ejection on a fake clock: growing times, the share cap, never the last one."""

import random

from poise.resilience.ejection import EjectionConfig, OutlierDetector


def make(clock, n=4, **kw):
    cfg = EjectionConfig(
        **{"consecutive_failures": 3, "base_s": 10, "max_s": 25, "jitter_s": 0, **kw}
    )
    return OutlierDetector([f"b{i}" for i in range(n)], cfg, clock, random.Random(0))


def fail(d, backend, times):
    return [d.record(backend, False) for _ in range(times)]


def test_consecutive_failures_eject_for_growing_times(clock):
    d = make(clock)
    assert fail(d, "b0", 3) == [False, False, True]
    assert d.is_ejected("b0")
    clock.advance(10)
    assert not d.is_ejected("b0")
    fail(d, "b0", 3)
    clock.advance(19)
    assert d.is_ejected("b0")  # second time: 20 s
    clock.advance(1)
    assert not d.is_ejected("b0")
    fail(d, "b0", 3)
    clock.advance(24.9)
    assert d.is_ejected("b0")  # third time: 30 s, capped at 25
    clock.advance(0.2)
    assert not d.is_ejected("b0")


def test_a_success_resets_the_run(clock):
    d = make(clock)
    fail(d, "b0", 2)
    d.record("b0", True)
    assert fail(d, "b0", 2) == [False, False]


def test_never_more_than_the_share_and_never_the_last(clock):
    d = make(clock, n=4, max_ejected_share=0.5)
    fail(d, "b0", 3)
    fail(d, "b1", 3)
    fail(d, "b2", 3)
    assert d.ejected == ["b0", "b1"]
    d2 = make(clock, n=2, max_ejected_share=1.0)
    fail(d2, "b0", 3)
    fail(d2, "b1", 3)
    assert d2.ejected == ["b0"]


def test_a_healthy_period_earns_an_ejection_back(clock):
    d = make(clock)
    fail(d, "b0", 3)
    clock.advance(10)
    assert not d.is_ejected("b0")
    clock.advance(10)
    d.record("b0", True)  # healthy for base_s: the next ejection is short again
    fail(d, "b0", 3)
    clock.advance(10)
    assert not d.is_ejected("b0")
