"""Per-stage weights, caches and the stage step: what one device of the `stage` mesh axis runs.

Every stage runs the same program (SPMD) over J = max layers per stage "slots". A small per-stage
table says, for each slot, which of the slot's options this device runs (a layer kind and its place in
the stage's layers of that kind, or none: a padded, identity slot for stages with fewer layers) and which
SPD anchor (if any) its output is. So uneven splits and Qwen3.5's mixed layer kinds need no special
program: a slot every device runs alike is a plain call, one whose devices differ a `lax.switch` over its
options (`slot_options`, static).

Layout: one buffer per layer position, as the AR loop keeps them (`decoder.decode_layers`). XLA copies a
layer's slice out of a stacked weight before its matmuls (read, write, read again: 3.3x the bytes of the
layers on the CPU); a buffer of its own is read once, in place. Leading axis n = stages, sharded over
`stage` (with the PSM on a device of its own, n + 1 rows, the last one a device without layers):
    weights  {kind: (one {leaf: [n, ...]} per position i in a stage's layers of that kind)}  (zero padded)
    caches   {kind: (one per position i)}: KVCache k/v [n, B, Nkv, S, D]; a one-layer LinearState ring
             conv [n, 1, R, B, K-1, C], ssm [n, 1, R, B, Hv, Dk, Dv]
    program  branch / anchor_id [n, J] int32
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models import schema
from spd_jax.models.kinds import KINDS
from spd_jax.models.layers import rope_cos_sin
from spd_jax.pipeline.partition import StagePlan


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Static shape facts of a model split by a plan (hashable: a jit static argument)."""

    plan: StagePlan
    max_per_kind: tuple[tuple[str, int], ...]  # (kind, max layers of that kind in one stage)
    anchors: tuple[int, ...]
    devices: int  # rows of every stage buffer: plan.n, or plan.n + 1 with the PSM on a device of its own

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


def _device_options(cfg: ModelConfig, layout: StageLayout) -> list[list[tuple[str, int] | None]]:
    """[devices][J]: what each device runs at slot j: (kind, i), the i-th layer of that kind in its stage, or
    None (an empty slot; every slot of a device of its own for the PSM)."""
    out = []
    for s in range(layout.devices):
        a, b = layout.plan.bounds[s] if s < layout.plan.n else (0, 0)
        seen = {k: 0 for k in KINDS}
        row = []
        for j in range(layout.slots):
            if j < b - a:
                kind = cfg.layer_types[a + j]
                row.append((kind, seen[kind]))
                seen[kind] += 1
            else:
                row.append(None)
        out.append(row)
    return out


def slot_options(cfg: ModelConfig, layout: StageLayout) -> tuple[tuple[tuple[str, int] | None, ...], ...]:
    """Per slot j, what the devices run there, in device order of first use: (kind, i) or None (an empty slot).
    Static: the stage program's branches."""
    per_device = _device_options(cfg, layout)
    return tuple(tuple(dict.fromkeys(row[j] for row in per_device)) for j in range(layout.slots))


def program(cfg: ModelConfig, layout: StageLayout) -> dict[str, np.ndarray]:
    """Per-device slot tables [n, J]: branch (which of `slot_options`' options the device runs at slot j) and
    anchor_id (a if the slot's output is h_{b_a}, else -1)."""
    options = slot_options(cfg, layout)
    per_device = _device_options(cfg, layout)
    branch = np.asarray([[options[j].index(o) for j, o in enumerate(row)] for row in per_device], np.int32)
    anchor_id = np.full(branch.shape, -1, np.int32)
    for s, (a, b) in enumerate(layout.plan.bounds):
        for j, layer in enumerate(range(a, b)):
            if layer + 1 in layout.anchors:  # h_{layer+1} is the output of this layer
                anchor_id[s, j] = layout.anchors.index(layer + 1)
    return dict(branch=branch, anchor_id=anchor_id.reshape(layout.devices, layout.slots))


def stage_layer_ids(cfg: ModelConfig, layout: StageLayout) -> dict[str, np.ndarray]:
    """{kind: [n, max_k] int32}: the model layer each stage holds at position i of its layers of that kind, -1 for
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
    """Logical axes of the stage weights: ("stage", *the leaf's axes), per kind and position."""
    return {kind: tuple({k: ("stage", *leaf.axes) for k, leaf in schema.layer_schema(cfg, kind).items()}
                        for _ in range(m)) for kind, m in layout.max_per_kind}


def stack_stage_weights(layers: dict, cfg: ModelConfig, layout: StageLayout) -> dict:
    """Model-order per-kind stacks -> the stage weights: {kind: ({leaf: [n, ...]} per position)}, each stage's
    layers, zero padded."""
    out = {}
    for kind, ids in stage_layer_ids(cfg, layout).items():
        # model layer index -> index in the per-kind stack
        pos = np.cumsum([k == kind for k in cfg.layer_types]) - 1
        per = []
        for i in range(ids.shape[1]):
            idx = jnp.asarray(np.where(ids[:, i] >= 0, pos[np.maximum(ids[:, i], 0)], 0))
            keep = jnp.asarray(ids[:, i] >= 0)
            per.append(jax.tree.map(lambda t: jnp.where(keep.reshape(-1, *(1,) * (t.ndim - 1)), t[idx],
                                                        jnp.zeros((), t.dtype)), layers[kind]))
        out[kind] = tuple(per)
    return out


def load_stage_weights(reader, cfg: ModelConfig, layout: StageLayout, placement, dtype) -> dict:
    """The stage weights read straight from a checkpoint (`convert.hf.CheckpointReader`), each placed
    with its sharding under `placement` (stage rules): device s reads and holds only stage s's layers."""
    ids = stage_layer_ids(cfg, layout)
    shardings = placement.shardings(stage_weight_axes(cfg, layout))
    np_dtype = jnp.dtype(dtype)
    return {kind: tuple({k: jax.make_array_from_callback(
        (ids[kind].shape[0], *leaf.shape), shardings[kind][i][k],
        lambda ix, kind=kind, k=k, i=i: reader.read_stack(kind, k, ids[kind][:, i], ix, np_dtype))
        for k, leaf in schema.layer_schema(cfg, kind).items()} for i in range(ids[kind].shape[1]))
        for kind in ids}


def init_stage_caches(cfg: ModelConfig, layout: StageLayout, batch: int, max_len: int, ring: int,
                      dtype) -> dict:
    """Caches of every stage, leading axis n (layout.devices): {kind: (one per position)}."""
    n = layout.devices

    def one(kind):  # one layer's own cache (`LayerKind.layer_cache` of a stack of one)
        return KINDS[kind].layer_cache(KINDS[kind].init_cache(cfg, 1, batch, max_len, ring, dtype), 0)

    return {kind: tuple(jax.tree.map(lambda t: jnp.broadcast_to(t, (n, *t.shape)), one(kind)) for _ in range(m))
            for kind, m in layout.max_per_kind}


def stage_forward(weights: dict, cache: dict, prog: dict, x: jax.Array, pos: jax.Array,
                  cfg: ModelConfig, layout: StageLayout, length: jax.Array | None = None):
    """Run this device's stage on x [B, T, H] at positions [pos, pos+T) (`length` of them real: a padded
    prompt; default T).

    weights/cache/prog: this stage's (no leading n axis). Returns (x, cache, anchors [m, B, T, H]) where
    anchors[a] is h_{b_a} if this stage produced it (zeros otherwise; anchor 0, the embedding, never).
    """
    B, T, _ = x.shape
    m = len(layout.anchors)
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(T))
    anchors = jnp.zeros((m, B, T, x.shape[-1]), x.dtype)

    def run(option, x, c):
        """One option of a slot on its own buffers: (x, its cache) -> (x, its cache)."""
        if option is None:
            return x, c
        kind, i = option
        return KINDS[kind].block(weights[kind][i], x, c, pos, cos, sin, cfg, length)

    for j, options in enumerate(slot_options(cfg, layout)):
        held = [o for o in options if o is not None]  # the caches this slot's options touch
        mine = tuple(cache[k][i] for k, i in held)
        if len(options) == 1:
            x, mine = run(options[0], x, mine[0] if mine else None)
            mine = (mine,) if held else ()
        else:
            def branch(o):
                def fn(x, mine):
                    if o is None:
                        return x, mine
                    at = held.index(o)
                    x, c = run(o, x, mine[at])
                    return x, (*mine[:at], c, *mine[at + 1:])
                return fn

            x, mine = jax.lax.switch(prog["branch"][j], [branch(o) for o in options], x, mine)
        cache = {k: tuple(mine[held.index((k, i))] if (k, i) in held else c for i, c in enumerate(cs))
                 for k, cs in cache.items()}
        hit = jnp.arange(m) == prog["anchor_id"][j]
        anchors = jnp.where(hit[:, None, None, None], x[None], anchors)
    return x, cache, anchors
