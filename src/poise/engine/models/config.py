"""The model's shape, read from a Hugging Face ``config.json`` in any spelling transformers used.

The rule: a checkpoint runs exactly as transformers runs it, or it is refused here with the key
named. So a key that is absent takes the default of that architecture's transformers config
class (``ARCH_DEFAULTS``: Mistral's window is 4096 and Qwen3's head_dim 128 when the file says
nothing), the rotary settings are merged as ``convert_rope_params_to_dict`` merges them
(``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``, per layer type where a
model nests them), and a key that changes the computation in a way poise does not implement
(``REFUSED_KEYS``, an unknown rope type, a layer type poise lacks) is a ``ModelLoadError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poise.engine.errors import ModelLoadError
from poise.engine.models.rope_spec import RopeSpec

# Hugging Face class name -> poise's name of the family member.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# What transformers' config classes default to when config.json lacks the key.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "max_window_layers": 28,
        "sliding_window": 4096,  # used only with use_sliding_window
    },
    "qwen3": {
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "max_window_layers": 28,
        "sliding_window": 4096,
        "head_dim": 128,
    },
    "phi3": {
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "original_max_position_embeddings": 4096,
    },
}

# Keys that change the computation in ways poise does not implement, with the values that
# leave it unchanged; any other value is refused. (Dropout rates, initializer ranges and cache
# flags change nothing at inference.)
_OFF: tuple[Any, ...] = (None, False)
_UNIT: tuple[Any, ...] = (None, 1, 1.0)
REFUSED_KEYS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "quantization_config": ("quantized checkpoints are not supported", (None,)),
    "attn_logit_softcapping": ("attention logit soft-capping is not implemented", (None, 0, 0.0)),
    "final_logit_softcapping": ("final logit soft-capping is not implemented", (None, 0, 0.0)),
    "logits_scaling": ("logit scaling is not implemented", _UNIT),
    "embedding_multiplier": ("embedding multipliers are not implemented", _UNIT),
    "residual_multiplier": ("residual multipliers are not implemented", _UNIT),
    "attention_multiplier": ("attention multipliers are not implemented", (None,)),
    "use_qk_norm": ("this kind of QK norm is not implemented", _OFF),
    "attention_chunk_size": ("chunked attention is not implemented", (None,)),
    "no_rope_layers": ("layers without rotary embeddings are not implemented", (None,)),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
_KV_HEADS_DEFAULT = {"mistral": 8, "qwen2": 32, "qwen3": 32}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    family: str  # llama, mistral, qwen2, qwen3, phi3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama and Qwen3 when attention_bias
    o_bias: bool  # attention_bias also covers o_proj (Llama, Qwen3)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before the rotation
    ropes: tuple[RopeSpec, ...]  # distinct rotary settings
    layer_rope: tuple[int, ...]  # per layer: index into ropes
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, None for full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None  # the checkpoint's torch_dtype / dtype

    @property
    def max_model_len(self) -> int:
        """The longest sequence served: the rotary scaling's reach where it extends the
        model's (vLLM's rule: linear and dynamic multiply max_position_embeddings by the
        factor, YaRN its original length; llama3 and LongRoPE state theirs already)."""
        return min(rope.max_len for rope in self.ropes)

    @property
    def rope(self) -> RopeSpec:
        return self.ropes[0]

    @property
    def kv_window(self) -> int | None:
        """The window past which no layer reads a token again: K/V blocks wholly before it can
        be given back. None when any layer attends to everything."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or '(none given)'} (config.json "
                f"'architectures'); poise runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        _refuse_unsupported(raw, family)
        get = _Reader(raw, ARCH_DEFAULTS[family])
        hidden = get.int("hidden_size")
        heads = get.int("num_attention_heads")
        layers = get.int("num_hidden_layers")
        # Absent, transformers takes its class default: the head count for Llama and Phi-3,
        # but a fixed 8 (Mistral) or 32 (Qwen2, Qwen3), which the weights then have to fit.
        kv_heads = get.int("num_key_value_heads", _KV_HEADS_DEFAULT.get(family, heads))
        head_dim = get.int("head_dim", hidden // heads)
        mpe = get.int("max_position_embeddings")
        attention_bias = bool(raw.get("attention_bias", False)) and family in ("llama", "qwen3")
        windows = _layer_windows(raw, family, layers)
        layer_types = ["sliding_attention" if w is not None else "full_attention" for w in windows]
        ropes, layer_rope = _ropes(raw, family, head_dim, mpe, layer_types)
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        config = cls(
            architecture=arch,
            family=family,
            vocab_size=get.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.int("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=get.float("rms_norm_eps"),
            max_position_embeddings=mpe,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            ropes=ropes,
            layer_rope=layer_rope,
            layer_windows=windows,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )
        if heads % kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        return config


class _Reader:
    """Typed reads of config keys, with the architecture's defaults, naming a bad key."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.raw, self.defaults = raw, defaults

    def _value(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            value = self.defaults.get(key, default)
        if value is None:
            raise ModelLoadError(f"config.json lacks required key {key!r}")
        return value

    def int(self, key: str, default: int | None = None) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"config.json {key!r} must be a positive integer, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"config.json {key!r} must be a positive number, got {value!r}")
        return float(value)


def _refuse_unsupported(raw: dict[str, Any], family: str) -> None:
    for key, (why, neutral) in REFUSED_KEYS.items():
        value = raw.get(key)
        if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
            raise ModelLoadError(f"config.json {key!r} = {_short(value)}: {why}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json 'hidden_act' {act!r} is not supported (silu)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _layer_windows(raw: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers' modeling code for the family applies it."""
    window = raw.get("sliding_window", ARCH_DEFAULTS[family].get("sliding_window"))
    if family == "llama":
        return (None,) * layers  # transformers' Llama has no sliding window
    if family in ("mistral", "phi3"):
        return (_window(window),) * layers
    # Qwen2 and Qwen3: the window only with use_sliding_window, on the layers layer_types says.
    if not raw.get("use_sliding_window", False):
        window = None
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", ARCH_DEFAULTS[family]["max_window_layers"]))
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    if not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"config.json 'layer_types' must list one type per layer ({layers})")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ModelLoadError(
            f"config.json 'layer_types' has {', '.join(map(repr, unknown))}; poise runs "
            f"{', '.join(LAYER_TYPES)}"
        )
    w = _window(window)
    return tuple(w if t == "sliding_attention" else None for t in types)


def _window(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json 'sliding_window' must be a positive integer: {value!r}")
    return value


def _ropes(
    raw: dict[str, Any], family: str, head_dim: int, mpe: int, layer_types: list[str]
) -> tuple[tuple[RopeSpec, ...], tuple[int, ...]]:
    """Merge the rotary settings as transformers' ``convert_rope_params_to_dict`` does."""
    source = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(source, dict):
        raise ModelLoadError("config.json 'rope_parameters' / 'rope_scaling' must be an object")
    theta = raw.get("rope_theta", 10000.0)
    partial = raw.get("partial_rotary_factor")
    declared = raw.get("layer_types") or []
    nested = sorted(k for k in source if k in declared or k in LAYER_TYPES)
    if nested:
        # transformers 5 runs per-layer-type rotary settings only for the families that define
        # them (Gemma 3, ...), none of which poise runs; for these it ignores or fails on them.
        raise ModelLoadError(
            f"config.json 'rope_parameters' per layer type ({', '.join(nested)}) is not "
            f"supported for {family}"
        )
    one = _rope_dict(raw, family, source, theta, partial)
    per_type = dict.fromkeys(set(layer_types), one)
    specs: list[RopeSpec] = []
    index: dict[str, int] = {}
    for t, params in sorted(per_type.items()):
        spec = RopeSpec.parse(params, head_dim, mpe)
        if family not in ("phi3",) and spec.rotary_dim != head_dim:
            raise ModelLoadError(
                f"config.json 'partial_rotary_factor' is not supported for {family} "
                "(transformers rotates the whole head there)"
            )
        specs.append(spec)
        index[t] = len(specs) - 1
    return tuple(specs), tuple(index[t] for t in layer_types)


def _rope_dict(
    raw: dict[str, Any], family: str, params: dict[str, Any], theta: Any, partial: Any
) -> dict[str, Any]:
    merged = dict(params)
    merged.setdefault("rope_theta", theta)
    if partial is not None:
        merged.setdefault("partial_rotary_factor", partial)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3's old names for its LongRoPE, renamed by transformers
    merged.pop("type", None)
    merged["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        top = raw.get(
            "original_max_position_embeddings",
            ARCH_DEFAULTS[family].get("original_max_position_embeddings"),
        )
        if top is not None:
            merged["original_max_position_embeddings"] = top
        else:
            merged.setdefault(
                "original_max_position_embeddings",
                raw.get(
                    "max_position_embeddings", ARCH_DEFAULTS[family]["max_position_embeddings"]
                ),
            )
    return merged
