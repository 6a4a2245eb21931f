"""config.json → ModelConfig reads what transformers' config classes read, defaults included."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from poise.engine.errors import ModelLoadError
from poise.engine.models.config import ModelConfig
from poise.engine.models.rope import inv_freq

BASE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# Spellings seen in real checkpoints, shrunk; each is read by transformers and by poise.
CONFIGS = {
    "qwen2 window without a size": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "max_window_layers": 2,
    },
    "qwen2.5 yarn, old spelling": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "max_position_embeddings": 256,
    },
    "mistral without a window key": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
    },
    "qwen3 without head_dim": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "phi3 top-level original length": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "max_position_embeddings": 512,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    },
    "llama 3.2 with a top-level original length": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 128,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_reads_as_transformers_does(name):
    """Shape, windows and rotary frequencies as transformers' own config class gives them."""
    raw = {**BASE, **CONFIGS[name]}
    ours = ModelConfig.from_dict(raw)
    theirs = AutoConfig.for_model(**raw)
    head_dim = (
        getattr(theirs, "head_dim", None) or BASE["hidden_size"] // BASE["num_attention_heads"]
    )
    assert ours.head_dim == head_dim
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    layer_types = getattr(theirs, "layer_types", None)
    window = getattr(theirs, "sliding_window", None)
    if layer_types is not None:  # Qwen2/Qwen3: per layer
        want = tuple(window if t == "sliding_attention" else None for t in layer_types)
    elif theirs.model_type == "llama":
        want = (None,) * BASE["num_hidden_layers"]
    else:  # Mistral and Phi-3: every layer
        want = (window,) * BASE["num_hidden_layers"]
    assert ours.layer_windows == want
    kind = theirs.rope_parameters["rope_type"]
    inv, scaling = ROPE_INIT_FUNCTIONS.get(kind, lambda c, d: (None, None))(theirs, "cpu")
    if kind == "default":
        inv, scaling = ROPE_INIT_FUNCTIONS["linear"](
            AutoConfig.for_model(**{**raw, "rope_scaling": {"type": "linear", "factor": 1.0}}),
            "cpu",
        )
    assert torch.equal(inv_freq(ours.rope), inv)
    assert ours.rope.attention_scaling == pytest.approx(scaling, rel=1e-12)


def test_absent_kv_heads_take_transformers_class_default():
    raw = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    for model_type, arch in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        full = {**raw, "num_attention_heads": 32, "model_type": model_type, "architectures": [arch]}
        want = AutoConfig.for_model(**full).num_key_value_heads
        assert ModelConfig.from_dict(full).num_kv_heads == want


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        ({"rope_scaling": {"rope_type": "wavy", "factor": 2.0}}, "'wavy'"),
        ({"quantization_config": {"bits": 4}}, "quantization_config"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ],
)
def test_what_poise_cannot_run_is_named(changes, named):
    raw = {**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict(raw)
