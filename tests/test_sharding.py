"""The weight schema, the rules tables and what they place: tensor-parallel decoding equals `ar`,
sharded loads put every leaf where the rules say, and a pipeline device holds only its stage's layers."""

import jax
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.models import decoder, schema
from spd_jax.pipeline import stages
from spd_jax.sharding import (STAGE_RULES, TP_RULES, Placement, logical_spec, model_mesh, stage_mesh,
                              tree_shardings)
from spd_jax import methods
from spd_jax.decode.sampling import Sampling
from jax.sharding import PartitionSpec as P

PROMPT = [1, 17, 42, 99, 5, 63, 7]


def test_rules_split_only_what_divides():
    """SmolLM2's 9 query / 3 KV heads: split 3 ways, replicated 2 ways; the MLP and vocabulary split
    either way; a mesh axis is never used twice in one spec."""
    units = {"q_heads": 9, "kv_heads": 3, "mlp": 1536, "vocab": 49152, "embed": 576}
    for n, heads in ((2, None), (3, "model"), (4, None)):
        mesh = model_mesh(n)
        assert logical_spec(("embed", "q_heads"), TP_RULES, mesh, units) == (P(None, heads) if heads else P())
        assert logical_spec(("embed", "mlp"), TP_RULES, mesh, units) == P(None, "model")
        assert logical_spec(("vocab", "embed"), TP_RULES, mesh, units) == P("model")
    assert logical_spec(("mlp", "vocab"), TP_RULES) == P("model")
    assert logical_spec(("stage", "layers", "embed"), STAGE_RULES) == P("stage")


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_5"])
def test_schema_is_the_converters_layout(tiny_ckpt, model_type):
    """Random init, logical axes and the loaded checkpoint share one tree and one set of shapes."""
    path, _ = tiny_ckpt(model_type, False)
    model = spd_jax.load_model(path)
    init = jax.eval_shape(lambda: schema.init_params(model.config, jax.random.key(0)))
    assert jax.tree.structure(init) == jax.tree.structure(model.params)
    assert jax.tree.map(lambda a: a.shape, init) == jax.tree.map(lambda a: a.shape, model.params)
    axes = schema.param_axes(model.config)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert [len(a) for a in flat_axes] == [a.ndim for a in jax.tree.leaves(model.params)]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_5"])
def test_tp_greedy_equals_ar(tiny_ckpt, model_type):
    path, _ = tiny_ckpt(model_type, False)
    model = spd_jax.load_model(path)
    ref = spd_jax.generate(model, PROMPT, 24, stop_at_eos=False).token_ids
    for n in (2, 3, 4, 8):
        res = spd_jax.generate(model, PROMPT, 24, method=methods.TP(n=n), stop_at_eos=False)
        assert res.token_ids == ref, n
        assert res.stats["method"] == "tp" and res.stats["devices"] == n


def test_tp_sampling_equals_ar_with_the_same_seed(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3", False)
    model = spd_jax.load_model(path)
    kw = dict(max_new_tokens=24, stop_at_eos=False, sampling=Sampling(temperature=1.0, top_p=0.9, seed=5))
    ref = spd_jax.generate(model, PROMPT, **kw).token_ids
    streamed = []
    assert spd_jax.generate(model, PROMPT, method=methods.TP(n=4), stream=streamed.append, **kw).token_ids == ref
    assert streamed == ref


def test_tp_sharded_load_places_every_leaf_by_the_rules(tiny_ckpt):
    """load_model(mesh, rules): each leaf has its rules sharding, each device holds only its block (a
    split leaf's shard is 1/n of it), values equal an unsharded load, and tp decodes from it as is."""
    path, _ = tiny_ckpt("qwen3", False)
    whole = spd_jax.load_model(path)
    n = 4
    mesh = model_mesh(n)
    model = spd_jax.load_model(path, mesh=mesh, rules=TP_RULES)
    cfg = model.config
    want = tree_shardings(schema.param_axes(cfg), mesh, TP_RULES, schema.axis_units(cfg))
    split = 0
    for (kp, got), w, full in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(want),
                                  jax.tree.leaves(whole.params)):
        assert got.sharding == w, kp
        for shard in got.addressable_shards:
            assert shard.data.shape == w.shard_shape(got.shape), kp
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(full)[shard.index])
        split += any(a is not None for a in w.spec)
    assert split >= 7  # embed, lm_head, wq, wo (4 query heads), w_gate, w_up, w_down really are split
    assert spd_jax.generate(model, PROMPT, 16, method=methods.TP(n=n)).token_ids == \
        spd_jax.generate(whole, PROMPT, 16).token_ids
    assert model.placements.placement("tp") == n
    assert model.placements.entries("tp")["params"][0] is model.params  # used in place, not resharded


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_stage_rules_put_each_stage_on_its_own_device(tiny_ckpt, model_type):
    """A model loaded with stage rules holds no layer outside the pipeline's stage stacks, and device s
    holds exactly stage s's layers; the pipeline's tokens equal ar's."""
    path, _ = tiny_ckpt(model_type, False)
    whole = spd_jax.load_model(path)
    n = 4
    model = spd_jax.load_model(path, mesh=stage_mesh(n), rules=STAGE_RULES)
    assert not model.layers_loaded
    with pytest.raises(ValueError, match="loaded for the pipeline"):
        spd_jax.generate(model, PROMPT, 4)
    ref = spd_jax.generate(whole, PROMPT, 16, stop_at_eos=False).token_ids
    assert spd_jax.generate(model, PROMPT, 16, method=methods.Pipeline(n=n), stop_at_eos=False).token_ids == ref
    stage_w = model.placements.entries(pipelined.STAGE_SLOT)["weights"][0]
    cfg = model.config
    layout, _ = model.placements.placement(pipelined.STAGE_SLOT)  # the stage weights are kept at (layout, tp)
    ids = stages.stage_layer_ids(cfg, layout)
    kind_pos = {kind: np.cumsum([t == kind for t in cfg.layer_types]) - 1 for kind in ids}
    for kind, per_position in stage_w.items():  # one buffer [n, ...] per position j in a stage's layers of the kind
        for j, leaves in enumerate(per_position):
            for name, arr in leaves.items():
                full = np.asarray(whole.params["layers"][kind][name])
                for shard in arr.addressable_shards:
                    s = shard.index[0].start
                    assert shard.data.shape[0] == 1 and shard.device == stage_mesh(n).devices[s]
                    got, layer = np.asarray(shard.data[0]), ids[kind][s, j]
                    if layer < 0:
                        assert not got.any()
                    else:
                        np.testing.assert_array_equal(got, full[kind_pos[kind][layer]])


@pytest.mark.parametrize("tie", [False, True])
def test_spd_places_one_target_head_for_the_psm_and_the_verification(tiny_ckpt, tie):
    """A PSM without a draft vocabulary reads the target's head: the stage mesh holds one copy of it per
    device (the shared weights'), not a second one for the PSM; a new placement drops the old PSM's."""

    path, _ = tiny_ckpt("llama", tie)
    model = spd_jax.load_model(path)
    ref = spd_jax.generate(model, PROMPT, 12, stop_at_eos=False).token_ids
    for n in (2, 4):
        assert spd_jax.generate(model, PROMPT, 12, method=methods.SPD(n=n, spec="random"), stop_at_eos=False).token_ids == ref
        kept = model.placements.entries(pipelined.STAGE_SLOT)  # this layout's: the last n's dropped
        assert model.placements.placement(pipelined.STAGE_SLOT)[0].plan.n == n
        shared, ((_, placed),) = kept["shared"], [(k, v) for k, v in kept.items() if k not in ("weights", "shared")]
        head = decoder.lm_head(shared, model.config)
        assert placed["params"]["lm_head"] is head and len(head.sharding.device_set) == n


def test_placement_is_hashable_and_pins_caches(tiny_ckpt):
    path, _ = tiny_ckpt("llama", False)
    cfg = spd_jax.load_model(path).config
    pl = Placement(model_mesh(2), TP_RULES, tuple(schema.axis_units(cfg).items()))
    assert hash(pl) == hash(Placement(model_mesh(2), TP_RULES, tuple(schema.axis_units(cfg).items())))
    sh = pl.shardings(decoder.cache_axes(cfg))
    kv_heads_split = cfg.num_kv_heads % 2 == 0
    assert sh.kv.k.spec == (P(None, None, "model") if kv_heads_split else P())
