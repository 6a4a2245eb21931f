"""The pace of starts of one kind of request, on a fake clock."""

from __future__ import annotations

import pytest

from poise.resilience.start_pace import StartPace


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_only_gaps_a_request_waited_through_are_a_pace_and_a_stall_counts_once_longer():
    clock = Clock()
    pace = StartPace(window=8, max_age_s=30, clock=clock)
    pace.queued(clock.now)
    clock.now += 0.5
    pace.started(still_waiting=False)  # the first start after idle time: latency, no interval
    clock.now += 3.0
    pace.started(still_waiting=True)  # nobody waited through those 3 s
    assert pace.mean_interval_s is None
    for _ in range(2):
        clock.now += 1.0
        pace.started(still_waiting=True)
    assert pace.mean_interval_s == pytest.approx(1.0)
    # A gap shorter than the pace says nothing new; one already longer counts as one more.
    clock.now += 0.5
    assert pace.interval_s(waiting=True) == pytest.approx(1.0)
    assert pace.stalled_s(waiting=True) == pytest.approx(0.5)
    clock.now += 4.5
    assert pace.interval_s(waiting=True) == pytest.approx((1.0 + 1.0 + 5.0) / 3)
    assert pace.stalled_s(waiting=False) == 0.0
    # Old intervals age out.
    clock.now += 31
    assert pace.mean_interval_s is None and pace.interval_s(waiting=True) is None
