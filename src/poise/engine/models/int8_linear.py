"""Weight-only int8 linear layers (``--quantization int8``): one scale per output channel.

Why: at batch 1 a decode step reads every weight once per token, so its time is the weights'
bytes; int8 holds a quarter of float32's and half of bfloat16's. torch ships the kernel,
``aten._weight_int8pack_mm`` (``x @ (q * scales[:, None]).T`` for x of shape (M, K), int8 q of
(N, K) and one scale per row), so poise writes none. Only the linear layers change: the
embedding, norms, KV pool, attention and sampling keep the model's dtype.

The scales are symmetric, ``max |w| / 127`` of each output row, computed from float32 weights
as they arrive from the checkpoint. Rows quantize on their own, so fusing q/k/v and gate/up
(``llama.py``) is fusing already-quantized rows. A GGUF's Q8_0 tensors arrive the same way:
their int8 values times their per-32 block scales are exact in float32, and are rounded once to
this per-row layout; the kernel takes one scale per row, so Q8_0's block scales cannot be used as
they are.

On the CPU the kernel is fast only with bfloat16 activations (on an AVX2 host, float32 ones
took 7-20x as long), so activations are rounded to bfloat16 for the product and the result comes
back in the model's dtype. That kernel is a matrix-vector loop: for more than ``GEMV_ROWS`` rows
of float32 activations (a prefill) the weights are dequantized for the call and float32 GEMM
runs instead (256 rows of W3's shape: TTFT 1.93 s -> 1.43 s). On CUDA the activations keep the
model's dtype; that path has not run on a GPU yet (no GPU was lent while it was written), and its
speed is unmeasured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from poise.engine.errors import ModelLoadError

QUANTIZATIONS = ("int8",)


def check_quantization(value: str | None) -> str | None:
    if value is not None and value not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization {value!r} is not one of: {', '.join(QUANTIZATIONS)} (or none)"
        )
    return value


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales) with ``weight ≈ q * scales[:, None]``."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.scales = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._kernel_scales: torch.Tensor | None = None

    def load_rows(self, tensor: torch.Tensor, offset: int | None, size: int | None) -> None:
        """Quantize a float tensor of whole rows into rows ``offset:offset + size``."""
        q, scales = quantize_rows(tensor)
        rows = slice(None) if offset is None else slice(offset, offset + (size or 0))
        self.weight.data[rows] = q.to(self.weight.device)
        self.scales.data[rows] = scales.to(self.scales.device, self.scales.dtype)
        self._kernel_scales = None

    def kernel_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.bfloat16 if x.device.type == "cpu" else x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel() > self.in_features * GEMV_ROWS
        ):
            # A prefill's many rows: torch's int8 kernel is a matrix-vector loop, slower than
            # float32 GEMM with the weights dequantized for this call (measured at 256 rows).
            weight = self.weight.to(torch.float32) * self.scales.float()[:, None]
            return F.linear(x, weight, self.bias)
        dtype = self.kernel_dtype(x)
        if self._kernel_scales is None or self._kernel_scales.dtype != dtype:
            self._kernel_scales = self.scales.data.to(dtype)
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self._kernel_scales)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


# Above this many rows of float32 activations on the CPU, dequantize and use float32 GEMM.
GEMV_ROWS = 16

# torch 2.13's CPU kernel reads past the row (NaN, or a crash) when K is not a multiple of 8.
K_MULTIPLE = 8


def quantize_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of a model still on the meta device for an ``Int8Linear`` whose
    rows the checkpoint's weights fill (``load_rows``). Returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    names = {id(m): n for n, m in model.named_modules()}
    for _, _, child in targets:
        if child.in_features % K_MULTIPLE:
            raise ModelLoadError(
                f"quantization int8: {names[id(child)]} has {child.in_features} input features; "
                f"torch's int8 kernel needs a multiple of {K_MULTIPLE}"
            )
    for parent, name, child in targets:
        setattr(
            parent,
            name,
            Int8Linear(child.in_features, child.out_features, child.bias is not None),
        )
    return len(targets)


def check_kernel(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse at load where torch has no int8 weight kernel for the device and dtype."""
    # A layer of a real model's proportions: with 4 output rows torch 2.13's CPU kernel read
    # past the weight and crashed the process now and then (a segfault, seen in the suite).
    probe = Int8Linear(64, 64, bias=False).to(device)
    probe.load_rows(torch.randn(64, 64), None, None)
    try:
        probe(torch.randn(2, 64, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"quantization int8: torch {torch.__version__} has no int8 weight matmul kernel on "
            f"{device} ({str(exc).splitlines()[0]})"
        ) from exc
