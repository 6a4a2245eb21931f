"""A long queue's trend on a fake clock: a burst drains and is served, a flood fills and is shed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from poise.resilience.admission import AdmissionConfig, AdmissionController
from poise.resilience.queue_trend import PriorityTrends, QueueTrend, TrendConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refused(trend: QueueTrend, long: bool) -> bool:
    """What admission does with a newcomer: refuse only a long wait in a filling queue."""
    return long and not trend.in_burst and trend.filling


def test_a_burst_sent_at_once_is_a_burst_and_drains():
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    out = []
    for i in range(64):  # a millisecond apart; the fourth already finds the queue long
        clock.now += 0.001
        trend.arrival(1, long=i >= 3)
        out.append(refused(trend, i >= 3))
    assert not any(out) and trend.state == "burst"
    # Served at 3 a second, with a newcomer now and then: it waits, and is not refused.
    for k in range(30):
        clock.now += 0.33
        trend.start()
        if k % 4 == 0:
            trend.arrival(1, long=True)
            assert not refused(trend, True)
            assert trend.state == "draining"


def test_the_next_burst_after_the_last_one_drained_is_a_burst_too():
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for _burst in range(3):
        for i in range(64):
            clock.now += 0.001
            trend.arrival(1, long=i >= 3)
            assert not refused(trend, i >= 3)
        for _ in range(64):
            clock.now += 0.3
            trend.start()


def test_a_flood_fills_and_its_newcomers_past_the_target_are_refused():
    """Twice as many arrive as start (every 83 ms, against a start every 167 ms); a newcomer
    finds the queue long with two waiting."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    events = [(k / 12.0, "arrival") for k in range(1, 240)]
    events += [(k / 6.0 + 0.01, "start") for k in range(1, 120)]
    waiting, refusals, long_admitted = 0, 0, 0
    for t, kind in sorted(events):
        clock.now = 100.0 + t
        if kind == "start":
            if waiting:
                waiting -= 1
                trend.start()
            continue
        long = waiting >= 2
        trend.arrival(1, long, service_rate=6.0)
        if refused(trend, long):
            refusals += 1
        else:
            waiting += 1
            long_admitted += long
    assert refusals > 100
    # The queue is held near the target: few got in past it (the slack), and none for long.
    assert long_admitted <= 4
    assert waiting <= 4


def test_a_dense_run_is_a_burst_and_a_sparse_one_is_not():
    """At 6 starts a second, eight requests within 40 ms are a burst; eight 100 ms apart (the
    pace of a flood at 10 a second) are not, and get the benefit of the doubt for one only."""
    for gap, burst in ((0.005, True), (0.099, False)):
        clock = Clock()
        trend = QueueTrend(TrendConfig(), clock)
        free = 0
        for _ in range(12):
            clock.now += gap
            trend.arrival(1, long=True, service_rate=6.0)
            free += trend.in_burst
        assert (trend.state == "burst") is burst
        assert free == (12 if burst else 1)


def test_a_flood_that_turns_the_queue_long_again_gets_no_new_burst():
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for _ in range(20):  # 3 arrive per start for 2.3 s, 8.7 starts a second: filling
        clock.now += 0.101
        trend.arrival(1, long=False, service_rate=8.7)
        trend.arrival(1, long=False, service_rate=8.7)
        clock.now += 0.014
        trend.arrival(1, long=False, service_rate=8.7)
        trend.start()
    trend.arrival(1, long=True, service_rate=8.7)  # it turns long: no burst, and it is filling
    assert trend.state == "filling" and refused(trend, True)
    for _ in range(30):  # requests coming together now do not make it a burst either
        clock.now += 0.001
        trend.arrival(1, long=True, service_rate=8.7)
        assert refused(trend, True)


def test_a_closed_loop_of_clients_is_not_a_flood():
    """64 clients, each sending again when answered: as many arrive as start."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for i in range(64):
        clock.now += 0.001
        trend.arrival(1, long=i >= 3)
    rng = random.Random(3)
    for _ in range(300):
        clock.now += rng.uniform(0.05, 0.3)
        trend.start()  # one starts when one ends, whose client sends again at once
        clock.now += 0.002
        trend.arrival(1, long=True)
        assert not refused(trend, True)


def test_a_burst_is_bounded_in_time():
    clock = Clock()
    trend = QueueTrend(TrendConfig(burst_gap_s=0.02, burst_max_s=1.0), clock)
    trend.arrival(1, long=True)
    while clock.now < 101.5:
        clock.now += 0.01
        trend.arrival(1, long=True)
    assert not trend.in_burst  # past a second of arrivals it is a flood, however tight


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 0.5), st.sampled_from(["arrival", "start", "finish"]), st.booleans()
        ),
        max_size=200,
    )
)
def test_what_is_counted_happened_and_a_burst_is_never_held_against_the_queue(ops):
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    arrivals = starts = finishes = 0
    for dt, what, long in ops:
        clock.now += dt
        if what == "start":
            trend.start()
            starts += 1
        elif what == "finish":
            trend.finish()
            finishes += 1
        else:
            trend.arrival(1, long)
            arrivals += 1
            if trend.bursting:
                assert trend.in_burst and trend.state == "burst"
        counted_arrivals, served = trend.counts()
        assert counted_arrivals <= arrivals and served <= max(starts, finishes)


def test_admission_serves_a_burst_whose_wait_is_long_and_sheds_a_flood():
    """Through the admission controller: a burst 20 s deep is admitted whole (the deadline is
    600 s away); under a flood, a newcomer predicted past the target is refused with
    Retry-After while one of a better priority, with nobody ahead, is not."""
    clock = Clock()
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock)
    for i in range(64):
        clock.now += 0.001
        assert ac.admit([f"b{i}"], [100], priority=5, deadline=clock.now + 600).admitted
    for i in range(20):  # one start every 0.3 s teaches the rate
        clock.now += 0.3
        ac.started(f"b{i}")
    assert ac.predicted_wait(5) > 10
    # A newcomer behind the draining burst waits, and is served.
    assert ac.admit(["patient"], [100], priority=5, deadline=clock.now + 600).admitted
    # Now more keep arriving than start: a flood.
    decisions = []
    for i in range(40):
        clock.now += 0.05
        decisions.append(ac.admit([f"f{i}"], [100], priority=5, deadline=clock.now + 600))
        if i % 6 == 5:
            ac.started(f"b{20 + i // 6}")
    late = [d for d in decisions if not d.admitted]
    assert late and all(d.reason == "overloaded" and d.retry_after_s >= 1 for d in late)
    assert ac.admit(["vip"], [100], priority=0, deadline=clock.now + 600).admitted


def test_a_trend_per_priority_any_priority_value_and_quiet_ones_are_forgotten():
    clock = Clock()
    trends = PriorityTrends(TrendConfig(), clock)
    for p in range(40):  # a client may send any priority value, each a burst of eight
        for _ in range(8):
            clock.now += 0.001
            trends.of(p).arrival(1, long=False)
    assert len(trends) == 40  # all were active within the interval: none is dropped
    clock.now += 6.0
    trends.of(1000).arrival(1, long=False)
    assert len(trends) == 1 and trends.counts() == (1, 0)  # bursts long over are quiet too
    for p in range(2000):  # all active at once: a hard bound holds all the same
        trends.of(-p).arrival(1, long=False)
    assert len(trends) <= 256
    for _ in range(5):  # the worse priority's arrivals outrun its starts
        trends.of(10).arrival(1, long=True)
    assert trends.filling(10) and not trends.filling(0) and trends.state == "filling"


def test_a_shed_holds_the_queue_filling_for_a_moment_not_an_interval():
    """After a whole priority is refused, the queue counts as filling for ``shed_s`` whatever
    the counts say (a gateway holds the priority back meanwhile); then the counts decide again,
    so one marginal refusal does not renew itself for an interval."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for _ in range(6):  # as many start as arrive
        clock.now += 0.5
        trend.arrival(1, long=True)
        trend.start()
    assert not trend.filling
    trend.shed()
    assert trend.filling
    clock.now += 1.1
    assert not trend.filling


def slow_host_overload(config: TrendConfig, seed: int, rate: float = 2.0) -> tuple[int, int]:
    """Poisson arrivals at ``rate`` a second (2: about 1.5x capacity) on a server that starts one
    request every 0.75 s while one waits (a slow host), for a minute, each newcomer refused as
    admission does (long: someone waits ahead, 0.75 s past a 0.5 s target). Returns (refused,
    admitted to wait past a second)."""
    clock, rng = Clock(), random.Random(seed)
    trend = QueueTrend(config, clock)
    arrivals, t = [], 0.0
    while t < 60.0:
        t += rng.expovariate(rate)
        arrivals.append(t)
    waiting, next_start, refusals, late = 0, 0.0, 0, 0
    for at in arrivals:
        while next_start <= at:
            if waiting:
                clock.now = 100.0 + next_start
                waiting -= 1
                trend.start()
            next_start += 0.75
        clock.now = 100.0 + at
        long = waiting >= 1
        trend.arrival(1, long, service_rate=1 / 0.75)
        if refused(trend, long):
            refusals += 1
            continue
        late += waiting * 0.75 + (next_start - at) > 1.0
        waiting += 1
    return refusals, late


# Only the 5 s window, with a slack of two requests whatever the pace.
SHORT_ONLY = TrendConfig(long_interval_s=5.0, slack_s=1e9)


def test_a_slow_hosts_small_excess_fills_the_queue():
    """At about 1.5x a slow host's capacity a 5 s window holds about three arrivals more than
    starts, short of a slack of two requests plus the margin one time in three: each arrival
    then was admitted to wait past a second. Over 20 s the excess shows."""
    for seed in range(5):
        refused_new, late_new = slow_host_overload(TrendConfig(), seed)
        refused_old, late_old = slow_host_overload(SHORT_ONLY, seed)
        assert late_new <= 6 and late_old >= 2 * late_new + 10
        # What it refuses more is about what it no longer admits late.
        assert refused_new <= refused_old + 16


def test_a_flood_over_leaves_no_hangover_for_a_burst():
    """The long window speaks only while the short one still holds more arrivals than
    starts: a batch job's burst six seconds after a flood ended is a burst, and served."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for k in range(150):  # a flood at 30 a second, 10 starting, for 5 s
        clock.now += 1 / 30
        trend.arrival(1, long=True, service_rate=10.0)
        if k % 3 == 0:
            trend.start()
    assert refused(trend, True)
    clock.now += 6.0
    out = []
    for i in range(64):
        clock.now += 0.001
        trend.arrival(1, long=i >= 3, service_rate=10.0)
        out.append(refused(trend, i >= 3))
    assert not any(out) and trend.state == "burst"


def test_a_closed_loop_on_a_slow_host_is_not_a_flood():
    """64 clients, each sending again when answered, on a host that starts a request every
    0.6-0.95 s: as many arrive as start, over either window, however long the queue."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for i in range(64):
        clock.now += 0.001
        trend.arrival(1, long=i >= 1, service_rate=1.3)
    rng = random.Random(5)
    for _ in range(120):  # 90 s: the 20 s window fills and turns over
        clock.now += rng.uniform(0.6, 0.95)
        trend.start()
        clock.now += rng.uniform(0.0, 0.01)
        trend.arrival(1, long=True, service_rate=1.3)
        assert not refused(trend, True)


class ForwardClock(Clock):
    """A clock that is only ever set forward."""

    def set(self, at: float) -> None:
        assert at >= self.now, (at, self.now)
        self.now = at


def closed_loop_in_waves(told_of_finishes: bool, seed: int) -> int:
    """24 clients on a replica that runs them all at once (its batch has room) but starts a
    newcomer only every 0.1-0.2 s (its prefills): the first wave a burst sent at once, each
    answer about 10 s after its start, each client sending again 1 ms after it is answered.
    How many of the arrivals after the first wave it would refuse (a wait past 0.5 s at the
    prefills' pace)."""
    clock = ForwardClock()
    trend = QueueTrend(TrendConfig(), clock)
    rng = random.Random(seed)
    pace = 1 / 0.15
    for i in range(24):
        clock.set(clock.now + 0.001)
        trend.arrival(1, long=i >= 2, service_rate=None if i == 0 else pace)
    events: list[tuple[float, str]] = []
    arrivals = [clock.now] * 24
    last_start = clock.now
    for _ in range(6):
        starts = []
        for at in sorted(arrivals):
            last_start = max(last_start, at) + rng.uniform(0.1, 0.2)
            starts.append(last_start)
        events += [(t, "start") for t in starts]
        arrivals = [t + rng.uniform(9.5, 10.5) for t in starts]
        events += [(t, "end") for t in arrivals]
        arrivals = [t + 0.001 for t in arrivals]
        events += [(t, "arrival") for t in arrivals]
    refusals = sent = started = 0
    for at, what in sorted(events):
        clock.set(at)
        if what == "start":
            trend.start()
            started += 1
        elif what == "end":
            if told_of_finishes:
                trend.finish()
        else:
            sent += 1
            long = (24 + sent - started) * 0.15 > 0.5  # the wait behind those not started
            trend.arrival(1, long=long, service_rate=pace)
            refusals += refused(trend, long)
    return refusals


def test_a_closed_loop_whose_answers_end_in_waves_is_not_a_flood():
    """As a wave of answers ends, its clients send the next wave, faster than the prefills
    start it: counted against starts alone that looks like a flood; the batch that shrank as
    fast is the room the wave takes."""
    for seed in range(5):
        assert closed_loop_in_waves(True, seed) == 0
        assert closed_loop_in_waves(False, seed) > 0  # what starts alone would refuse


def test_finishes_do_not_hide_a_flood():
    """A full batch under a flood: each start follows a finish, and three times as many
    arrive; the queue fills as it did when starts alone were counted. Served is the larger of
    starts and finishes, not their sum."""
    clock = Clock()
    trend = QueueTrend(TrendConfig(), clock)
    for k in range(300):
        clock.now += 1 / 30
        trend.arrival(1, long=True, service_rate=10.0)
        if k % 3 == 0:
            trend.finish()
            trend.start()
        if k > 60:
            assert refused(trend, True)
    arrived, served = trend.counts()
    assert 149 <= arrived <= 151 and abs(served - arrived / 3) <= 1


def test_a_better_prioritys_answers_ending_leave_a_batch_burst_a_burst():
    """Interactive answers still ending (no interactive arrivals or starts any more) do not
    make a batch job's burst the remainder of a better priority's traffic."""
    clock = Clock()
    trends = PriorityTrends(TrendConfig(), clock)
    for _ in range(4):
        trends.of(0).finish()
        clock.now += 0.5
    out = []
    for i in range(32):
        clock.now += 0.001
        trends.of(10).arrival(1, long=i >= 2, service_rate=5.0, outranked=trends.outranked(10))
        out.append(not trends.of(10).in_burst and trends.filling(10))
    assert not trends.outranked(10) and trends.of(10).bursting and not any(out)
