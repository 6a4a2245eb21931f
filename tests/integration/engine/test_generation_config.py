"""generation_config.json end to end, and repetition_penalty against transformers.

A copy of the tiny Llama gets a generation_config.json whose eos list adds a token greedy
decoding (with repetition_penalty 1.3) reaches a few tokens in, and whose sampling defaults are
greedy, that penalty and a max_new_tokens. ``LLM`` and the HTTP server must honour them where a
call leaves the fields unset, give way where it sets them, and with ``none`` keep only the eos
ids. Transformers is the reference for what repetition_penalty does to greedy decoding.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from poise import LLM, SamplingParams
from poise.engine.errors import ModelLoadError
from serverproc import ServerProcess

PROMPT = [1, *range(100, 130)]
PENALTY = 1.3
MAX_NEW = 6  # the file's max_new_tokens
REF_LEN = 20


# ----- repetition_penalty: token for token as transformers -----

PARITY_PROMPTS = [PROMPT, [1, *range(20, 37)], [1, 5, 5, 5, 9, 9, 40, 41, 42]]


@pytest.mark.parametrize("setup", [{}, {"max_num_batched_tokens": 8, "block_size": 4}])
def test_greedy_with_repetition_penalty_matches_transformers(llama_dir, setup):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    expected = []
    for p in PARITY_PROMPTS:
        out = hf.generate(
            torch.tensor([p]),
            do_sample=False,
            repetition_penalty=PENALTY,
            max_new_tokens=REF_LEN,
            min_new_tokens=REF_LEN,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    # generation_config none: nothing but the request's own parameters.
    llm = LLM(llama_dir, generation_config="none", **setup)
    sp = SamplingParams(
        temperature=0, repetition_penalty=PENALTY, max_tokens=REF_LEN, ignore_eos=True
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], sp)
    assert [o.outputs[0].token_ids for o in outs] == expected
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in PARITY_PROMPTS],
        SamplingParams(temperature=0, max_tokens=REF_LEN, ignore_eos=True),
    )
    assert [o.outputs[0].token_ids for o in plain] != expected  # the penalty mattered


# ----- a model whose generation_config.json sets defaults -----


class Case:
    """The copied model and what its greedy, penalised decoding of PROMPT looks like."""

    def __init__(self, model: Path, penalised: list[int], plain: list[int], stop_at: int) -> None:
        self.model = model
        self.penalised = penalised  # greedy with repetition_penalty, eos ignored
        self.plain = plain  # greedy without it
        self.stop_at = stop_at  # index in penalised of the token the file adds as eos
        self.stop_token = penalised[stop_at]

    @property
    def stopped(self) -> list[int]:
        return self.penalised[: self.stop_at + 1]


@pytest.fixture(scope="module")
def case(llama_dir, tmp_path_factory) -> Case:
    llm = LLM(llama_dir, generation_config="none")
    base = SamplingParams(temperature=0, max_tokens=REF_LEN, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPT}]
    plain = llm.generate(prompt, base)[0].outputs[0].token_ids
    base.repetition_penalty = PENALTY
    penalised = llm.generate(prompt, base)[0].outputs[0].token_ids
    eos = set(llm.engine.eos_token_ids)
    differ = next(i for i, (a, b) in enumerate(zip(plain, penalised, strict=True)) if a != b)
    # A token first reached after the two decodings part, so only the penalised one stops there.
    stop_at = next(
        i
        for i in range(max(differ, 2), MAX_NEW - 1)
        if penalised[i] not in penalised[:i] and penalised[i] not in eos
    )
    model = tmp_path_factory.mktemp("genconfig") / "llama"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 0,
                "eos_token_id": [*sorted(eos), penalised[stop_at]],
                "do_sample": True,
                "temperature": 0.0,
                "repetition_penalty": PENALTY,
                "max_new_tokens": MAX_NEW,
            }
        )
    )
    return Case(model, penalised, plain, stop_at)


def test_llm_takes_the_files_defaults_when_given_no_sampling_params(case, caplog):
    with caplog.at_level(logging.INFO, logger="poise.engine"):
        llm = LLM(case.model)
    assert f"temperature=0.0, repetition_penalty={PENALTY}, max_tokens={MAX_NEW}" in caplog.text
    defaults = llm.get_default_sampling_params()
    # max_tokens stays unset: the intake applies the file's max_new_tokens within the context.
    assert (defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (
        0.0,
        PENALTY,
        None,
    )
    out = llm.generate([{"prompt_token_ids": PROMPT}])[0].outputs[0]
    assert out.token_ids == case.stopped  # greedy, penalised, and stopped by the file's eos
    assert out.finish_reason == "stop" and out.stop_reason is None
    chat = llm.chat([{"role": "user", "content": "Tell me about exceptions"}])[0].outputs[0]
    assert len(chat.token_ids) <= MAX_NEW
    # Given SamplingParams are the caller's whole say, as in vLLM: no file defaults in them.
    mine = SamplingParams(temperature=0, max_tokens=REF_LEN, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], mine)[0].outputs[0]
    assert out.token_ids == case.plain


def test_llm_with_none_takes_no_defaults_but_still_stops_at_the_files_eos(case):
    llm = LLM(case.model, generation_config="none")
    assert llm.get_default_sampling_params() == SamplingParams()
    sp = SamplingParams(temperature=0, repetition_penalty=PENALTY, max_tokens=REF_LEN)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp)[0].outputs[0]
    assert out.token_ids == case.stopped
    assert out.finish_reason == "stop"


def test_a_file_poise_cannot_honour_fails_the_load_unless_none(case, tmp_path):
    model = tmp_path / "beams"
    shutil.copytree(case.model, model)
    (model / "generation_config.json").write_text(json.dumps({"num_beams": 4, "eos_token_id": 2}))
    with pytest.raises(ModelLoadError, match="num_beams"):
        LLM(model)
    assert 2 in LLM(model, generation_config="none").engine.eos_token_ids


def test_max_length_bounds_requests_without_max_tokens(case, tmp_path):
    model = tmp_path / "max_length"
    shutil.copytree(case.model, model)
    (model / "generation_config.json").write_text(json.dumps({"max_length": len(PROMPT) + 4}))
    llm = LLM(model)
    prompt = [{"prompt_token_ids": PROMPT}]
    unset = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    assert len(llm.generate(prompt, unset)[0].outputs[0].token_ids) == 4
    given = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    assert len(llm.generate(prompt, given)[0].outputs[0].token_ids) == 9


def test_max_new_tokens_is_a_default_capped_by_the_context(case, tmp_path):
    """A file's max_new_tokens longer than what the context leaves is a cap, not an error."""
    model = tmp_path / "long_default"
    shutil.copytree(case.model, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100_000}))
    llm = LLM(model, max_model_len=len(PROMPT) + 6)
    unset = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], unset)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    defaults = llm.get_default_sampling_params()
    assert defaults.max_tokens is None
    assert len(llm.generate([{"prompt_token_ids": PROMPT}])[0].outputs[0].token_ids) <= 6


# ----- the HTTP server -----


def _post(server: ServerProcess, path: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


def _complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    r = _post(server, "/v1/completions", prompt=PROMPT, **body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def auto_server(case, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(case.model, tmp_path_factory.mktemp("logs"), "--max-model-len", "256")
    yield proc
    proc.stop()


def test_server_defaults_fill_only_what_the_request_leaves_unset(case, auto_server):
    greedy = _complete(auto_server, temperature=0, repetition_penalty=PENALTY, max_tokens=12)
    omitted = _complete(auto_server, max_tokens=12)
    assert omitted["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert omitted["choices"][0]["finish_reason"] == "stop"  # the file's extra eos id
    assert omitted["usage"]["completion_tokens"] == len(case.stopped)
    # A request's own values win: no penalty gives the plain greedy text, eos ignored.
    plain = _complete(
        auto_server, temperature=0, repetition_penalty=1.0, max_tokens=12, ignore_eos=True
    )
    penalised = _complete(auto_server, max_tokens=12, ignore_eos=True)
    assert plain["choices"][0]["text"] != penalised["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] == 12
    sampled = _complete(auto_server, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    assert sampled["choices"][0]["text"] != penalised["choices"][0]["text"]


def test_server_max_new_tokens_is_chats_default_max_tokens(auto_server):
    messages = [{"role": "user", "content": "Tell me about exceptions"}]
    r = _post(auto_server, "/v1/chat/completions", messages=messages, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_NEW
    r = _post(auto_server, "/v1/chat/completions", messages=messages, ignore_eos=True, max_tokens=9)
    assert r.json()["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize("value", [0, -1.5])
def test_server_refuses_a_bad_repetition_penalty(auto_server, value):
    r = _post(auto_server, "/v1/completions", prompt="x", repetition_penalty=value)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "repetition_penalty"


def test_server_with_none_takes_no_defaults_but_stops_at_the_files_eos(case, tmp_path):
    # In a thread of the HTTP process, so the in-process engine client is covered too.
    server = ServerProcess(
        case.model,
        tmp_path,
        "--max-model-len",
        "256",
        "--generation-config",
        "none",
        "--engine-in-thread",
    )
    try:
        omitted = _complete(server, seed=7, max_tokens=12, ignore_eos=True)
        explicit = _complete(server, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)
        assert omitted["choices"][0]["text"] == explicit["choices"][0]["text"]
        stopped = _complete(server, temperature=0, repetition_penalty=PENALTY, max_tokens=12)
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == len(case.stopped)
    finally:
        server.stop()


def test_server_honours_min_p_from_the_request(auto_server):
    """min_p=1 keeps only the most likely token: sampling at any temperature is then greedy."""
    common = {"repetition_penalty": 1.0, "max_tokens": 12, "ignore_eos": True}
    greedy = _complete(auto_server, temperature=0, **common)
    for seed in (1, 2, 3):
        kept = _complete(auto_server, temperature=1.5, seed=seed, min_p=1.0, **common)
        assert kept["choices"][0]["text"] == greedy["choices"][0]["text"]
    free = [
        _complete(auto_server, temperature=1.5, seed=s, min_p=0.0, **common)["choices"][0]["text"]
        for s in (1, 2, 3)
    ]
    assert any(text != greedy["choices"][0]["text"] for text in free)
    r = _post(auto_server, "/v1/completions", prompt="x", min_p=1.5)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_p"
