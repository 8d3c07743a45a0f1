"""The plots of pooled results, of a training run and of a PSM directory's lineage: S0 and speed against
n, the cycle broken down by part, the learning curves, S0 against training positions.

Draws from plain data (`results.pooled` rows, metrics rows, lineage points) into PNG files; computes no
figure itself.
Every function selects the Agg backend before drawing (no display needed).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator

from spd_jax.reports.lineage import lineage_chains
from spd_jax.reports.results import BASELINE, DRAFTER_FIELD, method_label
from spd_jax.reports.tables import PROFILES


def _series_style(labels: list[str]) -> dict[str, str]:
    """One colour per method label, the same in every panel and plot."""
    return {label: f"C{i % 10}" for i, label in enumerate(sorted(set(labels)))}


_T_STYLE = {0.0: ("o", "-"), 1.0: ("s", "--")}  # marker, line: greedy solid, sampling dashed


def _lines(ax, table: list[dict], value, colors: dict[str, str]) -> None:
    """One line per (method label, T) over n, from the table rows given; value(t) -> y or None."""
    series = defaultdict(list)
    for t in table:
        y = value(t)
        if y is not None:
            series[(method_label(t), t["temperature"])].append((t["n"], y))
    for (label, temp), pts in sorted(series.items()):
        pts.sort()
        marker, line = _T_STYLE.get(temp, ("^", ":"))
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, linestyle=line, color=colors[label],
                label=f"{label}, T={temp:g}")
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")  # ar
    ax.set_xticks(sorted({t["n"] for t in table} | {1}))


def plot_results(table: list[dict], out: Path) -> None:
    """s0_vs_n.png: S0 against n, one panel per benchmark and over all (the drafting methods; ar = 1).
    speed_vs_n.png: speedup over ar against n, every method over all benchmarks: measured here, and
    the cost model's projections for the H200 and TPU v5e profiles. cycle_breakdown.png: see
    plot_breakdown. Colour = method, solid = T 0, dashed = T 1; eagle3 runs on one device (n = 1)."""
    matplotlib.use("Agg")
    colors = _series_style([method_label(t) for t in table if t["method"] != BASELINE])
    benches = sorted({t["bench"] for t in table} - {"all"}) + ["all"]
    drafted = [t for t in table if t["method"] in DRAFTER_FIELD]
    fig, axes = plt.subplots(1, len(benches), figsize=(3.4 * len(benches), 4), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, bench in zip(axes[0], benches):
        _lines(ax, [t for t in drafted if t["bench"] == bench], lambda t: t["S0"], colors)
        ax.set(title=bench if bench != "all" else "all benchmarks (pooled)", xlabel="n (devices)")
    axes[0][0].set_ylabel("S0 (pooled); ar = 1")
    _legend(fig, axes)
    fig.suptitle("S0 vs devices n")
    fig.savefig(out / "s0_vs_n.png", dpi=110)
    plt.close(fig)

    rows = [t for t in table if t["bench"] == "all" and t["method"] != BASELINE]
    panels = [("measured here", lambda t: t["speed_vs_ar"])]
    if any("proj" in t for t in rows):
        panels += [(f"projected, {p} (cost model)", lambda t, p=p: t["proj"][p]["speedup"] if "proj" in t
                    else None) for p in PROFILES]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False, layout="constrained")
    for ax, (title, value) in zip(axes[0], panels):
        _lines(ax, rows, value, colors)
        ax.set(title=title, xlabel="n (devices)")
    axes[0][0].set_ylabel("speedup over ar")
    _legend(fig, axes)
    fig.suptitle("speedup over ar vs devices n (all benchmarks)")
    fig.savefig(out / "speed_vs_n.png", dpi=110)
    plt.close(fig)
    plot_breakdown(table, out / "cycle_breakdown.png")


def _legend(fig, axes) -> None:
    """One legend under the panels (a constrained-layout figure), with every series any panel drew."""
    entries = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=min(len(entries), 4),
                   fontsize=8, frameon=False)


def plot_breakdown(table: list[dict], png: Path) -> None:
    """Time per cycle, stacked, one bar per (method, n, k, T) over all benchmarks. Left, measured here:
    wall time / cycles (rounds for eagle3, tokens for ar and tp), split only where the method times its
    parts apart (ar, tp: prefill and the decode loop; the others time prefill and loop as one). Right,
    when the table is projected: the cost model's H200 cycle by part (spd: busiest device and
    collectives; tp: compute and all-reduces; eagle3: drafter steps, target pass, drafter commit; ar and
    pipeline: one step)."""
    matplotlib.use("Agg")
    rows = [t for t in table if t["bench"] == "all" and t["cycles"]]
    proj = any("proj" in t for t in rows)
    fig, axes = plt.subplots(1, 2 if proj else 1, figsize=(13 if proj else 7, 5), squeeze=False)
    labels = [f"{method_label(t)}, n={t['n']}, T={t['temperature']:g}" for t in rows]
    panels = [("measured here: wall time / cycles (not a projection)", "ms per cycle", 1e3,
               lambda t: ([("prefill (timed apart)", t["prefill_s"]), ("decode loop", t["wall_s"] - t["prefill_s"])]
                          if t["prefill_s"] is not None else [("prefill + loop (one timing)", t["wall_s"])]),
               lambda t: 1 / t["cycles"])]
    if proj:
        panels.append(("projected, H200 (cost model, not measured)", "us per cycle", 1e6,
                       lambda t: list(t["proj"]["H200"]["parts_s"].items()), lambda t: 1.0))
    for ax, (title, unit, scale, parts, per) in zip(axes[0], panels):
        colors: dict[str, str] = {}
        for i, t in enumerate(rows):
            bottom = 0.0
            for name, sec in parts(t):
                h = sec * per(t) * scale
                first = name not in colors
                ax.bar(i, h, bottom=bottom, color=colors.setdefault(name, f"C{len(colors)}"),
                       label=name if first else None)
                bottom += h
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60, ha="right")
        ax.set(title=title, ylabel=unit)
        if colors:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- training positions

def positions_axis(ax) -> None:
    """Training positions on ax's x axis as 50k, 1.5M, 2B (full numbers overlap at the plots' widths)."""
    def short(x, _):
        scale, suffix = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "k")) if abs(x) >= s), (1, ""))
        return f"{x / scale:g}{suffix}"

    ax.xaxis.set_major_formatter(FuncFormatter(short))
    if ax.get_xscale() == "log":  # within one decade only minor ticks fall in range: label a few of them
        ax.xaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
        ax.xaxis.set_minor_formatter(FuncFormatter(short))


def plot_lineage(points: list[dict], png: Path) -> None:
    """S0 against training positions (log scale) for the lineage's points (`lineage.update_lineage`)."""
    matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    pos, s0 = [p["positions"] for p in points], [p["S0"] for p in points]
    for chain in lineage_chains(points):
        ax.plot([p["positions"] for p in chain], [p["S0"] for p in chain], "o-", color="C0")
    ax.margins(y=0.15)  # room for the labels above the points
    # Runs a few hundred k positions apart sit on one spot of a log axis past 10 M: label the newest of
    # such a cluster only (overlapping labels read as neither; the card's table has every value).
    placed: list[tuple[float, float]] = []
    for x, y in sorted(zip(pos, s0), reverse=True):
        if all(abs(math.log10(x) - px) > 0.06 or abs(y - py) > 0.02 for px, py in placed):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
            placed.append((math.log10(x), y))
    ax.set(xscale="log", xlabel="training positions, whole warm-start chain (a gap: a run from scratch)",
           ylabel="S0 (greedy, pooled)", title=f"S0 of each PSM this directory held ({points[0]['prompts']} benchmark prompts)")
    positions_axis(ax)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_curves(metrics: list[dict], png: Path) -> None:
    """A training run's learning curves (its metrics.jsonl rows): loss, agreement and the quick eval (S0,
    or an EAGLE-3 drafter's tokens per round) against training positions. No rows: no plot."""
    if not metrics:
        return
    matplotlib.use("Agg")
    rows = metrics
    pos = [r["positions"] for r in rows]
    chain = any("tokens_per_round" in r or "agreement_by_step" in r for r in rows)
    key = "tokens_per_round" if chain else "S0"
    ev = [r for r in rows if key in r]
    # a run without a quick eval (fewer devices than stages, or none fell due) gets no empty third panel
    fig, ax = plt.subplots(1, 3 if ev else 2, figsize=(13, 3.6) if ev else (9, 3.6))
    ax[0].plot(pos, [r["loss"] for r in rows])
    ax[0].set(title="KL(teacher || drafter) per unrolled step" if chain else "KL(teacher || PSM)",
              xlabel="training positions", yscale="log")
    ax[1].plot(pos, [r["agreement"] for r in rows])
    ax[1].set(title="top-1 agreement (train, 1st draft step)" if chain else "top-1 agreement (train batches)",
              xlabel="training positions")
    if ev:
        ax[2].plot([r["positions"] for r in ev], [r[key] for r in ev], "o-")
        ax[2].set(title=f"tokens/round, chain k={ev[0].get('eval_k', '?')}, held-out (greedy)" if chain
                  else "S0 on held-out prompts (greedy)", xlabel="training positions")
    for a in ax:
        a.grid(alpha=0.3)
        positions_axis(a)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
