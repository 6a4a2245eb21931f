"""Three autoscaling policies on the same load traces: a discrete-time simulation.

Replicas are modelled on what `poise bench --concurrency 48` measured through the gateway for
the demo model's two replicas on this machine (24.6 req/s, E2E p50 1.79 s at 24 requests per
replica): each replica serves up to ``--slots`` requests at once, each for ``--service-s``,
so one replica completes slots / service_s requests per second. A new replica serves only after
``--startup-s`` (loading a model); a replica scaled down drains (finishes what it holds, takes
nothing new). Requests wait in one FIFO queue; a request meets the SLO when it starts within
``--slo-wait-s`` of arriving, and one that waits ``--give-up-s`` leaves (missed).

Policies, each evaluated once a second, each with its usual stabilisation:
- poise: ``poise.resilience.autoscale`` (formula 5: α (λ + Q/T) / μ, μ measured from
  completions while requests wait; tolerance; scale-down window 120 s);
- waiting threshold, as the KEDA recipe of vLLM's production stack: desired =
  ceil(waiting / 5), Kubernetes HPA's default 300 s scale-down stabilisation;
- target ongoing requests, as Ray Serve: desired = ceil(ongoing / target) with the target at
  80 % of a replica's slots, Ray's default 30 s upscale and 600 s downscale delays.

Traces (rates relative to half of one replica's capacity): a step x4, a spike x10 for 60 s, a
diurnal curve (0.2x to 3x), and a gamma process at 2x with gaps of shape 0.25 (bursty).
Printed per trace: SLO attainment, replica-seconds, scale events, p99 queue wait.

    python benchmarks/autoscale_sim.py [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from poise.resilience.autoscale import AutoscaleConfig, Autoscaler

DT = 0.05


DECIDE_EVERY_S = 1.0


@dataclass
class Replica:
    ready_at: float
    running: list[float] = field(default_factory=list)  # end times (a heap)
    draining: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Signals:
    now: float
    waiting: int
    running: int
    arrivals_total: int
    completed_total: int
    ready: int  # replicas serving
    current: int  # replicas counted as the deployment's size (starting + serving)


Policy = Callable[[Signals], int]


class Stabilized:
    """Up after ``up_delay_s`` of asking for more, down to the window's highest ask."""

    def __init__(self, up_delay_s: float, down_window_s: float) -> None:
        self.up_delay_s, self.down_window_s = up_delay_s, down_window_s
        self.asks: deque[tuple[float, int]] = deque()
        self.up_since: float | None = None

    def apply(self, now: float, ask: int, current: int) -> int:
        self.asks.append((now, ask))
        while self.asks and self.asks[0][0] < now - max(self.down_window_s, self.up_delay_s):
            self.asks.popleft()
        if ask > current:
            self.up_since = now if self.up_since is None else self.up_since
            if now - self.up_since >= self.up_delay_s:
                # The lowest ask over the delay: scale up to what was asked all along.
                recent = [a for t, a in self.asks if t >= now - self.up_delay_s]
                return max(current, min(recent))
            return current
        self.up_since = None
        if ask < current:
            window = [a for t, a in self.asks if t >= now - self.down_window_s]
            return max(ask, min(current, max(window)))
        return current


def poise_policy(mn: int, mx: int, target_s: float) -> Policy:
    clock = Clock()
    config = AutoscaleConfig(
        target_latency_s=target_s,
        min_replicas=mn,
        max_replicas=mx,
        scale_down_window_s=120,
    )
    scaler = Autoscaler(config, clock)

    def decide(s: Signals) -> int:
        clock.now = s.now
        scaler.observe(s.arrivals_total, s.completed_total, s.waiting, s.ready, s.current - s.ready)
        return scaler.decide().desired

    return decide


def waiting_threshold_policy(mn: int, mx: int, per_replica: float = 5.0) -> Policy:
    stab = Stabilized(up_delay_s=0.0, down_window_s=300.0)

    def decide(s: Signals) -> int:
        ask = min(mx, max(mn, math.ceil(s.waiting / per_replica)))
        return stab.apply(s.now, ask, s.current)

    return decide


def ongoing_policy(mn: int, mx: int, target: float) -> Policy:
    stab = Stabilized(up_delay_s=30.0, down_window_s=600.0)

    def decide(s: Signals) -> int:
        ask = min(mx, max(mn, math.ceil((s.waiting + s.running) / target)))
        return stab.apply(s.now, ask, s.current)

    return decide


@dataclass
class Outcome:
    attainment: float
    replica_seconds: float
    scale_events: int
    p99_wait_s: float
    peak: int


def simulate(
    trace: Trace,
    policy: Policy,
    args: argparse.Namespace,
    seed: int,
) -> Outcome:
    rate_at, duration_s, shape = trace
    rng = random.Random(seed)

    def gap(rate: float) -> float:
        return rng.gammavariate(shape, 1.0 / (rate * shape)) if rate > 0 else DT

    now = 0.0
    replicas = [Replica(0.0) for _ in range(args.min_replicas)]
    queue: deque[float] = deque()
    arrivals = completed = met = missed = 0
    waits: list[float] = []
    replica_seconds = 0.0
    events = 0
    next_decision = DECIDE_EVERY_S
    peak = len(replicas)
    next_arrival = gap(rate_at(0.0))
    while now < duration_s or queue or any(r.running for r in replicas):
        now += DT
        # Arrivals (a Poisson process whose rate follows the trace; none after the end).
        while next_arrival <= now and next_arrival < duration_s:
            queue.append(next_arrival)
            arrivals += 1
            next_arrival += gap(rate_at(next_arrival))
        for r in replicas:
            while r.running and r.running[0] <= now:
                heapq.heappop(r.running)
                completed += 1
        while queue and now - queue[0] > args.give_up_s:
            queue.popleft()
            missed += 1
        serving = [r for r in replicas if r.ready_at <= now and not r.draining]
        while queue and serving:
            r = min(serving, key=lambda x: len(x.running))
            if len(r.running) >= args.slots:
                break
            arrived = queue.popleft()
            wait = now - arrived
            waits.append(wait)
            met += wait <= args.slo_wait_s
            heapq.heappush(r.running, now + args.service_s)
        replicas = [r for r in replicas if not (r.draining and not r.running)]
        replica_seconds += DT * len(replicas)
        if now >= next_decision:
            next_decision += DECIDE_EVERY_S
            live = [r for r in replicas if not r.draining]
            signals = Signals(
                now,
                len(queue),
                sum(len(r.running) for r in replicas),
                arrivals,
                completed,
                sum(1 for r in live if r.ready_at <= now),
                len(live),
            )
            desired = max(args.min_replicas, min(args.max_replicas, policy(signals)))
            if desired != len(live):
                events += 1
            if desired > len(live):
                replicas += [Replica(now + args.startup_s) for _ in range(desired - len(live))]
            elif desired < len(live):
                # The youngest go first: the ones still starting hold nothing.
                for r in sorted(live, key=lambda x: -x.ready_at)[: len(live) - desired]:
                    r.draining = True
            peak = max(peak, sum(1 for r in replicas if not r.draining))
    total = met + (len(waits) - met) + missed
    waits.sort()
    p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0
    return Outcome(met / total if total else 1.0, replica_seconds, events, p99, peak)


Trace = tuple[Callable[[float], float], float, float]  # rate(t), duration, gamma shape


def traces(base: float) -> dict[str, Trace]:
    """Shape 1 is Poisson; the bursty trace's gaps are gamma with shape 0.25 (CV 2), at 2x base
    on average, as ``poise bench --burstiness 0.25`` sends them."""
    return {
        "step x4": (lambda t: base if t < 120 else 4 * base, 600.0, 1.0),
        "spike x10 60s": (lambda t: 10 * base if 120 <= t < 180 else base, 600.0, 1.0),
        "diurnal": (lambda t: base * (1.6 + 1.4 * math.sin(2 * math.pi * t / 600)), 1200.0, 1.0),
        "bursty gamma": (lambda t: 2 * base, 900.0, 0.25),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--slots", type=int, default=24)
    p.add_argument("--service-s", type=float, default=1.95)
    p.add_argument("--startup-s", type=float, default=30.0)
    p.add_argument("--slo-wait-s", type=float, default=2.0)
    p.add_argument("--give-up-s", type=float, default=60.0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    mu = args.slots / args.service_s
    base = mu / 2
    print(
        f"replica: {args.slots} slots x {args.service_s:g} s = {mu:.1f} req/s; start-up "
        f"{args.startup_s:g} s; SLO: start within {args.slo_wait_s:g} s; base rate {base:.1f}/s"
    )
    policies: dict[str, Callable[[], Policy]] = {
        "poise (formula 5)": lambda: poise_policy(
            args.min_replicas, args.max_replicas, args.slo_wait_s
        ),
        "waiting > 5 (KEDA)": lambda: waiting_threshold_policy(
            args.min_replicas, args.max_replicas
        ),
        "ongoing (Ray Serve)": lambda: ongoing_policy(
            args.min_replicas, args.max_replicas, 0.8 * args.slots
        ),
    }
    print(
        f"{'trace':<15}{'policy':<22}{'attainment':>11}{'replica-s':>11}{'events':>8}"
        f"{'p99 wait':>10}{'peak':>6}"
    )
    for name, trace in traces(base).items():
        for label, make in policies.items():
            o = simulate(trace, make(), args, args.seed)
            print(
                f"{name:<15}{label:<22}{100 * o.attainment:>10.2f}%{o.replica_seconds:>11.0f}"
                f"{o.scale_events:>8}{o.p99_wait_s:>9.1f}s{o.peak:>6}"
            )


if __name__ == "__main__":
    main()
