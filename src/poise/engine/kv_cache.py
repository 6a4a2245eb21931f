"""The paged KV cache's bookkeeping: which block of the preallocated pool holds what.

The tensors themselves live in the runner; this module only hands out block ids. Blocks are
reference counted (a prefix-cache hit shares a block between requests). A block whose count
drops to zero goes back to the free queue but keeps its content hash, so a later request with
the same prefix can take it back; allocation evicts free blocks least-recently-freed first.

Prefix caching keys a *full* block by a chained hash of (parent block's hash, this block's token
ids), so equal hashes imply equal prefixes; the stored token ids are compared on lookup to guard
against hash collisions.

Under sliding-window attention on every layer (``sliding_window``), a block whose tokens every
future query is past the window of is given back while its request runs
(``free_out_of_window``); its place in the block table becomes ``NULL_BLOCK``, never read again.
A request whose rotary embedding depends on its prompt's length carries a ``cache_salt`` that
roots its hash chain, so it shares blocks only with requests whose keys were rotated alike.

The scheduler talks to this class in query/commit pairs: ``get_computed_blocks`` (query, no
change) then ``allocate_slots`` (commit, all or nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from poise.engine.request import Request

NULL_BLOCK = -1  # a block-table entry given back under a sliding window


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: int) -> int:
    """SPEC formula 3 per token: K and V, for every layer and KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_size


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks a memory budget holds."""
    return budget_bytes // (block_size * bytes_per_token)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set only while this block is the cache's entry for it
    token_ids: tuple[int, ...] = ()  # content, kept for the collision check
    parent_hash: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class KVCacheManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    sliding_window: int | None = None  # every layer's window, when all have one
    # At most this many blocks held at once (fault injection: a pool that shrinks under its
    # load); None: the whole pool. Blocks held past it stay held; none is taken until under.
    limit: int | None = None
    blocks: list[Block] = field(init=False)
    # Blocks nobody references, in eviction order (front goes first).
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[int, int] = field(init=False)  # block hash -> block id
    _tables: dict[str, list[int]] = field(init=False)
    stats: PrefixCacheStats = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}
        self._tables = {}
        self.stats = PrefixCacheStats()

    # ----- queries -----
    @property
    def capacity(self) -> int:
        """Blocks that may be held at once: the pool, or ``limit`` while it is set."""
        return self.num_blocks if self.limit is None else min(self.num_blocks, self.limit)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that may be taken: free ones, no more than ``limit`` leaves."""
        return self._available(len(self._free))

    def _available(self, free: int) -> int:
        if self.limit is None:
            return free
        held = self.num_blocks - free
        return max(0, min(free, self.limit - held))

    def num_free_blocks_without(self, request_ids: frozenset[str]) -> int:
        """``num_free_blocks`` once these requests have given their blocks back: a block
        another request also holds (a shared prefix) stays taken, and under ``limit`` a pool
        held past it frees nothing until it is back under."""
        drops: dict[int, int] = {}
        for rid in request_ids:
            for b in self._tables.get(rid, ()):
                if b != NULL_BLOCK:
                    drops[b] = drops.get(b, 0) + 1
        freed = sum(1 for b, n in drops.items() if self.blocks[b].ref_cnt <= n)
        return self._available(len(self._free) + freed)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Share of the pool referenced by live requests (free cached blocks count as free);
        of the blocks ``limit`` leaves, while it is set."""
        held = self.num_blocks - len(self._free)
        return min(1.0, held / max(1, self.capacity))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's table holds (those given back under a sliding window not)."""
        table = self._tables.get(request_id, ())
        if self.sliding_window is None:
            return len(table)
        return sum(1 for b in table if b != NULL_BLOCK)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free_block_ids(self) -> list[int]:
        """Unreferenced blocks in eviction order (front first)."""
        return list(self._free)

    def cached_blocks(self) -> dict[int, int]:
        """Prefix-cache entries: block hash -> block id."""
        return dict(self._cached)

    def holders(self) -> dict[str, list[int]]:
        """Every live block table, for invariant checks and debugging."""
        return {rid: [b for b in t if b != NULL_BLOCK] for rid, t in self._tables.items()}

    def _hash_full_blocks(self, request: Request, upto_tokens: int) -> list[int]:
        """Extend request.block_hashes to cover the full blocks among its first tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        n_full = upto_tokens // bs
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hash((parent, tuple(request.all_token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def _lookup(self, block_hash: int, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tokens or block.parent_hash != parent:
            return None  # a hash collision: different content under the same hash
        return block_id

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks that prefixes this request's tokens.

        At least one token is always left to compute, so the model produces logits to sample.
        Changes nothing but the request's hash list; the caller records the lookup in the
        hit-rate counters once the request is admitted (``record_lookup``).
        """
        if not self.enable_prefix_caching:
            return []
        usable = request.num_tokens - 1
        hashes = self._hash_full_blocks(request, usable)
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(hashes[: usable // bs]):
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            block_id = self._lookup(h, hashes[i - 1] if i else request.cache_salt, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    # ----- commits -----
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; all or nothing.

        ``computed_blocks`` (only on a request's admission) are prefix-cache hits to adopt; the
        caller then counts their tokens as computed.
        """
        computed_blocks = computed_blocks or []
        table = self._tables.get(request.request_id, [])
        if computed_blocks and table:
            raise RuntimeError(f"{request.request_id} already holds blocks")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if need + reclaimed > self._available(len(self._free)):
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1
        new_table = table + computed_blocks
        for _ in range(max(need, 0)):
            new_table.append(self._take_free_block())
        self._tables[request.request_id] = new_table
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
        block.ref_cnt = 1
        return block_id

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        Only blocks wholly below ``num_computed_tokens``: the lookup hashed every full block of
        the prompt, and a chunk that ends mid-block leaves the rest of its last block unwritten.
        Registered, that block would be adopted by a later request with the same prefix (or by
        this one, back from preemption) and its unwritten slots read as K/V.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        hashes = self._hash_full_blocks(request, request.num_computed_tokens)
        bs = self.block_size
        for i in range(min(request.num_computed_tokens // bs, len(table))):
            if table[i] == NULL_BLOCK:
                continue
            block = self.blocks[table[i]]
            if block.block_hash is not None or hashes[i] in self._cached:
                continue
            block.block_hash = hashes[i]
            block.parent_hash = hashes[i - 1] if i else request.cache_salt
            block.token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self._cached[hashes[i]] = block.block_id

    def free(self, request: Request) -> None:
        """Give back every block the request holds. Idempotent."""
        table = self._tables.pop(request.request_id, None)
        if not table:
            return
        # Tail blocks are the least likely to be shared, so they are evicted first.
        for block_id in reversed(table):
            if block_id != NULL_BLOCK:
                self._release(block_id)

    def free_out_of_window(self, request: Request) -> int:
        """Give back the blocks no future query of the request can see; how many went back.

        The next token computed sits at ``num_computed_tokens`` and sees keys after
        ``num_computed_tokens - sliding_window``; blocks wholly before that are done with.
        """
        table = self._tables.get(request.request_id)
        if self.sliding_window is None or not table:
            return 0
        first_needed = request.num_computed_tokens - self.sliding_window + 1
        freed = 0
        for i in range(min(max(first_needed, 0) // self.block_size, len(table))):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK
                freed += 1
        return freed

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block_id} freed more often than taken")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                # Nothing to keep in it: reuse it before any cached block.
                self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = ()
            block.parent_hash = None
            del self._cached[block_hash]
