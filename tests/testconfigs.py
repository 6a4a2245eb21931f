"""Model settings several test modules share (a module: conftest.py files cannot be imported
by name, there is more than one)."""

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
