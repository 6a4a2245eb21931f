"""Time to first token of a lone request and of a cluster of three, on poise's defaults and on vLLM.

A cluster is three requests sent 20 ms apart (Poisson arrivals bring such clusters at any load):
the first starts alone, and the other two's prompts are prefilled while it streams. How long
they wait is what a step-time budget costs, or not, where nobody's time per token is near its
objective. Each request is W2's: 256 random prompt token ids, 64 tokens streamed (ignore_eos).
Five lone requests, then three clusters each a second after the last ended, after three to
warm up (``--clusters`` more); the deployment is started and stopped by pid, on loopback. Every
request runs to its length (ignore_eos), the case where a stream's time to come is known.

    python benchmarks/cluster_ttft.py [--target serve|vllm] [--flags "--step-time-budget-s 0"]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import httpx

from serve_overload import Replica, run_async

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64
CLUSTER_GAP_S = 0.02


async def timed(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int]
) -> tuple[float, float]:
    """(TTFT, mean time per output token) of one streamed completion, in seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip
    sent = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    # A server may put more than one token in an event: the mean is over the tokens.
    return stamps[0] - sent, (stamps[-1] - stamps[0]) / (OUTPUT_TOKENS - 1)


async def measure(url: str, model: str, clusters: int) -> dict[str, list[list[float]]]:
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(300, 31000) for _ in range(PROMPT_TOKENS)]

    async def later(client: httpx.AsyncClient, delay: float) -> tuple[float, float]:
        await asyncio.sleep(delay)
        return await timed(client, url, model, prompt())

    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(3):
            await timed(client, url, model, prompt())
        lone = [await timed(client, url, model, prompt()) for _ in range(5)]
        together = []
        for _ in range(clusters):
            await asyncio.sleep(1.0)
            together.append(
                await asyncio.gather(*(later(client, CLUSTER_GAP_S * k) for k in range(3)))
            )
    return {"lone": [list(x) for x in lone], "clusters": [[list(x) for x in c] for c in together]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "w0"))
    ap.add_argument("--target", choices=["serve", "vllm"], default="serve")
    ap.add_argument("--flags", default="", help="more flags for the server (none: its defaults)")
    ap.add_argument("--clusters", type=int, default=3)
    args = ap.parse_args()
    flags = args.flags.split()
    if args.target == "vllm" and "--dtype" not in flags:
        # The checkpoint's own, as poise's auto takes it: vLLM's CPU build would cast a float32
        # checkpoint to bfloat16, which an AVX2 host only emulates.
        flags += ["--dtype", "float32"]
    replica = Replica(args.model, flags, vllm=args.target == "vllm")
    try:
        got = run_async(measure(replica.url, replica.model, args.clusters))
    finally:
        replica.stop()
    for name, runs in [("lone", [got["lone"]]), ("cluster", got["clusters"])]:
        for run in runs:
            ttft = [round(1000 * t) for t, _ in run]
            print(f"{name}: TTFT {ttft} ms, TPOT {[round(1000 * p) for _, p in run]} ms")
    lone = got["lone"]
    third = [c[-1][0] for c in got["clusters"]]
    print(f"lone TTFT median {1000 * statistics.median(t for t, _ in lone):.0f} ms; "
          f"a cluster's last TTFT median {1000 * statistics.median(third):.0f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
