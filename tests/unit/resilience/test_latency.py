"""Latency estimates, routing cost and slow-outlier ejection, on a fake clock."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.resilience.latency import LatencyConfig, LatencyTracker, PeakEwma, TimeEwma
from poise.resilience.slow_ejection import SlowChanges, SlowEjectionConfig, SlowOutlierDetector


class Clock:
    """The fixture's clock, for property tests (hypothesis wants no function fixtures)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(clock, urls=("b0", "b1"), latency=None, **kw):
    tracker = LatencyTracker(LatencyConfig(**(latency or {})), clock)
    detector = SlowOutlierDetector(tracker, SlowEjectionConfig(**kw), urls)
    return tracker, detector, Traffic(clock, tracker)


class Traffic:
    """Streams on each backend, as the relay observes them: ``run({url: gap}, seconds)``
    makes a token come every ``gap`` seconds on each backend named, for ``seconds``."""

    def __init__(self, clock, tracker) -> None:
        self.clock, self.tracker = clock, tracker
        self.last: dict[str, float] = {}

    def run(self, rates, seconds, step=0.01):
        end = self.clock() + seconds
        for url in rates:
            self.last.setdefault(url, self.clock())
        while self.clock() < end - 1e-9:
            self.clock.advance(step)
            for url, gap in rates.items():
                if self.clock() >= self.last[url] + gap - 1e-9:
                    self.tracker.observe_tpot(url, self.clock() - self.last[url])
                    self.last[url] = self.clock()


# -- the estimates ----------------------------------------------------------------------------


def test_peak_ewma_jumps_up_and_decays_by_time(clock):
    e = PeakEwma(10.0, clock)
    assert e.value is None and e.estimate() is None
    e.observe(0.1)
    assert e.value == 0.1
    clock.advance(1)
    e.observe(0.5)
    assert e.value == 0.5  # a peak is believed at once
    clock.advance(10)
    e.observe(0.1)
    w = math.exp(-1)
    assert e.value == pytest.approx(0.5 * w + 0.1 * (1 - w))
    clock.advance(0)
    e.observe(0.1)  # the same instant: no weight at all
    assert e.value == pytest.approx(0.5 * w + 0.1 * (1 - w))
    assert e.count == 4


def test_time_ewma_is_symmetric(clock):
    e = TimeEwma(1.0, clock)
    e.observe(0.01)
    clock.advance(0.3)
    e.observe(0.3)
    assert e.value == pytest.approx(0.01 + 0.29 * (1 - math.exp(-0.3)))


def test_outstanding_work_raises_the_estimate(clock):
    e = PeakEwma(10.0, clock)
    assert e.estimate(pending_s=2.0) == 2.0  # nothing observed, but a wait of 2 s: at least 2
    e.observe(0.5)
    assert e.estimate(pending_s=0.2) == 0.5
    assert e.estimate(pending_s=3.0) == 3.0


def test_bad_values(clock):
    e = PeakEwma(1.0, clock)
    with pytest.raises(ValueError):
        e.observe(math.nan)
    e.observe(-1.0)  # a clock stepping back: no negative latency
    assert e.value == 0.0
    e.reset()
    assert e.value is None and e.count == 0
    with pytest.raises(ValueError):
        PeakEwma(0.0, clock)


observations = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=10.0),  # seconds since the previous one
        st.floats(min_value=0.0, max_value=5.0),  # the value
    ),
    min_size=1,
    max_size=60,
)


@given(observations)
def test_peak_is_at_least_the_last_observation_and_within_the_range(obs):
    clock = Clock()
    e = PeakEwma(5.0, clock)
    for dt, x in obs:
        clock.advance(dt)
        e.observe(x)
        assert e.value is not None
        assert e.value >= x
        assert e.value <= max(v for _, v in obs) + 1e-12


@given(observations)
def test_symmetric_stays_within_the_range_of_its_observations(obs):
    clock = Clock()
    e = TimeEwma(1.0, clock)
    seen: list[float] = []
    for dt, x in obs:
        clock.advance(dt)
        e.observe(x)
        seen.append(x)
        assert e.value is not None
        assert min(seen) - 1e-12 <= e.value <= max(seen) + 1e-12


@given(
    st.floats(min_value=0.0, max_value=5.0),
    st.floats(min_value=0.0, max_value=5.0),
    st.lists(st.floats(min_value=0.001, max_value=5.0), min_size=1, max_size=40),
)
def test_decays_toward_repeated_observations(start, target, gaps):
    clock = Clock()
    for cls in (PeakEwma, TimeEwma):
        e = cls(2.0, clock)
        e.observe(start)
        previous = abs(start - target) if cls is TimeEwma or target <= start else 0.0
        for dt in gaps:
            clock.advance(dt)
            e.observe(target)
            assert e.value is not None
            distance = abs(e.value - target)
            assert distance <= previous + 1e-12  # never further from it
            previous = distance
        # After t seconds of it, what is left of the distance is at most exp(-t/tau).
        assert previous <= abs(start - target) * math.exp(-sum(gaps) / 2.0) + 1e-9


# -- the tracker and the cost -----------------------------------------------------------------


def test_cost_is_neutral_without_data_and_for_unknown_backends(clock):
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    assert t.cost("b0") == 1.0 and t.cost("nope") == 1.0
    t.observe_tpot("b0", 0.01)
    t.observe_tpot("b1", 0.01)
    assert t.cost("b0") == t.cost("b1") == 1.0


def test_a_slow_backend_costs_its_ratio_to_the_median(clock):
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1", "b2"])
    for url, s in (("b0", 0.26), ("b1", 0.05), ("b2", 0.05)):
        t.observe_tpot(url, s)
    assert t.cost("b0") == pytest.approx(0.26 / 0.05)
    assert t.cost("b1") == 1.0
    # Linkerd's score: the slow one idle costs as much as the fast one with 4 in flight.
    assert t.cost("b0") * (0 + 1) > t.cost("b1") * (4 + 1)


def test_floors_keep_small_differences_from_steering(clock):
    t = LatencyTracker(LatencyConfig(tpot_floor_s=0.02), clock, ["b0", "b1"])
    t.observe_tpot("b0", 0.016)
    t.observe_tpot("b1", 0.008)
    assert t.cost("b0") == t.cost("b1") == 1.0


def test_the_worse_of_ttft_and_tpot_counts_and_cost_is_clamped(clock):
    t = LatencyTracker(LatencyConfig(max_cost=10.0), clock, ["b0", "b1", "b2"])
    t.observe_ttft("b0", 2.0)
    t.observe_ttft("b1", 0.1)
    t.observe_ttft("b2", 0.1)
    t.observe_tpot("b0", 0.02)
    t.observe_tpot("b1", 0.04)
    t.observe_tpot("b2", 0.04)
    assert t.cost("b0") == 10.0  # 20x on TTFT, clamped
    assert t.cost("b1") == 1.0
    t2 = LatencyTracker(LatencyConfig(), clock, ["a", "b", "c"])
    for url, s in (("a", 0.02), ("b", 1.0), ("c", 1.0)):
        t2.observe_tpot(url, s)
    assert t2.cost("a") == pytest.approx(0.02)  # 50x faster than the median


def test_two_backends_cost_in_the_ratio_of_their_estimates(clock):
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    t.observe_tpot("b0", 0.26)
    t.observe_tpot("b1", 0.01)  # raised to the floor, 0.02
    assert t.cost("b0") / t.cost("b1") == pytest.approx(13.0)


def test_a_stream_times_ttft_and_tokens_per_read(clock):
    t = LatencyTracker(LatencyConfig(), clock, ["b0"])
    with t.stream("b0") as s:
        clock.advance(0.3)
        s.tokens(0)  # a role-only event: not a token
        assert t.tpot_samples("b0") == 0
        s.tokens(1)
        assert t.ttft("b0") == pytest.approx(0.3)
        clock.advance(0.1)
        s.tokens(4)  # one read, four tokens: 25 ms each
        assert t.tpot("b0") == pytest.approx(0.025)
        assert t.tpot_samples("b0") == 1
    s.tokens(1)  # closed: ignored
    assert t.tpot_samples("b0") == 1


def test_a_hung_backend_gets_expensive_without_observations(clock):
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    for url in ("b0", "b1"):
        t.observe_ttft(url, 0.1)
        t.observe_tpot(url, 0.01)
    waiting = t.stream("b0")  # no first token yet
    clock.advance(3.0)
    assert t.ttft("b0") == pytest.approx(3.0)
    assert t.cost("b0") == pytest.approx(30.0)
    waiting.close()
    assert t.cost("b0") == 1.0
    streaming = t.stream("b1")
    streaming.tokens(1)
    clock.advance(1.0)  # a gap of a second and counting
    assert t.tpot("b1") == pytest.approx(1.0)
    assert t.cost("b1") > 10
    streaming.close()
    assert t.tpot("b1") == pytest.approx(0.01)


def test_stale_estimates_are_forgotten(clock):
    t = LatencyTracker(LatencyConfig(stale_s=60), clock, ["b0", "b1"])
    t.observe_tpot("b0", 1.0)
    t.observe_tpot("b1", 0.02)
    assert t.cost("b0") == pytest.approx(50 * t.cost("b1"))  # two: the median is the mean
    clock.advance(61)
    assert t.tpot("b0") is None and t.recent_tpot("b0") is None
    assert t.cost("b0") == 1.0  # avoided long enough: tried again


def test_unknown_backends_are_ignored_and_reset_keeps_probes(clock):
    t = LatencyTracker(LatencyConfig(probe_history=3), clock)
    t.observe_tpot("ghost", 1.0)
    t.stream("ghost").tokens(1)
    assert "ghost" not in t and t.tpot("ghost") is None and t.probes("ghost") == []
    t.add("b0")
    t.observe_tpot("b0", 0.5)
    for i in range(5):
        clock.advance(1)
        t.observe_probe("b0", 0.01 * i)
    assert [s for _, s in t.probes("b0")] == [0.02, 0.03, 0.04]  # the last three kept
    assert [s for _, s in t.probes("b0", since=clock() - 1)] == [0.03, 0.04]
    t.reset("b0")
    assert t.tpot("b0") is None and t.tpot_samples("b0") == 0
    assert t.probe("b0") is not None
    t.remove("b0")
    assert t.urls == []


def test_config_validation():
    with pytest.raises(ValueError):
        LatencyConfig(tau_s=0)
    with pytest.raises(ValueError):
        LatencyConfig(max_cost=0.5)
    with pytest.raises(ValueError):
        SlowEjectionConfig(factor=1.0)
    with pytest.raises(ValueError):
        SlowEjectionConfig(base_s=5, max_s=1)
    with pytest.raises(ValueError):
        SlowEjectionConfig(max_ejected_share=1.5)
    with pytest.raises(ValueError):
        SlowEjectionConfig(readmit_probes=0)


# -- slow-outlier ejection --------------------------------------------------------------------


def test_a_steadily_slow_backend_is_ejected_after_for_s(clock):
    _tracker, d, traffic = make(clock)
    start = clock()
    ejected_at = None
    while clock() - start < 5:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
        if d.update().ejected:
            ejected_at = clock() - start
            break
    assert ejected_at is not None
    assert 1.5 <= ejected_at < 2.5
    assert d.ejected == ["b0"] and d.ejections_total == 1
    assert d.ratio("b1") is None  # b0 is out: nothing left to compare b1 with


def test_one_stall_is_not_an_outlier(clock):
    tracker, d, traffic = make(clock)
    traffic.run({"b0": 0.01, "b1": 0.01}, 2.0)
    traffic.run({"b0": 0.3, "b1": 0.01}, 0.3)  # one 300 ms stall of b0's engine
    for _ in range(3):  # seen by four streams
        tracker.observe_tpot("b0", 0.3)
    assert tracker.recent_tpot("b0") == pytest.approx(0.01)
    for _ in range(50):
        traffic.run({"b0": 0.01, "b1": 0.01}, 0.1)
        assert d.update().ejected == []
    assert d.ejected == []


def test_one_stream_stuck_for_long_is_not_an_outlier(clock):
    tracker, d, traffic = make(clock)
    traffic.run({"b0": 0.01, "b1": 0.01}, 2.0)
    tracker.observe_tpot("b0", 20.0)  # its client stopped reading, or its prompt was odd
    for _ in range(50):
        traffic.run({"b0": 0.01, "b1": 0.01}, 0.1)
        assert d.update().ejected == []
    assert tracker.cost("b0") > 10 * tracker.cost("b1")  # routing stays wary of it a while


def test_the_signal_turns_within_the_window(clock):
    tracker, _, traffic = make(clock, latency={"window_s": 1.0})
    traffic.run({"b0": 0.01, "b1": 0.01}, 3.0)
    traffic.run({"b0": 0.26, "b1": 0.01}, 0.6)
    assert tracker.recent_tpot("b0") == pytest.approx(0.01)  # the fast tokens outnumber
    traffic.run({"b0": 0.26, "b1": 0.01}, 0.6)
    assert tracker.recent_tpot("b0") == pytest.approx(0.26)
    clock.advance(30)
    assert tracker.recent_tpot("b0") == pytest.approx(0.26)  # idle: the last known value
    clock.advance(31)
    assert tracker.recent_tpot("b0") is None  # until it is stale


def test_fast_backends_are_not_ejected_below_the_floor(clock):
    _tracker, d, traffic = make(clock)
    for _ in range(50):
        traffic.run({"b0": 0.04, "b1": 0.005}, 0.1, step=0.005)  # 8x, but fast
        assert d.update().ejected == []


def test_too_few_samples_are_not_enough(clock):
    tracker, d, traffic = make(clock, min_samples=5)
    traffic.run({"b1": 0.01}, 1.0)
    for _ in range(4):  # one slow token a second: four in four seconds
        tracker.observe_tpot("b0", 1.0)
        d.update()
        traffic.run({"b1": 0.01}, 1.0)
        assert d.ejected == []
    tracker.observe_tpot("b0", 1.0)
    tracker.observe_tpot("b0", 1.0)
    assert d.update().ejected == ["b0"]


def test_a_lone_backend_is_never_ejected(clock):
    _tracker, d, traffic = make(clock, urls=["b0"], max_ejected_share=1.0)
    for _ in range(50):
        traffic.run({"b0": 0.5}, 0.5)
        assert d.update().ejected == []


def test_never_the_last_available_backend(clock):
    _tracker, d, traffic = make(clock, max_ejected_share=1.0)
    for _ in range(30):
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
        # b1 is down for the health checks: b0, slow as it is, is all there is.
        assert d.update(available=["b0"]).ejected == []
    assert d.ejected == []


def test_a_backend_that_cannot_take_traffic_is_no_reference(clock):
    # b1 was fast, then died: its last timings say nothing of what b0, now carrying all the
    # load, should manage. b0 is not judged slow against them, and once b1 is back it must
    # stay slow for ``for_s`` again before it is ejected.
    _tracker, d, traffic = make(clock, max_ejected_share=1.0)
    traffic.run({"b0": 0.01, "b1": 0.01}, 1.0)
    for _ in range(30):
        traffic.run({"b0": 0.26}, 0.1)
        assert d.update(available=["b0"]).ejected == []
        assert d.slow_backends() == []
    for _ in range(10):
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
        assert d.update(available=["b0", "b1"]).ejected == []  # 1 s of the 1.5 s
    ejected = []
    for _ in range(10):
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
        ejected += d.update(available=["b0", "b1"]).ejected
    assert ejected == ["b0"]


def test_the_share_cap_ejects_the_worst_first(clock):
    urls = [f"b{i}" for i in range(6)]
    _tracker, d, traffic = make(clock, urls=urls, max_ejected_share=0.34)
    rates = {"b0": 0.2, "b1": 0.3, "b2": 0.25, "b3": 0.01, "b4": 0.01, "b5": 0.01}
    traffic.run(rates, 1.0)
    assert d.update().ejected == []  # all three slow from now on, judged together
    traffic.run(rates, 2.0)
    assert d.update().ejected == ["b1", "b2"]  # the two worst; 6 x 0.34: two at most
    traffic.run(rates, 2.0)
    assert d.update().ejected == []
    assert d.slow_backends() == ["b1", "b2", "b0"]


def test_slow_probes_hold_it_out_and_fast_ones_let_it_back(clock):
    tracker, d, traffic = make(clock, base_s=2.0, readmit_probes=2)
    while not d.update().ejected:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
    assert d.ejected_for("b0") == pytest.approx(2.0)
    for _ in range(10):  # five seconds of probes: b0 still slow
        clock.advance(0.5)
        tracker.observe_probe("b0", 0.27)
        tracker.observe_probe("b1", 0.02)
        assert d.update().returned == []
    assert d.is_ejected("b0")
    assert d.ejected_for("b0") == 2.0  # past its shortest stay, held by the probes
    clock.advance(0.5)
    tracker.observe_probe("b0", 0.02)
    tracker.observe_probe("b1", 0.02)
    assert d.update().returned == []  # one good probe is not yet two
    clock.advance(0.5)
    tracker.observe_probe("b0", 0.03)
    changes = d.update()
    assert changes.returned == ["b0"] and not d.is_ejected("b0")
    assert tracker.tpot("b0") is None  # back with a clean slate
    assert tracker.cost("b0") == 1.0
    assert d.ejected_for("b0") is None


def test_probes_are_judged_against_the_others_probes(clock):
    tracker, d, traffic = make(clock, min_probe_s=0.1, readmit_probes=2)
    while not d.update().ejected:
        traffic.run({"b0": 0.5, "b1": 0.1}, 0.1)
    for b0_probe in (0.7, 0.7, 0.5):
        tracker.observe_probe("b1", 0.2)  # a big model: probes of 200 ms are normal
        tracker.observe_probe("b0", b0_probe)
        clock.advance(1.0)
        assert d.is_ejected("b0")  # 3.5x the others' probes: slow; then only one not slow
    tracker.observe_probe("b0", 0.5)
    assert not d.is_ejected("b0")  # 2.5x: not an outlier


def test_without_probes_the_timer_decides(clock):
    _tracker, d, traffic = make(clock, base_s=2.0, probe_stale_s=10)
    while not d.update().ejected:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
    clock.advance(1.9)
    assert d.is_ejected("b0")
    clock.advance(0.1)
    assert not d.is_ejected("b0")
    assert d.update().returned == ["b0"]  # reported once, by the next update
    assert d.update().returned == []


def test_stale_probes_are_no_evidence(clock):
    tracker, d, traffic = make(clock, base_s=2.0, probe_stale_s=3)
    while not d.update().ejected:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
    tracker.observe_probe("b0", 0.27)
    tracker.observe_probe("b1", 0.02)
    clock.advance(2.5)
    assert d.is_ejected("b0")  # a slow probe, recent: held
    clock.advance(1.0)
    assert not d.is_ejected("b0")  # no probe for 3 s (the health loop gave up on it)


def test_ejections_double_up_to_the_cap_and_are_forgiven(clock):
    _tracker, d, traffic = make(clock, base_s=2.0, max_s=5.0, forgive_s=20.0)
    stays = []
    for _ in range(3):
        while not d.update().ejected:
            traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
        stays.append(d.ejected_for("b0"))
        clock.advance(stays[-1])
        assert not d.is_ejected("b0")
    assert stays == pytest.approx([2.0, 4.0, 5.0])
    for _ in range(25):  # 20 s back and fast: forgiven
        traffic.run({"b0": 0.01, "b1": 0.01}, 1.0)
        d.update()
    while not d.update().ejected:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
    assert d.ejected_for("b0") == pytest.approx(2.0)


def test_removing_the_last_one_in_rotation_lets_the_ejected_back(clock):
    tracker, d, traffic = make(clock)
    while not d.update().ejected:
        traffic.run({"b0": 0.26, "b1": 0.01}, 0.1)
    d.remove("b1")
    assert d.ejected == [] and "b1" not in tracker
    assert d.update() == SlowChanges([], ["b0"])
    d.add("b2")
    assert "b2" in tracker and not d.is_ejected("b2")


def test_unknown_backends_are_not_ejected(clock):
    _, d, _ = make(clock)
    assert not d.is_ejected("ghost") and d.ejected_for("ghost") is None
    assert d.ratio("ghost") is None


@pytest.mark.parametrize(("streams", "probe_every"), [(3, 0.5), (1, 0.5), (3, 2.0)])
def test_the_chaos_slow_replica_scenario(streams, probe_every):
    """Two replicas of a small model (5-20 ms a token), ``streams`` streams each; replica 0's
    engine steps take 250 ms longer from t=20 s to t=40 s. Health probes every
    ``probe_every`` s (the chaos runs' interval, and the default), the router consults the
    detector every 100 ms. Detection well under 5 s, one ejection for the whole fault, back
    within a few seconds of its end, and no false alarm otherwise."""
    clock = Clock(0.0)
    rng = random.Random(7)
    tracker, d, _ = make(clock)
    fault = (20.0, 40.0)
    due = {"b0": 0.0, "b1": 0.0}  # the next engine step's end
    last: dict[str, float | None] = {"b0": None, "b1": None}  # the last tokens' time
    ejected_at: float | None = None
    returned_at: float | None = None
    t = 0.0
    while t < 60.0:
        t = round(t + 0.005, 3)
        clock.now = t
        slow = fault[0] <= t < fault[1]
        for url in ("b0", "b1"):
            if d.is_ejected(url):
                last[url] = None  # no traffic: its streams are over, new ones go elsewhere
                continue
            if t < due[url]:
                continue
            previous = last[url]
            if previous is not None:
                for _ in range(streams):  # a token each per engine step
                    tracker.observe_tpot(url, t - previous)
            last[url] = t
            due[url] = t + rng.uniform(0.005, 0.02) + (0.25 if url == "b0" and slow else 0.0)
        if abs(t / probe_every - round(t / probe_every)) < 1e-9:  # a round of probes
            for url in ("b0", "b1"):
                extra = 0.25 if url == "b0" and slow else 0.0
                tracker.observe_probe(url, rng.uniform(0.01, 0.04) + extra)
        if abs(t * 10 - round(t * 10)) < 1e-9:
            changes = d.update()
            if "b0" in changes.ejected and ejected_at is None:
                ejected_at = t
            if "b0" in changes.returned and t >= fault[1] and returned_at is None:
                returned_at = t
        if t < fault[0]:
            assert d.ejected == []
    assert ejected_at is not None and returned_at is not None
    assert ejected_at - fault[0] < 5.0
    assert returned_at - fault[1] <= 2 * probe_every + 0.5
    assert d.ejections_total == 1  # out for the whole fault: no trial returns while slow
    assert "b1" not in d.ejected


# -- properties of the guards -----------------------------------------------------------------

actions = st.lists(
    st.tuples(
        st.sampled_from(["tpot", "tpot", "tpot", "probe", "tick", "update", "update"]),
        st.integers(min_value=0, max_value=5),  # which backend
        st.sampled_from([0.005, 0.01, 0.02, 0.3, 1.0, 2.5]),  # a latency, or seconds to wait
        st.frozensets(st.integers(min_value=0, max_value=5), min_size=1),  # available ones
    ),
    min_size=20,
    max_size=150,
)
shares = st.one_of(st.sampled_from([0.0, 0.34, 0.5, 1.0]), st.floats(min_value=0.0, max_value=1.0))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=6),
    shares,
    st.sampled_from([0.0, 0.5]),
    st.sampled_from([0, 2]),
    actions,
)
def test_guards_hold_whatever_happens(n, share, for_s, min_samples, acts):
    clock = Clock()
    urls = [f"b{i}" for i in range(n)]
    tracker, d, _ = make(
        clock,
        urls=urls,
        max_ejected_share=share,
        for_s=for_s,
        min_samples=min_samples,
        min_tpot_s=0.0,
        base_s=0.5,
    )
    for kind, i, x, avail in acts:
        url = urls[i % n]
        if kind == "tpot":
            tracker.observe_tpot(url, x)
        elif kind == "probe":
            tracker.observe_probe(url, x)
        elif kind == "tick":
            clock.advance(x)
        else:
            available = sorted({urls[j % n] for j in avail})
            before = set(d.ejected)
            changes = d.update(available)
            out = d.ejected
            assert len(out) <= share * n + 1e-9  # the share is never exceeded
            for e in changes.ejected:
                assert e not in before
                if len(changes.ejected) == 1:  # the others' median is the one it was judged on
                    ratio = d.ratio(e)
                    assert ratio is not None and ratio > d.config.factor
                # Another backend it was told may serve stayed in rotation.
                assert any(a != e and a not in out for a in available)
            for r in changes.returned:
                assert r not in out or r in changes.ejected
        assert len(d.ejected) < n  # never the last backend


rounds = st.lists(
    st.tuples(
        st.frozensets(st.integers(min_value=0, max_value=5), max_size=2),  # turn slow/fast
        st.frozensets(st.integers(min_value=0, max_value=5), min_size=1),  # available ones
        st.sampled_from([0.1, 0.5, 1.0, 3.0]),  # seconds the round lasts
        st.booleans(),  # a round of probes
    ),
    min_size=10,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=6),
    shares,
    st.frozensets(st.integers(min_value=0, max_value=5)),
    rounds,
)
def test_guards_hold_as_backends_turn_slow_and_fast(n, share, slow_at_first, plan):
    clock = Clock()
    urls = [f"b{i}" for i in range(n)]
    tracker, d, _ = make(
        clock, urls=urls, max_ejected_share=share, for_s=0.5, min_samples=2, base_s=1.0
    )
    slow = set(slow_at_first)
    for turn, avail, seconds, probe in plan:
        slow ^= turn
        for i, url in enumerate(urls):
            x = 0.3 if i in slow else 0.01
            if not d.is_ejected(url):
                for _ in range(3):
                    tracker.observe_tpot(url, x)
            if probe:
                tracker.observe_probe(url, x + 0.01)
        clock.advance(seconds)
        available = sorted({urls[j % n] for j in avail})
        before = set(d.ejected)
        changes = d.update(available)
        out = d.ejected
        assert len(out) <= share * n + 1e-9
        assert len(out) < n
        for e in changes.ejected:
            assert e not in before
            assert any(a != e and a not in out for a in available)
        for r in changes.returned:  # ``before`` may already have let it back, lazily
            assert r not in out or r in changes.ejected


def _served_typical(t: LatencyTracker, clock, url: str = "b1", size: int = 1000) -> None:
    for _ in range(10):
        with t.stream(url, size) as s:
            clock.advance(0.1)
            s.tokens(1)
            clock.advance(0.05)
            s.tokens(1)


def test_a_large_request_held_while_others_stream_does_not_make_the_backend_slow(clock):
    """A backend that holds a long request back (waiting for KV room) while it streams to the
    others is not stopped: the held request's age does not raise its estimates; once it gives
    no stream a token, the held request's wait counts from its last token."""
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    _served_typical(t, clock, "b0")
    _served_typical(t, clock, "b1")
    held = t.stream("b0", 8000)
    flowing = t.stream("b0", 8000)
    for _ in range(100):  # five seconds of tokens to the other long request
        clock.advance(0.05)
        flowing.tokens(1)
    assert t.ttft("b0") < 0.2 and t.cost("b0") == pytest.approx(t.cost("b1"), rel=0.5)
    clock.advance(2.0)  # then nothing comes from it at all
    assert t.ttft("b0") == pytest.approx(2.0) and t.tpot("b0") == pytest.approx(2.0)
    assert t.cost("b0") > 10 * t.cost("b1")
    held.close()
    flowing.close()


def test_a_typical_request_waiting_counts_in_full_while_others_stream(clock):
    """A backend that stops starting requests of typical size while one stream still flows
    gets expensive: their waits count whatever else it does."""
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    _served_typical(t, clock, "b0")
    _served_typical(t, clock, "b1")
    waiting = t.stream("b0", 1000)
    flowing = t.stream("b0", 1000)
    for _ in range(20):
        clock.advance(0.05)
        flowing.tokens(1)
    assert t.ttft("b0") == pytest.approx(1.0)
    assert t.cost("b0") > 5 * t.cost("b1")
    waiting.close()
    flowing.close()


def test_only_a_request_of_typical_size_times_the_first_token(clock):
    """A long prompt's first token takes its prefill (or its wait for KV room) on any backend:
    it does not time the backend's TTFT, though its tokens still show the backend is alive."""
    t = LatencyTracker(LatencyConfig(), clock, ["b0", "b1"])
    for _ in range(10):
        with t.stream("b1", 1000) as s:
            clock.advance(0.1)
            s.tokens(1)
    with t.stream("b0", 1500) as s:  # typical: within twice the median
        clock.advance(0.1)
        s.tokens(1)
    assert t.ttft("b0") == pytest.approx(0.1)
    with t.stream("b0", 8000) as long:
        clock.advance(5.0)
        long.tokens(1)
        assert t.ttft("b0") == pytest.approx(0.1)  # not five seconds
        held = t.stream("b0", 8000)
        clock.advance(3.0)  # nothing at all comes from it now: waits count again
        assert t.ttft("b0") == pytest.approx(3.0)
        held.close()
