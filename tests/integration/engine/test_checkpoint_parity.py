"""Checkpoints as transformers 5 saves them, in every spelling poise reads, served token for token
as transformers' own ``generate(do_sample=False)`` runs them.

Each case builds a small random model with transformers' config class, saves it with
``save_pretrained`` (today's format: ``rope_parameters``, ``layer_types``, ``dtype``), and
compares greedy tokens on prompts of mixed lengths, several longer than the sliding window or
the rotary threshold where the case has one. Some cases rewrite config.json into an older
spelling (top-level ``rope_theta`` + ``rope_scaling``) to show both are read alike.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from poise import LLM, SamplingParams
from poise.engine.intake import RequestOptions
from testconfigs import TINY_HF_CONFIG

MAX_NEW = 20
PROMPTS = [
    [1, *range(10, 15)],
    [1, *range(20, 47)],
    [1, *range(100, 160)],  # longer than every window and rotary threshold below
    [1, *range(100, 160), *range(300, 320)],  # shares 61 tokens with the one before
]
SMALL = {**TINY_HF_CONFIG, "vocab_size": 512}
LONGROPE_SHORT = [1.0 + 0.05 * i for i in range(4)]
LONGROPE_LONG = [1.5 + 0.5 * i for i in range(4)]


def _old_spelling(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's config.json: rope_theta at the top, scaling in rope_scaling."""
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    config["torch_dtype"] = config.pop("dtype", "float32")
    return config


CASES: dict[str, tuple[Any, Any]] = {
    "llama-rope-base-in-rope-parameters": (
        LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        None,
    ),
    "llama-old-spelling": (
        LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        _old_spelling,
    ),
    "llama3-scaling": (
        LlamaConfig(
            **SMALL,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        None,
    ),
    "llama-linear-scaling-old-spelling": (
        LlamaConfig(
            **SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        ),
        _old_spelling,
    ),
    "llama-dynamic-scaling": (
        LlamaConfig(
            **SMALL,
            max_position_embeddings=40,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
        ),
        None,
    ),
    "llama-untied-attention-bias": (
        LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        None,
    ),
    "qwen2-yarn-tied": (
        Qwen2Config(
            **SMALL,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        None,
    ),
    "qwen2-sliding-window-upper-layers": (
        Qwen2Config(
            **{**SMALL, "num_hidden_layers": 3},
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        None,
    ),
    "mistral-sliding-window": (
        MistralConfig(**SMALL, sliding_window=12, head_dim=24),
        None,
    ),
    "qwen3-qk-norm": (
        Qwen3Config(
            **SMALL, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
        None,
    ),
    "qwen3-sliding-window-all-layers": (
        Qwen3Config(
            **SMALL,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=10,
            max_window_layers=0,
            tie_word_embeddings=True,
        ),
        None,
    ),
    "phi3-partial-rotary-sliding-window": (
        Phi3Config(
            **SMALL,
            sliding_window=16,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            partial_rotary_factor=0.5,
        ),
        None,
    ),
    "phi3-longrope": (
        Phi3Config(
            **SMALL,
            pad_token_id=0,
            max_position_embeddings=256,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": LONGROPE_SHORT * 2,
                "long_factor": LONGROPE_LONG * 2,
            },
        ),
        None,
    ),
}

# Beyond the roomy default: chunked prefill, a pool so small that requests are preempted and
# windowed blocks must come back, and PyTorch's attention instead of the native kernel.
SETUPS: dict[str, dict[str, Any]] = {
    "default": {},
    # A pool too small for the prompts at once, started optimistically: preemption happens.
    "tight": {
        "num_kv_blocks": 40,
        "block_size": 4,
        "max_num_batched_tokens": 24,
        "kv_admission": "optimistic",
    },
    "pytorch-attention": {"native_kernels": False, "block_size": 4, "max_num_batched_tokens": 24},
}


def _build(name: str, root: Path, tokenizer_dir: Path) -> Path:
    config, rewrite = CASES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms at 1.0 hide mistakes in their handling: perturb them
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.add_(0.2 * torch.randn_like(param))
    path = root / name
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)
    if rewrite is not None:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(rewrite(raw)))
    return path


def _reference(path: Path) -> list[list[int]]:
    """Each prompt alone, as transformers generates it; dynamic rope keeps state from one call
    to the next in transformers, so that case gets a freshly loaded model per prompt."""
    out = []
    hf = None
    for prompt in PROMPTS:
        if hf is None or "dynamic" in path.name:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        ids = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is no padding here
            do_sample=False,
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, llama_dir) -> dict[str, tuple[Path, list[list[int]]]]:
    root = tmp_path_factory.mktemp("hf-checkpoints")
    built = {}
    for name in CASES:
        path = _build(name, root, llama_dir)
        built[name] = (path, _reference(path))
    return built


# PyTorch's attention path differs from the native kernel's only in how it reads the cache:
# windows and length-dependent rotations are where it has something of its own to get right.
MATRIX = [
    (case, setup)
    for case in CASES
    for setup in SETUPS
    if setup != "pytorch-attention"
    or any(key in case for key in ("window", "dynamic", "longrope", "phi3"))
]


@pytest.mark.parametrize(("case", "setup"), MATRIX)
def test_greedy_matches_transformers(checkpoints, case, setup):
    path, reference = checkpoints[case]
    llm = LLM(path, dtype="float32", **SETUPS[setup])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    assert [o.outputs[0].token_ids for o in outs] == reference
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks  # every block came back
    if setup == "tight" and llm.engine.model.config.kv_window is None:
        # (With a window on every layer the blocks out of it come back and nobody is.)
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_references_are_not_degenerate(checkpoints):
    """Guard the comparison itself: random models that repeat one token would prove little."""
    for path, reference in checkpoints.values():
        assert all(len(set(tokens)) >= 4 for tokens in reference), path.name


@pytest.mark.parametrize("case", ["mistral-sliding-window", "qwen3-sliding-window-all-layers"])
def test_sliding_window_gives_blocks_back_while_generating(checkpoints, case):
    """With a window on every layer, a long request holds a window's worth of blocks, not its
    whole length, and the blocks it gave back serve others."""
    path, reference = checkpoints[case]
    llm = LLM(path, dtype="float32", block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    window = engine.model.config.kv_window
    assert window is not None
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    request, _ = engine.prepare_request(PROMPTS[3], RequestOptions(sp))
    engine.add_request(request)
    held: list[int] = []
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
        held.append(engine.kv.num_blocks - engine.kv.num_free_blocks)
    total_blocks = -(-(len(PROMPTS[3]) + MAX_NEW) // 4)
    # The prefill takes the whole prompt at once; from then on only the window is kept.
    assert max(held[1:]) <= window // 4 + 2 < total_blocks
    assert outputs[-1].outputs[0].token_ids == reference[3]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_tied_checkpoint_that_stores_its_own_head_uses_it(checkpoints, tmp_path):
    """tie_word_embeddings with a distinct lm_head.weight in the file: transformers unties them
    and uses the stored head; so does poise."""
    from safetensors.torch import load_file, save_file

    src, _ = checkpoints["qwen2-yarn-tied"]
    path = tmp_path / "untied"
    shutil.copytree(src, path)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = embed + 0.2 * torch.randn_like(embed)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    reference = _reference(path)
    assert reference != checkpoints["qwen2-yarn-tied"][1]  # the stored head changes the output
    llm = LLM(path, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    assert [o.outputs[0].token_ids for o in outs] == reference
