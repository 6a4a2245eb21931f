import math

import pytest

from poise import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = texts(llm.generate(["The for statement"], sp))[0]
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    crowd = llm.generate(["Other text", "The for statement", "More"], [other, sp, other])
    assert crowd[1].outputs[0].token_ids == alone
    again = texts(llm.generate(["The for statement"], sp))[0]
    assert again == alone
    different = texts(
        llm.generate(
            ["The for statement"],
            SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True),
        )
    )[0]
    assert different != alone


def test_top_k_one_is_greedy(llm):
    greedy = texts(
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    )
    topk = texts(
        llm.generate(
            ["Hello"],
            SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10, ignore_eos=True),
        )
    )
    assert greedy == topk


def test_max_tokens_and_length(llm):
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    free = texts(
        llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    )[0]
    stop_at = free[4]
    out = llm.generate(
        ["Hi"],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free[: free.index(stop_at) + 1]


def test_stop_string_truncates_text(llm):
    free = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = free[0].outputs[0].text
    stop = text[5:8]
    assert stop.strip(), "the model wrote too little text for this test"
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 30


def test_logprobs_are_a_distribution(llm):
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and len(lp) == 5  # greedy: the chosen token is in the top 5
        assert lp[token] == max(lp.values())
        assert all(v <= 0 for v in lp.values())
        assert sum(math.exp(v) for v in lp.values()) <= 1.0 + 1e-5


def test_penalties_change_repetitive_output(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = texts(llm.generate(["Hi"], base))[0]
    penalised = texts(
        llm.generate(
            ["Hi"],
            SamplingParams(
                temperature=0,
                max_tokens=40,
                ignore_eos=True,
                frequency_penalty=2.0,
                presence_penalty=2.0,
            ),
        )
    )[0]
    assert len(set(penalised)) > len(set(plain))


def test_min_tokens_holds_stop_tokens_back(llm):
    first = texts(llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1)))[0][0]
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    )[0].outputs[0]
    assert len(out.token_ids) >= 3
    assert first not in out.token_ids[:2]
