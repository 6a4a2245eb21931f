"""A local Hugging Face model directory → a ready model. Nothing is ever downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from poise.engine.errors import ModelLoadError
from poise.engine.models.config import ModelConfig
from poise.engine.models.llama import LlamaForCausalLM
from poise.engine.models.packed_linear import pack_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
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


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return ModelConfig.from_dict(raw)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors weights (nor model.safetensors.index.json)"
        )
    return files


def iter_weights(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).to(dtype)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    cpu_kernels: bool = True,
) -> LlamaForCausalLM:
    """``cpu_kernels``: on the CPU in float32, run linear layers through oneDNN (packed)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    files = weight_files(model_dir)
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=torch_device).to(torch_dtype)
    model.tie_weights()
    model.load_weights(iter_weights(files, torch_dtype))
    model.rope.build(torch_device)
    if cpu_kernels:
        pack_linears(model)
    return model.eval()
