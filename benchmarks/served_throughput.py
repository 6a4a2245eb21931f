"""W1's request mix served over HTTP: poise against vLLM for the CPU, with one driver, side by side.

Each system is a real server started here on loopback (``poise serve`` on its defaults, and
vLLM's OpenAI server from the benchmark venv ``.cache/vllm-venv`` when it is present, with
prefix caching off and ``--max-num-seqs 64`` as issue 19 gives it). The driver posts W1's 64
requests at once to ``/v1/completions`` as token-id prompts, greedy, ``ignore_eos``, and times
from the first send to the last answer. Repeat ``k`` uses workload seed ``k`` for every system,
so the requests are the same across systems while no run finds the previous run's prompts in a
prefix cache (the warm-up prompt starts like none of them); the runs of the systems alternate
and the table shows medians.

``--batch1`` measures one user instead: a 256-token prompt and 128 output tokens, streamed,
``--repeat`` times after one untimed request: TTFT (send to first token) and TPOT (first to last
token over the tokens between), medians. transformers joins that table in-process
(``generate`` with a streamer), as the same request alone.

Output agreement: for every repeat, the share of requests whose texts are identical between
the first system and each other (informational: different kernels round differently).

    python benchmarks/served_throughput.py --model .cache/models/w3 --dtype float32 \
        [--systems poise vllm poise-int8 poise-bare] [--repeat 3] [--batch1 [--transformers]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from engine_throughput import DEFAULT_MODEL, Workload, workload_w1
from poise.launcher import free_port, serve_argv, stop_group

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"


@dataclass(frozen=True)
class System:
    name: str
    argv: list[str]
    env: dict[str, str]


class SpanSink(ThreadingHTTPServer):
    """A local OTLP/HTTP trace receiver for ``poise-traced``: takes every export, counts it."""

    def __init__(self) -> None:
        self.exports = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.bytes += len(self.rfile.read(int(self.headers["content-length"])))
                sink.exports += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


SINKS: list[SpanSink] = []  # the one receiver, made on first use


# poise's systems: their flags beyond the model, dtype and port.
POISE_FLAGS = {
    "poise": [],  # the defaults
    "poise-int8": ["--quantization", "int8"],
    "poise-nobudget": ["--step-time-budget-s", "0"],  # the 80 ms step-time budget off
    # the stability mechanisms off, for their cost (against poise-traced)
    "poise-bare": ["--no-admission-control", "--engine-in-thread"],
    "poise-traced": [],  # the defaults, with traces to a local OTLP receiver
}
SYSTEMS = [*POISE_FLAGS, "vllm"]


def system(name: str, model: Path, dtype: str, port: int) -> System:
    if name in POISE_FLAGS:
        flags = ["--dtype", dtype, *POISE_FLAGS[name]]
        if name == "poise-traced":
            if not SINKS:
                SINKS.append(SpanSink())
            flags += ["--otlp-endpoint", SINKS[0].endpoint]
        return System(name, serve_argv(str(model), port, *flags), {})
    if name == "vllm":
        if not VLLM_PYTHON.exists():
            raise SystemExit(f"vllm: no benchmark venv at {VLLM_PYTHON.parent.parent}")
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model), "--dtype", dtype, "--max-num-seqs", "64",
                "--no-enable-prefix-caching", "--port", str(port)]  # fmt: skip
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        }
        return System(name, argv, env)
    raise SystemExit(f"unknown system {name!r}")  # argparse's choices keep this unreachable


def _wait_ready(proc: subprocess.Popen[bytes], base: str, name: str, log: Path) -> str:
    """The served model's id, once the server says it is ready."""
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
        try:
            # poise's /health is liveness (200 while loading); vLLM has no /ready
            ready = "/health" if name == "vllm" else "/ready"
            if httpx.get(f"{base}{ready}", timeout=2).status_code == 200:
                return str(httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start in 600 s; see {log}")
        time.sleep(1)


@contextmanager
def running(sys_: System, port: int, log: Path) -> Iterator[tuple[str, str]]:
    """The server, up and answering ``/v1/models``; stopped by pid (its process group) after."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            sys_.argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **sys_.env},
            start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, _wait_ready(proc, base, sys_.name, log)
    finally:
        if proc.poll() is None:
            stop_group(proc, 30)


async def _complete(client: httpx.AsyncClient, model: str, prompt: list[int], n: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    data = r.json()
    if data["usage"]["completion_tokens"] != n:
        raise SystemExit(f"asked {n} tokens, got {data['usage']['completion_tokens']}")
    return str(data["choices"][0]["text"])


def warmup_prompt(vocab: int, n: int) -> list[int]:
    """Tokens no timed prompt starts with, so a prefix cache gains nothing from the warm-up."""
    return [3 + (i * 7919) % (vocab - 3) for i in range(n)]


async def run_w1(base: str, model: str, w: Workload, vocab: int) -> tuple[float, list[str]]:
    limits = httpx.Limits(max_connections=len(w.prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=1800, limits=limits) as client:
        await _complete(client, model, warmup_prompt(vocab, 32), 4)  # untimed
        t0 = time.perf_counter()
        outs = await asyncio.gather(
            *(_complete(client, model, p, n) for p, n in zip(w.prompts, w.output_lens, strict=True))
        )
        return time.perf_counter() - t0, outs


async def run_batch1(base: str, model: str, prompt: list[int], n: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one streamed request alone. Every chunk that carries a token counts,
    its text empty or not (a token may end inside a UTF-8 character); the usage chunk must say
    ``n`` tokens came."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    stamps: list[float] = []
    usage = None
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                data = line.removeprefix("data: ")
                if data in (line, "[DONE]"):
                    continue
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [None])[0]
                if choice and (choice.get("text") or choice.get("finish_reason") is None):
                    stamps.append(time.perf_counter())
    if usage is None or usage["completion_tokens"] != n or not stamps:
        raise SystemExit(f"asked {n} streamed tokens, got usage {usage}, {len(stamps)} chunks")
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, n - 1)


def transformers_batch1(model: Path, dtype: str, prompt: list[int], n: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM, TextStreamer

    class Stamps(TextStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])
    kw = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        net.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        streamer = Stamps()
        t0 = time.perf_counter()
        net.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=streamer, **kw)
    first = streamer.times[1]  # the streamer's first put is the prompt
    return first - t0, (streamer.times[-1] - first) / (n - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["poise", "vllm"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch1", action="store_true", help="one 256-token prompt, 128 out")
    parser.add_argument("--transformers", action="store_true", help="with --batch1")
    parser.add_argument("--logs", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.transformers and not args.batch1:
        parser.error("--transformers joins only the --batch1 table")
    args.logs.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    results: dict[str, list[float] | list[tuple[float, float]]] = {s: [] for s in args.systems}
    outputs: dict[str, list[list[str]]] = {s: [] for s in args.systems}
    workloads = [workload_w1(vocab, seed=k, n=args.requests) for k in range(args.repeat)]
    for k in range(args.repeat):
        for name in args.systems:
            port = free_port()
            spec = system(name, args.model, args.dtype, port)
            with running(spec, port, args.logs / f"served_{name}.log") as (base, model_id):
                if args.batch1:
                    prompt = workloads[0].prompts[0][:1] + workloads[0].prompts[1][:255]
                    warm = warmup_prompt(vocab, 256)  # not the timed prompt: no cached prefix
                    asyncio.run(run_batch1(base, model_id, warm, 16))
                    results[name].append(asyncio.run(run_batch1(base, model_id, prompt, 128)))
                else:
                    secs, outs = asyncio.run(run_w1(base, model_id, workloads[k], vocab))
                    results[name].append(secs)
                    outputs[name].append(outs)
            print(f"repeat {k}: {name} {results[name][-1]}", flush=True)
    report: dict[str, object] = {"model": str(args.model), "dtype": args.dtype}
    if args.batch1:
        if args.transformers:
            prompt = workloads[0].prompts[0][:1] + workloads[0].prompts[1][:255]
            results["transformers"] = [
                transformers_batch1(args.model, args.dtype, prompt, 128) for _ in range(args.repeat)
            ]
        print(f"\nbatch 1, 256-token prompt, 128 out, {args.dtype}, medians of {args.repeat}")
        print(f"{'system':<14}{'TTFT ms':>10}{'TPOT ms':>10}")
        for name, runs in results.items():
            ttft = statistics.median(r[0] for r in runs) * 1e3  # type: ignore[index]
            tpot = statistics.median(r[1] for r in runs) * 1e3  # type: ignore[index]
            print(f"{name:<14}{ttft:>10.1f}{tpot:>10.2f}")
            report[name] = {"runs": runs, "ttft_ms": ttft, "tpot_ms": tpot}
    else:
        print(f"\nW1 mix over HTTP, {args.dtype}, medians of {args.repeat}")
        print(f"{'system':<14}{'output tok/s':>14}   runs (s)")
        first = args.systems[0]
        medians: dict[str, float] = {}
        for name in args.systems:
            runs = [float(s) for s in results[name]]  # type: ignore[arg-type]
            tok_s = [w.output_tokens / s for w, s in zip(workloads, runs, strict=True)]
            medians[name] = statistics.median(tok_s)
            same = [
                sum(a == b for a, b in zip(outputs[first][k], outputs[name][k], strict=True))
                / len(outputs[name][k])
                for k in range(args.repeat)
            ]
            print(f"{name:<14}{medians[name]:>14.1f}   {[round(s, 1) for s in runs]}")
            if name != first:
                print(f"{'':<14}{first} is {medians[first] / medians[name]:.2f}x {name}; "
                      f"identical outputs {[f'{x:.0%}' for x in same]}")  # fmt: skip
            report[name] = {"seconds": runs, "output_tok_s": tok_s, "median_tok_s": medians[name],
                            f"identical_to_{first}": same}  # fmt: skip
    for sink in SINKS:
        print(f"poise-traced sent {sink.exports} OTLP exports ({sink.bytes} bytes)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
