"""Linear layers whose every row comes out the same whatever else is in the batch.

A step's tokens go through each projection as one matrix of T rows, and T follows the batch.
oneDNN (and the CUDA libraries alike) choose a kernel by the shape: here, measured on torch
2.13's CPU build, a single row takes a matrix-vector path whose sums run in another order than
the matrix-matrix kernel every larger row count gets, so a token decoded alone and the same
token decoded beside others differ in their last bits, and in bfloat16 the answers part after a
few dozen tokens. ``RowStableLinear`` never lets a layer see fewer than ``MIN_ROWS`` rows (a
lone row is computed beside a copy of itself).

No library offers this on the CPU, and whether a kernel keeps each row's arithmetic fixed is a
property of the build and the processor: ``check_row_invariance`` measures it at load for each
distinct layer shape, at row counts up to the step's token budget, and the deterministic mode
refuses to start, naming the layer, where it does not hold rather than promise what it cannot.
"""

from __future__ import annotations

import torch
from torch import nn

from poise.engine.errors import ModelLoadError
from poise.engine.kernels import PagedDecodeAttention
from poise.engine.models.int8_linear import Int8Linear
from poise.engine.models.packed_linear import PackedLinear

MIN_ROWS = 2
# Row counts the load-time check compares (capped by the step's token budget).
CHECKED_ROWS = (*range(2, 34), 48, 64, 100, 128, 256, 512, 1024, 2048)


class BatchVariantError(ModelLoadError):
    """The deterministic mode cannot hold here: a layer's result for a row depends on the
    batch's row count on this machine, or a kernel it needs is missing."""


class RowStableLinear(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.in_features = int(inner.in_features)
        self.out_features = int(inner.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] != 1:
            return self.inner(x)
        out = self.inner(flat.expand(MIN_ROWS, -1).contiguous())[:1]
        return out.view(*x.shape[:-1], self.out_features)


LINEAR_TYPES = (nn.Linear, PackedLinear, Int8Linear)


def require_attention_kernel(model: nn.Module, kernel: PagedDecodeAttention | None) -> None:
    """The mode sends every token's attention through poise's native kernel: refuse it, saying
    why, where the kernel cannot run this model."""
    param = next(model.parameters())
    c = model.config  # type: ignore[attr-defined]
    group = c.num_heads // c.num_kv_heads
    if kernel is None or not kernel.supports(param.dtype, param.device, group, c.head_dim):
        raise BatchVariantError(
            "deterministic mode needs poise's native attention kernel: native_kernels on, "
            "a C compiler with OpenMP, float32 or bfloat16 on the CPU, at most 16 query "
            "heads per KV head and head_dim at most 256"
        )


def stabilise_linears(model: nn.Module) -> list[str]:
    """Wrap every linear layer of ``model`` (the LM head included); their names."""
    targets = [
        (parent, name, child, f"{prefix}.{name}" if prefix else name)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, LINEAR_TYPES) and not isinstance(parent, RowStableLinear)
    ]
    for parent, name, child, _ in targets:
        setattr(parent, name, RowStableLinear(child))
    return [full for *_, full in targets]


def check_row_invariance(model: nn.Module, dtype: torch.dtype, max_rows: int) -> None:
    """Raise ``BatchVariantError`` naming the first layer (one per kind and shape) whose row
    results change with the row count, up to ``max_rows``; ``dtype``: the activations'."""
    seen: set[tuple[str, int, int]] = set()
    gen = torch.Generator().manual_seed(0)
    counts = sorted({MIN_ROWS, max_rows, *(n for n in CHECKED_ROWS if n <= max_rows)})
    total = counts[-1]
    for name, layer in model.named_modules():
        if not isinstance(layer, RowStableLinear):
            continue
        key = (type(layer.inner).__name__, layer.in_features, layer.out_features)
        if key in seen:
            continue
        seen.add(key)
        device = next(layer.parameters(), torch.empty(0)).device
        x = torch.randn(total, layer.in_features, generator=gen).to(device, dtype)
        with torch.inference_mode():
            whole = layer(x)
            # Each size at the head and the tail of the batch, and a lone row, as a decode
            # step alone computes it, against the same rows computed all together.
            trials = [(start, n) for n in counts for start in (0, total - n)] + [(0, 1)]
            for start, n in trials:
                if not torch.equal(layer(x[start : start + n].clone()), whole[start : start + n]):
                    raise BatchVariantError(
                        f"deterministic mode: layer {name} ({key[0]}, {key[1]} -> {key[2]}, "
                        f"{str(dtype).removeprefix('torch.')}) gives a row another result in a "
                        f"batch of {n} rows than of {total} on this machine: its answers cannot "
                        "be made independent of the batch here"
                    )
