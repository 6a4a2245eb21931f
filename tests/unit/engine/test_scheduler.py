"""The scheduler with fake runner outputs: no torch, no model."""

import pytest

from poise.engine.errors import RequestTooLargeError
from poise.engine.kv_cache import KVCacheManager
from poise.engine.request import Request, RequestStatus, SamplingParams
from poise.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from stepbudgets import FixedStepBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(blocks=64, block_size=4, **cfg) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(blocks, block_size), clock), clock


def add(
    s: Scheduler,
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    priority: int = 0,
    deadline: float | None = None,
    arrival: float | None = None,
    first: int = 0,
) -> Request:
    r = Request(
        rid,
        list(range(first, first + prompt_len)),
        SamplingParams(ignore_eos=True),
        arrival_time=s.clock() if arrival is None else arrival,
        max_tokens=max_tokens,
        priority=priority,
        deadline=deadline,
    )
    s.add_request(r)
    return r


def run_step(s: Scheduler, token: int = 1) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {q.request_id: token for q in out.sequences if q.sample})
    return out


def test_chunked_prefill_respects_the_token_budget():
    s, _ = make_scheduler(max_num_batched_tokens=10)
    r = add(s, "a", 25, max_tokens=2)
    sizes = [run_step(s).num_batched_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]
    assert r.num_computed_tokens == 25 and len(r.output_token_ids) == 1
    out = run_step(s)  # decode mixes in as one token
    assert out.num_batched_tokens == 1 and r.is_finished


def test_decode_and_prefill_share_a_step():
    s, _ = make_scheduler(max_num_batched_tokens=8)
    add(s, "a", 3, max_tokens=10)
    run_step(s)
    add(s, "b", 20)
    out = run_step(s)
    assert [(q.request_id, len(q.token_ids)) for q in out.sequences] == [("a", 1), ("b", 7)]
    assert not out.sequences[1].sample


def test_running_cap():
    s, _ = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3)
    out = run_step(s)
    assert len(out.sequences) == 2 and s.num_waiting == 2


def test_admission_follows_priority_then_arrival():
    s, _ = make_scheduler(max_num_seqs=1)
    add(s, "late-low", 3, priority=5, arrival=0.0)
    add(s, "high", 3, priority=0, arrival=2.0)
    add(s, "early-high", 3, priority=0, arrival=1.0)
    assert run_step(s).sequences[0].request_id == "early-high"


def test_preemption_picks_worst_priority_and_recomputes():
    s, _ = make_scheduler(blocks=4, block_size=4)
    hi = add(s, "hi", 4, max_tokens=8, priority=0)
    lo = add(s, "lo", 4, max_tokens=8, priority=1)
    run_step(s)
    run_step(s)  # both decoding; each holds 2 of the 4 blocks
    while lo.status is not RequestStatus.PREEMPTED:
        out = run_step(s)
    assert "lo" in out.preempted_request_ids
    assert lo.num_computed_tokens == 0 and s.kv.block_table("lo") == []
    assert hi.status is RequestStatus.RUNNING
    while s.has_unfinished:
        run_step(s)
    assert hi.finish_reason == lo.finish_reason == "length"
    assert len(lo.output_token_ids) == 8  # recomputed, finished in full
    assert s.kv.num_free_blocks == 4


def test_preemption_cap_protects_a_request():
    s, _ = make_scheduler(blocks=4, block_size=4, max_preemptions=1)
    hi = add(s, "hi", 4, max_tokens=8, priority=0)
    lo = add(s, "lo", 4, max_tokens=8, priority=1)
    lo.num_preemptions = 1  # already preempted as often as allowed
    while s.has_unfinished:
        run_step(s)
    assert lo.num_preemptions == 1
    assert hi.num_preemptions == 1  # the better request yielded instead
    assert hi.finish_reason == lo.finish_reason == "length"


def test_everyone_protected_still_makes_progress():
    s, _ = make_scheduler(blocks=4, block_size=4, max_preemptions=0)
    a = add(s, "a", 4, max_tokens=8)
    b = add(s, "b", 4, max_tokens=8)
    for _ in range(200):
        if not s.has_unfinished:
            break
        run_step(s)
    assert a.finish_reason == b.finish_reason == "length"


def test_deadline_times_out_and_frees_blocks():
    s, clock = make_scheduler()
    r = add(s, "a", 8, max_tokens=100, deadline=5.0)
    w = add(s, "w", 8, deadline=5.0, priority=9)
    run_step(s)
    assert s.kv.block_table("a")
    clock.now = 5.0
    out = run_step(s)
    assert r.finish_reason == "timeout" and w.finish_reason == "timeout"
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert {x.request_id for x in s.take_finished()} == {"a", "w"}
    assert out.is_empty


def test_too_large_is_rejected_at_submission():
    s, _ = make_scheduler(blocks=4, block_size=4)
    with pytest.raises(RequestTooLargeError, match="whole pool has 4"):
        add(s, "big", 10, max_tokens=10)
    assert not s.has_unfinished


def test_abort_at_any_time_frees_everything():
    s, _ = make_scheduler(max_num_batched_tokens=4)
    add(s, "a", 10)
    add(s, "b", 10)
    run_step(s)  # a is mid-prefill, b waits
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert not s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert [r.finish_reason for r in s.take_finished()] == ["abort", "abort"]
    assert s.schedule().finished_request_ids == ["a", "b"]


def test_prefix_cache_skips_computed_tokens():
    s, _ = make_scheduler(block_size=4)
    add(s, "a", 12, max_tokens=1)
    while s.has_unfinished:
        run_step(s)
    b = add(s, "b", 14, max_tokens=1)  # same first 12 tokens
    out = run_step(s)
    assert out.sequences[0].start_position == 12
    assert b.num_cached_prompt_tokens == 12
    assert s.kv.stats.hit_tokens == 12


def test_a_chunk_ending_mid_block_leaves_that_block_out_of_the_prefix_cache():
    # Issue 17, item 9: block 1 holds positions 4-7, of which the first step computes 4-5.
    # Once the request is aborted, the same prompt may reuse block 0 only: adopting block 1
    # would skip positions 6-7, whose K/V was never written.
    s, _ = make_scheduler(block_size=4, max_num_batched_tokens=6)
    add(s, "a", 16)
    assert run_step(s).num_batched_tokens == 6
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    b = add(s, "b", 16)
    out = run_step(s)
    assert out.sequences[0].start_position == 4
    assert b.num_cached_prompt_tokens == 4


def test_a_preempted_chunk_does_not_readopt_its_half_computed_block():
    # "a" computes 2 of its first block's 4 positions, then "hi"'s decode takes the last free
    # block and "a" yields it. Back from the queue, "a" must start again at position 0.
    s, _ = make_scheduler(blocks=3, block_size=4, max_num_batched_tokens=6)
    add(s, "hi", 4, max_tokens=2, priority=0)
    a = add(s, "a", 8, max_tokens=1, priority=1, first=100)
    out = run_step(s)
    assert [(q.request_id, len(q.token_ids)) for q in out.sequences] == [("hi", 4), ("a", 2)]
    out = run_step(s)
    assert out.preempted_request_ids == ["a"]
    out = run_step(s)
    assert [(q.request_id, q.start_position) for q in out.sequences] == [("a", 0)]
    assert a.num_cached_prompt_tokens == 0
    while s.has_unfinished:
        run_step(s)
    assert a.finish_reason == "length"


def test_a_time_budget_serves_decodes_first_then_prefill_and_caps_the_running_set():
    s, _ = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        add(s, f"d{i}", 3, max_tokens=50)
    run_step(s)  # three running, decoding from now on
    s.time_budget = FixedStepBudget(tokens=8, cap=4)
    add(s, "new", 20, max_tokens=4)
    out = run_step(s)
    sizes = {q.request_id: len(q.token_ids) for q in out.sequences}
    # Every decode, then the prompt gets what the budget leaves: 8 - 3 = 5 tokens, not 20.
    assert sizes == {"d0": 1, "d1": 1, "d2": 1, "new": 5}
    assert s.max_running == 4
    add(s, "later", 3)
    run_step(s)
    assert s.num_waiting == 1 and len(s.running) == 4  # the cap holds it back
    # Decodes alone beyond the budget: a prompt under way still progresses, a block a step.
    s.time_budget = FixedStepBudget(tokens=2, cap=4)
    out = run_step(s)
    assert {q.request_id: len(q.token_ids) for q in out.sequences}["new"] == s.kv.block_size
    s.time_budget = None  # no time budget: the caps alone, as before
    assert s.max_running == s.config.max_num_seqs
