"""Float32 linear layers on the CPU through oneDNN with weights packed once at load.

Why: PyTorch sends float32 ``F.linear`` to MKL, which on the AMD EPYC CPUs measured here runs
1.5-2.5x slower than oneDNN for the shapes a decode step has (64 x 512 x 3072 took 2.2 ms with
MKL and 0.9 ms with oneDNN; the 32k-wide logits projection 24.8 ms and 16.3 ms). PyTorch exposes
oneDNN's linear with a weight reordered once into its blocked layout and dense activations in
and out (``mkldnn::_linear_pointwise``, what Inductor's CPU freezing pass emits); an earlier
version converted the activations to and from oneDNN's tensor type at every call, which on a
30-layer model of hidden 576 took a tenth of each step. bfloat16 already goes through oneDNN and
is left alone.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("poise.engine")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias.detach() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def _packing_works() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = nn.Linear(8, 4)
        x = torch.randn(2, 3, 8)
        with torch.inference_mode():
            return bool(torch.allclose(PackedLinear(probe)(x), probe(x), atol=1e-5))
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN linear unavailable, using PyTorch's default: %s", exc)
        return False


def pack_linears(model: nn.Module) -> bool:
    """Swap every float32 CPU ``nn.Linear`` in the model for a ``PackedLinear``."""
    if not _packing_works():
        return False
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return bool(targets)
