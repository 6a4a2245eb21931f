"""A chaos run's arithmetic: what every request came to, detection, recovery, leaks. Pure.

Each request ends as exactly one of: completed (some after a retry), refused (429/503, an
explicit "not now"), failed (any other explicit error: a status, an error event, a refused
connection), hung (no whole answer by its deadline plus a grace), lost (no answer and no
error: a connection that broke, a stream cut short without an error), or abandoned (its
client walked away on purpose). Lost and hung must be zero. Of the completed, those the
client had to send again are told apart by why: *resent* after a connection the gateway had
accepted broke before any answer (it may have begun the work; without the client's resend
the request was lost), *reconnected* after refused connections only (nothing had reached it).

After the load, every replica must answer the leak check and hold nothing: one that cannot be
read (down, not restarted, not a poise replica) fails it, as a leak that cannot be ruled out.

Recovery looks at the steady traffic only, in windows of send time after the fault: a window
is healthy when every steady request in it completed with a TTFT p99 within the threshold
(twice the p99 before the fault, and at least 100 ms above it). MTTR is the time from the fault
to the end of the last unhealthy window after which ``STABLE_WINDOWS`` healthy windows follow
in a row: back, and staying back (a lone slow request at the very end of the run, with no
time left to show a recovery, is not counted as the fault's). Availability is formula 1,
MTBF / (MTBF + MTTR), with the run's unimpaired time as MTBF.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import Any

from poise.bench.report import REJECTED_STATUS, Record, Stats
from poise.chaos.load import Sent
from poise.chaos.sampler import Sample
from poise.chaos.scenarios import Plan
from poise.resilience.success import RunSuccess, run_success

OUTCOMES = ("completed", "refused", "failed", "hung", "lost", "abandoned")
WINDOW_S = 2.0
STABLE_WINDOWS = 3  # healthy windows in a row that count as recovered
_LOST_FAILURES = frozenset({"dropped", "truncated", "bad_payload"})


def outcome(r: Record) -> str:
    if r.abandoned:
        return "abandoned"
    if r.completed:
        return "completed"
    if r.failure == "timeout":
        return "hung"
    if r.failure in _LOST_FAILURES or r.failure is None:
        return "lost"
    if r.failure == "status" and r.status in REJECTED_STATUS:
        return "refused"
    return "failed"


@dataclass(frozen=True, slots=True)
class Counts:
    sent: int
    completed: int
    after_retry: int  # completed, but only after the gateway or the client tried again
    resent: int  # completed after the client resent it: an accepted connection was dropped
    reconnected: int  # completed after the client resent it: only refused connections
    refused: int
    failed: int
    hung: int
    lost: int
    abandoned: int
    ttft: Stats | None
    e2e: Stats | None = None  # the completed requests' whole time, request to last byte

    @classmethod
    def of(cls, sents: list[Sent]) -> Counts:
        c = Counter(outcome(s.record) for s in sents)
        done = [s.record for s in sents if s.record.completed]
        return cls(
            sent=len(sents),
            after_retry=sum((r.attempts or 1) > 1 or r.connect_retries > 0 for r in done),
            resent=sum(r.drop_resends > 0 for r in done),
            reconnected=sum(r.connect_retries > 0 and r.drop_resends == 0 for r in done),
            ttft=Stats.of([r.ttft_s for r in done if r.ttft_s is not None]),
            e2e=Stats.of([r.e2e_s for r in done if r.e2e_s is not None]),
            **{k: c[k] for k in OUTCOMES},
        )


@dataclass(frozen=True, slots=True)
class Leaks:
    """What is still held once the load has stopped and every answer is in.

    Per replica, in the order of the replica URLs; None where the replica could not be read
    (it did not answer, or not as a poise replica): that fails the check, since what it holds
    is unknown. No replicas at all (a remote run without ``--replica``) leaves the gateway's
    count alone to judge, and a gateway that cannot be read (not a poise gateway) leaves only
    the requests' outcomes.
    """

    kv_blocks: list[int | None]
    replica_requests: list[int | None]
    gateway_requests: int | None

    @classmethod
    def of(cls, sample: Sample) -> Leaks:
        return cls(
            kv_blocks=[r.kv_used_blocks for r in sample.replicas],
            replica_requests=[r.inflight for r in sample.replicas],
            gateway_requests=sample.gateway_inflight,
        )

    @property
    def unreadable(self) -> list[int]:
        """The replicas (by index) that did not answer the check."""
        pairs = zip_longest(self.kv_blocks, self.replica_requests)
        return [i for i, (kv, inflight) in enumerate(pairs) if kv is None or inflight is None]

    @property
    def clean(self) -> bool:
        held = [*self.kv_blocks, *self.replica_requests]
        return (
            not self.unreadable and all(v == 0 for v in held) and self.gateway_requests in (0, None)
        )


@dataclass(frozen=True, slots=True)
class Timeline:
    """The run second by second, for the plot and for a reader of the JSON."""

    second: list[int]  # by the second each request was sent
    completed: list[int]
    refused: list[int]
    failed: list[int]  # failed, hung and lost together
    steady_ttft_p99_s: list[float | None]
    sample_t: list[float]
    backends: dict[str, list[str]]  # per backend URL, per sample: routed, half-open, out, ?
    kv_used_blocks: list[list[int | None]]  # per replica, per sample
    kv_capacity_blocks: list[list[int | None]] = field(default_factory=list)  # the same way
    # Requests each replica has held back for lack of KV room since it started, as read.
    kv_room_waits: list[list[int | None]] = field(default_factory=list)

    @classmethod
    def of(
        cls, sents: list[Sent], samples: list[Sample], backends: list[str], duration_s: float
    ) -> Timeline:
        n = int(duration_s) + 1
        counts = {k: [0] * n for k in ("completed", "refused", "failed")}
        ttfts: list[list[float]] = [[] for _ in range(n)]
        for s in sents:
            i = min(n - 1, int(s.planned.at_s))
            kind = outcome(s.record)
            if kind == "abandoned":
                continue
            counts[kind if kind in counts else "failed"][i] += 1
            r = s.record
            if s.planned.traffic.counts_for_recovery and r.ttft_s is not None:
                ttfts[i].append(r.ttft_s)
        p99 = [None if not t else (Stats.of(t) or Stats(0, 0, 0, 0)).p99 for t in ttfts]
        states: dict[str, list[str]] = {b: [] for b in backends}
        for smp in samples:
            for b in backends:
                states[b].append(_backend_state(smp, b))
        return cls(
            list(range(n)),
            counts["completed"],
            counts["refused"],
            counts["failed"],
            p99,
            [round(smp.t, 3) for smp in samples],
            states,
            _per_replica(samples, "kv_used_blocks"),
            _per_replica(samples, "kv_capacity_blocks"),
            _per_replica(samples, "room_waits"),
        )


def _per_replica(samples: list[Sample], reading: str) -> list[list[int | None]]:
    """One of the replicas' readings, per replica, per sample (None where it did not answer)."""
    replicas = max((len(smp.replicas) for smp in samples), default=0)
    return [
        [getattr(smp.replicas[i], reading) if i < len(smp.replicas) else None for smp in samples]
        for i in range(replicas)
    ]


def _backend_state(s: Sample, backend: str) -> str:
    if not s.gateway_up or s.eligible is None:
        return "?"  # the gateway itself did not answer
    breaker = s.breakers.get(backend, "closed")
    if breaker == "half_open":
        return "half-open"
    return "routed" if backend in s.eligible and breaker == "closed" else "out"


@dataclass(frozen=True, slots=True)
class ChaosReport:
    scenario: str
    summary: str
    plan: dict[str, Any]
    counts: Counts
    by_traffic: dict[str, Counts]
    migrated: float | None  # streams continued on another replica (a poise gateway's count)
    detected_s: float | None
    detection: str
    baseline_ttft_p99_s: float | None
    worst_ttft_p99_s: float | None  # the steady traffic's worst 2 s window after the fault
    mttr_s: float | None  # None: not recovered within the run
    availability: float | None
    leaks: Leaks
    preemptions: int | None
    events: list[tuple[float, str]] = field(default_factory=list)
    timeline: Timeline | None = None
    scenario_holds: bool = False  # the fault lasts for the plan's hold, then ends
    offered: dict[str, float] = field(default_factory=dict)  # requests per second, by traffic
    requests: list[dict[str, Any]] = field(default_factory=list)  # each one, for the JSON
    success: RunSuccess | None = None  # formula 2's prediction beside what the clients saw

    @property
    def passed(self) -> bool:
        return self.counts.lost == 0 and self.counts.hung == 0 and self.leaks.clean

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["leaks"]["unreadable"] = self.leaks.unreadable
        d["leaks"]["clean"] = self.leaks.clean
        return d


def detection_time(
    samples: list[Sample], fault_at: float, how: str, target: str | None
) -> float | None:
    """Seconds from the fault until the gateway showed it knew."""
    for s in samples:
        if s.t < fault_at:
            continue
        if how == "redis" and s.redis_up is False:
            return s.t - fault_at
        if how != "ejection" or target is None or s.eligible is None:
            continue
        if target not in s.eligible or s.breakers.get(target, "closed") != "closed":
            return s.t - fault_at
    return None


def baseline_p99(sents: list[Sent], plan: Plan) -> float | None:
    warm = min(2.0, plan.fault_at_s / 4)
    before = [
        s.record.ttft_s
        for s in sents
        if s.planned.traffic.counts_for_recovery
        and warm <= s.planned.at_s < plan.fault_at_s
        and s.record.completed
        and s.record.ttft_s is not None
    ]
    stats = Stats.of(before)
    return None if stats is None else stats.p99


def _windows(sents: list[Sent], plan: Plan) -> list[tuple[float, bool, float | None]]:
    """Each window of steady traffic after the fault: its start, healthy or not, its p99."""
    steady = [s for s in sents if s.planned.traffic.counts_for_recovery and not s.record.abandoned]
    out = []
    start = plan.fault_at_s
    while start < plan.duration_s:
        window = [s.record for s in steady if start <= s.planned.at_s < start + WINDOW_S]
        stats = Stats.of([r.ttft_s for r in window if r.ttft_s is not None])
        out.append((start, all(r.completed for r in window), None if stats is None else stats.p99))
        start += WINDOW_S
    return out


def recovery_time(sents: list[Sent], plan: Plan, baseline: float | None) -> float | None:
    """MTTR: the fault to the end of the last unhealthy window that a lasting recovery
    (``STABLE_WINDOWS`` healthy windows in a row) follows; 0 when there is none but the run
    was healthy from the fault on; None when it never lastingly recovered, or relapsed for
    ``STABLE_WINDOWS`` windows in a row after it and never recovered again."""
    if baseline is None:
        return None
    limit = max(2 * baseline, baseline + 0.1)
    healthy = [
        completed and (p99 is None or p99 <= limit) for _, completed, p99 in _windows(sents, plan)
    ]

    def stable_from(i: int) -> bool:
        run = healthy[i : i + STABLE_WINDOWS]
        return len(run) == STABLE_WINDOWS and all(run)

    last_bad = [i for i, ok in enumerate(healthy) if not ok and stable_from(i + 1)]
    back = last_bad[-1] + 1 if last_bad else 0
    if not stable_from(back):
        return None
    # A slow window or two later is not the same outage; as many unhealthy windows in a row
    # as a recovery takes, with none after them, are (after kv-exhaustion the restored pool let
    # the long requests in, and TTFT rose for ten seconds to the end of the run: that was no
    # recovery at the fault).
    last_start = len(healthy) - STABLE_WINDOWS
    if any(not any(healthy[i : i + STABLE_WINDOWS]) for i in range(back, last_start + 1)):
        return None
    return back * WINDOW_S


def worst_p99(sents: list[Sent], plan: Plan) -> float | None:
    """The steady traffic's worst windowed p99 TTFT after the fault: how bad it got."""
    values = [p99 for _, _, p99 in _windows(sents, plan) if p99 is not None]
    return max(values) if values else None


def preemptions(samples: list[Sample]) -> int | None:
    """Preemptions during the run: each replica's counter's increase (restarts count anew)."""
    total, seen = 0, False
    n = max((len(s.replicas) for s in samples), default=0)
    for i in range(n):
        last: int | None = None
        for s in samples:
            v = s.replicas[i].preemptions if i < len(s.replicas) else None
            if v is None:
                continue
            seen = True
            if last is not None:
                total += v - last if v >= last else v
            last = v
    return total if seen else None


def build(
    scenario: str,
    summary: str,
    plan: Plan,
    sents: list[Sent],
    samples: list[Sample],
    migrated: float | None,
    detection: str,
    target: str | None,
    leaks: Leaks,
    events: list[tuple[float, str]],
    backends: list[str],
    holds: bool = False,
    offered: dict[str, float] | None = None,
    model: str | None = None,
) -> ChaosReport:
    by_label: dict[str, list[Sent]] = {}
    for s in sents:
        by_label.setdefault(s.planned.traffic.label, []).append(s)
    baseline = baseline_p99(sents, plan)
    mttr = recovery_time(sents, plan, baseline)
    counts = Counts.of(sents)
    return ChaosReport(
        scenario=scenario,
        summary=summary,
        plan=asdict(plan),
        counts=counts,
        by_traffic={k: Counts.of(v) for k, v in by_label.items()},
        migrated=migrated,
        detected_s=detection_time(samples, plan.fault_at_s, detection, target),
        detection=detection,
        baseline_ttft_p99_s=baseline,
        worst_ttft_p99_s=worst_p99(sents, plan),
        mttr_s=mttr,
        availability=None if mttr is None else (plan.duration_s - mttr) / plan.duration_s,
        leaks=leaks,
        preemptions=preemptions(samples),
        events=events,
        timeline=Timeline.of(sents, samples, backends, plan.duration_s),
        scenario_holds=holds,
        offered=offered or {},
        requests=[_request_row(s) for s in sents],
        success=success_of(samples, counts, model),
    )


def success_of(samples: list[Sample], counts: Counts, model: str | None = None) -> RunSuccess:
    """Formula 2 for ``model`` from what the gateway counted over the run, beside the share of
    the requests (those whose clients did not walk away) that completed."""
    read = [s for s in samples if s.tally is not None]
    policy = read[-1].policy if read else None
    tallies = [s.tally for s in read if s.tally is not None]
    return run_success(tallies, policy, counts.completed, counts.sent - counts.abandoned, model)


def _request_row(s: Sent) -> dict[str, Any]:
    r = s.record
    return {
        "sent_at": round(s.planned.at_s, 4),
        "traffic": s.planned.traffic.label,
        "outcome": outcome(r),
        "status": r.status,
        "ttft_s": r.ttft_s,
        "e2e_s": r.e2e_s,
        "output_tokens": r.output_tokens,
        "attempts": r.attempts,
        "connect_retries": r.connect_retries,
        "drop_resends": r.drop_resends,
        "failure": r.failure,
        "error": r.error,
    }
