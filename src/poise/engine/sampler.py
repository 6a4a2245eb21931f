"""Logits → next tokens, one row per sequence that samples this step.

Greedy rows are one argmax over the batch. Every other row samples with its own generator:
seeded requests own a ``torch.Generator`` seeded once, so the same seed and input give the same
tokens whatever else shares the batch; unseeded ones draw from the runner's generator.
Logprobs are those of the model's raw distribution, before penalties and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from poise.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRow:
    sampling: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    # Chosen token's logprob first, then the top alternatives; None unless asked for.
    logprobs: dict[int, float] | None


def _apply_penalties(logits: torch.Tensor, sp: SamplingParams, output: list[int]) -> None:
    if not output or (sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0):
        return
    counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])[
        : logits.shape[-1]
    ].to(logits.dtype)
    logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_stops(
    logits: torch.Tensor, sp: SamplingParams, output: list[int], eos: frozenset[int]
) -> None:
    """Before min_tokens, end-of-sequence and stop tokens cannot be drawn."""
    if len(output) >= sp.min_tokens:
        return
    banned = [t for t in (*eos, *sp.stop_token_ids) if t < logits.shape[-1]]  # type: ignore[misc]
    if banned:
        logits[banned] = float("-inf")


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass strictly before it already reaches top_p.
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], eos: frozenset[int]) -> list[Sampled]:
    """logits: (S, vocab) float32, one row per entry of ``rows``."""
    raw_logprobs = None
    if any(r.sampling.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    processed = logits
    needs_processing = [
        i
        for i, r in enumerate(rows)
        if r.sampling.presence_penalty
        or r.sampling.frequency_penalty
        or len(r.output_token_ids) < r.sampling.min_tokens
    ]
    if needs_processing:
        processed = logits.clone()
        for i in needs_processing:
            _apply_penalties(processed[i], rows[i].sampling, rows[i].output_token_ids)
            _mask_stops(processed[i], rows[i].sampling, rows[i].output_token_ids, eos)
    tokens = processed.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        sp = row.sampling
        if sp.greedy:
            continue
        scaled = _top_k_top_p(processed[i] / sp.temperature, sp.top_k, sp.top_p)
        probs = scaled.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
    out = []
    for i, row in enumerate(rows):
        lp = None
        if raw_logprobs is not None and row.sampling.logprobs is not None:
            lp = {tokens[i]: float(raw_logprobs[i, tokens[i]])}
            if row.sampling.logprobs:
                top = torch.topk(raw_logprobs[i], row.sampling.logprobs)
                for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    lp.setdefault(t, v)
        out.append(Sampled(tokens[i], lp))
    return out
