"""The GGUF container: metadata and tensor directory from a file's header, tensor data as float32.

The header is parsed here rather than with ``gguf.GGUFReader``: the reader builds numpy views
per array element and takes ~10 s on a 150k-token vocabulary with its merges, while the header
is a plain little-endian, length-prefixed layout that a tight loop reads in well under a
second. The gguf package still supplies every constant and the dequantization.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, Keys
from gguf.quants import dequantize, quant_shape_to_byte_shape

from poise.engine.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy / Hugging Face order: GGUF lists dimensions innermost first
    offset: int  # from the start of the file
    nbytes: int


_STRUCT = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata (key → value) and the tensors (name → where and how, in file order)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf, path)
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _parse_header(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts {buf[:4]!r})")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):  # a big-endian file shows up here as a huge version
        raise ModelLoadError(f"{path} is GGUF version {version}; poise reads little-endian v2/v3")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, meta = 24, {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        try:
            meta[key], pos = _value(buf, pos + 4, kind)
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{path}: metadata {key!r} holds text that is not UTF-8") from exc
    infos: list[tuple[str, list[int], int, int]] = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        type_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, type_id, offset))
    alignment = int(meta.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment {alignment} is not a power of two")
    data_start = pos + (-pos % alignment)
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"tensor {name} has unknown ggml type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        info = TensorInfo(
            name, qtype, tuple(reversed(dims)), data_start + offset, count // block * type_size
        )
        if info.offset + info.nbytes > len(buf):
            raise ModelLoadError(f"{path} is truncated: tensor {name} runs past its end")
        tensors[name] = info
    return meta, tensors


_U64 = struct.Struct("<Q")


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    return buf[pos + 8 : end].decode("utf-8"), end


def _value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    vtype = GGUFValueType(kind)
    if vtype == GGUFValueType.STRING:
        return _string(buf, pos)
    if vtype != GGUFValueType.ARRAY:
        fmt = _STRUCT[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    item_kind, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    item_type = GGUFValueType(item_kind)
    # Vocabularies and merges run to 10^5 entries: numbers in one numpy read, strings in a
    # tight loop.
    if item_type in _STRUCT:
        dtype = np.dtype(_STRUCT[item_type])
        end = pos + dtype.itemsize * count
        return np.frombuffer(buf[pos:end], dtype=dtype).tolist(), end
    items: list[Any] = []
    if item_type == GGUFValueType.STRING:
        unpack, append = _U64.unpack_from, items.append
        for _ in range(count):
            (length,) = unpack(buf, pos)
            start, pos = pos + 8, pos + 8 + length
            append(buf[start:pos].decode("utf-8"))
        return items, pos
    for _ in range(count):
        item, pos = _value(buf, pos, item_kind)
        items.append(item)
    return items, pos


@cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    # Probe with one zero block: which types gguf.quants handles depends on its version.
    type_size = GGML_QUANT_SIZES[qtype][1]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize_tensor(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    raw = data[info.offset : info.offset + info.nbytes]
    values = dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)), info.qtype)
    # F32 comes back as a view of the read-only map; torch wants memory of its own.
    return np.array(values, dtype=np.float32, copy=not values.flags.writeable).reshape(info.shape)
