"""``poise chaos``: run a fault scenario under load and report what the clients lived through."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from poise.bench.command import format_success
from poise.bench.report import Stats
from poise.bench.workload import Lengths
from poise.chaos.capacity import CLIENTS_PER_REPLICA, LOAD_SHARE, MIN_RATE, CapacityError
from poise.chaos.report import ChaosReport, Counts
from poise.chaos.runner import Setup, measure_capacity, run_scenario
from poise.chaos.scenarios import SCENARIOS, ChaosError, Plan
from poise.resilience.success import RunSuccess


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject a fault under steady load and report lost, hung, MTTR and leaks",
        description="Scenarios: " + "; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values()),
    )
    p.add_argument(
        "--scenario",
        required=True,
        help=f"one of {', '.join(SCENARIOS)}; a comma list, or 'all'",
    )
    p.add_argument("--model", help="a local model directory: poise chaos starts the deployment")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gateway", help="or: load the gateway at this URL (faults over HTTP only)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        help="with --gateway: a replica's URL, for faults and leak checks (repeatable)",
    )
    p.add_argument("--model-name", default="demo", help="the model name requests ask for")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per scenario")
    p.add_argument(
        "--rate",
        type=float,
        help=f"steady requests per second (default: {LOAD_SHARE:g} of the capacity, at least "
        f"{MIN_RATE:g} where that is no more than half of it)",
    )
    p.add_argument(
        "--capacity",
        type=float,
        help="requests per second the deployment serves at these lengths (flood: 10x this); "
        f"default: measured first, by {CLIENTS_PER_REPLICA} clients per replica in a closed loop",
    )
    p.add_argument("--prompt-len", default="24", help="words per prompt: N or LOW:HIGH")
    p.add_argument("--output-len", default="128", help="tokens per answer: N or LOW:HIGH")
    p.add_argument("--deadline", type=float, default=20.0, help="each request's deadline (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report(s) as JSON here")
    p.add_argument(
        "--plot", type=Path, help="write a timeline PNG per scenario with this path prefix"
    )
    p.add_argument("--work-dir", type=Path, help="logs and configs (default: a temp dir)")
    p.add_argument(
        "--gateway-defaults",
        action="store_true",
        help="a local deployment's gateway with poise up's settings, not chaos's tighter ones",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(
            f"error: unknown scenario(s) {', '.join(unknown)}; know {', '.join(SCENARIOS)}"
        )
    if args.gateway is None and args.model is None:
        raise SystemExit("error: give --model (a local deployment) or --gateway URL")
    local = [n for n in names if SCENARIOS[n].local_only]
    if args.gateway is not None and local:
        raise SystemExit(
            f"error: {', '.join(local)} need(s) a deployment poise chaos starts (--model)"
        )
    plan = _plan(args, names)
    reports: list[ChaosReport] = []
    for name in names:
        setup = _setup(args, name)
        try:
            report = run_scenario(SCENARIOS[name], plan, setup, _log)
        except ChaosError as exc:
            raise SystemExit(f"error: {name}: {exc}") from None
        reports.append(report)
        print(format_report(report), flush=True)
        if args.plot:
            from poise.chaos.plots import plot_timeline

            print(f"figure: {plot_timeline(report, args.plot)}")
    if len(reports) > 1:
        print(format_table(reports))
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=1))
        print(f"report: {args.json}")
    return 0 if all(r.passed for r in reports) else 1


def _log(line: str) -> None:
    print(line, flush=True)


def _setup(args: argparse.Namespace, name: str) -> Setup:
    return Setup(
        model=args.model,
        replicas=args.replicas,
        gateway_url=args.gateway,
        replica_urls=tuple(args.replica),
        model_name=args.model_name,
        deadline_s=args.deadline,
        seed=args.seed,
        work_dir=None if args.work_dir is None else args.work_dir / name,
        gateway_defaults=args.gateway_defaults,
    )


def _plan(args: argparse.Namespace, names: list[str]) -> Plan:
    """The run's plan: its capacity measured first where it is not given and something needs
    it (the steady rate left out, or a flood; see ``chaos.capacity``)."""
    lengths = (Lengths.parse(args.prompt_len), Lengths.parse(args.output_len))
    capacity = args.capacity
    measured = capacity is None and (args.rate is None or "flood" in names)
    if measured:
        capacity = _measured(args, lengths)
    if args.rate is not None:
        rate = args.rate
    else:
        assert capacity is not None
        rate = steady_rate(capacity)
    told = "not needed" if capacity is None else f"{capacity:.2f} req/s"
    print(f"steady load: {rate:.2f} req/s; capacity {told}"
          f"{' (measured)' if measured else ''}", flush=True)  # fmt: skip
    plan = Plan.of(args.duration, rate, capacity or 0.0, *lengths)
    return replace(plan, capacity_measured=measured)


def steady_rate(capacity: float) -> float:
    """``LOAD_SHARE`` of the capacity, and at least ``MIN_RATE`` where that is no more than
    half of it: MTTR is judged on 2 s windows of the steady requests, and windows of one
    request or none say little."""
    return max(LOAD_SHARE * capacity, min(MIN_RATE, capacity / 2))


def _measured(args: argparse.Namespace, lengths: tuple[Lengths, Lengths]) -> float:
    try:
        found = measure_capacity(_setup(args, "capacity"), lengths, _log)
    except (ChaosError, CapacityError) as exc:
        raise SystemExit(f"error: capacity: {exc}") from None
    refused = f", {found.refused} refused: the gateway sheds a closed loop" if found.refused else ""
    print(
        f"capacity: {found.rps:.2f} req/s ({found.events_per_s:.0f} tokens/s over "
        f"{found.window_s:.0f}s, {found.events_per_answer:.0f} per answer, {found.answers} "
        f"answers{refused})",
        flush=True,
    )
    return found.rps


def _s(v: float | None, none: str = "-") -> str:
    return none if v is None else f"{v:.1f}s"


def _p50_p99(stats: Stats | None) -> str:
    return "-" if stats is None else f"{1000 * stats.p50:.0f}/{1000 * stats.p99:.0f} ms"


def _counts(c: Counts) -> str:
    return (
        f"sent {c.sent}, completed {c.completed} ({c.after_retry} after a retry: {c.resent} "
        f"resent after a dropped connection, {c.reconnected} after refused ones), "
        f"refused {c.refused}, failed {c.failed}, hung {c.hung}, lost {c.lost}, "
        f"abandoned {c.abandoned}; TTFT p50/p99 {_p50_p99(c.ttft)}, "
        f"end-to-end p50/p99 {_p50_p99(c.e2e)}"
    )


def format_report(r: ChaosReport) -> str:
    c, leaks = r.counts, r.leaks
    lines = [
        f"== {r.scenario}: {r.summary}",
        f"{'requests':<24}{_counts(c)}",
    ]
    if len(r.by_traffic) > 1:
        for label, tc in r.by_traffic.items():
            lines.append(f"{'  ' + label:<24}{_counts(tc)}")
        for label, rate in r.offered.items():
            if label == "steady" or label not in r.by_traffic:
                continue
            tc = r.by_traffic[label]
            lines.append(
                f"{'  ' + label:<24}offered {rate:.1f} req/s for {r.plan['hold_s']:g}s: "
                f"{tc.completed} of its {tc.sent} requests completed"
            )
    lines += [
        f"{'migrated mid-stream':<24}{'-' if r.migrated is None else int(r.migrated)}",
        f"{'time to detect':<24}{_detection(r)}",
        f"{'MTTR':<24}{_s(r.mttr_s, 'not recovered within the run')}"
        + (
            ""
            if r.baseline_ttft_p99_s is None
            else f" (steady traffic all served, TTFT p99 within 2x of the "
            f"{1000 * r.baseline_ttft_p99_s:.0f} ms before, for 6 s)"
        ),
        f"{'worst steady TTFT p99':<24}"
        + ("-" if r.worst_ttft_p99_s is None else f"{1000 * r.worst_ttft_p99_s:.0f} ms")
        + " (in a 2 s window after the fault)",
        f"{'availability':<24}"
        + ("-" if r.availability is None else f"{100 * r.availability:.2f} % (formula 1)"),
        f"{'success':<24}{format_success(r.success)}",
        f"{'after the load':<24}KV blocks in use {leaks.kv_blocks}, replica requests "
        f"{leaks.replica_requests}, gateway requests {leaks.gateway_requests}"
        + (f"; replicas {leaks.unreadable} did not answer" if leaks.unreadable else ""),
    ]
    if r.preemptions:
        lines.append(f"{'preemptions':<24}{r.preemptions}")
    lines.append(f"{'verdict':<24}{'PASS' if r.passed else 'FAIL'} (lost 0, hung 0, nothing held)")
    return "\n".join(lines)


def _detection(r: ChaosReport) -> str:
    if r.detection == "none":
        return "- (nothing for the gateway to detect)"
    if r.detection == "redis":
        seen = "the gateway fell back to its local limits"
        unseen = "the gateway never reported Redis down"
    else:
        seen = "the gateway took the replica out of rotation"
        unseen = "the gateway never took the replica out of rotation"
    return unseen if r.detected_s is None else f"{r.detected_s:.1f}s ({seen})"


def format_table(reports: list[ChaosReport]) -> str:
    head = (
        f"{'scenario':<18}{'sent':>6}{'done':>6}{'retry':>6}{'migr':>6}{'refus':>6}{'fail':>6}"
        f"{'lost':>6}{'hung':>6}{'detect':>8}{'MTTR':>8}{'avail':>9}{'leak':>6}"
        f"{'pred':>8}{'obs':>8}{'diff':>7}  verdict"
    )
    rows = [head]
    for r in reports:
        c = r.counts
        leaked = "?" if r.leaks.unreadable else sum(v or 0 for v in r.leaks.kv_blocks)
        avail = "-" if r.availability is None else f"{100 * r.availability:.1f}%"
        rows.append(
            f"{r.scenario:<18}{c.sent:>6}{c.completed:>6}{c.after_retry:>6}"
            f"{'-' if r.migrated is None else int(r.migrated):>6}{c.refused:>6}{c.failed:>6}"
            f"{c.lost:>6}{c.hung:>6}{_s(r.detected_s):>8}{_s(r.mttr_s, 'never'):>8}{avail:>9}"
            f"{leaked:>6}{_success_columns(r.success)}  {'PASS' if r.passed else 'FAIL'}"
        )
    return "\n".join(rows)


def _success_columns(s: RunSuccess | None) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    diff = None if s is None else s.difference_pp
    return (
        f"{pct(None if s is None else s.predicted):>8}{pct(None if s is None else s.observed):>8}"
        f"{'-' if diff is None else f'{diff:+.1f}':>7}"
    )
