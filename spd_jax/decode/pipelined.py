"""Host side of pipelined decoding (`spd` and `pipeline` modes): plan the stages, place weights and
caches on the `stage` mesh, pick the drafter, compile once per shape bucket, run, and report.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from spd_jax.costs import cycle
from spd_jax.decode import ar
from spd_jax.decode.compile_cache import CompileCache, cache_events, compile_source
from spd_jax.decode.sampling import Sampling
from spd_jax.decode.spd import EngineConfig, arg_specs, build
from spd_jax.distributed import to_host
from spd_jax.drafters import registry
from spd_jax.drafters.base import NoDrafter, OracleDrafter
from spd_jax.drafters.kind import Form
from spd_jax.drafters.psm import PSMConfig
from spd_jax.models import decoder, schema
from spd_jax.models.costs import layer_costs
from spd_jax.pipeline import stages
from spd_jax.pipeline.partition import StagePlan, plan_stages
from spd_jax.sharding import (MODEL, STAGE_RULES, STAGE_TP_RULES, Placement, logical_spec, put, stage_mesh,
                              stage_model_mesh)

_compiled = CompileCache()
STAGE_SLOT = "stage"  # `model.placements`' slot of the stage weights and the drafters placed on their mesh


def plan_for(model, n: int, stage_layers: Sequence[int] | None = None) -> StagePlan:
    """Uniform when n divides L and layers cost the same; else balanced on per-token decode bytes."""
    layer_bytes = [c.bytes for c in layer_costs(model.config, context_len=1024)]
    plan = plan_stages(model.config.num_layers, n, stage_layers, layer_bytes)  # first: counts that do not sum to L
    if plan.n != n:
        raise ValueError(f"{plan.n} stage layer counts {list(plan.counts)} for n={n} stages: give {n} counts, or "
                         f"set n to {plan.n} (--n {plan.n}, n={plan.n} in a training config)")
    return plan


def psm_source(model, plan: StagePlan, spec) -> registry.Source:
    """`registry.source` of the PSM: spec (a `DrafterRef` or its older forms) -> (what runs, why a random
    one). Loads nothing."""
    return registry.source(registry.PSM, model, spec, plan)


def resolve_psm(model, plan: StagePlan, spec, psm_layers: int) -> registry.Resolved:
    """`registry.resolve` of the PSM: spec -> (config, variables in the model's dtype, label); psm_layers:
    Ls of a random one."""
    return registry.resolve(registry.PSM, model, spec, plan, psm_layers, method="spd")


PSM_PLACEMENTS = ("auto", "last", "own")  # or a stage index


def drafter_device(model, plan: StagePlan, draft: "EngineDraft", placement) -> int:
    """Where the drafter's network runs: a drafter that drafts after a stage's step on that stage's device
    (placement "auto" or that stage, else refused); a PSM where `placement` says (`psm_device_for`); none
    on the last stage (unused)."""
    after = draft.drafter.after_stage
    if after is not None:
        if placement not in ("auto", after):
            raise ValueError(f"{type(draft.drafter).__name__} drafts after stage {after}'s step, on its device: "
                             f"placement {placement!r} does not apply (leave it \"auto\")")
        return after
    return psm_device_for(model, plan, draft.spec, placement) if draft.spec is not None else plan.n - 1


def psm_device_for(model, plan: StagePlan, psm_cfg: PSMConfig, placement) -> int:
    """Where the PSM body runs -> a stage 0..n-1, or n (a device of its own: n + 1 devices).
    placement: "auto" (the stage the cost model predicts makes the shortest cycle, busiest device +
    collectives, on the TPU v5e profile on a TPU backend and on the H200 NVLink profile on any other,
    CPU and GPU alike; the same device count), "last", "own", or a stage index."""
    n = plan.n
    if placement == "last":
        return n - 1
    if placement == "own":
        return n
    if placement == "auto":
        hw = cycle.TPU_V5E_ICI if jax.default_backend() == "tpu" else cycle.H200_NVLINK
        return cycle.best_psm_device(model.config, plan, psm_cfg, hw, context=1024,
                                     param_bytes=jnp.dtype(model.dtype).itemsize)[0]
    if isinstance(placement, (int, np.integer)) and not isinstance(placement, bool) and 0 <= placement < n:
        return int(placement)
    raise ValueError(f"psm placement {placement!r}: one of {', '.join(PSM_PLACEMENTS)}, or a stage index 0..{n - 1}")


def place_psm(variables: dict, psm_cfg, shared_on_mesh: dict, cfg, rep) -> dict:
    """A loaded or random drafter's variables (a PSM's, a PPSD head's: psm_cfg its kind's config) replicated on
    the stage mesh. Without a draft vocabulary its frozen head is the target's [V, H] (`shared.target_head`):
    it reuses the target head already placed with the shared weights instead of a second copy per device (on
    an 8-stage CPU mesh of SmolLM2 in float32, 8 x 113 MB). A drafter with its own head (a PSM's `own_head`)
    keeps it."""
    if psm_cfg.draft_vocab or registry.of_config(psm_cfg).training.trains_head(psm_cfg):
        return put(variables, rep)
    params = {k: v for k, v in variables["params"].items() if k != "lm_head"}
    placed = put({**variables, "params": params}, rep)
    placed["params"]["lm_head"] = decoder.lm_head(shared_on_mesh, cfg)
    return placed


class EngineDraft(NamedTuple):
    """The SPD engine's drafter for one call: the `SpdDrafter`, how its params go on the stage mesh
    (place(prompt length, cache_len, the stage placement (layout, tp), shared weights placed, replicated
    sharding)), and, for a
    drafter with a network, its kind's config and label (in stats under label_key: "psm", "ppsd")."""

    drafter: Any
    place: Callable[..., Any]
    spec: Any = None
    label: str | None = None
    label_key: str = "psm"


def engine_draft(model, plan: StagePlan, opts) -> EngineDraft:
    """The engine's drafter for a call with opts (a pipelined method: `methods.Pipeline` and its kin), the one
    its `engine_drafter` names in `registry.ENGINE_DRAFTERS`: a staged kind's network, the oracle, or none."""
    kind = registry.engine_drafter(opts.engine_drafter)
    if kind is not None:
        return _network_draft(kind, model, plan, opts)
    if opts.engine_drafter == registry.ORACLE:
        return _oracle_draft(model, opts.oracle_tokens)
    return EngineDraft(NoDrafter(model.config.vocab_size),
                       lambda prompt_len, cache_len, where, shared, rep: put((), rep))


def _network_draft(kind, model, plan: StagePlan, opts) -> EngineDraft:
    """A staged kind's network as the engine's drafter (`DrafterKind.spd_drafter`), its weights resolved from
    opts's drafter reference and placed once per (drafter, stage placement)."""
    d_cfg, variables, label = registry.resolve(kind, model, opts.drafter_ref(), plan, opts.psm_layers, method=opts.name)
    drafter = kind.spd_drafter(model.config, d_cfg)
    # the unplaced variables, dropped once placed: this EngineDraft lives as long as the call, and a second copy
    # of the drafter through the run is 0.63 GB a process at Qwen3.5-4B
    held = {"variables": variables}
    del variables

    def engine_layout():  # split from host views (on a CPU host no copy): placing makes the only new copy
        return drafter.engine_params(jax.tree.map(
            lambda a: np.asarray(a) if getattr(a, "is_fully_addressable", True) else a, held["variables"]))

    def place(prompt_len, cache_len, where, shared, rep):
        if label == Form.GIVEN.value:  # in memory, the caller's: placed per call, not kept
            return put(engine_layout(), rep)

        def build():
            placed = place_psm(engine_layout(), d_cfg, shared, model.config, rep)
            registry.keep_placed(model, held.pop("variables"), placed)
            return placed

        # replicated once per (drafter, stage placement), not per call; kept beside the stage weights
        return model.placements.get(STAGE_SLOT, ("drafter", label, d_cfg), build, placement=where)

    return EngineDraft(drafter, place, d_cfg, label, kind.name)


def _oracle_draft(model, oracle_tokens) -> EngineDraft:
    if oracle_tokens is None:
        raise ValueError("the oracle drafter needs oracle_tokens (the reference continuation)")

    def place(prompt_len, cache_len, where, shared, rep):  # the reference token at every position of the cache
        ref = np.zeros((cache_len,), np.int32)
        toks = np.asarray(oracle_tokens, np.int32)[: cache_len - prompt_len]
        ref[prompt_len:prompt_len + toks.size] = toks
        return put(ref, rep)

    return EngineDraft(OracleDrafter(k=1, vocab_size=model.config.vocab_size), place)


def engine_cache_len(prompt_len: int, max_new_tokens: int, n: int) -> int:
    """The positions each cache of the engine holds for a call: + n + 1, for the PSM recomputes a block of
    n + 1 rows that may reach past the last generated position; a multiple of the cache bucket."""
    return ar.round_up(max(prompt_len + max_new_tokens + n + 1, ar.round_up(prompt_len, ar.PROMPT_BUCKET)),
                       ar.CACHE_BUCKET)


def check_tp(cfg, tp) -> None:
    """Refuse a tensor-parallel width that is not a positive integer or that divides none of a layer's head
    counts and not its MLP width (the stage's devices would each hold and run all of it). A width dividing
    some of them (SmolLM2's MLP columns at tp = 2, not its 9 query heads) splits those and replicates the
    rest, as method "tp" does (`sharding.logical_spec`)."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp (tensor-parallel devices per stage) must be a positive integer, got {tp!r}")
    units = schema.axis_units(cfg)
    if tp > 1 and all(units[a] % tp for a in ("q_heads", "kv_heads", "mlp", "v_heads") if a in units):
        raise ValueError(f"tp={tp} divides none of the model's head counts ({cfg.num_heads} query, "
                         f"{cfg.num_kv_heads} key/value" + (f", {cfg.linear.num_v_heads} Gated DeltaNet value"
                                                            if cfg.linear else "")
                         + f" heads) nor its MLP width ({cfg.intermediate_size}): each of a stage's devices would "
                         "hold and run the whole stage; pick a tp that divides them")


def stage_units(cfg, tp: int) -> dict[str, int]:
    """`schema.axis_units` for the engine's placement at tp devices per stage. A Gated DeltaNet mixer splits
    over `model` only when tp divides both its key heads (the q|k|v conv channels are grouped by them) and its
    value heads; else its value heads stay whole too (units 1: no split). Value heads split under a whole conv
    make XLA slice the conv's output across devices with collective-permutes inside the stage's `lax.cond`
    branch, which only the stages with a token in flight run: on the CPU those permutes wait for all devices
    of the mesh and the program deadlocks."""
    units = dict(schema.axis_units(cfg))
    if tp > 1 and "conv" in units and (units["conv"] % tp or units["v_heads"] % tp):
        units["conv"] = units["v_heads"] = 1
    return units


def engine_mesh(cfg, devices: int, tp: int = 1):
    """The engine's mesh: `devices` along `stage` (tp = 1), or `devices x tp` along (`stage`, `model`), each
    stage tensor-parallel over tp devices (refused when the devices present are fewer, or tp splits no heads)."""
    check_tp(cfg, tp)
    return stage_mesh(devices) if tp == 1 else stage_model_mesh(devices, int(tp))


class Placed(NamedTuple):
    """Everything the engine's program reads, on the stage mesh: per-stage buffers (leading axis the devices,
    split over `stage`) and replicated values."""

    stage_w: dict  # {kind: ({leaf: [devices, ...]} per position in a stage's layers of that kind)}
    prog: dict  # the stages' slot tables [devices, J]
    shared: dict  # embedding, final norm, LM head: replicated
    dparams: Any  # the drafter's weights (`EngineDraft.place`)
    caches: Any  # the stages' caches [devices, ...]
    dstate: Any  # the drafter's state, one copy per device [devices, ...]


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "cache_len", "dtype", "drafter", "sharding"))
def _new_state(*, cfg, layout: stages.StageLayout, cache_len: int, dtype, drafter, sharding):
    """Zeroed stage caches and the drafter's state, one copy per device ([devices, ...] each), made on the
    devices that hold them (each its own block)."""
    caches = stages.init_stage_caches(cfg, layout, 1, cache_len, ring=layout.plan.n, dtype=dtype)
    dstate = jax.tree.map(lambda t: jnp.broadcast_to(t, (layout.devices, *t.shape)), drafter.init((), cache_len, dtype))
    return jax.lax.with_sharding_constraint((caches, dstate), sharding)


def place_engine(model, layout: stages.StageLayout, draft: EngineDraft, mesh, prompt_len: int,
                 cache_len: int) -> Placed:
    """Place what the engine reads for one call. The stage weights, programs and shared weights are kept in
    `model.placements`' stage slot at (layout, tp), one placement at a time (with the drafters placed beside
    them: `place_psm` may share their head); the caches and the drafter's state are new,
    each device making only its own block (nothing of the whole [devices, ...] stack is built in one place).
    mesh: `stage`, or `stage x model` (`engine_mesh`): there the stage weights are also split over `model`."""
    cfg = model.config
    tp = dict(mesh.shape).get(MODEL, 1)
    placement = Placement(mesh, STAGE_RULES if tp == 1 else STAGE_TP_RULES, tuple(stage_units(cfg, tp).items()))
    rep, st = (NamedSharding(mesh, logical_spec(a, STAGE_RULES)) for a in ((), ("stage",)))
    where = (layout, tp)

    def build_shared():
        # the embedding and heads as the stage rules place them (split by vocabulary rows where the devices divide
        # the vocabulary): used as they are when the model was loaded with them
        axes = {k: a for k, a in schema.param_axes(cfg).items() if k != "layers"}
        return placement.put({k: model.params[k] for k in axes}, axes)

    def build():
        if model.layers_loaded:
            stage_w = placement.put(stages.stack_stage_weights(model.params["layers"], cfg, layout),
                                    stages.stage_weight_axes(cfg, layout))
        else:  # loaded for the pipeline: each device reads its own stage's layers from the checkpoint
            stage_w = stages.load_stage_weights(model.reader, cfg, layout, placement, model.dtype)
        return stage_w, put(jax.tree.map(jnp.asarray, stages.program(cfg, layout)), st)

    shared = model.placements.get(STAGE_SLOT, "shared", build_shared, placement=where)
    # the drafter before the stage weights: placing it holds its unplaced copy beside the placed one for a moment,
    # and that moment's peak is then without the layers
    dparams = draft.place(prompt_len, cache_len, where, shared, rep)
    stage_w, prog = model.placements.get(STAGE_SLOT, "weights", build, placement=where)
    caches, dstate = _new_state(cfg=cfg, layout=layout, cache_len=cache_len, dtype=jnp.dtype(model.dtype),
                                drafter=draft.drafter, sharding=st)
    return Placed(stage_w, prog, shared, dparams, caches, dstate)


def generate_pipelined(model, prompt: np.ndarray, max_new_tokens: int, sp: Sampling, opts, *,
                       stop_at_eos: bool = True, compiled: CompileCache | None = None):
    """One prompt through the pipeline a pipelined method's options say (opts: `methods.Pipeline` or its kin,
    as given: its n stages and stage_layers, its engine drafter (`engine_draft`), psm_placement, and tp,
    devices per stage, each stage tensor-parallel over them: a `stage x model` mesh, `engine_mesh`); opts.name
    names the run in the stats. compiled: the caller's compile cache (default this module's)."""
    cfg, tp = model.config, int(opts.tp)
    check_tp(cfg, tp)
    plan = plan_for(model, opts.n, opts.stage_layers)
    draft = engine_draft(model, plan, opts)  # its name was checked when opts was made
    psm_device = drafter_device(model, plan, draft, opts.psm_placement)
    # the stages' programs gather the drafter's anchors (a layout needs one: the embedding, unused without)
    layout = stages.StageLayout.of(cfg, plan, draft.drafter.anchors or (0,), devices=plan.n + (psm_device == plan.n))
    mesh = engine_mesh(cfg, layout.devices, tp)

    P_ = int(prompt.size)
    p_pad = ar.round_up(P_, ar.PROMPT_BUCKET)
    cache_len = engine_cache_len(P_, max_new_tokens, plan.n)
    stage_w, prog, shared, dparams, caches, dstate = place_engine(model, layout, draft, mesh, P_, cache_len)
    rep = NamedSharding(mesh, logical_spec((), STAGE_RULES))

    prompt_arr = np.zeros((1, p_pad), np.int32)
    prompt_arr[0, :P_] = prompt
    eos = np.asarray(model.eos_token_ids if stop_at_eos else (), np.int32)
    eos = eos if eos.size else np.array([-1], np.int32)
    args = (stage_w, prog, shared, dparams, caches, dstate,
            *put((jnp.asarray(prompt_arr), jnp.int32(P_), jnp.int32(max_new_tokens), jnp.asarray(eos),
                  sp.runtime()), rep))

    # the engine compiles per power of two of top_k (the candidates a filter gathers per vocabulary shard)
    top_k_cap = 1 << max(sp.top_k - 1, 0).bit_length() if sp.top_k and sp.filtered and not sp.greedy else 0
    ec = EngineConfig(cfg, layout, draft.drafter, sp.greedy, sp.filtered, top_k_cap, p_pad, cache_len, psm_device,
                      vocab_rows=not shared["embed"].sharding.is_fully_replicated)
    # where the shared weights and the drafter's live: split by rows or replicated (a drafter's own head)
    placed = (arg_specs(shared), arg_specs(dparams))
    ckey = (ec, eos.shape, str(model.dtype), mesh.devices.shape, tuple(d.id for d in mesh.devices.flat),
            tuple(jax.tree.leaves(placed)))
    events = cache_events()
    exe, compile_s = (_compiled if compiled is None else compiled).get(ckey, lambda: build(ec, mesh, placed).lower(*args))
    compile_from = compile_source(events, compile_s)

    t0 = time.perf_counter()
    seq, n_commit, cycles, accepted, rejected, seq_all, _, _ = exe(*args)
    n_commit = int(n_commit)
    wall = time.perf_counter() - t0
    seq_all = to_host(seq_all)  # [devices, S]: each device's copy, from whichever process holds it
    if not (seq_all == seq_all[0]).all():
        raise RuntimeError("pipeline stages disagree on the committed sequence (an engine bug)")
    tokens = seq_all[0, P_:n_commit].tolist()
    N, K = len(tokens), int(cycles)
    alpha = N / K if K else float("nan")
    stats = dict(
        method=opts.name, drafter=opts.engine_drafter, **({"psm": None} | {draft.label_key: draft.label}), n=plan.n,
        stage_layers=list(plan.counts),
        tokens=N, prompt_tokens=P_, cycles=K, alpha=alpha,
        S0=alpha * cfg.num_layers / plan.max_layers,
        accepted=int(accepted), rejected=int(rejected),
        wall_s=wall, tokens_per_s=N / wall, compile_s=compile_s, compile_from=compile_from,
        stopped_at_eos=bool(tokens and tokens[-1] in set(eos.tolist())),
        backend=jax.default_backend(), devices=layout.devices * tp, tp=tp, processes=jax.process_count(),
        psm_device=psm_device if draft.spec is not None else None,
        timing_includes=("prefill and the whole on-device decode loop: every stage's compute, the per-cycle "
                         "inter-stage transfers and all-reduces, the device-to-host copy of the result"
                         + (f" (over {jax.process_count()} processes: the transfers and all-reduces cross them, "
                            "gloo on a CPU host)" if jax.process_count() > 1 else "")
                         + "; excludes compilation (compile_s)"
                         + (". On a CPU host the n devices of one process share its cores, so stages run one "
                            "after another" if jax.process_count() == 1 and jax.default_backend() == "cpu" else "")),
    )
    return tokens, stats
