"""Rotary position embeddings, every scaling transformers applies to the families poise runs.

``RopeSpec.parse`` reads one ``rope_parameters`` dict (transformers 5) or the older
``rope_theta`` + ``rope_scaling`` spelling, already merged by the config reader, and refuses a
type or key it does not know: a rotary table computed with a silently wrong base or scaling
gives fluent-looking garbage, the worst failure a server can have.

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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poise.engine.errors import ModelLoadError

# Keys transformers reads for each type (its ``_validate_*_rope_parameters``); "type" is the
# old spelling of "rope_type".
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": _COMMON,
    "linear": _COMMON | {"factor"},
    "dynamic": _COMMON | {"factor", "original_max_position_embeddings"},
    "llama3": _COMMON
    | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": _COMMON
    | {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": _COMMON
    | {
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "attention_factor",
        "factor",
    },
    # Written by poise's GGUF reader: llama.cpp's per-frequency divisors (``rope_freqs``).
    "gguf_freq_factors": _COMMON | {"freq_factors"},
}
_REQUIRED = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"},
    "gguf_freq_factors": {"freq_factors"},
}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int  # head_dim × partial_rotary_factor: the leading dims that rotate
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def parse(
        cls,
        params: dict[str, Any],
        head_dim: int,
        max_position_embeddings: int,
        where: str = "rope_parameters",
    ) -> RopeSpec:
        """``params``: the merged rope dict, ``rope_theta`` included."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _KEYS:
            raise ModelLoadError(
                f"{where}.rope_type {rope_type!r} is not supported; poise runs "
                f"{', '.join(k for k in _KEYS if k != 'gguf_freq_factors')}"
            )
        unknown = sorted(set(params) - _KEYS[rope_type])
        if unknown:
            raise ModelLoadError(
                f"{where} has keys poise does not understand for rope_type {rope_type!r}: "
                f"{', '.join(unknown)}"
            )
        missing = sorted(_REQUIRED.get(rope_type, set()) - set(params))
        if missing:
            raise ModelLoadError(f"{where} ({rope_type}) lacks {', '.join(missing)}")
        theta = params.get("rope_theta")
        if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
            raise ModelLoadError(f"{where}.rope_theta must be a positive number, got {theta!r}")
        partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ModelLoadError(f"{where}.partial_rotary_factor {partial} gives no even dimension")
        spec = cls(
            rope_type,
            float(theta),
            head_dim,
            rotary_dim,
            max_position_embeddings,
            {k: v for k, v in params.items() if k not in _COMMON},
        )
        half = rotary_dim // 2
        for key in ("short_factor", "long_factor", "freq_factors"):
            if key in spec.params and len(spec.params[key]) != half:
                raise ModelLoadError(
                    f"{where}.{key} has {len(spec.params[key])} entries, the rotary dimension "
                    f"needs {half}"
                )
        return spec

    # ----- frequencies, as transformers computes them -----
    def _base_inv_freq(self, base: float) -> torch.Tensor:
        dim = self.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponents)

    @property
    def original_max_position_embeddings(self) -> int:
        return int(
            self.params.get("original_max_position_embeddings", self.max_position_embeddings)
        )

    @property
    def length_threshold(self) -> int | None:
        """The sequence length past which the frequencies change; None if they never do."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            return self.original_max_position_embeddings
        return None

    @property
    def max_len(self) -> int:
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(self.params["factor"]))
        if self.rope_type == "yarn":
            return int(self.original_max_position_embeddings * self._yarn_factor())
        return self.max_position_embeddings

    def rotation_variant(self, num_prompt_tokens: int, num_tokens: int) -> int | None:
        """Which rotation a sequence's cached keys have, where it is not the usual: dynamic's
        stretched base for its prompt's length, or longrope's long factors."""
        if self.rope_type == "dynamic" and num_prompt_tokens > self.max_position_embeddings:
            return num_prompt_tokens
        if self.rope_type == "longrope" and num_tokens > self.original_max_position_embeddings:
            return 1
        return None

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (YaRN's and LongRoPE's mscale)."""
        p = self.params
        if self.rope_type == "yarn":
            if p.get("attention_factor") is not None:
                return float(p["attention_factor"])
            factor = self._yarn_factor()
            if p.get("mscale") and p.get("mscale_all_dim"):
                return float(
                    _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
                )
            return _yarn_mscale(factor)
        if self.rope_type == "longrope":
            if p.get("attention_factor") is not None:
                return float(p["attention_factor"])
            factor = p.get("factor")
            orig = self.original_max_position_embeddings
            if factor is None:
                factor = self.max_position_embeddings / orig
            if factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(factor) / math.log(orig))
        return 1.0

    def _yarn_factor(self) -> float:
        factor = self.params.get("factor")
        if factor is None:
            return self.max_position_embeddings / self.original_max_position_embeddings
        return float(factor)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """float32 inverse frequencies, (rotary_dim / 2,); ``seq_len`` matters only for the
        length-dependent types."""
        p, kind = self.params, self.rope_type
        if kind == "default":
            return self._base_inv_freq(self.theta)
        if kind == "linear":
            return self._base_inv_freq(self.theta) / float(p["factor"])
        if kind == "dynamic":
            # In float32 tensors, as transformers computes it from a tensor sequence length.
            mpe = self.max_position_embeddings
            if seq_len is None or seq_len <= mpe:
                return self._base_inv_freq(self.theta)  # transformers' table until it grows
            seq = torch.tensor(seq_len)
            factor, dim = float(p["factor"]), self.rotary_dim
            base = self.theta * ((factor * seq / mpe) - (factor - 1)) ** (dim / (dim - 2))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return 1.0 / (base**exponents)
        if kind == "llama3":
            return _llama3(self._base_inv_freq(self.theta), p)
        if kind == "yarn":
            return self._yarn_inv_freq()
        if kind == "longrope":
            long = seq_len is not None and seq_len > self.original_max_position_embeddings
            factors = torch.tensor(
                p["long_factor" if long else "short_factor"], dtype=torch.float32
            )
            shape = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            return 1.0 / (factors * self.theta**shape)
        # gguf_freq_factors: llama.cpp divides each frequency by its factor.
        factors = torch.tensor(p["freq_factors"], dtype=torch.float32)
        return self._base_inv_freq(self.theta) / factors

    def _yarn_inv_freq(self) -> torch.Tensor:
        p, dim, base = self.params, self.rotary_dim, self.theta
        factor = self._yarn_factor()
        orig = self.original_max_position_embeddings
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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


class RotaryEmbedding(nn.Module):
    """cos/sin tables kept in float32 (scaled by the attention factor) and cast at use, as
    transformers does; length-dependent types compute the rows past their threshold per step."""

    def __init__(self, spec: RopeSpec, max_len: int) -> None:
        super().__init__()
        self.spec = spec
        self.max_len = max_len
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._by_len: dict[int, torch.Tensor] = {}  # inv_freq per sequence length (dynamic)

    @property
    def length_dependent(self) -> bool:
        return self.spec.length_threshold is not None

    def _table(self, positions: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.spec.attention_scaling
        return emb.cos() * scale, emb.sin() * scale

    def build(self, device: torch.device) -> None:
        positions = torch.arange(self.max_len, device=device)
        self.cos, self.sin = self._table(positions, self.spec.inv_freq())

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
            cos[rows], sin[rows] = self._table(positions[rows], inv)
        return cos, sin

    def _inv_freq_for(self, length: int) -> torch.Tensor:
        if self.spec.rope_type == "longrope":
            length = self.spec.original_max_position_embeddings + 1  # one long set
        inv = self._by_len.get(length)
        if inv is None:
            if len(self._by_len) > 4096:
                self._by_len.clear()
            inv = self._by_len[length] = self.spec.inv_freq(length)
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
        cos, sin = self.cos_sin(positions, lengths)
        cos = cos.to(q.dtype).unsqueeze(1)
        sin = sin.to(q.dtype).unsqueeze(1)
        rd = self.spec.rotary_dim
        if rd == q.shape[-1]:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, q_pass = q[..., :rd], q[..., rd:]
        k_rot, k_pass = k[..., :rd], k[..., rd:]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)
