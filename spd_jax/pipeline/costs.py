"""Per-cycle cost model of SPD on a hardware profile: each device's busy time per cycle, the cycle, and
the wall-clock speedup of `spd`, `tp` and `pipeline` over `ar`, all from FLOPs and bytes per part; and
one round of the EAGLE-3-style chain baseline on one device (`predict_eagle3`), counted the same way.

Parts of one cycle (counts from `spd_jax.models.costs`, which derives them from the weight schema; a
drafter's from its kind, `DrafterKind.cost`, the one count of its draft):
each stage's layers on one token; the embedding (stage 0); the verification head (final norm + LM
head); the PSM's body (projections and its Ls layers over the n + 1 rows of a full pipeline, on
`psm_device`: a stage, the last by default, or a device of its own) and its head (V rows, or the
draft vocabulary's V'); the collectives. Two placements of the heads (`HEADS`): "sharded", what the
engine runs (`spd_jax.decode.vocab`: every device computes 1/D of each head's rows, and the greedy
choices come from each shard's max logit and its smallest id), and "last", both heads whole on the last
stage (the engine before vocabulary-parallel heads).

Collectives per cycle (`collectives`), as the engine (`spd_jax.decode.spd`) runs a greedy cycle, one after
another over the D devices of the `stage` axis: the ppermute of each stage's output [H] to the next
stage; one all-gather of each device's packet of [m + 2, H] values in the model dtype (its stage's output,
the last stage's being the verified token's hidden state; rows 1..m the anchor states its stage makes,
zeros otherwise; row m + 1 the drafter's hidden state on the drafter's device), [1, H] without a drafter
(the plain pipeline); and one all-gather of each device's [2, 2] int32 choices (per head, its shard's
max logit and its smallest id at that max; [1, 2] without a drafter, and with the heads whole on the last
stage that stage's two ids). Not counted: the few scalar reductions sampling adds. `tp` keeps its own
collectives (`tp_step_s`: an all-reduce of [H] after every split attention-out or MLP-down projection,
one for the vocabulary-split embedding, one for the argmax over the vocabulary shards), as its placement
(`sharding.TP_RULES`, heads split only where the device count divides them) runs them.

Every part and collective is costed by its `spd_jax.pipeline.hardware.Hardware` profile: the roofline at
the achievable bandwidth, a fixed cost per decoder layer and per program, and per collective a latency
by kind and device count plus its bytes over the achievable link bandwidth. The H100, H200, TPU v5e and
v5p profiles are projections from published figures (each constant's source is in `hardware`), not
measurements; `fit_cpu` fits this machine's from `spd_jax.pipeline.profile.profile_cycle`.
This module computes numbers only: it must not run or compile anything.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from spd_jax.config import ATTENTION, ModelConfig
from spd_jax.models import schema
from spd_jax.models.costs import LayerCost, embed_cost, head_cost, kind_cost, layer_costs
from spd_jax.pipeline.hardware import (A100_GPT_FAST, H100_NVLINK, H200_NVLINK, PROFILES, TPU_V5E_ICI,  # noqa: F401
                                       TPU_V5P_ICI, Hardware)
from spd_jax.pipeline.partition import StagePlan, balanced, plan_stages
from spd_jax.sharding import MODEL, TP_RULES, logical_spec

if TYPE_CHECKING:  # the drafters (Flax) are imported only when their costs are counted
    from spd_jax.drafters.psm import PSMConfig

SCALAR_BYTES = 4  # an int32 / float32 decision value
HEADS = ("sharded", "last")  # where the heads run: vocabulary-parallel on every device (the engine), or the last


@dataclasses.dataclass(frozen=True)
class CycleCosts:
    """The parts of one SPD cycle, as FLOPs and bytes (no hardware yet). Without a drafter (the plain
    pipeline: `psm_cfg` None) the PSM parts are empty and `m` is 0."""

    stages: tuple[tuple[LayerCost, ...], ...]  # [n] each stage's layers, one token
    embed: LayerCost  # stage 0
    head: LayerCost  # verification: final norm + the whole LM head, one token
    head_shard: LayerCost  # the same over one device's ceil(V / D) rows
    psm_body: tuple[LayerCost, ...]  # one draft: projections and Ls layers (on psm_device); () without a drafter
    psm_head: LayerCost | None  # the PSM's whole head (V or V' rows), the newest row only
    psm_head_shard: LayerCost | None  # the same over one device's ceil(V' / D) rows
    hidden_bytes: int  # [H] in the model dtype: one row of the hidden-state packet
    m: int  # the PSM's anchors (rows 1..m of the packet); 0 without a drafter
    psm_device: int  # the device running the PSM body: a stage 0..n-1, or n (a device of its own)
    embed_rows: bool = False  # the embedding split by vocabulary rows over the devices (D divides V)

    @property
    def n(self) -> int:
        return len(self.stages)

    @property
    def drafter(self) -> bool:
        return self.psm_head is not None

    @property
    def devices(self) -> int:
        """Devices of the `stage` axis: the n stages, plus one when the PSM has its own."""
        return self.n + (self.psm_device == self.n)

    @property
    def packet_bytes(self) -> int:
        """One device's hidden-state packet: [m + 2, H] with a drafter (its stage's output, the m anchor
        rows, the drafter's hidden state), [1, H] without."""
        return (self.m + 2 if self.drafter else 1) * self.hidden_bytes


def cycle_costs(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig | None, context: int, param_bytes: int = 2,
                cache_bytes: int | None = None, psm_device: int | None = None) -> CycleCosts:
    """The parts of one cycle of `plan` at position `context` (the KV cache length); psm_cfg: its
    num_layers, m and draft_vocab are read (None: no drafter, the plain pipeline). Bytes in the model
    dtype: `param_bytes` per weight and activation, `cache_bytes` (default: the same) per cache element.
    psm_device: the stage running the PSM body (default the last), or plan.n for a device of its own (the
    heads then split n + 1 ways)."""
    cache_bytes = param_bytes if cache_bytes is None else cache_bytes
    psm_device = check_psm_device(plan.n, psm_device if psm_cfg is not None else None)
    D = plan.n + (psm_device == plan.n)
    n, H = plan.n, cfg.hidden_size
    layers = layer_costs(cfg, context, param_bytes, cache_bytes)
    stages = tuple(tuple(layers[a:b]) for a, b in plan.bounds)
    body, psm_head, psm_shard, m = (), None, None, 0
    if psm_cfg is not None:
        # the PSM's draft (its kind's cost) over a full pipeline: n in-flight rows plus the block's first
        # completed row (`profile_cycle`'s block); its head's shard: a PSM's head over ceil(V' / D) rows
        cost = functools.partial(_drafter_kinds().PSM.cost, cfg, context=context, param_bytes=param_bytes,
                                 cache_bytes=cache_bytes, rows=n + 1)
        *body, psm_head = cost(psm_cfg)
        dv = -(-(psm_cfg.draft_vocab or cfg.vocab_size) // D)
        psm_shard, m = cost(dataclasses.replace(psm_cfg, draft_vocab=dv))[-1], psm_cfg.m
    return CycleCosts(stages, embed_cost(cfg, param_bytes), head_cost(cfg, param_bytes),
                      head_cost(cfg, param_bytes, -(-cfg.vocab_size // D)), tuple(body), psm_head, psm_shard,
                      H * param_bytes, m, psm_device, cfg.vocab_size % D == 0)


def _drafter_kinds():
    """`spd_jax.drafters.registry`, whose kinds' `cost` is the one count of each drafter's draft; imported
    when counted (the drafters import Flax, and this module needs none of it otherwise)."""
    from spd_jax.drafters import registry
    return registry


def check_psm_device(n: int, psm_device: int | None) -> int:
    """None -> the last stage; else a stage in [0, n) or n (a device of its own)."""
    if psm_device is None:
        return n - 1
    if not 0 <= psm_device <= n:
        raise ValueError(f"psm_device {psm_device}: a stage 0..{n - 1}, or {n} for a device of its own")
    return int(psm_device)


def collectives(cc: CycleCosts, heads: str = "sharded") -> list[tuple[str, float]]:
    """The collectives of one cycle as (kind, bytes per device), one after the other: the ppermute of the
    stage output [H], the all-gather of the hidden-state packets (`CycleCosts.packet_bytes`) and the
    all-gather of the choices (int32: [2, 2] per device with a drafter and sharded heads, [1, 2] without
    a drafter or with the heads on the last stage; where the embedding is split by rows, `embed_rows`, each
    choice carries the row [H] of its shard's best token, the next token's embedding). None on one device."""
    _check_heads(heads)
    if cc.devices == 1:
        return []
    choice_rows = 2 if cc.drafter and heads == "sharded" else 1
    choice = 2 * SCALAR_BYTES + (cc.hidden_bytes if cc.embed_rows and heads == "sharded" else 0)
    return [("ppermute", cc.hidden_bytes), ("all_gather", cc.packet_bytes), ("all_gather", choice_rows * choice)]


def comm_s(cc: CycleCosts, hw: Hardware, heads: str = "sharded") -> float:
    """Seconds of the collectives of one cycle (every device of the `stage` axis takes part)."""
    return sum(hw.collective_s(kind, b, cc.devices) for kind, b in collectives(cc, heads))


def _check_heads(heads: str) -> None:
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")


def _busy_s(cc: CycleCosts, hw: Hardware, heads: str) -> list[float]:
    """Each device's compute per cycle: its stage (a stage program; the embedding runs inside stage 0's,
    so no launch of its own); the PSM body on its device; the heads (each its own part) on every device's
    shard, or whole on the last stage. [devices]: n, or n + 1 with the PSM on its own device."""
    _check_heads(heads)
    busy = [hw.part_s(stage, stage=True) for stage in cc.stages] + [0.0] * (cc.devices - cc.n)
    busy[0] += hw.seconds(cc.embed, stage=True)
    if cc.drafter:
        busy[cc.psm_device] += hw.part_s(cc.psm_body)
    if heads == "sharded":
        shards = sum(hw.part_s([h]) for h in (cc.head_shard, cc.psm_head_shard) if h is not None)
        return [b + shards for b in busy]
    busy[cc.n - 1] += hw.part_s([cc.head])
    if cc.drafter:
        busy[cc.psm_device] += hw.part_s([cc.psm_head])
    return busy


def device_busy(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig, hw: Hardware, context: int,
                param_bytes: int = 2, heads: str = "sharded", psm_device: int | None = None) -> list[float]:
    """[devices] seconds each device computes per SPD cycle: its stage, the PSM body on `psm_device`
    (default the last stage; plan.n: its own device), and the heads per `heads` (default "sharded", as
    the engine runs them; "last": both whole on the last stage). Collectives excluded (`comm_s`: every
    device takes part in them)."""
    return _busy_s(cycle_costs(cfg, plan, psm_cfg, context, param_bytes, psm_device=psm_device), hw, heads)


def imbalance(busy_s: Sequence[float]) -> float:
    """max / mean of the devices' busy times (1 = perfectly balanced)."""
    return max(busy_s) / (sum(busy_s) / len(busy_s))


def default_plan(cfg: ModelConfig, n: int) -> StagePlan:
    """The engine's default plan (`spd_jax.decode.pipelined.plan_for`: layers balanced on their decode
    bytes at a 1024-token context), from the config alone."""
    return plan_stages(cfg.num_layers, n, costs=[c.bytes for c in layer_costs(cfg, context_len=1024)])


def device_aware_plan(cfg: ModelConfig, n: int, psm_cfg: PSMConfig, hw: Hardware, context: int,
                      param_bytes: int = 2, heads: str = "sharded",
                      psm_device: int | None = None) -> tuple[StagePlan, list[float]]:
    """The stage plan minimising the busiest device's time per cycle, counting each device's fixed work
    (the embedding on stage 0, the PSM body on `psm_device` (default the last stage; n: its own device,
    whose busy time no plan changes), the heads per `heads`, each part's launch) next to its layers
    -> (plan, [devices] predicted busy seconds per device). An opt-in (`infer.generate
    --stages`): a trained PSM is tied to the plan it was trained on, so the default stays `default_plan`."""
    cc = cycle_costs(cfg, default_plan(cfg, n), psm_cfg, context, param_bytes, psm_device=psm_device)
    layer_s = [hw.seconds(c, stage=True) + hw.layer_s for stage in cc.stages for c in stage]
    no_layers = dataclasses.replace(cc, stages=tuple(() for _ in range(n)))
    fixed = _busy_s(no_layers, hw, heads)  # the fixed work alone, launches included; [n] (+ a PSM device)
    plan = balanced(layer_s, n, extra=fixed[:n])
    return plan, device_busy(cfg, plan, psm_cfg, hw, context, param_bytes, heads, psm_device)


def best_psm_device(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig, hw: Hardware, context: int,
                    param_bytes: int = 2, heads: str = "sharded", own: bool = False) -> tuple[int, list[float]]:
    """Where the PSM body makes the shortest cycle (busiest device + collectives) -> (psm_device, [devices]
    predicted busy seconds). Candidates: the n stages, and with own=True a device of its own (n + 1
    devices); ties keep the last stage (the engine's placement before this option existed)."""
    def cycle(d):
        cc = cycle_costs(cfg, plan, psm_cfg, context, param_bytes, psm_device=d)
        busy = _busy_s(cc, hw, heads)
        return max(busy) + comm_s(cc, hw, heads), busy

    best = plan.n - 1
    best_t, best_busy = cycle(best)
    for d in [*range(plan.n - 1), *([plan.n] if own else [])]:
        t, busy = cycle(d)
        if t < best_t * (1 - 1e-9):
            best, best_t, best_busy = d, t, busy
    return best, best_busy


def predict(cfg: ModelConfig, n: int, psm_cfg: PSMConfig, hw: Hardware, context: int, S0: float,
            plan: StagePlan | None = None, param_bytes: int = 2, alpha: float | None = None,
            heads: str = "sharded", psm_device: int | None = None) -> dict:
    """Predicted seconds per step of each method on `hw`, and wall-clock speedups over `ar`.

    S0 = alpha * L / max(stage layers) of `plan` (what `spd` reports); alpha (tokens per cycle), when
    given, is used instead (to compare plans at one acceptance rate). plan: default `default_plan`.
    - ar: one token through every layer + embedding + head on one device, one program (`ar_step_s`);
    - tp: n devices as `sharding.TP_RULES` places the model, with its all-reduces (`tp_step_s`);
    - pipeline: the SPD engine without a drafter, one token in flight: n cycles per token, each the
      busiest device (its stage and the verification head per `heads`) + its collectives (the ppermute,
      an all-gather of [1, H] and one of the choices);
    - spd: a cycle = the busiest device (`device_busy`, the PSM body on `psm_device`) + the cycle's
      collectives (`comm_s`); with the PSM on its own device (psm_device = n) spd uses n + 1 devices.
    Speedups: spd = alpha * t_ar / t_cycle (alpha tokens per cycle; = S0 * t_ideal / t_cycle with
    t_ideal = t_ar * max(stage layers) / L), tp = t_ar / t_tp, pipeline = t_ar / t_pipeline."""
    _check_heads(heads)
    plan = default_plan(cfg, n) if plan is None else plan
    if plan.n != n:
        raise ValueError(f"a plan of {plan.n} stages for n = {n}")
    if alpha is None:
        alpha = S0 * plan.max_layers / cfg.num_layers
    cc = cycle_costs(cfg, plan, psm_cfg, context, param_bytes, psm_device=psm_device)
    t_ar = ar_step_s(cfg, hw, context, param_bytes)
    tp = tp_step(cfg, hw, n, context, param_bytes)
    plain = cycle_costs(cfg, plan, None, context, param_bytes)  # the plain pipeline: no drafter, n devices
    t_pipe = n * (max(_busy_s(plain, hw, heads)) + comm_s(plain, hw, heads))
    busy = _busy_s(cc, hw, heads)
    t_comm = comm_s(cc, hw, heads)
    t_cycle = max(busy) + t_comm
    return dict(
        hardware=hw.name, projection=hw.projection, assumes=hw.assumes, n=n, stage_layers=list(plan.counts),
        heads=heads, psm_device=cc.psm_device, devices=cc.devices, context=context, param_bytes=param_bytes,
        S0=alpha * cfg.num_layers / plan.max_layers,
        alpha=alpha, ar_step_s=t_ar, tp_step_s=tp["step_s"], tp_comm_s=tp["comm_s"], pipeline_token_s=t_pipe,
        spd_cycle_s=t_cycle, spd_comm_s=t_comm, device_busy_s=busy, imbalance=imbalance(busy),
        speedup_spd=alpha * t_ar / t_cycle, speedup_tp=t_ar / tp["step_s"], speedup_pipeline=t_ar / t_pipe,
        includes="per part: roofline max(FLOPs/peak, bytes/achievable bandwidth) of each layer + a fixed cost per "
                 "decoder layer + one launch; communication included (per collective: its latency by kind and "
                 "device count + bytes/achievable link bandwidth); spd: busiest device + the cycle's ppermute and two "
                 "all-gathers (greedy choices); tp: its placement's compute + all-reduces; pipeline: n cycles of "
                 "the engine without a drafter; excluded: prefill, host transfers, sampling's extra scalar "
                 "reductions, rollback refills (in alpha)")


def ar_step_s(cfg: ModelConfig, hw: Hardware, context: int, param_bytes: int = 2) -> float:
    """`ar`'s step on one device: one token through the embedding, every layer and the head, one program."""
    return hw.part_s([embed_cost(cfg, param_bytes), *layer_costs(cfg, context, param_bytes, param_bytes),
                      head_cost(cfg, param_bytes)])


def _tp_split(axes: tuple, n: int, units: dict) -> tuple:
    """The mesh axis (MODEL or None) of each dimension of an array with logical `axes` under n-way
    `TP_RULES`: `sharding.logical_spec` over an n-device `model` axis."""
    spec = tuple(logical_spec(axes, TP_RULES, SimpleNamespace(shape={MODEL: n}), units))
    return spec + (None,) * (len(axes) - len(spec))


def tp_layer_cost(cfg: ModelConfig, kind: str, context: int, n: int, param_bytes: int = 2,
                  cache_bytes: int = 2) -> tuple[LayerCost, int]:
    """One device's share of one layer of `kind` under n-way tensor parallelism (`sharding.TP_RULES`, an
    axis split only where n divides its units: heads whole) -> (its LayerCost, the all-reduces of [H] it
    ends in: one per 2-D weight whose contracting (first) axis is split, e.g. attention-out and MLP-down).
    A split weight is read 1/n per device and its matmul's FLOPs split with it; attention's context FLOPs
    and KV cache split with the query and KV heads; a Gated DeltaNet mixer's state FLOPs and bytes with its
    value heads."""
    full, units = kind_cost(cfg, kind, context, param_bytes, cache_bytes), schema.axis_units(cfg)
    weights = mm_flops = full_mm = 0.0
    all_reduces = 0
    for leaf in schema.layer_schema(cfg, kind).values():
        split, size = _tp_split(leaf.axes, n, units), float(np.prod(leaf.shape))
        weights += size / (n if MODEL in split else 1)
        if len(leaf.shape) == 2 and "conv_kernel" not in leaf.axes:  # a matmul operand
            full_mm, mm_flops = full_mm + 2 * size, mm_flops + 2 * size / (n if MODEL in split else 1)
            all_reduces += split[0] == MODEL
    if kind == ATTENTION:
        heads, kv = (MODEL in _tp_split((axis,), n, units) for axis in ("q_heads", "kv_heads"))
    else:  # Gated DeltaNet: the conv channels by key-head group, the state by value heads
        heads = kv = MODEL in _tp_split(("conv",), n, units) and MODEL in _tp_split(("v_heads",), n, units)
    rest = (full.flops - full_mm) / (n if heads else 1)  # the mixer's context or state FLOPs
    return LayerCost(kind, full.params, int(mm_flops + rest), int(weights * param_bytes),
                     int(full.state_bytes / (n if kv else 1))), all_reduces


def tp_step(cfg: ModelConfig, hw: Hardware, n: int, context: int, param_bytes: int = 2,
            vocab_split: bool = True) -> dict:
    """`tp`'s step on n devices, one program: each device's share of every layer (`tp_layer_cost`), the
    embedding and the head (vocabulary-split, as `TP_RULES` places them, or whole with vocab_split=False:
    gpt-fast's placement), and the all-reduces: of [H] after each split projection and for a split
    embedding's lookup, and one of the argmax's (value, id) over a split head -> {step_s, comm_s,
    all_reduces (of [H])}."""
    vocab = int(vocab_split and MODEL in _tp_split(("vocab",), n, schema.axis_units(cfg)))
    shares = [tp_layer_cost(cfg, kind, context, n, param_bytes, param_bytes) for kind in cfg.layer_types]
    head = head_cost(cfg, param_bytes, -(-cfg.vocab_size // n) if vocab else None)
    compute = hw.part_s([embed_cost(cfg, param_bytes), *(c for c, _ in shares), head])
    hidden = sum(k for _, k in shares) + vocab
    comm = hidden * hw.all_reduce_s(cfg.hidden_size * param_bytes, n) + vocab * hw.all_reduce_s(2 * SCALAR_BYTES, n)
    return dict(step_s=compute + comm, comm_s=comm, all_reduces=hidden)


def tp_step_s(cfg: ModelConfig, hw: Hardware, n: int, context: int, param_bytes: int = 2,
              vocab_split: bool = True) -> float:
    """Seconds of `tp`'s step on n devices (`tp_step`)."""
    return tp_step(cfg, hw, n, context, param_bytes, vocab_split)["step_s"]


def eagle3_round_costs(cfg: ModelConfig, k: int, context: int, draft_vocab: int = 0,
                       param_bytes: int = 2) -> dict[str, list[list[LayerCost]]]:
    """The parts of one chain round of the EAGLE-3-style drafter on one device (`decode.chain` with
    `drafters.eagle3.Eagle3Drafter`), as FLOPs and bytes: {part: [[LayerCost]]}, each inner list one
    launch:
    - "draft": k drafter steps on one row: the first is the head on the verified row's output, each later
      one the drafter's decoder layer then its head (k heads, k - 1 layer rows);
    - "target": one target pass over the k + 1 positions (embedding, every layer and the head on k + 1
      rows; weights and caches read once, FLOPs times k + 1);
    - "commit": the drafter over the k + 1 verified rows (the fuse [m H, H] and its layer).
    The drafter's layer is the standard EAGLE-3 layer (`drafters.eagle3.DraftLayer`), q/k/v reading [2H]."""
    from spd_jax.drafters.eagle3 import Eagle3Config  # the drafter (Flax): only when counted

    H, rows, pb = cfg.hidden_size, k + 1, param_bytes
    spec = Eagle3Config.for_target(cfg, draft_vocab=draft_vocab)  # the default feature layers
    m, cost = len(spec.layers), _drafter_kinds().EAGLE3.cost
    step_layer, d_head = cost(cfg, spec, context, pb)  # one draft step: the layer on one row, the head
    commit_layer, _ = cost(cfg, spec, context, pb, rows=rows)

    def times(c, r):  # a head or an embedding on r rows: FLOPs and activations r times, weights once
        return dataclasses.replace(c, flops=c.flops * r, state_bytes=c.state_bytes * r)

    fc = LayerCost("eagle3_fc", m * H * H, 2 * m * H * H * rows, m * H * H * pb, rows * m * H * pb)
    target = [times(embed_cost(cfg, pb), rows), *[kind_cost(cfg, kind, context, pb, pb, rows) for kind in
                                                  cfg.layer_types], times(head_cost(cfg, pb), rows)]
    return dict(draft=[[d_head]] + [[step_layer, d_head]] * (k - 1), target=[target], commit=[[fc, commit_layer]])


def predict_eagle3(cfg: ModelConfig, k: int, hw: Hardware, context: int, tokens_per_round: float,
                   draft_vocab: int = 0, param_bytes: int = 2) -> dict:
    """Predicted seconds of one EAGLE-3 chain round on `hw` per part (`eagle3_round_costs`), and its
    wall-clock speedup over `ar` at the measured tokens per round: tokens_per_round * t_ar / t_round."""
    parts = {name: sum(hw.part_s(p) for p in ps)
             for name, ps in eagle3_round_costs(cfg, k, context, draft_vocab, param_bytes).items()}
    t_ar = ar_step_s(cfg, hw, context, param_bytes)
    t_round = sum(parts.values())
    return dict(parts_s=parts, round_s=t_round, ar_step_s=t_ar, speedup=tokens_per_round * t_ar / t_round)


def fit_cpu(profile: dict, cfg: ModelConfig, psm_cfg: PSMConfig, param_bytes: int = 4,
            name: str = "this CPU (fitted)") -> Hardware:
    """This machine's profile, fitted to a `spd_jax.pipeline.profile.profile_cycle` dict, for the model
    `cfg` it was measured on with the PSM `psm_cfg`, in a dtype of `param_bytes`. The dict: stage_ms
    [n], psm_ms (the PSM body), psm_head_ms and verify_ms (one vocabulary shard of each head), ar_step_ms
    (one AR decoder step of the whole model; older profiles lack it), comm_ms (the cycle's collectives),
    context, stage_layers.

    Each measured part is taken as bytes / bandwidth + launch, with two bandwidths: the pipeline stages'
    programs (their layers stacked per stage, which XLA:CPU copies out before each matmul) and every
    other program (heads, the PSM, the AR step's per-layer weights); the three unknowns come from a
    non-negative least-squares fit of the part times against their bytes (one bandwidth without an AR
    step). The fixed cost per layer is not separable from the bytes here (a stage's bytes grow with its
    layers) and is left at 0. FLOP/s is not identifiable from decode parts (their FLOPs grow with their
    bytes), so peak is set to the lowest value under which every fitted layer stays memory-bound. The
    link: the fitted bandwidth (host devices share memory) and a latency from the measured collectives
    less their bytes at that bandwidth."""
    plan = StagePlan(tuple(profile["stage_layers"]))
    ctx = int(profile["context"])
    cc = cycle_costs(cfg, plan, psm_cfg, ctx, param_bytes)
    parts = [*cc.stages, (cc.head_shard,), cc.psm_body, (cc.psm_head_shard,)]
    y = [*profile["stage_ms"], profile["verify_ms"], profile["psm_ms"], profile["psm_head_ms"]]
    two = bool(profile.get("ar_step_ms"))  # an AR step: a second bandwidth, the stages' programs apart
    if two:
        parts.append((embed_cost(cfg, param_bytes), *layer_costs(cfg, ctx, param_bytes, param_bytes),
                      head_cost(cfg, param_bytes)))
        y.append(profile["ar_step_ms"])
    y = 1e-3 * np.array(y)
    x = np.array([sum(c.bytes for c in p) for p in parts], float)
    stage = np.arange(len(parts)) < plan.n
    cols = [np.where(stage, x, 0.0), np.where(stage, 0.0, x)] if two else [x]
    *slopes, launch_s = _nonneg_lstsq(np.stack([*cols, np.ones_like(x)], 1), y)
    bw = 1.0 / slopes[-1] if slopes[-1] > 0 else float(np.max(x / y))  # no slope: the fastest part's rate
    stage_eff = slopes[-1] / slopes[0] if two and min(slopes) > 0 else 1.0
    peak = bw * max(c.flops / c.bytes for p in parts for c in p if c.bytes)
    coll = collectives(cc, "sharded")
    moved = sum(b if kind == "ppermute" else (cc.devices - 1) * b for kind, b in coll)  # each device receives
    latency = max(0.0, (1e-3 * profile["comm_ms"] - moved / bw) / len(coll)) if coll else 0.0
    pred = x * np.where(stage, 1.0 / (bw * stage_eff), 1.0 / bw) + launch_s
    resid_ms = 1e3 * (y - pred)
    names = [*(f"stage {s}" for s in range(plan.n)), "verify shard", "PSM body", "PSM head shard",
             *(["AR step"] if two else [])]
    return Hardware(
        name, peak_flops_per_s=float(peak), mem_bytes_per_s=float(bw), link_latency_s=float(latency),
        link_bytes_per_s=float(bw), launch_s=float(launch_s), projection=False, stage_efficiency=float(stage_eff),
        assumes=f"fitted here from {len(y)} measured parts ({', '.join(names)}; one jitted call each, incl. host "
                f"dispatch) as bytes/bandwidth + launch: {bw / 1e9:.1f} GB/s, the stages' programs at "
                f"{stage_eff:.2f} of it, launch {1e6 * launch_s:.0f} us; residuals (ms) "
                + ", ".join(f"{k} {r:+.2f}" for k, r in zip(names, resid_ms))
                + f"; peak FLOP/s not identifiable, set to {peak / 1e9:.0f} GFLOP/s (every fitted layer "
                f"memory-bound); link: the fitted bandwidth and {1e6 * latency:.1f} us per collective from comm_ms; "
                "on this host the n devices share its cores, so stages do not really run in parallel")


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares y ~ X c with c >= 0, by trying every set of free columns (the others held at 0) and
    keeping the best feasible fit: exact for the few columns used here."""
    k = X.shape[1]
    best, best_sse = np.zeros(k), float(y @ y)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.all(c >= 0):
                sse = float(np.sum((y - X[:, cols] @ c) ** 2))
                if sse < best_sse:
                    best, best_sse = np.zeros(k), sse
                    best[list(cols)] = c
    return best
