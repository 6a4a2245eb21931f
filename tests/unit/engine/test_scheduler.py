"""The scheduler with fake runner outputs: no torch, no model."""

import pytest

from poise.engine.errors import CANNOT_FINISH, RequestTooLargeError
from poise.engine.kv_cache import KVCacheManager
from poise.engine.request import Request, RequestStatus, SamplingParams, StreamPace
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


def optimistic(s: Scheduler) -> Scheduler:
    """Headroom for everyone: as when the projection of what requests will produce falls
    short, the scheduler lets more in than the pool can finish, and must preempt."""
    s._headroom = lambda excluding=frozenset(): (1 << 30, s.typical_footprint)  # type: ignore[method-assign]
    return s


def test_preemption_picks_worst_priority_and_recomputes():
    s, _ = make_scheduler(blocks=4, block_size=4)
    optimistic(s)
    hi = add(s, "hi", 4, max_tokens=8, priority=0)
    lo = add(s, "lo", 4, max_tokens=8, priority=1)
    run_step(s)
    run_step(s)  # both decoding; each holds 2 of the 4 blocks
    for _ in range(50):
        out = run_step(s)
        if lo.status is RequestStatus.PREEMPTED:
            break
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
    optimistic(s)
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


def test_a_waiting_request_that_can_no_longer_finish_by_its_deadline_ends_at_once():
    """At 50 ms a step (40 ms at the share the rule allows for), 100 tokens take 4 s: with 3.5 s
    left, a waiting request that must produce them all ends now, saying why, while one that
    may stop early waits on, and so do a health probe, one with time enough, and the running
    one (its tokens are on their way). With nothing else running the step time is no guide,
    and nobody is ended."""
    s, clock = make_scheduler(max_num_seqs=1)
    s.step_s = 0.05
    running = add(s, "running", 8, max_tokens=100, deadline=5.5)
    run_step(s)
    clock.now = 2.0
    doomed = add(s, "doomed", 8, max_tokens=100, deadline=5.5)
    may_stop = Request(
        "may-stop",
        list(range(8)),
        SamplingParams(),
        arrival_time=2.0,
        max_tokens=100,
        deadline=5.5,
    )
    s.add_request(may_stop)
    probe = Request(
        "probe",
        [1, 2],
        SamplingParams(ignore_eos=True),
        arrival_time=2.0,
        max_tokens=100,
        deadline=5.5,
        is_probe=True,
    )
    s.add_request(probe)
    patient = add(s, "patient", 8, max_tokens=80, deadline=5.5)  # 3.2 s at the share
    run_step(s)
    assert doomed.finish_reason == "timeout" and not s.kv.block_table("doomed")
    assert doomed.error is not None and doomed.error.startswith(CANNOT_FINISH)
    assert may_stop.finish_reason is None and running.finish_reason is None
    assert probe.finish_reason is None and patient.finish_reason is None
    # Alone, with a step time left from a load that has gone, it is not ended.
    idle, idle_clock = make_scheduler()
    idle.step_s = 0.05
    alone = add(idle, "alone", 8, max_tokens=100, deadline=3.0)
    idle_clock.now = 0.0
    run_step(idle)
    assert alone.finish_reason is None


def test_a_preempted_request_that_has_streamed_tokens_is_not_ended_before_its_deadline():
    s, clock = make_scheduler(max_num_seqs=1)
    s.step_s = 0.05
    first = add(s, "first", 8, max_tokens=100, deadline=20.0)
    run_step(s)
    run_step(s)
    assert first.output_token_ids
    other = add(s, "other", 8, max_tokens=100, priority=-1)
    s._preempt(first, [])  # as when blocks or a better priority need its place
    run_step(s)
    assert other.status is RequestStatus.RUNNING
    clock.now = 16.0  # 100 tokens would take 4 s at the share: no longer in time
    run_step(s)
    assert first.finish_reason is None


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
    # The headroom rule would keep "a" out until "hi" is done: here it is what happens once a
    # preemption has happened that matters, so the rule stands aside.
    s._headroom = lambda: (1 << 30, 0)  # type: ignore[method-assign]
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


def test_worse_priorities_sit_out_steps_past_their_share_and_lose_nothing():
    """A step holds 10 tokens (decodes and prompt tokens cost one each) and the cap lets 4 run.
    Four batch requests decode; an interactive one arrives. It starts although four run (the
    cap counts only its priority and better) and its prompt is prefilled at once; batch work
    fills what is left of half the step, oldest first, and the rest sits out with its blocks,
    never preempted."""
    s, _ = make_scheduler(max_num_batched_tokens=64)
    s.time_budget = FixedStepBudget(tokens=10, cap=4)
    batch = [add(s, f"b{i}", 4, max_tokens=40, priority=10) for i in range(4)]
    batch_ids = {r.request_id for r in batch}
    for _ in range(3):
        run_step(s)
    hi = add(s, "hi", 4, max_tokens=10, priority=0)
    out = run_step(s)
    chunks = {q.request_id: len(q.token_ids) for q in out.sequences}
    assert chunks["hi"] == 4 and hi.status is RequestStatus.RUNNING
    assert set(chunks) - {"hi"} == {"b0"}  # half the step is 5: the prompt's 4, one decode
    out = run_step(s)  # hi decodes: four batch decodes fit beside it in half the step
    assert {q.request_id for q in out.sequences} == {"hi", *batch_ids}
    more = [add(s, f"hi{i}", 4, max_tokens=10, priority=0) for i in range(2)]
    out = run_step(s)  # their prompts first (8 tokens and hi's decode): no room for batch
    assert {q.request_id for q in out.sequences} == {"hi", "hi0", "hi1"}
    out = run_step(s)  # three interactive decodes, two batch ones: the oldest
    assert {q.request_id for q in out.sequences} == {"hi", "hi0", "hi1", "b0", "b1"}
    assert all(r.status is RequestStatus.RUNNING for r in batch)  # paused, blocks kept
    assert all(s.kv.num_held_blocks(r.request_id) > 0 for r in batch)
    assert not out.preempted_request_ids
    assert not any(r.num_preemptions for r in (*batch, hi, *more))


def test_one_priority_alone_is_never_paused():
    s, _ = make_scheduler(max_num_batched_tokens=64)
    s.time_budget = FixedStepBudget(tokens=4, cap=8)
    rs = [add(s, f"r{i}", 4, max_tokens=20) for i in range(8)]
    for _ in range(12):
        run_step(s)
    out = run_step(s)
    assert {q.request_id for q in out.sequences} == {r.request_id for r in rs}


def test_the_victim_of_a_full_pool_is_the_request_that_wants_the_most():
    """Same priority, 16 blocks of 4: a long request (12 + 40 tokens, 13 blocks at its end)
    and three short ones (8 + 12, 5 blocks each) that arrived after it. When blocks run out,
    the long one gives way; the short ones finish without a preemption."""
    s, _ = make_scheduler(blocks=16, block_size=4)
    optimistic(s)
    long = add(s, "long", 12, max_tokens=40)
    shorts = [add(s, f"s{i}", 8, max_tokens=12, first=100 * (i + 1)) for i in range(3)]
    preempted: list[str] = []
    for _ in range(20):
        preempted += run_step(s).preempted_request_ids
    assert preempted and set(preempted) == {"long"}
    assert all(r.status.is_finished and r.num_preemptions == 0 for r in shorts)
    assert long.num_preemptions >= 1


def test_a_request_that_cannot_get_its_blocks_lets_smaller_ones_behind_it_start():
    """14 blocks of 4. A running request will end at 42 tokens (11 blocks); at 28 it holds 7
    and will take 4 more: 3 blocks of headroom. A request of 22 tokens (6 blocks) waits for
    room; a smaller one behind it (2 blocks) starts."""
    s, _ = make_scheduler(blocks=14, block_size=4)
    add(s, "running", 12, max_tokens=30)
    for _ in range(17):
        run_step(s)
    big = add(s, "big", 20, max_tokens=2, first=100)
    small = add(s, "small", 4, max_tokens=2, first=200)
    run_step(s)
    assert big.status is RequestStatus.WAITING
    assert small.status is RequestStatus.RUNNING


def test_a_row_of_requests_waiting_for_room_does_not_hide_a_small_one_behind_it():
    """As above, but a dozen requests of 6 blocks wait for room ahead of the small one, more
    than the scheduler tries past in a step: the small one still starts in the next step."""
    s, _ = make_scheduler(blocks=14, block_size=4)
    add(s, "running", 12, max_tokens=30)
    for _ in range(17):
        run_step(s)
    bigs = [add(s, f"big{i}", 20, max_tokens=2, first=100 * (i + 1)) for i in range(12)]
    small = add(s, "small", 4, max_tokens=2, first=5000)
    run_step(s)
    assert all(b.status is RequestStatus.WAITING for b in bigs)
    assert small.status is RequestStatus.RUNNING


def test_a_request_does_not_start_where_it_could_not_finish_without_a_preemption():
    """The pool would hold both prompts, not both answers: the second waits for the first to
    end rather than start, grow, and have its work thrown away."""
    s, _ = make_scheduler(blocks=8, block_size=4)
    a = add(s, "a", 4, max_tokens=12)  # 16 tokens: 4 blocks
    b = add(s, "b", 4, max_tokens=16, first=100)  # 20 tokens: 5 blocks
    preempted: list[str] = []
    while s.has_unfinished:
        preempted += run_step(s).preempted_request_ids
        if a.status is RequestStatus.RUNNING:
            assert b.status is RequestStatus.WAITING
    assert not preempted and a.finish_reason == b.finish_reason == "length"


def test_a_better_priority_short_of_blocks_preempts_a_worse_one():
    s, _ = make_scheduler(blocks=7, block_size=4)
    lo = add(s, "lo", 8, max_tokens=20, priority=5)
    for _ in range(9):
        run_step(s)  # 16 tokens: 4 blocks held, 3 free
    hi = add(s, "hi", 16, max_tokens=2, priority=0, first=100)  # needs 5 blocks
    out = run_step(s)
    assert out.preempted_request_ids == ["lo"] and lo.status is RequestStatus.PREEMPTED
    assert hi.status is RequestStatus.RUNNING


def test_the_kv_picture_counts_unfilled_slots_and_what_the_queue_needs():
    s, _ = make_scheduler(blocks=16, block_size=4)
    add(s, "a", 5, max_tokens=8)  # 2 blocks, 5 of 8 slots filled once prefilled
    run_step(s)
    add(s, "w", 9, max_tokens=2)
    s.waiting[0].num_preemptions = 0
    picture = s.kv_picture()
    assert picture.allocated_slots == 8
    assert picture.unused_slots == 8 - 5
    assert picture.fragmentation == pytest.approx(3 / 8)
    assert picture.waiting_blocks == 3 and picture.preempted_blocks == 0


def test_batch_paused_for_a_waiting_prompt_does_not_cascade_into_preemptions():
    """Batch work fills the cap; an interactive prompt arrives that takes the whole half step.
    Every batch decode sits that step out: nothing runs but its chunk. That is a pause, not a
    stall: no batch request is preempted for it, and the prompt starts at once."""
    s, _ = make_scheduler(max_num_batched_tokens=64)
    s.time_budget = FixedStepBudget(tokens=10, cap=4)
    batch = [add(s, f"b{i}", 4, max_tokens=40, priority=10) for i in range(4)]
    for _ in range(3):
        run_step(s)
    hi = add(s, "hi", 6, max_tokens=4, priority=0, first=500)
    out = run_step(s)
    assert [q.request_id for q in out.sequences] == ["hi"]
    assert hi.status is RequestStatus.RUNNING and not out.preempted_request_ids
    while not hi.is_finished:
        assert not run_step(s).preempted_request_ids
    assert all(r.status is RequestStatus.RUNNING and r.num_preemptions == 0 for r in batch)


def test_a_short_request_that_finds_the_pool_full_takes_the_place_of_a_long_one():
    """26 blocks of 4. A long request (60 + 8 tokens: 17 blocks) runs, then two short ones
    (4 + 12: 4 blocks each) beside it: the pool is spoken for until the long one ends. Another
    short one arrives. The long one, of no better priority and more than twice as large as it
    and as the typical running request, gives way: the short one runs; the long one waits and
    finishes after."""
    s, _ = make_scheduler(blocks=26, block_size=4)
    long = add(s, "long", 60, max_tokens=8)
    run_step(s)
    shorts = [add(s, f"s{i}", 4, max_tokens=12, first=100 * (i + 1)) for i in range(2)]
    run_step(s)
    assert all(r.status is RequestStatus.RUNNING for r in (*shorts, long))
    short = add(s, "short", 4, max_tokens=12, first=500)
    out = run_step(s)
    assert out.preempted_request_ids == ["long"]
    assert short.status is RequestStatus.RUNNING and long.status is RequestStatus.PREEMPTED
    for _ in range(200):
        if not s.has_unfinished:
            break
        run_step(s)
    assert short.finish_reason == long.finish_reason == "length"


def test_a_health_probe_waits_for_blocks_and_takes_nobodys():
    s, _ = make_scheduler(blocks=4, block_size=4)
    user = add(s, "user", 12, max_tokens=4, priority=5)
    run_step(s)  # 3 blocks held, 4 once it has its answer
    probe = add(s, "probe", 8, max_tokens=1, priority=-(2**31))
    probe.is_probe = True
    out = run_step(s)
    assert not out.preempted_request_ids and user.status is RequestStatus.RUNNING
    assert probe.status is RequestStatus.WAITING
    for _ in range(20):
        if not s.has_unfinished:
            break
        run_step(s)
    assert probe.finish_reason == user.finish_reason == "length"


def test_a_better_priority_takes_a_worse_ones_seat_when_every_seat_is_taken():
    s, _ = make_scheduler(max_num_seqs=2)
    batch = [add(s, f"b{i}", 4, max_tokens=30, priority=10, first=100 * i) for i in range(2)]
    run_step(s)
    hi = add(s, "hi", 4, max_tokens=4, priority=0, first=900)
    out = run_step(s)
    assert hi.status is RequestStatus.RUNNING
    assert len(out.preempted_request_ids) == 1 and out.preempted_request_ids[0] in ("b0", "b1")
    assert sum(r.status is RequestStatus.RUNNING for r in batch) == 1


def test_a_long_request_leaves_the_last_running_slots_to_the_short_ones_behind_it():
    """Eight slots; four short requests run (3 blocks each). A long one (17 blocks) waits
    first in line, a short one behind it: taking one of the last four slots, the long one
    would leave fewer for the short ones, so the short one starts first. Alone in line, or
    once slots are plenty, the long one starts; both finish."""
    s, _ = make_scheduler(blocks=256, block_size=4, max_num_seqs=8)
    shorts = [add(s, f"s{i}", 4, max_tokens=8, first=100 * (i + 1)) for i in range(4)]
    run_step(s)
    long = add(s, "long", 8, max_tokens=60, first=900)
    short = add(s, "short", 4, max_tokens=4, first=990)
    run_step(s)
    assert short.status is RequestStatus.RUNNING and long.status is RequestStatus.WAITING
    run_step(s)
    assert long.status is RequestStatus.RUNNING  # nobody smaller waits behind it now
    for _ in range(200):
        if not s.has_unfinished:
            break
        run_step(s)
    assert all(r.finish_reason == "length" for r in (*shorts, short, long))


def test_a_long_request_is_not_held_back_for_a_worse_prioritys_short_one():
    """As above, but the short request behind the long one is batch work: it could not take
    the slot before the long one anyway, so the long one starts."""
    s, _ = make_scheduler(blocks=256, block_size=4, max_num_seqs=8)
    for i in range(4):
        add(s, f"s{i}", 4, max_tokens=8, first=100 * (i + 1))
    run_step(s)
    long = add(s, "long", 8, max_tokens=60, first=900)
    add(s, "batch", 4, max_tokens=4, priority=10, first=990)
    out = run_step(s)
    assert long.status is RequestStatus.RUNNING and not out.preempted_request_ids


def test_a_larger_request_whose_prompt_is_cached_is_not_passed_over_with_a_smaller_one():
    """A running request holds a 64-token prompt. A waiting one of 16 blocks does not fit; one
    behind it wants 18 blocks, but 16 of them are that running prompt's, cached and shared: it
    needs 2 and starts."""
    s, _ = make_scheduler(blocks=40, block_size=4)
    add(s, "running", 64, max_tokens=40)
    run_step(s)
    run_step(s)
    a = add(s, "a", 56, max_tokens=8, first=1000)
    b = Request(
        "b",
        [*range(64), 7000, 7001, 7002, 7003],
        SamplingParams(ignore_eos=True),
        arrival_time=s.clock(),
        max_tokens=4,
    )
    s.add_request(b)
    assert s.footprint_blocks(b) > s.footprint_blocks(a)
    run_step(s)
    assert a.status is RequestStatus.WAITING
    assert b.status is RequestStatus.RUNNING


def _past_room_scheduler(**cfg) -> tuple[Scheduler, Request]:
    """Three decodes and a 400-token prompt being chunked fill every step's prompt room
    (before that, ``warm`` is served whole, with no time budget)."""
    warm = cfg.pop("warm", None)
    s, _ = make_scheduler(blocks=512, block_size=4, max_num_batched_tokens=256, **cfg)
    if warm is not None:
        s.add_request(warm)
        while not warm.is_finished:
            run_step(s)
    s.time_budget = FixedStepBudget(tokens=4, cap=32)
    for i in range(3):
        add(s, f"d{i}", 4, max_tokens=100, first=1000 * (i + 1))
    for _ in range(4):
        run_step(s)
    long = add(s, "long", 400, max_tokens=4, first=5000)
    run_step(s)
    return s, long


def test_a_short_prompt_starts_past_a_long_prompts_chunks_one_a_step():
    """Three decodes fill a tight time budget and a long prompt is computed a block a step
    (a preempted request's recompute, say). Short prompts arriving start past the full room,
    whole, one a step, and have their first token in that step; the long one keeps its chunk
    every step; a long newcomer does not start past the room."""
    s, long = _past_room_scheduler()
    assert long.status is RequestStatus.RUNNING and 0 < long.num_computed_tokens < 400
    shorts = [add(s, f"s{k}", 12, max_tokens=4, first=7000 + 100 * k) for k in range(2)]
    big = add(s, "big", 40, max_tokens=4, first=9000)
    before = long.num_computed_tokens
    run_step(s)
    assert len(shorts[0].output_token_ids) == 1 and shorts[1].status is RequestStatus.WAITING
    assert long.num_computed_tokens > before
    run_step(s)
    assert len(shorts[1].output_token_ids) == 1
    assert big.status is RequestStatus.WAITING


def test_a_short_prompt_behind_one_waiting_for_room_starts_past_it():
    s, _ = _past_room_scheduler()
    big = add(s, "big", 40, max_tokens=4, first=9000)
    short = add(s, "short", 8, max_tokens=4, first=9500)
    run_step(s)
    assert big.status is RequestStatus.WAITING and len(short.output_token_ids) == 1


def test_a_worse_prioritys_short_prompt_does_not_start_past_the_room():
    s, _ = _past_room_scheduler()
    batch = add(s, "batch", 8, max_tokens=4, priority=10, first=9500)
    run_step(s)
    assert batch.status is RequestStatus.WAITING


def test_nobody_is_preempted_for_a_short_prompt_past_the_room():
    """A batch request holds most of the pool; an interactive long prompt is chunked through a
    tight step. A short interactive prompt that would need the batch request's blocks does not
    start past the full room: that would preempt for a start the step has no room for."""
    s, _ = make_scheduler(blocks=40, block_size=4, max_num_batched_tokens=256)
    s.time_budget = FixedStepBudget(tokens=2, cap=16)
    batch = add(s, "batch", 8, max_tokens=100, priority=10)
    for _ in range(4):
        run_step(s)
    add(s, "long", 32, max_tokens=4, first=5000)
    run_step(s)
    short = add(s, "short", 8, max_tokens=48, first=9000)
    out = run_step(s)
    assert not out.preempted_request_ids and batch.status is RequestStatus.RUNNING
    assert short.status is RequestStatus.WAITING


def test_a_short_prompt_behind_a_dozen_longer_ones_starts_past_the_room():
    s, _ = _past_room_scheduler()
    longer = [add(s, f"l{k}", 20, max_tokens=4, first=20000 + 100 * k) for k in range(12)]
    short = add(s, "short", 8, max_tokens=4, first=90000)
    run_step(s)
    assert len(short.output_token_ids) == 1
    assert all(r.status is RequestStatus.WAITING for r in longer)


def test_a_prompt_with_a_cached_prefix_is_as_short_as_what_it_computes():
    """A 60-token system prompt is cached; a chat request on it has 4 tokens to compute: it
    starts past the room though its prompt is longer than a short one."""
    system = list(range(7000, 7060))  # 15 blocks
    warm = Request("warm", [*system, 1, 2, 3, 4], SamplingParams(ignore_eos=True), 0.0, 4)
    s, _ = _past_room_scheduler(warm=warm)
    chat = Request("chat", [*system, 9, 9, 9, 9], SamplingParams(ignore_eos=True), 1.0, 4)
    s.add_request(chat)
    run_step(s)
    assert len(chat.output_token_ids) == 1


def test_optimistic_admission_preempts_nobody_for_a_start_past_the_room():
    s, _ = make_scheduler(blocks=40, block_size=4, max_num_batched_tokens=256, kv_headroom=False)
    s.time_budget = FixedStepBudget(tokens=2, cap=16)
    batch = add(s, "batch", 100, max_tokens=60, priority=10)
    long = None
    for _ in range(60):
        run_step(s)
        if long is None and s.kv.num_free_blocks <= 10:
            long = add(s, "long", 40, max_tokens=4, first=5000)
        if long is not None and long.status is RequestStatus.RUNNING and not s.kv.num_free_blocks:
            break
    short = add(s, "short", 8, max_tokens=4, first=9000)
    out = run_step(s)
    assert not out.preempted_request_ids and batch.status is RequestStatus.RUNNING
    assert short.status is RequestStatus.WAITING


def test_long_requests_holding_most_of_the_running_set_are_still_the_large_ones():
    """Twelve short requests (2 blocks) have started and ended; three long ones (17 blocks)
    and a short one run on a roomy pool, which then shrinks to what they hold (a fault, as in
    the kv-exhaustion scenario): most of the running set is long. The typical request is still
    the short one (counted by starts, not by who holds the pool), so a short newcomer that
    finds no room takes a long one's place."""
    s, _ = make_scheduler(blocks=256, block_size=4)
    for k in range(12):
        add(s, f"warm{k}", 4, max_tokens=4, first=100 * (k + 1))
    while s.has_unfinished:
        run_step(s)
    longs = [add(s, f"long{k}", 8, max_tokens=60, first=5000 + 100 * k) for k in range(3)]
    add(s, "short", 4, max_tokens=4, first=9000)
    for _ in range(2):
        run_step(s)
    assert all(r.status is RequestStatus.RUNNING for r in longs)
    s.kv.limit = 3 * 17 + 2 + 1
    assert s.typical_footprint == 2
    newcomer = add(s, "newcomer", 4, max_tokens=8, first=9500)
    out = run_step(s)
    assert newcomer.status is RequestStatus.RUNNING
    assert out.preempted_request_ids and out.preempted_request_ids[0].startswith("long")


def test_the_typical_footprint_follows_todays_typical_output():
    """Requests that started before any had finished were projected at their max_tokens; once
    answers turn out short, the typical request is projected as short too."""
    s, _ = make_scheduler(blocks=512, block_size=4)
    for k in range(12):
        r = Request(f"r{k}", [100 * k + 1, 100 * k + 2], SamplingParams(), 0.0, 400)
        s.add_request(r)
    run_step(s)
    assert s.typical_footprint == s.kv.blocks_needed(2 + 400)
    s.typical_output = 4
    assert s.typical_footprint == s.kv.blocks_needed(2 + 4)


def test_only_a_typical_prompt_spends_what_earlier_steps_banked():
    """A step holds 10 tokens, and earlier steps banked 30 more for prompts. A short request's
    prompt is prefilled at once from the bank; a long request's (more than twice the typical
    footprint) gets only the step's own room, and none while a short prompt has taken it: a
    step lengthened by the bank delays every request that arrives meanwhile, and only a short
    prompt repays that with its own first token."""
    s, _ = make_scheduler(blocks=256, max_num_batched_tokens=256)
    for i in range(4):
        add(s, f"d{i}", 4, max_tokens=40, first=100 * i)
    run_step(s)  # four typical requests (11 blocks each) decode from now on
    s.time_budget = FixedStepBudget(tokens=10, cap=8, bank=30)
    short = add(s, "short", 20, max_tokens=4, first=1000)
    long = add(s, "long", 100, max_tokens=40, first=2000)
    out = run_step(s)
    chunks = {q.request_id: len(q.token_ids) for q in out.sequences if not q.is_decode}
    assert chunks == {"short": 20}  # 10 + 30 - 4 decodes: the short prompt whole
    assert long.status is RequestStatus.WAITING  # the step's own room went to it
    out = run_step(s)
    chunks = {q.request_id: len(q.token_ids) for q in out.sequences if not q.is_decode}
    assert chunks == {"long": 10 - 5}  # five decodes (short's too): not 35 from the bank
    out = run_step(s)
    assert {q.request_id: len(q.token_ids) for q in out.sequences}["long"] == 10 - 5
    assert short.status is RequestStatus.RUNNING


def test_a_long_prompt_alone_with_typical_ones_unknown_spends_the_bank():
    """Before any request has started there is no typical one: nobody is large, and a prompt
    spends the bank as every prompt did."""
    s, _ = make_scheduler(blocks=256, max_num_batched_tokens=256)
    s.time_budget = FixedStepBudget(tokens=10, cap=8, bank=30)
    add(s, "long", 100, max_tokens=40)
    out = run_step(s)
    assert [len(q.token_ids) for q in out.sequences] == [40]


def _three_typical_at_a_cap_of_four() -> Scheduler:
    s, _ = make_scheduler(blocks=256, max_num_batched_tokens=256)
    for i in range(3):
        add(s, f"d{i}", 4, max_tokens=40, first=100 * i)
    run_step(s)  # three typical requests (11 blocks each) decode from now on
    s.time_budget = FixedStepBudget(tokens=20, cap=4)
    return s


def test_a_short_request_takes_the_last_seat_from_a_long_prompt_still_prefilling():
    """The last slot under the cap went to a long request while nobody else waited; a short
    one then comes while the long prompt is still being prefilled. The short one starts at
    once in the long one's seat, and the long one (which has streamed nothing) waits."""
    s = _three_typical_at_a_cap_of_four()
    long = add(s, "long", 100, max_tokens=40, first=1000)
    run_step(s)
    assert long.status is RequestStatus.RUNNING and long.num_computed_tokens == 20 - 3
    short = add(s, "short", 8, max_tokens=4, first=2000)
    out = run_step(s)
    chunks = {q.request_id: len(q.token_ids) for q in out.sequences if not q.is_decode}
    assert chunks == {"short": 8}
    assert out.preempted_request_ids == ["long"] and long.num_preemptions == 1
    assert short.status is RequestStatus.RUNNING and len(s.running) == 4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_long_prompt_past_its_half_gives_its_seat_up_only_where_its_blocks_stay_cached(
    prefix_caching,
):
    """Past half of a 100-token prompt, 20 tokens a step: with prefix caching its filled
    blocks stay cached and it loses at most a block's worth, so the short request still takes
    its seat; without, all it computed would be computed again, and it keeps the seat."""
    s = _three_typical_at_a_cap_of_four()
    s.kv.enable_prefix_caching = prefix_caching
    long = add(s, "long", 100, max_tokens=40, first=1000)
    for _ in range(4):
        run_step(s)
    assert long.status is RequestStatus.RUNNING and 50 < long.num_computed_tokens < 100
    filled = long.num_computed_tokens - long.num_computed_tokens % 4  # its full blocks' tokens
    short = add(s, "short", 8, max_tokens=4, first=2000)
    out = run_step(s)
    if prefix_caching:
        assert out.preempted_request_ids == ["long"] and short.status is RequestStatus.RUNNING
        for _ in range(20):
            if long.status is RequestStatus.RUNNING:
                break
            run_step(s)
        # Back, it finds the blocks it had filled in the prefix cache: nothing lost but time.
        assert long.status is RequestStatus.RUNNING and long.num_cached_prompt_tokens == filled
    else:
        assert not out.preempted_request_ids and short.status is RequestStatus.WAITING
        assert long.status is RequestStatus.RUNNING


def test_a_seat_is_taken_only_where_the_short_request_then_starts():
    """The cap fell below what runs (a step ran over), or the pool has no room for the short
    request even in the long one's place: the long one keeps its seat."""
    s = _three_typical_at_a_cap_of_four()
    long = add(s, "long", 100, max_tokens=40, first=1000)
    run_step(s)
    s.time_budget = FixedStepBudget(tokens=20, cap=2)
    short = add(s, "short", 8, max_tokens=4, first=2000)
    out = run_step(s)
    assert not out.preempted_request_ids and short.status is RequestStatus.WAITING
    s.time_budget = FixedStepBudget(tokens=20, cap=4)
    s.kv.limit = sum(s.kv.num_held_blocks(r.request_id) for r in s.running) + 4
    out = run_step(s)
    assert not out.preempted_request_ids and long.status is RequestStatus.RUNNING


def test_a_long_request_gives_its_seat_up_once_and_counts_as_waiting_since_it_came():
    s, clock = make_scheduler(blocks=256, max_num_batched_tokens=256)
    for i in range(3):
        add(s, f"d{i}", 4, max_tokens=40, first=100 * i)
    run_step(s)
    s.time_budget = FixedStepBudget(tokens=20, cap=4)
    clock.now = 5.0
    long = add(s, "long", 200, max_tokens=40, first=1000)
    run_step(s)
    clock.now = 6.0
    short = add(s, "short", 8, max_tokens=4, first=2000)
    out = run_step(s)
    assert out.preempted_request_ids == ["long"] and long.passed_over_since == 5.0
    for _ in range(6):
        run_step(s)  # the short one's answer, then the long one's seat back
    assert short.status is RequestStatus.FINISHED_LENGTH
    assert long.status is RequestStatus.RUNNING
    add(s, "again", 8, max_tokens=4, first=3000)
    out = run_step(s)
    assert not out.preempted_request_ids and long.status is RequestStatus.RUNNING


def test_a_long_request_that_has_streamed_keeps_its_seat():
    s = _three_typical_at_a_cap_of_four()
    long = add(s, "long", 12, max_tokens=100, first=1000)  # 28 blocks: large
    run_step(s)
    assert long.output_token_ids  # its prompt in one step: it streams
    short = add(s, "short", 8, max_tokens=4, first=2000)
    out = run_step(s)
    assert not out.preempted_request_ids and short.status is RequestStatus.WAITING


def test_a_request_held_for_kv_room_is_counted_once_however_long_it_waits():
    """The count a replica reports of requests the pool had no room for: one per request held
    back (not one per step it waits), and none for a request that starts at once."""
    s, _ = make_scheduler(blocks=16, block_size=4)
    big = add(s, "big", 40, max_tokens=8)  # 12 blocks projected, of 16
    run_step(s)
    assert big.status is RequestStatus.RUNNING and s.num_room_waits_total == 0
    other = add(s, "other", 20, max_tokens=8, first=1000)  # 7 blocks: no room beside it
    for _ in range(3):
        run_step(s)
    assert other.status is RequestStatus.WAITING and s.num_room_waits_total == 1
    for _ in range(50):
        if not s.has_unfinished:
            break
        run_step(s)
    assert other.finish_reason == "length" and s.num_room_waits_total == 1


def test_a_request_starts_where_the_running_requests_never_hold_their_footprints_at_once():
    """25 blocks of 4. Three requests will end at 32 tokens (8 blocks each), from prompts of
    24, 16 and 8 tokens: in 8, 16 and 24 steps. A fourth (3 blocks) arrives a step later, when
    they hold 15 blocks and will grow by 9 more: counted at once, that would leave 1 free. But
    the first gives its 8 back before the others have grown by 4: it starts at once, and every
    request finishes without a preemption."""
    s, _ = make_scheduler(blocks=25, block_size=4)
    running = [add(s, f"r{k}", 32 - 8 * k, max_tokens=8 * k, first=100 * k) for k in range(1, 4)]
    run_step(s)
    assert all(r.status is RequestStatus.RUNNING for r in running)
    newcomer = add(s, "new", 4, max_tokens=8, first=900)
    out = run_step(s)
    assert newcomer.status is RequestStatus.RUNNING
    assert not out.preempted_request_ids
    preempted = []
    while s.has_unfinished:
        preempted += run_step(s).preempted_request_ids
    assert preempted == []
    assert all(r.finish_reason == "length" for r in (*running, newcomer))
    assert s.kv.num_free_blocks == 25


def test_what_started_in_the_step_is_counted_again_before_anyone_is_preempted():
    """64 blocks of 4. A long interactive request (4 + 200 tokens) and a short batch one run.
    Two short interactive requests arrive together; the first starts. Its whole footprint
    comes off the step's headroom, which then looks too small for the second: counted again,
    the first gives its blocks back long before the long one peaks, and the second fits. It
    starts, and the batch request keeps its place."""
    s, _ = make_scheduler(blocks=64, block_size=4)
    add(s, "long", 4, max_tokens=200, first=1000)
    batch = add(s, "batch", 4, max_tokens=8, priority=5, first=2000)
    run_step(s)
    first = add(s, "a", 4, max_tokens=36, first=3000)
    second = add(s, "b", 4, max_tokens=16, first=4000)
    out = run_step(s)
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.RUNNING
    assert out.preempted_request_ids == [] and batch.status is RequestStatus.RUNNING


def test_the_time_budget_hears_of_the_best_prioritys_streams_as_they_stand_here():
    """Each step the time budget is told of the decoding requests of the best priority: the
    tokens each streamed on this engine (a resumed stream's carried ones set no pace here),
    when its first came, and how many more it is known to stream (to its max_tokens where it
    runs to them; none where it may end at any token); and how many are about to run. A batch
    stream that runs ahead of them in the list is not asked."""
    s, clock = make_scheduler(blocks=256, max_num_batched_tokens=256)
    budget = FixedStepBudget(tokens=100, cap=8)
    s.time_budget = budget
    add(s, "batch", 4, max_tokens=40, priority=5)
    run_step(s)  # the batch request streams from t=0
    clock.now = 1.0
    resumed = Request(
        "resumed", list(range(200, 204)), SamplingParams(ignore_eos=True), 1.0, max_tokens=30
    )
    for t in (7, 8, 9):  # carried from the replica it streamed on before
        resumed.append_output_token(t)
    s.add_request(resumed)
    s.add_request(Request("eos", list(range(300, 304)), SamplingParams(), 1.0, 30, frozenset({2})))
    run_step(s)  # both prefilled: their first tokens here at t=1
    for now, streamed in [(1.5, 1), (1.6, 2)]:
        clock.now = now
        run_step(s)
        streams, told_at, slots = budget.lent[-1]
        assert told_at == now and slots == 3
        assert sorted(streams, key=lambda p: p.expected_more) == [
            StreamPace(streamed, 1.0, 0),  # eos: it may end at any token
            StreamPace(streamed, 1.0, 30 - 3 - streamed - 1),
        ]
