"""A PSM directory's lineage: the greedy S0 of each PSM it has held against the training positions of
its whole warm-start chain, kept in DIR/lineage.json (which outlives the weights: a PSM trained on from
the directory's is exported over it) and shown in its card.

Plain data (pooled rows, the PSM's psm.json, the run's run.json); writes lineage.json only.
"""

from __future__ import annotations

import json
from pathlib import Path

from spd_jax.drafters import registry
from spd_jax.reports.results import DRAFTER_METHOD

LINEAGE = "lineage.json"  # in a PSM directory: the greedy S0 of each PSM it has held, kept by train.card
SAME_SETUP = ("model", "benches", "prompts", "max_new_tokens")  # what makes two lineage points comparable


def lineage_positions(warm_start: dict | None) -> int:
    """Training positions of a warm-start chain (a warm-start record: its `positions` and its own
    `warm_start`, as training exports it), summed down the chain."""
    total = 0
    while warm_start:
        total += int(warm_start.get("positions", 0))
        warm_start = warm_start.get("warm_start")
    return total


def lineage_point(table: list[dict], setup: dict | None, psm: dict, run: dict | None,
                  method: str = DRAFTER_METHOD[registry.PSM.name]) -> dict | None:
    """This PSM's (or another staged drafter's) lineage point: its pooled greedy (T = 0) S0 over every evaluated
    benchmark against the training positions of its whole warm-start chain (`lineage_positions`). table:
    `results.pooled` over its rows; psm: its identity json (psm.json, ppsd.json); run: its run.json (for the
    config it names) or None; method: the method its rows run (spd, ppsd). None without a T = 0 row of it or a
    record of its training positions."""
    trained = psm.get("trained", {})
    spd = [t for t in table if t["method"] == method and t["temperature"] == 0]
    pooled_all = next((t for t in spd if t["bench"] == "all"), None)
    if pooled_all is None or "positions" not in trained:
        return None
    config = next((c.split("--config", 1)[1].split()[0] for c in (run or {}).get("commands", []) if "--config" in c),
                  None)
    label = f"{config}, {trained.get('steps', '?')} steps" if config else f"{trained.get('steps', '?')} steps"
    return dict(positions=int(trained["positions"]) + lineage_positions(trained.get("warm_start")),
                S0=round(pooled_all["S0"], 4), alpha=round(pooled_all["alpha"], 4), tokens=pooled_all["tokens"],
                cycles=pooled_all["cycles"], prompts=pooled_all["prompts"],
                benches=sorted(t["bench"] for t in spd if t["bench"] != "all"),
                max_new_tokens=setup["max_new_tokens"], model=setup["model"], run=label,
                warm_started=bool(trained.get("warm_start")))


def update_lineage(psm_dir: Path, point: dict) -> list[dict]:
    """PSM_DIR/lineage.json with `point` in it (replacing one of the same setup and positions: the same
    PSM evaluated again), written atomically -> its points of point's setup, by positions. The file
    outlives the weights: a PSM trained on from this directory's is exported over it, and its point
    joins its predecessors'."""
    path = psm_dir / LINEAGE
    try:
        points = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): fix or remove it (train.card rebuilds it from this "
                         "PSM's evaluation on)") from None
    key = lambda p: tuple(p.get(k) for k in SAME_SETUP)  # noqa: E731
    points = [p for p in points if (key(p), p.get("positions")) != (key(point), point["positions"])] + [point]
    points.sort(key=lambda p: (repr(key(p)), p["positions"]))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(points, indent=1) + "\n")
    tmp.replace(path)
    return [p for p in points if key(p) == key(point)]


def lineage_lines(points: list[dict]) -> list[str]:
    """The card's lineage table and plot (lines); none for fewer than two points."""
    if len(points) < 2:
        return []
    p0 = points[0]
    return [
        "### S0 against training positions", "",
        f"Each PSM this directory has held (every one trained on from the one before, except where the run says "
        f"otherwise), by the training positions of its whole warm-start chain: pooled greedy S0 on the same "
        f"{p0['prompts']} prompts ({', '.join(p0['benches'])}; max_new_tokens {p0['max_new_tokens']}). From "
        f"`{LINEAGE}` beside the weights, which `train.card` keeps.", "",
        "| positions in all | run | alpha | S0 |", "|---|---|---|---|",
        *[f"| {p['positions']:,} | {p['run']} | {p['alpha']:.3f} | {p['S0']:.2f} |" for p in points],
        "", "![S0 against training positions](lineage.png)", ""]


def lineage_chains(points: list[dict]) -> list[list[dict]]:
    """The lineage's points (by positions) split into warm-start chains: a PSM trained from scratch
    (`warm_started` false; points from before the key count as warm-started) starts a new one, so the
    plot draws no line into it from a PSM it did not train on from."""
    chains: list[list[dict]] = []
    for p in points:
        if not chains or p.get("warm_started", True) is False:
            chains.append([])
        chains[-1].append(p)
    return chains
