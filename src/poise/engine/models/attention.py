"""Attention over a flat batch of tokens and a paged KV cache, with or without a sliding window.

Attention writes the step's K/V into the cache slots first, then reads each sequence's context
from its blocks. The cache is head-major, ``(kv_heads, slots, head_dim)``, so a gather lands in
the layout batched matrix products want without another copy. Decode tokens (one per sequence)
are attended in buckets of similar context length, each padded to its longest context with a
mask, by two batched matrix products: CPU flash attention is slow for a single query row.
On the CPU the native kernel (``poise.engine.kernels``) replaces that path when it is built: it
reads the blocks in place instead of gathering them.
Prefill chunks go one sequence at a time through PyTorch's SDPA, with a causal mask offset by
the tokens already cached. In the deterministic mode the runner sends every token, prompt
chunks' too, through the native kernel as a query row of its own (context up to its position),
so a token's attention never depends on how its prompt was cut or decoded.

A layer with a sliding window ``w`` lets the token at position ``q`` see keys ``q - w < k <=
q`` (transformers' ``sliding_window_overlay``). Its context starts at ``q - w + 1``, so it never
reads a block the cache has already given back; the runner builds one ``AttentionView`` per
distinct window of the model, and each layer reads the one of its own window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from poise.engine.kernels import PagedDecodeAttention
from poise.engine.models.config import ModelConfig
from poise.engine.models.layers import RMSNorm
from poise.engine.models.rope import RotaryEmbedding


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_slots: torch.Tensor  # (ctx,) cache slots of the positions the chunk reads
    mask: torch.Tensor | None  # (num_tokens, ctx) bool, None when plain causal from position 0


@dataclass(slots=True)
class DecodeBucket:
    token_start: int  # index of the bucket's first token in the flat batch
    num_tokens: int  # one token per sequence
    block_tables: torch.Tensor  # (num_tokens, max_blocks) int64, for the native kernel
    context_lens: torch.Tensor  # (num_tokens,) int64: positions [0, len) exist
    context_starts: torch.Tensor | None  # (num_tokens,) int64 first position read; None: all 0
    # For the PyTorch path only (None when the native kernel runs):
    context_slots: torch.Tensor | None  # (num_tokens, width) cache slots to gather, padded
    masked: torch.Tensor | None  # (num_tokens, width) True on padding; None if none


@dataclass(slots=True)
class AttentionView:
    """What the layers of one window size read this step."""

    decodes: list[DecodeBucket]  # decode tokens come first in the batch
    prefills: list[PrefillChunk]


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # (T,) position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot each token's K/V is written to
    # Only for rotations that depend on the sequence's length (models/rope.py), else None:
    rope_lens: torch.Tensor | None  # (T,) max(position + 1, prompt length)
    seq_lens: torch.Tensor | None  # (T,) the sequence's length at this step
    views: dict[int | None, AttentionView]  # by sliding window (None: full attention)
    block_size: int
    decode_kernel: PagedDecodeAttention | None  # native decode attention, when built
    logits_indices: torch.Tensor  # (S,) tokens whose logits are sampled


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.layer_windows[layer]
        self.rope_index = config.layer_rope[layer]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        ropes: nn.ModuleList,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (kv_heads, num_slots, head_dim)
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope: RotaryEmbedding = ropes[self.rope_index]
        q, k = rope(q, k, meta.positions, meta.rope_lens, meta.seq_lens)
        k_cache[:, meta.slot_mapping] = k.transpose(0, 1)
        v_cache[:, meta.slot_mapping] = v.transpose(0, 1)

        view = meta.views[self.window]
        out = torch.empty_like(q)  # (T, heads, head_dim)
        for bucket in view.decodes:
            s, n = bucket.token_start, bucket.num_tokens
            if meta.decode_kernel is not None:
                out[s : s + n] = meta.decode_kernel(
                    q[s : s + n],
                    k_cache,
                    v_cache,
                    bucket.block_tables,
                    bucket.context_lens,
                    meta.block_size,
                    self.scale,
                    bucket.context_starts,
                )
            else:
                out[s : s + n] = self._decode(q[s : s + n], bucket, k_cache, v_cache)
        for chunk in view.prefills:
            s, n = chunk.token_start, chunk.num_tokens
            kp = k_cache.index_select(1, chunk.context_slots).unsqueeze(0)  # (1, kv, ctx, hd)
            vp = v_cache.index_select(1, chunk.context_slots).unsqueeze(0)
            qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, head_dim)
            o = F.scaled_dot_product_attention(
                qp,
                kp,
                vp,
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return self.o_proj(out.view(t, self.q_size))

    def _decode(
        self,
        q: torch.Tensor,  # (n, heads, head_dim)
        bucket: DecodeBucket,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        assert bucket.context_slots is not None
        # index_select copies whole rows and is many times faster than advanced indexing here.
        flat = bucket.context_slots.view(-1)
        ctx = bucket.context_slots.shape[1]
        kd = k_cache.index_select(1, flat).view(self.num_kv_heads, n, ctx, self.head_dim)
        vd = v_cache.index_select(1, flat).view(self.num_kv_heads, n, ctx, self.head_dim)
        qd = q.view(n, self.num_kv_heads, group, self.head_dim).transpose(0, 1)  # (kv, n, g, hd)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * self.scale  # (kv, n, g, ctx)
        if bucket.masked is not None:
            scores.masked_fill_(bucket.masked[None, :, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        o = torch.matmul(probs, vd)  # (kv, n, g, head_dim)
        return o.transpose(0, 1).reshape(n, self.num_heads, self.head_dim)
