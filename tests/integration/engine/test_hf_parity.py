"""Greedy decoding token for token equal to Hugging Face transformers on the same checkpoint."""

import pytest

from hfreference import transformers_greedy
from poise import LLM, SamplingParams

MAX_NEW = 24
# Mixed lengths; the last two share a 40-token prefix with the third.
PROMPTS = [
    [1, *range(10, 13)],
    [1, *range(20, 37)],
    [1, *range(100, 140)],
    [1, *range(100, 140), 7, 8, 9],
    [1, *range(100, 140), *range(300, 331)],
]


@pytest.fixture(scope="module")
def references(model_dirs):
    return {arch: transformers_greedy(path, PROMPTS, MAX_NEW) for arch, path in model_dirs.items()}


ENGINE_SETUPS = {
    "roomy": {},
    "preempting": {
        "num_kv_blocks": 48,
        "block_size": 4,
        "max_preemptions": 2,
        "kv_admission": "optimistic",  # more start than can finish: preemption happens
    },
    "chunked": {"max_num_batched_tokens": 16},
    "no-prefix-cache": {"enable_prefix_caching": False, "max_num_seqs": 2},
    "pytorch-attention": {"native_kernels": False, "num_kv_blocks": 48, "block_size": 4},
}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_matches_transformers(model_dirs, references, arch, setup):
    llm = LLM(model_dirs[arch], dtype="float32", **ENGINE_SETUPS[setup])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == references[arch]
    engine = llm.engine
    if setup == "preempting":
        assert engine.scheduler.num_preemptions_total > 0
    if setup == "chunked":
        # Later prompts wait while the third is prefilled in chunks, then reuse its blocks.
        assert engine.kv.stats.hit_tokens > 0
    if setup == "roomy":
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
        assert [o.outputs[0].token_ids for o in again] == references[arch]
        assert sum(o.num_cached_tokens for o in again) > 0  # served from the prefix cache
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bfloat16_runs_close_to_float32(llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    f32 = LLM(llama_dir, dtype="float32").generate(prompt, sp)[0].outputs[0].token_ids
    bf16 = LLM(llama_dir, dtype="bfloat16").generate(prompt, sp)[0].outputs[0].token_ids
    assert len(bf16) == 8
    assert bf16[0] == f32[0]  # the first token survives bf16 rounding on this model
