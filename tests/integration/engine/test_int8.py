"""Weight-only int8 (``quantization="int8"``): per-row scales, torch's int8 weight kernel.

What a user would notice: the linear layers hold int8 and a quarter of float32's bytes, the rest
of the model (embedding, norms, KV pool) keeps its dtype, greedy output follows the unquantized
model's, tied embeddings stay float for the lookup, a Q8_0 GGUF loads into it, and an unknown
quantization is refused at load naming it.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ggufwriter import write_gguf
from poise import LLM, SamplingParams
from poise.config import ConfigError, load_settings
from poise.engine.errors import ModelLoadError
from poise.engine.models.int8_linear import Int8Linear, quantize_rows
from poise.engine.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5 + 7 * i, 60 + 7 * i))} for i in range(6)]


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]  # rows of unlike scale
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    err = (q.float() * scales[:, None] - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-7).all())
    assert bool((q[3] == 0).all())
    assert int(q.abs().max()) == 127  # every nonzero row uses the whole range


def test_int8_linear_matches_the_dequantized_product():
    layer = Int8Linear(96, 40, bias=True)
    w = torch.randn(40, 96)
    layer.load_rows(w[:16], 0, 16)  # fused loading: rows arrive in parts
    layer.load_rows(w[16:], 16, 24)
    layer.bias.data = torch.randn(40)
    x = torch.randn(5, 96)
    q, s = quantize_rows(w)
    want = F.linear(x, q.float() * s[:, None], layer.bias.data)
    got = layer(x)
    assert got.dtype == torch.float32
    # activations go through bfloat16 on the CPU: relative error of a few 1e-3
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().mean()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_model_holds_int8_and_keeps_the_rest(model_dirs, arch):
    net = load_model(model_dirs[arch], "float32", quantization="int8")
    linears = [m for m in net.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * net.config.num_layers + 1  # qkv, o, gate_up, down; lm_head
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert net.embed_tokens.weight.dtype == torch.float32
    assert net.norm.weight.dtype == torch.float32
    if arch == "qwen2":  # tied: the head is a quantized copy; the lookup keeps float weights
        q, _ = quantize_rows(net.embed_tokens.weight.data)
        assert torch.equal(net.lm_head.weight.data, q)


def test_greedy_output_follows_the_unquantized_model(model_dirs):
    full = LLM(model_dirs["llama"], dtype="float32")
    int8 = LLM(model_dirs["llama"], dtype="float32", quantization="int8")
    assert int8.engine.runner.kv_caches[0][0].dtype == torch.float32  # the KV pool unchanged
    assert int8.engine.kv_bytes_per_token == full.engine.kv_bytes_per_token
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = [o.outputs[0] for o in full.generate(PROMPTS, first)]
    b = [o.outputs[0] for o in int8.generate(PROMPTS, first)]
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids  # the same greedy choice after every prompt
        top_x, top_y = x.logprobs[0], y.logprobs[0]
        for token in set(top_x) & set(top_y):  # per-row int8 moves them by hundredths
            assert abs(top_x[token] - top_y[token]) < 0.05
    # Whole answers: the tiny random model's top choices are close, so some answers part
    # after a few tokens (measured: 4 of 6 identical, the others after 3 and 5).
    a24 = [o.outputs[0].token_ids for o in full.generate(PROMPTS, GREEDY)]
    b24 = [o.outputs[0].token_ids for o in int8.generate(PROMPTS, GREEDY)]
    assert sum(x == y for x, y in zip(a24, b24, strict=True)) >= 3


def test_unknown_quantization_is_refused_naming_it(model_dirs):
    with pytest.raises(ModelLoadError, match="'int4'"):
        load_model(model_dirs["llama"], "float32", quantization="int4")
    with pytest.raises(ConfigError, match="quantization"):
        load_settings({"model": str(model_dirs["llama"]), "quantization": "int4"}, None)


def test_a_width_the_kernel_cannot_take_is_refused_naming_the_layer(tmp_path: Path):
    from poise.modelgen.make_model import make_model

    odd = make_model(tmp_path / "odd", "llama", "tiny", intermediate_size=100)
    with pytest.raises(ModelLoadError, match=r"mlp\.down_proj has 100 input features"):
        load_model(odd, "float32", quantization="int8")


def test_every_entry_point_reaches_the_engine(model_dirs, monkeypatch):
    from poise.cli import build_parser
    from poise.server.app import engine_config

    args = build_parser().parse_args(["serve", "--model", "m", "--quantization", "int8"])
    assert args.quantization == "int8"
    settings = load_settings({"model": str(model_dirs["llama"]), "quantization": "int8"}, None)
    assert engine_config(settings).quantization == "int8"
    monkeypatch.setenv("POISE_QUANTIZATION", "int8")
    settings = load_settings({"model": str(model_dirs["llama"])}, None)
    assert engine_config(settings).quantization == "int8"


def test_q8_0_gguf_loads_into_int8(model_dirs, tmp_path: Path):
    path = write_gguf(model_dirs["llama"], tmp_path / "tiny-q8_0.gguf", "Q8_0")
    net = load_model(path, "float32", quantization="int8")
    reference = load_model(model_dirs["llama"], "float32", quantization="int8")
    layer, ref_layer = net.layers[0].mlp.down_proj, reference.layers[0].mlp.down_proj
    assert isinstance(layer, Int8Linear) and layer.weight.dtype == torch.int8
    # Q8_0's block values re-rounded to one scale per row: within one step of the direct
    # quantization of the original weights
    assert int((layer.weight.int() - ref_layer.weight.int()).abs().max()) <= 1
    assert torch.allclose(layer.scales, ref_layer.scales, rtol=1e-2)
    llm = LLM(path, dtype="float32", quantization="int8")
    out = llm.generate(PROMPTS[:2], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
