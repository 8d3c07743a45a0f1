"""Autoregressive generation: greedy equals transformers and a cache-free reference, sampling follows
the warped distribution, EOS stops, buckets avoid recompilation, streaming sees every token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as sstats

import spd_jax
from spd_jax import api, methods
from spd_jax.decode.sampling import choose, warp_logits
from spd_jax.models import decoder
from spd_jax.decode.sampling import Sampling

from conftest import cache_free_greedy
from tolerances import BF16_VS_FP32, CACHED_VS_FULL, ELEMENTWISE, assert_close


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    path, ref = tiny_ckpt("qwen3", False)
    return spd_jax.load_model(path), ref


def test_greedy_matches_transformers_generate(tiny):
    model, ref = tiny
    prompt = [1, 17, 42, 99, 5, 63]
    ours = spd_jax.generate(model, prompt, max_new_tokens=40)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    assert ours.token_ids == hf
    assert ours.stats["tokens"] == len(hf)


def test_greedy_matches_cache_free_argmax_loop(tiny):
    model, _ = tiny
    prompt = [3, 4, 5]
    ours = spd_jax.generate(model, prompt, max_new_tokens=25, stop_at_eos=False).token_ids
    assert ours == cache_free_greedy(model, prompt, 25)


def test_eos_stops_and_is_kept(tiny):
    model, _ = tiny
    prompt = [7, 8, 9]
    free = spd_jax.generate(model, prompt, max_new_tokens=30, stop_at_eos=False).token_ids
    eos = free[5]
    stopper = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    res = spd_jax.generate(stopper, prompt, max_new_tokens=30)
    assert res.token_ids == free[:free.index(eos) + 1]
    assert res.stats["stopped_at_eos"]


def test_shape_buckets_do_not_recompile(tiny):
    model, _ = tiny
    spd_jax.generate(model, [1, 2, 3, 4, 5], max_new_tokens=10)
    n = methods.METHODS["ar"].compiled.compiles
    spd_jax.generate(model, [1, 2, 3, 4, 5, 6, 7, 8, 9], sampling=Sampling(temperature=0.0), max_new_tokens=20)
    spd_jax.generate(model, [9, 8], max_new_tokens=33)
    assert methods.METHODS["ar"].compiled.compiles == n
    # Sampling values are data, not compile-time constants.
    spd_jax.generate(model, [1, 2], sampling=Sampling(temperature=0.7, seed=1), max_new_tokens=10)
    n = methods.METHODS["ar"].compiled.compiles
    spd_jax.generate(model, [1, 2], sampling=Sampling(temperature=1.3, seed=5), max_new_tokens=10)
    assert methods.METHODS["ar"].compiled.compiles == n


def test_streaming_sees_every_token_in_order(tiny):
    model, _ = tiny
    seen = []
    res = spd_jax.generate(model, [5, 6], max_new_tokens=12, stop_at_eos=False, stream=seen.append)
    assert seen == res.token_ids and len(seen) == 12


def test_batch_generation_matches_one_sequence_at_a_time(tiny):
    """generate_batch (per-row prompt lengths, positions, stopping) gives each row what `generate` gives
    it alone: sampled (row b seeded seed + b) and stopping at EOS (greedy without EOS: test_distill)."""
    model, _ = tiny
    prompts = [[3, 4, 5], [1, 17, 42, 99, 5, 63, 8, 2, 11], list(range(20, 40))]
    sampled = spd_jax.generate_batch(model, prompts, max_len=48, temperature=1.0, seed=5, stop_at_eos=False)
    assert sampled == [spd_jax.generate(model, p, 48 - len(p), sampling=Sampling(temperature=1.0, seed=5 + b),
                                        stop_at_eos=False).token_ids for b, p in enumerate(prompts)]
    eos = spd_jax.generate(model, prompts[1], 8, stop_at_eos=False).token_ids[4]  # row 1 stops there, others may
    stopper = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    stopped = spd_jax.generate_batch(stopper, prompts, max_len=48)
    assert stopped == [spd_jax.generate(stopper, p, 48 - len(p)).token_ids for p in prompts]
    assert stopped[1][-1] == eos and len(stopped[1]) <= 5
    first = spd_jax.generate(model, prompts[0], 1).token_ids[0]  # row 0 is finished by its first token
    starter = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(first,)))
    started = spd_jax.generate_batch(starter, prompts, max_len=48)
    assert started[0] == [first] and started == [spd_jax.generate(starter, p, 48 - len(p)).token_ids for p in prompts]
    with pytest.raises(ValueError, match="prompt 2 has 20 tokens"):
        spd_jax.generate_batch(model, prompts, max_len=20)


def test_a_batch_shrinks_to_its_live_rows_and_each_row_is_still_its_own(tiny, monkeypatch):
    """Rows that finish at different steps: the batch of 6 runs on at widths 4, 2, 1 as they finish (padding
    rows repeat a live one, masked), and every row, finished early or late, is what `generate` gives alone."""
    from spd_jax.decode import ar
    model, _ = tiny
    widths = []
    real = ar._take_rows
    monkeypatch.setattr(ar, "_take_rows", lambda carry, rows, keep, *a, **k: widths.append(keep.size) or real(carry, rows, keep, *a, **k))
    prompts = [list(range(3, 3 + n)) for n in (30, 2, 25, 9, 14, 40)]  # max_new 18 .. 46: finishing one by one
    got = spd_jax.generate_batch(model, prompts, max_len=48, temperature=1.0, seed=[7, 1, 4, 2, 9, 3], stop_at_eos=False)
    assert widths == [4, 2, 1]
    assert got == [spd_jax.generate(model, p, 48 - len(p), sampling=Sampling(temperature=1.0, seed=s),
                                    stop_at_eos=False).token_ids for p, s in zip(prompts, [7, 1, 4, 2, 9, 3])]


def test_sampling_is_seeded(tiny):
    model, _ = tiny
    a = spd_jax.generate(model, [1, 2, 3], 30, sampling=Sampling(temperature=1.0, seed=11), stop_at_eos=False).token_ids
    b = spd_jax.generate(model, [1, 2, 3], 30, sampling=Sampling(temperature=1.0, seed=11), stop_at_eos=False).token_ids
    c = spd_jax.generate(model, [1, 2, 3], 30, sampling=Sampling(temperature=1.0, seed=12), stop_at_eos=False).token_ids
    assert a == b and a != c


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6), (1, 1.0)])
def test_warp_matches_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = np.random.default_rng(top_k).normal(size=(4, 50)).astype(np.float32) * 3
    t = torch.as_tensor(logits)
    t = TemperatureLogitsWarper(0.7)(None, t)
    if top_k:
        t = TopKLogitsWarper(top_k)(None, t)
    if top_p < 1:
        t = TopPLogitsWarper(top_p)(None, t)
    ours = np.asarray(warp_logits(jnp.asarray(logits), 0.7, jnp.int32(top_k), jnp.float32(top_p), True))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(t.numpy()))
    keep = ~np.isinf(ours)
    assert_close(ours[keep], t.numpy()[keep], ELEMENTWISE, what="warped logits")


def _draw_counts(logits, sp, greedy=False, filtered=True, n=20000):
    pos = jnp.arange(n)
    toks = jax.vmap(lambda p: choose(logits, p, sp, greedy, filtered))(pos)
    return np.bincount(np.asarray(toks), minlength=logits.shape[0])


def test_sampling_follows_the_warped_distribution():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=12).astype(np.float32) * 1.5)
    sp = dict(temperature=jnp.float32(0.8), top_k=jnp.int32(8), top_p=jnp.float32(0.9), seed=jnp.uint32(3))
    counts = _draw_counts(logits, sp)
    p = np.asarray(jax.nn.softmax(warp_logits(logits, 0.8, jnp.int32(8), jnp.float32(0.9), True)))
    keep = p > 0
    assert counts[~keep].sum() == 0  # nothing outside the kept set
    _, pval = sstats.chisquare(counts[keep], p[keep] * counts.sum())
    assert pval > 1e-3
    # Control: the same test rejects the unwarped distribution (it has power here).
    q = np.asarray(jax.nn.softmax(logits))
    _, pval_wrong = sstats.chisquare(counts[keep], q[keep] / q[keep].sum() * counts.sum())
    assert pval_wrong < 1e-6


def _decode_logits(model, tokens, layers, params, **kw):
    """Logits of decode_step fed tokens [B, T] one position at a time from an empty cache -> [T, B, V]."""
    cfg = model.config
    caches = decoder.split_cache(decoder.init_cache(cfg, tokens.shape[0], 128), cfg)
    step = jax.jit(lambda t, c, pos: decoder.decode_step(layers, params, t, c, pos, cfg, **kw))
    out = []
    for pos in range(tokens.shape[1]):
        logits, caches = step(tokens[:, pos:pos + 1], caches, jnp.int32(pos))
        out.append(np.asarray(logits[:, 0]))
    return np.stack(out)


def test_live_block_attention_and_bf16_weights_compute_the_same_step(tiny):
    """decode_step reading only the filled cache blocks (attn_block, the bulk path) is the one softmax over
    the whole cache up to summation order; bf16 weights through the bf16-in, float32-out dots stay within
    bf16's rounding of the float32 step."""
    tiny, _ = tiny
    cfg = tiny.config
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 40)), jnp.int32)
    layers = decoder.decode_layers(tiny.params["layers"], cfg)
    full = _decode_logits(tiny, tokens, layers, tiny.params)
    assert_close(_decode_logits(tiny, tokens, layers, tiny.params, attn_block=16), full, CACHED_VS_FULL,
                 depth=cfg.num_layers, what="attention over the filled blocks")
    bf16_layers = api.cast_matrices(layers, "bfloat16")
    assert bf16_layers[0]["w_up"].dtype == jnp.bfloat16 and bf16_layers[0]["mlp_norm"].dtype == jnp.float32
    bf16 = _decode_logits(tiny, tokens, bf16_layers, api.cast_matrices(tiny.params, "bfloat16"))
    assert_close(bf16, full, BF16_VS_FP32, depth=cfg.num_layers, what="bf16 weights")
    assert np.abs(bf16 - full).max() > 0  # the bf16 dots really ran


def test_an_attention_layer_with_some_queries_gives_those_rows_of_all(tiny):
    """`query` (a drafter's last layer, whose newest row alone goes on): the chosen rows' outputs are those
    rows of the layer run on every row, and every row's key and value is still written."""
    from spd_jax.models.kinds import FULL_ATTENTION
    from spd_jax.models.layers import rope_cos_sin

    tiny, _ = tiny
    cfg = tiny.config
    lp = jax.tree.map(lambda w: w[0], tiny.params["layers"][FULL_ATTENTION.name])
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((1, 6, cfg.hidden_size)), jnp.float32)
    cache = jax.tree.map(lambda t: t[0], FULL_ATTENTION.init_cache(cfg, 1, 1, 32, 1, jnp.float32))
    cache = cache._replace(k=jnp.asarray(rng.standard_normal(cache.k.shape), jnp.float32),
                           v=jnp.asarray(rng.standard_normal(cache.v.shape), jnp.float32))
    pos = jnp.int32(9)
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(6))
    every, c_every = FULL_ATTENTION.block(lp, x, cache, pos, cos, sin, cfg)
    for rows in ([5], [0, 3]):
        some, c_some = FULL_ATTENTION.block(lp, x, cache, pos, cos, sin, cfg, query=jnp.asarray(rows))
        assert some.shape == (1, len(rows), cfg.hidden_size)
        assert_close(some, every[:, rows], CACHED_VS_FULL, what=f"queries {rows}")
        assert_close(c_some.k, c_every.k, ELEMENTWISE, what="keys written")


@pytest.mark.parametrize("rows, w_contract", [(1, 0), (3, 0), (1, 1), (3, 1)])
def test_a_low_precision_dot_differentiates_with_its_cotangent_in_the_weights_dtype(rows, w_contract):
    """`layers.low_precision_dot`'s gradient (its own rule: the float32 cotangent rounded to the weight's dtype,
    so XLA:CPU never converts the weight to float32) is the float32 gradient up to bf16 rounding, and its
    inputs' dtypes; a wrong transpose (an axis swapped, a missing term) is off by order 1."""
    from spd_jax.models.layers import low_precision_dot

    rng = np.random.default_rng(rows + 2 * w_contract)
    x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((48, 40) if w_contract == 0 else (40, 48)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((rows, 40)), jnp.float32)

    def loss(x, w, dot):
        return jnp.sum(dot(x, w) * c)

    plain = lambda x, w: jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32),  # noqa: E731
                                             (((1,), (w_contract,)), ((), ())))
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w, lambda x, w: low_precision_dot(x, w, w_contract))
    rx, rw = jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32), plain)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert_close(gx, rx, BF16_VS_FP32, what="dx")
    assert_close(gw, rw, BF16_VS_FP32, what="dw")
