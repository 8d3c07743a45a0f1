"""Per-cycle cost model of SPD on a hardware profile: each device's busy time per cycle, the cycle, and
the wall-clock speedup of `spd`, `tp` and `pipeline` over `ar`, all from FLOPs and bytes per part (the
baselines' steps: `spd_jax.costs.baselines`; every (stage, model) split of a device count:
`spd_jax.costs.factorisations`).

Parts of one cycle (counts from `spd_jax.models.costs`, which derives them from the weight schema; a
drafter's from its kind, `DrafterKind.cost`, the one count of its draft):
each stage's layers on one token; the embedding (stage 0); the verification head (final norm + LM
head); the PSM's body (projections and its Ls layers over the n + 1 rows of a full pipeline, on
`psm_device`: a stage, the last by default, or a device of its own) and its head (V rows, or the
draft vocabulary's V'), or any drafter's by its kind's cost (PPSD's head: its layers on the newest row,
on stage 0); the collectives. Two placements of the heads (`HEADS`): "sharded", what the engine runs
(`spd_jax.decode.vocab`: every device computes 1/D of each head's rows, and the greedy choices come
from each shard's max logit and its smallest id), and "last", both heads whole on the last
stage (the engine before vocabulary-parallel heads).

Collectives per cycle (`collectives`), as the engine (`spd_jax.decode.spd`) runs a cycle, one after another,
each along the `stage` axis or over the devices the heads' vocabulary is split over: greedy, the ppermute of
each stage's output [H] to the next stage; one all-gather of each device's packet of [m + 2, H] values in the
model dtype (its stage's output, the last stage's being the verified token's hidden state; rows 1..m the
anchor states its stage makes, zeros otherwise; row m + 1 the drafter's hidden state on the drafter's
device), [1, H] without a drafter (the plain pipeline); and one all-gather of each device's [2, 2] int32
choices (per head, its shard's max logit and its smallest id at that max; [1, 2] without a drafter, and with
the heads whole on the last stage that stage's two ids). Sampled, the draft's and the verification's draws
add their filters' candidates, softmax reductions and Gumbel argmaxes, as XLA compiles them
(tests/test_spd.py checks the counts against the compiled loop). `tp` keeps its own collectives
(`baselines.tp_step`: an all-reduce of [H] after every split attention-out or MLP-down projection, one for the
vocabulary-split embedding, one for the argmax over the vocabulary shards), as its placement
(`sharding.TP_RULES`, heads split only where the device count divides them) runs them.

On a (stage, model) mesh (`cycle_costs(model=...)`, `factorisations.predict_factorisation`) each stage's
layers, and the PSM's, split over `model` devices as `tp` splits them, their all-reduces along `model` adding
to the stage's time; the heads split over `stage` or over both axes, whichever is cheaper; the PSM on a stage
or on a row of its own.

Every part and collective is costed by its `spd_jax.costs.hardware.Hardware` profile: the roofline at
the achievable bandwidth, a fixed cost per decoder layer and per program, and per collective a latency
by kind and device count plus its bytes over the achievable link bandwidth. The H100, H200, TPU v5e and
v5p profiles are projections from published figures (each constant's source is in `hardware`), not
measurements; `calibration.fit_cpu` fits this machine's from `spd_jax.costs.profile.profile_cycle`.
This module computes numbers only: it must not run or compile anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

from spd_jax.config import ModelConfig
from spd_jax.models.costs import LayerCost, embed_cost, head_cost, kind_cost, layer_costs
from spd_jax.models.kinds import FULL_ATTENTION
from spd_jax.costs.baselines import _drafter_kinds, ar_step_s, tp_layer_cost, tp_state_share, tp_step
from spd_jax.costs.hardware import (A100_GPT_FAST, H100_NVLINK, H200_NVLINK, PROFILES, TPU_V5E_ICI,  # noqa: F401
                                       TPU_V5P_ICI, Hardware)
from spd_jax.pipeline.partition import StagePlan, balanced, plan_stages

if TYPE_CHECKING:  # the drafters (Flax) are imported only when their costs are counted
    from spd_jax.drafters.psm import PSMConfig

HEADS = ("sharded", "last")  # where the heads run: vocabulary-parallel on every device (the engine), or the last
HEAD_AXES = ("stage", "both")  # on a (stage, model) mesh, the mesh axes the heads' vocabulary is split over
INT32_BYTES = FLOAT32_BYTES = 4


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
    model: int = 1  # each stage tensor-parallel over this many devices (a (stage, model) mesh)
    stage_all_reduces: tuple[int, ...] = ()  # [n] all-reduces of [H] along `model` in each stage's layers
    psm_all_reduces: int = 0  # the same in the PSM body's layers
    head_axes: str = "stage"  # the heads' vocabulary split over "stage" (each row's devices alike) or "both"
    draft_rows: int = 0  # a draft vocabulary's rows per head shard (its head's rows are not the embedding's); 0: none
    # the PSM's head is the target's (shared: no draft vocabulary, no head of its own), so each device computes
    # both heads in one pass over its shard (`decode.spd`): the rows read once, the draft a second row of the dot
    one_head: bool = False

    @property
    def n(self) -> int:
        return len(self.stages)

    @property
    def drafter(self) -> bool:
        return self.psm_head is not None

    @property
    def draft_vocab(self) -> bool:
        return self.draft_rows > 0

    @property
    def rows(self) -> int:
        """Positions of the `stage` axis: the n stages, plus one when the PSM has its own."""
        return self.n + (self.psm_device == self.n)

    @property
    def devices(self) -> int:
        """Every device of the mesh: `rows` x `model`."""
        return self.rows * self.model

    @property
    def head_devices(self) -> int:
        """The devices the heads' vocabulary is split over (and its choices gathered from)."""
        return self.rows if self.head_axes == "stage" else self.devices

    @property
    def packet_bytes(self) -> int:
        """One device's hidden-state packet: [m + 2, H] with a drafter (its stage's output, the m anchor
        rows, the drafter's hidden state), [1, H] without."""
        return (self.m + 2 if self.drafter else 1) * self.hidden_bytes


def cycle_costs(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig | None, context: int, param_bytes: int = 2,
                cache_bytes: int | None = None, psm_device: int | None = None, model: int = 1,
                head_axes: str = "stage") -> CycleCosts:
    """The parts of one cycle of `plan` at position `context` (the KV cache length); psm_cfg: its
    num_layers, m and draft_vocab are read (None: no drafter, the plain pipeline). Bytes in the model
    dtype: `param_bytes` per weight and activation, `cache_bytes` (default: the same) per cache element.
    psm_device: the stage running the PSM body (default the last), or plan.n for a device of its own (the
    heads then split n + 1 ways). model: each stage's layers and the PSM's split over `model` devices as
    `sharding.TP_RULES` splits them (`tp_layer_cost`: each device's share, and the all-reduces of [H] each
    layer ends in); head_axes: the heads' vocabulary split over the `stage` axis ("stage") or over every
    device of the mesh ("both")."""
    cache_bytes = param_bytes if cache_bytes is None else cache_bytes
    psm_device = check_psm_device(plan.n, psm_device if psm_cfg is not None else None)
    if head_axes not in HEAD_AXES:
        raise ValueError(f"head_axes must be one of {HEAD_AXES}, got {head_axes!r}")
    rows = plan.n + (psm_device == plan.n)
    D = rows * (model if head_axes == "both" else 1)  # the heads' vocabulary shards
    n, H = plan.n, cfg.hidden_size
    if model == 1:
        layers, ars = layer_costs(cfg, context, param_bytes, cache_bytes), [0] * cfg.num_layers
    else:  # each device's share of each layer, as `tp` splits it (one count per layer kind)
        per_kind = {k: tp_layer_cost(cfg, k, context, model, param_bytes, cache_bytes) for k in set(cfg.layer_types)}
        layers, ars = zip(*(per_kind[k] for k in cfg.layer_types))
    stages = tuple(tuple(layers[a:b]) for a, b in plan.bounds)
    stage_ars = tuple(sum(ars[a:b]) for a, b in plan.bounds) if model > 1 else ()
    body, psm_head, psm_shard, m, psm_ars, dv = (), None, None, 0, 0, 0
    if psm_cfg is not None:
        # the drafter's draft, its kind's cost over its own rows (a PSM's: n in-flight rows and the block's first
        # completed one, `profile_cycle`'s; a PPSD head's: the newest); its head's shard: ceil(V' / D) rows
        cost = functools.partial(_drafter_kinds().of_config(psm_cfg).cost, cfg, context=context,
                                 param_bytes=param_bytes, cache_bytes=cache_bytes)
        *body, psm_head = cost(psm_cfg)
        dv = -(-(psm_cfg.draft_vocab or cfg.vocab_size) // D)
        psm_shard, m = cost(dataclasses.replace(psm_cfg, draft_vocab=dv))[-1], psm_cfg.m
        if model > 1:
            body, psm_ars = _tp_psm_body(cfg, body, context, model, param_bytes, cache_bytes)
    return CycleCosts(stages, embed_cost(cfg, param_bytes), head_cost(cfg, param_bytes),
                      head_cost(cfg, param_bytes, -(-cfg.vocab_size // D)), tuple(body), psm_head, psm_shard,
                      H * param_bytes, m, psm_device, cfg.vocab_size % D == 0, model, stage_ars, psm_ars, head_axes,
                      dv if psm_cfg is not None and psm_cfg.draft_vocab else 0,
                      getattr(psm_cfg, "reads_target_head", False))


def _tp_psm_body(cfg: ModelConfig, body: Sequence[LayerCost], context: int, model: int, param_bytes: int,
                 cache_bytes: int) -> tuple[list[LayerCost], int]:
    """The PSM body's parts on a `model`-wide row -> (each device's share, the all-reduces of [H]). Its
    layers are full-attention layers of the target's kind under the same logical axes (`drafters.psm`), so
    `TP_RULES` splits them as the target's (`tp_layer_cost`), their FLOPs by the same fraction, their cache and
    scores as the KV and query heads split (`tp_state_share`); its projections read (None, "embed") axes, which
    no TP rule splits: whole on every device."""
    full = kind_cost(cfg, FULL_ATTENTION.name, context, param_bytes, cache_bytes)
    share, ars = tp_layer_cost(cfg, FULL_ATTENTION.name, context, model, param_bytes, cache_bytes)
    out, total = [], 0
    for c in body:
        if c.kind == "psm_layer":
            c = dataclasses.replace(c, flops=int(c.flops * share.flops / full.flops), weight_bytes=share.weight_bytes,
                                    state_bytes=tp_state_share(cfg, FULL_ATTENTION.name, context, model, cache_bytes,
                                                               c.state_bytes))
            total += ars
        out.append(c)
    return out, total


def check_psm_device(n: int, psm_device: int | None) -> int:
    """None -> the last stage; else a stage in [0, n) or n (a device of its own)."""
    if psm_device is None:
        return n - 1
    if not 0 <= psm_device <= n:
        raise ValueError(f"psm_device {psm_device}: a stage 0..{n - 1}, or {n} for a device of its own")
    return int(psm_device)


def collectives(cc: CycleCosts, heads: str = "sharded", sampled: bool = False,
                filter_rows: int = 0) -> list[tuple[str, int, str]]:
    """The collectives of one cycle as (kind, bytes per device, axis), one after the other, as the engine
    (`spd_jax.decode.spd`) runs them; axis "stage" (along the `stage` axis) or "heads" (over the devices the
    heads' vocabulary is split over, `CycleCosts.head_devices`). None on one device.

    Greedy: the ppermute of the stage output [H]; the all-gather of the hidden-state packets
    (`CycleCosts.packet_bytes`); the all-gather of the choices (int32: [2, 2] per device with a drafter and
    sharded heads, [1, 2] without a drafter or with the heads on the last stage; where the embedding is split
    by rows, `embed_rows`, each choice carries the row [H] of its shard's best token, the next token's
    embedding); and a draft from a draft vocabulary, whose best row's shard need not hold its embedding, looked
    up by an all-reduce of [H].

    Sampled (`decode.vocab`, as XLA compiles it: the independent scalar reductions of one verification share
    one all-reduce): the ppermute and the packets' all-gather as greedy; the draft's draw (with a drafter): a
    filter's candidates (`filter_rows` float32 per shard, 0: no top-k / top-p), the Gumbel argmax's [2] int32,
    and its softmax's max and sum (two all-reduces of a float32: the sum needs the max), and the draft
    distribution's rows when it comes from a draft vocabulary; the verification: the filter's candidates, the
    softmax's max and sum, one all-reduce of p(d), q(d) and the residual's mass, the draw's [2] int32; and the
    lookup of the two tokens' embeddings ([2, H]) where the embedding is split by rows."""
    _check_heads(heads)
    if cc.devices == 1:
        return []
    out = [("ppermute", cc.hidden_bytes, "stage"), ("all_gather", cc.packet_bytes, "stage")]
    rows_split = cc.embed_rows and heads == "sharded"
    if not sampled:
        choice_rows = 2 if cc.drafter and heads == "sharded" else 1
        choice = 2 * INT32_BYTES + (cc.hidden_bytes if rows_split else 0)
        out.append(("all_gather", choice_rows * choice, "heads"))
        if cc.drafter and cc.draft_vocab and rows_split:
            out.append(("all_reduce", cc.hidden_bytes, "heads"))
        return out
    best, scalar = 2 * INT32_BYTES, FLOAT32_BYTES
    candidates = [("all_gather", filter_rows * FLOAT32_BYTES, "heads")] if filter_rows else []
    if cc.drafter:
        out += [*candidates, ("all_gather", best, "heads"), ("all_reduce", scalar, "heads"),
                ("all_reduce", scalar, "heads")]
        if cc.draft_vocab:  # q over the head's rows -> each device's target-vocabulary shard
            out.append(("all_gather", cc.draft_rows * FLOAT32_BYTES, "heads"))
    out += [*candidates, ("all_reduce", scalar, "heads"), ("all_reduce", scalar, "heads"),
            ("all_reduce", 3 * scalar, "heads"), ("all_gather", best, "heads")]
    if rows_split:
        out.append(("all_reduce", 2 * cc.hidden_bytes, "heads"))
    return out


def mesh_nodes(hw: Hardware, rows: int, model: int) -> dict[str, int]:
    """Nodes each group of a `rows` x `model` mesh spans, the devices laid out node by node with `model`
    fastest (a model group inside a node where it fits): {"model": one stage's model group, "stage": one
    position's column along `stage`, "all": the whole mesh, "permute": 2 where some stage hands its output to
    a stage on another node, else 1}."""
    node = [(r * model) // hw.devices_per_node if hw.devices_per_node else 0 for r in range(rows)]
    return dict(model=hw.nodes(model), stage=len(set(node)), all=hw.nodes(rows * model),
                permute=2 if len(set(node)) > 1 else 1)


def comm_s(cc: CycleCosts, hw: Hardware, heads: str = "sharded", sampled: bool = False,
           filter_rows: int = 0) -> float:
    """Seconds of the collectives of one cycle (`collectives`): along `stage` over its `rows` devices (each
    model column at once), over the heads' devices for the choices."""
    nodes = mesh_nodes(hw, cc.rows, cc.model)
    head_nodes = nodes["stage"] if cc.head_axes == "stage" else nodes["all"]
    total = 0.0
    for kind, b, axis in collectives(cc, heads, sampled, filter_rows):
        if kind == "ppermute":
            total += hw.collective_s(kind, b, 2, nodes["permute"]) if cc.rows > 1 else 0.0
        elif axis == "stage":
            total += hw.collective_s(kind, b, cc.rows, nodes["stage"])
        else:
            total += hw.collective_s(kind, b, cc.head_devices, head_nodes)
    return total


def _check_heads(heads: str) -> None:
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")


def _busy_s(cc: CycleCosts, hw: Hardware, heads: str) -> list[float]:
    """Each device's compute per cycle: its stage (a stage program; the embedding runs inside stage 0's,
    so no launch of its own) with, on a `model`-wide row, its layers' all-reduces along `model` (they sit
    between its layers, so they add to its time); the PSM body on its device (likewise); the heads (each its
    own part) on every device's shard, or whole on the last stage. [rows]: n, or n + 1 with the PSM on its
    own device (each row's `model` devices alike)."""
    _check_heads(heads)
    ar = hw.all_reduce_s(cc.hidden_bytes, cc.model, hw.nodes(cc.model)) if cc.model > 1 else 0.0
    busy = [hw.part_s(stage, stage=True) + k * ar for stage, k in
            zip(cc.stages, cc.stage_all_reduces or (0,) * cc.n)] + [0.0] * (cc.rows - cc.n)
    busy[0] += hw.seconds(cc.embed, stage=True)
    if cc.drafter:
        busy[cc.psm_device] += hw.part_s(cc.psm_body) + cc.psm_all_reduces * ar
    if heads == "sharded":
        return [b + heads_shard_s(cc, hw) for b in busy]
    busy[cc.n - 1] += hw.part_s([cc.head])
    if cc.drafter:
        busy[cc.psm_device] += hw.part_s([cc.psm_head])
    return busy


def one_pass_heads(cc: CycleCosts) -> list[LayerCost]:
    """The heads each device computes per cycle: its verification shard and the PSM head's shard, or with
    `one_head` one dot of two rows over the shard (both heads' FLOPs, the rows read once, and the draft's row)."""
    if cc.psm_head_shard is None:
        return [cc.head_shard]
    if cc.one_head:
        h = cc.head_shard
        return [dataclasses.replace(h, flops=h.flops + cc.psm_head_shard.flops,
                                    state_bytes=h.state_bytes + cc.hidden_bytes)]
    return [cc.head_shard, cc.psm_head_shard]


def heads_shard_s(cc: CycleCosts, hw: Hardware) -> float:
    """Seconds one device spends on its heads' shards per cycle (`one_pass_heads`, a part each)."""
    return sum(hw.part_s([c]) for c in one_pass_heads(cc))


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
                    param_bytes: int = 2, heads: str = "sharded", own: bool = False, model: int = 1,
                    head_axes: str = "stage") -> tuple[int, list[float]]:
    """Where the PSM body makes the shortest cycle (busiest device + collectives) -> (psm_device, [devices]
    predicted busy seconds). Candidates: the n stages, and with own=True a device of its own (n + 1
    devices); ties keep the last stage (the engine's placement before this option existed). model,
    head_axes: a (stage, model) mesh (`cycle_costs`)."""
    def cycle(d):
        cc = cycle_costs(cfg, plan, psm_cfg, context, param_bytes, psm_device=d, model=model, head_axes=head_axes)
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
