"""The deterministic mode's element-wise kernels: a value's result never depends on the tensor it
is computed in (its size, its row, the thread count), and it is PyTorch's result, in bfloat16
to the bit on these inputs and in float32 within a few units in the last place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from poise.engine.kernels.row_ops import RowOps, load_row_ops
from poise.engine.models.rope import RotaryEmbedding
from poise.engine.models.rope_spec import RopeSpec


@pytest.fixture(scope="module")
def ops() -> RowOps:
    built = load_row_ops()
    assert built is not None, "the C kernels should build wherever the tests run"
    return built


def _gate_up(rows: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("inter", [37, 1000, 1536])
def test_silu_and_mul_is_pytorchs(ops, inter):
    f32 = _gate_up(300, inter, torch.float32)
    got, want = ops.silu_and_mul(f32), _torch_silu_and_mul(f32)
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(1e-30)
    assert bool(((got - want).abs() <= 4 * ulp).all())
    bf16 = f32.bfloat16()
    assert torch.equal(ops.silu_and_mul(bf16), _torch_silu_and_mul(bf16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_keeps_infinities_nans_and_extremes(ops, dtype):
    inf, nan = float("inf"), float("nan")
    values = [0.0, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, -200.0]
    gate = torch.tensor([*values, 1e-30, inf, -inf, nan]).to(dtype)
    got = ops.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    torch.testing.assert_close(got, F.silu(gate), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_out_the_same_in_any_batch_and_on_any_thread_count(ops, dtype):
    """Rows alone, at the head and the tail of batches of many sizes, on one and two threads:
    one answer. (Sizes past PyTorch's grain of 32768 values are split between threads.) On the
    2-core AVX-512 machine this was written on, ``F.silu(gate) * up`` fails this same check in
    float32 in 2 of its 24 cases, and ``F.silu`` on a contiguous gate in 20.)"""
    threads = torch.get_num_threads()
    inter = 1000
    batch = _gate_up(301, inter, dtype, seed=1)
    alone = torch.cat([ops.silu_and_mul(batch[i : i + 1]) for i in range(batch.shape[0])])
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for n in (2, 3, 17, 33, 150, 301):
                for start in (0, batch.shape[0] - n):
                    rows = slice(start, start + n)
                    assert torch.equal(ops.silu_and_mul(batch[rows]), alone[rows]), (n, start)
    finally:
        torch.set_num_threads(threads)


def test_the_rotary_rows_are_transformers_and_follow_no_batch(ops):
    rope = RotaryEmbedding(RopeSpec("default", 10000.0, 64, 64, 4096), max_len=4096)
    positions = torch.arange(0, 4000, 3)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = ops.rope_table(positions, inv, 1.0)
    want_cos, want_sin = rope._table(positions, inv)  # PyTorch's, as transformers computes them
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2.5e-7)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2.5e-7)
    scaled_cos, scaled_sin = ops.rope_table(positions, inv, 1.25)  # an attention factor
    assert torch.equal(scaled_cos, cos * 1.25) and torch.equal(scaled_sin, sin * 1.25)
    for n in (1, 2, 5, 100):
        part_cos, part_sin = ops.rope_table(positions[-n:], inv, 1.0)
        assert torch.equal(part_cos, cos[-n:]) and torch.equal(part_sin, sin[-n:])
