"""``poise chaos --plot``: one timeline PNG per scenario, the fault marked (matplotlib).

Four panels on one time axis: requests by outcome, steady traffic's p99 TTFT, each backend as
the gateway saw it (routed / half-open / out), and each replica's KV blocks in use. The fault's
start is a red line, its hold a red band, and the recovery (MTTR) a green dashed line.
"""

from __future__ import annotations

from pathlib import Path

from poise.bench.plots import _pyplot
from poise.chaos.report import ChaosReport

_STATE_COLORS = {"routed": "#2ca02c", "half-open": "#ff7f0e", "out": "#d62728", "?": "#bbbbbb"}


def plot_timeline(report: ChaosReport, prefix: Path) -> Path:
    plt = _pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    tl = report.timeline
    assert tl is not None
    plan = report.plan
    fig, axes = plt.subplots(
        4, 1, figsize=(11, 10), sharex=True, constrained_layout=True,
        gridspec_kw={"height_ratios": [3, 2, 1.3, 2]},
    )  # fmt: skip
    c = report.counts
    fig.suptitle(
        f"poise chaos: {report.scenario} ({report.summary})\n"
        f"sent {c.sent}, completed {c.completed}, refused {c.refused}, failed {c.failed}, "
        f"lost {c.lost}, hung {c.hung}; MTTR "
        + ("not reached" if report.mttr_s is None else f"{report.mttr_s:.1f} s"),
        fontsize=11,
    )
    ax = axes[0]
    x = [s + 0.5 for s in tl.second]
    ax.bar(x, tl.completed, width=1.0, color="#1f77b4", label="completed")
    ax.bar(
        x, tl.refused, width=1.0, bottom=tl.completed, color="#ff7f0e", label="refused (429/503)"
    )
    top = [a + b for a, b in zip(tl.completed, tl.refused, strict=True)]
    ax.bar(x, tl.failed, width=1.0, bottom=top, color="#d62728", label="failed / hung / lost")
    ax.set_ylabel("requests sent\nper second")
    ax.legend(loc="upper left", fontsize=8, ncols=3)

    ax = axes[1]
    ys = [None if v is None else 1000 * v for v in tl.steady_ttft_p99_s]
    ax.plot(x, ys, marker=".", color="#1f77b4", label="steady traffic, p99 TTFT per second")
    if report.baseline_ttft_p99_s is not None:
        base = 1000 * report.baseline_ttft_p99_s
        ax.axhline(base, color="gray", linestyle=":", label=f"p99 before the fault ({base:.0f} ms)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[2]
    names = list(tl.backends)
    for row, name in enumerate(names):
        states = tl.backends[name]
        for i, state in enumerate(states):
            t0 = tl.sample_t[i]
            t1 = tl.sample_t[i + 1] if i + 1 < len(tl.sample_t) else t0 + 0.25
            ax.broken_barh([(t0, t1 - t0)], (row - 0.4, 0.8), color=_STATE_COLORS[state])
    ax.set_yticks(range(len(names)), [f"replica {i}" for i in range(len(names))])
    ax.set_ylim(-0.6, max(1, len(names)) - 0.4)
    handles = [plt.Rectangle((0, 0), 1, 1, color=v) for v in _STATE_COLORS.values()]
    ax.legend(
        handles, ["routed", "half-open", "out of rotation", "gateway not answering"],
        loc="upper left", fontsize=8, ncols=4,
    )  # fmt: skip
    ax.set_ylabel("gateway's view")

    ax = axes[3]
    for i, series in enumerate(tl.kv_used_blocks):
        ax.step(tl.sample_t, [float("nan") if v is None else v for v in series], where="post",
                label=f"replica {i}")  # fmt: skip
    ax.set_ylabel("KV blocks in use")
    ax.set_xlabel("seconds since the load began")
    ax.legend(loc="upper left", fontsize=8)

    fault = plan["fault_at_s"]
    for ax in axes:
        ax.axvline(fault, color="#d62728", linewidth=1.5)
        if report.scenario_holds:
            ax.axvspan(fault, fault + plan["hold_s"], color="#d62728", alpha=0.08)
        if report.mttr_s:
            ax.axvline(fault + report.mttr_s, color="#2ca02c", linestyle="--", linewidth=1.2)
    axes[0].annotate("fault", (fault, 1.0), xycoords=("data", "axes fraction"), color="#d62728",
                     ha="left", va="bottom", fontsize=9)  # fmt: skip
    if report.scenario_holds:
        axes[0].annotate("fault ends", (fault + plan["hold_s"], 1.0),
                         xycoords=("data", "axes fraction"), color="#d62728", ha="right",
                         va="bottom", fontsize=9)  # fmt: skip
    if report.mttr_s:
        axes[0].annotate("recovered", (fault + report.mttr_s, 0.97),
                         xycoords=("data", "axes fraction"), color="#2ca02c", ha="left",
                         va="top", fontsize=9, backgroundcolor="white")  # fmt: skip
    axes[-1].set_xlim(0, max(plan["duration_s"], tl.sample_t[-1] if tl.sample_t else 0))
    path = prefix.parent / f"{prefix.name}-{report.scenario}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
