"""The autoscaling decision (formula 5) on scripted signals, with a fake clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from poise.resilience.autoscale import AutoscaleConfig, Autoscaler


class Sim:
    """Counters as a gateway would read them: arrivals, completions, and what waits."""

    def __init__(self, scaler: Autoscaler, clock: Callable[[], float], replicas: int) -> None:
        self.scaler, self.clock, self.replicas = scaler, clock, replicas
        self.arrivals = self.completed = 0
        self.waiting = 0.0

    def run(self, seconds: int, rate: float, mu: float, follow: bool = True) -> list[int]:
        """Each second: ``rate`` arrive, up to ``mu`` per replica complete; the decision."""
        out = []
        for _ in range(seconds):
            self.clock.advance(1.0)  # type: ignore[attr-defined]
            self.arrivals += round(rate)
            backlog = self.waiting + rate
            done = min(backlog, mu * self.replicas)
            self.completed += round(done)
            self.waiting = backlog - done
            self.scaler.observe(self.arrivals, self.completed, self.waiting, self.replicas)
            desired = self.scaler.decide().desired
            if follow:
                self.replicas = desired
            out.append(desired)
        return out


def make(clock: Callable[[], float], replicas: int = 1, **kw: object) -> Sim:
    config = AutoscaleConfig(**{"max_replicas": 10, "scale_down_window_s": 60.0, **kw})  # type: ignore[arg-type]
    return Sim(Autoscaler(config, clock), clock, replicas)


def test_a_step_scales_up_within_seconds_to_what_formula_5_says(clock):
    sim = make(clock, replicas=1, service_rate_prior=5.0)
    sim.run(30, rate=4, mu=5)
    assert sim.replicas == 1
    # Load x4: 16/s against 5/s per replica needs ceil(1.2 * 16 / 5) = 4 once the queue is gone.
    after = sim.run(40, rate=16, mu=5)
    assert max(after[:10]) >= 4  # up fast (the backlog asks for more at first)
    assert sim.replicas == 4
    assert sim.waiting == 0


def test_the_service_rate_is_measured_while_requests_wait_not_taken_from_the_prior(clock):
    # The prior is wrong by 3x; saturation shows the truth.
    sim = make(clock, replicas=1, service_rate_prior=15.0)
    sim.run(60, rate=20, mu=5)
    mu = sim.scaler.service_rate
    assert mu is not None and mu == pytest.approx(5.0, rel=0.15)
    # The backlog asked for more at first; once it is served, ceil(1.2 * 20 / 5) = 5.
    assert sim.waiting == 0 and sim.scaler.decide().recommended == 5


def test_without_a_prior_nothing_moves_until_requests_wait(clock):
    sim = make(clock, replicas=2)
    sim.scaler.observe(0, 0, 0, 2)
    d = sim.scaler.decide()
    assert d.desired == 2 and d.raw is None and d.reason == "no service rate yet"
    # Half idle, throughput per replica is only a floor under μ: it must not become μ, or
    # α·λ/(λ/N) = α·N would ask for more replicas for ever.
    assert sim.run(60, rate=3, mu=5) == [2] * 60
    assert sim.scaler.service_rate is None
    sim.run(20, rate=20, mu=5)  # now requests wait: μ is measured, and the size follows
    assert sim.scaler.service_rate == pytest.approx(5.0, rel=0.15) and sim.replicas >= 5


def test_a_spike_scales_up_at_once_and_down_only_after_the_window(clock):
    sim = make(clock, replicas=1, service_rate_prior=5.0, scale_down_window_s=60.0)
    sim.run(20, rate=3, mu=5)
    spike = sim.run(60, rate=30, mu=5)
    assert max(spike) >= 8
    peak = sim.replicas
    after = sim.run(120, rate=3, mu=5)
    # Nothing is drained for a window after the spike ends, then it comes down to 1.
    assert after[:55] == [peak] * 55
    assert after[-1] == 1
    assert sorted(after, reverse=True) == after  # down in steps, never back up


def test_noise_around_a_steady_load_does_not_flap(clock):
    sim = make(clock, replicas=3, service_rate_prior=5.0)
    rng = random.Random(1)
    decisions = []
    for _ in range(300):
        decisions += sim.run(1, rate=max(0.0, rng.gauss(11, 2)), mu=5)
    changes = sum(a != b for a, b in itertools.pairwise(decisions))
    # ceil(1.2 * 11 / 5) = 3, and bursts ask for 4: a few changes, not one every few seconds.
    assert changes <= 4 and set(decisions) <= {3, 4}


def test_bounds_hold_whatever_the_load(clock):
    sim = make(clock, replicas=2, service_rate_prior=5.0, min_replicas=2, max_replicas=4)
    assert max(sim.run(30, rate=200, mu=5)) == 4
    assert min(sim.run(600, rate=0, mu=5)) == 2  # once the backlog is served


def test_the_decision_explains_itself(clock):
    sim = make(clock, replicas=1, service_rate_prior=5.0, safety_factor=1.5, target_latency_s=2.0)
    sim.run(5, rate=10, mu=5)
    d = sim.scaler.decide()
    # raw = α (λ + Q/T) / μ with the measured values it reports.
    assert d.service_rate is not None
    expected = 1.5 * (d.arrival_rate + d.queue / 2.0) / d.service_rate
    assert d.raw == pytest.approx(expected)
    assert d.desired >= 3


def test_invalid_configs_are_refused():
    for bad in ({"min_replicas": 0}, {"min_replicas": 5, "max_replicas": 2},
                {"target_latency_s": 0}, {"tolerance": 1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            AutoscaleConfig(**bad)  # type: ignore[arg-type]
