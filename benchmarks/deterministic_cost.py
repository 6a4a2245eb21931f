"""What the deterministic mode costs: W1 (see engine_throughput.py) through poise with the mode
off and on, interleaved in one run, medians of ``--repeat`` runs each, and the ratio.

Also checks what the mode is for, on the same engines: W1's first 8 requests generated alone
give the same tokens as within the whole of W1, with the mode on (and, for the record, how many
do without it).

    python benchmarks/deterministic_cost.py [--dtype bfloat16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=3)
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
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
