"""K-quant tensors (Q4_K, Q5_K, Q6_K) in a GGUF come back with their Hugging Face shape and the
exact values llama.cpp's reference dequantization gives them.

The gguf package can dequantize K-quants but not quantize to them, so the blocks are packed here
by hand from chosen logical contents (super-block scales d/dmin, 6-bit sub-block scales and mins
or int8 Q6_K scales, and the quants), following the byte layouts of ggml-common.h (block_q4_K,
block_q5_K, block_q6_K) and the packing of quantize_row_q*_K_ref in ggml-quants.c. The expected
floats come from those logical contents (element i of a Q4_K/Q5_K block belongs to 32-element
sub-block i // 32, of a Q6_K block to 16-element sub-block i // 16); a decoder written from
dequantize_row_q*_K checks the packing; gguf.quants is not used for either. d, dmin and the
scales are chosen so that every product and difference is exact in float32: a correct reader
must match bit for bit, whatever order it multiplies in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors.torch import load_file

import ggufwriter
from ggufwriter import permute, write_gguf
from poise import LLM, SamplingParams
from poise.engine.errors import ModelLoadError
from poise.engine.models.gguf_container import read_header
from poise.engine.models.gguf_file import iter_gguf_weights, read_gguf
from poise.modelgen.make_model import make_model

Q4_K, Q5_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K
QK_K = 256
# Rows of 256 and 512 values, so that every 2-D weight splits into 256-value super-blocks.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
HEADS = 4
# GGUF tensor → its type here, its Hugging Face name and its (rows, row length). ffn_down has
# two blocks per row; attn_q goes through the rotary un-permutation; output.weight is lm_head.
REPLACED = {
    "blk.0.ffn_gate.weight": (Q4_K, "model.layers.0.mlp.gate_proj.weight", (512, 256)),
    "blk.0.ffn_up.weight": (Q5_K, "model.layers.0.mlp.up_proj.weight", (512, 256)),
    "blk.0.ffn_down.weight": (Q6_K, "model.layers.0.mlp.down_proj.weight", (256, 512)),
    "blk.1.attn_q.weight": (Q4_K, "model.layers.1.self_attn.q_proj.weight", (256, 256)),
    "output.weight": (Q6_K, "lm_head.weight", (1024, 256)),
}


# --- block contents -------------------------------------------------------------------------


def _half(x: np.ndarray) -> np.ndarray:
    """ggml_half: IEEE float16, little-endian, as two bytes per value."""
    return np.asarray(x, dtype="<f2").reshape(-1, 1).view(np.uint8)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of Q4_K/Q5_K (quantize_row_q4_K_ref): sub-blocks 0-3 keep their
    6-bit scale and min in bytes 0-3 and 4-7; sub-blocks 4-7 put their low 4 bits in bytes
    8-11 (scale low, min high) and their top 2 bits in the top bits of bytes 0-7."""
    out = np.zeros((len(sc), 12), dtype=np.uint8)
    for j in range(8):
        ls, lm = sc[:, j].astype(np.uint8), m[:, j].astype(np.uint8)
        if j < 4:
            out[:, j] = ls
            out[:, j + 4] = lm
        else:
            out[:, j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[:, j - 4] |= (ls >> 4) << 6
            out[:, j] |= (lm >> 4) << 6
    return out


def pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """block_q4_K: d, dmin (f16), scales[12], qs[128]; each 64 values share 32 bytes, the
    first 32 values in the low nibbles and the next 32 in the high ones."""
    q = q.astype(np.uint8)
    qs = np.zeros((len(q), 128), dtype=np.uint8)
    for k in range(4):
        low, high = q[:, 64 * k : 64 * k + 32], q[:, 64 * k + 32 : 64 * k + 64]
        qs[:, 32 * k : 32 * k + 32] = low | (high << 4)
    return np.hstack([_half(d), _half(dmin), _pack_scales_mins(sc, m), qs])


def pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32], qs[128]: the low 4 bits as in Q4_K, the fifth
    bit of value 64k + l in bit 2k of qh[l] and of value 64k + 32 + l in bit 2k + 1."""
    q = q.astype(np.uint8)
    qh = np.zeros((len(q), 32), dtype=np.uint8)
    qs = np.zeros((len(q), 128), dtype=np.uint8)
    for k in range(4):
        low, high = q[:, 64 * k : 64 * k + 32], q[:, 64 * k + 32 : 64 * k + 64]
        qs[:, 32 * k : 32 * k + 32] = (low & 0xF) | ((high & 0xF) << 4)
        qh |= ((low >> 4) << (2 * k)) | ((high >> 4) << (2 * k + 1))
    return np.hstack([_half(d), _half(dmin), _pack_scales_mins(sc, m), qh, qs])


def pack_q6_k(d, sc, q) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d; quants stored as q + 32 in 0..63.
    In each half of 128 values, value l / l+32 / l+64 / l+96 (l < 32) put their low nibbles
    in ql[l] low / ql[l+32] low / ql[l] high / ql[l+32] high, and their top 2 bits in bits
    0-1 / 2-3 / 4-5 / 6-7 of qh[l]."""
    u = (q + 32).astype(np.uint8)
    ql = np.zeros((len(q), 128), dtype=np.uint8)
    qh = np.zeros((len(q), 64), dtype=np.uint8)
    for h in range(2):
        a, b, c, e = (u[:, 128 * h + 32 * s : 128 * h + 32 * s + 32] for s in range(4))
        ql[:, 64 * h : 64 * h + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, 64 * h + 32 : 64 * h + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, 32 * h : 32 * h + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    return np.hstack([ql, qh, sc.astype(np.int8).view(np.uint8), _half(d)])


def value_k(d, dmin, sc, m, q) -> np.ndarray:
    """What a Q4_K/Q5_K block means: value i = d * scale[i // 32] * q[i] - dmin * min[i // 32]."""
    sub = np.arange(QK_K) // 32
    out = d[:, None] * sc[:, sub] * q - dmin[:, None] * m[:, sub]
    return out.astype(np.float32)


def value_q6_k(d, sc, q) -> np.ndarray:
    """What a Q6_K block means: value i = d * scale[i // 16] * q[i]."""
    return (d[:, None] * sc[:, np.arange(QK_K) // 16] * q).astype(np.float32)


# --- decoders written from ggml-quants.c's dequantize_row_q*_K ----------------------------------


def _f16(two: list[int]) -> float:
    return float(np.frombuffer(bytes(two), dtype="<f2")[0])


def _scale_min_k4(j: int, q: list[int]) -> tuple[int, int]:  # get_scale_min_k4
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def decode_q4_k(block: np.ndarray) -> list[float]:
    b = block.tolist()
    d, dmin, scales, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144]
    y: list[float] = []
    for j in range(4):  # 64 values: 32 low nibbles, then the 32 high nibbles of the same bytes
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j : 32 * j + 32]
        y += [d * sc1 * (x & 0xF) - dmin * m1 for x in q]
        y += [d * sc2 * (x >> 4) - dmin * m2 for x in q]
    return y


def decode_q5_k(block: np.ndarray) -> list[float]:
    b = block.tolist()
    d, dmin, scales, qh, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]
    y: list[float] = []
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        q = qs[32 * j : 32 * j + 32]
        pairs = list(zip(q, qh, strict=True))  # ql[l] with qh[l]: the fifth bits of value l
        y += [d * sc1 * ((x & 0xF) + (16 if h & u1 else 0)) - dmin * m1 for x, h in pairs]
        y += [d * sc2 * ((x >> 4) + (16 if h & u2 else 0)) - dmin * m2 for x, h in pairs]
    return y


def decode_q6_k(block: np.ndarray) -> list[float]:
    b = block.tolist()
    d, scales = _f16(b[208:210]), block[192:208].view(np.int8).tolist()
    y = [0.0] * QK_K
    for n in range(2):  # 128 values from ql[64n:64n + 64], qh[32n:32n + 32], scales[8n:8n + 8]
        ql, qh, sc = b[64 * n : 64 * n + 64], b[128 + 32 * n : 160 + 32 * n], scales[8 * n :]
        for i in range(32):
            s = i // 16
            q1 = ((ql[i] & 0xF) | (((qh[i] >> 0) & 3) << 4)) - 32
            q2 = ((ql[i + 32] & 0xF) | (((qh[i] >> 2) & 3) << 4)) - 32
            q3 = ((ql[i] >> 4) | (((qh[i] >> 4) & 3) << 4)) - 32
            q4 = ((ql[i + 32] >> 4) | (((qh[i] >> 6) & 3) << 4)) - 32
            y[128 * n + i] = d * sc[s] * q1
            y[128 * n + i + 32] = d * sc[s + 2] * q2
            y[128 * n + i + 64] = d * sc[s + 4] * q3
            y[128 * n + i + 96] = d * sc[s + 6] * q4
    return y


DECODERS = {Q4_K: decode_q4_k, Q5_K: decode_q5_k, Q6_K: decode_q6_k}


# --- tensors ----------------------------------------------------------------------------------

# Hand-made first blocks. Sub-blocks 4-7 have scales and mins of 16 or more, so their top bits
# land in bytes 0-7 next to sub-blocks 0-3's; quants differ by position and sub-block.
HAND_SC = np.array([1, 2, 3, 4, 17, 33, 49, 63])
HAND_M = np.array([0, 5, 10, 15, 20, 40, 60, 63])
HAND_Q4 = np.array([(i % 32 + i // 32) % 16 for i in range(QK_K)])
HAND_Q5 = np.array([(3 * (i % 32) + i // 32) % 32 for i in range(QK_K)])
HAND_Q6_SC = np.array([1, -1, 2, -3, 5, -8, 13, -21, 34, -55, 89, -128, 127, 7, 0, -2])
HAND_Q6 = np.array([(i * 5 + i // 16) % 64 - 32 for i in range(QK_K)])


def _d(rng: np.random.Generator, n: int, smallest: int, largest: int) -> np.ndarray:
    """float16 super-block scales with 3 significant bits: 1, 1.25, 1.5 or 1.75 times 2^-e."""
    mantissa = rng.choice([1.0, 1.25, 1.5, 1.75], n)
    return mantissa * 2.0 ** -rng.integers(smallest, largest + 1, n)


def k_quant_tensor(qtype, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes as the GGUF stores them, (rows, bytes per row); the float32 values, (rows,
    cols)). Block 0 is the hand-made one, d = 1 and dmin = 0.5; the rest random."""
    rng = np.random.default_rng(seed)
    n = rows * cols // QK_K
    d = _d(rng, n, 7, 10)
    d[0] = 1.0
    if qtype == Q6_K:
        sc = rng.integers(-128, 128, (n, 16))
        q = rng.integers(-32, 32, (n, QK_K))
        sc[0], q[0] = HAND_Q6_SC, HAND_Q6
        raw, values = pack_q6_k(d, sc, q), value_q6_k(d, sc, q)
    else:
        top = 16 if qtype == Q4_K else 32
        dmin = _d(rng, n, 7, 10)
        dmin[0] = 0.5
        sc, m = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
        q = rng.integers(0, top, (n, QK_K))
        sc[0], m[0], q[0] = HAND_SC, HAND_M, HAND_Q4 if qtype == Q4_K else HAND_Q5
        pack = pack_q4_k if qtype == Q4_K else pack_q5_k
        raw, values = pack(d, dmin, sc, m, q), value_k(d, dmin, sc, m, q)
    assert raw.shape == (n, GGML_QUANT_SIZES[qtype][1])
    return raw.reshape(rows, -1), values.reshape(rows, cols)


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K], ids=lambda t: t.name)
def test_packing_decodes_as_llama_cpp_does(qtype):
    raw, values = k_quant_tensor(qtype, 4, 2 * QK_K, seed=1)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    decoded = np.array([DECODERS[qtype](b) for b in blocks], dtype=np.float32)
    np.testing.assert_array_equal(decoded.reshape(values.shape), values)


def test_hand_made_blocks_by_hand():
    # d * scale * q - dmin * min, with d = 1 and dmin = 0.5
    q4 = k_quant_tensor(Q4_K, 1, QK_K, 0)[1][0]
    assert q4[0] == 0.0  # sub-block 0, q 0
    assert q4[33] == 1.5  # sub-block 1: scale 2, min 5, q 2
    assert q4[163] == 244.0  # sub-block 5: scale 33, min 40, q 8
    assert q4[255] == 346.5  # sub-block 7: scale 63, min 63, q 6
    q5 = k_quant_tensor(Q5_K, 1, QK_K, 0)[1][0]
    assert q5[11] == 1.0  # sub-block 0: scale 1, min 0, q 1
    assert q5[10] == 30.0  # q 30: the fifth bit set
    assert q5[231] == 1732.5  # sub-block 7: scale 63, min 63, q 28
    # d * scale * q, with d = 1
    q6 = k_quant_tensor(Q6_K, 1, QK_K, 0)[1][0]
    assert q6[0] == -32.0  # scale 1, q -32
    assert q6[17] == 10.0  # sub-block 1: scale -1, q -10
    assert q6[191] == 3328.0  # sub-block 11: scale -128, q -26


# --- the GGUF model ---------------------------------------------------------------------------


def _write(model_dir: Path, out: Path, tensors: dict[str, tuple]) -> Path:
    """write_gguf (F32), but the named tensors written as given: (array, ggml type), the array
    raw bytes (rows, bytes per row) for a quantized type."""
    add = ggufwriter._add_tensor

    def add_tensor(writer, name, data, qtype):
        if name not in tensors:
            return add(writer, name, data, qtype)
        array, raw_type = tensors[name]
        shape = array.shape
        if array.dtype == np.uint8:  # raw blocks: a row of bytes stands for fewer values
            block, type_size = GGML_QUANT_SIZES[raw_type]
            shape = (shape[0], shape[1] // type_size * block)
        assert data.shape == shape, name  # in place of the converter's own tensor
        writer.add_tensor(name, array, raw_dtype=raw_type)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ggufwriter, "_add_tensor", add_tensor)
        return write_gguf(model_dir, out, "F32", name="kquants")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf-kquants")
    model_dir = make_model(root / "hf", "llama", "tiny", **SHAPE)
    assert json.loads((model_dir / "config.json").read_text())["num_attention_heads"] == HEADS
    raw, values = {}, {}
    for seed, (name, (qtype, _, shape)) in enumerate(REPLACED.items()):
        raw[name], values[name] = k_quant_tensor(qtype, *shape, seed=seed)
    quantized = {n: (raw[n], REPLACED[n][0]) for n in REPLACED}
    # The same model with the values the K-quant blocks stand for stored as F32.
    plain = {n: (values[n], GGMLQuantizationType.F32) for n in REPLACED}
    return {
        "dir": model_dir,
        "quantized": _write(model_dir, root / "kquants.gguf", quantized),
        "plain": _write(model_dir, root / "plain.gguf", plain),
        "values": values,
    }


def test_file_holds_the_k_quant_tensors(model):
    _, tensors = read_header(model["quantized"])
    for name, (qtype, _, shape) in REPLACED.items():
        assert tensors[name].qtype == qtype
        assert tensors[name].shape == shape
        assert tensors[name].nbytes == shape[0] * shape[1] // QK_K * GGML_QUANT_SIZES[qtype][1]


@pytest.fixture(scope="module")
def weights(model) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(model["quantized"], torch.float32))


@pytest.mark.parametrize("name", list(REPLACED))
def test_k_quant_tensors_load_exactly(model, weights, name):
    qtype, hf_name, _ = REPLACED[name]
    got = weights[hf_name]
    want = torch.from_numpy(model["values"][name])
    assert got.dtype == torch.float32
    assert got.shape == want.shape  # (out, in) as in Hugging Face
    if name.endswith("attn_q.weight"):
        got = permute(got, HEADS)  # back to llama.cpp's row order, in which it was stored
    assert torch.equal(got, want), (name, qtype.name)


def test_other_weights_are_the_checkpoints(model, weights):
    original = load_file(model["dir"] / "model.safetensors")
    replaced = {hf for _, hf, _ in REPLACED.values()}
    assert weights.keys() == original.keys()
    for name, tensor in original.items():
        if name not in replaced:
            assert torch.equal(weights[name], tensor), name


def test_k_quant_model_serves_as_its_f32_twin(model):
    assert read_gguf(model["quantized"]).config == read_gguf(model["plain"]).config
    greedy = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    prompts = ["Hello world", "def f(x):"]
    small = {"dtype": "float32", "num_kv_blocks": 16}  # not the default 1 GiB KV cache
    got = LLM(model["quantized"], **small).generate(prompts, greedy)
    want = LLM(model["plain"], **small).generate(prompts, greedy)
    for g, w in zip(got, want, strict=True):
        assert len(g.outputs[0].token_ids) == 6
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_q8_k_weight_is_refused_by_name(model, tmp_path):
    # Q8_K is the K-family's intermediate type for dot products; it has no dequantization.
    raw = np.zeros((512, GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K][1]), dtype=np.uint8)
    q8_k = {"blk.0.ffn_up.weight": (raw, GGMLQuantizationType.Q8_K)}
    path = _write(model["dir"], tmp_path / "q8k.gguf", q8_k)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight.*Q8_K"):
        read_gguf(path)
