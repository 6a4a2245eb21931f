"""Workload W1 through poise and through Hugging Face transformers with static batches.

W1: the ``w0`` model, 64 requests, prompt lengths uniform in [64, 512], output lengths uniform
in [32, 256], ignore_eos, all submitted at once, fixed seed. poise runs them with continuous
batching over its paged KV cache; transformers runs them in submission order as static batches
of 16, left-padded, each batch generating until its longest request is done. Only the tokens a
request asked for count as output for either system.

Timings on a shared 2-core machine are noisy, so each system runs ``--repeat`` times, the two
interleaved, and the table shows medians. It prints one table per dtype with output tokens/s and
total (prompt + output) tokens/s, the ratio of the medians (transformers time / poise time),
poise's KV-cache utilization, and the share of this machine's measured matrix-multiply peak
(best of several measurements) that poise reaches.

    python benchmarks/engine_throughput.py [--dtypes float32 bfloat16] [--repeat 3] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from poise import LLM, SamplingParams
from poise.engine.intake import RequestOptions
from poise.modelgen.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / ".cache" / "models" / "w0"


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def workload_w1(vocab: int, seed: int = 0, n: int = 64) -> Workload:
    rng = random.Random(seed)
    lens = [(rng.randint(64, 512), rng.randint(32, 256)) for _ in range(n)]
    prompts = [[rng.randrange(4, vocab) for _ in range(p)] for p, _ in lens]
    return Workload(prompts, [o for _, o in lens])


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 10, tries: int = 5) -> float:
    """Best of several timings of a large square matmul: the machine's attainable peak."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def model_flops(llm: LLM, w: Workload) -> float:
    """Matrix-multiply FLOPs poise must do for W1: weights per token, lm_head per sampled
    token, attention (QK and PV) per token over its context."""
    c = llm.engine.model.config
    per_token = (
        2
        * (
            c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            + c.num_heads * c.head_dim * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        * c.num_layers
    )
    flops = 0.0
    for prompt, out in zip(w.prompts, w.output_lens, strict=True):
        total = len(prompt) + out
        flops += per_token * total + 2 * c.hidden_size * c.vocab_size * out
        # each token at position p attends to p + 1 keys: 2 products of 2*heads*head_dim each
        flops += 4 * c.num_heads * c.head_dim * c.num_layers * (total * (total + 1) / 2)
    return flops


@dataclass
class PoiseResult:
    seconds: float
    output_tokens: int
    kv_peak_usage: float  # share of the pool's blocks held at the busiest step
    kv_mean_usage: float
    slot_fill: float  # tokens stored / slots in held blocks at the busiest step
    preemptions: int
    steps: int


def run_poise(
    model_dir: Path, dtype: str, w: Workload, kv_bytes: int, **options: object
) -> PoiseResult:
    """``options``: more of the engine's settings (the deterministic mode, say)."""
    llm = LLM(model_dir, dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_num_seqs=64, **options)
    warm = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([{"prompt_token_ids": w.prompts[0][:32]}], warm)
    engine = llm.engine
    for i, (prompt, out) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        request, _ = engine.prepare_request(prompt, RequestOptions(sp, request_id=f"w1-{i}"))
        engine.add_request(request)
    usages, fills, produced, steps = [], [], 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
        steps += 1
        usages.append(engine.kv.usage)
        held = sum(len(t) for t in engine.kv.holders().values())
        stored = sum(r.num_computed_tokens for r in engine.scheduler.running)
        fills.append(stored / (held * engine.kv.block_size) if held else 0.0)
    seconds = time.perf_counter() - t0
    peak = max(range(len(usages)), key=usages.__getitem__)
    return PoiseResult(
        seconds,
        produced,
        usages[peak],
        statistics.fmean(usages),
        fills[peak],
        engine.scheduler.num_preemptions_total,
        steps,
    )


def run_transformers(model_dir: Path, dtype: torch.dtype, w: Workload, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generate(
        torch.tensor([w.prompts[0][:32]]), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    t0 = time.perf_counter()
    for start in range(0, len(w.prompts), batch):
        prompts = w.prompts[start : start + batch]
        longest_out = max(w.output_lens[start : start + batch])
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest_out,
                min_new_tokens=longest_out,
                do_sample=False,
                pad_token_id=0,
            )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--kv-gib", type=float, default=1.0, help="poise's KV pool budget")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs per system; medians shown")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    if not (args.model / "config.json").is_file():
        print(f"making the w0 model in {args.model} ...")
        make_model(args.model, "llama", "w0")
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    w = workload_w1(vocab, n=args.requests)
    print(
        f"W1: {len(w.prompts)} requests, {w.prompt_tokens} prompt tokens, "
        f"{w.output_tokens} output tokens; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    results = {}
    for dtype in args.dtypes:
        tdtype = getattr(torch, dtype)
        peak = matmul_peak_gflops(tdtype)
        poise_runs: list[PoiseResult] = []
        hf_runs: list[float] = []
        for _ in range(args.repeat):  # interleaved, so drifts in machine speed hit both
            poise_runs.append(run_poise(args.model, dtype, w, int(args.kv_gib * (1 << 30))))
            if not args.skip_hf:
                hf_runs.append(run_transformers(args.model, tdtype, w, args.hf_batch))
        p = sorted(poise_runs, key=lambda r: r.seconds)[len(poise_runs) // 2]
        assert p.output_tokens == w.output_tokens, "poise produced the wrong number of tokens"
        llm_for_flops = LLM(args.model, dtype=dtype, num_kv_blocks=1)
        achieved = model_flops(llm_for_flops, w) / p.seconds / 1e9
        hf_s = statistics.median(hf_runs) if hf_runs else None
        total = w.prompt_tokens + w.output_tokens
        rows = [("poise", p.seconds), *([] if hf_s is None else [("transformers", hf_s)])]
        print(
            f"\n{dtype}: poise runs {[round(r.seconds, 1) for r in poise_runs]} s, "
            f"transformers runs {[round(x, 1) for x in hf_runs]} s"
        )
        print(f"{dtype}, medians of {args.repeat}  (matmul peak measured: {peak:.0f} GFLOP/s)")
        print(f"{'system':<14}{'seconds':>9}{'output tok/s':>14}{'total tok/s':>13}")
        for name, secs in rows:
            print(f"{name:<14}{secs:>9.1f}{w.output_tokens / secs:>14.1f}{total / secs:>13.1f}")
        if hf_s is not None:
            print(f"{'ratio':<14}{'':>9}{hf_s / p.seconds:>13.2f}x{hf_s / p.seconds:>12.2f}x")
        print(
            f"poise KV cache: peak {p.kv_peak_usage:.1%} of the pool held, mean "
            f"{p.kv_mean_usage:.1%}; {p.slot_fill:.1%} of held slots filled at the peak; "
            f"{p.preemptions} preemptions over {p.steps} steps"
        )
        print(f"poise matmul work: {achieved:.0f} GFLOP/s = {achieved / peak:.1%} of peak")
        results[dtype] = {
            "poise": asdict(p),
            "poise_runs_seconds": [r.seconds for r in poise_runs],
            "transformers_seconds": hf_s,
            "transformers_runs_seconds": hf_runs,
            "matmul_peak_gflops": peak,
            "poise_gflops": achieved,
            "ratio": None if hf_s is None else hf_s / p.seconds,
        }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
