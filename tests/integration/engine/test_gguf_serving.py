"""A GGUF file written from a checkpoint serves as that checkpoint does: the same tokens from the
same text for F32, the same top-1 token on nearly every step for Q8_0, and the same chat."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Phi3Config, Qwen3Config

from ggufwriter import write_gguf
from hfreference import save_transformers_checkpoint as save
from poise import LLM, SamplingParams
from testconfigs import TINY_HF_CONFIG

TEXTS = [
    "The import system",
    "def f(x):\n    return x ** 2",
    "Ünïcode — and numbers 12345 and spaces   at the end  ",
    "A longer prompt that goes on for a while, about the for statement and the while loop, "
    "the if statement, and how exceptions are raised and caught.",
]
MAX_NEW = 16
SMALL = TINY_HF_CONFIG


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-serving")
    tok = model_dirs["llama"]
    return {
        "llama": model_dirs["llama"],  # with Llama 3 rope scaling: frequency factors in GGUF
        "qwen2": model_dirs["qwen2"],  # tied embeddings, q/k/v biases
        "qwen3": save(root / "qwen3", Qwen3Config(**SMALL, head_dim=32), tok),
        "phi3": save(root / "phi3", Phi3Config(**SMALL, pad_token_id=0), tok),
    }


def _gguf(checkpoints, arch: str, tensor_type: str, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"{arch}-{tensor_type}") / f"{arch}-{tensor_type}.gguf"
    # llama.cpp's converter names the pre-tokenizer after what AutoTokenizer does with the
    # directory, and for model_type qwen2 that is Qwen2's own split (transformers ignores the
    # file's), so the GGUF of a Qwen2 directory says "qwen2".
    pre = "qwen2" if arch == "qwen2" else "gpt-2"
    return write_gguf(checkpoints[arch], out, tensor_type, pre=pre)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_f32_gguf_serves_exactly_as_the_checkpoint(checkpoints, arch, tmp_path_factory):
    path = _gguf(checkpoints, arch, "F32", tmp_path_factory)
    from_dir = LLM(checkpoints[arch], dtype="float32")
    from_gguf = LLM(path, dtype="float32")
    # The text goes through the GGUF's own tokenizer: its ids must be the directory's.
    want = from_dir.generate(TEXTS, GREEDY)
    got = from_gguf.generate(TEXTS, GREEDY)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_gguf_in_a_directory_chats_with_its_own_template(checkpoints, tmp_path_factory):
    path = _gguf(checkpoints, "llama", "F32", tmp_path_factory)
    folder = path.parent  # a directory holding one .gguf and nothing else
    messages = [{"role": "user", "content": "What does the for statement do?"}]
    want = LLM(checkpoints["llama"], dtype="float32").chat(messages, GREEDY)
    got = LLM(folder, dtype="float32").chat(messages, GREEDY)
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def _teacher_forced_agreement(reference: LLM, quantized: LLM, prompts: list[list[int]]) -> float:
    """Share of greedy steps where the quantized model's top-1 token is the reference's, each
    step given the reference's own tokens so far (one divergence does not end the count)."""
    ref = reference.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    contexts, wanted = [], []
    for prompt, out in zip(prompts, ref, strict=True):
        tokens = out.outputs[0].token_ids
        for k, token in enumerate(tokens):
            contexts.append({"prompt_token_ids": prompt + tokens[:k]})
            wanted.append(token)
    one = SamplingParams(temperature=0, max_tokens=1, min_tokens=1)
    got = [o.outputs[0].token_ids[0] for o in quantized.generate(contexts, one)]
    return sum(g == w for g, w in zip(got, wanted, strict=True)) / len(wanted)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_q8_0_gguf_keeps_the_top_token(checkpoints, arch, tmp_path_factory, record_property):
    path = _gguf(checkpoints, arch, "Q8_0", tmp_path_factory)
    reference = LLM(checkpoints[arch], dtype="float32")
    prompts = [o.prompt_token_ids for o in reference.generate(TEXTS, GREEDY)]
    agreement = _teacher_forced_agreement(reference, LLM(path, dtype="float32"), prompts)
    record_property("q8_0_top1_agreement", agreement)
    print(f"{arch} Q8_0 top-1 agreement: {agreement:.3f}")
    assert agreement >= 0.95
