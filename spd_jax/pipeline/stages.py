"""Per-stage weights, caches and the stage step: what one device of the `stage` mesh axis runs.

Every stage runs the same program (SPMD) over J = max layers per stage "slots". A small per-stage
table says, for each slot, which layer kind it is (or none: a padded, identity slot for stages with
fewer layers), where that layer sits in the stage's stack of that kind, and which SPD anchor (if any)
its output is. So uneven splits and Qwen3.5's mixed layer kinds need no special program: each device
indexes its own weights, and `lax.switch` picks the kind at run time.

Layout (leading axis n = stages, sharded over `stage`; with the PSM on a device of its own, n + 1 rows,
the last one a device without layers: every slot empty, zero-size work):
    weights  {kind: [n, max layers of that kind in a stage, ...]}   (zero padded)
    caches   Cache(kv [n, max_attn, B, Nkv, S, D], linear ring [n, max_linear, R, ...])
    program  kind_id / kind_index / anchor_id [n, J] int32
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.models import decoder, schema
from spd_jax.models.attention import KVCache
from spd_jax.models.deltanet import LinearState
from spd_jax.models.layers import rope_cos_sin
from spd_jax.pipeline.partition import StagePlan

KINDS = (ATTENTION, LINEAR)  # kind_id 0, 1; 2 = empty slot


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Static shape facts of a model split by a plan (hashable: a jit static argument)."""

    plan: StagePlan
    max_per_kind: tuple[tuple[str, int], ...]  # (kind, max layers of that kind in one stage)
    anchors: tuple[int, ...]
    devices: int  # rows of every stage stack: plan.n, or plan.n + 1 with the PSM on a device of its own

    @classmethod
    def of(cls, cfg: ModelConfig, plan: StagePlan, anchors: tuple[int, ...],
           devices: int | None = None) -> "StageLayout":
        if plan.num_layers != cfg.num_layers:
            raise ValueError(f"stage plan covers {plan.num_layers} layers, the model has {cfg.num_layers}")
        mx = []
        for kind in KINDS:
            m = max(cfg.layer_types[a:b].count(kind) for a, b in plan.bounds)
            if m:
                mx.append((kind, m))
        devices = plan.n if devices is None else devices
        if devices not in (plan.n, plan.n + 1):
            raise ValueError(f"{devices} devices for {plan.n} stages: n, or n + 1 with the PSM on its own device")
        return cls(plan, tuple(mx), anchors, devices)

    @property
    def slots(self) -> int:
        return self.plan.max_layers

    def count(self, kind: str) -> int:
        return dict(self.max_per_kind).get(kind, 0)


def program(cfg: ModelConfig, layout: StageLayout) -> dict[str, np.ndarray]:
    """Per-stage slot tables [n, J]: kind_id (0 attention, 1 linear, 2 empty), kind_index (position
    in the stage's stack of that kind) and anchor_id (a if the slot's output is h_{b_a}, else -1)."""
    n, J = layout.devices, layout.slots
    kind_id = np.full((n, J), len(KINDS), np.int32)
    kind_index = np.zeros((n, J), np.int32)
    anchor_id = np.full((n, J), -1, np.int32)
    for s, (a, b) in enumerate(layout.plan.bounds):
        seen = {k: 0 for k in KINDS}
        for j, layer in enumerate(range(a, b)):
            kind = cfg.layer_types[layer]
            kind_id[s, j] = KINDS.index(kind)
            kind_index[s, j] = seen[kind]
            seen[kind] += 1
            if layer + 1 in layout.anchors:  # h_{layer+1} is the output of this layer
                anchor_id[s, j] = layout.anchors.index(layer + 1)
    return dict(kind_id=kind_id, kind_index=kind_index, anchor_id=anchor_id)


def stage_layer_ids(cfg: ModelConfig, layout: StageLayout) -> dict[str, np.ndarray]:
    """{kind: [n, max_k] int32}: the model layer held in each stage's slot of that kind's stack, -1 for
    a zero-padded slot. The one statement of which device holds which layer."""
    out = {}
    for kind, mx in layout.max_per_kind:
        ids = np.full((layout.devices, mx), -1, np.int32)
        for s, (a, b) in enumerate(layout.plan.bounds):
            mine = [i for i in range(a, b) if cfg.layer_types[i] == kind]
            ids[s, :len(mine)] = mine
        out[kind] = ids
    return out


def stage_weight_axes(cfg: ModelConfig, layout: StageLayout) -> dict:
    """Logical axes of the stage stacks: ("stage", "layers", *the leaf's axes)."""
    return {kind: {k: ("stage", "layers", *leaf.axes) for k, leaf in schema.layer_schema(cfg, kind).items()}
            for kind, _ in layout.max_per_kind}


def stack_stage_weights(layers: dict, cfg: ModelConfig, layout: StageLayout) -> dict:
    """Model-order per-kind stacks -> {kind: [n, max_k, ...]} with each stage's layers, zero padded."""
    out = {}
    for kind, ids in stage_layer_ids(cfg, layout).items():
        # model layer index -> index in the per-kind stack
        pos = np.cumsum([k == kind for k in cfg.layer_types]) - 1
        idx = jnp.asarray(np.where(ids >= 0, pos[np.maximum(ids, 0)], 0))
        keep = jnp.asarray(ids >= 0)
        out[kind] = jax.tree.map(
            lambda t: jnp.where(keep.reshape(*keep.shape, *(1,) * (t.ndim - 1)), t[idx], jnp.zeros((), t.dtype)),
            layers[kind])
    return out


def load_stage_weights(reader, cfg: ModelConfig, layout: StageLayout, placement, dtype) -> dict:
    """The stage stacks read straight from a checkpoint (`convert.hf.CheckpointReader`), each placed
    with its sharding under `placement` (stage rules): device s reads and holds only stage s's layers."""
    ids = stage_layer_ids(cfg, layout)
    shardings = placement.shardings(stage_weight_axes(cfg, layout))
    np_dtype = jnp.dtype(dtype)
    return {kind: {k: jax.make_array_from_callback(
        (*ids[kind].shape, *leaf.shape), shardings[kind][k],
        lambda ix, kind=kind, k=k: reader.read_stack(kind, k, ids[kind], ix, np_dtype))
        for k, leaf in schema.layer_schema(cfg, kind).items()} for kind in ids}


def init_stage_caches(cfg: ModelConfig, layout: StageLayout, batch: int, max_len: int, ring: int,
                      dtype) -> decoder.Cache:
    """Caches of every stage, leading axis n (layout.devices)."""
    n = layout.devices
    kinds = tuple(k for k, m in layout.max_per_kind for _ in range(m))
    one = decoder.init_cache(cfg, batch, max_len, dtype, ring=ring, kinds=kinds)
    return jax.tree.map(lambda t: jnp.broadcast_to(t, (n, *t.shape)), one)


def stage_forward(weights: dict, cache: decoder.Cache, prog: dict, x: jax.Array, pos: jax.Array,
                  cfg: ModelConfig, layout: StageLayout, length: jax.Array | None = None):
    """Run this device's stage on x [B, T, H] at positions [pos, pos+T).

    weights/cache/prog: this stage's (no leading n axis). Returns (x, cache, anchors [m, B, T, H]) where
    anchors[a] is h_{b_a} if this stage produced it (zeros otherwise; anchor 0, the embedding, never).
    """
    B, T, _ = x.shape
    m = len(layout.anchors)
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(T))
    anchors = jnp.zeros((m, B, T, x.shape[-1]), x.dtype)

    def attn_branch(idx, x, cache):
        lp = jax.tree.map(lambda t: t[idx], weights[ATTENTION])
        kv = cache.kv
        x, k_new, v_new = decoder.attention_layer(lp, x, kv.k[idx], kv.v[idx], pos, cos, sin, cfg)
        kv = KVCache(jax.lax.dynamic_update_slice(kv.k, k_new[None], (idx, 0, 0, pos, 0)),
                     jax.lax.dynamic_update_slice(kv.v, v_new[None], (idx, 0, 0, pos, 0)))
        return x, decoder.Cache(kv, cache.linear)

    def linear_branch(idx, x, cache):
        lp = jax.tree.map(lambda t: t[idx], weights[LINEAR])
        lin = cache.linear
        R = lin.depth
        slot_in = (pos - 1) % R
        fresh = pos == 0
        conv_prev = jnp.where(fresh, 0, lin.conv[idx, slot_in]).astype(lin.conv.dtype)
        s_prev = jnp.where(fresh, 0.0, lin.ssm[idx, slot_in])
        x, conv_new, s_new = decoder.linear_layer(lp, x, conv_prev, s_prev, length, cfg)
        slot_out = (pos + (T if length is None else length) - 1) % R
        lin = LinearState(
            jax.lax.dynamic_update_slice(lin.conv, conv_new[None, None].astype(lin.conv.dtype),
                                         (idx, slot_out, 0, 0, 0)),
            jax.lax.dynamic_update_slice(lin.ssm, s_new[None, None], (idx, slot_out, 0, 0, 0, 0)))
        return x, decoder.Cache(cache.kv, lin)

    def empty(idx, x, cache):
        return x, cache

    branches = [attn_branch if k == ATTENTION else linear_branch for k in KINDS]
    branches = [b if layout.count(k) else empty for b, k in zip(branches, KINDS)] + [empty]
    for j in range(layout.slots):
        x, cache = jax.lax.switch(prog["kind_id"][j], branches, prog["kind_index"][j], x, cache)
        hit = jnp.arange(m) == prog["anchor_id"][j]
        anchors = jnp.where(hit[:, None, None, None], x[None], anchors)
    return x, cache, anchors
