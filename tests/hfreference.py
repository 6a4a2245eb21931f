"""transformers as the reference: checkpoints it saves itself, and its own greedy generation.

A module rather than fixtures: several engine test modules build their own checkpoints from
different configs, and each compares against the same ``generate(do_sample=False)``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def save_transformers_checkpoint(
    path: Path, config: PretrainedConfig, tokenizer_dir: Path, seed: int = 7
) -> Path:
    """A random model of ``config`` saved with ``save_pretrained``, with the tokenizer files of
    ``tokenizer_dir`` (a make_model directory, whose ids the tiny configs use)."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)
    return path


def transformers_greedy(path: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt's ``max_new`` greedy tokens (EOS not honoured), as transformers makes them."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ids = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is no padding here
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out
