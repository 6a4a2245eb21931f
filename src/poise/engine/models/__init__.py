"""The model families poise runs (Llama, Mistral, Qwen2, Qwen3 in ``llama.py``; Phi-3 in
``phi3.py``), their shared parts, and the loader for Hugging Face directories and GGUF files."""
