"""Short interactive prompts beside long ones, against a running ``poise serve``: the short
requests' time to first token, and how many were refused.

Poisson arrivals at 3/s for 30 s; 15 % are 1500-token prompts (32 tokens out), the rest
24-token prompts (64 out), streamed. Start the server yourself, pinned apart from this client:

    taskset -c 0 .venv/bin/poise serve --model .cache/models/w0 --port 8000 \\
        --served-model-name demo &
    taskset -c 1 .venv/bin/python benchmarks/short_beside_long.py http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import httpx

RATE = 3.0
DURATION_S = 30.0
LONG_SHARE = 0.15


async def one(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, out: list
) -> None:
    start = time.perf_counter()
    ttft = None
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            out.append(("refused", None))
            return
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data:") and '"text"' in line:
                ttft = time.perf_counter() - start
    out.append(("ok", ttft))


def quantile(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def main(url: str) -> None:
    rng = random.Random(1)
    shorts: list = []
    longs: list = []
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = []
        t = 0.0
        start = time.perf_counter()
        while True:
            t += rng.expovariate(RATE)
            if t > DURATION_S:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            if rng.random() < LONG_SHARE:
                prompt = [rng.randrange(300, 30000) for _ in range(1500)]
                tasks.append(asyncio.create_task(one(client, url, prompt, 32, longs)))
            else:
                prompt = [rng.randrange(300, 30000) for _ in range(24)]
                tasks.append(asyncio.create_task(one(client, url, prompt, 64, shorts)))
        await asyncio.gather(*tasks)
    short_ttft = sorted(x for kind, x in shorts if kind == "ok" and x is not None)
    long_ttft = sorted(x for kind, x in longs if kind == "ok" and x is not None)
    print(json.dumps({
        "short_sent": len(shorts), "short_served": len(short_ttft),
        "short_ttft_p50": quantile(short_ttft, 0.5), "short_ttft_p90": quantile(short_ttft, 0.9),
        "short_ttft_p99": quantile(short_ttft, 0.99),
        "long_sent": len(longs), "long_served": len(long_ttft),
        "long_ttft_p50": quantile(long_ttft, 0.5),
    }))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
