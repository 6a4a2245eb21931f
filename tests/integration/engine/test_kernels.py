"""The native decode-attention kernel against the PyTorch path it replaces."""

import logging
import subprocess

import pytest
import torch

from hfreference import transformers_greedy
from poise import LLM, SamplingParams
from poise.engine import kernels
from poise.engine.kernels import load_paged_decode_attention


def reference(q, k_cache, v_cache, tables, ctx, block_size, scale):
    kv_heads = k_cache.shape[0]
    out = []
    for i in range(q.shape[0]):
        pos = torch.arange(int(ctx[i]))
        slots = tables[i][pos // block_size] * block_size + pos % block_size
        k = k_cache[:, slots].double()  # (kv, ctx, d)
        v = v_cache[:, slots].double()
        qi = q[i].double().view(kv_heads, -1, q.shape[-1])  # (kv, group, d)
        probs = (torch.einsum("hgd,hcd->hgc", qi, k) * scale).softmax(-1)
        out.append(torch.einsum("hgc,hcd->hgd", probs, v).reshape(q.shape[1], -1))
    return torch.stack(out)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 32), (12, 2, 128)])
def test_kernel_matches_reference(dtype, tol, heads, kv_heads, head_dim):
    kernel = load_paged_decode_attention()
    assert kernel is not None, "the C kernel should build wherever the tests run"
    gen = torch.Generator().manual_seed(heads + head_dim)
    block_size, num_blocks, n = 16, 64, 7
    k_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor([1, 2, 15, 16, 17, 100, 250])
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:16] for _ in range(n)])
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = kernel(q, k_cache, v_cache, tables, ctx, block_size, scale)
    want = reference(q, k_cache, v_cache, tables, ctx, block_size, scale)
    assert got.dtype == dtype
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 4), (4, 4), (16, 1)])
def test_a_prompts_rows_read_together_give_each_row_its_result_alone(dtype, heads, kv_heads):
    """A prompt chunk's rows (one sequence's consecutive positions) share their K/V reads in
    one task; each row's result is still, bit for bit, what the row alone gets (the
    deterministic mode's promise), and the attention the reference computes."""
    kernel = load_paged_decode_attention()
    assert kernel is not None
    gen = torch.Generator().manual_seed(heads)
    head_dim, block_size, num_blocks = 64, 16, 64
    k_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    table_a = torch.randperm(num_blocks, generator=gen)[:20]
    table_b = torch.randperm(num_blocks, generator=gen)[:20]
    # A decode row of b, 37 prompt rows of a (positions 100..136), a decode row of b again.
    ctx = torch.tensor([50, *range(101, 138), 51])
    tables = torch.stack([table_b, *[table_a] * 37, table_b])
    q = torch.randn(len(ctx), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    together = kernel(q, k_cache, v_cache, tables, ctx, block_size, scale)
    for i in range(len(ctx)):
        alone = kernel(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], ctx[i : i + 1],
                       block_size, scale)  # fmt: skip
        assert torch.equal(alone, together[i : i + 1]), i
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = reference(q, k_cache, v_cache, tables, ctx, block_size, scale)
    assert torch.allclose(together.double(), want, atol=tol, rtol=tol)


def test_no_compiler_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="poise.engine.kernels"):
        assert load_paged_decode_attention(tmp_path / "fresh") is None
    assert "no C compiler" in caplog.text


def test_a_build_that_crashes_on_this_cpu_leaves_the_engine_on_pytorch(
    llama_dir, tmp_path, monkeypatch, caplog
):
    # What a cache shared with a CPU of more instructions could hold: a build whose first call
    # is an illegal instruction. It must cost the trial run's child, not the engine.
    trap = tmp_path / "trap.c"
    trap.write_text(
        "int paged_decode_attention_f32(void) { __builtin_trap(); }\n"
        "int paged_decode_attention_bf16(void) { __builtin_trap(); }\n"
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    cmd = ["cc", "-shared", "-fPIC", str(trap), "-o", str(kernels.build_path(cache))]
    subprocess.run(cmd, check=True)
    monkeypatch.setattr(kernels, "default_cache_dir", lambda: cache)
    with caplog.at_level(logging.WARNING, logger="poise.engine.kernels"):
        llm = LLM(llama_dir, dtype="float32", native_kernels=True)
    assert llm.engine.runner.decode_kernel is None
    assert "trial run failed" in caplog.text and "killed by signal" in caplog.text
    prompt = [1, *range(10, 30)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    assert got == transformers_greedy(llama_dir, [prompt], 8)[0]


def test_engine_runs_with_either_attention_path(llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The for statement", "Exceptions are raised when something goes wrong"]
    native = LLM(llama_dir, native_kernels=True)
    plain = LLM(llama_dir, native_kernels=False)
    assert native.engine.runner.decode_kernel is not None
    assert plain.engine.runner.decode_kernel is None
    a = [o.outputs[0].token_ids for o in native.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    assert a == b


def test_packed_linears_replace_float32_layers_and_agree():
    from torch import nn

    from poise.engine.models.packed_linear import PackedLinear, pack_linears

    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model)
        assert all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
        assert torch.allclose(model(x), want, atol=1e-5)
    bf16 = nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16)
    assert not pack_linears(bf16)  # bfloat16 already runs on oneDNN
