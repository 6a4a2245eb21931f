"""Random sequences of add / step / abort / finish keep the KV pool's books straight, and no step
reads a position of the KV pool that was not written with that position's token."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from poise.engine.kv_cache import KVCacheManager
from poise.engine.request import Request, RequestStatus, SamplingParams
from poise.engine.scheduler import Scheduler, SchedulerConfig
from stepbudgets import FixedStepBudget

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.kv = KVCacheManager(num_blocks=12, block_size=4)
        self.s = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_preemptions=2),
            self.kv,
            lambda: self.now,
        )
        self.n = 0
        self.ended: Counter[str] = Counter()
        # A fake KV pool: slot -> the token whose K/V a step wrote there.
        self.slots: dict[int, int] = {}

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=10),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
        deadline=st.one_of(st.none(), st.floats(0.5, 20)),
    )
    def add(self, prefix, tail, max_tokens, priority, deadline):
        prompt = prefix + tail
        if self.kv.blocks_needed(len(prompt) + max_tokens) > self.kv.num_blocks:
            return
        self.n += 1
        self.s.add_request(
            Request(
                f"r{self.n}",
                prompt,
                SamplingParams(stop_token_ids=[3]),
                arrival_time=self.now,
                max_tokens=max_tokens,
                priority=priority,
                deadline=None if deadline is None else self.now + deadline,
            )
        )

    @rule(tokens=st.one_of(st.none(), st.integers(1, 20)), cap=st.integers(1, 6))
    def time_budget(self, tokens, cap):
        # The engine's step budget changes between steps.
        self.s.time_budget = None if tokens is None else FixedStepBudget(tokens, cap)

    @rule(token=st.integers(0, 3))
    def step(self, token):
        out = self.s.schedule()
        for seq in out.sequences:
            assert len(seq.block_table) * 4 >= seq.start_position + len(seq.token_ids)
            tokens = [*seq.prompt_token_ids, *seq.output_token_ids]
            for pos in range(seq.start_position):  # the context this step attends to
                slot = seq.block_table[pos // 4] * 4 + pos % 4
                assert self.slots.get(slot) == tokens[pos], f"position {pos} was never written"
            for pos, t in enumerate(seq.token_ids, seq.start_position):
                self.slots[seq.block_table[pos // 4] * 4 + pos % 4] = t
        self.s.update_from_output(out, {q.request_id: token for q in out.sequences if q.sample})
        self.now += 1.0

    @precondition(lambda self: self.s.requests)
    @rule(
        data=st.data(),
        status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
    )
    def end(self, data, status):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        assert self.s.finish_request(rid, status)

    @invariant()
    def books_balance(self):
        for r in self.s.take_finished():
            self.ended[r.request_id] += 1
            assert self.ended[r.request_id] == 1, "a request ended twice"
            assert r.is_finished and not self.kv.block_table(r.request_id)
        holders = self.kv.holders()
        refs = Counter(b for table in holders.values() for b in table)
        free = self.kv.free_block_ids()
        assert len(free) == len(set(free)), "a block is free twice"
        for block in self.kv.blocks:
            assert block.ref_cnt == refs[block.block_id]
            assert (block.ref_cnt == 0) == (block.block_id in free)
        for h, block_id in self.kv.cached_blocks().items():
            assert self.kv.blocks[block_id].block_hash == h
        for rid in holders:
            assert self.s.requests[rid].status is RequestStatus.RUNNING
        for r in self.s.running:
            assert len(holders[r.request_id]) * 4 >= r.num_computed_tokens

    def teardown(self):
        for rid in list(self.s.requests):
            self.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.blocks)


def test_everything_ends_once_and_every_block_comes_back():
    # Drains the machine with steps only: every request must end by itself.
    m = SchedulerMachine()
    for i in range(6):
        m.add(PREFIXES[i % 3], [i % 4] * i, max_tokens=10, priority=i % 3, deadline=None)
    for _ in range(500):
        if not m.s.has_unfinished:
            break
        m.step(token=1)
        m.books_balance()
    assert not m.s.has_unfinished
    assert len(m.ended) == 6
    assert m.kv.num_free_blocks == m.kv.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
