"""Bytes per device of each method's placement, from the config alone (no arrays): what `spd`, `tp`, `ar`
and a PSM training step hold on each device once placed, by part, as the code places them today.

- `spd` (`decode.pipelined.place_engine`): every device holds the same shapes (one SPMD program): its
  stage's layers, one buffer per position in a stage's layers of each kind, padded to the most layers of that
  kind in any stage (`pipeline.stages`); the embedding and
  LM head split by vocabulary rows over the D devices where D divides the vocabulary (`heads="rows"`, V / D
  rows each), else whole on every device (`heads="replicated"`), and the final norm (`heads="auto"`, the
  default: what the stage rules do); the PSM's weights, replicated (its head is the target's placed one
  without a draft vocabulary); the stage
  caches, one per position: KV [1, Nkv, S, D] x 2 in the model dtype for each of the most attention layers,
  Gated DeltaNet's conv inputs [1, n, 1, K-1, C] in the model dtype and recurrent states [1, n, 1, Hv, Dk, Dv]
  in float32 (a ring of n saved states, for rollback) for each of the most linear layers; the PSM's KV cache,
  [1, Nkv, S, D] x 2 per layer (the same bytes as stacks: the totals are unchanged).
- `tp` (`methods.tp_runtime`): each leaf's shard under `TP_RULES` (heads that n does not divide stay whole),
  plus the per-layer decode copy of the layers (`decoder.decode_layers`: the layers twice); caches split like
  the KV heads, the Gated DeltaNet states (ring 1) like its heads.
- `ar`: the whole model and its per-layer decode copy, whole caches (ring 1).
- training (`train.step`): the frozen target in the compute dtype split over `model` (`TRAIN_RULES`), the
  PSM's trained weights with their gradient and AdamW's two moments in float32, replicated, its frozen head
  split over `model`; activations are not counted.

Nothing transient is counted (a load's reads, the random PSM's float32 init, XLA's temporaries); on a CPU
host all devices share the host's memory, so a process of D host devices holds D times a device's bytes.
This module computes numbers only: it must not build arrays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import AbstractMesh

from spd_jax.config import ModelConfig
from spd_jax.models import kinds, schema
from spd_jax.models.decoder import CACHE_FIELD
from spd_jax.models.kinds import FULL_ATTENTION, KINDS
from spd_jax.costs.cycle import default_plan
from spd_jax.pipeline.partition import StagePlan
from spd_jax.sharding import MODEL, TP_RULES, TRAIN_RULES, logical_spec

if TYPE_CHECKING:
    from spd_jax.drafters.psm import PSMConfig

GiB = 2**30
# one chip's memory: what a device's total is held against
DEVICE_MEMORY = {"TPU v5e": 16 * GiB, "H100": 80 * GiB}
HEADS = ("auto", "replicated", "rows")  # the embedding and heads: as the stage rules place them, whole, or by rows


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """What one device holds, in bytes, by part."""

    layers: int  # its layers' weights (a stage's stacks; a tensor-parallel shard of every layer, twice)
    heads: int  # embedding, final norm, LM head
    psm: int  # the PSM's weights (trained ones with their gradient and optimiser state in training)
    # the layers' caches, one field per kind, named as `decoder.Cache` names them (`CACHE_FIELD`)
    kv: int  # attention KV cache
    linear: int  # Gated DeltaNet conv inputs and recurrent states (the SPD ring of n of each)
    psm_cache: int  # the PSM's KV cache

    @property
    def weights(self) -> int:
        return self.layers + self.heads + self.psm

    @property
    def caches(self) -> int:
        return self.kv + self.linear + self.psm_cache

    @property
    def total(self) -> int:
        return self.weights + self.caches


def _drafter_kinds():
    """`spd_jax.drafters.registry`, whose kinds' `params` is the one count of each drafter's weights; imported
    when counted (the drafters import Flax, and this module needs none of it otherwise)."""
    from spd_jax.drafters import registry
    return registry


def _caches(cfg: ModelConfig, layers: dict, cache_len: int, ring: int, cache_bytes: int,
            split: dict | None = None) -> dict:
    """The layers' caches by `DeviceBytes` field: layers[kind] layers of each kind (`LayerKind.cache_bytes`),
    split[kind] ways (default whole)."""
    return {CACHE_FIELD[name]: k.cache_bytes(cfg, layers.get(name, 0), cache_len, ring, cache_bytes,
                                             (split or {}).get(name, 1)) for name, k in KINDS.items()}


def heads_bytes(cfg: ModelConfig, param_bytes: int = 2, rows_of: int = 1) -> int:
    """Embedding, final norm and (untied) LM head, each matrix's ceil(V / rows_of) rows."""
    g = schema.global_schema(cfg)
    rows = -(-cfg.vocab_size // rows_of)
    return sum((rows * leaf.shape[1] if leaf.axes[0] == "vocab" else int(np.prod(leaf.shape))) * param_bytes
               for leaf in g.values())


def drafter_params(cfg: ModelConfig, spec) -> int:
    """A drafter's weights, as its kind counts them (`DrafterKind.params`: its module's declared shapes; the
    LM head only where it is its own, a draft vocabulary's or one it trains)."""
    return _drafter_kinds().of_config(spec).params(cfg, spec)


def random_psm(cfg: ModelConfig, plan: StagePlan, num_layers: int = 2) -> "PSMConfig":
    """The random PSM `spd` runs without a trained one (its kind's `random_config`)."""
    return _drafter_kinds().PSM.random_config(cfg, plan, num_layers)


def spd_device_bytes(cfg: ModelConfig, n: int, cache_len: int, param_bytes: int = 2, plan: StagePlan | None = None,
                     psm: "PSMConfig | None" = None, heads: str = "auto", own_device: bool = False) -> DeviceBytes:
    """One device of `spd` at n stages (plan: default `costs.default_plan`) with cache_len positions per cache,
    weights and caches in the model dtype (`param_bytes`); psm: default the random one; own_device: the PSM on
    a device of its own (n + 1 devices, each with the same shapes)."""
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
    plan = default_plan(cfg, n) if plan is None else plan
    psm = random_psm(cfg, plan) if psm is None else psm
    most = {kind: max(cfg.layer_types[a:b].count(kind) for a, b in plan.bounds) for kind in KINDS}
    layers = sum(most[k.name] * k.params(cfg) for k in kinds.of(cfg)) * param_bytes
    psm_w = drafter_params(cfg, psm) * param_bytes + (psm.draft_vocab * 4 if psm.draft_vocab else 0)  # + its ids
    devices = n + own_device
    rows = heads == "rows" or (heads == "auto" and cfg.vocab_size % devices == 0)
    return DeviceBytes(layers, heads_bytes(cfg, param_bytes, devices if rows else 1), psm_w,
                       psm_cache=FULL_ATTENTION.cache_bytes(cfg, psm.num_layers, cache_len, 1, param_bytes),
                       **_caches(cfg, most, cache_len, n, param_bytes))


def _sharded(shape: tuple[int, ...], axes: tuple, rules, mesh: AbstractMesh, units: dict) -> int:
    """Elements of one device's block of an array of `shape` with logical `axes` under rules on mesh."""
    spec = logical_spec(axes, rules, mesh, units)
    return math.prod(-(-d // (mesh.shape[a] if a else 1)) for d, a in zip(shape, (*spec, *(None,) * len(shape))))


def _layers_sharded(cfg: ModelConfig, rules, mesh: AbstractMesh) -> tuple[int, int]:
    """(layer weights, embedding/norm/head) elements on one device under rules."""
    units = schema.axis_units(cfg)
    g = schema.global_schema(cfg)
    heads = sum(_sharded(leaf.shape, leaf.axes, rules, mesh, units) for leaf in g.values())
    layers = sum(cfg.layer_types.count(kind.name) * _sharded(leaf.shape, leaf.axes, rules, mesh, units)
                 for kind in kinds.of(cfg) for leaf in kind.schema(cfg).values())
    return layers, heads


def tp_device_bytes(cfg: ModelConfig, n: int, cache_len: int, param_bytes: int = 2) -> DeviceBytes:
    """One device of `tp` over n devices (n = 1: `ar`): its shards, the layers twice (the per-layer decode copy)."""
    mesh = AbstractMesh((n,), (MODEL,))
    layers, heads = _layers_sharded(cfg, TP_RULES, mesh)
    units = schema.axis_units(cfg)
    # a kind's cache splits n ways where TP_RULES split every axis of its group (`LayerKind.tp_mixer_axes`)
    split = {k.name: n if all(MODEL in tuple(logical_spec((a,), TP_RULES, mesh, units)) for a in k.tp_mixer_axes[1])
             else 1 for k in kinds.of(cfg)}
    return DeviceBytes(2 * layers * param_bytes, heads * param_bytes, 0, psm_cache=0,
                       **_caches(cfg, {k: cfg.layer_types.count(k) for k in KINDS}, cache_len, 1, param_bytes, split))


def ar_device_bytes(cfg: ModelConfig, cache_len: int, param_bytes: int = 2) -> DeviceBytes:
    return tp_device_bytes(cfg, 1, cache_len, param_bytes)


def train_device_bytes(cfg: ModelConfig, spec: "PSMConfig", model_devices: int, compute_bytes: int = 4) -> DeviceBytes:
    """One device of a PSM training step on a data x `model_devices` mesh: the frozen target in the compute
    dtype split over `model`; the PSM's trained weights, their gradient and AdamW's two moments (float32,
    replicated); its frozen head (the compute dtype, split over `model` without a draft vocabulary). No caches;
    activations not counted."""
    mesh = AbstractMesh((1, model_devices), ("data", MODEL))
    layers, heads = _layers_sharded(cfg, TRAIN_RULES, mesh)
    V = spec.draft_vocab or cfg.vocab_size
    head_rows = V if spec.draft_vocab else -(-V // model_devices)
    return DeviceBytes(layers * compute_bytes, heads * compute_bytes,
                       4 * 4 * drafter_params(cfg, spec) + compute_bytes * head_rows * cfg.hidden_size, 0, 0, 0)


def memory_table(names: list[str], ns: list[int], contexts: list[int], param_bytes: int = 2) -> list[dict]:
    """Rows of the docs' table: per config, n and context, one `spd` device's parts in GiB as placed (heads
    split by rows where n divides the vocabulary), and its total were the heads whole on every device, against
    each chip in `DEVICE_MEMORY`."""
    rows = []
    for name in names:
        cfg = ModelConfig.named(name)
        for n in ns:
            for ctx in contexts:
                d = spd_device_bytes(cfg, n, ctx, param_bytes)
                w = spd_device_bytes(cfg, n, ctx, param_bytes, heads="replicated")
                rows.append(dict(config=name, n=n, context=ctx, stage_plan=default_plan(cfg, n).counts,
                                 **{k: v / GiB for k, v in dataclasses.asdict(d).items()},
                                 total=d.total / GiB, total_heads_whole=w.total / GiB,
                                 **{f"fits {chip}": d.total <= b for chip, b in DEVICE_MEMORY.items()}))
    return rows
