"""``poise make-model``: a complete Hugging Face–format model directory with random weights.

What it writes loads in poise and in Hugging Face transformers alike: ``config.json``,
``model.safetensors`` (or shards plus ``model.safetensors.index.json``), ``tokenizer.json`` (a
byte-level BPE trained here with the ``tokenizers`` library), ``tokenizer_config.json`` with a
ChatML chat template, and ``generation_config.json``. The same seed gives the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from poise.modelgen.corpus import tokenizer_corpus

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False  # lm_head shares the embedding (qwen2 always does)
    rope_theta: float = 10000.0


SIZES = {
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1024),
    "small": ModelSize(hidden=256, layers=4, heads=8, kv_heads=4, ffn=768, vocab=8192),
    "w0": ModelSize(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1536, vocab=32000),
    # SmolLM2-135M's shape: deep and narrow, where per-layer overhead rather than matrix
    # products takes a step's time.
    "w3": ModelSize(
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        ffn=1536,
        vocab=49152,
        tied=True,
        rope_theta=100000.0,
    ),
    # The trained demo (``--train``): a few million parameters, a vocabulary of a few thousand.
    "demo": ModelSize(hidden=192, layers=4, heads=6, kv_heads=3, ffn=512, vocab=4096),
}


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(vocab_size, seed), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def model_config(arch: str, size: ModelSize, tok: Tokenizer, **extra: Any) -> dict[str, Any]:
    head_dim = size.hidden // size.heads
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.ffn,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": size.rope_theta,
        "tie_word_embeddings": arch == "qwen2" or size.tied,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "torch_dtype": "float32",
    }
    if arch == "mistral":
        config["sliding_window"] = None
    if arch == "qwen2":
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    config.update(extra)
    return config


def random_weights(config: dict[str, Any], seed: int, std: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    qkv_bias = config["model_type"] == "qwen2"

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, h)
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows)
        w[p + "self_attn.o_proj.weight"] = normal(h, q)
        w[p + "mlp.gate_proj.weight"] = normal(ffn, h)
        w[p + "mlp.up_proj.weight"] = normal(ffn, h)
        w[p + "mlp.down_proj.weight"] = normal(h, ffn)
    w["model.norm.weight"] = norm_weight()
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(vocab, h)
    return {k: v.contiguous() for k, v in w.items()}


def save_weights(weights: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    metadata = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(out / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tokenizer_files(tok: Tokenizer, out: Path, config: dict[str, Any]) -> None:
    tok.save(str(out / "tokenizer.json"))
    im_end = tok.token_to_id(IM_END)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], im_end],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    shards: int = 1,
    std: float = 0.05,
    **config_overrides: Any,
) -> Path:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = SIZES[size]
    tok = train_tokenizer(spec.vocab, seed)
    config = model_config(arch, spec, tok, **config_overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_weights(random_weights(config, seed, std), out, shards)
    write_tokenizer_files(tok, out, config)
    return out
