"""A checkpoint (Hugging Face directory or GGUF file) → a ready model on its device."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from poise.engine.errors import ModelLoadError
from poise.engine.models.checkpoint import Checkpoint, open_checkpoint
from poise.engine.models.config import ModelConfig
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


def load_model(
    model: str | Path | Checkpoint,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    cpu_kernels: bool = True,
) -> LlamaForCausalLM:
    """``cpu_kernels``: on the CPU in float32, run linear layers through oneDNN (packed)."""
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    config = ckpt.config
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)
    with torch.device("meta"):
        net = MODEL_CLASSES[config.family](config)
    net = net.to_empty(device=torch_device).to(torch_dtype)
    net.tie_weights()
    net.load_weights(ckpt.weights(torch_dtype))
    net.build_rope(torch_device)
    if cpu_kernels:
        pack_linears(net)
    return net.eval()
