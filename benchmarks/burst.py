"""Bounded bursts: W1's 64 requests sent at once, several bursts in a row, through the official
``openai`` client as it comes (two retries, honouring ``Retry-After``).

A batch job, an eval harness or ``vllm bench serve --max-concurrency 64`` sends work this way:
a bounded number of requests, all at once, the next burst when the last one is answered. A
server that sheds load must tell such a burst (a queue that drains) from a flood (a queue that
grows); this counts, per burst, the requests that completed, the ones that failed (what the
client saw after its retries) and every refusal the server sent (the client's retries hide
them, so they are counted by an httpx event hook on each response).

The deployment is started here on loopback, on its defaults: one ``poise serve`` (``--target
serve``), ``poise up`` with two replicas (``--target up``), or vLLM's CPU build from the
benchmark venv ``.cache/vllm-venv`` (``--target vllm``). Everything stops by pid.

    python benchmarks/burst.py --model .cache/models/w0 --target serve [--bursts 3] [--json F]

``--closed-loop S`` runs a closed loop instead: ``--concurrency`` clients, started over
``--ramp-s`` seconds (users arriving, or ``vllm bench serve --request-rate R --max-concurrency
N``), each sending its next W1 request when the last is answered or has failed, for S seconds.
Every such request is one the server could serve: no more are ever waiting than there are
clients. ``--slo-ttft-ms MS`` sends that first-token objective on every request
(``x-slo-ttft-ms``): a patient client says how long it will wait, and poise holds it to that
rather than to its queue target.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

from engine_throughput import workload_w1
from poise.launcher import free_port, serve_argv, stop_group, wait_ready

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"


@dataclass
class BurstReport:
    burst: int
    sent: int
    completed: int = 0
    failed: int = 0
    refusals_seen: int = 0  # 429/503 answers, retried ones included
    seconds: float = 0.0
    output_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)  # the first few errors, as told


def start(target: str, model: str, port: int, flags: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    if target == "serve":
        argv = serve_argv(model, port, "--log-level", "warning", *flags)
        name = Path(model).name
    elif target == "up":
        serve_flags = " ".join(["--log-level", "warning", *flags])
        argv = [sys.executable, "-m", "poise.cli", "up", "--model", model, "--replicas", "2",
                "--port", str(port), "--serve-flags", serve_flags]  # fmt: skip
        name = "demo"
    else:
        if not VLLM_PYTHON.exists():
            raise SystemExit(f"no vLLM venv at {VLLM_PYTHON.parent.parent} (make test builds it)")
        env |= {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(port), "--max-num-seqs", "64", "--no-enable-prefix-caching",
                "--served-model-name", Path(model).name, *flags]  # fmt: skip
        name = Path(model).name
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + ("/health" if target == "vllm" else "/ready"), proc, str, target, 600)
        if target == "up":
            wait_routable(url, name, 2)
    except (TimeoutError, RuntimeError):
        stop_group(proc, 30)
        raise
    return proc, name


def wait_routable(url: str, model: str, replicas: int) -> None:
    end = time.monotonic() + 180
    while time.monotonic() < end:
        state = httpx.get(url + "/debug/state", timeout=5).json()
        if len(state["models"][model]["trusted"]) >= replicas:
            return
        time.sleep(0.5)
    raise TimeoutError("the gateway did not route to every replica")


async def one_burst(url: str, model: str, index: int, seed: int, concurrency: int) -> BurstReport:
    work = workload_w1(32000, seed=seed, n=concurrency)
    report = BurstReport(index, len(work.prompts))
    http, client = _client(url, report)
    t0 = time.perf_counter()
    async with http:
        await asyncio.gather(
            *(
                _complete(client, model, report, p, n)
                for p, n in zip(work.prompts, work.output_lens, strict=True)
            )
        )
    report.seconds = time.perf_counter() - t0
    return report


def _client(
    url: str, report: BurstReport, slo_ttft_ms: float | None = None
) -> tuple[httpx.AsyncClient, openai.AsyncOpenAI]:
    """The official client as it comes, and every 429/503 it sees counted in the report."""

    async def count_refusals(response: httpx.Response) -> None:
        if response.status_code in (429, 503):
            report.refusals_seen += 1

    http = httpx.AsyncClient(
        event_hooks={"response": [count_refusals]},
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000),
        timeout=600,
    )
    headers = {} if slo_ttft_ms is None else {"x-slo-ttft-ms": f"{slo_ttft_ms:g}"}
    return http, openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", http_client=http, default_headers=headers
    )


async def closed_loop(url: str, model: str, args: argparse.Namespace) -> BurstReport:
    work = workload_w1(32000, seed=7, n=max(256, 4 * args.concurrency))
    report = BurstReport(0, 0)
    http, client = _client(url, report, args.slo_ttft_ms)
    items = itertools.cycle(list(zip(work.prompts, work.output_lens, strict=True)))
    t0 = time.perf_counter()

    async def user(i: int) -> None:
        await asyncio.sleep(i * args.ramp_s / args.concurrency)
        while time.perf_counter() - t0 < args.closed_loop:
            prompt, max_tokens = next(items)
            report.sent += 1
            await _complete(client, model, report, prompt, max_tokens)

    async with http:
        await asyncio.gather(*(user(i) for i in range(args.concurrency)))
    report.seconds = time.perf_counter() - t0
    return report


async def _complete(
    client: openai.AsyncOpenAI, model: str, report: BurstReport, prompt: list[int], max_tokens: int
) -> None:
    try:
        r = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        report.completed += 1
        report.output_tokens += r.usage.completion_tokens if r.usage else 0
    except openai.APIError as exc:
        report.failed += 1
        kind = f"{getattr(exc, 'status_code', None)} {type(exc).__name__}"
        report.errors[kind] = report.errors.get(kind, 0) + 1
        if len(report.messages) < 3:
            report.messages.append(str(exc)[:300])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "w0"))
    ap.add_argument("--target", choices=["serve", "up", "vllm"], default="serve")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64, help="requests per burst")
    ap.add_argument("--flags", default="", help="more flags for the server (none: its defaults)")
    ap.add_argument("--url", help="an already running deployment instead of starting one")
    ap.add_argument("--served-name", help="with --url: the model name to ask for")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--closed-loop", type=float, help="seconds of a closed loop, not bursts")
    ap.add_argument("--ramp-s", type=float, default=0.0, help="closed loop: clients start over")
    ap.add_argument("--slo-ttft-ms", type=float, help="send this x-slo-ttft-ms on every request")
    args = ap.parse_args()
    proc = None
    if args.url:
        url, name = args.url, args.served_name or Path(args.model).name
    else:
        port = free_port()
        proc, name = start(args.target, args.model, port, args.flags.split())
        url = f"http://127.0.0.1:{port}"
    reports = []
    try:
        runs = [("closed loop", lambda: closed_loop(url, name, args))]
        if args.closed_loop is None:
            runs = [
                (f"burst {i + 1}", lambda i=i: one_burst(url, name, i + 1, i, args.concurrency))
                for i in range(args.bursts)
            ]
        for what, run in runs:
            r = asyncio.run(run())
            reports.append(r)
            print(
                f"{what}: {r.completed}/{r.sent} completed, {r.failed} failed, "
                f"{r.refusals_seen} refusals seen, {r.seconds:.1f}s, "
                f"{r.output_tokens / r.seconds:.0f} out-tok/s {r.errors or ''}",
                flush=True,
            )
            for message in r.messages:
                print(f"  {message}")
    finally:
        if proc is not None:
            stop_group(proc, 60)
    total = sum(r.sent for r in reports)
    done = sum(r.completed for r in reports)
    print(f"{args.target}: {done}/{total} completed, {sum(r.failed for r in reports)} failed, "
          f"{sum(r.refusals_seen for r in reports)} refusals seen")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0 if done == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
