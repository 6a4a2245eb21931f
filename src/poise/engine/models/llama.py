"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

Reads top to bottom: rotary embedding, norm, attention, MLP, block, model. A step's tokens from
all sequences are concatenated into one ``(T, hidden)`` tensor so every projection is a single
matrix product; only attention looks at sequence boundaries, through ``AttentionMetadata``.

Attention writes the step's K/V into the cache slots first, then gathers each sequence's context
from its blocks. The cache is head-major, ``(kv_heads, slots, head_dim)``, so a gather lands in
the layout batched matrix products want without another copy. Decode tokens (one per sequence)
are attended in buckets of similar context length, each padded to its longest context with a
mask, by two batched matrix products: CPU flash attention is slow for a single query row.
On the CPU the native kernel (``poise.engine.kernels``) replaces that path when it is built: it
reads the blocks in place instead of gathering them.
Prefill chunks go one sequence at a time through PyTorch's SDPA, with a causal mask offset by
the tokens already cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from poise.engine.errors import ModelLoadError
from poise.engine.kernels import PagedDecodeAttention
from poise.engine.models.config import ModelConfig


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_slots: torch.Tensor  # (ctx,) cache slots of every position up to the chunk's end
    mask: torch.Tensor | None  # (num_tokens, ctx) bool, None when plain causal (no prefix)


@dataclass(slots=True)
class DecodeBucket:
    token_start: int  # index of the bucket's first token in the flat batch
    num_tokens: int  # one token per sequence
    block_tables: torch.Tensor  # (num_tokens, max_blocks) int64, for the native kernel
    context_lens: torch.Tensor  # (num_tokens,) int64
    # For the PyTorch path only (None when the native kernel runs):
    context_slots: torch.Tensor | None  # (num_tokens, max_ctx) cache slots to gather, padded
    masked: torch.Tensor | None  # (num_tokens, max_ctx) True on padding; None if none


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # (T,) position of each token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot each token's K/V is written to
    decodes: list[DecodeBucket]  # decode tokens come first in the batch
    prefills: list[PrefillChunk]
    block_size: int
    decode_kernel: PagedDecodeAttention | None  # native decode attention, when built
    logits_indices: torch.Tensor  # (S,) tokens whose logits are sampled


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies, float32, with Llama-3 or linear scaling; as transformers."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] == "default":
        return inv
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables kept in float32 and cast at use, as transformers does."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        positions = torch.arange(self.config.max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(self.config))
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # (T, 1, head_dim)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (kv_heads, num_slots, head_dim)
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(q, k, meta.positions)
        k_cache[:, meta.slot_mapping] = k.transpose(0, 1)
        v_cache[:, meta.slot_mapping] = v.transpose(0, 1)

        out = torch.empty_like(q)  # (T, heads, head_dim)
        for bucket in meta.decodes:
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
                )
            else:
                out[s : s + n] = self._decode(q[s : s + n], bucket, k_cache, v_cache)
        for chunk in meta.prefills:
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


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Logits, float32, for the tokens in ``meta.logits_indices``: (S, vocab)."""
        x = self.embed_tokens(input_ids)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, self.rope, meta, k_cache, v_cache)
        x = self.norm(x[meta.logits_indices])
        return self.lm_head(x).float()

    # ----- weights -----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        c = self.config
        fused = {
            "q_proj": ("qkv_proj", 0, c.num_heads * c.head_dim),
            "k_proj": ("qkv_proj", c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim),
            "v_proj": (
                "qkv_proj",
                (c.num_heads + c.num_kv_heads) * c.head_dim,
                c.num_kv_heads * c.head_dim,
            ),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, offset, size = name, None, None
            for i, part in enumerate(parts):
                if part in fused:
                    new, offset, size = fused[part]
                    target = ".".join([*parts[:i], new, *parts[i + 1 :]])
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in the model")
            dest = param.data if offset is None else param.data.narrow(0, offset, size)
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not match the "
                    f"config's {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(hf_name.removeprefix("model."))
        missing = [n for n in self._expected_hf_names() if n not in loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors: {shown}")

    def _expected_hf_names(self) -> list[str]:
        c = self.config
        names = ["embed_tokens.weight", "norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(c.num_layers):
            p = f"layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(p + f"self_attn.{proj}.weight")
                if c.qkv_bias:
                    names.append(p + f"self_attn.{proj}.bias")
            names.append(p + "self_attn.o_proj.weight")
            if c.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.append(p + f"mlp.{proj}.weight")
                if c.mlp_bias:
                    names.append(p + f"mlp.{proj}.bias")
        return names
