"""Native CPU kernels, built on first use with the system C compiler and called through ctypes.

Why hand-written: decode attention over a paged cache in plain PyTorch must first gather each
sequence's blocks into a contiguous copy and then read that copy twice; on the CPU that is
memory-bound and costs about two thirds of a decode step. The kernel in ``paged_attention.c``
reads every K/V row once, straight from the pool. It needs only a C compiler with OpenMP (no
PyTorch headers, no ninja), and builds in about a second. The deterministic mode's
element-wise kernels (``row_ops.c``, wrapped by ``row_ops.py``) are built into the same library.

It is built with ``-march=native``, so a build is only good on CPUs with the instructions of the
one that built it: the cache key covers the source, the compiler flags and this CPU's identity
(its architecture, model and instruction-set flags), so a cache directory shared by machines
with different CPUs holds one build per kind of CPU. Before it is trusted, each build is run
once in a child process: an instruction the CPU lacks then kills the child, not the engine.
When it cannot be built, loaded or run, poise logs why (once) and uses the PyTorch path;
only the deterministic mode needs the kernels, and refuses to start without them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("poise.engine.kernels")

_HERE = Path(__file__).parent
# Compiled together into one library.
_SOURCES = (_HERE / "paged_attention.c", _HERE / "row_ops.c")
# Reassociation lets the dot products vectorize; finite-math stays off (-inf is used).
_CFLAGS = (
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
)
# /proc/cpuinfo's fields that say which instructions -march=native may use: x86's flags and
# model, Arm's features and part numbers.
_CPU_FIELDS = frozenset(
    {
        "vendor_id",
        "cpu family",
        "model",
        "model name",
        "flags",
        "features",
        "cpu implementer",
        "cpu architecture",
        "cpu variant",
        "cpu part",
    }
)
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}


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


def cpu_identity(cpuinfo: str | None = None) -> str:
    """What ``-march=native`` compiles for here: the machine's architecture and, from
    ``/proc/cpuinfo`` (``cpuinfo``: its text, read when None), the CPU models and their
    instruction-set flags. Off Linux, where there is no such file, the architecture alone."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields = set()
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        if sep and name in _CPU_FIELDS:
            if name in ("flags", "features"):
                value = " ".join(sorted(value.split()))  # the set matters, not the order
            fields.add(f"{name}: {value.strip()}")
    # Every distinct line of every processor: a hybrid CPU's cores may differ.
    return "\n".join([platform.machine(), *sorted(fields)])


def kernel_key(source: bytes, cpu: str) -> str:
    """The build's cache key: a build is reused only for the same source, flags and CPU."""
    digest = hashlib.sha256(source)
    for part in (" ".join(_CFLAGS), cpu):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _source_bytes() -> bytes:
    return b"\0".join(path.read_bytes() for path in _SOURCES)


def build_identity() -> str:
    """What this machine's build of the kernels is: its source, flags and CPU (the cache key)."""
    return kernel_key(_source_bytes(), cpu_identity())


def build_path(cache_dir: Path) -> Path:
    """Where this CPU's build of the kernels lives in ``cache_dir``."""
    return cache_dir / f"poise-kernels-{kernel_key(_source_bytes(), cpu_identity())}.so"


def _build(cache_dir: Path) -> Path:
    target = build_path(cache_dir)
    if target.is_file():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    cmd = [compiler, *_CFLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"compiling the kernel failed: {exc.stderr.strip()[-400:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# One call of each kernel on a tiny context whose values are all 1, so the output must be 1
# (within rounding: f32 to 1e-5, bf16 to one step of its last bit). Only ctypes: the child
# starts in tens of milliseconds.
_TRIAL = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
n, heads, kv_heads, dim, bs = 1, 2, 1, 64, 4
kinds = {"f32": (ctypes.c_float, 1.0, 1e-5), "bf16": (ctypes.c_uint16, 0x3F80, 1)}
for name, (ctype, one, tol) in kinds.items():
    fn = getattr(lib, "paged_decode_attention_" + name)
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    q = (ctype * (heads * dim))(*[one] * (heads * dim))
    kv = (ctype * (bs * dim))(*[one] * (bs * dim))
    out = (ctype * (heads * dim))()
    table, ctx = (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(3)
    args = (q, kv, kv, table, ctx, None, out, n, heads, kv_heads, dim, bs, bs, 1, 0.125, 1)
    if fn(*args) != 0 or any(abs(x - one) > tol for x in out):
        sys.exit(name + " gave a wrong answer")
# silu(1) * 1 over a row of 20 (a whole block and a padded one): 0.7310586, bf16 0x3F3B.
for name, (ctype, one, want, tol) in {
    "f32": (ctypes.c_float, 1.0, 0.7310586, 1e-6), "bf16": (ctypes.c_uint16, 0x3F80, 0x3F3B, 0)
}.items():
    fn = getattr(lib, "silu_and_mul_" + name)
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    gate_up, out = (ctype * 40)(*[one] * 40), (ctype * 20)()
    if fn(gate_up, out, 1, 20, 1) != 0 or any(abs(x - want) > tol for x in out):
        sys.exit("silu_and_mul_" + name + " gave a wrong answer")
# Position 0 at any frequency: cos 1, sin 0.
fn = lib.rope_table
fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_float]
fn.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
pos, inv = (ctypes.c_int64 * 1)(0), (ctypes.c_float * 4)(1.0, 0.5, 0.25, 0.125)
cos, sin = (ctypes.c_float * 8)(), (ctypes.c_float * 8)()
if fn(pos, inv, 1, 4, 1.0, cos, sin, 1) != 0 or list(cos) != [1.0] * 8 or list(sin) != [0.0] * 8:
    sys.exit("rope_table gave a wrong answer")
"""


def _trial_run(path: Path) -> None:
    """Raise unless the build runs correctly here; a crash (SIGILL) stays in the child."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _TRIAL, str(path)],
            check=False,  # a failure is read from the status below, a signal included
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError("the kernel's trial run did not finish within 60 s") from exc
    if done.returncode < 0:  # killed: SIGILL for an instruction this CPU lacks
        why = f"killed by signal {-done.returncode}: {signal.strsignal(-done.returncode)}"
        raise RuntimeError(f"the kernel's trial run failed ({path.name}): {why}")
    if done.returncode > 0:
        why = done.stderr.strip()[-300:] or f"exit status {done.returncode}"
        raise RuntimeError(f"the kernel's trial run failed ({path.name}): {why}")


def _load(cache_dir: Path) -> ctypes.CDLL:
    path = _build(cache_dir)
    _trial_run(path)
    return ctypes.CDLL(str(path))


def load_library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The built kernels, or None (logged once) when they cannot be built, loaded or run here."""
    cache_dir = cache_dir or default_cache_dir()
    with _lock:
        if cache_dir not in _loaded:
            try:
                _loaded[cache_dir] = _load(cache_dir)
            except Exception as exc:  # whatever went wrong, the PyTorch path still serves
                log.warning("native kernels unavailable, using PyTorch: %s", exc)
                _loaded[cache_dir] = None
        return _loaded[cache_dir]


def load_paged_decode_attention(cache_dir: Path | None = None) -> PagedDecodeAttention | None:
    """The decode attention kernel, or None when the kernels cannot be used here."""
    lib = load_library(cache_dir)
    return None if lib is None else PagedDecodeAttention(lib)
