"""A learning curve in p: a recipe's held-out top-1 agreement (the per-draft acceptance p the greedy engine
sees at the simulated fills) against training positions, fitted two ways, and the positions each fit needs
for a target p.

    python -m train.pcurve HELDOUT_JSON [--runs base-s0,base-s1,base-s2] [--target 0.71,0.83]
        [--mark POSITIONS:P:LABEL ...] [--out DIR]

HELDOUT_JSON is `train.heldout`'s output. The points are the named runs' scored checkpoints (step 0 left
out: its positions are 0), pooled: every run's own points, so the seeds' spread enters the fit. Two forms:

- log-linear in p:        p = a + b ln N          (returns in p that fall as 1 / N)
- power law in 1 - p:     ln(1 - p) = a + b ln N  (the miss rate falling as a power of N; p never passes 1)

Both are least-squares lines in ln N. They agree inside the measured range and part outside it, which is
the point of fitting both: the positions a target p needs are as uncertain as the two fits' spread. What
an accelerator hour buys is the positions per hour of the H200 run (`--rate`, 93 k positions/s) against
those needs. `--mark` adds points measured elsewhere (another recipe, another measure of p: not fitted),
with what each fit predicts there. The checkpoints of one run under a decaying learning rate are not independent runs of each
length (the last ones train at a rate near zero), so the curve's slope is, if anything, understated.
Writes pcurve.json, pcurve.md and pcurve.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- after the backend is chosen: no display is needed

H200_RATE = 93_000  # response positions per second of the H200 run (docs/train/runs.md, lineage step 7)
FORMS = {
    "log-linear in p": (lambda p: p, lambda y: y),
    "power law in 1 - p": (lambda p: np.log1p(-p), lambda y: -np.expm1(y)),
}


def points(doc: dict, runs: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """heldout.json -> (positions [k], agreement [k]) of the named runs' checkpoints (every run's when
    runs is None), step 0 left out."""
    have = {r["run"] for r in doc["rows"]}
    names = runs or sorted(have)
    missing = sorted(set(names) - have)
    if missing:
        raise ValueError(f"no rows for run(s) {missing} in the held-out scores (it has {sorted(have)})")
    rows = [r for r in doc["rows"] if r["run"] in names and r["train_positions"] > 0]
    if len({r["train_positions"] for r in rows}) < 2:
        raise ValueError("a curve needs checkpoints at two or more training positions (train with save_every "
                         "below steps and score them all: train.heldout without --steps)")
    return (np.asarray([r["train_positions"] for r in rows], float),
            np.asarray([r["agreement"] for r in rows], float))


def fit(n: np.ndarray, p: np.ndarray) -> dict[str, dict]:
    """Both forms' lines in ln N: form -> {a, b, rmse (in p)}."""
    out = {}
    for name, (to_y, from_y) in FORMS.items():
        b, a = np.polyfit(np.log(n), to_y(p), 1)
        out[name] = dict(a=float(a), b=float(b), rmse=float(np.sqrt(np.mean((from_y(a + b * np.log(n)) - p) ** 2))))
    return out


def positions_for(line: dict, form: str, p: float) -> float:
    """The positions at which a fitted line reaches p (inf when it never does: a slope <= 0)."""
    to_y, _ = FORMS[form]
    if line["b"] <= 0 if form == "log-linear in p" else line["b"] >= 0:
        return math.inf
    return float(math.exp((float(to_y(np.asarray(p))) - line["a"]) / line["b"]))


def parse_mark(text: str) -> tuple[float, float, str]:
    """"POSITIONS:P:LABEL" -> (positions, p, label)."""
    parts = text.split(":", 2)
    try:
        n, p = float(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        raise ValueError(f"--mark {text!r}: give POSITIONS:P:LABEL, e.g. 2.61e7:0.415:H200 run") from None
    if n <= 0 or not 0 < p < 1:
        raise ValueError(f"--mark {text!r}: positions must be > 0 and p in (0, 1)")
    return n, p, parts[2] if len(parts) > 2 else text


def predict(line: dict, form: str, n: float) -> float:
    """A fitted line's p at n positions."""
    return float(FORMS[form][1](line["a"] + line["b"] * math.log(n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.pcurve", description=__doc__.split("\n")[0])
    ap.add_argument("heldout", help="a train.heldout heldout.json")
    ap.add_argument("--runs", help="comma-separated run names to pool (default: every run in the file)")
    ap.add_argument("--target", default="0.71,0.83", help="target p values (0.71: S0 2.5 at n = 8; 0.83: 3.4)")
    ap.add_argument("--rate", type=float, default=H200_RATE, help="accelerator positions per second")
    ap.add_argument("--mark", action="append", default=[], metavar="POSITIONS:P:LABEL",
                    help="a point measured elsewhere, shown against the fits and not fitted (repeatable)")
    ap.add_argument("--out", help="where pcurve.json/.md/.png go (default: beside heldout.json)")
    args = ap.parse_args(argv)
    try:
        marks = [parse_mark(m) for m in args.mark]
        doc = json.loads(Path(args.heldout).read_text())
        targets = [float(t) for t in args.target.split(",")]
        if not all(0 < t < 1 for t in targets):
            raise ValueError(f"--target {args.target}: each p must be in (0, 1)")
        n, p = points(doc, args.runs.split(",") if args.runs else None)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fits = fit(n, p)
    per_hour = args.rate * 3600
    need = {form: {str(t): positions_for(line, form, t) for t in targets} for form, line in fits.items()}
    out = Path(args.out) if args.out else Path(args.heldout).parent
    out.mkdir(parents=True, exist_ok=True)
    marked = [dict(positions=m, p=q, label=label, **{form: predict(line, form, m) for form, line in fits.items()})
              for m, q, label in marks]
    (out / "pcurve.json").write_text(json.dumps(dict(points=dict(positions=n.tolist(), agreement=p.tolist()),
                                                     fits=fits, positions_needed=need, rate=args.rate, marks=marked),
                                                indent=1))
    lines = [f"{len(n)} checkpoints ({int(n.min()):,} .. {int(n.max()):,} training positions; held-out agreement "
             f"{p.min():.4f} .. {p.max():.4f}), fitted in ln N:", "",
             "| form | a | b | rmse (in p) | " + " | ".join(f"positions for p = {t}" for t in targets) +
             " | " + " | ".join(f"accelerator hours for p = {t}" for t in targets) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(targets))]
    for form, line in fits.items():
        lines.append(f"| {form} | {line['a']:.4f} | {line['b']:.4f} | {line['rmse']:.4f} | "
                     + " | ".join(f"{need[form][str(t)]:.3g}" for t in targets) + " | "
                     + " | ".join(f"{need[form][str(t)] / per_hour:.3g}" for t in targets) + " |")
    lines += ["", f"One accelerator hour at {args.rate:,.0f} positions/s: {per_hour:.3g} positions."]
    if marked:
        lines += ["", "Points measured elsewhere (not fitted) against what each fit predicts there:", "",
                  "| point | positions | p | " + " | ".join(fits) + " |", "|---|---|---|" + "---|" * len(fits)]
        lines += [f"| {m['label']} | {m['positions']:.3g} | {m['p']:.3f} | " +
                  " | ".join(f"{m[form]:.3f}" for form in fits) + " |" for m in marked]
    md = "\n".join(lines) + "\n"
    (out / "pcurve.md").write_text(md)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    grid = np.geomspace(n.min(), max(n.max() * 1e4, 1e11), 200)
    ax.plot(n, p, "ko", label="held-out checkpoints")
    for m in marked:
        ax.plot(m["positions"], m["p"], "x", ms=9, mew=2, label=f"{m['label']} (not fitted)")
    for form, line in fits.items():
        _, from_y = FORMS[form]
        ax.plot(grid, np.clip(from_y(line["a"] + line["b"] * np.log(grid)), 0, 1), label=form)
    for t in targets:
        ax.axhline(t, color="grey", lw=0.6, ls=":")
    ax.set(xscale="log", xlabel="training positions", ylabel="held-out top-1 agreement p", ylim=(0, 1),
           title="learning curve in p, two fits")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pcurve.png", dpi=110)
    plt.close(fig)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
