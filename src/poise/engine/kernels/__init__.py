"""Native CPU kernels, built on first use with the system C compiler and called through ctypes.

Why hand-written: decode attention over a paged cache in plain PyTorch must first gather each
sequence's blocks into a contiguous copy and then read that copy twice; on the CPU that is
memory-bound and costs about two thirds of a decode step. The kernel in ``paged_attention.c``
reads every K/V row once, straight from the pool. It needs only a C compiler with OpenMP (no
PyTorch headers, no ninja), builds in about a second, and is cached by the hash of its source.
When it cannot be built, poise logs why and uses the PyTorch path: nothing depends on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("poise.engine.kernels")

_SOURCE = Path(__file__).with_name("paged_attention.c")
_lock = threading.Lock()
_loaded: dict[Path, PagedDecodeAttention | None] = {}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "poise" / "kernels"


class PagedDecodeAttention:
    """``out[i] = softmax(q[i] · K_ctx(i)ᵀ · scale) · V_ctx(i)``, one query token per sequence;
    ctx(i) = positions [context_starts[i], context_lens[i])."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
        self._fns = {}
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"paged_decode_attention_{name}")
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, device: torch.device, group: int, head_dim: int) -> bool:
        return dtype in self._fns and device.type == "cpu" and group <= 16 and head_dim <= 256

    def __call__(
        self,
        q: torch.Tensor,  # (n, heads, head_dim), contiguous
        k_cache: torch.Tensor,  # (kv_heads, slots, head_dim)
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # (n, max_blocks) int64
        context_lens: torch.Tensor,  # (n,) int64
        block_size: int,
        scale: float,
        context_starts: torch.Tensor | None = None,  # (n,) int64 first position read
    ) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        n, heads, head_dim = q.shape
        kv_heads, slots, _ = k_cache.shape
        status = self._fns[q.dtype](
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            None if context_starts is None else context_starts.data_ptr(),
            out.data_ptr(),
            n,
            heads,
            kv_heads,
            head_dim,
            slots,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError("paged decode attention kernel failed (shape or memory)")
        return out


def _build(cache_dir: Path) -> Path:
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    target = cache_dir / f"paged_attention-{digest}.so"
    if target.is_file():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    # Reassociation lets the dot products vectorize; finite-math stays off (-inf is used).
    cmd = [
        compiler,
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c11",
        "-ffp-contract=fast",
        "-fno-math-errno",
        "-fassociative-math",
        "-fno-signed-zeros",
        "-fno-trapping-math",
        str(_SOURCE),
        "-o",
        tmp,
        "-lm",
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"compiling the kernel failed: {exc.stderr.strip()[-400:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_paged_decode_attention(cache_dir: Path | None = None) -> PagedDecodeAttention | None:
    """The kernel, or None (logged once) when it cannot be built or loaded here."""
    cache_dir = cache_dir or default_cache_dir()
    with _lock:
        if cache_dir not in _loaded:
            try:
                _loaded[cache_dir] = PagedDecodeAttention(ctypes.CDLL(str(_build(cache_dir))))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("native decode attention unavailable, using PyTorch: %s", exc)
                _loaded[cache_dir] = None
        return _loaded[cache_dir]
