"""Logits → next tokens, one row per sequence that samples this step.

Greedy rows are one argmax over the batch. Every other row samples with the generator the runner
gives it: a seeded request's draw at output position p from one seeded by (seed, p) alone, so the
same seed and input give the same tokens whatever else shares the batch, and after preemption
or resumption; unseeded ones draw from the runner's shared generator (or, in the deterministic
mode, one seeded per request).
Logprobs are those of the model's distribution before penalties and temperature (after a
structured output's grammar mask, as vLLM's).

The grammar masks of structured output are applied before, by the runner, on the logits' own
device (``guided.apply_grammar``). Each row's logits go through the steps in vLLM's order: the
logit bias, stop tokens banned before min_tokens, then the penalties (repetition
over prompt and output, frequency, presence), then for sampled
rows temperature, min_p, top-k and top-p. Greedy rows take the argmax after the penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from poise.engine.request import SamplingParams

# A banned token's logprob (-inf, a grammar's mask) as vLLM clamps it: JSON has no infinity.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class SampleRow:
    sampling: SamplingParams
    prompt_token_ids: list[int]  # read only; the repetition penalty covers them
    output_token_ids: list[int]
    generator: torch.Generator


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    # Chosen token's logprob first, then the top alternatives; None unless asked for.
    logprobs: dict[int, float] | None


def _apply_penalties(
    logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    """In place, in vLLM's order: repetition (prompt and output), frequency, presence."""
    vocab = logits.shape[-1]
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor([*prompt, *output], dtype=torch.long, device=logits.device).unique()
        seen = seen[seen < vocab]
        picked = logits[seen]
        p = sp.repetition_penalty
        logits[seen] = torch.where(picked > 0, picked / p, picked * p)
    if not output or (sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0):
        return
    counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=vocab)[:vocab].to(
        logits.dtype
    )
    logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _add_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's logit_bias, added to the logits; -100 bans a token, as OpenAI's does in effect."""
    vocab = logits.shape[-1]
    kept = [(t, v) for t, v in bias.items() if t < vocab]
    if not kept:
        return
    at = torch.tensor([t for t, _ in kept], dtype=torch.long)
    values = torch.tensor([v for _, v in kept], dtype=logits.dtype)
    values = values.masked_fill(values <= -100.0, float("-inf"))
    logits.index_add_(0, at, values)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """+inf as the largest finite value: a penalty or temperature that divides by a tiny
    number (``repetition_penalty`` 5e-324 is valid) overflows the likeliest tokens to +inf,
    and a softmax over two of them is NaN (the step failed for every request in it). Tied at
    the largest value they are still the likeliest, and equally likely, as in the limit."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def _mask_stops(
    logits: torch.Tensor, sp: SamplingParams, output: list[int], eos: frozenset[int]
) -> None:
    """Before min_tokens, end-of-sequence and stop tokens cannot be drawn."""
    if len(output) >= sp.min_tokens:
        return
    banned = [t for t in (*eos, *sp.stop_token_ids) if t < logits.shape[-1]]  # type: ignore[misc]
    if banned:
        logits[banned] = float("-inf")


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the likeliest one (after temperature)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


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
        or r.sampling.repetition_penalty != 1.0
        or len(r.output_token_ids) < r.sampling.min_tokens
        or r.sampling.logit_bias
    ]
    if needs_processing:
        processed = logits.clone()
        for i in needs_processing:
            row = rows[i]
            if row.sampling.logit_bias:
                _add_bias(processed[i], row.sampling.logit_bias)
            _mask_stops(processed[i], row.sampling, row.output_token_ids, eos)
            _apply_penalties(processed[i], row.sampling, row.prompt_token_ids, row.output_token_ids)
            processed[i] = _finite(processed[i])
    tokens = processed.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        sp = row.sampling
        if sp.greedy:
            continue
        scaled = _finite(processed[i] / sp.temperature)
        if sp.min_p > 0.0:
            scaled = _min_p(scaled, sp.min_p)
        scaled = _top_k_top_p(scaled, sp.top_k, sp.top_p)
        probs = scaled.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
    out = []
    for i, row in enumerate(rows):
        lp = None
        if raw_logprobs is not None and row.sampling.logprobs is not None:
            lp = {tokens[i]: max(float(raw_logprobs[i, tokens[i]]), MIN_LOGPROB)}
            if row.sampling.logprobs:
                top = torch.topk(raw_logprobs[i], row.sampling.logprobs)
                for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    lp.setdefault(t, max(v, MIN_LOGPROB))
        out.append(Sampled(tokens[i], lp))
    return out
