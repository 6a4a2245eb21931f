"""A checkpoint (Hugging Face directory or GGUF file) → a ready model on its device."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poise.engine.errors import ModelLoadError
from poise.engine.models.checkpoint import Checkpoint, open_checkpoint
from poise.engine.models.config import ModelConfig
from poise.engine.models.int8_linear import check_kernel, check_quantization, quantize_linears
from poise.engine.models.llama import LlamaForCausalLM
from poise.engine.models.packed_linear import pack_linears
from poise.engine.models.phi3 import Phi3ForCausalLM

log = logging.getLogger("poise.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def resolve_dtype(
    dtype: str | torch.dtype, config: ModelConfig | None = None, device: torch.device | None = None
) -> torch.dtype:
    """``auto`` is the checkpoint's own dtype, as transformers 5 loads it; float16 becomes
    float32 on the CPU, where half-precision matrix products are slow (more precise, never
    less)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        own = (config.dtype if config else None) or "float32"
        if own not in DTYPES:
            raise ModelLoadError(f"config.json dtype {own!r} is not one of {', '.join(DTYPES)}")
        if own == "float16" and (device is None or device.type == "cpu"):
            log.info("checkpoint is float16; running float32 on the CPU")
            own = "float32"
        return DTYPES[own]
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    """CPU unless CUDA is asked for (``cuda`` / ``auto``) and present."""
    if device in (None, "cpu"):
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def read_config(path: Path) -> ModelConfig:
    return open_checkpoint(path).config


# The initialisers torch's layers call from ``reset_parameters``.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_",
                 "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_")  # fmt: skip


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """Layers built on the meta device are not initialised: ``to_empty`` drops what they hold
    and the checkpoint fills them. An initialiser on meta is not free either: the first one
    imports torch's decompositions, 2.3 s of the 3 s that loading a tiny model took (in every
    replica that starts). As transformers' ``no_init_weights``; not for concurrent use."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in saved:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def load_model(
    model: str | Path | Checkpoint,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    cpu_kernels: bool = True,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """``cpu_kernels``: on the CPU in float32, run linear layers through oneDNN (packed).
    ``quantization``: ``int8`` holds every linear layer's weights as int8 with per-row scales
    (``int8_linear.py``); the checkpoint's weights are read in float32 to quantize them."""
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    config = ckpt.config
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)
    if check_quantization(quantization):
        check_kernel(torch_device, torch_dtype)
    with torch.device("meta"), _initialisers_skipped():
        net = MODEL_CLASSES[config.family](config)
        if quantization:
            quantize_linears(net)
    # As ``to_empty(...).to(dtype)`` but by shape: ``empty_like`` of a meta tensor imports
    # torch's symbolic shapes (sympy), 0.7 s more.
    net = net._apply(
        lambda t: torch.empty(
            t.shape, dtype=torch_dtype if t.is_floating_point() else t.dtype, device=torch_device
        )
    )
    net.tie_weights()
    net.load_weights(ckpt.weights(torch.float32 if quantization else torch_dtype))
    net.build_rope(torch_device)
    if cpu_kernels:
        pack_linears(net)
    return net.eval()
