"""The admission policy on a fake clock: bounds, predicted waits, deadlines, shedding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.resilience.admission import AdmissionConfig, AdmissionController, Need, Objective


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeForecast:
    """The server's forecast as admission reads it: a fixed wait, and the priorities of the
    running requests (a newcomer may take the place of those with a higher value); what it
    was asked is kept."""

    def __init__(self, wait: float = 0.0, running: list[int] | None = None) -> None:
        self.wait = wait
        self.running = running or []
        self.asked: list[tuple[int, int | None, int]] = []

    def wait_s(
        self, position: int, priority: int | None = None, blocks: int = 0, own: int = 0
    ) -> float:
        self.asked.append((position, priority, blocks))
        return self.wait

    def preemptible(self, priority: int | None) -> int:
        return 0 if priority is None else sum(1 for p in self.running if p > priority)

    typical_footprint = 0
    busy_step_s = 0.05
    kv_headroom_blocks = 1 << 30
    together = 1  # how many large requests the pool holds at once ...
    together_drained = 1  # ... and when no new typical requests take back what others free

    def fits_now(self, blocks: int) -> bool:
        return blocks <= self.kv_headroom_blocks

    def fit_together(self, blocks: int, retaken: bool = True) -> int:
        return self.together if retaken else self.together_drained


def blocks(*each: int) -> list[Need]:
    return [Need(b) for b in each]


def make(**config) -> tuple[AdmissionController, Clock]:
    clock = Clock()
    return AdmissionController(AdmissionConfig(**config), clock), clock


def test_bounds_on_count_and_tokens():
    ac, _ = make(max_waiting_requests=2, max_waiting_tokens=100)
    assert ac.admit(["a"], [10]).admitted
    assert ac.admit(["b"], [10]).admitted
    refused = ac.admit(["c"], [10])
    assert not refused.admitted and refused.reason == "queue_full"
    assert refused.retry_after_s >= 1
    ac.started("a")
    big = ac.admit(["d"], [95])
    assert not big.admitted and big.reason == "queue_tokens_full"
    assert ac.admit(["e"], [90]).admitted
    assert ac.saturated


def test_a_group_is_admitted_whole_or_not_at_all():
    ac, _ = make(max_waiting_requests=3)
    assert ac.admit(["a", "b"], [1, 1]).admitted
    assert not ac.admit(["c", "d"], [1, 1]).admitted
    assert set(ac.waiting) == {"a", "b"}


def test_start_rate_predicts_the_wait_and_idle_time_is_not_counted():
    ac, clock = make()
    ac.admit(["a", "b", "c"], [1, 1, 1])
    for key in "abc":
        clock.now += 0.5
        ac.started(key)
    clock.now += 20  # idle: must not make the service look slow
    ac.admit(["d", "e"], [1, 1])
    clock.now += 0.5
    ac.started("d")
    assert ac.mean_start_interval_s == pytest.approx(0.5)
    # e is waiting; a newcomer of the same priority has one ahead of it.
    assert ac.predicted_wait(0) == pytest.approx(0.5)


def test_deadline_that_cannot_be_met_is_refused_with_the_wait_as_retry_after():
    ac, clock = make()
    ac.admit([f"r{i}" for i in range(4)], [1] * 4)
    clock.now += 2.0
    ac.started("r0")  # the first start after idle time: latency, no rate yet
    assert ac.mean_start_interval_s is None
    clock.now += 2.0
    ac.started("r1")  # one start per 2 s, two still waiting: predicted wait 4 s
    d = ac.admit(["late"], [1], deadline=clock.now + 3.0)
    assert not d.admitted and d.reason == "deadline"
    assert d.retry_after_s == pytest.approx(4.0)
    assert ac.admit(["ok"], [1], deadline=clock.now + 10.0).admitted


def test_higher_priority_is_queued_ahead_and_sheds_lower_priority_work():
    ac, clock = make(max_waiting_requests=2)
    ac.admit(["low1"], [1], priority=5)
    clock.now += 1
    ac.admit(["low2"], [1], priority=5)
    assert ac.predicted_wait(0) == 0.0  # nobody of priority <= 0 is ahead
    d = ac.admit(["high"], [1], priority=0)
    assert d.admitted and d.shed == ("low2",)  # the newest of the lowest goes first
    equal = ac.admit(["also-low"], [1], priority=5)
    assert not equal.admitted and equal.shed == ()


def test_a_stalled_queue_stops_admitting_deadline_work():
    ac, clock = make()
    ac.admit(["a", "b"], [1, 1])
    clock.now += 0.1
    ac.started("a")  # fast so far
    clock.now += 30  # then nothing starts for 30 s
    assert ac.predicted_wait(0) >= 30
    assert not ac.admit(["c"], [1], deadline=clock.now + 5).admitted


def test_starts_that_come_in_batches_do_not_inflate_the_wait():
    # An engine starts the requests waiting for a step together: four every 150 ms.
    ac, clock = make(queue_target_s=0.5)
    n = 0
    for _ in range(10):
        keys = [f"r{n + i}" for i in range(4)]
        n += 4
        assert ac.admit(keys, [1] * 4).admitted
        clock.now += 0.15
        for key in keys:
            ac.started(key)
    ac.admit([f"r{n + i}" for i in range(4)], [1] * 4)
    clock.now += 0.14  # the next batch is due: four ahead, the last start 140 ms ago
    wait = ac.predicted_wait(0)
    assert 0.14 <= wait < 0.3  # one batch's time, not four times the pause
    assert ac.admit(["newcomer"], [1]).admitted


def test_disabled_admits_everything():
    ac, _ = make(enabled=False, max_waiting_requests=1)
    assert all(ac.admit([str(i)], [1]).admitted for i in range(5))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "start", "leave", "tick"]),
            st.integers(0, 30),
            st.integers(-2, 2),
            st.integers(1, 50),
        ),
        max_size=80,
    )
)
def test_bounds_and_token_accounting_always_hold(ops):
    ac, clock = make(max_waiting_requests=5, max_waiting_tokens=120)
    live: set[str] = set()
    for i, (op, pick, priority, tokens) in enumerate(ops):
        if op == "admit":
            d = ac.admit([f"k{i}"], [tokens], priority=priority)
            live -= set(d.shed)
            if d.admitted:
                live.add(f"k{i}")
            else:
                assert d.retry_after_s >= 1 and not d.shed
        elif op in ("start", "leave") and live:
            key = sorted(live)[pick % len(live)]
            (ac.started if op == "start" else ac.left)(key)
            live.discard(key)
        else:
            clock.now += pick / 10
        assert set(ac.waiting) == live
        assert ac.waiting_tokens == sum(t.prompt_tokens for t in ac.waiting.values())
        assert len(ac.waiting) <= 5 and ac.waiting_tokens <= 120
        assert ac.predicted_wait(0) >= 0


def test_the_servers_slot_forecast_overrides_an_optimistic_start_rate():
    """A queue that starts requests quickly on average can still be a whole wave away."""
    clock = Clock()
    forecast = FakeForecast()
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    ac.admit(["a", "b"], [1, 1], needs=blocks(3, 4))
    clock.now += 0.1
    ac.started("a")
    clock.now += 0.1
    ac.started("b")
    ac.admit(["c"], [1], needs=blocks(3))
    assert ac.predicted_wait(0) == pytest.approx(0.1)
    forecast.wait = 3.0
    assert ac.predicted_wait(0) == pytest.approx(3.0)
    # It is asked about the place in line, the priority and the blocks of all up to it.
    assert ac.predicted_wait(2, group_size=2, group_blocks=6) == pytest.approx(3.0)
    assert forecast.asked[-1] == (3, 2, 9)
    # One larger than its own that does not fit the pool now is no wait: the engine starts
    # smaller requests past it. One that fits is.
    forecast.kv_headroom_blocks = 10
    ac.admit(["huge"], [1], needs=blocks(40))
    ac.predicted_wait(2, group_size=2, group_blocks=6)
    assert forecast.asked[-1] == (3, 2, 9)
    forecast.kv_headroom_blocks = 50
    ac.predicted_wait(2, group_size=2, group_blocks=6)
    assert forecast.asked[-1] == (4, 2, 49)
    refused = ac.admit(["e"], [1], deadline=clock.now + 2.0)
    assert not refused.admitted and refused.reason == "deadline"
    assert refused.predicted_wait_s == pytest.approx(3.0)
    assert refused.retry_after_s == 3


def test_the_first_start_after_idle_time_is_latency_not_a_rate():
    """Requests that find the engine idle start 100 ms later: a step's latency, shared by all
    that arrive together. Read as a start interval, it made a burst of four "wait" 0.4 s and
    the next newcomer was refused although all five start in the next step."""
    ac, clock = make(queue_target_s=0.3)
    for i in range(5):
        assert ac.admit([f"single{i}"], [1]).admitted
        clock.now += 0.1
        ac.started(f"single{i}")
        clock.now += 1.0  # idle until the next one
    assert ac.mean_start_interval_s is None
    assert ac.admit([f"burst{i}" for i in range(4)], [1] * 4).admitted
    clock.now += 0.01
    assert ac.admit(["newcomer"], [1]).admitted


def test_a_resumed_stream_is_taken_past_the_wait_rules_but_not_past_a_full_queue():
    """Its client already has its first token: refusing it would end a stream, not spare a
    TTFT; the queue's hard bounds hold for it all the same."""
    clock = Clock()
    ac = AdmissionController(
        AdmissionConfig(queue_target_s=0.3, max_waiting_requests=2),
        clock,
        lambda: FakeForecast(wait=2.0),
    )
    assert ac.admit(["late"], [1], deadline=clock.now + 1).reason == "deadline"
    assert ac.admit(["resumed"], [1], deadline=clock.now + 1, continuation=True).admitted
    assert ac.admit(["resumed2"], [1], continuation=True).admitted
    full = ac.admit(["resumed3"], [1], continuation=True)
    assert not full.admitted and full.reason == "queue_full"


def test_a_slow_spell_long_past_does_not_refuse_todays_work():
    """Start intervals from a slow spell (a fault, another load) age out: refusals make no new
    samples, so without an age limit the old rate would refuse work for as long as it lasted."""
    ac, clock = make()
    ac.admit(["a", "b", "c"], [1, 1, 1])
    for key in "abc":
        clock.now += 2.0  # a start every 2 s
        ac.started(key)
    ac.admit(["d"], [1])
    # One ahead at 2 s each: a deadline 1.5 s away cannot be met.
    assert ac.admit(["e"], [1], deadline=clock.now + 1.5).reason == "deadline"
    ac.started("d")
    clock.now += 31  # the spell is over; nobody came for a while
    ac.admit(["f"], [1])
    assert ac.mean_start_interval_s is None
    # Judged by the slot forecast and stalls alone.
    assert ac.admit(["g"], [1], deadline=clock.now + 1.5).admitted


def test_requests_that_will_take_a_lower_prioritys_slot_do_not_wait_for_its_pace():
    """Batch work holds every slot and starts one request a second; an interactive request
    behind two others of its priority takes a batch slot, as they do: the batch's pace is no
    wait for it (it refused interactive requests under a batch flood)."""
    clock = Clock()
    forecast = FakeForecast(wait=0.05, running=[10] * 8)
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    ac.admit([f"batch{i}" for i in range(6)], [1] * 6, priority=10)
    for i in range(4):
        clock.now += 1.0
        ac.started(f"batch{i}")
    assert ac.mean_start_interval_s == pytest.approx(1.0)
    ac.admit(["i1", "i2"], [1, 1], priority=0)
    assert ac.predicted_wait(0) == pytest.approx(0.05)  # the forecast alone
    assert ac.predicted_wait(10) >= 4.0  # four ahead at a second each
    # One batch slot to take: the first in line takes it; the newcomer, third, is paced as
    # if second (one start interval), not third.
    forecast.running = [10] + [0] * 7
    assert ac.predicted_wait(0) == pytest.approx(1.0)


def flood(ac: AdmissionController, clock: Clock, priority: int = 0, n: int = 30) -> None:
    """Three arrive for every one that starts: one is served at once, two are refused (their
    deadline is already here): the queue stays empty, and fills all the same."""
    for i in range(n):
        clock.now += 0.15
        ac.admit([f"flood{priority}-{i}"], [1], priority=priority, needs=blocks(2))
        ac.started(f"flood{priority}-{i}")
        for j in range(2):
            ac.admit([f"late{priority}-{i}-{j}"], [1], priority=priority, deadline=clock.now)


def test_under_a_flood_the_largest_requests_are_refused_first_and_named_so():
    """Typical requests fill 2 blocks; one of 10 is refused while the queue fills whatever
    its wait, with its own message flag and no claim that the whole priority is shed; one of
    typical size with no wait is admitted."""
    clock = Clock()
    forecast = FakeForecast(wait=0.0)
    forecast.typical_footprint = 2
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac, clock)
    assert ac.trends.filling(0)
    big = ac.admit(["big"], [1], needs=blocks(10))
    assert not big.admitted and big.reason == "overloaded" and big.large
    assert not big.sheds_priority
    assert ac.admit(["small"], [1], needs=blocks(2)).admitted
    # An interactive request amid a batch flood is not shed for its size: it takes a batch
    # request's place instead.
    forecast.running = [10, 10]
    assert ac.admit(["vip"], [1], priority=0, needs=blocks(10)).admitted
    # With no target, nothing is refused for its size either.
    ac2 = AdmissionController(AdmissionConfig(), clock, lambda: forecast)
    forecast.running = []
    flood(ac2, clock)
    assert ac2.admit(["big2"], [1], needs=blocks(10)).admitted


def test_a_refusal_says_when_the_whole_priority_is_shed_and_then_the_queue_stays_filling():
    clock = Clock()
    forecast = FakeForecast(wait=2.0)  # every place is 2 s away: any newcomer would wait
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac, clock)
    refused = ac.admit(["late"], [1], needs=blocks(2))
    assert not refused.admitted and refused.sheds_priority and not refused.large
    # The gateway now holds such requests back: fewer arrive, yet the queue counts as filling.
    clock.now += 4.0
    for key in list(ac.waiting)[:10]:
        ac.started(key)
    assert ac.trends.filling(0) and ac.trends.state == "filling"
    clock.now += 5.1
    assert not ac.trends.filling(0)  # an interval later, the counts decide again
    # A full line sheds every newcomer of the priority, whatever its size.
    full = AdmissionController(AdmissionConfig(max_waiting_requests=1), clock)
    full.admit(["a"], [1])
    refused = full.admit(["b"], [1])
    assert refused.reason == "queue_full" and refused.sheds_priority


def test_a_batch_flood_fills_the_batch_queue_not_the_interactive_one():
    """Batch requests arrive three for every one that starts; interactive ones start as fast
    as they come. An interactive newcomer predicted to wait past the target is admitted (its
    own queue drains); a batch one is refused, and so is an interactive one once interactive
    arrivals outrun their starts too, which also fills the batch queue behind them."""
    clock = Clock()
    forecast = FakeForecast(wait=2.0)
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac, clock, priority=10)
    for i in range(8):
        clock.now += 0.3
        assert ac.admit([f"i{i}"], [1], priority=0, needs=blocks(2)).admitted
        ac.started(f"i{i}")
    assert ac.trends.filling(10) and not ac.trends.filling(0)
    assert not ac.admit(["b"], [1], priority=10, needs=blocks(2)).admitted
    assert ac.admit(["i"], [1], priority=0, needs=blocks(2)).admitted
    arrived, started = ac.trends.counts(0)
    assert (arrived, started) == (9, 8)
    ac2 = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac2, clock, priority=0)
    assert ac2.trends.filling(0) and ac2.trends.filling(10)
    assert not ac2.admit(["i"], [1], priority=0, needs=blocks(2)).admitted


def test_the_error_margin_learns_per_priority_from_typical_requests_and_stays_under_half():
    clock = Clock()
    forecast = FakeForecast(wait=0.0)
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.4), clock, lambda: forecast)
    for i in range(7):  # too few samples: no margin yet
        ac.admit([f"a{i}"], [1], priority=0)
        clock.now += 0.1
        ac.started(f"a{i}")
    assert ac.wait_error(0) == 0.0
    for i in range(20):  # each waited 0.1 s more than predicted (0)
        clock.now += 2.0  # apart, so that nothing else moves
        ac.admit([f"b{i}"], [1], priority=0)
        clock.now += 0.1
        ac.started(f"b{i}")
    assert ac.wait_error(0) == pytest.approx(0.1)
    assert ac.wait_error(10) == 0.0  # batch work's lateness is its own
    for i in range(40):  # long waits: the margin stops at half the target
        clock.now += 0.5
        ac.admit([f"c{i}"], [1], priority=0)
        clock.now += 0.3
        ac.started(f"c{i}")
    assert ac.wait_error(0) == pytest.approx(0.2)
    # A request larger than the typical one (it waits for room by design) teaches nothing.
    forecast.typical_footprint = 2
    before = list(ac._errors[0])
    ac.admit(["huge"], [1], needs=blocks(30))
    clock.now += 9.0
    ac.started("huge")
    assert list(ac._errors[0]) == before


def test_a_batch_burst_beside_interactive_traffic_gets_no_burst_allowance():
    """Sixty-four batch requests at once are all taken on an otherwise quiet server (a burst
    that drains); the same while interactive requests are coming is a flood's first half
    second: past the slack, those that would wait past the target are refused."""
    for interactive in (False, True):
        clock = Clock()
        forecast = FakeForecast(wait=2.0)
        ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda f=forecast: f)
        if interactive:
            for i in range(4):
                clock.now += 0.5
                ac.admit([f"i{i}"], [1], priority=0)
                ac.started(f"i{i}")
        admitted = 0
        for i in range(64):
            clock.now += 0.001
            admitted += ac.admit([f"b{i}"], [1], priority=10).admitted
        assert admitted == (2 if interactive else 64)  # the slack: two more than started


def test_a_request_refused_for_its_own_size_is_no_demand_on_the_queue():
    """While the queue fills, a request refused for its size (a smaller one would have been
    taken) leaves the trend's counts as they were; one refused whatever its size counts."""
    clock = Clock()
    forecast = FakeForecast(wait=0.0)
    forecast.typical_footprint = 2
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac, clock)
    before = ac.trends.counts(0)
    big = ac.admit(["big"], [1], needs=blocks(10))
    assert not big.admitted and big.large and ac.trends.counts(0) == before
    forecast.wait = 2.0  # now any newcomer would wait: the whole priority is refused
    late = ac.admit(["late"], [1], needs=blocks(2))
    assert not late.admitted and late.sheds_priority
    assert ac.trends.counts(0) == (before[0] + 1, before[1])


class ShortPool(FakeForecast):
    """A short KV pool: a request of more than 5 blocks waits 0.8 s for room, a smaller one
    0.6 s, one of none 0.3 s."""

    def wait_s(
        self, position: int, priority: int | None = None, blocks: int = 0, own: int = 0
    ) -> float:
        if self.wait == 0.0:
            return 0.0
        return 0.8 if own > 5 else (0.6 if own > 0 else 0.3)


def test_long_requests_waiting_for_room_do_not_fill_the_queue_short_ones_join():
    """Four long requests wait for room in a short KV pool (10 blocks each, 5 free): more have
    arrived than started. A short newcomer, predicted to wait past the target, starts past
    them (the engine starts smaller ones first), so the queue it joins is not filling and it
    is admitted; another long one joins theirs and is refused for its wait, which a smaller
    request would not have had (the priority is not shed)."""
    clock = Clock()
    forecast = ShortPool(wait=0.0)
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    for i in range(4):
        clock.now += 0.15  # apart: no burst
        assert ac.admit([f"long{i}"], [1], needs=blocks(10)).admitted
    forecast.wait, forecast.kv_headroom_blocks = 1.0, 5  # the pool is short now
    assert ac.trends.filling(0)  # four arrived, none started: past the slack of two
    assert ac.admit(["short"], [1], needs=blocks(2)).admitted
    refused = ac.admit(["long4"], [1], needs=blocks(10))
    assert not refused.admitted and refused.reason == "overloaded"
    assert not refused.sheds_priority


def test_short_requests_are_not_paced_by_long_ones_held_for_room():
    """A long request waits for room in a short pool while short ones arrive half a second
    apart and start at once. Their gaps are no pace: no short request waited through them
    (counted, they predicted half a second per short request ahead, and the short ones beside
    the long one were refused for it)."""
    clock = Clock()
    forecast = FakeForecast()
    forecast.typical_footprint, forecast.kv_headroom_blocks = 2, 5
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    assert ac.admit(["long"], [1], needs=[Need(10, 8.0)]).admitted
    for i in range(10):
        clock.now += 0.5
        assert ac.admit([f"s{i}"], [1], needs=blocks(2)).admitted
        clock.now += 0.05
        ac.started(f"s{i}")
    assert ac.mean_start_interval_s is None
    ac.admit(["s-waiting"], [1], needs=blocks(2))
    assert ac.predicted_wait(0, 1, 2) == pytest.approx(0.0)
    assert ac.paces()["large"]["waiting"] == 1
    assert ac.paces()["large"]["stalled_s"] == pytest.approx(5.5)


def test_a_long_request_behind_long_ones_held_for_room_is_refused_for_its_deadline():
    """Two long requests (10 blocks, 8 s of output each) wait for a pool that holds one at a
    time. A third, with 20 s to its deadline and 8 s of its own to run, would start after
    their 16 s: it is refused now, not cut at its deadline; a short request with the same
    deadline is taken, and the refusal counts as no demand on the short ones' queue."""
    clock = Clock()
    forecast = FakeForecast()
    forecast.typical_footprint, forecast.kv_headroom_blocks = 2, 5
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    for i in range(2):
        clock.now += 0.3
        assert ac.admit([f"long{i}"], [1], needs=[Need(10, 8.0, exact=True)]).admitted
    clock.now += 0.3
    arrived = ac.trends.counts(0)[0]
    late = ac.admit(["long2"], [1], deadline=clock.now + 20, needs=[Need(10, 8.0, exact=True)])
    assert not late.admitted and late.reason == "deadline"
    assert late.predicted_wait_s == pytest.approx(16.0)
    assert ac.trends.counts(0)[0] == arrived
    # Were the pool to hold two at once, it would start in 8 s and finish in time.
    forecast.together = forecast.together_drained = 2
    assert ac.admit(["long3"], [1], deadline=clock.now + 20, needs=[Need(10, 8.0, True)]).admitted
    assert ac.admit(["short"], [1], deadline=clock.now + 20, needs=[Need(2, 1.0)]).admitted


def test_a_request_that_runs_to_max_tokens_must_finish_by_its_deadline():
    """Its output's time is known: one needing 5 s is refused 4 s before its deadline, as one
    that may stop early is not."""
    ac, clock = make(queue_target_s=0.5)
    refused = ac.admit(["exact"], [1], deadline=clock.now + 4, needs=[Need(0, 5.0, exact=True)])
    assert not refused.admitted and refused.reason == "deadline"
    assert ac.admit(["may-stop"], [1], deadline=clock.now + 4, needs=[Need(0, 5.0)]).admitted


def short_pool(ac_wait: float = 0.0) -> tuple[AdmissionController, Clock, FakeForecast]:
    clock = Clock()
    forecast = FakeForecast(wait=ac_wait)
    forecast.typical_footprint, forecast.kv_headroom_blocks = 2, 5
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    return ac, clock, forecast


def test_the_large_kinds_pace_counts_a_gap_already_longer_than_its_mean():
    """Large requests started 2 s apart once; three now wait and none has started for 8 s. A
    large newcomer behind them waits at least 5 s per place (the open gap counted as one more
    interval), not the clump's 2 s, and at least the 8 s already gone."""
    ac, clock, _ = short_pool()
    for i in range(3):
        assert ac.admit([f"L{i}"], [1], needs=[Need(10)]).admitted
    clock.now += 1.0
    ac.started("L0")
    clock.now += 2.0
    ac.started("L1")  # L2 waited through those 2 s: one interval
    for i in (3, 4):
        assert ac.admit([f"L{i}"], [1], needs=[Need(10)]).admitted
    clock.now += 8.0
    assert ac.paces()["large"]["mean_interval_s"] == pytest.approx(2.0)
    assert ac.predicted_wait(0, 1, 10) == pytest.approx(3 * (2.0 + 8.0) / 2)


def test_a_large_newcomer_with_no_large_request_ahead_pays_no_large_pace():
    """Large starts were ten seconds apart, but none waits now: a large newcomer is predicted
    the forecast's wait for room (1 s), not an interval of its kind's pace."""
    ac, clock, _ = short_pool(ac_wait=1.0)
    for i in range(3):
        assert ac.admit([f"L{i}"], [1], needs=[Need(10)]).admitted
    for i in range(3):
        clock.now += 10.0
        ac.started(f"L{i}")
    assert ac.paces()["large"]["mean_interval_s"] == pytest.approx(10.0)
    assert ac.predicted_wait(0, 1, 10) == pytest.approx(1.0)


def test_what_the_short_requests_free_is_room_for_long_ones_only_once_no_more_come():
    """A long request (20 s of output) is held for room. While short requests keep arriving,
    the pool holds one long one at a time and a second long newcomer waits its 20 s; in a
    burst that drains (no short arrival for a trend interval) what the short ones free counts
    too, and two fit at once: 10 s (more than the 6 s the first has waited)."""
    ac, clock, forecast = short_pool()
    forecast.together_drained = 2
    assert ac.admit(["long0"], [1], needs=[Need(10, 20.0)]).admitted
    assert ac.admit(["short"], [1], needs=[Need(2)]).admitted
    ac.started("short")
    assert ac.predicted_wait(0, 1, 10) == pytest.approx(20.0)
    clock.now += 6.0
    assert ac.predicted_wait(0, 1, 10) == pytest.approx(10.0)


def test_a_started_request_that_ends_counts_as_served_once_and_a_queued_one_does_not():
    """The trend hears of a finish from ``left`` only for a request that had started and ran
    to its end: one that left the queue unstarted, or was cut short (an engine that stalls
    ends its running requests at their deadlines), made no room the queue takes."""
    ac, clock = make()
    for key in ("a", "b", "c", "d"):
        assert ac.admit([key], [1], priority=0, needs=blocks(2)).admitted
    ac.started("a")
    ac.started("d")
    clock.now += 4.0
    ac.left("a", answered=True)
    ac.left("b", answered=True)  # gave up while waiting: never started
    ac.left("a", answered=True)  # a second report of the same end counts for nothing
    ac.left("d")  # timed out while running
    clock.now += 2.0  # the starts are out of the 5 s window, the finish is not
    assert ac.trends.counts(0) == (0, 1)
    clock.now += 4.0
    assert ac.trends.counts(0) == (0, 0)


def test_a_finish_is_served_for_the_best_priority_waiting():
    """A batch answer's slot goes to the interactive request waiting: it is the interactive
    queue that was served, not the batch one."""
    ac, clock = make()
    assert ac.admit(["b"], [1], priority=10, needs=blocks(2)).admitted
    ac.started("b")
    clock.now += 6.0  # the start is out of the window
    assert ac.admit(["i"], [1], priority=0, needs=blocks(2)).admitted
    ac.left("b", answered=True)
    assert ac.trends.of(0).counts() == (1, 1)
    assert ac.trends.of(10).counts() == (0, 0)


def _with_forecast(wait: float, **config) -> tuple[AdmissionController, Clock, FakeForecast]:
    clock, forecast = Clock(), FakeForecast(wait)
    return AdmissionController(AdmissionConfig(**config), clock, lambda: forecast), clock, forecast


def test_a_request_predicted_to_miss_its_first_token_objective_is_refused_whatever_the_trend():
    # A queue that drains (no flood) takes a request without an objective whatever its wait;
    # one whose x-slo-ttft-ms the wait passes is refused at once, told when it would meet it.
    ac, clock, _ = _with_forecast(2.4, queue_target_s=0.5)
    refused = ac.admit(["hurried"], [1], objective=Objective(first_token_by=clock.now + 1.0))
    assert not refused.admitted and refused.reason == "slo_ttft"
    assert refused.retry_after_s == 2.0  # 2.4 s predicted, 1 s allowed
    assert ac.admit(["patient"], [1], objective=Objective(first_token_by=clock.now + 3.0)).admitted
    assert ac.admit(["plain"], [1]).admitted
    # Its arrival is no demand on the queue the others join (the objective was its own).
    assert ac.trends.counts(0) == (2, 0)
    assert "hurried" not in ac.waiting


def _first_tokens_late(ac: AdmissionController, clock: Clock, late_s: float) -> None:
    """Ten requests predicted to start at once, each starting ``late_s`` later, one by one."""
    for i in range(10):
        assert ac.admit([f"k{i}"], [1]).admitted
        clock.now += late_s
        ac.started(f"k{i}")


def test_the_first_token_objective_counts_how_late_first_tokens_have_come():
    # First tokens came 0.3 s after their predicted starts (their own prefill): an objective of
    # 0.2 s cannot be met by an idle server, one of 0.4 s can.
    ac, clock, _ = _with_forecast(0.0, queue_target_s=0.5)
    _first_tokens_late(ac, clock, 0.3)
    tight = ac.admit(["tight"], [1], objective=Objective(first_token_by=clock.now + 0.2))
    assert tight.reason == "slo_ttft" and tight.predicted_wait_s == pytest.approx(0.3)
    assert ac.admit(["loose"], [1], objective=Objective(first_token_by=clock.now + 0.4)).admitted


def test_a_time_per_token_objective_slower_steps_cannot_meet_is_refused():
    ac, _, forecast = _with_forecast(0.0)
    forecast.busy_step_s = 0.08
    refused = ac.admit(["fast"], [1], objective=Objective(per_token_s=0.05))
    assert refused.reason == "slo_tpot" and refused.retry_after_s == 1.0
    assert ac.admit(["ok"], [1], objective=Objective(per_token_s=0.1)).admitted


def test_a_continuation_is_not_judged_by_its_objective():
    # Its client already has its first token: ending its stream would break what was taken on.
    ac, clock, _ = _with_forecast(5.0)
    hurried = Objective(first_token_by=clock.now + 0.1, per_token_s=0.001)
    assert ac.admit(["resumed"], [1], continuation=True, objective=hurried).admitted


def test_a_patient_first_token_objective_is_held_to_it_not_to_the_target():
    # Under a flood every newcomer would wait 2 s: past the server's 0.5 s target, so one that
    # says nothing is refused; one that accepts 5 s (ten times the target) is served; one that
    # accepts 1 s is held to the target too.
    clock = Clock()
    forecast = FakeForecast(wait=2.0)
    ac = AdmissionController(AdmissionConfig(queue_target_s=0.5), clock, lambda: forecast)
    flood(ac, clock)
    assert ac.trends.filling(0)
    assert ac.admit(["plain"], [1], needs=blocks(2)).reason == "overloaded"
    patient = Objective(first_token_by=clock.now + 5.0)
    assert ac.admit(["patient"], [1], needs=blocks(2), objective=patient).admitted
    hurried = ac.admit(["hurried"], [1], objective=Objective(first_token_by=clock.now + 1.0))
    assert hurried.reason == "overloaded"
    # Patient, but not that patient: it is refused for its own objective.
    forecast.wait = 6.0
    refused = ac.admit(["short"], [1], needs=blocks(2), objective=patient)
    assert refused.reason == "slo_ttft" and refused.retry_after_s == 1.0
    # A time-per-token objective alone says nothing of the wait: the target still holds.
    per_token = Objective(per_token_s=1.0)
    assert ac.admit(["steady"], [1], needs=blocks(2), objective=per_token).reason == "overloaded"


def test_what_a_slow_spell_taught_stops_refusing_objectives_once_it_is_old():
    # First tokens came 2 s late for a while: a 1 s objective cannot be met, and while such
    # requests are refused nothing new is learnt. Half a minute on, the spell no longer counts.
    ac, clock, _ = _with_forecast(0.0, queue_target_s=0.5)
    _first_tokens_late(ac, clock, 2.0)
    refused = ac.admit(["a"], [1], objective=Objective(first_token_by=clock.now + 1))
    assert refused.reason == "slo_ttft"
    clock.now += 31.0
    assert ac.admit(["b"], [1], objective=Objective(first_token_by=clock.now + 1)).admitted


def test_an_idle_servers_old_step_time_refuses_no_time_per_token_objective():
    from poise.engine.forecast import SlotForecast

    # Idle, the mean of a load gone does not count; the shortest recent step does.
    idle = SlotForecast(4, (), step_s=0.3, cycle_steps=0, fastest_step_s=0.05)
    slow = SlotForecast(4, (), step_s=0.3, cycle_steps=0, fastest_step_s=0.2)
    busy = SlotForecast(3, (5,), step_s=0.3, cycle_steps=5, fastest_step_s=0.05)
    assert idle.busy_step_s == 0.05 and busy.busy_step_s == 0.3
    for forecast, admitted in ((idle, True), (slow, False), (busy, False)):
        ac = AdmissionController(AdmissionConfig(), Clock(), lambda f=forecast: f)
        assert ac.admit(["k"], [1], objective=Objective(per_token_s=0.1)).admitted is admitted
