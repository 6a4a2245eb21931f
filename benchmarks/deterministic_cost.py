"""What the deterministic mode costs: W1 (see engine_throughput.py) through poise with the mode
off and on, interleaved in one run, medians of ``--repeat`` runs each, and the ratio.

Also checks what the mode is for, on the same engines: W1's first 8 requests generated alone
give the same tokens as within the whole of W1, with the mode on (and, for the record, how many
do without it). And the prefill of long prompts (``--long-prompt`` tokens, 4 at once, 16 tokens
out, fresh prompts each run), where the mode costs most: every prompt row's attention goes
through the decode kernel.

    python benchmarks/deterministic_cost.py [--dtype bfloat16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from poise import LLM, SamplingParams
from poise.modelgen.make_model import make_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import DEFAULT_MODEL, run_poise, workload_w1


def agreement(model: Path, dtype: str, deterministic: bool, w, probes: int = 8) -> int:
    """How many of the first ``probes`` requests answer alone as they do among all of W1."""
    # No prefix cache: the lone runs must compute their prompts afresh, not reuse the crowd's.
    llm = LLM(
        model, dtype=dtype, deterministic=deterministic, max_num_seqs=64,
        enable_prefix_caching=False,
    )  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
    prompts = [{"prompt_token_ids": p} for p in w.prompts]
    crowd = llm.generate(prompts, params)
    same = 0
    for i in range(probes):
        alone = llm.generate([prompts[i]], params[i])[0]
        same += alone.outputs[0].token_ids == crowd[i].outputs[0].token_ids
    return same


def long_prompts(model: Path, dtype: str, tokens: int, repeat: int) -> dict[str, list[float]]:
    """Seconds for 4 fresh prompts of ``tokens`` tokens (16 out), off and on interleaved."""
    engines = {
        mode: LLM(model, dtype=dtype, deterministic=mode == "on", enable_prefix_caching=False)
        for mode in ("off", "on")
    }
    vocab = engines["off"].engine.model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeat):
        for mode, llm in engines.items():
            prompts = [
                {"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(tokens)]}
                for _ in range(4)
            ]
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            seconds[mode].append(time.perf_counter() - t0)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=2000, help="tokens; 0: skip")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        make_model(args.model, "llama", "w0")
    probe = LLM(args.model, dtype=args.dtype)
    w = workload_w1(probe.engine.model.config.vocab_size)
    del probe
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.repeat):
        for mode in ("off", "on"):
            res = run_poise(args.model, args.dtype, w, 1 << 30, deterministic=mode == "on")
            assert res.output_tokens == w.output_tokens
            seconds[mode].append(res.seconds)
            print(f"run {r} {mode}: {res.seconds:.2f} s", flush=True)
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    result = {
        "dtype": args.dtype,
        "requests": len(w.prompts),
        "output_tokens": w.output_tokens,
        "seconds_off": seconds["off"],
        "seconds_on": seconds["on"],
        "median_off_s": round(off, 2),
        "median_on_s": round(on, 2),
        "slowdown": round(on / off - 1, 3),
        "probes_same_alone_and_in_w1": {
            "on": agreement(args.model, args.dtype, True, w),
            "off": agreement(args.model, args.dtype, False, w),
            "of": 8,
        },
    }
    if args.long_prompt:
        long = long_prompts(args.model, args.dtype, args.long_prompt, args.repeat)
        off_l, on_l = statistics.median(long["off"]), statistics.median(long["on"])
        result["long_prompts"] = {
            "prompt_tokens": args.long_prompt,
            "seconds_off": long["off"],
            "seconds_on": long["on"],
            "median_off_s": round(off_l, 2),
            "median_on_s": round(on_l, 2),
            "slowdown": round(on_l / off_l - 1, 3),
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
