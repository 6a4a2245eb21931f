"""What the gateway adds: the same load straight to a fast upstream and through the gateway.

The upstream is a minimal OpenAI-shaped server (fixed answer, no model) so that what is measured
is the gateway's own cost. For streaming and non-streaming requests, in turn:
1. fixed-rate arrivals (default 200/s) for a bounded time, direct and via the gateway in
   alternating short rounds (so both see the same drift of the machine's speed): latency
   p50/p99 (to the last byte) over all rounds, and the difference;
2. a closed loop at fixed concurrency for a bounded time: the most requests/s each path carries.
Everything runs on loopback and stops by itself; processes are stopped by pid.

    python benchmarks/gateway_overhead.py [--rate 200] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from poise.launcher import free_port, stop_process, wait_ready

UPSTREAM = r"""
import json, sys
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
import uvicorn

BODY = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": "hello world", "finish_reason": "length",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}}
EVENT = ("data: " + json.dumps({**BODY, "choices": [{"index": 0, "text": "tok",
         "finish_reason": None, "logprobs": None}]}) + "\n\n").encode()

async def completions(request):
    body = await request.json()
    if body.get("stream"):
        async def gen():
            for _ in range(8):
                yield EVENT
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")
    return JSONResponse(BODY)

async def ok(request):
    return Response("ok")

async def models(request):  # what the gateway's checks ask a server of no known engine
    return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/models", models), Route("/health", ok),
                        Route("/metrics", ok)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float | None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": stream}
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            if stream:
                async for _ in r.content.iter_any():
                    pass
            else:
                await r.read()
            ok = r.status == 200
    except aiohttp.ClientError:
        return None
    return time.perf_counter() - t0 if ok else None


def session() -> aiohttp.ClientSession:
    # aiohttp, not httpx: the client shares the two cores with both servers, and its own cost
    # per request (about half httpx's) is noise in what is measured here.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=500), timeout=aiohttp.ClientTimeout(total=30)
    )


async def fixed_rate(url: str, stream: bool, rate: float, duration: float) -> list[float | None]:
    async with session() as client:
        for _ in range(20):
            await one(client, url, stream)
        start = time.perf_counter()
        tasks = []
        for i in range(int(rate * duration)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, stream)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(url: str, stream: bool, concurrency: int, duration: float) -> float:
    done = 0
    end = time.perf_counter() + duration
    async with session() as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                if await one(client, url, stream) is not None:
                    done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / duration


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per path, in all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--log-level",
        default="warning",
        help="the gateway's; at info it also writes its JSON line per request (to /dev/null)",
    )
    args = ap.parse_args()
    up_port, gw_port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)])
    cfg = Path(tempfile.mkdtemp()) / "gateway.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "port": gw_port,
                "log_level": args.log_level,
                "models": {"m": {"backends": [{"url": f"http://127.0.0.1:{up_port}"}]}},
                "health": {"generate_probe": False, "interval_s": 1.0},
            }
        )
    )
    gateway = subprocess.Popen(
        [sys.executable, "-m", "poise.cli", "gateway", "--config", str(cfg)],
        stderr=subprocess.DEVNULL if args.log_level == "info" else None,
    )
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{up_port}/health", upstream, str, "upstream", 60)
        wait_ready(f"http://127.0.0.1:{gw_port}/ready", gateway, str, "gateway", 60)
        direct = f"http://127.0.0.1:{up_port}/v1/completions"
        via = f"http://127.0.0.1:{gw_port}/v1/completions"
        for stream in (False, True):
            # Short rounds, direct and via the gateway in turn: the machine's speed drifts
            # over seconds, and both paths must see the same drift.
            got: dict[str, list[float | None]] = {"direct": [], "gateway": []}
            for _ in range(args.rounds):
                for name, url in (("direct", direct), ("gateway", via)):
                    got[name] += asyncio.run(
                        fixed_rate(url, stream, args.rate, args.duration / args.rounds)
                    )
            lat = {}
            for name, res in got.items():
                ok = [1000 * x for x in res if x is not None]
                lat[name] = (pct(ok, 0.5), pct(ok, 0.99), len(res) - len(ok))
            rps = {
                name: asyncio.run(closed_loop(url, stream, args.concurrency, args.duration / 2))
                for name, url in (("direct", direct), ("gateway", via))
            }
            rows.append((stream, lat, rps))
    finally:
        stop_process(gateway, 15)
        stop_process(upstream, 15)
    print(
        f"\n{args.rate:g} req/s for {args.duration:g}s per path; max rps at concurrency "
        f"{args.concurrency}; gateway log level {args.log_level}"
    )
    print(
        f"{'mode':<11}{'direct p50':>11}{'p99':>8}{'gw p50':>9}{'p99':>8}{'added p50':>11}"
        f"{'added p99':>11}{'failed':>8}{'max rps direct':>16}{'via gw':>8}"
    )
    for stream, lat, rps in rows:
        d, g = lat["direct"], lat["gateway"]
        print(
            f"{'stream' if stream else 'non-stream':<11}{d[0]:>9.2f}ms{d[1]:>6.2f}ms"
            f"{g[0]:>7.2f}ms{g[1]:>6.2f}ms{g[0] - d[0]:>9.2f}ms{g[1] - d[1]:>9.2f}ms"
            f"{d[2] + g[2]:>8}{rps['direct']:>16.0f}{rps['gateway']:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
