"""SchedulerOutput → one forward pass over the batch → one sampled token per finished chunk.

Owns the KV pool's tensors (one K and one V tensor per layer, ``(kv_heads, num_blocks *
block_size, head_dim)``, allocated and zeroed once at start so running out of memory shows at
start, not mid-request) and what seeds each sampled row's draw (``draw_seed``). Builds the flat
batch: decode tokens first (one per sequence), then prefill chunks, and the cache slots each
token reads and writes, from the block tables the scheduler handed over. With the native decode
kernel all decode sequences form one bucket read in place; without it they are sorted by context
length and cut into buckets of ``DECODE_BUCKET`` so each bucket pads only to its own longest
context. In the deterministic mode every token, prompt chunks' too, is a row of that bucket.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from poise.engine.guided import GuidedMatchers, StepMasks, apply_grammar
from poise.engine.kernels import PagedDecodeAttention
from poise.engine.models.attention import (
    AttentionMetadata,
    AttentionView,
    DecodeBucket,
    PrefillChunk,
)
from poise.engine.models.llama import LlamaForCausalLM
from poise.engine.sampler import Sampled, SampleRow, sample
from poise.engine.scheduler import ScheduledSequence, SchedulerOutput

DECODE_BUCKET = 16


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a request's draw at output ``position``: (seed, position) mixed by
    a hash, so that neighbouring seeds or positions give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled: dict[str, Sampled]  # request id -> its new token, for sequences that sampled
    guided_ended: frozenset[str] = frozenset()  # their grammar is complete: they stop
    guided_failed: dict[str, str] = field(default_factory=dict)  # request id -> why


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
        decode_kernel: PagedDecodeAttention | None = None,
        guided: GuidedMatchers | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.guided = guided
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.eos = eos_token_ids
        c = model.config
        group = c.num_heads // c.num_kv_heads
        if decode_kernel is not None and not decode_kernel.supports(
            self.dtype, self.device, group, c.head_dim
        ):
            decode_kernel = None
        # None here in the deterministic mode cannot happen: the engine refuses it at load.
        self.decode_kernel = decode_kernel
        self.windows = sorted(set(c.layer_windows), key=lambda w: -1 if w is None else w)
        slots = num_blocks * block_size
        shape = (c.num_kv_heads, slots, c.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]
        self._default_generator = torch.Generator(device="cpu").manual_seed(seed)
        self.deterministic = deterministic
        self._seeds: dict[str, int] = {}  # unseeded requests' own seeds (deterministic mode)

    def _generator(self, seq: ScheduledSequence) -> torch.Generator:
        """A seeded request's draw for its output position ``p`` comes from (seed, p) alone:
        the same wherever and whenever it is drawn, so a request preempted, resumed on another
        replica or batched differently draws what it would have. Unseeded requests share one
        stream, unless the mode is deterministic: then each gets a seed of its own, once."""
        seed = seq.sampling.seed
        if seed is None and self.deterministic:
            seed = self._seeds.get(seq.request_id)
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._default_generator))
                self._seeds[seq.request_id] = seed
        if seed is None:
            return self._default_generator
        return torch.Generator(device="cpu").manual_seed(draw_seed(seed, len(seq.output_token_ids)))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._seeds.pop(rid, None)
        if self.guided is not None:
            self.guided.forget(request_ids)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _decode_bucket(
        self, seqs: list[ScheduledSequence], token_start: int, window: int | None
    ) -> DecodeBucket:
        return self._bucket(
            [(s.block_table, s.start_position + 1, 1) for s in seqs], token_start, window
        )

    def _bucket(
        self, entries: list[tuple[list[int], int, int]], token_start: int, window: int | None
    ) -> DecodeBucket:
        """One query token per row: ``entries`` of (block table, context length of the first
        row, rows), a run of rows reading one table with contexts one longer each."""
        bs = self.block_size
        ctx = torch.cat([torch.arange(c, c + n) for _, c, n in entries])
        starts = (ctx - window).clamp(min=0) if window is not None else torch.zeros_like(ctx)
        width = -(-int(ctx.max()) // bs)
        tables = torch.zeros(len(ctx), width, dtype=torch.long)
        row = 0
        for table, _, n in entries:
            tables[row : row + n, : min(width, len(table))] = torch.tensor(table[:width])
            row += n
        windowed = bool(starts.any())
        if self.decode_kernel is not None:
            return DecodeBucket(
                token_start, len(ctx), tables, ctx, starts if windowed else None, None, None
            )
        span = int((ctx - starts).max())
        pos = starts.unsqueeze(1) + torch.arange(span).unsqueeze(0)  # (n, span)
        padding = pos >= ctx.unsqueeze(1)
        pos = pos.masked_fill(padding, 0)
        slots = tables.gather(1, pos // bs) * bs + pos % bs
        slots = slots.masked_fill(padding, 0)
        masked = padding.to(self.device) if bool(padding.any()) else None
        return DecodeBucket(
            token_start,
            len(ctx),
            tables.to(self.device),
            ctx.to(self.device),
            starts.to(self.device) if windowed else None,
            slots.to(self.device),
            masked,
        )

    def _prefill_chunk(
        self, s: ScheduledSequence, slots: torch.Tensor, token_start: int, window: int | None
    ) -> PrefillChunk:
        """``slots``: the cache slots of positions [0, start + n); the window reads a suffix."""
        n, start = len(s.token_ids), s.start_position
        lo = max(0, start - window + 1) if window is not None else 0
        context = slots[lo:]
        mask = None
        if start or (window is not None and n > window):
            q_pos = torch.arange(start, start + n).unsqueeze(1)
            k_pos = torch.arange(lo, start + n).unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            mask = visible.to(self.device)
        return PrefillChunk(token_start, n, context.to(self.device), mask)

    def _view(
        self,
        decodes: list[ScheduledSequence],
        prefills: list[ScheduledSequence],
        prefill_slots: list[torch.Tensor],
        window: int | None,
    ) -> AttentionView:
        if self.deterministic:
            # Every token, prompt chunks' too, by the kernel's one reduction order: a token's
            # attention is the same decoded or prefilled, alone or in any company.
            entries = [(s.block_table, s.start_position + 1, 1) for s in decodes]
            entries += [(s.block_table, s.start_position + 1, len(s.token_ids)) for s in prefills]
            return AttentionView([self._bucket(entries, 0, window)], [])
        per_bucket = len(decodes) if self.decode_kernel is not None else DECODE_BUCKET
        buckets = [
            self._decode_bucket(decodes[start : start + per_bucket], start, window)
            for start in range(0, len(decodes), max(per_bucket, 1))
        ]
        chunks: list[PrefillChunk] = []
        offset = len(decodes)
        for s, slots in zip(prefills, prefill_slots, strict=True):
            chunks.append(self._prefill_chunk(s, slots, offset, window))
            offset += len(s.token_ids)
        return AttentionView(buckets, chunks)

    def _metadata(
        self, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence]
    ) -> AttentionMetadata:
        bs = self.block_size
        positions: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        if decodes:
            pos = [s.start_position for s in decodes]
            positions.append(torch.tensor(pos))
            writes.append(
                torch.tensor(
                    [
                        s.block_table[p // bs] * bs + p % bs
                        for s, p in zip(decodes, pos, strict=True)
                    ]
                )
            )
        prefill_slots: list[torch.Tensor] = []  # each prefill's slots from position 0
        for s in prefills:
            n, start = len(s.token_ids), s.start_position
            positions.append(torch.arange(start, start + n))
            prefill_slots.append(self._slots(s.block_table, 0, start + n))
            writes.append(prefill_slots[-1][start:])
        flat_positions = torch.cat(positions)
        rope_lens = seq_lens = None
        if self.model.rope_length_dependent:
            # The lengths the rotation reads, per token: see models/rope.py.
            prompt, total = [], []
            for s in decodes:
                prompt.append(len(s.prompt_token_ids))
                total.append(len(s.prompt_token_ids) + len(s.output_token_ids))
            for s in prefills:
                prompt += [len(s.prompt_token_ids)] * len(s.token_ids)
                total += [len(s.prompt_token_ids) + len(s.output_token_ids)] * len(s.token_ids)
            rope_lens = torch.maximum(flat_positions + 1, torch.tensor(prompt)).to(self.device)
            seq_lens = torch.tensor(total).to(self.device)
        logits_at: list[int] = [i for i, s in enumerate(decodes) if s.sample]
        offset = len(decodes)
        for s in prefills:
            offset += len(s.token_ids)
            if s.sample:
                logits_at.append(offset - 1)
        return AttentionMetadata(
            positions=flat_positions.to(self.device),
            slot_mapping=torch.cat(writes).to(self.device),
            rope_lens=rope_lens,
            seq_lens=seq_lens,
            views={w: self._view(decodes, prefills, prefill_slots, w) for w in self.windows},
            block_size=self.block_size,
            decode_kernel=self.decode_kernel,
            logits_indices=torch.tensor(logits_at, dtype=torch.long, device=self.device),
        )

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.forget(out.finished_request_ids)
        decodes = sorted(
            (s for s in out.sequences if len(s.token_ids) == 1), key=lambda s: s.start_position
        )
        prefills = [s for s in out.sequences if len(s.token_ids) > 1]
        ordered = decodes + prefills
        meta = self._metadata(decodes, prefills)
        input_ids = torch.tensor(
            [t for s in ordered for t in s.token_ids], dtype=torch.long, device=self.device
        )
        sampling = [s for s in decodes if s.sample] + [s for s in prefills if s.sample]
        # The grammar masks are computed in the worker thread while the forward pass runs.
        pending = None
        if self.guided is not None:
            pending = self.guided.begin_masks([(i, s.request_id) for i, s in enumerate(sampling)])
        logits = self.model(input_ids, meta, self.kv_caches)
        masks = StepMasks() if pending is None else pending.result()
        rows = [
            SampleRow(s.sampling, s.prompt_token_ids, s.output_token_ids, self._generator(s))
            for s in sampling
        ]
        results = sample(apply_grammar(logits, masks).cpu(), rows, self.eos)
        sampled = {s.request_id: r for s, r in zip(sampling, results, strict=True)}
        if pending is None:
            return RunnerOutput(sampled)
        assert self.guided is not None
        ended, failed = set(), dict(masks.failed)
        for rid, result in sampled.items():
            if rid in failed:
                continue
            verdict = self.guided.consume(rid, result.token_id)
            if verdict == "ended":
                ended.add(rid)
            elif verdict is not None:
                failed[rid] = verdict
        return RunnerOutput(sampled, frozenset(ended), failed)
