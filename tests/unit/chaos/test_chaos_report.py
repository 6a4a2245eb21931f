"""The chaos report's arithmetic on made-up runs whose answers are known."""

from __future__ import annotations

import pytest

from poise.bench.command import format_success
from poise.bench.report import Record
from poise.bench.workload import Item, Lengths
from poise.chaos.load import Planned, Sent
from poise.chaos.report import (
    Counts,
    Leaks,
    baseline_p99,
    build,
    detection_time,
    outcome,
    preemptions,
    recovery_time,
    worst_p99,
)
from poise.chaos.sampler import ReplicaSample, Sample, gateway_sample, replica_sample
from poise.chaos.scenarios import Plan, Traffic
from poise.resilience.success import BackendCounts, SuccessPolicy, Tally

PLAN = Plan.of(duration_s=30.0, rate=4.0, capacity=10.0)
STEADY = PLAN.steady()
EXTRA = PLAN.during_fault("flood", 40.0)


def ok(at: float, ttft: float = 0.05, attempts: int = 1, traffic: Traffic = STEADY) -> Sent:
    r = Record(sent_at=at, status=200, ttft_s=ttft, e2e_s=ttft + 0.5, output_tokens=10)
    r.attempts = attempts
    return Sent(Planned(at, traffic, Item("p", 10)), r)


def bad(at: float, traffic: Traffic = STEADY, **kw: object) -> Sent:
    r = Record(sent_at=at, status=int(kw.pop("status", 0)))  # type: ignore[call-overload]
    for k, v in kw.items():
        setattr(r, k, v)
    return Sent(Planned(at, traffic, Item("p", 10)), r)


def test_every_request_ends_as_exactly_one_outcome():
    assert outcome(ok(1).record) == "completed"
    assert outcome(bad(1, status=429, failure="status").record) == "refused"
    assert outcome(bad(1, status=503, failure="status").record) == "refused"
    assert outcome(bad(1, status=500, failure="status").record) == "failed"
    assert outcome(bad(1, status=200, failure="error_event").record) == "failed"
    assert outcome(bad(1, failure="refused").record) == "failed"  # the client was told
    assert outcome(bad(1, failure="timeout").record) == "hung"
    for silent in ("dropped", "truncated", "bad_payload", None):
        assert outcome(bad(1, status=200, failure=silent).record) == "lost"
    assert outcome(bad(1, abandoned=True, error="abandoned").record) == "abandoned"


def test_counts_tell_a_retried_answer_from_a_first_try_one():
    sents = [ok(1), ok(2, attempts=2), ok(3), bad(4, failure="timeout")]
    sents[2].record.connect_retries = 1
    c = Counts.of(sents)
    assert (c.sent, c.completed, c.after_retry, c.hung, c.lost) == (4, 3, 2, 1, 0)


def test_a_resend_after_a_dropped_connection_is_told_from_one_after_a_refused_one():
    refused_twice, dropped_once, dropped_then_refused = ok(1), ok(2), ok(3)
    gateway_retry = ok(4, attempts=2)
    refused_twice.record.connect_retries = 2
    dropped_once.record.connect_retries = dropped_once.record.drop_resends = 1
    dropped_then_refused.record.connect_retries, dropped_then_refused.record.drop_resends = 3, 1
    # Resent but never answered: not completed, so neither count has it.
    gave_up = bad(5, failure="dropped", connect_retries=4, drop_resends=4)
    sents = [ok(0), refused_twice, dropped_once, dropped_then_refused, gateway_retry, gave_up]
    c = Counts.of(sents)
    assert (c.completed, c.after_retry, c.resent, c.reconnected, c.lost) == (5, 4, 2, 1, 1)
    report = build("x", "x", PLAN, sents, [], 0, "none", None, Leaks([0], [0], 0), [], [])
    d = report.as_dict()
    assert (d["counts"]["resent"], d["counts"]["reconnected"]) == (2, 1)
    assert [r["drop_resends"] for r in d["requests"]] == [0, 0, 1, 1, 0, 4]


def test_detection_is_the_first_sample_after_the_fault_that_shows_it():
    target = "http://127.0.0.1:1"
    other = "http://127.0.0.1:2"

    def s(t: float, eligible: list[str], breaker: str = "closed") -> Sample:
        return Sample(t, True, eligible, {target: breaker, other: "closed"})

    samples = [s(9.0, [other]), s(10.25, [target, other]), s(10.5, [target, other], "open"),
               s(10.75, [other])]  # fmt: skip
    # Out before the fault is not a detection of it; an open breaker is.
    assert detection_time(samples, 10.0, "ejection", target) == pytest.approx(0.5)
    assert detection_time(samples, 10.0, "ejection", None) is None
    redis = [Sample(9.0, True, redis_up=False), Sample(11.0, True, redis_up=True),
             Sample(12.5, True, redis_up=False)]  # fmt: skip
    assert detection_time(redis, 10.0, "redis", None) == pytest.approx(2.5)


def test_mttr_is_the_start_of_a_lasting_recovery():
    # Steady at 50 ms before the fault at 10 s; slow until 14 s; one failure at 15 s.
    sents = [ok(t / 2, 0.05) for t in range(0, 20)]
    sents += [ok(10 + t / 2, 0.5) for t in range(0, 8)]
    sents += [bad(15.0, status=500, failure="status")]
    sents += [ok(16 + t / 2, 0.05) for t in range(0, 28)]
    assert baseline_p99(sents, PLAN) == pytest.approx(0.05)
    # Windows of 2 s from the fault: [10,12) [12,14) slow, [14,16) has the failure.
    assert recovery_time(sents, PLAN, 0.05) == pytest.approx(6.0)
    # Traffic that is not steady (a flood's refusals) does not count against recovery.
    flood = [bad(11.0, EXTRA, status=429, failure="status")]
    assert recovery_time([*sents[:20], *flood, *sents[28:]], PLAN, 0.05) == pytest.approx(6.0)
    # A lone slow request once it has been back for 6 s is not the same outage.
    assert recovery_time([*sents, ok(29.5, 0.9)], PLAN, 0.05) == pytest.approx(6.0)
    assert 0.5 < (worst_p99([*sents, ok(29.5, 0.9)], PLAN) or 0) <= 0.9  # the late one
    # Hurt until the end, or back for less than 6 s: not recovered.
    still = [ok(t / 2, 0.05) for t in range(20)] + [ok(10 + t / 2, 0.5) for t in range(32)]
    assert recovery_time(still, PLAN, 0.05) is None
    brief = [*sents[:20], *[ok(10 + t / 2, 0.5) for t in range(30)], ok(25.5), ok(27.0)]
    assert recovery_time(brief, PLAN, 0.05) is None
    # Back, then slow again for three windows, never back after them: not recovered. Two
    # slow windows are a blip, not the outage again.
    relapse = [*sents, ok(24.5, 0.9), ok(26.5, 0.9), ok(28.5, 0.9)]
    assert recovery_time(relapse, PLAN, 0.05) is None
    fine_then_slow = [ok(t / 2) for t in range(44)] + [ok(22.5 + 2 * t, 0.9) for t in range(3)]
    assert recovery_time(fine_then_slow, PLAN, 0.05) is None
    blip = [*sents, ok(26.5, 0.9), ok(28.5, 0.9)]
    assert recovery_time(blip, PLAN, 0.05) == pytest.approx(6.0)
    # Nothing visible at all: recovered at once.
    assert recovery_time([ok(t / 2) for t in range(60)], PLAN, 0.05) == 0.0


def test_preemptions_add_up_across_a_restart():
    def s(t: float, *counts: int | None) -> Sample:
        return Sample(
            t, True, replicas=[ReplicaSample(c is not None, preemptions=c) for c in counts]
        )

    samples = [s(0, 0, 5), s(1, 3, 5), s(2, None, 7), s(3, 1, 7), s(4, 2, 7)]
    assert preemptions(samples) == 3 + 1 + 1 + 2


def test_leaks_are_clean_only_when_nothing_is_held_by_anyone():
    assert Leaks([0, 0], [0, 0], 0).clean
    assert not Leaks([0, 3], [0, 0], 0).clean
    assert not Leaks([0, 0], [1, 0], 0).clean
    assert not Leaks([0, 0], [0, 0], 2).clean
    assert Leaks([0, 0], [0, 0], None).clean  # not a poise gateway: its replicas still count
    assert Leaks([], [], 0).clean and Leaks([], [], None).clean  # no replicas named: remote


def test_a_replica_that_does_not_answer_the_leak_check_fails_it():
    # What a replica that did not answer holds is unknown: not clean, and named.
    gone = Leaks([0, None], [0, None], 0)
    assert not gone.clean and gone.unreadable == [1]
    assert not Leaks([None, None], [None, None], None).clean
    assert Leaks([None, 0], [0, 0], 0).unreadable == [0]  # half a reading is no reading
    assert Leaks([0, 0], [0], 0).unreadable == [1]  # nor is a missing one
    # As the run builds it, from the last sample: down, or not a poise replica's state.
    sample = Sample(30.0, True, [], {}, None, 0)
    sample.replicas = [
        replica_sample(STATE),
        replica_sample(None),
        replica_sample({"role": "gateway"}),
        replica_sample({**STATE, "kv_cache": {"free_blocks": 9}}),
    ]
    leaks = Leaks.of(sample)
    assert leaks.kv_blocks == [0, None, None, None] and leaks.unreadable == [1, 2, 3]
    good = [ok(t / 2) for t in range(60)]
    report = build("x", "x", PLAN, good, [sample], 0, "none", None, leaks, [], [])
    assert not report.passed and report.counts.lost == 0 and report.counts.hung == 0
    d = report.as_dict()
    assert d["passed"] is False
    assert d["leaks"]["unreadable"] == [1, 2, 3] and d["leaks"]["clean"] is False
    sample.replicas = [replica_sample(STATE), replica_sample(STATE)]
    assert Leaks.of(sample).clean


STATE = {
    "role": "replica",
    "kv_cache": {"total_blocks": 10, "free_blocks": 10},
    "engine": {"preemptions_total": 2},
    "inflight_requests": 0,
}


def test_a_replica_sample_reads_what_is_held_or_marks_it_unreadable():
    s = replica_sample({**STATE, "kv_cache": {"total_blocks": 10, "free_blocks": 7}})
    assert (s.up, s.kv_used_blocks, s.preemptions, s.inflight) == (True, 3, 2, 0)
    assert s.room_waits is None  # not every replica says it: nothing is made up
    for waits, read in ((12, 12), (True, None), (-3, None), ("x", None), (2.5, None)):
        s = replica_sample({**STATE, "engine": {"preemptions_total": 2, "room_waits_total": waits}})
        assert (s.up, s.kv_used_blocks, s.room_waits) == (True, 0, read)
    for unreadable in (None, {}, {"role": "gateway"}, {**STATE, "engine": None},
                       {**STATE, "inflight_requests": "many"}, {**STATE, "kv_cache": None},
                       {**STATE, "kv_cache": [1]}, {**STATE, "engine": [1]}):  # fmt: skip
        s = replica_sample(unreadable)
        assert not s.up and s.kv_used_blocks is None and s.inflight is None


def test_the_report_fails_on_a_lost_request_and_passes_without():
    good = [ok(t / 2) for t in range(60)]
    clean = Leaks([0, 0], [0, 0], 0)
    report = build("x", "x", PLAN, good, [], 0, "none", None, clean, [], [])
    assert report.passed and report.availability == 1.0 and report.mttr_s == 0.0
    lost = build("x", "x", PLAN, [*good, bad(12, status=200, failure="truncated")], [], 0,
                 "none", None, clean, [], [])  # fmt: skip
    assert not lost.passed and lost.counts.lost == 1
    assert lost.mttr_s == pytest.approx(4.0) and lost.availability == pytest.approx(26 / 30)
    timeline = lost.timeline
    assert timeline is not None and sum(timeline.failed) == 1 and sum(timeline.completed) == 60
    assert Lengths(24) == PLAN.prompt_len


def gateway_state(seconds: float, requests: int, ok: int, failed: int) -> dict[str, object]:
    """A poise gateway's /debug/state, with its formula 2 counts since it started."""
    tally = Tally(seconds=seconds)
    m = tally.model("demo")
    m.requests = m.sent = m.latency[0] = requests
    m.backends["http://r0"] = BackendCounts(first=requests, ok=ok, failed=failed)
    return {
        "role": "gateway",
        "models": {},
        "rate_limits": {"redis_up": None},
        "success_tally": tally.as_dict(),
        "success_policy": SuccessPolicy(max_retries=0).as_dict(),
    }


def test_the_run_predicts_success_from_the_gateways_counts_across_its_restart():
    states = [
        gateway_state(5.0, 4, 4, 0),  # the warm-up, before the run
        gateway_state(15.0, 24, 22, 2),  # 20 more, 2 of them failed
        gateway_state(3.0, 10, 8, 2),  # restarted: all of it is the run's
    ]
    samples = [gateway_sample(float(i), s) for i, s in enumerate(states)]
    sents = [ok(t / 2) for t in range(27)] + [bad(14, status=502, failure="status")] * 3
    report = build("x", "x", PLAN, sents, samples, 0, "none", None, Leaks([], [], 0), [], [])
    s = report.success
    assert s is not None and s.model == "demo"
    assert s.predicted == pytest.approx(26 / 30) and s.observed == pytest.approx(27 / 30)
    assert s.difference_pp == pytest.approx(-100 / 30)
    # Not a poise gateway (or one without the counts): observed only.
    foreign = [
        gateway_sample(0.0, {"role": "gateway", "models": {}, "rate_limits": {"redis_up": None}})
    ]
    alone = build("x", "x", PLAN, sents, foreign, 0, "none", None, Leaks([], [], 0), [], [])
    assert alone.success is not None and alone.success.predicted is None
    assert "predicted -" in format_success(alone.success)
    assert "-3.33 pp" in format_success(s)
