"""What a checkpoint's rotary settings say, read and checked without torch.

``RopeSpec.parse`` reads one ``rope_parameters`` dict (transformers 5) or the older
``rope_theta`` + ``rope_scaling`` spelling, already merged by the config reader, and refuses a
type or key it does not know: a rotary table computed with a silently wrong base or scaling
gives fluent-looking garbage, the worst failure a server can have. The tables themselves are
``poise.engine.models.rope``'s: a server checks a checkpoint before it listens, in a process that
never computes and should not import torch for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
            return int(self.original_max_position_embeddings * self.yarn_factor())
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
            factor = self.yarn_factor()
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

    def yarn_factor(self) -> float:
        factor = self.params.get("factor")
        if factor is None:
            return self.max_position_embeddings / self.original_max_position_embeddings
        return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
