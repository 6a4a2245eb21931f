"""The faults ``poise chaos`` knows: what each does, to what, and the traffic around it.

A scenario is data plus two actions on a ``Harness`` (the deployment under test): ``inject`` at
the fault time and, for faults that end, ``recover`` after the hold. Traffic is the steady
stream every run has, plus what a scenario adds while its fault holds (a flood, long prompts,
clients that walk away). Faults that need a process (a signal, Redis) need a local deployment;
the others act over HTTP (``/admin/faults``) and work against any poise replicas.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from poise.bench.workload import Lengths


class ChaosError(RuntimeError):
    """A scenario cannot run as asked (say, a signal to a replica that is not local)."""


class Harness(Protocol):
    """What a fault acts on."""

    @property
    def replica_count(self) -> int: ...
    def replica_state(self, index: int) -> dict[str, Any]: ...
    def signal_replica(self, index: int, sig: signal.Signals) -> None: ...
    def set_faults(self, index: int, **faults: Any) -> None: ...
    def clear_faults(self, index: int) -> None: ...
    def signal_gateway(self, sig: signal.Signals) -> None: ...
    def stop_redis(self) -> None: ...
    def start_redis(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Traffic:
    """Poisson arrivals at ``rate`` per second from ``start_s`` to ``end_s`` of the run."""

    label: str
    rate: float
    start_s: float
    end_s: float
    prompt_len: Lengths
    output_len: Lengths
    key: str | None = None  # the name of an API key of the chaos gateway (its priority)
    abandon_share: float = 0.0  # this share of requests is given up part way
    counts_for_recovery: bool = True  # steady traffic: what MTTR and detection look at


@dataclass(frozen=True, slots=True)
class Plan:
    """A run's timing and steady load; what scenarios build their traffic from."""

    duration_s: float
    fault_at_s: float
    hold_s: float
    rate: float
    prompt_len: Lengths
    output_len: Lengths
    capacity: float  # requests per second the deployment serves at the steady lengths
    capacity_measured: bool = False  # measured on this host before the run, not given

    @classmethod
    def of(
        cls,
        duration_s: float,
        rate: float,
        capacity: float,
        prompt_len: Lengths | None = None,
        output_len: Lengths | None = None,
    ) -> Plan:
        """The fault a third of the way in, held for a third: steady, hurt, after."""
        return cls(
            duration_s=duration_s,
            fault_at_s=duration_s / 3,
            hold_s=duration_s / 3,
            rate=rate,
            prompt_len=prompt_len or Lengths(24),
            output_len=output_len or Lengths(128),
            capacity=capacity,
        )

    @property
    def recover_at_s(self) -> float:
        return self.fault_at_s + self.hold_s

    def steady(self, key: str | None = None) -> Traffic:
        return Traffic(
            "steady", self.rate, 0.0, self.duration_s, self.prompt_len, self.output_len, key
        )

    def during_fault(self, label: str, rate: float, after_s: float = 0.0, **kw: Any) -> Traffic:
        """Traffic from ``after_s`` into the fault to its end."""
        kw.setdefault("prompt_len", self.prompt_len)
        kw.setdefault("output_len", self.output_len)
        start = min(self.fault_at_s + after_s, self.recover_at_s)
        return Traffic(label, rate, start, self.recover_at_s, counts_for_recovery=False, **kw)


Action = Callable[[Harness], None]

# API keys of the chaos gateway: lower priority values are served first (as in vLLM).
INTERACTIVE_KEY = "interactive"
BATCH_KEY = "batch"
KEYS = {INTERACTIVE_KEY: 0, BATCH_KEY: 10}


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    inject: Action
    recover: Action | None = None
    target: int | None = 0  # the replica hurt, whose ejection is the detection; None: none
    detect: str = "ejection"  # ejection | redis | none
    local_only: bool = False  # needs process ids or Redis: a deployment poise chaos started
    needs_redis: bool = False
    serve_flags: tuple[str, ...] = ()
    gateway: dict[str, Any] = field(default_factory=dict)
    keyed: bool = False  # requests carry the interactive / batch keys
    extra: Callable[[Plan], list[Traffic]] = lambda plan: []


def _signal(index: int, sig: signal.Signals) -> Action:
    return lambda h: h.signal_replica(index, sig)


def _faults(index: int, **faults: Any) -> Action:
    return lambda h: h.set_faults(index, **faults)


def _clear(index: int) -> Action:
    return lambda h: h.clear_faults(index)


# The KV pool a replica keeps while kv-exhaustion holds: what its steady traffic holds and will
# still grow into as the fault begins (the replica's own projection, every running request at
# its projected end at once: ``committed_blocks``, the most of five readings over a second,
# read while the pool is whole and no admission rule holds anyone back for room; not the
# headroom, which counts only the most they hold at once and is the rule under test), a
# quarter more for its ups and downs, and
# room for one long request (25 blocks of 16 tokens) beside it. Sized by what the replica holds,
# not in blocks, so that the fault means the same on a slow CPU (whose requests last long and
# hold many blocks) and on a fast GPU: the steady traffic fits, a second long request does not.
KV_STEADY_MARGIN = 1.25
KV_LONG_BLOCKS = 28
KV_READINGS = 5
KV_READING_GAP_S = 0.25
# The long requests come once the pool is sized (the readings, and the answers to them), so
# that what they hold is not read as the steady traffic's need: the pool would have room for
# them, and nobody would be short of it.
KV_LONG_AFTER_S = 2.0


def _shrink_kv(h: Harness) -> None:
    if not h.replica_count:
        raise ChaosError("kv-exhaustion shrinks each replica's pool: pass their URLs (--replica)")
    # The steady traffic's need, at its most over a second: one reading may fall in a lull.
    need = [0] * h.replica_count
    total = [0] * h.replica_count
    for reading in range(KV_READINGS):
        if reading:
            time.sleep(KV_READING_GAP_S)
        for i in range(h.replica_count):
            kv = h.replica_state(i)["kv_cache"]
            total[i] = kv["total_blocks"]
            need[i] = max(need[i], kv["committed_blocks"])
    for i in range(h.replica_count):
        limit = math.ceil(KV_STEADY_MARGIN * need[i]) + KV_LONG_BLOCKS
        h.set_faults(i, kv_limit_blocks=min(limit, total[i]))


def _restore_kv(h: Harness) -> None:
    for i in range(h.replica_count):
        h.clear_faults(i)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "kill-replica",
            "SIGKILL replica 0; the supervisor starts it again",
            _signal(0, signal.SIGKILL),
            local_only=True,
        ),
        Scenario(
            "hang-replica",
            "SIGSTOP replica 0 for the hold, then SIGCONT",
            _signal(0, signal.SIGSTOP),
            _signal(0, signal.SIGCONT),
            local_only=True,
        ),
        Scenario(
            "slow-replica",
            "every engine step of replica 0 takes 250 ms longer for the hold",
            _faults(0, step_delay_s=0.25),
            _clear(0),
        ),
        Scenario(
            "error-replica",
            "replica 0 answers every request with 500 for the hold",
            _faults(0, error_status=500),
            _clear(0),
        ),
        Scenario(
            "step-exception",
            "the next 40 engine steps of replica 0 raise (its running requests fail)",
            _faults(0, fail_steps=40),
            _clear(0),
        ),
        Scenario(
            "kv-exhaustion",
            "each replica's KV pool shrinks to what its steady traffic needs and one long "
            "request more, and long prompts and outputs (25 blocks each) arrive for the rest of "
            "the hold once it is sized",
            _shrink_kv,
            _restore_kv,
            target=None,
            detect="none",
            extra=lambda plan: [
                plan.during_fault(
                    "long",
                    max(1.0, plan.rate),
                    KV_LONG_AFTER_S,
                    prompt_len=Lengths(200),
                    output_len=Lengths(200),
                )
            ],
        ),
        Scenario(
            "disconnect-storm",
            "twice the steady rate more, half of it abandoned by its clients part way",
            lambda h: None,
            target=None,
            detect="none",
            extra=lambda plan: [plan.during_fault("abandoning", 2 * plan.rate, abandon_share=0.5)],
        ),
        Scenario(
            "flood",
            "batch traffic at 10x capacity on top of the steady interactive load",
            lambda h: None,
            target=None,
            detect="none",
            keyed=True,
            # The gateway holds the line (replicas keep short queues), so priority decides.
            gateway={
                "admission": {
                    "max_inflight_per_backend": 16,
                    "max_backend_waiting": 4,
                    "max_queue": 64,
                    "queue_ttl_s": 2.0,
                }
            },
            extra=lambda plan: [plan.during_fault("flood", 10 * plan.capacity, key=BATCH_KEY)],
        ),
        Scenario(
            "redis-down",
            "the shared rate limits' Redis is killed for the hold, then started again",
            lambda h: h.stop_redis(),
            lambda h: h.start_redis(),
            target=None,
            detect="redis",
            local_only=True,
            needs_redis=True,
            keyed=True,
        ),
        Scenario(
            "drain",
            "SIGTERM replica 0 under load; it drains and the supervisor starts it again",
            _signal(0, signal.SIGTERM),
            local_only=True,
        ),
        Scenario(
            "gateway-restart",
            "SIGTERM the gateway; it drains and the supervisor starts it again",
            lambda h: h.signal_gateway(signal.SIGTERM),
            target=None,
            detect="none",
            local_only=True,
        ),
    ]
}
