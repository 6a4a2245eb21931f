"""Overload behaviour of ``poise serve`` (or ``poise up``) as it comes, admission on and off.

1. Capacity: Poisson arrivals at rising rates against the deployment with both off; the
   capacity is the highest rate still served within the SLOs (TTFT <= 1 s and TPOT <= 100 ms
   for >= 99 % of requests), every lower rate too. ``--rates`` must start below it: on a
   two-core AVX2 host W2 on w0 has been served to 1-2.5 req/s, as the hour's speed goes.
2. Overload: 1x, 2x and 3x that rate for a bounded time, once with the defaults (admission by
   predicted wait and the step-time budget are on by default) and once with both off
   (``--no-admission-control --step-time-budget-s 0``: a FIFO server).
   No tuning flag is passed: only ``--dtype`` (the model's own is float32) and, with
   ``--deployment up``, the replica count.
3. While each overload run lasts, /health, /ready and /metrics are polled and timed.
4. False refusals (``--modes on,replay``): the same requests, planned at the same times (the
   client's own lag aside), again against the defaults with admission off; each request the
   defaults refused is judged by what it got when everything was admitted. One that met the
   SLO then was refused falsely (an estimate that errs low: it waited behind every other
   refused request too, and runs vary); beside it, how many that the defaults
   served within the SLO missed it in the replay (what the refusals bought). The older judge
   (the next admitted request's time, ``judge_refusals``) is looser and errs the other way
   (it ignores what admitting a refused request costs those behind it; refusals with no
   request admitted within 2 s are not judged).

With ``--slo-headers`` each request carries its SLO as the Kubernetes Gateway API Inference
Extension's headers (``x-slo-ttft-ms: 1000``, ``x-slo-tpot-ms: 100``), as a client with an
objective tells a server: poise then refuses at once what it predicts would miss them (vLLM
ignores them). Without, the SLO is the client's secret and poise judges requests by its own
queue target.

Prompts are 256 random token ids (no prefix-cache hits), outputs exactly 64 tokens
(ignore_eos), streamed so TTFT and TPOT are measured at the client. Everything runs on loopback
and stops by itself; the replica is started and stopped by pid.

    python benchmarks/serve_overload.py --model .cache/models/w0 [--duration 30] [--json out.json]
    python benchmarks/serve_overload.py --deployment up   # a gateway and two replicas
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx

from poise.launcher import free_port, serve_argv, stop_process, wait_ready

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"
TTFT_SLO_S = 1.0
TPOT_SLO_S = 0.100
# Sent on every request with --slo-headers.
SLO_HEADERS = {"x-slo-ttft-ms": f"{1000 * TTFT_SLO_S:g}", "x-slo-tpot-ms": f"{1000 * TPOT_SLO_S:g}"}
_session_headers: dict[str, str] = {}
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64


@dataclass
class Result:
    status: int
    latency_s: float  # to the full response (or to the refusal)
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None
    retry_after: bool = False  # a refusal that said when to come back

    @property
    def good(self) -> bool:
        return (
            self.status == 200
            and self.error is None
            and self.ttft_s is not None
            and self.ttft_s <= TTFT_SLO_S
            and self.tpot_s is not None
            and self.tpot_s <= TPOT_SLO_S
        )


@dataclass
class RunReport:
    label: str
    offered_rps: float
    duration_s: float
    sent: int
    goodput_rps: float
    admitted: int
    attainment: float  # share of admitted requests that met both SLOs
    rejected_share: float
    failed: int  # admitted but ended with an error
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_ms: float | None
    ttft_misses: int  # admitted requests over the TTFT budget
    tpot_misses: int
    reject_p99_ms: float | None
    refusals_with_retry_after: float | None  # share of the 429s that carried Retry-After
    probe_p99_ms: dict[str, float] = field(default_factory=dict)
    client_lag_p99_ms: float = 0.0  # the load generator's own event-loop lag
    # The replica's own view of a refusal (app entry to 429), as the bucket bound of its p99.
    server_reject_p99_ms: float | None = None
    # Refusals that would have met the SLO, judged by the request admitted next after each
    # (see judge_refusals): certainly, and at most.
    false_refusals: int = 0
    possibly_false_refusals: int = 0
    refusals_judged: int = 0
    # Each request in send order: good, missed (admitted, an SLO missed), refused or failed;
    # the same seed sends the same requests at the same times, so runs compare request by
    # request (``replay_verdict``).
    outcomes: list[str] = field(default_factory=list)


def outcome_of(r: Result) -> str:
    if r.status in (429, 503):  # 503: a gateway's queue full, with poise up
        return "refused"
    if r.status != 200 or r.error:
        return "failed"
    return "good" if r.good else "missed"


@dataclass
class ReplayVerdict:
    """What admitting everything did to the same requests (the replay, admission off): of
    those the defaults refused, how many met the SLO anyway (false refusals, at least: the
    replay admitted all the others too, so each waited behind more than it would have alone),
    and of those the defaults admitted and served well, how many the replay's extra work made
    miss (what the refusals bought)."""

    label: str
    refused: int
    refused_met_slo: int
    served_well: int
    served_well_then_missed: int

    @property
    def false_share(self) -> float:
        return self.refused_met_slo / self.refused if self.refused else 0.0


def replay_verdict(label: str, on: list[str], replay: list[str]) -> ReplayVerdict:
    if len(on) != len(replay):
        print(f"warning: the replay of {label} sent {len(replay)} requests, not {len(on)}")
    pairs = list(zip(on, replay, strict=False))
    return ReplayVerdict(
        label,
        refused=sum(a == "refused" for a, _ in pairs),
        refused_met_slo=sum(a == "refused" and b == "good" for a, b in pairs),
        served_well=sum(a == "good" for a, _ in pairs),
        served_well_then_missed=sum(a == "good" and b != "good" for a, b in pairs),
    )


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(
    client: aiohttp.ClientSession, url: str, prompt: list[int], model: str
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    first: float | None = None
    error = None
    done = False
    try:
        # aiohttp, not httpx: httpx writes the headers and the body separately and yields to
        # its loop in between, so a busy client delays its own body and the server's answer
        # is measured late by the client's own lag.
        async with client.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return Result(
                    r.status, time.perf_counter() - t0, retry_after="retry-after" in r.headers
                )
            # Raw bytes, no JSON: the load generator shares two cores with the replica, and
            # every microsecond it spends parsing shows up as latency in its own measurements.
            tail = b""
            async for raw in r.content.iter_any():
                chunk = tail + raw  # a marker may straddle two reads
                tail = raw[-16:]
                if first is None and b'"choices":[{' in chunk:
                    first = time.perf_counter()
                if b'{"error"' in chunk:
                    error = chunk.decode(errors="replace")[:200]
                if b"data: [DONE]" in chunk:
                    done = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(599, time.perf_counter() - t0, error=repr(exc))
    end = time.perf_counter()
    if first is None or not done:
        return Result(200, end - t0, error=error or "no tokens or no [DONE]")
    return Result(200, end - t0, first - t0, (end - first) / (OUTPUT_TOKENS - 1), error)


async def loop_lag(stop: asyncio.Event, out: list[float], period_s: float = 0.005) -> None:
    """How late this process's own event loop wakes up: the client's share of any latency."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        out.append(1000 * (time.perf_counter() - t0 - period_s))


async def probe_loop(url: str, stop: asyncio.Event, out: dict[str, list[float]]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            for path in ("/health", "/ready", "/metrics"):
                t0 = time.perf_counter()
                await client.get(url + path)
                out.setdefault(path, []).append(1000 * (time.perf_counter() - t0))
            await asyncio.sleep(0.1)


async def run_load(
    url: str, label: str, rate: float, duration: float, seed: int, probe: bool, model: str
) -> RunReport:
    rng = random.Random(seed)
    probes: dict[str, list[float]] = {}
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=2000)
    timeout = aiohttp.ClientTimeout(total=300.0)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=_session_headers)
    async with session as client:
        prober = asyncio.create_task(probe_loop(url, stop, probes)) if probe else None
        lags: list[float] = []
        lagger = asyncio.create_task(loop_lag(stop, lags))
        tasks = []
        sent_times: list[float] = []
        start = time.perf_counter()
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > duration:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [rng.randrange(300, 31000) for _ in range(PROMPT_TOKENS)]
            tasks.append(asyncio.create_task(one_request(client, url, prompt, model)))
            sent_times.append(t)
        results: list[Result] = await asyncio.gather(*tasks)
        if os.environ.get("POISE_BENCH_DEBUG"):
            rej = sorted(1000 * r.latency_s for r in results if r.status == 429)
            if rej:
                print(
                    f"  reject ms: p50 {rej[len(rej) // 2]:.1f} p90 {rej[int(0.9 * len(rej))]:.1f}"
                    f" top {[round(x, 1) for x in rej[-8:]]}"
                )
            for sent_at, r in zip(sent_times, results, strict=False):
                if r.status == 200 and not r.good:
                    print(f"  miss sent {sent_at:.2f}s ttft {r.ttft_s:.2f}s tpot {r.tpot_s}")
        false, possible, judged = judge_refusals(sent_times, results)
        stop.set()
        await lagger
        if prober is not None:
            await prober
    elapsed = max(duration, 1e-9)
    admitted = [r for r in results if r.status == 200]
    good = [r for r in admitted if r.good]
    refused = [r for r in results if r.status == 429]
    ttfts = [r.ttft_s for r in admitted if r.ttft_s is not None]
    tpots = [r.tpot_s for r in admitted if r.tpot_s is not None]
    return RunReport(
        label=label,
        offered_rps=rate,
        duration_s=duration,
        sent=len(results),
        goodput_rps=len(good) / elapsed,
        admitted=len(admitted),
        attainment=len(good) / len(admitted) if admitted else 0.0,
        rejected_share=len(refused) / len(results) if results else 0.0,
        failed=sum(1 for r in results if r.status not in (200, 429) or r.error),
        ttft_p50_s=pct(ttfts, 0.5),
        ttft_p99_s=pct(ttfts, 0.99),
        tpot_p99_ms=None if not tpots else 1000 * (pct(tpots, 0.99) or 0.0),
        ttft_misses=sum(1 for t in ttfts if t > TTFT_SLO_S),
        tpot_misses=sum(1 for t in tpots if t > TPOT_SLO_S),
        reject_p99_ms=None if not refused else 1000 * pct([r.latency_s for r in refused], 0.99),
        refusals_with_retry_after=(
            None if not refused else sum(r.retry_after for r in refused) / len(refused)
        ),
        probe_p99_ms={k: pct(v, 0.99) or 0.0 for k, v in probes.items()},
        client_lag_p99_ms=pct(lags, 0.99) or 0.0,
        false_refusals=false,
        possibly_false_refusals=possible,
        refusals_judged=judged,
        outcomes=[outcome_of(r) for r in results],
    )


def judge_refusals(sent_times: list[float], results: list[Result]) -> tuple[int, int, int]:
    """(certainly false, possibly false, judged): each refusal is judged by the first request
    admitted after it (within 2 s). Had the refused one been admitted, it would have been
    ahead of that one and started no later: its time to first token would have been at most
    that one's plus the time between their sends. Where that bound meets the SLO (and the
    next one's time per token did), the refusal was certainly false; where the next one met
    the SLO at all, it possibly was (the refused one would have started at most that much
    earlier, and admitting it would have delayed the next one)."""
    certain = possible = judged = 0
    for i, r in enumerate(results):
        if r.status != 429:
            continue
        nxt = next(
            (
                j
                for j in range(i + 1, len(results))
                if results[j].status == 200 and sent_times[j] - sent_times[i] <= 2.0
            ),
            None,
        )
        if nxt is None:
            continue
        judged += 1
        after = results[nxt]
        if after.good and after.ttft_s is not None:
            possible += 1
            certain += after.ttft_s + sent_times[nxt] - sent_times[i] <= TTFT_SLO_S
    return certain, possible, judged


def refusal_buckets(url: str) -> dict[float, float]:
    """Cumulative counts of the replica's ``poise_refusal_latency_seconds`` histogram."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("poise_refusal_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_p99_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """Upper bound of the p99 of what happened between two readings."""
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return None
    for le in sorted(delta):
        if delta[le] >= 0.99 * total:
            return 1000 * le
    return None


class Replica:
    """One ``poise serve``, or with ``replicas`` a ``poise up`` (gateway and replicas), or
    with ``vllm`` vLLM's OpenAI server from the benchmark venv (its CPU build)."""

    def __init__(self, model: str, flags: list[str], replicas: int = 0, vllm: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateway = replicas > 0
        self.vllm = vllm
        self.model = "demo" if self.gateway else Path(model).name
        env = None
        if vllm:
            if not VLLM_PYTHON.exists():
                raise SystemExit(f"no vLLM venv at {VLLM_PYTHON.parent.parent}")
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
            cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--port", str(self.port), "--served-model-name", self.model,
                   "--max-num-seqs", "64", "--no-enable-prefix-caching",
                   *flags]  # fmt: skip
        elif self.gateway:
            cmd = [sys.executable, "-m", "poise.cli", "up", "--model", model, "--replicas",
                   str(replicas), "--port", str(self.port), "--serve-flags",
                   " ".join(["--log-level", "warning", *flags])]  # fmt: skip
        else:
            cmd = serve_argv(model, self.port, "--log-level", "warning", *flags)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr, env=env)
        try:
            ready = "/health" if vllm else "/ready"
            wait_ready(self.url + ready, self.proc, str, "the deployment", 600)
            if self.gateway:
                self._wait_routable(replicas)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise

    def _wait_routable(self, replicas: int) -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            state = httpx.get(self.url + "/debug/state", timeout=5).json()
            if len(state["models"][self.model]["trusted"]) >= replicas:
                return
            time.sleep(0.5)
        raise TimeoutError("the gateway did not route to every replica")

    def refusals(self) -> dict[float, float]:
        return {} if self.gateway or self.vllm else refusal_buckets(self.url)

    def stop(self) -> None:
        stop_process(self.proc, 60)


def run_async(coro):  # type: ignore[no-untyped-def]
    """The load generator shares the machine's cores with the replica: keep its own overhead low."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(capacity: float, peak: float, runs: list[RunReport]) -> None:
    print(
        f"\ncapacity: {capacity:.2f} req/s offered -> peak goodput {peak:.2f} req/s "
        f"(TTFT <= {TTFT_SLO_S:g}s, TPOT <= {1000 * TPOT_SLO_S:g}ms, "
        f"{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS}-token outputs)"
    )
    head = (
        f"{'run':<18}{'offered/s':>10}{'goodput/s':>10}{'of 1x':>7}{'attain':>8}"
        f"{'rejected':>9}{'failed':>7}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p99':>9}"
        f"{'reject p99':>11}{'Retry-After':>12}"
    )
    print(head)
    one_x: dict[str, float] = {}
    for r in runs:
        mode = r.label.rsplit(" ", 1)[0]
        base = one_x.setdefault(mode, r.goodput_rps)  # each mode's first run is its 1x
        with_hint = r.refusals_with_retry_after
        print(
            f"{r.label:<18}{r.offered_rps:>10.2f}{r.goodput_rps:>10.2f}"
            f"{100 * r.goodput_rps / base if base else 0:>6.0f}%{100 * r.attainment:>7.1f}%"
            f"{100 * r.rejected_share:>8.1f}%{r.failed:>7}{fmt(r.ttft_p50_s):>8}s"
            f"{fmt(r.ttft_p99_s):>8}s{fmt(r.tpot_p99_ms, 1, 0):>7}ms"
            f"{fmt(r.reject_p99_ms, 1, 1):>9}ms"
            f"{'-' if with_hint is None else f'{100 * with_hint:.0f}%':>12}"
        )
    print("\nprobe latency p99 while loaded (ms):")
    for r in runs:
        if r.probe_p99_ms:
            cells = "  ".join(f"{k} {v:.1f}" for k, v in r.probe_p99_ms.items())
            cells += f"  (client loop lag {r.client_lag_p99_ms:.1f}"
            if r.server_reject_p99_ms is not None:
                cells += f"; refusal inside the server <= {r.server_reject_p99_ms:g}"
            cells += ")"
            print(f"  {r.label:<18}{cells}")


def replay_verdicts(runs: list[RunReport]) -> list[ReplayVerdict]:
    """Each multiple run with the defaults and replayed, request by request."""
    by_label = {r.label: r for r in runs}
    out = []
    for r in runs:
        mode, mult = r.label.rsplit(" ", 1)
        other = by_label.get(f"replay {mult}")
        if mode == "defaults" and other is not None:
            out.append(replay_verdict(mult, r.outcomes, other.outcomes))
    return out


def vllm_dtype(model: str, dtype: str) -> str:
    """What to ask vLLM for: ``auto`` means what poise's own ``auto`` runs for this checkpoint
    (``resolve_dtype``). vLLM's own ``auto`` turns a float32 checkpoint into bfloat16 on the
    CPU, which a CPU without bf16 instructions (AVX2) runs many times slower: measured, W2's
    time per token passed 1.5 s on w0."""
    if dtype != "auto":
        return dtype
    from poise.engine.models.checkpoint import open_checkpoint
    from poise.engine.models.loader import resolve_dtype

    return str(resolve_dtype(dtype, open_checkpoint(model).config)).removeprefix("torch.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".cache/models/w0")
    # auto: the checkpoint's own (w0: float32). bfloat16 is the fast one only where the CPU
    # has bf16 matrix instructions (AVX512-BF16, AMX); on AVX2 alone it is emulated, far slower.
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    # As long as a run: a rate that only looks sustainable for 20 s is not the capacity.
    ap.add_argument("--sweep-duration", type=float, help="seconds per sweep rate (--duration)")
    # From below W2's capacity on a slow host (w0 on two AVX2 cores: 1-2.5 req/s) to above
    # it on a fast one (an AMX Xeon: about 4); the sweep ends past the capacity.
    ap.add_argument("--rates", default="0.5,1,1.5,2,2.5,3,4,5,6,8,10,12,14,16,18,20",
                    help="capacity sweep, req/s")  # fmt: skip
    ap.add_argument("--capacity", type=float, help="skip the sweep and use this rate")
    ap.add_argument(
        "--deployment",
        choices=["serve", "up"],
        default="serve",
        help="one poise serve, or poise up with --replicas replicas behind its gateway",
    )
    ap.add_argument("--replicas", type=int, default=2, help="with --deployment up")
    ap.add_argument(
        "--engine-flags",
        default="",
        help="more flags for each poise serve (none by default: the defaults are measured)",
    )
    ap.add_argument(
        "--modes",
        default="on,off",
        help="what to run at each multiple, in order: on (poise's defaults), off (poise with "
        "admission and the step budget off), replay (the defaults with admission off: the same "
        "requests, each judged against what 'on' did with it), vllm (vLLM's CPU build from "
        ".cache/vllm-venv)",
    )
    ap.add_argument("--mults", default="1,2,3", help="overload multiples of the capacity")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--slo-headers",
        action="store_true",
        help="send the SLO as x-slo-ttft-ms / x-slo-tpot-ms on every request",
    )
    args = ap.parse_args()
    if args.slo_headers:
        _session_headers.update(SLO_HEADERS)
    if not Path(args.model).exists():
        print(f"no model at {args.model}; make it with: poise make-model {args.model} --size w0")
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    engine = ["--dtype", args.dtype, *args.engine_flags.split()]
    # Off: what poise did before these defaults, a FIFO server (no admission control, no
    # step-time budget): the capacity is measured on it, as the load it serves within the SLO.
    off = [*engine, "--no-admission-control", "--step-time-budget-s", "0"]
    on = engine
    replay = [*engine, "--no-admission-control"]
    replicas = args.replicas if args.deployment == "up" else 0
    modes_asked = [m for m in args.modes.split(",") if m]
    # Before the sweep, so a model vLLM cannot be given a dtype for fails at once.
    vllm_flags = ["--dtype", vllm_dtype(args.model, args.dtype)] if "vllm" in modes_asked else []

    sweep: list[RunReport] = []
    if args.capacity is None:
        replica = Replica(args.model, off, replicas)
        try:
            run_async(run_load(replica.url, "warmup", 1.0, 5.0, 99, False, replica.model))
            # Rising: the capacity below is judged on every lower rate.
            for i, rate in enumerate(sorted(float(r) for r in args.rates.split(","))):
                rep = run_async(
                    run_load(
                        replica.url,
                        f"sweep {rate:g}/s",
                        rate,
                        args.sweep_duration or args.duration,
                        100 + i,
                        False,
                        replica.model,
                    )
                )
                sweep.append(rep)
                print(
                    f"sweep {rate:5.2f}/s: goodput {rep.goodput_rps:.2f}/s, attainment "
                    f"{100 * rep.attainment:.1f}%, TTFT p99 {fmt(rep.ttft_p99_s)}s, "
                    f"TPOT p99 {fmt(rep.tpot_p99_ms, 1, 0)}ms",
                    flush=True,
                )
                if rep.attainment < 0.9:
                    break
        finally:
            replica.stop()
        # Capacity: the highest rate served within the SLOs (>= 99 % attainment) with every
        # lower rate served so (the lowest rate where none is); past the first rate that
        # misses, one that passes does so by the luck of its arrivals (measured in 30 s
        # runs: 96.8 % at 1.75/s, then 100 % at 2/s, where the next 60 s of the same load,
        # admission off, met the SLOs for 78.8 %). The sweep goes on past that rate, until
        # attainment falls under 90 %, only for the peak: the most good requests per second
        # the replica delivered at any rate.
        capacity = sweep[0].offered_rps
        for rep in sweep:
            if rep.attainment < 0.99:
                break
            capacity = rep.offered_rps
        peak = max(r.goodput_rps for r in sweep)
        if sweep[0].attainment < 0.99:
            print(f"the lowest rate, {capacity:g}/s, already misses the SLOs: start --rates lower")
    else:
        capacity = peak = args.capacity

    runs: list[RunReport] = []
    modes = {
        "on": ("defaults", on),
        "off": ("protection off", off),
        "replay": ("replay", replay),
        "vllm": ("vllm", vllm_flags),
    }
    for mode, flags in (modes[m] for m in modes_asked):
        replica = Replica(args.model, flags, replicas if mode != "vllm" else 0, mode == "vllm")
        try:
            run_async(run_load(replica.url, "warmup", 1.0, 5.0, 98, False, replica.model))
            for mult in (float(m) for m in args.mults.split(",")):
                before = replica.refusals()
                rep = run_async(
                    run_load(
                        replica.url,
                        f"{mode} {mult:g}x",
                        capacity * mult,
                        args.duration,
                        200 + int(10 * mult),
                        True,
                        replica.model,
                    )
                )
                rep.server_reject_p99_ms = bucket_p99_ms(before, replica.refusals())
                runs.append(rep)
                print(
                    f"{rep.label}: goodput {rep.goodput_rps:.2f}/s, attainment "
                    f"{100 * rep.attainment:.1f}%, rejected {100 * rep.rejected_share:.1f}%, "
                    f"misses TTFT {rep.ttft_misses} TPOT {rep.tpot_misses}, "
                    f"false refusals {rep.false_refusals} (at most {rep.possibly_false_refusals})"
                    f" of {rep.refusals_judged} judged, "
                    f"TTFT p99 {fmt(rep.ttft_p99_s)}s TPOT p99 {fmt(rep.tpot_p99_ms, 1, 0)}ms",
                    flush=True,
                )
        finally:
            replica.stop()
    print_table(capacity, peak, runs)
    verdicts = replay_verdicts(runs)
    for v in verdicts:
        print(
            f"replay {v.label}: of {v.refused} refused, {v.refused_met_slo} met the SLO when "
            f"everything was admitted ({100 * v.false_share:.1f}% false, at least); of "
            f"{v.served_well} served within the SLO, {v.served_well_then_missed} missed it then"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "capacity_rps": capacity,
                    "peak_goodput_rps": peak,
                    "sweep": [asdict(r) for r in sweep],
                    "runs": [asdict(r) for r in runs],
                    "replay": [{**asdict(v), "false_share": v.false_share} for v in verdicts],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
