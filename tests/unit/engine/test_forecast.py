"""The slot forecast: when the k-th waiting request gets a running slot."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise.engine.forecast import (
    KVRelease,
    PoolView,
    Running,
    SlotForecaster,
    headroom_by_step,
)


def rs(pairs: list[tuple[int, int]]) -> list[Running]:
    """Running requests of priority 0 from (tokens produced, max_tokens) pairs."""
    return [Running(p, m) for p, m in pairs]


def test_free_slots_mean_no_wait() -> None:
    f = SlotForecaster(max_num_seqs=4)
    f.observe_step(0.05)
    fc = f.forecast(rs([(10, 64), (20, 64)]))
    assert fc.free_slots == 2
    assert fc.wait_s(1) == 0.0 and fc.wait_s(2) == 0.0
    # The third in line waits for the request closest to its end: 64 - 20 steps.
    assert fc.wait_s(3) == pytest.approx(44 * 0.05)


def test_a_cap_still_growing_lets_a_burst_in_two_steps_apiece() -> None:
    """A step-time budget's cap that stands where demand stopped, not where the budget holds:
    a burst beyond it starts one per two steps (admitted as a prompt chunk, counted once it
    decodes); it does not wait for running requests to end (the wait that refused a
    failed-over stream on a replica with room to spare)."""
    f = SlotForecaster(max_num_seqs=64)
    f.observe_step(0.01)
    running = [(2, 16)] * 3
    held = f.forecast(rs(running), max_running=3)
    assert held.wait_s(1) == pytest.approx(14 * 0.01)
    growing = f.forecast(rs(running), max_running=3, cap_grows=True)
    assert growing.wait_s(1) == pytest.approx(2 * 0.01)
    assert growing.wait_s(3) == pytest.approx(6 * 0.01)
    # It may grow as far again as it stands, not further: past that a request waits for
    # running ones to end (the fourth in line: behind three that take the first to end, a
    # cycle on).
    assert growing.wait_s(4) == pytest.approx((14 + 14) * 0.01)
    # Never later than running requests' ends would free slots, and only up to max_num_seqs.
    ending = f.forecast(rs([(15, 16)] * 3), max_running=3, cap_grows=True)
    assert ending.wait_s(7) == pytest.approx(3 * 0.01)  # one step to end, then 2 cycles of 1
    full = f.forecast(rs([(2, 16)] * 64), max_running=64, cap_grows=True)
    assert full.growth_slots == 0 and full.wait_s(1) == pytest.approx(14 * 0.01)


def test_a_synchronised_batch_makes_the_next_request_wait_for_the_whole_wave() -> None:
    """Requests that started together end together: an average start rate would say 'soon'."""
    f = SlotForecaster(max_num_seqs=8)
    f.observe_step(0.06)
    fc = f.forecast(rs([(2, 64)] * 8))
    assert fc.wait_s(1) == pytest.approx(62 * 0.06)
    assert fc.wait_s(8) == pytest.approx(62 * 0.06)
    # The ninth must wait for a slot freed by someone who started after this wave: a cycle on.
    f.observe_finished(64)
    fc = f.forecast(rs([(2, 64)] * 8))
    assert fc.wait_s(9) == pytest.approx((62 + 64) * 0.06)


def test_typical_output_length_tempers_a_huge_max_tokens() -> None:
    f = SlotForecaster(max_num_seqs=1)
    f.observe_step(0.1)
    for _ in range(50):
        f.observe_finished(20)
    fc = f.forecast(rs([(5, 4000)]))
    assert fc.wait_s(1) == pytest.approx(15 * 0.1)
    # Past its typical length a request may end any step now, but not before a step.
    assert f.forecast(rs([(30, 4000)])).wait_s(1) == pytest.approx(0.1)


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 200)), max_size=16),
    st.integers(1, 16),
)
def test_waits_never_decrease_along_the_line(running, max_num_seqs) -> None:
    f = SlotForecaster(max_num_seqs=max(max_num_seqs, len(running)))
    f.observe_step(0.01)
    fc = f.forecast(rs([(min(p, m - 1), m) for p, m in running]))
    waits = [fc.wait_s(k) for k in range(1, 40)]
    assert all(a <= b for a, b in itertools.pairwise(waits))
    assert all(w >= 0 for w in waits)


def test_slots_held_by_a_lower_priority_are_free_to_a_higher_one() -> None:
    """The scheduler preempts batch work for interactive work: a full running set of priority
    10 makes a priority-0 newcomer wait one step at most, a priority-10 one a whole output."""
    f = SlotForecaster(max_num_seqs=2)
    f.observe_step(0.05)
    fc = f.forecast([Running(2, 64, priority=10), Running(4, 64, priority=10)])
    assert fc.preemptible(0) == 2 and fc.preemptible(10) == 0
    assert fc.wait_s(1, 0) == 0.0 and fc.wait_s(2, 0) == 0.0
    assert fc.wait_s(3, 0) == pytest.approx(60 * 0.05)
    assert fc.wait_s(1, 10) == pytest.approx(60 * 0.05)


def test_a_request_that_wants_more_blocks_than_the_pool_has_waits_for_releases() -> None:
    """16-token blocks, 10 free. Two running requests: one of 64 tokens (4 blocks) that will
    grow to 5 and ends in 12 steps, one of 88 (6 blocks) that will grow to 8 in 40 steps. The
    most they will hold above today is 2 blocks, at step 12 (1 + 12/40 of 2, rounded up):
    8 blocks of headroom now, 12 once the first has ended (it gives back 5, the second grows
    by 2 in all), 20 once both have."""
    f = SlotForecaster(max_num_seqs=8)
    f.observe_step(0.02)
    running = [
        Running(produced=4, max_tokens=16, prompt_tokens=60, held_blocks=4),
        Running(produced=8, max_tokens=48, prompt_tokens=80, held_blocks=6),
    ]
    fc = f.forecast(running, pool=PoolView(free_blocks=10, block_size=16))
    assert fc.kv_headroom_blocks == 8
    assert fc.kv_wait_s(8) == 0.0  # a short request fits beside them
    assert fc.kv_wait_s(9) == pytest.approx(12 * 0.02)  # once the first gives back its 5
    assert fc.kv_wait_s(13) == pytest.approx(40 * 0.02)  # once both have
    assert fc.kv_wait_s(20) == pytest.approx(40 * 0.02)
    assert fc.wait_s(1, 0, blocks=9) == pytest.approx(12 * 0.02)  # slots free, blocks not
    assert fc.footprint_blocks(prompt_tokens=200, max_tokens=200) == 25
    # A pool never short (no view of it) never makes anyone wait.
    assert f.forecast(running).kv_wait_s(10_000) == 0.0


def test_the_headroom_is_the_peak_of_projected_use_not_the_sum_of_final_footprints() -> None:
    """Five requests of 2 blocks each, the k-th to grow by k more blocks in 16k steps (a block
    every 16 tokens); 15 blocks free. Their final footprints together would take all 15, but
    they never hold them at once: each gives its blocks back before the others are done. The
    most held above today is 6 blocks, at step 32 (four grown by 2 blocks each, less the 2
    the first gave back): a request of 9 blocks starts now."""
    f = SlotForecaster(max_num_seqs=32)
    f.observe_step(0.01)
    running = [
        Running(produced=1, max_tokens=1 + 16 * k, prompt_tokens=31, held_blocks=2, exact=True)
        for k in range(1, 6)
    ]
    fc = f.forecast(running, pool=PoolView(free_blocks=15, block_size=16))
    assert sum(r.growth for r in fc.kv_releases) == 15
    assert fc.kv_headroom_blocks == 15 - 6
    assert fc.kv_wait_s(9) == 0.0
    # What the running hold and will take, all at their ends at once.
    assert fc.committed_blocks(total=40, free=15) == 40 - 15 + 15
    # Past the headroom, the wait is for the release that makes the room: after step 32 the
    # most held above today is 5 (at step 48: 9 grown, 4 given back).
    assert fc.kv_wait_s(10) == pytest.approx(32 * 0.01)


BLOCK = 4
releases = st.lists(
    # steps left, blocks held (with the rest of the prompt), blocks to grow by, and how far
    # into its last held block its tokens are
    st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 20), st.integers(1, BLOCK)),
    max_size=12,
)


@given(st.integers(0, 200), releases)
def test_the_headroom_curve_is_the_projected_use_step_by_step(free, spec) -> None:
    """Against a step-by-step account of the same projection: at each step every request not
    yet ended holds its blocks and one more each time its tokens (one more a step) fill one,
    up to its end; one that has ended holds nothing. The headroom from step k is the free
    blocks less the most held above today at any step after k."""
    rel = [KVRelease(s, h + g, held=h, tokens=(h - 1) * BLOCK + into) for s, h, g, into in spec]
    curve = headroom_by_step(free, rel, BLOCK)
    horizon = max((r.steps for r in rel), default=0)

    def above_today(step: int) -> int:
        alive = sum(
            min(r.held + r.growth, max(r.held, -(-(r.tokens + step) // BLOCK))) - r.held
            for r in rel
            if r.steps >= step
        )
        return alive - sum(r.held for r in rel if r.steps < step)

    for step, room in curve:
        highest = max((above_today(k) for k in range(step + 1, horizon + 2)), default=0)
        if step == 0:
            highest = max(highest, 0)
        assert room == free - highest
    rooms = [room for _, room in curve]
    assert rooms == sorted(rooms)  # room only grows as requests end
    assert rooms[0] <= free
    assert rooms[0] >= free - sum(r.growth for r in rel)  # never short of the sum's
    assert rooms[-1] == free + sum(r.held for r in rel)


def test_the_headroom_counts_each_request_a_whole_block_at_a_time() -> None:
    """4-token blocks, 20 free. Six requests have just filled their last block and will grow
    by 2 blocks in 8 steps; a seventh, of 10 blocks, ends at the next step. At that step each
    of the six takes a block: 6 above today, though their growth spread evenly over their
    steps would come to 2. After it, they grow by 12 while the seventh's 10 are back: 2."""
    f = SlotForecaster(max_num_seqs=16)
    f.observe_step(0.01)
    six = [Running(produced=4, max_tokens=12, prompt_tokens=8, held_blocks=3, exact=True)] * 6
    seventh = Running(produced=3, max_tokens=4, prompt_tokens=36, held_blocks=10, exact=True)
    fc = f.forecast([*six, seventh], pool=PoolView(free_blocks=20, block_size=4))
    assert [r.held_at(1, 4) - r.held for r in fc.kv_releases if r.steps == 8] == [1] * 6
    assert fc.kv_headroom_blocks == 20 - 6
    assert fc.kv_wait_s(15) == pytest.approx(0.01)  # once the seventh has ended


def test_a_request_past_the_typical_output_is_not_counted_as_ending_now() -> None:
    """With a typical output of 30 tokens, a request 40 tokens in may end any step: its slot is
    forecast as soon as the next step. Its blocks are not counted as room for the others'
    growth then: it is projected to run as long again as a typical request, and to grow."""
    f = SlotForecaster(max_num_seqs=4)
    f.observe_step(0.01)
    for _ in range(50):
        f.observe_finished(30)
    past = Running(produced=40, max_tokens=1000, prompt_tokens=24, held_blocks=4)
    fc = f.forecast([past], pool=PoolView(free_blocks=50, block_size=16))
    assert fc.release_steps == (1,)  # its slot: any step now
    (release,) = fc.kv_releases
    assert release.steps == 30 and release.blocks == -(-(64 + 30) // 16)
    assert fc.kv_headroom_blocks == 50 - (release.blocks - 4)
    # Beside a request that grows by 6 blocks in 96 steps: by step 30 both have grown by 2,
    # and the 4 the past-typical one holds come back only then (counted back at the next
    # step, they would cover the other's growth: 50 - 2).
    growing = Running(produced=10, max_tokens=106, prompt_tokens=22, held_blocks=2, exact=True)
    fc = f.forecast([past, growing], pool=PoolView(free_blocks=50, block_size=16))
    assert fc.kv_headroom_blocks == 50 - 4
    # A prompt still to compute puts its end off by a step per block of it.
    prefilling = Running(
        produced=0, max_tokens=10, prompt_tokens=160, held_blocks=2, uncomputed=128
    )
    (release,) = f.forecast([prefilling], pool=PoolView(50, 16)).kv_releases
    assert release.steps == 10 + 128 // 16 and release.held == 10


def test_the_blocks_of_a_request_the_scheduler_would_preempt_are_room_now() -> None:
    """16-token blocks, 12 free. Three short requests (2 blocks each, all held) and a long
    one of 25 blocks (20 held, 5 owed) run: 12 blocks of headroom (the long one's 20 blocks
    hold its next 110 tokens, and the short ones end in 6 steps), and it ends in 190 steps. A
    short
    newcomer of its priority that needs 14 blocks does not wait for it: the
    scheduler would take its place (more than twice the newcomer's and the typical size). A
    newcomer of its own size does wait, and so does anyone when it may be preempted no more;
    a better priority takes the place of a worse one whatever their sizes."""
    f = SlotForecaster(max_num_seqs=8)
    f.observe_step(0.01)
    pool = PoolView(free_blocks=12, block_size=16)
    shorts = [Running(2, 8, prompt_tokens=16, held_blocks=2, exact=True)] * 3

    def long(priority: int = 0, preemptible: bool = True) -> Running:
        return Running(10, 200, priority, 200, 20, exact=True, preemptible=preemptible)

    fc = f.forecast([*shorts, long()], pool=pool)
    assert fc.kv_headroom_blocks == 12
    assert fc.kv_wait_s(14, priority=0, own=2) == 0.0
    assert fc.wait_s(1, 0, blocks=14, own=2) == 0.0
    assert fc.kv_wait_s(14, priority=0, own=25) > 0  # of its size: waits for room
    assert fc.kv_wait_s(14) > 0  # nobody's own size told: no preemption counted
    protected = f.forecast([*shorts, long(preemptible=False)], pool=pool)
    assert protected.kv_wait_s(14, priority=0, own=2) > 0
    batch = f.forecast([*shorts, long(priority=10)], pool=pool)
    assert batch.kv_wait_s(30, priority=0, own=25) == 0.0
    # Optimistic admission (no headroom rule) makes no room by preemption: none is counted.
    optimistic = f.forecast([*shorts, long()], pool=pool, preempts_for_room=False)
    assert optimistic.kv_wait_s(14, priority=0, own=2) > 0


def test_the_typical_output_tempers_a_footprint() -> None:
    f = SlotForecaster(max_num_seqs=1)
    for _ in range(50):
        f.observe_finished(30)
    fc = f.forecast([], pool=PoolView(free_blocks=100, block_size=16))
    assert fc.footprint_blocks(prompt_tokens=34, max_tokens=4000) == 4  # 34 + 30 tokens
    assert fc.footprint_blocks(prompt_tokens=34, max_tokens=10) == 3


def test_a_request_that_runs_to_max_tokens_is_projected_whole():
    """ignore_eos and nothing else to stop it: its length is known, whatever others produce."""
    f = SlotForecaster(max_num_seqs=4)
    f.observe_step(0.01)
    for _ in range(50):
        f.observe_finished(30)
    pool = PoolView(free_blocks=100, block_size=16)
    fc = f.forecast([Running(10, 200, prompt_tokens=200, held_blocks=14, exact=True)], pool=pool)
    assert fc.release_steps == (190,)  # not the typical 30 - 10
    assert fc.kv_headroom_blocks == 100 - (25 - 14)
    assert fc.footprint_blocks(200, 200, exact=True) == 25
    assert fc.footprint_blocks(200, 200) == 15  # 200 + a typical 30


def test_a_request_runs_its_output_at_the_step_time_and_a_short_pool_holds_one_long_one():
    """A request to run to 200 tokens needs 200 steps; one that may end early needs its
    typical output. How many long requests (25 blocks) fit at once counts the headroom and
    what the long ones running give back, not the short ones' blocks, which new short
    requests take again."""
    f = SlotForecaster(max_num_seqs=32)
    f.observe_step(0.05)
    for _ in range(50):
        f.observe_finished(30)
    pool = PoolView(free_blocks=30, block_size=16)
    shorts = [Running(10, 30, prompt_tokens=24, held_blocks=3, exact=True)] * 20
    fc = f.forecast(shorts, pool=pool, typical_footprint=4)
    assert fc.run_s(200, exact=True) == pytest.approx(200 * 0.05)
    assert fc.run_s(200) == pytest.approx(30 * 0.05)
    assert fc.kv_headroom_blocks == 30 - 20 * 1
    # 10 blocks of headroom less 16 left to four typical ones: not even one, yet at least one.
    assert fc.fit_together(25) == 1
    # The 60 blocks the short ones give back are not counted; a long one's 25 are.
    long = Running(10, 200, prompt_tokens=200, held_blocks=14, exact=True)
    roomy = f.forecast(
        [*shorts, long], pool=PoolView(free_blocks=100, block_size=16), typical_footprint=4
    )
    # The short ones end in 20 steps, each a block larger, by when the long one has taken one
    # more block (230 tokens).
    assert roomy.kv_headroom_blocks == 100 - (20 + 1)
    assert roomy.fit_together(25) == (69 + 25 - 16) // 25
    # In a burst that drains (no new short requests), what the short ones give back counts.
    assert roomy.fit_together(25, retaken=False) == (69 + 25 + 20 * 4 - 16) // 25
    # While nothing runs the step time is that of a load gone: no run time is promised.
    assert f.forecast([], pool=pool).run_s(200, exact=True) == 0.0
