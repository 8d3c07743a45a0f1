"""Markdown tables of pooled results (`results.pooled` rows), and the cost model's projections beside
them: the evaluation's results.md and the cells the cards' tables share.

Builds text from plain data; reads and writes no file. The projections come from
`spd_jax.costs.cycle`, per method through `projector` below.
"""

from __future__ import annotations

from spd_jax.drafters import eagle3, registry, store
from spd_jax.methods import METHODS
from spd_jax.costs import baselines, cycle
from spd_jax.pipeline.partition import StagePlan
from spd_jax.reports.results import DRAFTER_FIELD, method_label

PROFILES = ("H200", "TPU")  # the projection columns: cycle.H200_NVLINK and cycle.TPU_V5E_ICI
HARDWARE = dict(zip(PROFILES, (cycle.H200_NVLINK, cycle.TPU_V5E_ICI)))

# a pooled row's cells by column: the evaluation's and the cards' tables pick theirs
CELLS = {
    "bench": lambda t: t["bench"],
    "method": method_label,
    "n": lambda t: f"{t['n']}",
    "T": lambda t: f"{t['temperature']:g}",
    "prompts": lambda t: f"{t['prompts']}",
    "tokens": lambda t: f"{t['tokens']}",
    "alpha": lambda t: f"{t['alpha']:.3f}",
    "S0": lambda t: f"{t['S0']:.2f}",
    "tok/s": lambda t: f"{t['tokens_per_s']:.1f}",
    "vs ar": lambda t: f"{t['speed_vs_ar']:.2f}x" if t.get("speed_vs_ar") else "-",
}


def table_lines(heads: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: header, rule, rows."""
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads), *("| " + " | ".join(r) + " |" for r in rows)]


def pooled_table(table: list[dict], columns: list[str], heads: list[str] | None = None) -> list[str]:
    """Pooled rows as a markdown table of CELLS' columns (heads: their headers, default the column names)."""
    return table_lines(heads or columns, [[CELLS[c](t) for c in columns] for t in table])


# ---------------------------------------------------------------- projections (the cost model)

def _project_ar(t: dict, cfg, hw, ctx: int) -> dict:
    return dict(speedup=1.0, parts_s=dict(step=baselines.ar_step_s(cfg, hw, ctx)))


def _project_eagle3(t: dict, cfg, hw, ctx: int) -> dict:
    label = t.get("drafter_spec")
    dv = eagle3.read_spec(label).draft_vocab if registry.is_checkpoint(label) else 0
    p = baselines.predict_eagle3(cfg, t["k"], hw, ctx, t["alpha"], dv)
    return dict(speedup=p["speedup"], parts_s=p["parts_s"])


def _project_staged(t: dict, cfg, hw, ctx: int) -> dict:
    """tp, pipeline and the drafted pipelines (spd, ppsd) at n: a drafted one at the row's measured alpha,
    stage plan and drafter device, its drafter's cost from its kind (`cycle.predict`'s spd figures)."""
    plan = StagePlan(tuple(t["stage_layers"])) if t.get("stage_layers") else cycle.default_plan(cfg, t["n"])
    m = METHODS[t["method"]]
    kind = m.drafter_kind or registry.PSM  # tp, pipeline: predict's spd figures need a drafter, unread here
    label = t.get(m.label_key) if m.label_key else None
    d_cfg = store.read_spec(kind, label) if registry.is_checkpoint(label) else kind.random_config(cfg, plan)
    where = dict(psm_device=t["psm_device"]) if t.get("psm_device") is not None else {}  # as it ran
    pred = cycle.predict(cfg, t["n"], d_cfg, hw, ctx, S0=t["S0"], plan=plan,
                         alpha=t["alpha"] if t["method"] in DRAFTER_FIELD else None, **where)
    key = "spd" if m.drafter_kind is not None else t["method"]  # predict's figures of a drafted pipeline: "spd"
    parts = {"tp": dict(compute=pred["tp_step_s"] - pred["tp_comm_s"], collectives=pred["tp_comm_s"]),
             "pipeline": dict(step=pred["pipeline_token_s"]),
             "spd": dict(busiest_device=pred["spd_cycle_s"] - pred["spd_comm_s"],
                         collectives=pred["spd_comm_s"])}[key]
    return dict(speedup=pred[f"speedup_{key}"], parts_s=parts)


def projector(method: str):
    """A method's name -> its projection on one hardware profile: (row, cfg, hw, ctx) -> {speedup over ar,
    parts_s: its cycle by part}. The baseline: one step; a chain: `baselines.predict_eagle3`; the others
    (tp, pipeline, spd): `cycle.predict` at n."""
    m = METHODS[method]
    return _project_ar if m.baseline else _project_eagle3 if m.chain else _project_staged


def project(table: list[dict], cfg) -> None:
    """Add each table row's projected wall-clock speedup over `ar` and its projected cycle by part on the
    H200 and TPU v5e profiles, in place: row["proj"][profile] = {speedup, parts_s}. spd at the row's
    measured alpha, stage plan and PSM device (`cycle.predict`: busiest device + collectives); tp and
    pipeline from `cycle.predict` at n; eagle3 from `baselines.predict_eagle3` at its measured tokens per round;
    ar 1 (its parts: one step). The context is the rows' mean decode context; bf16, as the profiles assume."""
    for t in table:
        ctx = max(int(round(t["context"])), 1)
        t["proj"] = {name: projector(t["method"])(t, cfg, hw, ctx) for name, hw in HARDWARE.items()}


# ---------------------------------------------------------------- the evaluation's results.md

RESULTS_COLUMNS = ["bench", "method", "n", "T", "prompts", "tokens", "alpha", "S0", "tok/s", "vs ar"]


def results_markdown(table: list[dict], setup: dict) -> str:
    proj = any("proj" in t for t in table)
    lines = ["# Evaluation results", "",
             "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "alpha = tokens committed per cycle (SPD, pipeline) or per verification round (eagle3: tokens "
             "per target pass), pooled as sum(tokens) / sum(cycles); S0 = alpha * L / (layers of the slowest "
             "stage), the speedup an ideal pipeline would turn it into (eagle3, on n = 1 device: its tokens "
             "per target pass). tok/s and the ratio to `ar` are measured in this run on this backend; on a "
             "CPU host the n stage devices share its cores, so the ratio is not a projection for real devices."
             + (" proj. H200 / proj. TPU: the cost model's projected wall-clock speedup over `ar` "
                "(`spd_jax.costs.cycle`, the H200 and TPU v5e profiles, calibrated on published figures: not "
                "measurements; communication included; bf16) at the row's measured alpha and mean decode "
                "context; spd: busiest device + the cycle's ppermute and two all-gathers; eagle3: one chain round "
                "on one device = k drafter steps + one target pass over k + 1 positions + the drafter's pass over "
                "the verified rows; prefill excluded." if proj else ""), ""]
    heads = RESULTS_COLUMNS + ([f"proj. {p}" for p in PROFILES] if proj else [])
    rows = [[CELLS[c](t) for c in RESULTS_COLUMNS]
            + [f"{t['proj'][p]['speedup']:.2f}x" if "proj" in t else "-" for p in PROFILES if proj] for t in table]
    lines += table_lines(heads, rows)
    lines += ["", "What each timing includes:", ""]
    for method in sorted({t["method"] for t in table}):
        lines.append(f"- `{method}`: " + next(t["timing_includes"] for t in table if t["method"] == method))
    return "\n".join(lines) + "\n"
