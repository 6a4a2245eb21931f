"""Llama-family models and the loader for local Hugging Face directories."""
