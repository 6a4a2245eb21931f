"""Where a step's time goes: W1's request mix through ``LLM``'s engine, split by what ran.

Wall time of ``engine.step`` splits into the model's forward pass, sampling (the ``sample``
call and the logits' move to the CPU) and the rest (scheduling, the batch's metadata, outputs,
Python). The forward pass splits further by torch.profiler's per-operator self time:
matrix products (linear layers, lm_head), attention (SDPA, the native decode kernel's ctypes
call, gathers and the KV-cache writes), elementwise (norms, rotary, activations) and the
forward's own Python (forward wall time minus every operator's).

    python benchmarks/step_profile.py --model .cache/models/w3 [--dtype float32]
        [--requests 32] [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

import poise.engine.runner as runner_module
from engine_throughput import workload_w1
from poise import LLM, SamplingParams
from poise.engine.intake import RequestOptions

MATMUL = (
    "mkldnn::_linear_pointwise",
    "linear",
    "mm",
    "addmm",
    "bmm",
    "matmul",
    "_weight_int8pack_mm",
    "mkldnn_linear",
)
ATTENTION = ("scaled_dot_product", "flash_attention", "index_select", "index_put",
             "softmax", "_efficient_attention", "paged_decode")  # fmt: skip


def category(op: str) -> str:
    name = op.removeprefix("aten::")
    if any(name == m or name.startswith(m) for m in MATMUL):
        return "matmul"
    if any(a in name for a in ATTENTION):
        return "attention"
    return "elementwise and copies"


class Timed:
    """Wraps a callable and sums its wall time."""

    def __init__(self, fn: object, total: dict[str, float], key: str) -> None:
        self.fn, self.total, self.key = fn, total, key

    def __getattr__(self, name: str) -> object:  # the model's other attributes
        return getattr(self.fn, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)  # type: ignore[operator]
        finally:
            self.total[self.key] += time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    w = workload_w1(vocab, n=args.requests)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    engine = llm.engine
    llm.generate([{"prompt_token_ids": w.prompts[0][:32]}], SamplingParams(max_tokens=4))
    totals: dict[str, float] = defaultdict(float)
    model = engine.runner.model
    engine.runner.model = Timed(model, totals, "forward")  # type: ignore[assignment]
    if engine.runner.decode_kernel is not None:  # C through ctypes: no operator of torch's
        kernel = engine.runner.decode_kernel
        engine.runner.decode_kernel = Timed(kernel, totals, "kernel")  # type: ignore[assignment]
    runner_module.sample = Timed(runner_module.sample, totals, "sample")  # type: ignore[assignment]
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(engine.prepare_request(prompt, RequestOptions(sp, f"p{i}"))[0])
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
    ops: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.key.startswith(("aten::", "mkldnn::")):
            ops[category(evt.key)] += evt.self_cpu_time_total / 1e6
    op_total = sum(ops.values())
    kind = f"{args.dtype}{' int8' if args.quantization else ''}"
    print(f"{args.model.name} {kind}: {args.requests} requests, {w.output_tokens} output "
          f"tokens, {steps} steps, {wall:.1f} s ({w.output_tokens / wall:.1f} output tok/s, "
          "under the profiler)")  # fmt: skip
    rows = [
        *((f"forward: {k}", v) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])),
        ("forward: attention (C decode kernel)", totals["kernel"]),
        ("forward: Python and dispatch", totals["forward"] - op_total - totals["kernel"]),
        ("sampling (with logits to CPU)", totals["sample"]),
        ("scheduler, metadata, outputs", wall - totals["forward"] - totals["sample"]),
    ]
    for name, secs in rows:
        print(f"  {name:<34}{secs:>8.2f} s {secs / wall:>7.1%}  {secs / steps * 1e3:>7.2f} ms/step")
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(top)


if __name__ == "__main__":
    main()
