"""Per-cycle cost model of SPD on a hardware profile: each device's busy time per cycle, the cycle, and
the wall-clock speedup of `spd`, `tp` and `pipeline` over `ar`, all from FLOPs and bytes per part; and
one round of the EAGLE-3-style chain baseline on one device (`predict_eagle3`), counted the same way.

Parts of one cycle (counts from `spd_jax.models.costs`, which derives them from the weight schema; a
drafter's from its kind, `DrafterKind.cost`, the one count of its draft):
each stage's layers on one token; the embedding (stage 0); the verification head (final norm + LM
head); the PSM's body (projections and its Ls layers over the n + 1 rows of a full pipeline, on
`psm_device`: a stage, the last by default, or a device of its own) and its head (V rows, or the
draft vocabulary's V'); the collectives. Two placements of the heads (`HEADS`): "sharded", what the
engine runs (`spd_jax.decode.vocab`: every device computes 1/n of each head's rows; the verified
token's and the draft's hidden states are broadcast, [H] each, and the greedy choices are a max and a
min per head), and "last", both heads whole on the last stage (the engine before vocabulary-parallel
heads). Collectives per cycle, as `pipeline/profile.py` times them: one ppermute of [H], one
all-reduce of the cycle's anchor states [m, H] (each anchor from the one stage that makes it; where it
lands in the drafter's table follows from replicated bookkeeping, so nothing else travels), and the
choices' reductions (below). Not counted: the few scalar reductions sampling adds.

A part costs its roofline, max(FLOPs / peak, bytes / bandwidth) summed over its layers, plus a fixed
launch overhead; a collective costs the link latency plus its bytes over the link bandwidth (a ring
all-reduce moves 2 (n - 1) / n of them). The H200 and TPU v5e profiles are projections from published
figures, not measurements; `fit_cpu` fits this machine's from `spd_jax.pipeline.profile.profile_cycle`.
This module computes numbers only: it must not run or compile anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models.costs import LayerCost, embed_cost, head_cost, kind_cost, layer_costs
from spd_jax.pipeline.partition import StagePlan, balanced, plan_stages

if TYPE_CHECKING:  # the drafters (Flax) are imported only when their costs are counted
    from spd_jax.drafters.psm import PSMConfig

SCALAR_BYTES = 4  # an int32 / float32 decision value
HEADS = ("sharded", "last")  # where the heads run: vocabulary-parallel on every device (the engine), or the last
# scalar all-reduces per cycle for the choices: sharded, a max and a min per head (greedy argmax over
# the shards, `decode.vocab.argmax`); last, the decision broadcast from the last stage
CHOICE_ALL_REDUCES = {"sharded": 4, "last": 3}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A hardware profile: one device's roofline, its links and a fixed cost per part (units in names)."""

    name: str
    peak_flops_per_s: float  # dense FLOP/s in the decode dtype
    mem_bytes_per_s: float  # memory (HBM / DRAM) bandwidth
    link_latency_s: float  # per collective
    link_bytes_per_s: float  # per direction, per link
    launch_s: float  # fixed overhead of each part (a program, or a fused group of kernels)
    assumes: str  # what the figures are and where they come from
    projection: bool  # True: figures assumed, not measured on this machine

    def part_s(self, costs: Sequence[LayerCost]) -> float:
        """One part: the roofline of each of its layers, summed, plus one launch."""
        return sum(c.seconds(self.peak_flops_per_s, self.mem_bytes_per_s) for c in costs) + self.launch_s

    def ppermute_s(self, nbytes: float) -> float:
        return self.link_latency_s + nbytes / self.link_bytes_per_s

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        """A ring all-reduce over n devices: each sends and receives 2 (n - 1) / n of the bytes."""
        if n <= 1:
            return 0.0
        return self.link_latency_s + 2 * (n - 1) / n * nbytes / self.link_bytes_per_s


H200_NVLINK = Hardware(
    "H200-NVLink-like", peak_flops_per_s=989e12, mem_bytes_per_s=4.8e12, link_latency_s=5e-6,
    link_bytes_per_s=450e9, launch_s=5e-6, projection=True,
    assumes="projection, not measured: NVIDIA H200 SXM datasheet figures: 989 TFLOP/s dense bf16, 4.8 TB/s "
            "HBM3e, NVLink 4 at 450 GB/s per direction; assumed 5 us latency per collective (NCCL, small "
            "messages) and 5 us launch per part (kernels of one on-device loop); weights and caches in bf16")
TPU_V5E_ICI = Hardware(
    "TPU-v5e-ICI-like", peak_flops_per_s=197e12, mem_bytes_per_s=819e9, link_latency_s=10e-6,
    link_bytes_per_s=100e9, launch_s=3e-6, projection=True,
    assumes="projection, not measured: Cloud TPU v5e published figures: 197 TFLOP/s bf16, 819 GB/s HBM2; ICI "
            "taken as ~100 GB/s per link per direction (order of magnitude) with ~10 us per collective; "
            "assumed 3 us per part (XLA ops inside one on-device loop); weights and caches in bf16")


@dataclasses.dataclass(frozen=True)
class CycleCosts:
    """The parts of one SPD cycle, as FLOPs and bytes (no hardware yet)."""

    stages: tuple[tuple[LayerCost, ...], ...]  # [n] each stage's layers, one token
    embed: LayerCost  # stage 0
    head: LayerCost  # verification: final norm + the whole LM head, one token
    head_shard: LayerCost  # the same over one device's ceil(V / n) rows
    psm_body: tuple[LayerCost, ...]  # one draft: projections and Ls layers (on psm_device)
    psm_head: LayerCost  # the PSM's whole head (V or V' rows), the newest row only
    psm_head_shard: LayerCost  # the same over one device's ceil(V' / n) rows
    hidden_bytes: int  # [H]: the hidden state that moves one stage per cycle, or is broadcast
    anchor_bytes: int  # the cycle's anchor states [m, H], all-reduced
    psm_device: int  # the device running the PSM body: a stage 0..n-1, or n (a device of its own)

    @property
    def n(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> int:
        """Devices of the `stage` axis: the n stages, plus one when the PSM has its own."""
        return self.n + (self.psm_device == self.n)


def cycle_costs(cfg: ModelConfig, plan: StagePlan, psm_cfg: PSMConfig, context: int, param_bytes: int = 2,
                cache_bytes: int | None = None, psm_device: int | None = None) -> CycleCosts:
    """The parts of one cycle of `plan` at position `context` (the KV cache length); psm_cfg: its
    num_layers, m and draft_vocab are read. Bytes in the model dtype: `param_bytes` per weight and
    activation, `cache_bytes` (default: the same) per cache element. psm_device: the stage running
    the PSM body (default the last), or plan.n for a device of its own (the heads then split n + 1 ways)."""
    cache_bytes = param_bytes if cache_bytes is None else cache_bytes
    psm_device = check_psm_device(plan.n, psm_device)
    D = plan.n + (psm_device == plan.n)
    n, H, m = plan.n, cfg.hidden_size, psm_cfg.m
    layers = layer_costs(cfg, context, param_bytes, cache_bytes)
    stages = tuple(tuple(layers[a:b]) for a, b in plan.bounds)
    # the PSM's draft (its kind's cost) over a full pipeline: n in-flight rows plus the block's first completed
    # row (`profile_cycle`'s block); its head's shard is the head of a PSM over one device's ceil(V' / D) rows
    cost = functools.partial(_drafter_kinds().PSM.cost, cfg, context=context, param_bytes=param_bytes,
                             cache_bytes=cache_bytes, rows=n + 1)
    *body, psm_head = cost(psm_cfg)
    psm_shard = cost(dataclasses.replace(psm_cfg, draft_vocab=-(-(psm_cfg.draft_vocab or cfg.vocab_size) // D)))[-1]
    return CycleCosts(stages, embed_cost(cfg, param_bytes), head_cost(cfg, param_bytes),
                      head_cost(cfg, param_bytes, -(-cfg.vocab_size // D)), tuple(body), psm_head, psm_shard,
                      H * param_bytes, m * H * param_bytes, psm_device)


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
    """The collectives of one cycle as (kind, bytes), kind "ppermute" or "all_reduce": the hidden
    state's hop, the anchor states, with sharded heads two broadcasts of [H] (the verified token's and
    the draft's hidden state), and the choices' scalars."""
    _check_heads(heads)
    if cc.devices == 1:
        return []
    out = [("ppermute", cc.hidden_bytes), ("all_reduce", cc.anchor_bytes)]
    if heads == "sharded":
        out += [("all_reduce", cc.hidden_bytes)] * 2
    return out + [("all_reduce", SCALAR_BYTES)] * CHOICE_ALL_REDUCES[heads]


def comm_s(cc: CycleCosts, hw: Hardware, heads: str = "sharded") -> float:
    """Seconds of the collectives of one cycle (every device takes part)."""
    return sum(hw.ppermute_s(b) if kind == "ppermute" else hw.all_reduce_s(b, cc.devices)
               for kind, b in collectives(cc, heads))


def _check_heads(heads: str) -> None:
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")


def _busy_s(cc: CycleCosts, hw: Hardware, heads: str) -> list[float]:
    """Each device's compute per cycle: its stage (the embedding runs inside stage 0's program, so no
    launch of its own); the PSM body on its device; the heads (each its own part) on every device's
    shard, or whole on the last stage. [devices]: n, or n + 1 with the PSM on its own device."""
    _check_heads(heads)
    busy = [hw.part_s(stage) for stage in cc.stages] + [0.0] * (cc.devices - cc.n)
    busy[0] += cc.embed.seconds(hw.peak_flops_per_s, hw.mem_bytes_per_s)
    busy[cc.psm_device] += hw.part_s(cc.psm_body)
    if heads == "sharded":
        shards = hw.part_s([cc.head_shard]) + hw.part_s([cc.psm_head_shard])
        busy = [b + shards for b in busy]
    else:
        busy[cc.n - 1] += hw.part_s([cc.head])
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
    layer_s = [c.seconds(hw.peak_flops_per_s, hw.mem_bytes_per_s) for stage in cc.stages for c in stage]
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
    - ar: one token through every layer + embedding + head on one device, one program;
    - tp: the same on n devices, every part's FLOPs and bytes split n ways, plus two all-reduces of
      [H] per layer, one for the vocabulary-sharded embedding and one scalar for the head's argmax;
    - pipeline: one token through the n stages in turn, n hops of [H] (the last back to stage 0), and
      the head (per `heads`: a shard after a broadcast of [H], with the argmax's max and min; or whole);
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
    layers = [c for stage in cc.stages for c in stage]
    t_ar = ar_step_s(cfg, hw, context, param_bytes)
    compute = t_ar - hw.launch_s  # the roofline is linear in FLOPs and bytes: split n ways, 1/n of it
    t_tp = (compute / n + hw.launch_s + (2 * len(layers) + 1) * hw.all_reduce_s(cc.hidden_bytes, n)
            + hw.all_reduce_s(SCALAR_BYTES, n))
    if heads == "sharded":  # the plain pipeline's n devices (no PSM device)
        t_head = (hw.part_s([head_cost(cfg, param_bytes, -(-cfg.vocab_size // n))])
                  + hw.all_reduce_s(cc.hidden_bytes, n) + 2 * hw.all_reduce_s(SCALAR_BYTES, n))
    else:
        t_head = hw.part_s([cc.head])
    t_pipe = (sum(hw.part_s(stage) for stage in cc.stages) + cc.embed.seconds(hw.peak_flops_per_s, hw.mem_bytes_per_s)
              + t_head + n * hw.ppermute_s(cc.hidden_bytes))
    busy = _busy_s(cc, hw, heads)
    t_comm = comm_s(cc, hw, heads)
    t_cycle = max(busy) + t_comm
    return dict(
        hardware=hw.name, projection=hw.projection, assumes=hw.assumes, n=n, stage_layers=list(plan.counts),
        heads=heads, psm_device=cc.psm_device, devices=cc.devices, context=context, param_bytes=param_bytes,
        S0=alpha * cfg.num_layers / plan.max_layers,
        alpha=alpha, ar_step_s=t_ar, tp_step_s=t_tp, pipeline_token_s=t_pipe, spd_cycle_s=t_cycle,
        spd_comm_s=t_comm, device_busy_s=busy, imbalance=imbalance(busy),
        speedup_spd=alpha * t_ar / t_cycle, speedup_tp=t_ar / t_tp, speedup_pipeline=t_ar / t_pipe,
        includes="per part: roofline max(FLOPs/peak, bytes/bandwidth) of each layer + one launch; communication "
                 "included (ppermute/all-reduce: link latency + bytes/link bandwidth); spd: busiest device + "
                 "the cycle's collectives (greedy choices); tp: 1/n of the compute + all-reduces; excluded: "
                 "prefill, host transfers, sampling's extra scalar reductions, rollback refills (in alpha)")


def ar_step_s(cfg: ModelConfig, hw: Hardware, context: int, param_bytes: int = 2) -> float:
    """`ar`'s step on one device: one token through the embedding, every layer and the head, one program."""
    return hw.part_s([embed_cost(cfg, param_bytes), *layer_costs(cfg, context, param_bytes, param_bytes),
                      head_cost(cfg, param_bytes)])


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
    The drafter's layer is the target's attention layer with q/k/v (and the gate) reading [2H]."""
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
    [n], psm_ms (the PSM body), psm_head_ms and verify_ms (one vocabulary shard of each head), comm_ms
    (the sharded placement's collectives), context, stage_layers.

    Each measured part is taken as bytes / bandwidth + launch; both unknowns come from a non-negative
    least-squares fit of the part times against their bytes. FLOP/s is not identifiable from decode
    parts (their FLOPs grow with their bytes), so peak is set to the lowest value under which every
    fitted layer stays memory-bound. The link: the fitted bandwidth (host devices share memory) and a
    latency from the measured collectives less their bytes at that bandwidth."""
    plan = StagePlan(tuple(profile["stage_layers"]))
    cc = cycle_costs(cfg, plan, psm_cfg, int(profile["context"]), param_bytes)
    parts = [*cc.stages, (cc.head_shard,), cc.psm_body, (cc.psm_head_shard,)]
    y = 1e-3 * np.array([*profile["stage_ms"], profile["verify_ms"], profile["psm_ms"], profile["psm_head_ms"]])
    x = np.array([sum(c.bytes for c in p) for p in parts], float)
    s_per_byte, launch_s = _nonneg_line_fit(x, y)
    bw = 1.0 / s_per_byte if s_per_byte > 0 else float(np.max(x / y))  # no slope: the fastest part's rate
    peak = bw * max(c.flops / c.bytes for p in parts for c in p if c.bytes)
    coll = collectives(cc, "sharded")
    moved = sum(b if kind == "ppermute" else 2 * (plan.n - 1) / plan.n * b for kind, b in coll)
    latency = max(0.0, (1e-3 * profile["comm_ms"] - moved / bw) / len(coll)) if coll else 0.0
    resid_ms = 1e3 * (y - (x / bw + launch_s))
    return Hardware(
        name, peak_flops_per_s=float(peak), mem_bytes_per_s=float(bw), link_latency_s=float(latency),
        link_bytes_per_s=float(bw), launch_s=float(launch_s), projection=False,
        assumes=f"fitted here from {len(y)} measured parts (n={plan.n} stages, verify shard, PSM body, PSM head "
                f"shard; one jitted call each, incl. host dispatch) as bytes/bandwidth + launch: {bw / 1e9:.1f} "
                f"GB/s, launch {1e6 * launch_s:.0f} us, residuals up to {np.abs(resid_ms).max():.2f} ms; peak "
                f"FLOP/s not identifiable, set to {peak / 1e9:.0f} GFLOP/s (every fitted layer memory-bound); "
                f"link: the fitted bandwidth and {1e6 * latency:.1f} us per collective from comm_ms; on this host "
                "the n devices share its cores, so stages do not really run in parallel")


def _nonneg_line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ~ a x + b with a, b >= 0 (the two-variable active set: the unconstrained fit, else
    the best fit with one of them held at 0)."""
    (a, b), *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), y, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    cands = [(max(0.0, float(x @ y / (x @ x))), 0.0), (0.0, max(0.0, float(y.mean())))]
    return min(cands, key=lambda ab: float(np.sum((y - ab[0] * x - ab[1]) ** 2)))
