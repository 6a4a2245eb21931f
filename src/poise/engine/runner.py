"""SchedulerOutput → one forward pass over the batch → one sampled token per finished chunk.

Owns the KV pool's tensors (one K and one V tensor per layer, ``(kv_heads, num_blocks *
block_size, head_dim)``, allocated and zeroed once at start so running out of memory shows at
start, not mid-request) and the per-request random generators. Builds the flat batch: decode
tokens first (one per sequence), then prefill chunks, and the cache slots each token reads and
writes, from the block tables the scheduler handed over. With the native decode kernel all
decode sequences form one bucket read in place; without it they are sorted by context length and
cut into buckets of ``DECODE_BUCKET`` so each bucket pads only to its own longest context.
"""

from __future__ import annotations

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
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, seq: ScheduledSequence) -> torch.Generator:
        if seq.sampling.seed is None:
            return self._default_generator
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device="cpu").manual_seed(seq.sampling.seed)
            self._generators[seq.request_id] = gen
        return gen

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
        if self.guided is not None:
            self.guided.forget(request_ids)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _decode_bucket(
        self, seqs: list[ScheduledSequence], token_start: int, window: int | None
    ) -> DecodeBucket:
        bs = self.block_size
        ctx = torch.tensor([s.start_position + 1 for s in seqs])
        starts = (ctx - window).clamp(min=0) if window is not None else torch.zeros_like(ctx)
        width = -(-int(ctx.max()) // bs)
        tables = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : min(width, len(s.block_table))] = torch.tensor(s.block_table[:width])
        windowed = bool(starts.any())
        if self.decode_kernel is not None:
            return DecodeBucket(
                token_start, len(seqs), tables, ctx, starts if windowed else None, None, None
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
            len(seqs),
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
