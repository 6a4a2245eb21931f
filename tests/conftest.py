from pathlib import Path

import pytest

from poise.modelgen.make_model import make_model

# A tiny transformers config for checkpoints built with transformers' own classes; the ids are
# those of make_model's tokenizer (BOS 0, EOS 1), whose files such checkpoints borrow.
TINY_HF_CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models of each architecture, made once per session.

    The Llama one carries Llama-3 rope scaling and the Qwen2 one ties its embeddings, so the
    parity tests cover those paths too.
    """
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama", "llama", "tiny", rope_scaling=LLAMA3_SCALING),
        "mistral": make_model(root / "mistral", "mistral", "tiny", shards=3),
        "qwen2": make_model(root / "qwen2", "qwen2", "tiny"),
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]
