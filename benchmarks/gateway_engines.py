"""The gateway's promises in front of real vLLM servers, measured on its defaults.

Two vLLM servers (the CPU build from ``.cache/vllm-venv``, which ``make test`` installs; the
flags of the tests: bfloat16, 1024 tokens of context, no prefix caching) of a random
``make-model --size small`` checkpoint, and a ``poise gateway`` with nothing but its pool set.
Rounds, each on a fresh gateway:

- hang: SIGSTOP on one server's engine core (its HTTP server still answers /health); seconds
  until the gateway marks it down; SIGCONT, seconds until it is back;
- busy: one server held busy by 4 requests sent to it directly; the share of 20 requests sent
  through the gateway that go to the other one;
- kill: 8 streams (chat and completions, 900 tokens each) under way, kill -9 of the server
  holding more of them (its whole process group), then started again for the next round; how
  the streams ended: whole, continued (approximate), an error event, refused before they began
  (an explicit 5xx), or cut silently.

Also the cost of reading another engine's stream (``Transcript.observe``) per event.

Usage: python benchmarks/gateway_engines.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from poise.gateway.continuation import Transcript
from poise.modelgen.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from gatewayproc import GatewayProcess  # noqa: E402
from vllmproc import VLLM_PYTHON, VllmProcess, start_vllm  # noqa: E402

RESUMED = ": x-poise-resumed: approximate"
REFUSALS = Counter[int]()  # answers other than 200 in the busy rounds, by status


def backends_of(g: GatewayProcess) -> dict[str, dict[str, Any]]:
    state = httpx.get(g.url + "/debug/state", timeout=5).json()
    return {b["url"]: b for b in state["models"]["m"]["backends"]}


def until(predicate: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError
        time.sleep(0.02)
    return time.monotonic() - t0


def hang_round(g: GatewayProcess, hung: VllmProcess) -> tuple[float, float]:
    until(lambda: all(b["healthy"] and b["checked"] for b in backends_of(g).values()), 30)
    core = hung.engine_core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        down = until(lambda: not backends_of(g)[hung.url]["healthy"], 30)
        assert httpx.get(hung.url + "/health", timeout=5).status_code == 200
    finally:
        os.kill(core, signal.SIGCONT)
    up = until(lambda: backends_of(g)[hung.url]["healthy"], 30)
    return down, up


def busy_round(g: GatewayProcess, busy: VllmProcess, idle: VllmProcess) -> float:
    stop = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        holders = [pool.submit(busy.keep_busy, stop, i) for i in range(4)]
        try:
            until(lambda: backends_of(g)[busy.url]["reported_load"]["running"] >= 3, 60)
            before = _attempts(g)
            for _ in range(20):
                r = httpx.post(
                    g.url + "/v1/completions",
                    json={"model": "m", "prompt": "hello", "max_tokens": 3},
                    timeout=30,
                )
                if r.status_code != 200:
                    REFUSALS[r.status_code] += 1
            after = _attempts(g)
        finally:
            stop.set()
        for h in holders:
            h.result(60)
    moved = {u: after[u] - before.get(u, 0.0) for u in after}
    return moved.get(idle.url, 0.0) / max(1.0, sum(moved.values()))


def _attempts(g: GatewayProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(g.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("poise_gateway_upstream_attempts_total{") and 'outcome="ok"' in line:
            url = line.split('backend="', 1)[1].split('"', 1)[0]
            out[url] = out.get(url, 0) + float(line.rpartition(" ")[2])
    return out


def _settled(g: GatewayProcess) -> bool:
    """Every backend up and idle by its own report (the busy round's streams are gone)."""
    return all(
        b["healthy"] and b["checked"] and b["reported_load"]["running"] == 0
        for b in backends_of(g).values()
    )


def kill_round(g: GatewayProcess, pair: list[VllmProcess]) -> tuple[int, Counter[str]]:
    """(index of the server killed, how the streams ended)."""
    until(lambda: _settled(g), 60)
    lines: list[list[str]] = [[] for _ in range(8)]

    def stream(i: int) -> None:
        common = {"model": "m", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        if i % 2:
            path, body = (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": f"q{i}"}]},
            )
        else:
            path, body = "/v1/completions", {"prompt": f"Once upon a time, number {i}"}
        with httpx.stream(
            "POST", g.url + path, json={**body, **common, "stream": True}, timeout=180
        ) as r:
            if r.status_code != 200:
                lines[i].append(f"refused {r.status_code}")
                return
            for line in r.iter_lines():
                if line:
                    lines[i].append(line)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        until(lambda: any(len(x) >= 5 for x in lines), 60)
        state = backends_of(g)
        victim = max(range(2), key=lambda k: state[pair[k].url]["inflight"])
        pair[victim].kill()
        for f in futures:
            f.result(240)
    ends = Counter[str]()
    for seen in lines:
        if seen and seen[-1].startswith("refused"):
            ends["refused before it began"] += 1
            continue
        datas = [json.loads(x[6:]) for x in seen if x.startswith("data: {")]
        if any("error" in d for d in datas):
            ends["error event"] += 1
        elif not seen or seen[-1] != "data: [DONE]":
            ends["cut silently"] += 1
        elif RESUMED in seen:
            ends["continued"] += 1
        else:
            ends["whole"] += 1
    return victim, ends


def observe_cost_us(n: int = 20000) -> float:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
    }
    event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    t = Transcript(chat=True, strip_usage=True)
    t0 = time.perf_counter()
    for _ in range(n):
        t.observe(event)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM venv at .cache/vllm-venv: run `make test` once (it builds it)")
    work = Path(tempfile.mkdtemp(prefix="gateway-engines-"))
    model = make_model(work / "small", "llama", "small")
    servers = start_vllm(2, model, work)
    results: dict[str, list[Any]] = {"down_s": [], "up_s": [], "idle_share": [], "kill": []}
    try:
        for k in range(args.rounds):
            a, b = servers
            g = GatewayProcess(
                {"models": {"m": {"backends": [{"url": a.url}, {"url": b.url}]}}}, work
            )
            try:
                down, up = hang_round(g, a)
                results["down_s"].append(down)
                results["up_s"].append(up)
                results["idle_share"].append(busy_round(g, a, b))
                victim, ends = kill_round(g, servers)
                results["kill"].append(dict(ends))
            finally:
                g.stop()
            print(f"round {k}: {json.dumps({key: v[-1] for key, v in results.items()})}")
            servers[victim].stop()
            servers[victim] = VllmProcess(model, work, cpus=str(victim))
            servers[victim].wait_ready()
    finally:
        for s in servers:
            s.stop()
    kills = Counter[str]()
    for r in results["kill"]:
        kills.update(r)
    summary = {
        "rounds": args.rounds,
        "hang_marked_down_s": {"median": statistics.median(results["down_s"]),
                               "max": max(results["down_s"])},
        "back_up_after_sigcont_s": statistics.median(results["up_s"]),
        "share_to_idle_backend": {"median": statistics.median(results["idle_share"]),
                                  "min": min(results["idle_share"])},
        "busy_round_refusals": dict(REFUSALS),
        "streams_at_kill": dict(kills),
        "transcript_observe_us_per_event": round(observe_cost_us(), 2),
    }  # fmt: skip
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
