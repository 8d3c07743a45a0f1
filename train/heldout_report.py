"""The held-out report: runs' scores (`train.heldout`'s rows) as tables and plots, and earlier reports joined.

A row is one scored state: {run, step, train_positions, kl, agreement[, agreement_by_fill]}. Runs compare
at the largest number of training positions all reached (interpolated between the checkpoints around
it); runs that differ only in their seed are pooled into one setting (mean and spread). A report
records the held-out set it was scored on (its digest, the fills' seed) and every run's config, so that
reports from several sessions join into one table (`read_reports`) when, and only when, they scored
on one set.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import matplotlib
import numpy as np

from spd_jax.reports.plots import positions_axis

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- after the backend is chosen: no display is needed

# Config keys that only say how a run was logged or saved: not what a comparison is about.
BOOKKEEPING = ("save_every", "keep", "log_every", "eval_every", "eval_prompts", "eval_tokens", "distill_batch")


def differences(configs: dict[str, dict], ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """Run name -> the training settings that differ between the runs (configs: run name -> its
    `TrainConfig.to_flat()`, defaults filled in; bookkeeping keys and `ignore` left out; `steps` kept: it
    sets the learning-rate schedule). A key one config lacks (a report from older code) counts as None."""
    keys = list(dict.fromkeys(k for c in configs.values() for k in c if k not in BOOKKEEPING + ignore))
    varying = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs.values()}) > 1]
    return {name: ", ".join(f"{k}={c.get(k)}" for k in varying) or "-" for name, c in configs.items()}


def at_equal_positions(rows: list[dict]) -> tuple[int, dict[str, dict]]:
    """The largest training positions every run reached, and each run's scores there, linearly
    interpolated between the two scored states around it (`between`: their steps; one step when a
    checkpoint lies there)."""
    by_run = collections.defaultdict(list)
    for r in rows:
        by_run[r["run"]].append(r)
    common = min(max(r["train_positions"] for r in rs) for rs in by_run.values())
    out = {}
    for name, rs in by_run.items():
        rs = sorted(rs, key=lambda r: r["train_positions"])
        x = [r["train_positions"] for r in rs]
        hi = int(np.searchsorted(x, common))
        between = [rs[hi]["step"]] if x[hi] == common else [rs[hi - 1]["step"], rs[hi]["step"]]
        out[name] = {k: float(np.interp(common, x, [r[k] for r in rs])) for k in ("kl", "agreement")}
        if all("agreement_by_fill" in r for r in rs):
            by = np.asarray([r["agreement_by_fill"] for r in rs])
            out[name]["agreement_by_fill"] = [float(np.interp(common, x, by[:, k])) for k in range(by.shape[1])]
        out[name]["between"] = between
    return common, out


def by_setting(configs: dict[str, dict], equal: dict[str, dict]) -> dict[str, dict]:
    """Runs (configs: name -> flat config) that differ only in their seed, grouped: setting (the settings
    that differ but the seed) -> {runs, kl and agreement as mean, min, max over the seeds at equal
    positions, agreement_by_fill's mean}."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for name, setting in differences(configs, ignore=("seed",)).items():
        groups[setting].append(name)
    out = {}
    for setting, names in groups.items():
        row: dict = dict(runs=names)
        for k in ("kl", "agreement"):
            v = [equal[name][k] for name in names]
            row[k] = dict(mean=float(np.mean(v)), min=float(min(v)), max=float(max(v)))
        if all("agreement_by_fill" in equal[name] for name in names):
            row["agreement_by_fill"] = np.mean([equal[name]["agreement_by_fill"] for name in names], 0).tolist()
        out[setting] = row
    return out


def read_reports(paths: list[str]) -> tuple[list[dict], dict[str, dict], dict | None]:
    """-> (rows, run name -> flat config, the held-out set) of earlier reports (heldout.json), to join a new
    one (`--merge`): all on one held-out set (`same_set`), each run in one report."""
    rows: list[dict] = []
    configs: dict[str, dict] = {}
    held = None
    for p in paths:
        rec = json.loads(Path(p).read_text())
        if "configs" not in rec or "digest" not in rec.get("heldout", {}):
            raise ValueError(f"{p} records no run configs or no held-out set digest (a report from before --merge): "
                             "score its runs again to merge them")
        if held is not None:
            same_set(held, rec["heldout"], f"{paths[0]} and {p}")
        held = rec["heldout"]
        for name in rec["configs"]:
            if name in configs:
                raise ValueError(f"run {name!r} is in two of the reports ({p} and an earlier one): merge one of them")
        configs.update(rec["configs"])
        rows += rec["rows"]
    return rows, configs, held


def same_set(a: dict, b: dict, where: str) -> None:
    """Refuse to join scores on two held-out sets (or under two fill draws), naming what differs."""
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if differ:
        raise ValueError(f"{where} score on different held-out sets ({', '.join(f'{k}: {a.get(k)} vs {b.get(k)}' for k in differ)}): "
                         "rows compare only on one set, drawn under one fill seed")


def report(rows: list[dict], configs: dict[str, dict], heldout: dict, out: Path) -> str:
    """Write heldout.json, heldout.md and heldout.png to `out` (configs: run name -> flat config, in the
    table's order); -> the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    diff = differences(configs)
    common, equal = at_equal_positions(rows)
    settings = by_setting(configs, equal)
    (out / "heldout.json").write_text(json.dumps(dict(heldout=heldout, configs=configs, differences=diff, rows=rows,
                                                      equal_positions=common, at_equal_positions=equal,
                                                      by_setting=settings), indent=1))
    turns = "turns" if heldout.get("turns") == "every" else "first turns"
    lines = [f"Held-out set: {heldout['sequences']} {turns} (conversations {heldout['offset']} .. "
             f"{heldout['offset'] + heldout['count'] - 1} of each of {', '.join(heldout['sources'])}, less "
             f"{heldout['repeats']} repeating a training prompt), the target's greedy replies, {heldout['positions']:,} "
             f"scored positions; fills drawn once (seed {heldout['fills_seed']}) for all runs; float32.",
             "", f"At {common:,} training positions (the most every run reached; interpolated between the steps named):",
             "", "| run | differs in | steps | held-out KL | held-out top-1 agreement |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {diff[name]} | {' - '.join(map(str, v['between']))} | {v['kl']:.3f} | {v['agreement']:.4f} |"
              for name, v in equal.items()]
    if len(settings) < len(configs):  # some runs differ only by seed: their mean and spread
        lines += ["", "Runs that differ only in their seed, at the same positions (mean, and min .. max over the seeds; "
                  "spread = max - min):", "",
                  "| setting | seeds | held-out KL | top-1 agreement | agreement spread |" +
                  (" agreement by fill k = 1 .. n (mean) |" if all("agreement_by_fill" in s for s in settings.values()) else ""),
                  "|---|---|---|---|---|" + ("---|" if all("agreement_by_fill" in s for s in settings.values()) else "")]
        for setting, s in settings.items():
            kl, ag = s["kl"], s["agreement"]
            fills_col = (" " + " / ".join(f"{a:.3f}" for a in s["agreement_by_fill"]) + " |"
                         if "agreement_by_fill" in s else "")
            lines.append(f"| {setting} | {len(s['runs'])} | {kl['mean']:.3f} ({kl['min']:.3f} .. {kl['max']:.3f}) | "
                         f"{ag['mean']:.4f} ({ag['min']:.4f} .. {ag['max']:.4f}) | {ag['max'] - ag['min']:.4f} |{fills_col}")
    fills = {len(v["agreement_by_fill"]) for v in equal.values() if "agreement_by_fill" in v}
    if len(fills) == 1 and all("agreement_by_fill" in v for v in equal.values()):
        n = fills.pop()
        lines += ["", "Top-1 agreement by simulated fill (k: the draft's distance from the newest completed token), at "
                  "the same positions:", "", "| run | " + " | ".join(f"k={k}" for k in range(1, n + 1)) + " |",
                  "|---|" + "---|" * n]
        lines += [f"| {name} | " + " | ".join(f"{a:.4f}" for a in v["agreement_by_fill"]) + " |"
                  for name, v in equal.items()]
    lines += ["", "Every scored state (step 0: the initial weights):", "",
              "| run | step | training positions | held-out KL | held-out top-1 agreement |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['step']} | {r['train_positions']:,} | {r['kl']:.3f} | {r['agreement']:.4f} |"
              for r in rows]
    md = "\n".join(lines) + "\n"
    (out / "heldout.md").write_text(md)

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in diff:
        rs = [r for r in rows if r["run"] == name]
        x = [r["train_positions"] for r in rs]
        label = f"{name} ({diff[name]})"
        ax[0].plot(x, [r["kl"] for r in rs], "o-", label=label)
        ax[1].plot(x, [r["agreement"] for r in rs], "o-", label=label)
    ax[0].set(title="held-out KL(target || drafter)", xlabel="training positions", yscale="log")
    ax[1].set(title="held-out top-1 agreement with the target", xlabel="training positions")
    for a in ax:
        a.grid(alpha=0.3)
        positions_axis(a)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=110)
    plt.close(fig)
    return md
