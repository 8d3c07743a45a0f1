"""The report of `infer.replay`: greedy SPD replayed from teacher-forced drafts (replay.json's results)
as a markdown table and a plot: pooled alpha and S0 per drafter (a PSM or a PPSD head), agreement and
verified drafts by fill, S0 by the budget of new tokens, the continuations' repetition.

Builds text and a PNG from plain data (`infer.replay`'s result dicts); computes no figure itself.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

REPEAT = 4  # n-gram length of the repetition share (`infer.replay.repeats` counts it, the table names it)


def _name(res: dict) -> str:
    """A replayed drafter's short label: its method and its directory with the parent (runs/a/psm and
    runs/b/psm stay apart; "random" for an untrained one)."""
    return f"{res['method']} {'/'.join(Path(res['drafter']).parts[-2:])}"


def replay_markdown(results: list[dict], setup: dict) -> str:
    n = results[0]["n"]
    lines = [f"# Greedy SPD replayed: {setup['model']}, n = {n}, {setup['prompts']} prompts, "
             f"{setup['max_new_tokens']} new tokens", "",
             f"Continuations: `ar` rows of `{setup['from']}`. Exact greedy counts of the engine from teacher-forced "
             "drafts (`python -m infer.replay`).", "",
             "| drafter | bench | alpha | S0 | accepted | rejected | engine check |", "|---|---|---|---|---|---|---|"]
    for res in results:
        for bench, p in res["pooled"].items():
            check = (f"{p['engine_equal']}/{p['engine_checked']} prompts equal" if p["engine_checked"]
                     else f"no {res['method']} rows")
            if p["engine_S0"] is not None:
                check += f", measured S0 {p['engine_S0']:.3f}"
            lines.append(f"| {_name(res)} | {bench} | {p['alpha']:.3f} | {p['S0']:.3f} | {p['accepted']} | "
                         f"{p['rejected']} | {check} |")
    lines += ["", "Per fill k (tokens in flight when the draft is made): teacher-forced agreement over every generated "
              "position, and the engine's verified drafts made at that fill (accepted / verified).", "",
              "| drafter | " + " | ".join(f"k={k}" for k in range(1, n + 1)) + " |", "|---|" + "---|" * n]
    for res in results:
        p = res["pooled"]["all"]
        lines.append(f"| {_name(res)} agreement | " + " | ".join(f"{a:.3f}" for a in res["agreement_by_fill"]) + " |")
        lines.append(f"| {_name(res)} verified | " + " | ".join(
            f"{a}/{v}" for a, v in zip(p["accepted_fill"], p["verified_fill"])) + " |")
    if len(results[0]["by_length"]) > 1:
        head = " | ".join(f"L={e['L']}" for e in results[0]["by_length"]) + " |"
        lines += ["", "Pooled S0 by the budget of new tokens: the same runs with a smaller budget (the first L tokens "
                  "of each continuation, as the engine commits them with budget L).", "",
                  "| drafter | bench | " + head, "|---|---|" + "---|" * len(results[0]["by_length"])]
        for res in results:
            by = res["by_length"]
            lines += [f"| {_name(res)} | {b} | " + " | ".join(f"{e['pooled'][b]['S0']:.3f}" for e in by) + " |"
                      for b in by[-1]["pooled"]]
        by = results[0]["by_length"]
        lines += ["", f"Share of those tokens that close a {REPEAT}-gram already seen in the same continuation (loops, "
                  "which drafters predict easily; a property of the continuations, the same for every drafter):", "",
                  "| bench | " + head, "|---|" + "---|" * len(by)]
        lines += [f"| {b} | " + " | ".join(f"{e['pooled'][b]['repeated']:.3f}" for e in by) + " |"
                  for b in by[-1]["pooled"]]
    return "\n".join(lines) + "\n"


def plot_replay(results: list[dict], png: Path) -> None:
    matplotlib.use("Agg")
    n = results[0]["n"]
    k = np.arange(1, n + 1)
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    width = 0.8 / len(results)
    for i, res in enumerate(results):
        name = _name(res)
        ax[0].plot(k, res["agreement_by_fill"], marker="o", label=name)
        v = np.asarray(res["pooled"]["all"]["verified_fill"], float)
        ax[1].bar(k + (i - (len(results) - 1) / 2) * width, v / max(v.sum(), 1), width, label=name)
        ax[2].plot([e["L"] for e in res["by_length"]], [e["pooled"]["all"]["S0"] for e in res["by_length"]],
                   marker="o", label=name)
    ax[0].set(xlabel="fill k (tokens in flight at the draft)", ylabel="teacher-forced agreement",
              title="draft agreement with the target by fill")
    ax[1].set(xlabel="fill k", ylabel="share of verified drafts", title="which fills the engine verifies (greedy)")
    ax[2].set(xlabel="budget of new tokens L", ylabel="pooled S0", title="S0 by generation length (greedy)")
    ax[2].set_xscale("log", base=2)
    lengths = [e["L"] for e in results[0]["by_length"]]
    ax[2].set_xticks(lengths, [str(L) for L in lengths])
    ax[2].minorticks_off()
    for a in ax[:2]:
        a.set_xticks(k)
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
