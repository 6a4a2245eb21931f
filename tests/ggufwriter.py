"""Test helper: a Hugging Face checkpoint directory → a .gguf file, written the way llama.cpp's
convert_hf_to_gguf.py writes it, so the GGUF reader can be checked against the original files.

Covered: llama (and mistral), qwen2, qwen3 and phi3 checkpoints with a byte-level BPE
tokenizer.json. As in the converter: hyper-parameters under ``{arch}.*``, llama's q/k rows
permuted for llama.cpp's adjacent-pair rope, Llama 3 rope scaling precomputed into a
``rope_freqs`` tensor, Phi-3's longrope factors as ``rope_factors_long/short`` tensors, 1-D and
norm tensors kept in F32, a Q8_0/Q4_0 tensor whose rows do not split into blocks falling back to
F16, and the tokenizer metadata from ``gguf.SpecialVocab``. The real converter names the
pre-tokenizer by hashing the tokenizer's output on a probe text; a test tokenizer matches no
known hash, so the caller names it (``pre``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
TENSOR_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}


def write_gguf(
    model_dir: Path,
    out: Path,
    tensor_type: str = "F32",
    pre: str = "gpt-2",
    name: str | None = None,
) -> Path:
    model_dir, out = Path(model_dir), Path(out)
    hp = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[hp["model_type"]]
    qtype, ftype = TENSOR_TYPES[tensor_type]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    if arch == gguf.MODEL_ARCH.PHI3:
        _phi3_parameters(writer, hp)
    else:
        _text_parameters(writer, hp, arch)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _byte_level_vocab(writer, model_dir, hp, pre)
    for gguf_name, data in _tensors(model_dir, hp, arch):
        _add_tensor(writer, gguf_name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope(hp: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling.
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hp.get("rope_theta", 10000.0))
    if "type" in rope:
        rope.setdefault("rope_type", rope["type"])
    return rope


def _text_parameters(writer: gguf.GGUFWriter, hp: dict[str, Any], arch: gguf.MODEL_ARCH) -> None:
    """TextModel.set_gguf_parameters, plus LlamaModel's vocab size and rope dimensions."""
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    rope = _rope(hp)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (head_dim := hp.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(head_dim or hp["hidden_size"] // hp["num_attention_heads"])


def _phi3_parameters(writer: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Phi3MiniModel.set_gguf_parameters (which does not call the base class)."""
    rope = _rope(hp)
    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    original = rope.get(
        "original_max_position_embeddings", hp.get("original_max_position_embeddings")
    )
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = hp["max_position_embeddings"] / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(attn)


def _looks_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def _byte_level_vocab(
    writer: gguf.GGUFWriter, model_dir: Path, hp: dict[str, Any], pre: str
) -> None:
    """TextModel._set_vocab_gpt2 / get_vocab_base, on the ``tokenizers`` library."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(hp["vocab_size"]):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = by_id[i]
        if i in added:
            control = added[i].special or _looks_special(token)
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(
        writer, quiet=True
    )


def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rotary halves interleaved into adjacent pairs."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensors(
    model_dir: Path, hp: dict[str, Any], arch: gguf.MODEL_ARCH
) -> list[tuple[str, np.ndarray]]:
    out = list(_extra_tensors(hp, arch))
    name_map = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            data = tensor.to(torch.float32)
            if arch == gguf.MODEL_ARCH.LLAMA and ".q_proj." in name:
                data = permute(data, heads)
            elif arch == gguf.MODEL_ARCH.LLAMA and ".k_proj." in name:
                data = permute(data, kv_heads)
            new_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ValueError(f"cannot map tensor {name}")
            out.append((new_name, data.numpy()))
    return out


def _extra_tensors(hp: dict[str, Any], arch: gguf.MODEL_ARCH) -> list[tuple[str, np.ndarray]]:
    """LlamaModel / Phi3MiniModel.generate_extra_tensors."""
    rope = _rope(hp)
    names = gguf.TENSOR_NAMES
    if arch == gguf.MODEL_ARCH.LLAMA and rope.get("rope_type") == "llama3":
        dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        base = rope["rope_theta"]
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = rope.get("factor", 8.0)
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old_context = rope.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_context / low, old_context / high
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                factors.append(1.0)
            elif wavelen > low_wavelen:
                factors.append(factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return [(names[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(factors, np.float32))]
    if arch == gguf.MODEL_ARCH.PHI3 and rope.get("long_factor"):
        return [
            (
                names[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                np.array(rope["long_factor"], np.float32),
            ),
            (
                names[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                np.array(rope["short_factor"], np.float32),
            ),
        ]
    return []


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> None:
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        qtype = gguf.GGMLQuantizationType.F32
    try:
        raw = gguf.quants.quantize(data, qtype)
    except gguf.QuantError:
        qtype = gguf.GGMLQuantizationType.F16
        raw = gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, raw, raw_dtype=qtype)
