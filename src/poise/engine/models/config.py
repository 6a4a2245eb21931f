"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poise.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama's attention_bias also covers o_proj
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. Sliding-window attention is not implemented, so a model
        that has one is served only up to its window, where full attention is exact."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or '(none given)'}; poise runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
            attention_bias = bool(raw.get("attention_bias", False))
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            if arch == "LlamaForCausalLM":
                window = None
            head_dim = raw.get("head_dim") or hidden // heads
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
                o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_window=int(window) if window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required key {exc.args[0]!r}") from exc
        if config.num_heads % config.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        return config


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported (default, linear, llama3)"
        )
    return {**scaling, "rope_type": kind}
