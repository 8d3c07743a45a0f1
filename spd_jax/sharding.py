"""Meshes and the sharding rules tables: logical axes (declared once, in `spd_jax.models.schema`) ->
mesh axes, one table per parallelism.

Mesh axes: `stage` (pipeline: one device per stage), `model` (tensor parallel), `data` (batch).
A rules table maps a logical axis name to a mesh axis; unnamed axes stay replicated. An axis is
split only when the mesh axis's size divides its unit count (`schema.axis_units`): SmolLM2's 9 query /
3 KV heads are split 3 ways but replicated on 2, 4 or 8 devices, while its MLP columns and vocabulary
are split on any of them. Flax modules (the PSM) carry the same logical names through
`nn.with_logical_partitioning`, so one table covers the target and the PSM.

On a CPU-only machine the host devices are requested here too (before JAX initialises).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

STAGE, MODEL, DATA = "stage", "model", "data"

Rules = tuple[tuple[str, str], ...]  # (logical axis, mesh axis); hashable, so a jit static argument

# Pipeline: stage-stacked weights, caches and programs carry a leading "stage" logical axis; the embedding and
# LM head are split by vocabulary rows over the same devices (each computes its rows' logits and looks up the
# rows it holds: decode.spd), where their count divides the vocabulary.
STAGE_RULES: Rules = (("stage", STAGE), ("vocab", STAGE))
# Tensor parallel (Megatron-style): attention heads and MLP columns split, so the attention-out and
# MLP-down matmuls contract over a split axis and end in one all-reduce each; the vocabulary split
# for the embedding and the LM head (logits stay split until the argmax / sampling reduces them).
# Gated DeltaNet mixers split by heads as attention's are: their q|k|v conv channels grouped by key head
# (`schema.qkv_groups`), the value heads' projections, gates and state with them, the output projection
# contracting over the split heads.
TP_RULES: Rules = (("q_heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL), ("vocab", MODEL), ("conv", MODEL),
                   ("v_heads", MODEL))
# Pipeline stages, each tensor-parallel over `model` (a `stage x model` mesh): the stage stacks split over both
# (layers by stage, heads and MLP columns by model, as TP_RULES split them); the embedding and heads keep their
# vocabulary rows split over `stage` only (the engine's vocabulary-parallel heads are collectives over `stage`).
STAGE_TP_RULES: Rules = STAGE_RULES + tuple(r for r in TP_RULES if r[0] != "vocab")
# Data parallel: the batch split, weights replicated.
DP_RULES: Rules = (("batch", DATA),)
# PSM training on a `data x model` mesh: batches split over `data`, the frozen target split over
# `model` as in tensor-parallel decoding.
TRAIN_RULES: Rules = DP_RULES + TP_RULES


def logical_spec(axes: tuple[str | None, ...], rules: Rules, mesh: Mesh | None = None,
                 units: Mapping[str, int] | None = None) -> P:
    """Logical axes of one array -> its PartitionSpec under `rules`. With mesh and units, an axis
    whose unit count the mesh axis does not divide stays replicated; a mesh axis is used at most once."""
    table, used, out = dict(rules), set(), []
    for name in axes:
        mesh_axis = table.get(name) if name is not None else None
        if mesh_axis is not None and mesh is not None and units is not None and name in units:
            if units[name] % mesh.shape[mesh_axis] != 0:
                mesh_axis = None
        if mesh_axis in used:
            mesh_axis = None
        if mesh_axis is not None:
            used.add(mesh_axis)
        out.append(mesh_axis)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_specs(axes_tree: Any, rules: Rules, mesh: Mesh | None = None, units: Mapping[str, int] | None = None):
    """A pytree of logical-axes tuples -> the same pytree of PartitionSpecs."""
    return jax.tree.map(lambda a: logical_spec(a, rules, mesh, units), axes_tree, is_leaf=_is_axes)


def tree_shardings(axes_tree: Any, mesh: Mesh, rules: Rules, units: Mapping[str, int] | None = None):
    """A pytree of logical-axes tuples -> the same pytree of NamedShardings on mesh."""
    return jax.tree.map(lambda a: NamedSharding(mesh, logical_spec(a, rules, mesh, units)), axes_tree,
                        is_leaf=_is_axes)


def _varying(x) -> frozenset:
    # JAX 0.10 keeps the set of manual axes a value varies over on its aval's manual_axis_type
    # (empty outside shard_map)
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else aval.vma  # .vma: the name before JAX 0.10


def vary(tree: Any, axis: str) -> Any:
    """Inside `shard_map`: mark every leaf of tree as varying over `axis` (a no-op for leaves that
    already are). Branches of `lax.cond`/`switch` and loop carries must agree on this type, so a
    replicated value meeting a per-device one there is cast first."""
    return jax.tree.map(lambda x: x if axis in _varying(x) else jax.lax.pcast(x, axis, to="varying"), tree)


def put(tree: Any, shardings: Any) -> Any:
    """`jax.device_put` that also works when the shardings span several processes: there a value held
    by this process's devices alone (e.g. loaded on its default device) cannot move to another
    process's devices, so it goes through host memory, each process giving the same value and
    keeping only its own devices' shards. shardings: one sharding for every leaf, or a matching tree."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        if isinstance(x, jax.Array) and x.is_fully_addressable and not s.is_fully_addressable:
            x = np.asarray(x)
        return jax.device_put(x, s)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


# ---------------------------------------------------------------- meshes


def parse_mesh(spec: str) -> tuple[int, int]:
    """"8x1" -> (8, 1): data-parallel x model-parallel device counts."""
    try:
        d, m = (int(p) for p in str(spec).lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must look like DATAxMODEL, e.g. 8x1 or 4x2; got {spec!r}") from None
    if d < 1 or m < 1:
        raise ValueError(f"--mesh sizes must be positive, got {spec!r}")
    return d, m


def request_cpu_devices(n: int) -> None:
    """Ask for n host (CPU) devices. Must run before JAX initialises its backends; it changes nothing on
    GPU/TPU backends, whose devices are real."""
    jax.config.update("jax_num_cpu_devices", max(int(n), 1))


def _devices(count: int, what: str, flag: str) -> list:
    devices = jax.devices()
    if count > len(devices):
        raise ValueError(
            f"{what}: need {count} devices, but JAX sees {len(devices)} ({jax.default_backend()}). On a CPU-only "
            f"machine, set XLA_FLAGS=--xla_force_host_platform_device_count={count} or call "
            f"jax.config.update('jax_num_cpu_devices', {count}) before JAX initialises ({flag} does this "
            f"itself); elsewhere pick sizes that fit the devices present")
    return devices[:count]


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], what: str = "this mesh",
              flag: str = "the CLI") -> Mesh:
    """A mesh of the first prod(shape) devices with Auto axes: jit propagates the shardings given at
    the inputs and inserts the collectives; shard_map bodies see per-device blocks."""
    n = int(np.prod(shape))
    devs = np.asarray(_devices(n, what, flag)).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def data_model_mesh(data: int, model: int) -> Mesh:
    """The training mesh: (data, model)."""
    return make_mesh((data, model), (DATA, MODEL), f"--mesh {data}x{model}", "train.main")


def stage_mesh(n: int) -> Mesh:
    """The pipeline mesh: n devices along `stage`."""
    return make_mesh((n,), (STAGE,), f"n={n} pipeline stages", f"python -m infer.generate --n {n}")


def model_mesh(n: int) -> Mesh:
    """The tensor-parallel mesh: n devices along `model`."""
    return make_mesh((n,), (MODEL,), f"tensor parallelism over {n} devices", f"python -m infer.generate --n {n}")


def stage_model_mesh(stages: int, model: int) -> Mesh:
    """Pipeline stages, each tensor-parallel over `model` devices."""
    return make_mesh((stages, model), (STAGE, MODEL), f"{stages} stages x {model}-way tensor parallelism")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh with a rules table and the model's axis units: hashable, so jitted functions take it as
    a static argument and pin intermediate values (caches) to their logical shardings."""

    mesh: Mesh
    rules: Rules
    units: tuple[tuple[str, int], ...] = ()

    def shardings(self, axes_tree: Any):
        return tree_shardings(axes_tree, self.mesh, self.rules, dict(self.units))

    def constrain(self, tree: Any, axes_tree: Any):
        """with_sharding_constraint of tree's leaves to their logical axes' shardings."""
        return jax.lax.with_sharding_constraint(tree, self.shardings(axes_tree))

    def put(self, tree: Any, axes_tree: Any):
        return put(tree, self.shardings(axes_tree))
