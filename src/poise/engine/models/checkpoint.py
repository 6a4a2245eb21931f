"""Where a model comes from: a Hugging Face directory or a GGUF file, resolved once.

Both kinds end as the same four things, so the rest of the engine never asks which it was: the
``config.json``-style dict (``ModelConfig`` reads it and refuses what it does not understand),
the tokenizer's parts, the generation config, and an iterator of Hugging Face-named tensors.
Nothing is ever downloaded: a path that is neither is a ``ModelLoadError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from poise.engine.errors import ModelLoadError
from poise.engine.models.config import ModelConfig
from poise.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch only where weights are read: a server's parent only checks
    import torch

    from poise.engine.models.gguf_file import GGUFCheckpoint


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path  # the directory, or the .gguf file
    raw_config: dict[str, Any]
    config: ModelConfig
    generation_config: dict[str, Any] = field(default_factory=dict)
    gguf: Path | None = None  # set for a GGUF checkpoint
    # Its metadata, read once: the tokenizer is built from it without parsing the file again.
    gguf_metadata: GGUFCheckpoint | None = None

    @property
    def model_dir(self) -> Path:
        return self.path if self.gguf is None else self.path.parent

    @property
    def generation_config_source(self) -> str:
        """What errors about the generation config name."""
        if self.gguf is not None:
            return f"{self.gguf.name}'s metadata"
        return str(self.path / "generation_config.json")

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        if self.gguf is not None:
            from poise.engine.models.gguf_file import iter_gguf_weights

            return iter_gguf_weights(self.gguf, dtype)
        return iter_safetensors(weight_files(self.path), dtype)


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    gguf = None
    if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
        from poise.engine.models.gguf_file import find_gguf

        gguf = find_gguf(path)
    if gguf is not None:
        from poise.engine.models.gguf_file import read_gguf

        ckpt = read_gguf(gguf)
        config = ModelConfig.from_dict(ckpt.config)
        return Checkpoint(gguf, ckpt.config, config, ckpt.generation_config, gguf, ckpt)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    raw = _read_json(path / "config.json", required=True)
    generation = _read_json(path / "generation_config.json", required=False)
    return Checkpoint(path, raw, ModelConfig.from_dict(raw), generation)


def load_tokenizer(model: str | Path | Checkpoint) -> Tokenizer:
    """The checkpoint's tokenizer: its files beside the weights, or a GGUF's metadata."""
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    parts = ckpt.gguf_metadata
    if parts is None:
        return Tokenizer(ckpt.path)
    return Tokenizer.from_parts(
        parts.tokenizer,
        parts.tokenizer_config,
        parts.tokenizer_config.get("chat_template"),
        model_type=ckpt.raw_config.get("model_type"),
    )


def check_checkpoint(path: str | Path, generation_config: str = "auto") -> Checkpoint:
    """Everything about a checkpoint that can be refused without reading its weights: the
    config, the tokenizer and the generation config. A server runs this before it listens."""
    from poise.engine.generation_config import load_generation_config

    ckpt = open_checkpoint(path)
    load_tokenizer(ckpt)
    load_generation_config(ckpt.generation_config, generation_config, ckpt.generation_config_source)
    return ckpt


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent} has no {path.name}")
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
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


def iter_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).to(dtype)
