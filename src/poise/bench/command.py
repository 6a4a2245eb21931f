"""``poise bench``: drive any OpenAI-compatible endpoint and report its SLOs and goodput."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path

from poise.bench.gateway_counts import read_counts
from poise.bench.report import SLO, Stats, Summary, summarize
from poise.bench.runner import Target, run, write_results
from poise.bench.workload import Lengths, arrival_times, from_dataset, synthetic
from poise.resilience.success import RunSuccess, run_success


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="measure TTFT, TPOT, SLO attainment and goodput")
    p.add_argument("--url", required=True, help="the server's base URL (without /v1)")
    p.add_argument("--model", required=True)
    p.add_argument("--api-key")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions, not completions")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--rate",
        help="requests per second; a comma list is a ramp of steps of --step-s each",
    )
    load.add_argument("--concurrency", type=int, help="a closed loop of this many at a time")
    load.add_argument(
        "--sweep",
        help="rates to run in turn (comma list), --duration each: goodput per rate and the "
        "highest rate whose attainment stays >= 90 %% (needs --slo)",
    )
    p.add_argument("--step-s", type=float, default=30.0, help="length of each ramp step")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--num-requests", type=int, help="how many to send")
    p.add_argument("--duration", type=float, help="or: send at --rate for this many seconds")
    p.add_argument("--prompt-len", default="256", help="words per prompt: N or LOW:HIGH")
    p.add_argument("--output-len", default="128", help="max_tokens: N or LOW:HIGH")
    p.add_argument("--dataset", type=Path, help="prompts from JSONL or ShareGPT JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", help="e.g. ttft=1,tpot=0.1,e2e=30 (seconds, or 100ms)")
    p.add_argument("--results", type=Path, help="write per-request records and the summary")
    p.add_argument(
        "--plot",
        type=Path,
        help="write PNG figures with this path prefix (e.g. out/run: out/run-cdf.png, ...)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.sweep:
        return sweep(args)
    rng = random.Random(args.seed)
    rates = [float(r) for r in args.rate.split(",")] if args.rate else None
    n = args.num_requests
    if n is None:
        if rates is None or args.duration is None:
            raise SystemExit("error: give --num-requests, or --rate with --duration")
        n = max(1, math.ceil(_expected_sent(rates, args.step_s, args.duration)))
    output = Lengths.parse(args.output_len)
    items = (
        from_dataset(args.dataset, n, output, rng)
        if args.dataset
        else synthetic(n, Lengths.parse(args.prompt_len), output, rng)
    )
    arrivals = arrival_times(n, rates, args.step_s, args.burstiness, rng) if rates else None
    slo = SLO.parse(args.slo) if args.slo else None
    target = Target(args.url, args.model, args.api_key, args.chat, args.ignore_eos)
    before, _ = read_counts(args.url, target.headers)
    records, duration = asyncio.run(
        run(target, items, arrivals, args.concurrency, progress=not args.no_progress)
    )
    after, policy = read_counts(args.url, target.headers, settle=True)
    summary = summarize(records, duration, slo)
    tallies = [] if before is None or after is None else [before, after]
    summary = summary.with_success(
        run_success(tallies, policy, summary.completed, summary.sent, args.model)
    )
    print(format_summary(summary, slo))
    if args.plot:
        from poise.bench.plots import plot_run

        for path in plot_run(records, slo, args.plot):
            print(f"figure: {path}")
    if args.results:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        settings.pop("func", None)
        write_results(args.results, records, summary, settings)
        print(f"results: {args.results}")
    return 0


def sweep(args: argparse.Namespace) -> int:
    if not args.slo or not args.duration:
        raise SystemExit("error: --sweep needs --slo and --duration (seconds per rate)")
    slo = SLO.parse(args.slo)
    target = Target(args.url, args.model, args.api_key, args.chat, args.ignore_eos)
    output = Lengths.parse(args.output_len)
    rows: list[tuple[float, Summary]] = []
    for rate in (float(r) for r in args.sweep.split(",")):
        rng = random.Random(args.seed)
        n = max(1, math.ceil(rate * args.duration))
        items = (
            from_dataset(args.dataset, n, output, rng)
            if args.dataset
            else synthetic(n, Lengths.parse(args.prompt_len), output, rng)
        )
        arrivals = arrival_times(n, [rate], 0.0, args.burstiness, rng)
        records, duration = asyncio.run(run(target, items, arrivals, progress=not args.no_progress))
        rows.append((rate, summarize(records, duration, slo)))
    print(format_sweep(rows))
    if args.plot:
        from poise.bench.plots import plot_sweep

        print(f"figure: {plot_sweep(rows, args.plot)}")
    if args.results:
        args.results.write_text(
            json.dumps([{"rate": rate, **s.as_dict()} for rate, s in rows], indent=1)
        )
        print(f"results: {args.results}")
    return 0


def sustained(s: Summary) -> float:
    """The share of all requests sent that met the SLO: shed ones count as missed."""
    return 0.0 if not s.sent or s.goodput is None else s.goodput * s.duration_s / s.sent


def format_sweep(rows: list[tuple[float, Summary]]) -> str:
    lines = [
        f"{'rate/s':>8}{'goodput/s':>11}{'met/sent':>10}{'rejected':>10}{'failed':>8}"
        f"{'TTFT p99':>10}{'TPOT p99':>10}"
    ]
    for rate, s in rows:
        ttft = f"{1000 * s.ttft.p99:.0f}ms" if s.ttft else "-"
        tpot = f"{1000 * s.tpot.p99:.0f}ms" if s.tpot else "-"
        lines.append(
            f"{rate:>8g}{s.goodput or 0:>11.2f}{100 * sustained(s):>9.1f}%"
            f"{s.rejected:>10}{s.failed:>8}{ttft:>10}{tpot:>10}"
        )
    ok = [rate for rate, s in rows if sustained(s) >= 0.9]
    best = f"{max(ok):g} req/s" if ok else "none of the rates"
    lines.append(f"highest rate with >= 90 % of requests meeting the SLO: {best}")
    return "\n".join(lines)


def _expected_sent(rates: list[float], step_s: float, duration: float) -> float:
    total, t = 0.0, 0.0
    for i, r in enumerate(rates):
        end = duration if i == len(rates) - 1 else min(duration, t + step_s)
        total += r * max(0.0, end - t)
        t = end
    return total


def format_summary(s: Summary, slo: SLO | None) -> str:
    def ms(stats: Stats | None) -> str:
        if stats is None:
            return "-"
        return "  ".join(
            f"{name} {1000 * v:.1f}"
            for name, v in (("mean", stats.mean), ("p50", stats.p50), ("p90", stats.p90),
                            ("p99", stats.p99))
        )  # fmt: skip

    lines = [
        f"{'duration':<22}{s.duration_s:.2f} s",
        f"{'sent':<22}{s.sent}",
        f"{'completed':<22}{s.completed}",
        f"{'rejected (429/503)':<22}{s.rejected} ({_share(s.rejected, s.sent)})",
        f"{'failed':<22}{s.failed} ({_share(s.failed, s.sent)})",
        f"{'throughput':<22}{s.request_throughput:.2f} req/s, "
        f"{s.output_token_throughput:.1f} output tokens/s",
        f"{'TTFT ms':<22}{ms(s.ttft)}",
        f"{'TPOT ms':<22}{ms(s.tpot)}",
        f"{'ITL ms':<22}{ms(s.itl)}",
        f"{'E2E ms':<22}{ms(s.e2e)}",
    ]
    if slo is not None and s.goodput is not None:
        attained = "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.1f} %"
        lines.append(f"{'SLO attainment':<22}{attained} of completed")
        lines.append(f"{'goodput':<22}{s.goodput:.2f} req/s")
    if s.success is not None:
        lines.append(f"{'success':<22}{format_success(s.success)}")
    return "\n".join(lines)


def _share(k: int, n: int) -> str:
    return f"{100 * k / n:.1f} %" if n else "-"


def format_success(s: RunSuccess | None) -> str:
    """Formula 2's prediction beside what the clients saw, for chaos and bench alike."""
    if s is None or s.observed is None:
        return "-"
    observed = f"observed {100 * s.observed:.2f} %"
    if s.predicted is None or s.difference_pp is None:
        return f"{observed}; predicted - (the gateway gave no formula 2 counts)"
    return (
        f"predicted {100 * s.predicted:.2f} % (formula 2, from the gateway's counts over the "
        f"run), {observed}: {s.difference_pp:+.2f} pp"
    )
