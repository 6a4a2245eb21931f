"""The deterministic mode: a request's answer is the same bit for bit whatever the batch around it,
however its prompt was chunked, after preemption and after a prefix-cache warm-up; for each
architecture, in float32 and bfloat16, greedy and seeded.

The probes are compared by their token ids and logprobs: alone (one at a time), in a crowd of
others of mixed lengths, with a small token budget (prompts cut into chunks, prefill beside
decode), on a small KV pool (preemption and recompute) and after the same prompts warmed the
prefix cache. Without the mode, bfloat16 answers part in at least one of these (the control).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config, Qwen3Config

from poise import LLM, SamplingParams
from poise.engine.models.batch_invariance import (
    BatchVariantError,
    RowStableLinear,
    check_row_invariance,
    stabilise_linears,
)
from poise.engine.models.layers import MLP
from poise.engine.models.rope import RotaryEmbedding
from testconfigs import TINY_HF_CONFIG

pytestmark = pytest.mark.slow

PROBES = [
    "The quick brown fox jumps over the lazy dog and then",
    "In 1905 a clerk in Bern wrote four papers that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a kingdom by the sea, there lived",
]


# Architectures made with transformers' own classes (make_model has llama, mistral and qwen2):
# Qwen3 with its q/k norms and a sliding window on every layer, and Phi-3 with LongRoPE, whose
# rotation changes once a sequence passes 32 tokens (the probes do while they generate).
HF_CONFIGS = {
    "qwen3-sliding-window": Qwen3Config(
        **TINY_HF_CONFIG, head_dim=16, use_sliding_window=True, sliding_window=24,
        max_window_layers=0,
    ),
    "phi3-longrope": Phi3Config(
        **TINY_HF_CONFIG, pad_token_id=0, max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)],
        },
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def all_models(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deterministic-models")
    built = dict(model_dirs)
    for name, config in HF_CONFIGS.items():
        torch.manual_seed(len(name))
        path = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(model_dirs["llama"] / f, path / f)
        built[name] = path
    return built


def _crowd(n: int, rng: random.Random) -> list[str]:
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 50))) for _ in range(n)]


def _params(kind: str, i: int, max_tokens: int = 24) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return SamplingParams(
        temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True,
        logprobs=0,
    )  # fmt: skip


def _answers(llm: LLM, kind: str, crowd: list[str] | None = None) -> list[Any]:
    """The probes' (token ids, logprobs): alone, or all at once among ``crowd``."""
    if crowd is None:
        outs = [llm.generate([p], _params(kind, i))[0] for i, p in enumerate(PROBES)]
    else:
        rng = random.Random(7)
        batch = [(p, _params(kind, i)) for i, p in enumerate(PROBES)]
        batch += [(c, _params(kind, 100 + j, rng.randint(4, 40))) for j, c in enumerate(crowd)]
        order = list(range(len(batch)))
        rng.shuffle(order)
        got = llm.generate([batch[k][0] for k in order], [batch[k][1] for k in order])
        by_index = {k: out for k, out in zip(order, got, strict=True)}
        outs = [by_index[i] for i in range(len(PROBES))]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _engines(model: Path, dtype: str, deterministic: bool, pool: int = 24) -> dict[str, LLM]:
    """``pool``: the preempting engine's KV blocks."""
    base = {"dtype": dtype, "deterministic": deterministic, "step_time_budget_s": None}
    return {
        "plain": LLM(model, **base, enable_prefix_caching=False),
        "chunked": LLM(model, **base, max_num_batched_tokens=24, enable_prefix_caching=False),
        "preempting": LLM(
            model,
            **base,
            num_kv_blocks=pool,
            enable_prefix_caching=False,
            kv_admission="optimistic",
        ),
        "prefix-cached": LLM(model, **base),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", *HF_CONFIGS])
def test_every_probe_answers_the_same_in_any_batch(all_models, arch, dtype):
    # Under a window on every layer a sequence gives its old blocks back: a smaller pool.
    pool = 16 if "sliding-window" in arch else 24
    engines = _engines(all_models[arch], dtype, deterministic=True, pool=pool)
    model = engines["plain"].engine.model
    assert all(m.silu_and_mul is not None for m in model.modules() if isinstance(m, MLP))
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert all((m.row_table is not None) == m.length_dependent for m in ropes)
    assert any(m.length_dependent for m in ropes) == (arch == "phi3-longrope")
    crowd = _crowd(20, random.Random(arch))
    for kind in ("greedy", "seeded"):
        reference = _answers(engines["plain"], kind)
        cases = {
            "plain, crowded": _answers(engines["plain"], kind, crowd),
            "chunked, crowded": _answers(engines["chunked"], kind, crowd),
            "preempting, crowded": _answers(engines["preempting"], kind, crowd),
        }
        cached = engines["prefix-cached"]
        _answers(cached, kind)  # warms the prefix cache with every probe
        hits_before = cached.engine.kv.stats.hit_tokens
        cases["prefix-cached, crowded"] = _answers(cached, kind, crowd)
        assert cached.engine.kv.stats.hit_tokens > hits_before, "no probe found its prefix cached"
        for case, got in cases.items():
            for i, (want, have) in enumerate(zip(reference, got, strict=True)):
                assert have == want, f"{arch} {dtype} {kind}: probe {i} differs {case}"
    preempted = engines["preempting"].engine.scheduler.num_preemptions_total
    assert preempted > 0, "the small pool preempted nothing: the case tested nothing"


def test_without_the_mode_bfloat16_answers_part(model_dirs):
    """The control: the cases above do tell a batch-dependent engine apart."""
    engines = _engines(model_dirs["llama"], "bfloat16", deterministic=False)
    crowd = _crowd(20, random.Random("llama"))
    reference = _answers(engines["plain"], "greedy")
    differing = sum(
        have != want
        for name in ("plain", "chunked", "preempting")
        for want, have in zip(reference, _answers(engines[name], "greedy", crowd), strict=True)
    )
    assert differing > 0


def test_the_mode_is_off_unless_asked_for(llama_dir):
    """Off by default (long prompts prefill about twice as slowly with it), and nothing of it
    is on the model then: no row-stable layers, PyTorch's own activation."""
    engine = LLM(llama_dir).engine
    assert not engine.deterministic and not engine.limits.deterministic
    assert not any(isinstance(m, RowStableLinear) for m in engine.model.modules())
    assert all(m.silu_and_mul is None for m in engine.model.modules() if isinstance(m, MLP))
    assert LLM(llama_dir, deterministic=True).engine.limits.deterministic


def test_the_mode_refuses_to_start_where_it_cannot_hold(llama_dir):
    """Without poise's native attention kernel there is no one reduction order for prompt and
    decode alike: the load fails saying so, rather than promise."""
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(BatchVariantError, match="native kernels are off"):
            LLM(llama_dir, deterministic=True, native_kernels=False, dtype=dtype)


class RowwiseLinear(torch.nn.Linear):
    """A linear layer that multiplies each row on its own: the same answer for a row whatever
    rows come with it, on any CPU. (A plain Linear's matrix product may block rows by the batch's
    size, as oneDNN's AMX kernels do: no test may count on one keeping its rows apart.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.cat([super(RowwiseLinear, self).forward(r[None]) for r in rows])
        return out.reshape(*x.shape[:-1], self.out_features)


def rowwise(layer: torch.nn.Linear) -> RowwiseLinear:
    copy = RowwiseLinear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    copy.load_state_dict(layer.state_dict())
    return copy


def test_the_load_check_names_a_layer_whose_rows_follow_the_batch():
    """A layer that adds the batch's mean is caught, whatever kernel would hide it."""

    class BatchMean(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            return y + y.mean(0, keepdim=True)

    model = torch.nn.Sequential()
    model.add_module("steady", RowwiseLinear(8, 8))
    model.add_module("wobbly", BatchMean(8, 8))
    assert stabilise_linears(model) == ["steady", "wobbly"]
    with pytest.raises(BatchVariantError, match="layer wobbly"):
        check_row_invariance(model, torch.float32, 64)


def test_the_load_check_names_an_mlp_whose_activation_follows_the_batch():
    """The MLP is checked whole: its linears pass, its activation does not."""
    mlp = MLP(8, 4, bias=False)
    mlp.gate_up_proj, mlp.down_proj = rowwise(mlp.gate_up_proj), rowwise(mlp.down_proj)
    mlp.silu_and_mul = lambda gate_up: gate_up[..., :4] + gate_up[..., 4:].mean(0)
    model = torch.nn.Sequential()
    model.add_module("mlp", mlp)
    assert stabilise_linears(model) == ["mlp.gate_up_proj", "mlp.down_proj"]
    with pytest.raises(BatchVariantError, match=r"layer mlp \(MLP, 8 -> 8"):
        check_row_invariance(model, torch.float32, 64)
    mlp.silu_and_mul = None  # PyTorch's own activation: row by row
    check_row_invariance(model, torch.float32, 64)


def test_a_lone_row_is_computed_beside_a_copy_of_itself():
    seen: list[int] = []

    class Counting(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.reshape(-1, self.in_features).shape[0])
            return super().forward(x)

    layer = RowStableLinear(Counting(4, 3))
    x = torch.randn(1, 4)
    assert torch.equal(layer(x), layer.inner(x.expand(2, 4).contiguous())[:1])
    assert layer(torch.randn(5, 4)).shape == (5, 3)
    assert seen[0] == 2 and seen[-1] == 5
