"""Linear layers whose every row comes out the same whatever else is in the batch.

A step's tokens go through each projection as one matrix of T rows, and T follows the batch.
oneDNN (and the CUDA libraries alike) choose a kernel by the shape: here, measured on torch
2.13's CPU build, a single row takes a matrix-vector path whose sums run in another order than
the matrix-matrix kernel every larger row count gets, so a token decoded alone and the same
token decoded beside others differ in their last bits, and in bfloat16 the answers part after a
few dozen tokens. ``RowStableLinear`` never lets a layer see fewer than ``MIN_ROWS`` rows (a
lone row is computed beside a copy of itself).

Element-wise functions have the same trouble in another form: PyTorch computes most of a tensor
with vector code and what is left of each thread's share with scalar code, whose exp, sin and
cos differ in the last bit, and where the shares end follows the batch's size and the thread
count. ``stabilise_elementwise`` sends SwiGLU's activation and the per-step rotary rows of
length-dependent RoPE through poise's kernels (``kernels/row_ops.c``), which compute every value
by the same instructions.

No library offers this on the CPU, and whether a kernel keeps each row's arithmetic fixed is a
property of the build and the processor: ``check_row_invariance`` measures it at load for each
distinct layer shape and each MLP (its activation included), at row counts up to the step's
token budget, and the deterministic mode refuses to start, naming the layer, where it does not
hold rather than promise what it cannot.
"""

from __future__ import annotations

import torch
from torch import nn

from poise.engine.errors import ModelLoadError
from poise.engine.kernels import PagedDecodeAttention
from poise.engine.kernels.row_ops import RowOps
from poise.engine.models.int8_linear import Int8Linear
from poise.engine.models.layers import MLP
from poise.engine.models.packed_linear import PackedLinear
from poise.engine.models.rope import RotaryEmbedding

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


def require_native_kernels(
    model: nn.Module, attention: PagedDecodeAttention | None, row_ops: RowOps | None
) -> RowOps:
    """The mode sends every token's attention, SwiGLU activation and length-dependent rotary
    rows through poise's native kernels: refuse it, saying why, where they cannot run here;
    the element-wise kernels where they can."""
    param = next(model.parameters())
    c = model.config  # type: ignore[attr-defined]
    group = c.num_heads // c.num_kv_heads
    dtype = str(param.dtype).removeprefix("torch.")
    why = None
    if attention is None or row_ops is None:
        why = (
            "poise's native kernels are off or could not be built here (native_kernels on, "
            "a C compiler with OpenMP)"
        )
    elif param.device.type != "cpu":
        why = f"its kernels run on the CPU only, not on {param.device}"
    elif not row_ops.supports(param.dtype, param.device):
        why = f"its kernels run float32 and bfloat16, not {dtype}"
    elif not attention.supports(param.dtype, param.device, group, c.head_dim):
        why = (
            f"the native attention kernel takes at most 16 query heads per KV head ({group} "
            f"here) and head_dim at most 256 ({c.head_dim} here)"
        )
    if why is not None:
        raise BatchVariantError(
            f"deterministic mode needs poise's native attention and element-wise kernels: {why}"
        )
    return row_ops


def stabilise_elementwise(model: nn.Module, row_ops: RowOps) -> None:
    """Every MLP's ``silu(gate) * up`` and every length-dependent RoPE's per-step rows through
    ``row_ops``."""
    for module in model.modules():
        if isinstance(module, MLP):
            module.silu_and_mul = row_ops.silu_and_mul
        elif isinstance(module, RotaryEmbedding) and module.length_dependent:
            module.row_table = row_ops.rope_table


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


def _checked_modules(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, int, int]]]:
    """One of each distinct (kind, in, out) among the stable linears and the MLPs, the MLPs
    last (a linear's own failure names it more exactly)."""
    linears, mlps, seen = [], [], set()
    for name, module in model.named_modules():
        if isinstance(module, RowStableLinear):
            key = (type(module.inner).__name__, module.in_features, module.out_features)
            bucket = linears
        elif isinstance(module, MLP):
            hidden = int(module.down_proj.out_features)
            key, bucket = ("MLP", hidden, hidden), mlps
        else:
            continue
        if key not in seen:
            seen.add(key)
            bucket.append((name, module, key))
    return linears + mlps


def check_row_invariance(
    model: nn.Module, dtype: torch.dtype, max_rows: int, max_head_rows: int | None = None
) -> None:
    """Raise ``BatchVariantError`` naming the first layer (one per kind and shape) whose row
    results change with the row count, up to ``max_rows`` (the step's token budget; for the
    LM head, which sees one row per sequence, ``max_head_rows``); ``dtype``: the activations'."""
    gen = torch.Generator().manual_seed(0)
    for name, layer, key in _checked_modules(model):
        limit = min(max_rows, max_head_rows or max_rows) if name == "lm_head" else max_rows
        counts = sorted({MIN_ROWS, limit, *(n for n in CHECKED_ROWS if n <= limit)})
        total = counts[-1]
        device = next(layer.parameters(), torch.empty(0)).device
        x = torch.randn(total, key[1], generator=gen).to(device, dtype)
        with torch.inference_mode():
            whole = layer(x)
            # Each size at the head and the tail of the batch, and a lone row, as a decode
            # step alone computes it, against the same rows computed all together.
            trials = sorted({(start, n) for n in counts[:-1] for start in (0, total - n)})
            for start, n in [*trials, (0, 1)]:
                if not torch.equal(layer(x[start : start + n].clone()), whole[start : start + n]):
                    raise BatchVariantError(
                        f"deterministic mode: layer {name} ({key[0]}, {key[1]} -> {key[2]}, "
                        f"{str(dtype).removeprefix('torch.')}) gives a row another result in a "
                        f"batch of {n} rows than of {total} on this machine: its answers cannot "
                        "be made independent of the batch here"
                    )
