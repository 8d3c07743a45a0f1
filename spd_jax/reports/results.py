"""The evaluation's results JSONL (`infer.evaluate` rows) read, sorted by drafter and pooled: what every
table, plot, card and lineage point is built from.

Plain data in and out (row dicts as `infer.evaluate` writes them); runs no model, writes no file. What
it knows of a row's method (its shape, its drafter field, the baseline) it reads from the method objects
(`spd_jax.methods`), in the tables below, not by comparing method names.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from spd_jax.drafters import registry
from spd_jax.drafters.kind import Form
from spd_jax.drafters.store import content_id
from spd_jax.methods import METHODS

BASELINE = next(m.name for m in METHODS.values() if m.baseline)  # the method every speed is compared with


@dataclasses.dataclass(frozen=True)
class RowShape:
    """How a method's rows are made and read. one_device: it runs on one device (its rows have n = 1, it
    takes no depth of its own); staged: over n pipeline stages (a stage plan the model must split into);
    chain: k drafts per round (eagle3: its rows carry k and the drafter given, their cycles are the
    verification rounds)."""
    one_device: bool = False
    staged: bool = False
    chain: bool = False


ROW_SHAPES = {m.name: RowShape(one_device=m.one_device, staged=m.staged, chain=m.chain) for m in METHODS.values()}


def row_shape(method: str) -> RowShape:
    """ROW_SHAPES' entry of a method; a method it does not list: on n devices, no stages, no chain."""
    return ROW_SHAPES.get(method, RowShape())
# a drafted method -> the row field that records the drafter checkpoint it was given (`registry.resolve`'s
# label: a path, "random" or "given"); the other methods run no drafter
DRAFTER_FIELD = {m.name: m.label_key for m in METHODS.values() if m.label_key}
# a drafter kind's name -> the method its evaluation rows run
DRAFTER_METHOD = {m.drafter_kind.name: m.name for m in METHODS.values() if m.drafter_kind is not None}
SETUP = ("model", "max_new_tokens", "seed", "backend")  # what the rows of one evaluation share


def read_rows(path: Path) -> list[dict]:
    """A results JSONL file -> its rows (blank lines skipped)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def label_is_dir(label, directory: Path) -> bool:
    """Whether a row's drafter label (the checkpoint path `registry.resolve` was given, or
    "random" / "given" / None) names `directory`."""
    if not isinstance(label, str) or not registry.is_checkpoint(label):
        return False
    return Path(label).resolve() == Path(directory).resolve()


def setup_of(row: dict) -> tuple:
    return tuple(row.get(k) for k in SETUP)


def rows_of_drafter(rows: list[dict], directory: Path, label_key: str) -> tuple[list[dict], bool]:
    """The rows (of one method) made with the drafter now in `directory` -> (rows, legacy). A row records
    the path its drafter was given (label_key: "psm" for spd rows, "drafter_spec" for eagle3's) and what
    was there (drafter_id); the path alone does not say which drafter it held then (a PSM shipped over an
    older one keeps the path), so a row counts when its drafter_id is the directory's content now, at
    whatever path it was evaluated. Rows from before ids were recorded carry none: when no row of this
    path records one (an evaluation made before them) those rows are taken by their path and legacy is True
    (the caller warns: they may be an older drafter's); when some row of the path records another id, the
    rows without one are older still and left out. One row per (benchmark, prompt, method, n, k, T) and
    setup (SETUP): the same drafter evaluated under two paths (given by --spec, then shipped) counts once,
    the row under `directory` first, while its rows of two setups both stay (the card refuses them)."""
    want = content_id(directory)
    mine = sorted((r for r in rows if r.get("drafter_id") == want),
                  key=lambda r: not label_is_dir(r.get(label_key), directory))  # stable: this path's rows first
    seen, unique = set(), []
    for r in mine:
        key = (r["bench"], r["prompt_index"], r["method"], r["n"], r.get("k"), r["temperature"], *setup_of(r))
        if key not in seen:
            seen.add(key)
            unique.append(r)
    if unique:
        return unique, False
    at = [r for r in rows if label_is_dir(r.get(label_key), directory)]
    if any(r.get("drafter_id") is not None for r in at):
        return [], False
    return at, bool(at)


def drafter_rows(rows: list[dict], method: str, directory: Path, n: int | None = None
                 ) -> tuple[list[dict], dict | None, bool]:
    """The results rows of the drafter in `directory`: its `method` rows (at depth n where given: a PSM's
    spd rows at its n) plus the `ar` rows of their setup. A row is this drafter's by its content
    (`rows_of_drafter`: its drafter_id is the directory's content now), so the rows of an older drafter at
    the same path are left out; rows made before ids were recorded count by their path where no row of it
    records one (legacy True: the caller warns).
    -> (rows, setup, legacy); ([], None, False) when there is no row of this drafter; ValueError when its
    rows are of more than one setup."""
    mine, legacy = rows_of_drafter([r for r in rows if r["method"] == method and (n is None or r["n"] == n)],
                                   directory, DRAFTER_FIELD[method])
    setups = sorted({setup_of(r) for r in mine}, key=repr)
    if not setups:
        return [], None, False
    if len(setups) > 1:
        listed = "; ".join(", ".join(f"{k} {v}" for k, v in zip(SETUP, s)) for s in setups)
        raise ValueError(f"the evaluation holds {directory}'s rows of {len(setups)} setups ({listed}): a card "
                         "reports one; evaluate each setup into its own infer.evaluate --out and pass that as --eval")
    base = [r for r in rows if r["method"] == BASELINE and setup_of(r) == setups[0]]
    return mine + base, dict(zip(SETUP, setups[0])), legacy


def method_label(t: dict) -> str:
    """A table row's method, with its chain length for eagle3 ("eagle3 k=3"), and marked where its drafter
    is untrained (no trained PSM for this n, or --random-psm / --drafter random: S0 then says nothing about
    a trained one)."""
    label = t["method"] if t.get("k") is None else f"{t['method']} k={t['k']}"
    field = DRAFTER_FIELD.get(t["method"])
    untrained = field is not None and t.get(field) == Form.RANDOM.value
    return label + (" (untrained drafter)" if untrained else "")


def pooled(rows: list[dict]) -> list[dict]:
    """Per (bench, method, n, k, T) and over all benchmarks ("all"): sum(tokens) / sum(cycles) and
    sum(tokens) / sum(wall), with each one's tokens/s over `ar`'s at the same bench and T. Also what the
    projections and the breakdown plot read: the measured prefill time where the method times it apart
    (ar, tp), the mean decode context (prompt + half the generated tokens), the stage plan and drafters."""
    groups = defaultdict(list)
    for r in rows:
        for bench in (r["bench"], "all"):
            groups[(bench, r["method"], r["n"], r.get("k"), r["temperature"])].append(r)
    table = []
    order = lambda kv: (kv[0][0] == "all", kv[0][:3], kv[0][3] or 0, kv[0][4:])  # noqa: E731  (k None first)
    for (bench, method, n, k, temp), rs in sorted(groups.items(), key=order):
        tok = sum(r["tokens"] for r in rs)
        cyc = sum(r["cycles"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        alpha = tok / cyc if cyc else float("nan")
        prefill = sum(r["prefill_s"] for r in rs) if all(r.get("prefill_s") is not None for r in rs) else None
        table.append(dict(bench=bench, method=method, n=n, k=k, temperature=temp, prompts=len(rs), tokens=tok,
                          cycles=cyc, alpha=alpha, S0=alpha * rs[0]["depth_ratio"], tokens_per_s=tok / wall,
                          wall_s=wall, prefill_s=prefill,
                          context=sum(r.get("prompt_tokens", 0) + r["tokens"] / 2 for r in rs) / len(rs),
                          stage_layers=rs[0].get("stage_layers"), psm_device=rs[0].get("psm_device"),
                          **{f: rs[0].get(f) for f in sorted(set(DRAFTER_FIELD.values()))},  # psm, drafter_spec, ...
                          timing_includes=rs[0]["timing_includes"]))
    ar = {(t["bench"], t["temperature"]): t["tokens_per_s"] for t in table if t["method"] == BASELINE}
    for t in table:
        base = ar.get((t["bench"], t["temperature"]))
        t["speed_vs_ar"] = t["tokens_per_s"] / base if base else None
    return table
