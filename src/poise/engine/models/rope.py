"""Rotary position embeddings, every scaling transformers applies to the families poise runs.

What the checkpoint asks for is read and checked by ``poise.engine.models.rope_spec``.

The inverse frequencies are computed with the same float32 operations, in the same order, as
``transformers.modeling_rope_utils``, so the tables agree bit for bit.

Two types depend on the sequence's length, not only on the position, and transformers gives
each its own rule; poise follows both, per sequence, whatever else shares the batch:
- ``dynamic`` (NTK scaling once the sequence outgrows ``max_position_embeddings``) is recomputed
  at each forward from its longest position: the prompt's tokens are rotated for the prompt's
  length, each generated token for the length the sequence had when it was generated, and
  cached keys keep their rotation. poise rotates each token for ``max(position + 1, prompt
  length)`` (``rope_lens``).
- ``longrope`` (Phi-3: short factors up to ``original_max_position_embeddings``, long ones past
  it): Phi-3's generation drops its cache when the sequence crosses that length and computes
  every token again with the long factors. poise rotates every token for the sequence's length
  at the step (``seq_lens``), and the engine recomputes a sequence that crosses
  (``LlamaForCausalLM.recompute_past``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from poise.engine.models.rope_spec import RopeSpec


def inv_freq(spec: RopeSpec, seq_len: int | None = None) -> torch.Tensor:
    """float32 inverse frequencies, (rotary_dim / 2,); ``seq_len`` matters only for the
    length-dependent types."""
    p, kind = spec.params, spec.rope_type
    if kind == "default":
        return _base_inv_freq(spec, spec.theta)
    if kind == "linear":
        return _base_inv_freq(spec, spec.theta) / float(p["factor"])
    if kind == "dynamic":
        # In float32 tensors, as transformers computes it from a tensor sequence length.
        mpe = spec.max_position_embeddings
        if seq_len is None or seq_len <= mpe:
            return _base_inv_freq(spec, spec.theta)  # transformers' table until it grows
        seq = torch.tensor(seq_len)
        factor, dim = float(p["factor"]), spec.rotary_dim
        base = spec.theta * ((factor * seq / mpe) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponents)
    if kind == "llama3":
        return _llama3(_base_inv_freq(spec, spec.theta), p)
    if kind == "yarn":
        return _yarn_inv_freq(spec)
    if kind == "longrope":
        long = seq_len is not None and seq_len > spec.original_max_position_embeddings
        factors = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
        shape = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float() / spec.rotary_dim
        return 1.0 / (factors * spec.theta**shape)
    # gguf_freq_factors: llama.cpp divides each frequency by its factor.
    factors = torch.tensor(p["freq_factors"], dtype=torch.float32)
    return _base_inv_freq(spec, spec.theta) / factors


def _base_inv_freq(spec: RopeSpec, base: float) -> torch.Tensor:
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents)


def _yarn_inv_freq(spec: RopeSpec) -> torch.Tensor:
    p, dim, base = spec.params, spec.rotary_dim, spec.theta
    factor = spec.yarn_factor()
    orig = spec.original_max_position_embeddings
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# (positions, lengths, dtype), their version counters, (cos, sin): one step's rotary rows.
# (positions, inv_freq, attention scale) -> float32 (cos, sin) rows.
RowTable = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
StepRows = tuple[tuple[object, ...], tuple[int | None, ...], tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding(nn.Module):
    """cos/sin tables kept in float32 (scaled by the attention factor) and cast at use, as
    transformers does; length-dependent types compute the rows past their threshold per step,
    through ``row_table`` when set (the deterministic mode's kernel: PyTorch's cos and sin give a
    row another last bit in another batch)."""

    def __init__(self, spec: RopeSpec, max_len: int) -> None:
        super().__init__()
        self.spec = spec
        self.max_len = max_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._by_len: dict[int, torch.Tensor] = {}  # inv_freq per sequence length (dynamic)
        # The last step's rows, by the identity of its tensors (held, so no id is reused).
        self._step: StepRows | None = None
        self.row_table: RowTable | None = None

    @property
    def length_dependent(self) -> bool:
        return self.spec.length_threshold is not None

    def _table(self, positions: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.spec.attention_scaling
        return emb.cos() * scale, emb.sin() * scale

    def build(self, device: torch.device) -> None:
        self._step = None
        positions = torch.arange(self.max_len, device=device)
        self.cos, self.sin = self._table(positions, inv_freq(self.spec))

    def cos_sin(
        self, positions: torch.Tensor, rope_lens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, rotary_dim) float32 rows for the tokens' positions; ``rope_lens``: the length
        each token is rotated for (only the length-dependent types read it)."""
        cos, sin = self.cos[positions], self.sin[positions]
        threshold = self.spec.length_threshold
        if threshold is None or rope_lens is None:
            return cos, sin
        beyond = rope_lens > threshold
        if not bool(beyond.any()):
            return cos, sin
        cos, sin = cos.clone(), sin.clone()
        for length in rope_lens[beyond].unique().tolist():
            rows = (rope_lens == length).nonzero().squeeze(1)
            inv = self._inv_freq_for(int(length))
            if self.row_table is None:
                cos[rows], sin[rows] = self._table(positions[rows], inv)
            else:
                scale = self.spec.attention_scaling
                cos[rows], sin[rows] = self.row_table(positions[rows], inv, scale)
        return cos, sin

    def _inv_freq_for(self, length: int) -> torch.Tensor:
        if self.spec.rope_type == "longrope":
            length = self.spec.original_max_position_embeddings + 1  # one long set
        inv = self._by_len.get(length)
        if inv is None:
            if len(self._by_len) > 4096:
                self._by_len.clear()
            inv = self._by_len[length] = inv_freq(self.spec, length)
        return inv

    def forward(
        self,
        q: torch.Tensor,  # (T, heads, head_dim)
        k: torch.Tensor,
        positions: torch.Tensor,
        rope_lens: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = seq_lens if self.spec.rope_type == "longrope" else rope_lens
        # The same tensors, not changed in place since (their version counters), and dtype.
        key = (positions, lengths, q.dtype)
        versions = (positions._version, None if lengths is None else lengths._version)
        cached = self._step
        if (
            cached is not None
            and all(a is b for a, b in zip(cached[0], key, strict=True))
            and cached[1] == versions
        ):
            cos, sin = cached[2]  # every layer of a step rotates the same positions
        else:
            cos, sin = self.cos_sin(positions, lengths)
            cos = cos.to(q.dtype).unsqueeze(1)
            sin = sin.to(q.dtype).unsqueeze(1)
            self._step = (key, versions, (cos, sin))
        rd = self.spec.rotary_dim
        if rd == q.shape[-1]:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, q_pass = q[..., :rd], q[..., rd:]
        k_rot, k_pass = k[..., :rd], k[..., rd:]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
