"""SchedulerOutput → one forward pass over the batch → one sampled token per finished chunk.

Owns the KV pool's tensors (one K and one V tensor per layer, ``(num_blocks * block_size,
kv_heads, head_dim)``, allocated and zeroed once at start so running out of memory shows at
start, not mid-request) and the per-request random generators. Builds the flat batch: decode
tokens first (one per sequence), then prefill chunks, and the cache slots each token reads and
writes, from the block tables the scheduler handed over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poise.engine.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillChunk
from poise.engine.sampler import Sampled, SampleRow, sample
from poise.engine.scheduler import ScheduledSequence, SchedulerOutput


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled: dict[str, Sampled]  # request id -> its new token, for sequences that sampled


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
    ) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.eos = eos_token_ids
        c = model.config
        slots = num_blocks * block_size
        self.kv_caches = [
            (
                torch.zeros(
                    slots, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device
                ),
                torch.zeros(
                    slots, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device
                ),
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

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _metadata(
        self, decodes: list[ScheduledSequence], prefills: list[ScheduledSequence]
    ) -> AttentionMetadata:
        bs = self.block_size
        positions: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        decode_slots = decode_mask = None
        if decodes:
            ctx = torch.tensor([s.start_position + 1 for s in decodes])
            max_ctx = int(ctx.max())
            width = -(-max_ctx // bs)
            tables = torch.zeros(len(decodes), width, dtype=torch.long)
            for i, s in enumerate(decodes):
                tables[i, : len(s.block_table)] = torch.tensor(s.block_table[:width])
            pos = torch.arange(max_ctx)
            decode_slots = tables[:, pos // bs] * bs + pos % bs  # (d, max_ctx)
            valid = pos.unsqueeze(0) < ctx.unsqueeze(1)
            decode_slots = decode_slots.masked_fill(~valid, 0)
            decode_mask = valid[:, None, None, :].to(self.device)
            decode_slots = decode_slots.to(self.device)
            positions.append(ctx - 1)
            writes.append(decode_slots.gather(1, (ctx - 1).unsqueeze(1)).squeeze(1).cpu())
        chunks: list[PrefillChunk] = []
        offset = len(decodes)
        for s in prefills:
            n, start = len(s.token_ids), s.start_position
            context = self._slots(s.block_table, 0, start + n)
            mask = None
            if start:
                q_pos = torch.arange(start, start + n).unsqueeze(1)
                mask = (torch.arange(start + n).unsqueeze(0) <= q_pos).to(self.device)
            chunks.append(PrefillChunk(offset, n, context.to(self.device), mask))
            positions.append(torch.arange(start, start + n))
            writes.append(context[start:])
            offset += n
        logits_at: list[int] = [i for i, s in enumerate(decodes) if s.sample]
        offset = len(decodes)
        for s in prefills:
            offset += len(s.token_ids)
            if s.sample:
                logits_at.append(offset - 1)
        return AttentionMetadata(
            positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(writes).to(self.device),
            num_decode=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=chunks,
            logits_indices=torch.tensor(logits_at, dtype=torch.long, device=self.device),
        )

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.forget(out.finished_request_ids)
        decodes = [s for s in out.sequences if len(s.token_ids) == 1]
        prefills = [s for s in out.sequences if len(s.token_ids) > 1]
        ordered = decodes + prefills
        meta = self._metadata(decodes, prefills)
        input_ids = torch.tensor(
            [t for s in ordered for t in s.token_ids], dtype=torch.long, device=self.device
        )
        logits = self.model(input_ids, meta, self.kv_caches)
        sampling = [s for s in decodes if s.sample] + [s for s in prefills if s.sample]
        rows = [SampleRow(s.sampling, s.output_token_ids, self._generator(s)) for s in sampling]
        results = sample(logits.cpu(), rows, self.eos)
        return RunnerOutput({s.request_id: r for s, r in zip(sampling, results, strict=True)})
