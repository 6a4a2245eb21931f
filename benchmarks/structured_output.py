"""The cost of structured output: workload W1 with a JSON schema on every request, against W1 free.

W1 (see ``engine_throughput.py``): the ``w0`` model, 64 requests, prompts of 64-512 tokens,
outputs of 32-256, all at once, greedy, ``ignore_eos``. The constrained run gives every request
a JSON schema (an array of at least 100 objects with a bounded integer and a short string), so
no answer can end before its ``max_tokens`` and both runs produce exactly the same number of
tokens: the difference is the grammar's cost (matcher builds, the batch's masks each step, the
masked sampling). After one untimed run of each, the two alternate ``--repeat`` times; medians
are shown.

Reported: output tokens/s, per-request TPOT (time between its first and last token over the
tokens between) at p50/p99, and inter-token latency p99 across all requests' gaps. Targets
(issue 18): constrained output tokens/s >= 85 % of free, TPOT p99 <= 115 % of free.

    python benchmarks/structured_output.py [--dtype bfloat16] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

from engine_throughput import DEFAULT_MODEL, Workload, workload_w1
from poise import LLM, SamplingParams
from poise.engine.intake import RequestOptions
from poise.engine.structured import compile_guided

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
        },
        "required": ["id", "name"],
        "additionalProperties": False,
    },
    "minItems": 100,
}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(llm: LLM, w: Workload, constrained: bool) -> dict[str, float]:
    engine = llm.engine
    guided = compile_guided("json_schema", SCHEMA, "response_format") if constrained else None
    stamps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for i, (prompt, out) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        # The schema cannot end before max_tokens, so its grammar never allows the end of
        # sequence: ignore_eos (which structured output refuses) is not needed for the length.
        sp = SamplingParams(
            temperature=0, max_tokens=out, ignore_eos=not constrained, guided=guided
        )
        rid = f"w1-{int(constrained)}-{i}"
        request, _ = engine.prepare_request(prompt, RequestOptions(sp, request_id=rid))
        engine.add_request(request)
        stamps[rid] = []
    produced = 0
    texts = []
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            stamps[o.request_id].extend([now] * len(o.outputs[0].delta_token_ids))
            if o.finished:
                produced += len(o.outputs[0].token_ids)
                texts.append(o.outputs[0].text)
    seconds = time.perf_counter() - t0
    if constrained:  # every answer is a prefix of valid JSON: it starts as the schema says
        assert all(t.startswith('[{"id":') for t in texts), texts[:2]
    tpots = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    gaps = [b - a for s in stamps.values() for a, b in itertools.pairwise(s) if b > a]
    assert produced == w.output_tokens, (produced, w.output_tokens)
    return {
        "seconds": seconds,
        "output_tok_s": produced / seconds,
        "tpot_p50_ms": 1000 * _pct(tpots, 0.5),
        "tpot_p99_ms": 1000 * _pct(tpots, 0.99),
        "itl_p99_ms": 1000 * _pct(gaps, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None, help="cpu (default), cuda")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=64,
    )
    w = workload_w1(llm.engine.model.config.vocab_size, n=args.requests)
    llm.generate([{"prompt_token_ids": w.prompts[0][:32]}], SamplingParams(max_tokens=4))
    for constrained in (False, True):  # the first full runs pay one-time costs (allocator, CUDA)
        run(llm, w, constrained)
    runs: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    for _ in range(args.repeat):
        for name, results in runs.items():
            result = run(llm, w, name == "json_schema")
            results.append(result)
            print(name, {k: round(v, 2) for k, v in result.items()}, flush=True)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    free, constrained = med["free"], med["json_schema"]
    where = llm.engine.config.device or "cpu"
    print(f"\nW1, {args.dtype} on {where}, {args.requests} requests, medians of {args.repeat}:")
    print(f"{'':14}{'out tok/s':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>10}")
    for name, m in med.items():
        print(
            f"{name:14}{m['output_tok_s']:10.0f}{m['tpot_p50_ms']:9.1f}ms"
            f"{m['tpot_p99_ms']:9.1f}ms{m['itl_p99_ms']:9.1f}ms"
        )
    tput = constrained["output_tok_s"] / free["output_tok_s"]
    tpot = constrained["tpot_p99_ms"] / free["tpot_p99_ms"]
    print(f"\nthroughput ratio {tput:.1%} (target >= 85%); TPOT p99 ratio {tpot:.1%} (<= 115%)")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": med}, indent=2))


if __name__ == "__main__":
    main()
