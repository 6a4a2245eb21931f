"""RotaryEmbedding computes a step's cos/sin rows once for all layers, and never reuses them
for other positions: a new positions tensor, or the same one changed in place, gets new rows."""

import torch

from poise.engine.models.rope import RotaryEmbedding
from poise.engine.models.rope_spec import RopeSpec


def _rope() -> RotaryEmbedding:
    rope = RotaryEmbedding(RopeSpec("default", 10000.0, 8, 8, 64), 64)
    rope.build(torch.device("cpu"))
    return rope


def _rotate(rope: RotaryEmbedding, pos: torch.Tensor) -> torch.Tensor:
    q = torch.ones(len(pos), 2, 8)
    return rope(q, q.clone(), pos)[0]


def test_rows_follow_the_positions_not_the_tensor_object():
    rope = _rope()
    pos = torch.tensor([0, 1, 2])
    first = _rotate(rope, pos)
    assert torch.equal(_rotate(rope, pos), first)  # the same step, another layer
    pos += 10  # changed in place: the cached rows must not be served
    moved = _rotate(rope, pos)
    assert torch.equal(moved, _rotate(_rope(), torch.tensor([10, 11, 12])))
    assert not torch.equal(moved, first)
    assert torch.equal(_rotate(rope, torch.tensor([0, 1, 2])), first)  # a new tensor
