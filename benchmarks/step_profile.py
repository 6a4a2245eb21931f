"""Where a step's time goes: W1's request mix through ``LLM``'s engine, split by what ran.

Wall time of ``engine.step`` splits into the model's forward pass, sampling and the rest
(scheduling, the batch's metadata, outputs, Python). The forward pass splits further, by timers
around the calls themselves (no profiler, whose per-operator cost would swamp a small model's
small operators): the linear layers (every projection and lm_head), attention proper (prefill
SDPA, and the decode kernel or its PyTorch fallback), and the rest of the forward (embedding,
norms, rotary, activations, residual adds, KV-cache writes, and Python between them).

    python benchmarks/step_profile.py --model .cache/models/w3 [--dtype float32]
        [--requests 32] [--quantization int8]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import poise.engine.runner as runner_module
from engine_throughput import workload_w1
from poise import LLM, SamplingParams
from poise.engine.intake import RequestOptions
from poise.engine.models.attention import Attention
from poise.engine.models.int8_linear import Int8Linear
from poise.engine.models.packed_linear import PackedLinear

LINEARS = (nn.Linear, PackedLinear, Int8Linear)


class Timed:
    """Wraps a callable and sums its wall time; other attributes read through."""

    def __init__(self, fn: object, total: dict[str, float], key: str) -> None:
        self.fn, self.total, self.key = fn, total, key

    def __getattr__(self, name: str) -> object:
        return getattr(self.fn, name)

    def __get__(self, obj: object, owner: type | None = None) -> object:  # as a method
        return self if obj is None else functools.partial(self.__call__, obj)

    def __call__(self, *args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)  # type: ignore[operator]
        finally:
            self.total[self.key] += time.perf_counter() - t0


def time_linears(model: nn.Module, totals: dict[str, float]) -> None:
    started: list[float] = []

    def before(*_: object) -> None:
        started.append(time.perf_counter())

    def after(*_: object) -> None:
        totals["linear"] += time.perf_counter() - started.pop()

    for module in model.modules():
        if isinstance(module, LINEARS):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)


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
    warm = [3 + (i * 7919) % (vocab - 3) for i in range(32)]  # no timed prompt starts so
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=4))
    totals: dict[str, float] = defaultdict(float)
    model = engine.runner.model
    time_linears(model, totals)
    engine.runner.model = Timed(model, totals, "forward")  # type: ignore[assignment]
    F.scaled_dot_product_attention = Timed(F.scaled_dot_product_attention, totals, "attention")  # type: ignore[assignment]
    Attention._decode = Timed(Attention._decode, totals, "attention")  # type: ignore[method-assign]
    if engine.runner.decode_kernel is not None:  # C through ctypes: no operator of torch's
        kernel = engine.runner.decode_kernel
        engine.runner.decode_kernel = Timed(kernel, totals, "attention")  # type: ignore[assignment]
    runner_module.sample = Timed(runner_module.sample, totals, "sample")  # type: ignore[assignment]
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(engine.prepare_request(prompt, RequestOptions(sp, f"p{i}"))[0])
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    kind = f"{args.dtype}{' int8' if args.quantization else ''}"
    print(f"{args.model.name} {kind}: {args.requests} requests, {w.output_tokens} output "
          f"tokens, {steps} steps, {wall:.1f} s ({w.output_tokens / wall:.1f} output tok/s, "
          f"{torch.get_num_threads()} threads)")  # fmt: skip
    rows = [
        ("forward: linear layers", totals["linear"]),
        ("forward: attention", totals["attention"]),
        ("forward: the rest", totals["forward"] - totals["linear"] - totals["attention"]),
        ("sampling", totals["sample"]),
        ("scheduler, metadata, outputs", wall - totals["forward"] - totals["sample"]),
    ]
    for name, secs in rows:
        print(f"  {name:<30}{secs:>8.2f} s {secs / wall:>7.1%}  {secs / steps * 1e3:>7.2f} ms/step")


if __name__ == "__main__":
    main()
