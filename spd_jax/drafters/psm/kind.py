"""The PSM's entry in the drafter registry (`KIND`): its random init from the target, its identity file
(psm.json: format, config and the target it was trained for), the checks a loaded one must pass (target,
pipeline depth, stage plan, anchors), where trained ones ship, what one draft costs and what training asks
of it (`TRAINING`: its config from train's settings, its loss `psm_loss`, its warm start, its quick eval).
Reading and writing its checkpoints is `drafters.store`'s; `save_psm`, `read_spec` and `load_psm` name the
kind."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.drafters import store
from spd_jax.drafters.kind import DrafterKind, Training
from spd_jax.drafters.psm.engine import BLOCK_COMPLETED_ROWS, PSMDrafter
from spd_jax.drafters.psm.fills import drafts_by_fill
from spd_jax.drafters.psm.model import PSM, PSMConfig, _layer_schema, layer_config
from spd_jax.drafters.psm.objective import psm_loss
from spd_jax.drafters.shared import check_target, logical_axes, param_count, random_variables
from spd_jax.models.attention import init_kv_cache
from spd_jax.models.costs import psm_costs
from spd_jax.models.kinds import FULL_ATTENTION

FORMAT = 2  # psm.json layout version
# Trained PSMs shipped with the package, one directory per (default model, n): "<model>-n<n>".
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "psms"


def shipped_psm(model_name: str | None, n: int) -> Path | None:
    """The trained PSM shipped for a known default model at n stages, if there is one."""
    p = SHIPPED_DIR / f"{model_name}-n{n}"
    return p if model_name and (p / "psm.json").is_file() else None


def _init_boxed(cfg: ModelConfig, spec: PSMConfig, seed) -> dict:
    """PSM variables with their logical axes (Flax `LogicallyPartitioned` boxes)."""
    H, T = cfg.hidden_size, 2
    cache = init_kv_cache(cfg, spec.num_layers, 1, T, jnp.float32)
    return PSM(cfg, spec).init(jax.random.key(seed), jnp.zeros((T, spec.m, H)), jnp.zeros((T,), jnp.int32), cache,
                               jnp.int32(0), jnp.ones((H,), jnp.float32))


def init_psm(cfg: ModelConfig, spec: PSMConfig, target_params: dict, seed: int = 0, dtype=jnp.float32,
             layers_from_target: bool = False, vocab_ids=None) -> dict:
    """PSM weights: random layers and projections, the LM head copied from the target's (its rows at
    vocab_ids [V'] with a draft vocabulary, which then needs them: `train.corpus.draft_vocab_ids`). With
    layers_from_target, the Ls layers start as copies of the target's last Ls full-attention layers (q/k norms
    the target lacks, `qk_norm`, keep their identity init)."""
    out = random_variables(_init_boxed, cfg, spec, target_params, seed, dtype, vocab_ids, "a PSM")
    if layers_from_target:
        attn = target_params["layers"].get(FULL_ATTENTION.name)
        have = 0 if attn is None else attn["wq"].shape[0]
        if have < spec.num_layers:
            raise ValueError(f"layers_from_target: the PSM has {spec.num_layers} layers but the target only "
                             f"{have} full-attention layers to copy")
        for k in _layer_schema(cfg, spec).keys() & attn.keys():
            # a copy: training donates the PSM's buffers, which must not alias the frozen target's
            out["params"][f"layer_{k}"] = jnp.array(attn[k][have - spec.num_layers:], dtype, copy=True)
    return out


def psm_axes(cfg: ModelConfig, spec: PSMConfig) -> dict:
    """The PSM's variables pytree with each leaf's logical axes (a tuple) in place of the array."""
    return logical_axes(_init_boxed, cfg, spec)


class PSMCheckpointError(ValueError):
    """A PSM checkpoint that does not belong to this target model (architecture or weights), pipeline
    depth or stage plan."""


def spec_to_json(spec: PSMConfig) -> dict:
    return dict(format=FORMAT, **dataclasses.asdict(spec))


def spec_from_json(d: dict, where: str = "") -> PSMConfig:
    if d.get("format") != FORMAT:
        raise PSMCheckpointError(f"PSM checkpoint {where} has format {d.get('format')!r}, this version reads "
                                 f"format {FORMAT}; retrain it with train.main")
    return PSMConfig(tuple(d["anchors"]), int(d["num_layers"]), tuple(d["plan"]), tuple(d["target"]),
                     int(d.get("draft_vocab", 0)), bool(d.get("anchor_norm", False)), bool(d.get("own_head", False)),
                     bool(d.get("qk_norm", False)))


def check_spec(spec: PSMConfig, cfg: ModelConfig, stage_counts: Sequence[int], where: str = "",
               anchors: Sequence[int] | None = None) -> None:
    """Refuse a PSM made for another target model, n, stage plan or anchors, naming the mismatch."""
    check_target(spec.target, cfg, PSMCheckpointError, "PSM", where)
    plan = tuple(int(c) for c in stage_counts)
    if spec.n != len(plan):
        raise PSMCheckpointError(f"PSM checkpoint {where} was trained for n={spec.n} pipeline stages, not "
                                 f"n={len(plan)}; run with --n {spec.n} or train a PSM for n={len(plan)}")
    if spec.plan != plan:
        raise PSMCheckpointError(f"PSM checkpoint {where} was trained for the stage plan {list(spec.plan)} "
                                 f"(layers per stage), not {list(plan)}: its depth staircase depends on it; "
                                 f"run with --stages {','.join(map(str, spec.plan))}")
    if anchors is not None and tuple(anchors) != spec.anchors:
        raise PSMCheckpointError(f"PSM checkpoint {where} reads anchors {list(spec.anchors)}, not "
                                 f"{list(anchors)}")


def _misfit(spec: PSMConfig, plan) -> str | None:
    """Why the PSM shipped for this model at plan.n does not fit plan, or None."""
    if spec.plan == plan.counts:
        return None
    return (f"the PSM shipped for this model at n={plan.n} was trained for the stage plan {list(spec.plan)}, "
            f"not {list(plan.counts)}")


def _cost(cfg: ModelConfig, spec: PSMConfig, context: int, param_bytes: int = 2, cache_bytes: int | None = None,
          rows: int | None = None) -> list:
    """One draft as the engine runs it (`PSMDrafter`): the projections (each in-flight depth's row by its own
    type, the block's completed row by the deepest) and Ls layers over the block of `rows` rows (default
    n + 1: a full pipeline), and the head -> [projections, Ls layers, head]."""
    projected = spec.staircase[:spec.n] + (spec.m - 1,) * BLOCK_COMPLETED_ROWS
    return psm_costs(layer_config(cfg, spec), spec.num_layers, spec.m, spec.draft_vocab,
                     spec.n + 1 if rows is None else rows, context,
                     param_bytes, param_bytes if cache_bytes is None else cache_bytes, projected)


def _warm_start(model, spec: PSMConfig, init_from: str, log) -> dict:
    """The PSM exported at init_from, for a run training spec: the same layer count and anchor count (the
    projections' shapes), for this target; trained for another plan, it is still a warm start (noted)."""
    was = read_spec(init_from)
    if was.num_layers != spec.num_layers:
        raise ValueError(f"init_from {init_from} has {was.num_layers} PSM layers, this run {spec.num_layers}; "
                         f"set psm_layers={was.num_layers}")
    if was.m != spec.m:
        raise ValueError(f"init_from {init_from} reads {was.m} anchors {list(was.anchors)}, this run "
                         f"{spec.m} {list(spec.anchors)}: its projections do not fit; set anchors="
                         f"{','.join(map(str, was.anchors))} or start without init_from")
    if was.anchor_norm and not spec.anchor_norm:
        raise ValueError(f"init_from {init_from} normalises its anchor states (anchor_norm), this run does not: "
                         "its projections read normalised states; set anchor_norm=true or start without init_from")
    if spec.anchor_norm and not was.anchor_norm:
        # the layers and head still fit; the projections learnt unnormalised states, training adapts them
        log.warning("init_from %s does not normalise its anchor states; this run does (anchor_norm): the "
                    "anchor gains start at the identity, the projections relearn their inputs' scale", init_from)
    if was.own_head and not spec.own_head:
        raise ValueError(f"init_from {init_from} trained its own head (own_head), this run's head is the target's: "
                         "its layers learnt to feed its own head; set own_head=true or start without init_from")
    if was.qk_norm != spec.qk_norm:
        raise ValueError(f"init_from {init_from} {'has' if was.qk_norm else 'has no'} per-head q/k norms in its layers "
                         f"(qk_norm), this run's PSM {'has' if spec.qk_norm else 'has none'}: its layers do not fit; "
                         "start without init_from")
    if was.own_head and spec.draft_vocab:
        # its head's rows are its own draft vocabulary's, this run's are recomputed from this run's corpus
        raise ValueError(f"init_from {init_from} trained its own head, and this run has a draft vocabulary "
                         f"(draft_vocab={spec.draft_vocab}) whose rows need not be its rows: warm-start an "
                         "own head over the whole vocabulary (draft_vocab=0), or start without init_from")
    if (was.plan, was.anchors) != (spec.plan, spec.anchors):
        # A PSM for another n is still a warm start of the same shapes: the layers, the head and the
        # embedding-only projection (the drafting row's) mean the same; the staircase and what the
        # deeper anchors hold change, and training adapts them.
        log.warning("init_from %s was trained for n=%d (plan %s, anchors %s); this run is n=%d (plan %s, "
                    "anchors %s): a warm start only", init_from, was.n, list(was.plan), list(was.anchors),
                    spec.n, list(spec.plan), list(spec.anchors))
    # the target (model) is still checked: another model's PSM is refused
    variables = load_psm(init_from, model.config, was.plan, model.params, jnp.float32, was.anchors,
                         target_weights=model.weights_fingerprint, model_name=str(model.path))[1]
    if not was.own_head:  # the target's head, which the run's init already holds at its own vocabulary
        variables = {**variables, "params": {k: v for k, v in variables["params"].items() if k != "lm_head"}}
    return variables


def _eval_summary(spec: PSMConfig, tokens: int, cycles: int, d: Any) -> dict:
    """SPD's alpha (tokens per cycle) and S0 = alpha * L / max(stage layers), the paper's figure."""
    alpha = tokens / cycles
    return dict(alpha=alpha, S0=alpha * sum(spec.plan) / max(spec.plan), eval_tokens=tokens, eval_cycles=cycles)


TRAINING = Training(
    export_dir="psm", metric="S0",
    config=lambda cfg, plan, d: PSMConfig.for_target(cfg, plan.counts, d.psm_layers, d.anchors, d.draft_vocab,
                                                     d.anchor_norm, d.own_head),
    trains_head=lambda spec: spec.own_head,
    loss=psm_loss, loss_options=lambda d: dict(fill_accept=d.fill_accept, hard_weight=d.hard_weight),
    axes=psm_axes, warm_start=_warm_start,
    # SPD at the PSM's own n and plan (the quick eval needs n devices: train.loop checks)
    eval_options=lambda spec, variables, d: dict(n=spec.n, stage_layers=spec.plan, spec=(spec, variables)),
    eval_summary=_eval_summary,
    describe=lambda name, spec, d: (f"PSM for {name}: n={spec.n}, stages {list(spec.plan)}, anchors "
                                    f"{list(spec.anchors)}, staircase {list(spec.staircase)}, Ls={spec.num_layers}"
                                    f"{', anchor states normalised' if spec.anchor_norm else ''}"
                                    f"{', its own head trained' if spec.own_head else ''}"
                                    f"{', q/k norms in its layers' if spec.qk_norm else ''}"),
    exported=lambda final, spec, step, d: (f"PSM (step {step}) written to {final} (use: python -m infer.generate "
                                           f"--n {spec.n} --spec {final})"),
    init_options=lambda d: dict(layers_from_target=d.layers_from_target),
    # psm_layers is in the spec too (num_layers); kept in the identity as runs have always recorded it
    identity=lambda d: dict(psm_layers=d.psm_layers),
    recorded_spec=lambda s: spec_to_json(spec_from_json(s)))


KIND = DrafterKind(
    name="psm", label="PSM", a_label="a PSM", noun="PSM", identity_file="psm.json", config=PSMConfig,
    error=PSMCheckpointError, shipped_dir=SHIPPED_DIR, to_json=spec_to_json, from_json=spec_from_json,
    init=init_psm,
    check=lambda spec, cfg, where, plan=None, expect=None: check_spec(spec, cfg, plan, where, expect),
    random_config=lambda cfg, plan, num_layers=2: PSMConfig.for_target(cfg, plan.counts, num_layers=num_layers),
    shipped=lambda model_name, plan: shipped_psm(model_name, plan.n), misfit=_misfit, cost=_cost,
    params=lambda cfg, spec: param_count(_init_boxed, cfg, spec, bool(spec.draft_vocab or spec.own_head)),
    flag="--spec", train_fix="train a PSM for {model} (python -m train.main with model: {model}) or use one trained for it",
    training=TRAINING, missing_hint="; train one with train.main", staged=True, random_flag="--random-psm",
    teacher_drafts=drafts_by_fill, spd_drafter=PSMDrafter,
    why_random="an untrained PSM was asked for (spec=\"random\", --random-psm)")


def save_psm(path: str | Path, variables: dict, spec: PSMConfig, extra: dict | None = None,
             target_weights: str | None = None) -> None:
    """`store.save` of a PSM: variables (orbax) and psm.json (the spec, extra facts, target_weights)."""
    store.save(KIND, path, variables, spec, extra, target_weights)


def read_spec(path: str | Path) -> PSMConfig:
    return store.read_spec(KIND, path)


def load_psm(path: str | Path, cfg: ModelConfig, stage_counts: Sequence[int], target_params: dict,
             dtype=jnp.float32, anchors: Sequence[int] | None = None, target_weights: str | None = None,
             model_name: str | None = None) -> tuple[PSMConfig, dict]:
    """`store.load` of a PSM for the stage plan stage_counts (and, when given, these anchors)."""
    return store.load(KIND, path, cfg, target_params, dtype, plan=stage_counts, expect=anchors,
                      weights=target_weights, model_name=model_name)
