"""The sampler on hand-made logits: edge temperatures must not break a step."""

import pytest
import torch

from poise.engine.request import SamplingParams
from poise.engine.sampler import SampleRow, sample


def _row(**params: object) -> SampleRow:
    gen = torch.Generator().manual_seed(0)
    return SampleRow(SamplingParams(**params), [], gen)  # type: ignore[arg-type]


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


def test_min_tokens_bans_eos_even_when_it_dominates() -> None:
    logits = torch.tensor([[0.0, 100.0, 1.0]])
    (out,) = sample(logits, [_row(temperature=0.0, min_tokens=2)], frozenset({1}))
    assert out.token_id == 2
