"""The deterministic mode's element-wise kernels (``row_ops.c``): SwiGLU's ``silu(gate) * up``
and the rotary rows of length-dependent RoPE, each value computed by the same instructions
whatever the tensor's size, so a token's result does not follow the batch (see the C file)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from poise.engine.kernels import load_library


class RowOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._silu_and_mul = {}
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"silu_and_mul_{name}")
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
            fn.restype = ctypes.c_int
            self._silu_and_mul[dtype] = fn
        self._rope_table = lib.rope_table
        self._rope_table.argtypes = (
            ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_float])
            + [ctypes.c_void_p] * 2
            + [ctypes.c_int]
        )
        self._rope_table.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return dtype in self._silu_and_mul and device.type == "cpu"

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for (..., 2 * inter) rows holding gate then up."""
        inter = gate_up.shape[-1] // 2
        flat = gate_up.reshape(-1, 2 * inter).contiguous()
        out = torch.empty(flat.shape[0], inter, dtype=flat.dtype, device=flat.device)
        status = self._silu_and_mul[flat.dtype](
            flat.data_ptr(), out.data_ptr(), flat.shape[0], inter, torch.get_num_threads()
        )
        if status:
            raise RuntimeError("silu_and_mul kernel failed (shape)")
        return out.view(*gate_up.shape[:-1], inter)

    def rope_table(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (rows, 2 * len(inv_freq)) cos and sin, as ``RotaryEmbedding._table``."""
        positions = positions.to(torch.int64).contiguous()
        inv = inv_freq.to(torch.float32).contiguous()
        rows, half = positions.shape[0], inv.shape[0]
        cos = torch.empty(rows, 2 * half, dtype=torch.float32)
        sin = torch.empty_like(cos)
        status = self._rope_table(
            positions.data_ptr(),
            inv.data_ptr(),
            rows,
            half,
            scale,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError("rope_table kernel failed (shape)")
        return cos, sin


def load_row_ops(cache_dir: Path | None = None) -> RowOps | None:
    """The kernels, or None when they cannot be built, loaded or run here."""
    lib = load_library(cache_dir)
    return None if lib is None else RowOps(lib)
