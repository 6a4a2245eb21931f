"""`poise make-model --train`: a few seconds of training keep the path working, and the
trained directory loads in Hugging Face transformers with greedy output equal to poise's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from poise import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "model"
    run = subprocess.run(
        [sys.executable, "-m", "poise.cli", "make-model", str(out), "--train", "--minutes", "0.25"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "trained a 3.2M-parameter llama" in run.stdout  # the demo's own size
    return out


def test_training_records_what_it_did_and_the_loss_falls(trained):
    record = json.loads((trained / "training.json").read_text())
    assert record["corpus"].startswith("pydoc_data.topics")
    assert record["settings"]["seed"] == 0 and record["steps"] >= 3
    s = record["settings"]
    assert record["tokens_seen"] == record["steps"] * s["batch"] * s["seq_len"]
    # Untrained, the loss is about ln(vocab) = ln(4096) = 8.32; a few seconds already lower it.
    assert record["first_loss"] == pytest.approx(8.32, abs=0.15)
    assert record["final_loss"] < record["first_loss"] - 0.02
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (trained / name).is_file()
    chat = AutoTokenizer.from_pretrained(trained).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


def test_transformers_and_poise_agree_token_for_token(trained):
    tok = AutoTokenizer.from_pretrained(trained)
    prompts = ['The "for" statement', "A function definition"]
    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          pad_token_id=tok.eos_token_id)  # fmt: skip
        want.append(out[0, ids.shape[1] :].tolist())
    llm = LLM(trained, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
