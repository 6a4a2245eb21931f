"""``--plot``: the figures of a run or a sweep, as PNG files (matplotlib, imported only here).

A run gives two figures: the latency CDFs (TTFT, TPOT, E2E), and TTFT and TPOT of each request
against the time it was sent, with rejected and failed requests marked on the time axis. A
sweep gives goodput against offered rate, with the line goodput = offered rate for reference.
"""

from __future__ import annotations

from pathlib import Path

from poise.bench.report import SLO, Record, Summary


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install 'poise[plot]')") from None
    return plt


def plot_run(records: list[Record], slo: SLO | None, prefix: Path) -> list[Path]:
    plt = _pyplot()
    done = [r for r in records if r.completed]
    series = {
        "TTFT": [r.ttft_s for r in done if r.ttft_s is not None],
        "TPOT": [t for r in done if (t := r.tpot_s) is not None],
        "E2E": [r.e2e_s for r in done if r.e2e_s is not None],
    }
    limits = {"TTFT": slo.ttft_s, "TPOT": slo.tpot_s, "E2E": slo.e2e_s} if slo else {}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = sorted(1000 * v for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        if limits.get(name) is not None:
            ax.axvline(1000 * limits[name], color="red", linestyle="--", label="SLO")
            ax.legend(loc="lower right")
        ax.set_title(f"{name} ({len(values)} requests)")
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("share of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    cdf = prefix.with_name(prefix.name + "-cdf.png")
    fig.suptitle("Latency CDFs")
    fig.savefig(cdf, dpi=110)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, constrained_layout=True)
    for ax, name, getter in (
        (top, "TTFT", lambda r: r.ttft_s),
        (bottom, "TPOT", lambda r: r.tpot_s),
    ):
        pts = [(r.sent_at, 1000 * v) for r in done if (v := getter(r)) is not None]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, label=f"{name} of a completed request")
        if limits.get(name) is not None:
            ax.axhline(1000 * limits[name], color="red", linestyle="--", label="SLO")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
    for kind, color, rows in (
        ("rejected (429/503)", "orange", [r for r in records if r.rejected]),
        ("failed", "black", [r for r in records if not r.completed and not r.rejected]),
    ):
        if rows:
            bottom.scatter(
                [r.sent_at for r in rows], [0] * len(rows), marker="x", color=color, label=kind
            )
    top.legend(loc="upper left")
    bottom.legend(loc="upper left")
    bottom.set_xlabel("seconds since the start (when the request was sent)")
    fig.suptitle("TTFT and TPOT over time")
    timeline = prefix.with_name(prefix.name + "-timeline.png")
    fig.savefig(timeline, dpi=110)
    plt.close(fig)
    return [cdf, timeline]


def plot_sweep(rows: list[tuple[float, Summary]], prefix: Path) -> Path:
    plt = _pyplot()
    rates = [rate for rate, _ in rows]
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    ax.plot(rates, [s.goodput or 0 for _, s in rows], marker="o", label="goodput (met the SLO)")
    ax.plot(rates, [s.request_throughput for _, s in rows], marker=".", label="completed")
    ax.plot(rates, rates, color="grey", linestyle=":", label="offered")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_title("Goodput against offered rate")
    ax.grid(alpha=0.3)
    ax.legend()
    path = prefix.with_name(prefix.name + "-goodput.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
