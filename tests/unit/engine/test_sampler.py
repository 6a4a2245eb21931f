"""The sampler on hand-made logits: edge temperatures must not break a step, and the penalties
and filters are transformers' own (compared with its logits processors) in vLLM's order."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from poise.engine.request import SamplingParams
from poise.engine.sampler import SampleRow, _apply_penalties, sample


def _row(
    prompt: list[int] | None = None, output: list[int] | None = None, draw_seed: int = 0, **params
) -> SampleRow:
    gen = torch.Generator().manual_seed(draw_seed)
    return SampleRow(SamplingParams(**params), prompt or [], output or [], gen)


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-30, 9e-6])
def test_vanishing_temperature_is_greedy(temperature: float) -> None:
    logits = torch.tensor([[1.0, 30.0, 2.0, 29.9]])
    (out,) = sample(logits, [_row(temperature=temperature)], frozenset())
    assert out.token_id == 1


def test_huge_temperature_still_samples_a_valid_token() -> None:
    logits = torch.randn(4, 50)
    rows = [_row(temperature=1e300, top_p=0.5, top_k=7) for _ in range(4)]
    for out in sample(logits, rows, frozenset()):
        assert 0 <= out.token_id < 50


@pytest.mark.parametrize("temperature", [1.0, 1e-5])
def test_a_denormal_repetition_penalty_samples_among_the_seen_positive_tokens(
    temperature: float,
) -> None:
    # Dividing by 5e-324 overflows every seen token with a positive logit to +inf; the step
    # failed with NaN probabilities (found by the schema fuzzer). Those tokens stay the
    # likeliest, equally, and a draw picks one of them.
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.0, 5.0]])
    drawn = {
        sample(
            logits.clone(),
            [_row([1, 2, 3], temperature=temperature, repetition_penalty=5e-324, draw_seed=s)],
            frozenset(),
        )[0].token_id
        for s in range(40)
    }
    assert drawn == {1, 3}


def test_min_tokens_bans_eos_even_when_it_dominates() -> None:
    logits = torch.tensor([[0.0, 100.0, 1.0]])
    (out,) = sample(logits, [_row(temperature=0.0, min_tokens=2)], frozenset({1}))
    assert out.token_id == 2


VOCAB = 64


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(2, VOCAB, generator=gen) * 3
        prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
        output = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        rows = [
            _row(prompt, output, temperature=0, repetition_penalty=penalty),
            _row(prompt[:3], [], temperature=0, repetition_penalty=penalty),
        ]
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        expected = [
            hf(torch.tensor([prompt + output]), logits[:1].clone())[0],
            hf(torch.tensor([prompt[:3]]), logits[1:].clone())[0],
        ]
        for row, logit_row, want in zip(rows, logits, expected, strict=True):
            penalised = logit_row.clone()
            _apply_penalties(penalised, row.sampling, row.prompt_token_ids, row.output_token_ids)
            assert torch.equal(penalised, want)
        got = sample(logits, rows, frozenset())
        assert [o.token_id for o in got] == [int(e.argmax()) for e in expected]


def test_repetition_penalty_sampling_draws_equal_transformers():
    # A sampled row draws from softmax(penalised / T): with the same generator, the same
    # token as from transformers' penalised logits.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, VOCAB, generator=gen) * 2
    prompt, output = [3, 5, 5, 9, 40], [9, 11]
    penalised = RepetitionPenaltyLogitsProcessor(1.5)(
        torch.tensor([prompt + output]), logits.clone()
    )[0]
    for seed in range(50):
        row = _row(prompt, output, draw_seed=seed, temperature=0.7, repetition_penalty=1.5)
        (ours,) = sample(logits, [row], frozenset())
        theirs = torch.multinomial(
            (penalised / 0.7).softmax(-1), 1, generator=torch.Generator().manual_seed(seed)
        )
        assert ours.token_id == int(theirs)


def test_repetition_penalty_covers_the_prompt_and_one_is_off():
    logits = torch.tensor([[5.0, 4.0, 1.0, -3.0]])
    (out,) = sample(logits, [_row([0], [], temperature=0, repetition_penalty=2.0)], frozenset())
    assert out.token_id == 1  # 5 / 2 < 4: the prompt's token 0 lost its lead
    (out,) = sample(logits, [_row([0], [0], temperature=0, repetition_penalty=1.0)], frozenset())
    assert out.token_id == 0


def test_penalties_apply_in_vllms_order():
    # repetition (prompt and output), then frequency and presence (output only), as vLLM does.
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    prompt, output = [0, 1], [2, 2]
    row = _row(
        prompt,
        output,
        temperature=0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=4,
    )
    expected = torch.tensor([2.0 / 2, -1.0 * 2, 3.0 / 2 - 2 * 0.5 - 0.25, 0.5])
    (out,) = sample(logits, [row], frozenset())
    assert out.token_id == int(expected.argmax()) == 0
    # Logprobs are still the raw distribution's.
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(float(raw[0]))


def test_min_p_draws_equal_transformers():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, VOCAB, generator=gen) * 3
    warped = MinPLogitsWarper(0.2)(torch.zeros(1, 1, dtype=torch.long), logits / 0.8)[0]
    assert 1 < int(warped.isfinite().sum()) < VOCAB  # the cut does something
    for seed in range(50):
        (ours,) = sample(logits, [_row(draw_seed=seed, temperature=0.8, min_p=0.2)], frozenset())
        theirs = torch.multinomial(
            warped.softmax(-1), 1, generator=torch.Generator().manual_seed(seed)
        )
        assert ours.token_id == int(theirs)


def test_greedy_ignores_min_p():
    logits = torch.tensor([[1.0, 3.0, 2.9]])
    (out,) = sample(logits, [_row(temperature=0, min_p=0.99)], frozenset())
    assert out.token_id == 1
