"""A GGUF file (what llama.cpp and Ollama users hold) read back as a Hugging Face checkpoint.

A GGUF packs what a Hugging Face directory spreads over config.json, tokenizer.json and
*.safetensors into one file, under llama.cpp's key and tensor names and in llama.cpp's layouts.
This module undoes that, so that the rest of the engine sees the config.json dict, the
Hugging Face tensor names and shapes it already loads, and a ``tokenizers`` Tokenizer:

- hyper-parameters ``{arch}.*`` → the config.json keys of the matching transformers class;
- tensors ``blk.N.attn_q.weight`` … → ``model.layers.N.self_attn.q_proj.weight`` …, dequantized
  with ``gguf.quants.dequantize``; for ``llama`` the q/k rows are put back in Hugging Face's
  rotary order (convert_hf_to_gguf.py interleaves each head's two rotary halves for llama.cpp's
  adjacent-pair rope); Phi-3's fused qkv and gate/up tensors keep their Hugging Face fusion;
- rope data the converter stores as tensors (Llama 3's ``rope_freqs``, Phi-3's long/short
  factors) goes back into the config.

Only ``llama`` (also Mistral's GGUFs), ``qwen2``, ``qwen3`` and ``phi3`` are read; anything else
is refused with the name of what is not understood, before any weight is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys
from tokenizers import Tokenizer

from poise.engine.errors import ModelLoadError
from poise.engine.models.gguf_container import (
    TensorInfo,
    can_dequantize,
    dequantize_tensor,
    read_header,
)
from poise.engine.models.gguf_tokenizer import tokenizer_from_metadata

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_LLM, _ATTN, _ROPE = Keys.LLM, Keys.Attention, Keys.Rope


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one .gguf in a directory that has
    no config.json (a Hugging Face directory is loaded as such even if it also holds GGUFs)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise ModelLoadError(
            f"{path} holds several GGUF files ({', '.join(p.name for p in found)}); "
            "name the one to serve"
        )
    return found[0] if found else None


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    config: dict[str, Any]  # what transformers' config.json would hold for this model
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def read_gguf(path: Path) -> GGUFCheckpoint:
    """The checkpoint's config and tokenizer, from the metadata alone (no weight is read but
    the small rope tensors). Refuses, naming it, whatever poise could not load later."""
    opened = _open(Path(path))
    config = _config(opened)
    tok = tokenizer_from_metadata(opened.meta)
    return GGUFCheckpoint(
        path=opened.path,
        config=config,
        tokenizer=tok.tokenizer,
        tokenizer_config=tok.tokenizer_config,
        generation_config=tok.generation_config,
    )


def iter_gguf_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight under its Hugging Face name, dequantized to ``dtype`` in Hugging Face layout."""
    opened = _open(Path(path))
    heads = opened.need_int(_ATTN.HEAD_COUNT)
    kv_heads = opened.int_or(_ATTN.HEAD_COUNT_KV, heads)
    permuted = opened.arch == "llama"
    data = np.memmap(opened.path, dtype=np.uint8, mode="r")
    for info in opened.tensors.values():
        if info.name in _CONFIG_TENSORS:
            continue
        weight = torch.from_numpy(dequantize_tensor(data, info)).to(dtype)
        if permuted and info.name.endswith((".attn_q.weight", ".attn_q.bias")):
            weight = _unpermute_rotary(weight, heads)
        elif permuted and info.name.endswith((".attn_k.weight", ".attn_k.bias")):
            weight = _unpermute_rotary(weight, kv_heads)
        yield opened.hf_names[info.name], weight


def _unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf.py's ``permute``: per head, rows stored as (pair, 2) go
    back to (2, half), the two rotary halves Hugging Face's ``rotate_half`` expects."""
    rows = weight.shape[0]
    shaped = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape).contiguous()


# --- names and checks -------------------------------------------------------------------------

_CONFIG_TENSORS = frozenset(
    TENSOR_NAMES[t] + ".weight"
    for t in (
        MODEL_TENSOR.ROPE_FREQS,
        MODEL_TENSOR.ROPE_FACTORS_LONG,
        MODEL_TENSOR.ROPE_FACTORS_SHORT,
    )
)
_GLOBAL_NAMES = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
}
_LLAMA_BLOCK = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm",
    MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
}
_QK_NORMS = {
    MODEL_TENSOR.ATTN_Q_NORM: "self_attn.q_norm",
    MODEL_TENSOR.ATTN_K_NORM: "self_attn.k_norm",
}
_PHI3_BLOCK = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm",
    MODEL_TENSOR.ATTN_QKV: "self_attn.qkv_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_UP: "mlp.gate_up_proj",  # gate and up, fused as in Hugging Face's Phi-3
    MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
}
_BLOCK_NAMES = {
    "llama": _LLAMA_BLOCK,
    "qwen2": _LLAMA_BLOCK,
    "qwen3": _LLAMA_BLOCK | _QK_NORMS,
    "phi3": _PHI3_BLOCK,
}


def _hf_names(arch: str, layers: int) -> dict[str, str]:
    names: dict[str, str] = {}
    for tensor, hf in _GLOBAL_NAMES.items():
        names.update({f"{TENSOR_NAMES[tensor]}.{s}": f"{hf}.{s}" for s in ("weight", "bias")})
    for bid in range(layers):
        for tensor, hf in _BLOCK_NAMES[arch].items():
            gguf = TENSOR_NAMES[tensor].format(bid=bid)
            names.update(
                {f"{gguf}.{s}": f"model.layers.{bid}.{hf}.{s}" for s in ("weight", "bias")}
            )
    return names


@dataclass(frozen=True)
class _Opened:
    path: Path
    arch: str
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    hf_names: dict[str, str]

    def value(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key.format(arch=self.arch), default)

    def need(self, key: str) -> Any:
        full = key.format(arch=self.arch)
        if full not in self.meta:
            raise ModelLoadError(f"{self.path.name} lacks the GGUF metadata key {full!r}")
        return self.meta[full]

    def need_int(self, key: str) -> int:
        value = self.need(key)
        if not isinstance(value, int):  # per-layer lists exist for some architectures
            raise ModelLoadError(f"{key.format(arch=self.arch)} = {value!r} is not one number")
        return value

    def int_or(self, key: str, default: int) -> int:
        return self.need_int(key) if key.format(arch=self.arch) in self.meta else default

    def float_or(self, key: str, default: float | None = None) -> float | None:
        value = self.value(key)
        return default if value is None else _f32(value)


def _f32(value: float) -> float:
    # Metadata floats are float32: 1e-5 is stored as 9.99999974738e-06. The shortest decimal
    # that reads back as the same float32 is what config.json held.
    return float(str(np.float32(value)))


def _open(path: Path) -> _Opened:
    meta, tensors = read_header(path)
    arch = meta.get(Keys.General.ARCHITECTURE)
    if arch is None:
        raise ModelLoadError(f"{path.name} lacks the GGUF metadata key 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; poise reads {', '.join(ARCHITECTURES)}"
        )
    if int(meta.get(Keys.Split.LLM_KV_SPLIT_COUNT, 1)) > 1:
        raise ModelLoadError(
            f"{path.name} is one part of a split GGUF; merge the parts first "
            "(llama-gguf-split --merge)"
        )
    if experts := meta.get(_LLM.EXPERT_COUNT.format(arch=arch)):
        raise ModelLoadError(
            f"mixture-of-experts GGUFs ({arch}, {experts} experts) are not supported"
        )
    for info in tensors.values():
        if not can_dequantize(info.qtype):
            raise ModelLoadError(
                f"tensor {info.name} is stored as {info.qtype.name}, which the installed gguf "
                "package cannot dequantize"
            )
    opened = _Opened(path, arch, meta, tensors, {})
    layers = opened.need_int(_LLM.BLOCK_COUNT)
    names = _hf_names(arch, layers)
    # Old files carry each layer's rotary inverse frequencies; the model computes its own.
    derived = {
        TENSOR_NAMES[MODEL_TENSOR.ATTN_ROT_EMBD].format(bid=b) + ".weight" for b in range(layers)
    }
    kept = {n: t for n, t in tensors.items() if n not in derived}
    unknown = [n for n in kept if n not in names and n not in _CONFIG_TENSORS]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ModelLoadError(
            f"GGUF tensors not understood for architecture {arch}: {', '.join(unknown[:5])}{more}"
        )
    return replace(opened, tensors=kept, hf_names=names)


# --- config.json ------------------------------------------------------------------------------


def _config(gguf: _Opened) -> dict[str, Any]:
    arch, tensors = gguf.arch, gguf.tensors
    hidden = gguf.need_int(_LLM.EMBEDDING_LENGTH)
    heads = gguf.need_int(_ATTN.HEAD_COUNT)
    head_dim = gguf.int_or(_ATTN.KEY_LENGTH, hidden // heads)
    if gguf.int_or(_ATTN.VALUE_LENGTH, head_dim) != head_dim:
        raise ModelLoadError("GGUFs whose attention value and key lengths differ are not supported")
    rope_dims = gguf.int_or(_ROPE.DIMENSION_COUNT, head_dim)
    vocab = len(gguf.meta.get(Keys.Tokenizer.LIST) or [])
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": gguf.need_int(_LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": gguf.need_int(_LLM.BLOCK_COUNT),
        "num_attention_heads": heads,
        "num_key_value_heads": gguf.int_or(_ATTN.HEAD_COUNT_KV, heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": gguf.need_int(_LLM.CONTEXT_LENGTH),
        "rms_norm_eps": _f32(gguf.need(_ATTN.LAYERNORM_RMS_EPS)),
        "rope_theta": gguf.float_or(_ROPE.FREQ_BASE, 10000.0),
        "rope_scaling": _rope_scaling(gguf),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": gguf.meta.get(Keys.Tokenizer.BOS_ID),
        "eos_token_id": gguf.meta.get(Keys.Tokenizer.EOS_ID),
    }
    embed = tensors.get("token_embd.weight")
    if embed is None or embed.shape[0] != vocab:
        shape = list(embed.shape) if embed else "missing"
        raise ModelLoadError(
            f"token_embd.weight ({shape}) does not fit the {vocab}-token vocabulary"
        )
    has_bias = any(n.endswith(".attn_q.bias") for n in tensors)
    window = gguf.int_or(_ATTN.SLIDING_WINDOW, 0) or None
    if arch == "phi3":
        del config["head_dim"]  # Phi-3 derives it; rotary may cover only part of it
        if rope_dims != head_dim:
            config["partial_rotary_factor"] = rope_dims / head_dim
        config["sliding_window"] = window  # the converter writes 0 for "none" (Phi-4)
        if (original := gguf.value(_ROPE.SCALING_ORIG_CTX_LEN)) is not None:
            config["original_max_position_embeddings"] = original
        return config
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{arch} GGUF rotates {rope_dims} of {head_dim} head dimensions; partial rotary "
            "embeddings are not supported for this architecture"
        )
    if arch == "llama":
        config["attention_bias"] = has_bias
        config["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in tensors)
    else:
        if arch == "qwen3":
            config["attention_bias"] = has_bias
        config["use_sliding_window"] = window is not None
        config["sliding_window"] = window
    return config


def _rope_scaling(gguf: _Opened) -> dict[str, Any] | None:
    scaling = _rope_scaling_by_type(gguf)
    # Metadata that changes the rotation is honoured where poise's rope has the knob (the
    # attention factor of LongRoPE and YaRN) and refused by name elsewhere, never dropped.
    attn_factor = gguf.float_or(_ROPE.SCALING_ATTN_FACTOR)
    if attn_factor is not None:
        if scaling is not None and scaling["rope_type"] in ("longrope", "yarn"):
            scaling.setdefault("attention_factor", attn_factor)
        elif attn_factor != 1.0:
            raise ModelLoadError(f"{_ROPE.SCALING_ATTN_FACTOR} = {attn_factor} is not supported")
    log_mul = gguf.float_or(_ROPE.SCALING_YARN_LOG_MUL)
    if log_mul not in (None, 0.0):
        raise ModelLoadError(f"{_ROPE.SCALING_YARN_LOG_MUL} = {log_mul} is not supported")
    return scaling


def _rope_scaling_by_type(gguf: _Opened) -> dict[str, Any] | None:
    kind = gguf.value(_ROPE.SCALING_TYPE)
    factor = gguf.float_or(_ROPE.SCALING_FACTOR)
    if kind is None and (legacy := gguf.float_or("{arch}.rope.scale_linear")) not in (None, 1.0):
        kind, factor = "linear", legacy  # files from before rope.scaling.* existed
    original = gguf.value(_ROPE.SCALING_ORIG_CTX_LEN)
    has_freqs = "rope_freqs.weight" in gguf.tensors
    has_factors = "rope_factors_long.weight" in gguf.tensors
    if has_freqs and kind not in (None, "none"):
        raise ModelLoadError(f"GGUF has both rope_freqs and rope scaling {kind!r}; not supported")
    if has_freqs:
        # Llama 3's scaling, precomputed by the converter as one divisor per frequency.
        return {"rope_type": "gguf_freq_factors", "freq_factors": _floats(gguf, "rope_freqs")}
    if has_factors or kind == "longrope":
        if not has_factors or original is None:
            raise ModelLoadError(
                "a longrope GGUF needs rope_factors_long/short tensors and "
                "rope.scaling.original_context_length"
            )
        return {
            "type": "longrope",
            "rope_type": "longrope",
            "long_factor": _floats(gguf, "rope_factors_long"),
            "short_factor": _floats(gguf, "rope_factors_short"),
            "original_max_position_embeddings": original,
        }
    if kind in (None, "none"):
        return None
    if factor is None:
        raise ModelLoadError(f"rope scaling {kind!r} without {_ROPE.SCALING_FACTOR}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for key, hf in (
            (_ROPE.SCALING_YARN_ATTN_FACTOR, "attention_factor"),
            (_ROPE.SCALING_YARN_BETA_FAST, "beta_fast"),
            (_ROPE.SCALING_YARN_BETA_SLOW, "beta_slow"),
            (_ROPE.SCALING_YARN_EXT_FACTOR, "extrapolation_factor"),
        ):
            if (value := gguf.float_or(key)) is not None:
                scaling[hf] = value
        return scaling
    raise ModelLoadError(f"rope scaling type {kind!r} ({_ROPE.SCALING_TYPE}) is not supported")


def _floats(gguf: _Opened, tensor: str) -> list[float]:
    info = gguf.tensors.get(f"{tensor}.weight")
    if info is None:
        raise ModelLoadError(f"the GGUF lacks the tensor {tensor}.weight")
    data = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    return [_f32(v) for v in dequantize_tensor(data, info).reshape(-1).tolist()]
