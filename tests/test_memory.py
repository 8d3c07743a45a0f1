"""The memory planner (`spd_jax.costs.memory`) against the arrays the engine really places: bytes per
device, part by part, on host devices."""

from __future__ import annotations

import jax
import pytest

import spd_jax
from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.convert.random import write_random_checkpoint
from spd_jax.decode import pipelined
from spd_jax import methods
from spd_jax.methods import tp_runtime
from spd_jax.costs import memory
from spd_jax.pipeline import stages
from spd_jax.sharding import STAGE_RULES, TP_RULES, model_mesh, stage_mesh


def on_device(tree, device, skip=()) -> int:
    """Bytes of tree's shards held by device (leaves that are `skip`'s arrays not counted)."""
    skip_ids = {id(a) for a in jax.tree.leaves(skip)}
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) if id(a) not in skip_ids
               for s in a.addressable_shards if s.device == device)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint("tiny-qwen3_5", tmp_path_factory.mktemp("tiny_qwen3_5_random"),
                                   max_shard_bytes=100_000)


@pytest.mark.parametrize("n,placement", [(3, "last"), (4, "own")])
def test_spd_bytes_per_device_equal_the_placed_arrays(ckpt, n, placement):
    mesh_n = n + (placement == "own")
    model = spd_jax.load_model(ckpt, dtype="bfloat16", mesh=stage_mesh(mesh_n), rules=STAGE_RULES)
    plan = pipelined.plan_for(model, n)
    draft = pipelined.engine_draft(model, plan, methods.SPD(n=plan.n, spec="random"))
    psm_device = pipelined.psm_device_for(model, plan, draft.spec, placement)
    layout = stages.StageLayout.of(model.config, plan, draft.drafter.anchors, devices=plan.n + (psm_device == plan.n))
    cache_len = pipelined.engine_cache_len(40, 16, n)
    placed = pipelined.place_engine(model, layout, draft, stage_mesh(layout.devices), 40, cache_len)
    want = memory.spd_device_bytes(model.config, n, cache_len, 2, plan=plan, psm=draft.spec,
                                   own_device=placement == "own")
    for d in stage_mesh(layout.devices).devices.flat:  # every device: the same shapes
        got = memory.DeviceBytes(on_device(placed.stage_w, d), on_device(placed.shared, d),
                                 on_device(placed.dparams, d, skip=placed.shared), on_device(placed.caches.get(ATTENTION, ()), d),
                                 on_device(placed.caches.get(LINEAR, ()), d), on_device(placed.dstate, d))
        assert got == want, d


@pytest.mark.parametrize("n", [1, 4])
def test_tp_and_ar_bytes_per_device_equal_the_placed_arrays(ckpt, n):
    model = spd_jax.load_model(ckpt, dtype="bfloat16", mesh=model_mesh(n), rules=TP_RULES)
    params, layers, _ = tp_runtime(model, n)
    want = memory.tp_device_bytes(model.config, n, 128, 2)
    for d in model_mesh(n).devices.flat:
        assert on_device((params["layers"], layers), d) == want.layers
        assert on_device({k: v for k, v in params.items() if k != "layers"}, d) == want.heads


def test_rows_split_the_heads_and_the_table_covers_both_chips():
    cfg = ModelConfig.named("qwen3.5-4b")
    whole = memory.spd_device_bytes(cfg, 8, 4096, heads="replicated")
    rows = memory.spd_device_bytes(cfg, 8, 4096)  # 8 divides 248,320: split by rows
    assert whole.heads == cfg.vocab_size * cfg.hidden_size * 2 + cfg.hidden_size * 2  # tied: one [V, H]
    assert rows.heads == cfg.vocab_size // 8 * cfg.hidden_size * 2 + cfg.hidden_size * 2
    assert rows.total == whole.total - (whole.heads - rows.heads)
    assert memory.spd_device_bytes(cfg, 8, 4096, own_device=True).heads == whole.heads  # 9 does not divide V
    table = memory.memory_table(["qwen3.5-4b"], [8], [4096])
    assert table[0]["total"] * memory.GiB == pytest.approx(rows.total)
    assert table[0]["total_heads_whole"] * memory.GiB == pytest.approx(whole.total)
    assert set(k for k in table[0] if k.startswith("fits")) == {f"fits {c}" for c in memory.DEVICE_MEMORY}


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-llama"])
def test_drafter_params_are_the_real_drafters_weights(name):
    """The memory model's drafter weights (`DrafterKind.params`) equal the parameters of a real drafter made by
    its kind's init, for each kind and each option that adds weights: the PSM's anchor gains, q/k norms, a
    draft vocabulary's head and its own head; EAGLE-3's and PPSD's draft vocabulary. A head that is the
    target's (a shared one, no draft vocabulary) is not the drafter's."""
    import dataclasses

    import numpy as np

    from spd_jax.costs.cycle import default_plan
    from spd_jax.drafters import registry
    from spd_jax.models.schema import init_params

    cfg = ModelConfig.named(name)
    plan = default_plan(cfg, 2)
    target = init_params(cfg, jax.random.key(0))
    psm = registry.PSM.random_config(cfg, plan, 2)
    cases = [(registry.PSM, psm), (registry.PSM, dataclasses.replace(psm, anchor_norm=True, qk_norm=True)),
             (registry.PSM, dataclasses.replace(psm, draft_vocab=40)), (registry.PSM, dataclasses.replace(psm, own_head=True))]
    for kind in (registry.EAGLE3, registry.PPSD):
        spec = kind.random_config(cfg, plan, 1)
        cases += [(kind, spec), (kind, dataclasses.replace(spec, draft_vocab=40))]
    for kind, spec in cases:
        ids = np.arange(spec.draft_vocab) * 3 if spec.draft_vocab else None
        params = kind.init(cfg, spec, target, 0, vocab_ids=ids)["params"]
        own = spec.draft_vocab or getattr(spec, "own_head", False)
        held = sum(x.size for k, v in params.items() if k != "lm_head" or own for x in jax.tree.leaves(v))
        assert memory.drafter_params(cfg, spec) == kind.params(cfg, spec) == held, (kind, spec)


def test_a_random_psm_is_made_in_its_dtype_without_a_random_head():
    """The random PSM `spd` runs at Qwen3.5-4B's size, compiled from shapes alone: its programs make the body in
    bfloat16 and no [V, H] head (the target's replaces it), one top-level leaf per program, so no program's
    temporaries exceed a few times its leaf's float32 bytes. Before: 3.8 GB of outputs (the body and a random head
    in float32) and 9.6 GB of temporaries; then one program of the body, 2.7 GB of temporaries in every process."""
    import jax.numpy as jnp

    from spd_jax.drafters.psm.kind import _init_boxed
    from spd_jax.drafters.shared import _random_leaves
    from spd_jax.costs.cycle import default_plan

    cfg = ModelConfig.named("qwen3.5-4b")
    spec = memory.random_psm(cfg, default_plan(cfg, 8))
    shapes = jax.eval_shape(lambda: _init_boxed(cfg, spec, 0))["params"]
    out = temp = 0
    for name in [k for k in shapes if k != "lm_head"]:
        made = _random_leaves.lower(_init_boxed, cfg, spec, 0, jnp.dtype("bfloat16"), (name,)).compile().memory_analysis()
        leaf = sum(t.size for t in jax.tree.leaves(shapes[name]))
        out += made.output_size_in_bytes
        assert made.temp_size_in_bytes <= 5 * 4 * leaf + (1 << 20), name  # its float32 values and random bits
        temp = max(temp, made.temp_size_in_bytes)
    assert out == pytest.approx(memory.drafter_params(cfg, spec) * 2, rel=1e-4)  # + a pointer table per program
    assert temp < 0.8e9


def test_a_large_random_drafter_made_leaf_by_leaf_equals_one_program(monkeypatch):
    import jax.numpy as jnp

    from spd_jax.drafters import shared
    from spd_jax.drafters.psm.kind import _init_boxed
    from spd_jax.drafters.psm import PSMConfig

    cfg = ModelConfig.named("tiny-qwen3_5")
    spec = PSMConfig.for_target(cfg, (3, 3), 2)
    whole = shared._random_params(_init_boxed, cfg, spec, 3, jnp.dtype("float32"))
    monkeypatch.setattr(shared, "ONE_PROGRAM_BYTES", 0)
    by_leaf = shared._random_params(_init_boxed, cfg, spec, 3, jnp.dtype("float32"))
    assert jax.tree.structure(whole) == jax.tree.structure(by_leaf) and "lm_head" not in whole
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(by_leaf)))