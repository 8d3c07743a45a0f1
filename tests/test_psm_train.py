"""The PSM's training forward computes exactly what the SPD engine's PSM computes at inference.

For random sequences, every position t and every pipeline fill k (tokens in flight when t is the
newest), `PSM.train_hidden` with its head at t must equal `PSM.draft_step` (the engine's per-cycle draft, run over
its incremental cache exactly as the engine runs it) for the block starting at the engine's possible
cache lengths. A PSM with weights large enough that every row's type and context moves the logits
makes the comparison sensitive; a control checks that a wrong fill is detected.
"""


import dataclasses
import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.models import decoder
from spd_jax.models.attention import init_kv_cache
from spd_jax.drafters.base import anchor_states
from spd_jax.drafters.psm import (PSM, PSMConfig, deal_fills, fill_counts, fill_weights, group_sizes, init_psm,
                                  row_types)
from tolerances import CACHED_VS_FULL, assert_close, bound

T = 20


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def deep(request, tiny_ckpt):
    path, _ = tiny_ckpt(request.param, False, num_hidden_layers=8)
    return spd_jax.load_model(path)


def _sensitive_psm(model, spec, seed=0, vocab_ids=None):
    """Random PSM weights at a scale where attention is far from uniform, so a row typed or placed
    wrongly changes the draft logits by much more than rounding."""
    v = init_psm(model.config, spec, model.params, seed, vocab_ids=vocab_ids)
    params = v["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [x + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 1 else
           jax.random.normal(k, x.shape) * (1.5 / np.sqrt(x.shape[-2]))
           for k, x in zip(keys, leaves)]
    return {**v, "params": jax.tree.unflatten(tree, out)}


def _teacher_anchors(model, tokens, anchors):
    cfg = model.config
    cache = decoder.init_cache(cfg, 1, tokens.shape[1], model.dtype)
    emb = decoder.embed(model.params, tokens)
    _, _, hidden = decoder.run_layers(model.params["layers"], emb, cache, jnp.int32(0), cfg, collect_hidden=True)
    return anchor_states(emb, hidden, anchors)  # [1, T, m, H]


@pytest.mark.parametrize("n", [2, 4, 8])  # the default run: llama at 2, Qwen3.5 at 8 (conftest.SLOW)
def test_train_forward_equals_engine_draft(deep, n):
    _check_train_equals_engine(deep, n)


def test_train_forward_equals_engine_draft_with_draft_vocabulary(tiny_ckpt):
    """Over a draft vocabulary the training logits [V'] are the engine's at those ids; elsewhere the
    engine's draft is -inf (q = 0). The vocabulary only touches the head: one target kind suffices."""
    llama = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])
    ids = np.sort(np.random.default_rng(0).choice(llama.config.vocab_size, llama.config.vocab_size // 3, False))
    _check_train_equals_engine(llama, 4, ids)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])  # norm_offset 0 and 1: the gain's two identity scales
def test_train_forward_equals_engine_draft_with_anchor_norm(tiny_ckpt, kind):
    """anchor_norm: both paths read the anchor states through the same normalisation; a gain away from
    its identity (one per anchor and dimension) makes a path that skipped it fail."""
    model = spd_jax.load_model(tiny_ckpt(kind, False, num_hidden_layers=8)[0])
    _check_train_equals_engine(model, 4, anchor_norm=True)


def test_train_forward_equals_engine_draft_with_qk_norm(tiny_ckpt, tmp_path):
    """qk_norm (the reference's Qwen3 layers over a Llama target): both paths norm q and k per head with the
    layers' own gains (`_sensitive_psm` moves them off the identity), and those norms move the draft."""
    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])
    cfg = model.config
    spec = _check_train_equals_engine(model, 2, qk_norm=True)  # the option is in the layers only: n = 2 suffices
    v = _sensitive_psm(model, spec, seed=4)
    assert spec.qk_norm and v["params"]["layer_q_norm"].shape == (spec.num_layers, cfg.head_dim)
    from spd_jax.costs import memory  # the memory model counts them
    assert memory.drafter_params(cfg, spec) == sum(x.size for x in jax.tree.leaves({**v["params"], "lm_head": ()}))
    h = jax.random.normal(jax.random.key(1), (6, spec.m, cfg.hidden_size))
    types = jnp.asarray([4, 4, 3, 2, 1, 0])
    cache = init_kv_cache(cfg, spec.num_layers, 1, 8, jnp.float32)
    normed = PSM(cfg, spec).apply(v, h, types, cache, jnp.int32(0), model.params["final_norm"])[0]
    plain = {**v, "params": {k: x for k, x in v["params"].items() if k not in ("layer_q_norm", "layer_k_norm")}}
    unnormed = PSM(cfg, dataclasses.replace(spec, qk_norm=False)).apply(plain, h, types, cache, jnp.int32(0),
                                                                         model.params["final_norm"])[0]
    assert np.abs(np.asarray(normed) - np.asarray(unnormed)).max() > 0.1
    # a target whose attention norms q and k already: the option adds nothing and stays off (one identity)
    assert not PSMConfig.for_target(dataclasses.replace(cfg, qk_norm=True), spec.plan, qk_norm=True).qk_norm
    # part of the identity: written, read back, and a warm start across it refused (its layers do not fit)
    from spd_jax.drafters.psm import kind as psm_kind

    psm_kind.save_psm(tmp_path / "p", v, spec)
    assert json.loads((tmp_path / "p" / "psm.json").read_text())["qk_norm"] is True
    assert psm_kind.read_spec(tmp_path / "p") == spec
    with pytest.raises(ValueError, match=r"has per-head q/k norms in its layers \(qk_norm\)"):
        psm_kind._warm_start(model, dataclasses.replace(spec, qk_norm=False), str(tmp_path / "p"),
                             logging.getLogger("t"))


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_anchor_norm_normalises_each_anchor_with_its_gain(tiny_ckpt, kind):
    """The gain starts at the identity scale (w = 1, or w = 0 where the norm scales by 1 + w); a row of
    type a then reads RMS-normalised h_{b_0} .. h_{b_a}, whatever each anchor's scale."""
    model = spd_jax.load_model(tiny_ckpt(kind, False, num_hidden_layers=8)[0])
    cfg = model.config
    spec = PSMConfig.for_target(cfg, pipelined.plan_for(model, 4).counts, anchor_norm=True)
    v = init_psm(cfg, spec, model.params, 0)
    assert v["params"]["anchor_gain"].shape == (spec.m, cfg.hidden_size)
    np.testing.assert_array_equal(v["params"]["anchor_gain"], 1.0 - cfg.norm_offset)
    h = jax.random.normal(jax.random.key(0), (3, spec.m, cfg.hidden_size)) * jnp.array([0.1, 10, 30, 300, 1])[:, None]
    got = PSM(cfg, spec).apply(v, h, method=PSM.project_all)
    unit = h / np.sqrt(np.mean(np.square(h), -1, keepdims=True) + cfg.rms_norm_eps)
    plain = PSM(cfg, dataclasses.replace(spec, anchor_norm=False))
    want = plain.apply({"params": {k: w for k, w in v["params"].items() if k != "anchor_gain"}}, unit,
                       method=PSM.project_all)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_anchor_norm_is_part_of_the_psms_identity(tiny_ckpt, tmp_path, caplog):
    """anchor_norm is part of a PSM's identity: written, read back (with its gains), absent in the shipped
    PSMs' identity files and then off, checked by a warm start."""
    from spd_jax.drafters.psm import kind as psm_kind

    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])
    cfg = model.config
    spec = PSMConfig.for_target(cfg, pipelined.plan_for(model, 4).counts, num_layers=1, anchor_norm=True)
    v = _sensitive_psm(model, spec)
    psm_kind.save_psm(tmp_path / "p", v, spec)
    assert json.loads((tmp_path / "p" / "psm.json").read_text())["anchor_norm"] is True
    assert psm_kind.read_spec(tmp_path / "p") == spec
    got, w = psm_kind.load_psm(tmp_path / "p", cfg, spec.plan, model.params)
    assert got == spec
    np.testing.assert_array_equal(w["params"]["anchor_gain"], v["params"]["anchor_gain"])
    old = {k: x for k, x in psm_kind.spec_to_json(spec).items() if k != "anchor_norm"}  # before the field
    assert psm_kind.spec_from_json(old) == dataclasses.replace(spec, anchor_norm=False)
    for meta in psm_kind.SHIPPED_DIR.glob("*/psm.json"):
        assert "anchor_norm" not in json.loads(meta.read_text()), meta  # their files stay as they were written
        assert psm_kind.read_spec(meta.parent).anchor_norm is False
    # a warm start: a normalising PSM's projections do not fit a run without the norm; the other way the
    # run keeps its identity gains and takes the rest
    plain = dataclasses.replace(spec, anchor_norm=False)
    with pytest.raises(ValueError, match="set anchor_norm=true"):
        psm_kind._warm_start(model, plain, str(tmp_path / "p"), logging.getLogger("t"))
    psm_kind.save_psm(tmp_path / "q", init_psm(cfg, plain, model.params), plain)
    with caplog.at_level(logging.WARNING):
        warm = psm_kind._warm_start(model, spec, str(tmp_path / "q"), logging.getLogger("t"))
    assert "does not normalise its anchor states" in caplog.text and "anchor_gain" not in warm["params"]


def test_anchor_norm_is_a_training_option():
    """train.main's `anchor_norm=true` (off by default) reaches the spec the run trains."""
    from spd_jax.config import ModelConfig
    from spd_jax.drafters.psm import kind as psm_kind
    from spd_jax.costs.cycle import default_plan
    from train.config import TrainConfig

    cfg = ModelConfig.named("tiny-llama")
    assert TrainConfig().drafter.anchor_norm is False
    for flag in (False, True):
        d = TrainConfig.from_dict({"anchor_norm": flag}).drafter
        assert psm_kind.TRAINING.config(cfg, default_plan(cfg, 2), d).anchor_norm is flag


def _check_train_equals_engine(deep, n, vocab_ids=None, anchor_norm=False, qk_norm=False):
    cfg = deep.config
    plan = pipelined.plan_for(deep, n)
    spec = PSMConfig.for_target(cfg, plan.counts, num_layers=2,
                                draft_vocab=0 if vocab_ids is None else len(vocab_ids), anchor_norm=anchor_norm,
                                qk_norm=qk_norm)
    module = PSM(cfg, spec)
    v = _sensitive_psm(deep, spec, seed=n, vocab_ids=vocab_ids)
    tokens = jax.random.randint(jax.random.key(n), (1, T), 3, cfg.vocab_size)
    h = _teacher_anchors(deep, tokens, spec.anchors)
    fn = deep.params["final_norm"]

    def train(v, h, k):  # every position a query at fill k: in k slots, and (the first 7) in n slots
        at = jnp.arange(T)[None]
        y = module.apply(v, h, [(at[:, 7:], k, k), (at[:, :7], k, n)], method=PSM.train_hidden)
        return module.apply(v, jnp.concatenate([y[1], y[0]], 1), fn, method=PSM.head_logits)

    train = jax.jit(train, static_argnums=2)
    S = T + n + 2
    cache0 = init_kv_cache(cfg, spec.num_layers, 1, S, jnp.float32)
    hpad = jnp.concatenate([h[0], jnp.zeros((n + 1, *h.shape[2:]))])  # rows past T: never read by row t
    chain_cache = jax.jit(lambda v, h, c: module.apply(v, h, c, method=PSM.prefill))(v, hpad[:T], cache0)

    def infer(v, cache, pc, t, completed):
        block = jax.lax.dynamic_slice_in_dim(hpad, pc, n + 1)
        return module.apply(v, block, cache, pc, t, completed, fn, method=PSM.draft_step)[0]

    # every (cycle start, newest token) of one fill at once: the engine's function, batched by vmap
    infer_all = jax.jit(jax.vmap(infer, in_axes=(None, None, 0, 0, 0)))
    worst, checked, moved = 0.0, 0, 0
    for k in range(1, n + 1):
        got = np.asarray(train(v, h, k)[0])
        wrong = np.asarray(train(v, h, k % n + 1)[0]) if n > 1 else None
        # the engine's block starts at the completed prefix or one before it (psm_len lags a cycle)
        cases = [(pc, t, max(t - k + 1, 0)) for t in range(T) for pc in (max(t - k + 1, 0), max(t - k, 0))]
        pcs, ts, comps = (jnp.asarray(c, jnp.int32) for c in zip(*cases))
        wants = np.asarray(infer_all(v, chain_cache, pcs, ts, comps))
        if vocab_ids is not None:
            off = np.ones(cfg.vocab_size, bool)
            off[vocab_ids] = False
            assert np.isneginf(wants[..., off]).all()
            wants = wants[..., vocab_ids]
        for (pc, t, _), want in zip(cases, wants):
            # one function, its softmax blocks split differently (the same kind as cached vs full)
            err = assert_close(got[t], want, CACHED_VS_FULL, spec.num_layers, f"k={k} t={t} pc={pc}")
            worst = max(worst, err)
        for t in range(T):
            # control: the draft under another fill, where that changes the context
            if wrong is not None and t >= max(k, k % n + 1):
                checked += 1
                moved += np.abs(wrong[t] - got[t]).max() > 10 * bound(got[t], CACHED_VS_FULL, spec.num_layers)
    # the main check fails on one position; a wrong fill must move many (peaked attention may ignore
    # the one row a fill changes at some positions)
    assert n == 1 or moved >= 0.5 * checked, (moved, checked)
    print(f"n={n} {cfg.model_type}: max |train - inference| = {worst:.2e}; a wrong fill moved {moved}/{checked}")
    return spec


def test_row_types_follow_the_staircase(deep):
    spec = PSMConfig.for_target(deep.config, pipelined.plan_for(deep, 8).counts)
    assert spec.anchors == (0, 1, 3, 6, 7)  # [0, l, 3l, 6l, L-1] with l = 1
    assert spec.staircase == (0, 1, 1, 2, 2, 2, 3, 4, 4)  # depth 7 has passed 7 layers: h_7 too
    types = row_types(spec, jnp.arange(10), jnp.zeros(10, bool).at[9].set(True))
    assert types.tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 4, 4]
    # n = 4: 6 stages do not exist, the quarters are used
    assert PSMConfig.for_target(deep.config, (2, 2, 2, 2)).anchors == (0, 2, 4, 6, 7)


@pytest.mark.parametrize("n", [4, 8])
def test_a_blocks_rows_projected_by_their_own_types_equal_every_type_then_selected(deep, n):
    """`PSM.block_rows` (each row projected by its own type only, the engine's draft block) equals `rows` under
    `row_types` (every type at every row, then selected) at every reachable block: pc <= completed <= t < pc + R,
    t - completed < n, with up to `completed_rows` completed rows (the engine's one, or any)."""
    cfg = deep.config
    spec = PSMConfig.for_target(cfg, pipelined.plan_for(deep, n).counts)
    psm = PSM(cfg, spec)
    v = _sensitive_psm(deep, spec)
    R = n + 1
    h = jax.random.normal(jax.random.key(2), (R, spec.m, cfg.hidden_size)) * (1 + jnp.arange(spec.m))[:, None]
    block = jax.jit(lambda pc, t, c, C: psm.apply(v, h, pc, t, c, C, method=PSM.block_rows), static_argnums=3)
    every = psm.apply(v, h, method=PSM.project_all)  # [R, m, H]
    pc, pos, checked = 5, 5 + np.arange(R), 0
    for C in (1, None):
        for completed in range(pc, pc + (1 if C == 1 else R - 1) + 1):
            for t in range(completed, min(completed + n, pc + R)):
                types = np.asarray(row_types(spec, jnp.asarray(t - pos), jnp.asarray(pos < completed)))
                want = np.take_along_axis(np.asarray(every), types[:, None, None], 1)[:, 0]
                got = np.asarray(block(pc, t, completed, C))
                live = pos <= t  # rows after t are not drafted from
                assert_close(got[live], want[live], CACHED_VS_FULL, what=f"completed {completed - pc}, t {t - pc}")
                checked += 1
    assert checked >= 2 * n


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("accept", [None, 0.3])
def test_fills_are_dealt_in_their_proportions(n, accept):
    """Every slot count gets fill_weights' shares up to the rounding (largest remainder: under one slot
    per fill); dealing is a random permutation per sequence, so each position's fill follows them."""
    assert group_sizes(8) == (1, 2, 4, 8) and group_sizes(6) == (1, 2, 4, 6) and group_sizes(1) == (1,)
    w = fill_weights(n, accept)
    for slots in (1, 7, 128, 384):
        c = np.asarray(fill_counts(slots, n, accept))
        assert c.sum() == slots and (c >= 0).all() and (np.abs(c - w * slots) < 1).all(), (slots, c)
    if n == 1:
        assert fill_counts(5, 1) == (5,)
        return
    # the paper's mix at 128 slots: 64 at fill n, the rest spread over 1..n-1 as evenly as integers allow
    if accept is None:
        assert fill_counts(128, n)[-1] == 64
    Q, B = 14, 4000
    order, blocks = deal_fills(jax.random.split(jax.random.key(0), B), Q, n, accept)
    order = np.asarray(order)
    assert (np.sort(order, 1) == np.arange(Q)).all()
    # the blocks tile the reordered slots; each runs its fills in the smallest group size that holds them
    assert [a for a, _, _ in blocks] == list(np.cumsum([0] + [len(f) for _, f, _ in blocks])[:-1])
    assert sum(len(f) for _, f, _ in blocks) == Q and [K for _, _, K in blocks] == sorted({K for _, _, K in blocks})
    sizes = group_sizes(n)
    assert sizes[-1] == n and all(K == min(s for s in sizes if s >= f.max()) for _, f, K in blocks)
    fill_of_slot = np.zeros((B, Q), int)  # which fill query slot 0 .. Q-1 of each row was dealt
    for a, f, _ in blocks:
        np.put_along_axis(fill_of_slot, order[:, a:a + len(f)], np.broadcast_to(f, (B, len(f))), axis=1)
    share = np.asarray(fill_counts(Q, n, accept)) / Q
    for slot in (0, Q - 1):  # any one slot: its fill is drawn from the counts' shares (4,000 rows: 5 sd < 0.04)
        np.testing.assert_allclose(np.bincount(fill_of_slot[:, slot], minlength=n + 1)[1:] / B, share, atol=0.04)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_verified_fills_follow_the_engines_schedule(n):
    """fill_accept = p: the fills of the drafts the greedy engine verifies at per-draft acceptance p
    (fill 1 after each flush, fill k + 1 only after an accepted fill-k draft, fill n for a full pipeline)."""
    p = 0.3
    w = fill_weights(n, p)
    # the schedule, walked: a run of verifications after a flush until the first rejection
    rng = np.random.default_rng(0)
    seen = np.zeros(n)
    for _ in range(50000):
        k = 1
        while True:
            seen[k - 1] += 1
            if rng.random() >= p:
                break
            k = min(k + 1, n)
    # tolerance: over 5 standard deviations of a share near 0.2 (70 k walked verifications)
    np.testing.assert_allclose(w, seen / seen.sum(), atol=0.01)
    with pytest.raises(ValueError, match="fill_accept"):
        fill_weights(4, 1.0)
    from train.config import TrainConfig

    assert TrainConfig.from_dict({"fill_accept": "0.3"}).fill_accept == 0.3
    for bad in ("often", 1.5, 0):
        with pytest.raises(ValueError, match="fill_accept"):
            TrainConfig.from_dict({"fill_accept": bad})


def test_plain_loss_and_gradient_equal_the_fast_ones(tiny_ckpt):
    """`psm_loss(plain=True)`, each query drafted as the engine drafts (one after another, over the prefilled
    chain), gives the training forward's loss and gradient: the check `bench.scale` makes at a model's size."""
    from spd_jax.drafters.base import split_params
    from spd_jax.drafters.psm import psm_loss

    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])  # the target only feeds anchors
    spec = PSMConfig.for_target(model.config, pipelined.plan_for(model, 2).counts, 1)
    trainable, frozen = split_params(_sensitive_psm(model, spec))
    rng = np.random.default_rng(5)
    query = np.arange(T - 1, dtype=np.int32)[None]
    batch = dict(tokens=jnp.asarray(rng.integers(0, model.config.vocab_size, (1, T)), jnp.int32),
                 query=jnp.asarray(query), query_mask=jnp.asarray(rng.random(query.shape) < 0.8))
    keys = jax.random.split(jax.random.key(3), 1)

    def loss_and_grad(plain):
        loss = functools.partial(psm_loss, cfg=model.config, spec=spec, tau=1.0, plain=plain)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable, frozen, model.params, batch, keys)

    (fast, fast_sums), fast_grad = loss_and_grad(False)
    (plain, plain_sums), plain_grad = loss_and_grad(True)
    assert float(fast_sums["positions"]) == float(plain_sums["positions"]) > 0
    assert_close(plain, fast, CACHED_VS_FULL, depth=spec.num_layers, what="loss")
    for path, g in jax.tree_util.tree_leaves_with_path(fast_grad):
        assert_close(_at(plain_grad, path), g, CACHED_VS_FULL, depth=spec.num_layers, what=f"grad {path}")


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree
