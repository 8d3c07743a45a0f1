"""The baselines' steps on the cost model's terms: `ar` (one device), `tp` (one step over n devices as
`sharding.TP_RULES` places the model, with its all-reduces) and one round of the EAGLE-3-style chain
(`predict_eagle3`), each counted from FLOPs and bytes per part like the SPD cycle in
`spd_jax.costs.cycle`, which builds on `tp_layer_cost` for stages split over a `model` axis.
Numbers only: nothing runs or compiles here.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models import schema
from spd_jax.models.costs import LayerCost, embed_cost, head_cost, kind_cost, layer_costs
from spd_jax.costs.hardware import Hardware
from spd_jax.models.kinds import KINDS
from spd_jax.sharding import MODEL, TP_RULES, logical_spec

SCALAR_BYTES = 4  # an int32 / float32 decision value


def _drafter_kinds():
    """`spd_jax.drafters.registry`, whose kinds' `cost` is the one count of each drafter's draft; imported
    when counted (the drafters import Flax, and this module needs none of it otherwise)."""
    from spd_jax.drafters import registry
    return registry


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
    heads, _ = tp_mixer_split(cfg, kind, n)
    rest = (full.flops - full_mm) / (n if heads else 1)  # the mixer's context or state FLOPs
    return LayerCost(kind, full.params, int(mm_flops + rest), int(weights * param_bytes),
                     tp_state_share(cfg, kind, context, n, cache_bytes, full.state_bytes)), all_reduces


def tp_mixer_split(cfg: ModelConfig, kind: str, n: int) -> tuple[bool, bool]:
    """(the mixer's heads split, its cache split) under n-way `TP_RULES`: each where every axis of the kind's
    group is split (`tp_mixer_axes`: attention's query and KV heads; Gated DeltaNet's conv channels by key-head
    group and its value heads)."""
    units = schema.axis_units(cfg)
    heads, kv = (all(MODEL in _tp_split((axis,), n, units) for axis in group) for group in KINDS[kind].tp_mixer_axes)
    return heads, kv


def tp_state_share(cfg: ModelConfig, kind: str, context: int, n: int, cache_bytes: int, state_bytes: int) -> int:
    """One device's share of a layer's `state_bytes` (its cache, then attention's scores over its rows) under
    n-way tensor parallelism: the cache splits with the KV heads, the scores ([Nq, rows, context]) with the
    query heads."""
    heads, kv = tp_mixer_split(cfg, kind, n)
    cache = KINDS[kind].state_bytes(cfg, context, cache_bytes)
    return int(cache / (n if kv else 1) + (state_bytes - cache) / (n if heads else 1))


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
    nodes = hw.nodes(n)  # a `model` axis wider than a node spans nodes
    comm = (hidden * hw.all_reduce_s(cfg.hidden_size * param_bytes, n, nodes)
            + vocab * hw.all_reduce_s(2 * SCALAR_BYTES, n, nodes))
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
    H, rows, pb = cfg.hidden_size, k + 1, param_bytes
    kind = _drafter_kinds().EAGLE3
    # the default feature layers, over a draft vocabulary of draft_vocab rows (0 or V: the whole)
    spec = dataclasses.replace(kind.random_config(cfg), draft_vocab=0 if draft_vocab == cfg.vocab_size else draft_vocab)
    m, cost = len(spec.layers), kind.cost
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
