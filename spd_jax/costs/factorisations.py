"""SPD, the plain pipeline, `tp` and `ar` over every (stage, model) factorisation of a device count: each
stage's layers split over `model` devices as `tp` splits them (`cycle.cycle_costs(model=...)`), the heads over
`stage` or both axes, the PSM on a stage or on a row of its own (the paper's n + 1); acceptance held per draft
across depths (`acceptance`, `alpha_at`: SPD.md section 3). `best_factorisations` is what
`bench.projections` prints. Numbers only: nothing runs or compiles here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from spd_jax.config import ModelConfig
from spd_jax.costs import cycle
from spd_jax.costs.baselines import _drafter_kinds, ar_step_s, tp_step
from spd_jax.costs.hardware import Hardware
from spd_jax.pipeline.partition import StagePlan

if TYPE_CHECKING:  # the drafters (Flax) are imported only when their costs are counted
    from spd_jax.drafters.psm import PSMConfig


def acceptance(S0: float, n: int, max_layers: int, num_layers: int) -> float:
    """The per-draft acceptance p an n-stage S0 implies: alpha = S0 x max(stage layers) / L, and
    alpha = 1 / (1 + (1 - p)(n - 1)) (docs/SPD.md, section 3)."""
    alpha = S0 * max_layers / num_layers
    return 1.0 - (1.0 / alpha - 1.0) / (n - 1)


def alpha_at(p: float, n: int) -> float:
    """Committed tokens per cycle at n stages for a per-draft acceptance p (docs/SPD.md, section 3): a
    rejection costs the n - 1 cycles the pipeline takes to refill."""
    return 1.0 / (1.0 + (1.0 - p) * (n - 1))


@dataclasses.dataclass(frozen=True)
class Factorisation:
    """Devices as `stages` pipeline stages, each `model` devices wide (tensor parallel inside each stage, by
    `sharding.TP_RULES`); with `psm_own`, one more row of `model` devices runs the PSM body alone (the
    paper's n + 1). stages = 1: pure `tp`; stages = model = 1: `ar`."""

    stages: int
    model: int
    psm_own: bool = False

    @property
    def devices(self) -> int:
        return (self.stages + self.psm_own) * self.model

    @property
    def method(self) -> str:
        return "ar" if self.devices == 1 else "tp" if self.stages == 1 else "spd"

    def __str__(self) -> str:
        return f"{self.stages} x {self.model}" + (" + PSM row" if self.psm_own else "")


def factorisations(devices: int) -> list[Factorisation]:
    """Every (stage, model) split of `devices`: stages x model = devices, the PSM on a stage (stages = 1:
    pure `tp`), and (stages + 1) x model = devices, the PSM on a row of its own (stages >= 2: one stage
    pipelines nothing)."""
    out = [Factorisation(devices // m, m) for m in range(1, devices + 1) if devices % m == 0]
    out += [Factorisation(devices // m - 1, m, True) for m in range(1, devices + 1)
            if devices % m == 0 and devices // m - 1 >= 2]
    return sorted(out, key=lambda f: (f.psm_own, -f.stages))


def mesh_cycle(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig | None, hw: Hardware, context: int,
               model: int = 1, psm_device: int | None = None, head_axes: str = "stage", param_bytes: int = 2,
               heads: str = "sharded", sampled: bool = False, filter_rows: int = 0) -> dict:
    """One cycle of the engine on a (len(plan), model) mesh (psm_cfg None: the plain pipeline) -> {cycle_s
    (busiest row + collectives), busy_s [rows], comm_s, costs (the `CycleCosts`)}."""
    cc = cycle.cycle_costs(cfg, plan, psm_cfg, context, param_bytes, psm_device=psm_device, model=model,
                     head_axes=head_axes)
    busy = cycle._busy_s(cc, hw, heads)
    comm = cycle.comm_s(cc, hw, heads, sampled, filter_rows)
    return dict(cycle_s=max(busy) + comm, busy_s=busy, comm_s=comm, costs=cc)


def predict_factorisation(cfg: ModelConfig, f: Factorisation, hw: Hardware, context: int, p: float,
                          psm_layers: int, param_bytes: int = 2) -> dict:
    """One factorisation's seconds per token and speedup over `ar` on `hw`, at per-draft acceptance p.
    ar and tp: their step (`ar_step_s`, `tp_step` over `model` devices, across nodes where wider than one).
    spd: the default plan of `stages` stages (`default_plan`), a PSM of `psm_layers` layers for it, placed on
    the stage or its own row, and the heads split over `stage` or over both axes, whichever gives the
    shortest cycle; alpha = `alpha_at(p, stages)`, speedup alpha x t_ar / cycle. pipeline (the PSM on a
    stage only): the same mesh without a drafter, `stages` cycles per token. -> {factorisation, method,
    devices, step_s, speedup, psm (where the PSM body runs: "stage s", "own row"), head_axes, alpha, and for
    spd pipeline_s and speedup_pipeline}."""
    t_ar = ar_step_s(cfg, hw, context, param_bytes)
    out = dict(factorisation=f, method=f.method, devices=f.devices, hardware=hw.name, latency=hw.latency_class)
    if f.stages == 1:  # ar on one device, else tp over the model axis
        t = t_ar if f.model == 1 else tp_step(cfg, hw, f.model, context, param_bytes)["step_s"]
        return out | dict(step_s=t, speedup=t_ar / t)
    plan = cycle.default_plan(cfg, f.stages)
    psm_cfg = _drafter_kinds().PSM.random_config(cfg, plan, psm_layers)
    axes = cycle.HEAD_AXES if f.model > 1 else ("stage",)
    places = [f.stages] if f.psm_own else range(f.stages)
    best = min((mesh_cycle(cfg, plan, psm_cfg, hw, context, f.model, d, ax, param_bytes)
                | dict(psm_device=d, axes=ax) for d in places for ax in axes), key=lambda r: r["cycle_s"])
    alpha = alpha_at(p, f.stages)
    out |= dict(step_s=best["cycle_s"] / alpha, speedup=alpha * t_ar / best["cycle_s"], cycle_s=best["cycle_s"],
                comm_s=best["comm_s"], alpha=alpha, S0=alpha * cfg.num_layers / plan.max_layers,
                psm="own row" if f.psm_own else f"stage {best['psm_device']}", head_axes=best["axes"])
    if not f.psm_own:
        plain = min(mesh_cycle(cfg, plan, None, hw, context, f.model, None, ax, param_bytes)["cycle_s"] for ax in axes)
        out |= dict(pipeline_s=f.stages * plain, speedup_pipeline=t_ar / (f.stages * plain))
    return out


def best_factorisations(cfg: ModelConfig, devices: int, hw: Hardware, context: int, p: float,
                        psm_layers, param_bytes: int = 2) -> dict:
    """Every factorisation of `devices` and of each count that divides it (`factorisations`: a method need
    not use every device; pure tp over 16 GPUs on two nodes is slower than over the 8 of one) projected
    (`predict_factorisation`; psm_layers(stages) -> the PSM's layer count at that depth) -> {"all": every row,
    "spd": the best spd row, "tp": the best pure tp row (or ar), "pipeline": the best plain pipeline row (its
    speedup in speedup_pipeline)}."""
    rows = [predict_factorisation(cfg, f, hw, context, p, psm_layers(f.stages), param_bytes)
            for d in range(1, devices + 1) if devices % d == 0 for f in factorisations(d)]
    spd = [r for r in rows if r["factorisation"].stages > 1]
    return dict(all=rows, spd=max(spd, key=lambda r: r["speedup"], default=None),
                tp=max((r for r in rows if r["factorisation"].stages == 1), key=lambda r: r["speedup"]),
                pipeline=max((r for r in spd if "speedup_pipeline" in r), key=lambda r: r["speedup_pipeline"],
                             default=None))
