import pytest

from poise.engine.kv_cache import KVCacheManager, kv_bytes_per_token, num_blocks_for_budget
from poise.engine.request import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_time=0.0, max_tokens=8)


def test_kv_formula_matches_spec():
    # w0 in bfloat16: 2 * 8 layers * 4 kv heads * 64 dims * 2 bytes
    assert kv_bytes_per_token(8, 4, 64, 2) == 8192
    assert num_blocks_for_budget(1 << 20, 16, 8192) == 8


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == 1
    b = req("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)  # needs 2, only 1 free
    assert kv.num_free_blocks == 1 and kv.block_table("b") == []
    kv.free(a)
    assert kv.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 2
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits = kv.get_computed_blocks(b)
    assert hits == kv.block_table("a")[:2]
    assert kv.allocate_slots(b, 2, hits)
    assert [kv.blocks[i].ref_cnt for i in hits] == [2, 2]
    kv.free(a)
    assert [kv.blocks[i].ref_cnt for i in hits] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert kv.num_cached_blocks == 2  # content survives in free blocks


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = req("b", list(range(8)))
    assert len(kv.get_computed_blocks(b)) == 1  # the last block is recomputed for logits


def test_eviction_is_lru_and_uncached_blocks_go_first():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])  # one full (cached) block and one partial
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    full, partial = kv.block_table("a")
    kv.free(a)
    order = kv.free_block_ids()
    assert order.index(partial) < order.index(full)
    c = req("c", [9, 9, 9, 9, 9, 9])  # takes all three: the cached one is evicted last
    kv.allocate_slots(c, 6)
    assert kv.num_cached_blocks == 0


def test_hash_collision_is_not_a_hit():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    block_id = kv.block_table("a")[0]
    kv.blocks[block_id].token_ids = (7, 7)  # as if different content had the same hash
    assert kv.get_computed_blocks(req("b", [1, 2, 3])) == []


def test_double_free_is_detected():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = req("a", [1, 2])
    kv.allocate_slots(a, 2)
    kv.blocks[kv.block_table("a")[0]].ref_cnt = 0
    with pytest.raises(RuntimeError, match="freed more often"):
        kv.free(a)


def test_only_blocks_wholly_computed_are_cached():
    # The lookup hashes every full block of the prompt; a chunk that ends mid-block must not
    # register that block, whose last slots hold no K/V yet (issue 17, item 9).
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(16)))
    assert kv.get_computed_blocks(a) == []
    assert len(a.block_hashes) == 3
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 1
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 2


def test_a_limit_shrinks_the_pool_without_taking_what_is_held():
    """Fault injection: at most ``limit`` blocks held. Blocks held past it stay held; nothing
    more is taken until usage is back under it; lifting it gives the pool back."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(24)))
    assert kv.allocate_slots(a, 24)  # 6 blocks held
    kv.limit = 4  # below what is held
    assert kv.capacity == 4 and kv.num_free_blocks == 0 and kv.usage == 1.0
    b = req("b", list(range(100, 104)))
    assert not kv.allocate_slots(b, 4)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    assert kv.allocate_slots(b, 4) and kv.usage == pytest.approx(1 / 4)
    c = req("c", list(range(200, 216)))
    assert not kv.allocate_slots(c, 16)  # 4 more would pass the limit (1 + 4 > 4)
    kv.limit = None
    assert kv.capacity == 10 and kv.num_free_blocks == 9 and kv.allocate_slots(c, 16)


def test_the_blocks_a_preemption_would_free_are_those_nobody_else_holds():
    """What the scheduler counts as made by preempting requests: a prefix block another
    request also holds stays taken; two that share it free it together; under a limit the
    pool is held past, what they give back only brings it under."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 2, hits)  # a: 3 blocks, b: the 2 shared and 1 of its own
    assert kv.num_free_blocks == 4
    assert kv.num_free_blocks_without(frozenset({"a"})) == 4 + 1
    assert kv.num_free_blocks_without(frozenset({"b"})) == 4 + 1
    assert kv.num_free_blocks_without(frozenset({"a", "b"})) == 8
    kv.limit = 2  # 4 held, 2 past it
    assert kv.num_free_blocks == 0
    assert kv.num_free_blocks_without(frozenset({"a"})) == 0  # 3 held: still past
    assert kv.num_free_blocks_without(frozenset({"a", "b"})) == 2
