"""KV-cache decoding equals one full forward, and layer ranges compose (what a pipeline stage relies on)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from spd_jax.models import decoder

from tolerances import CACHED_VS_FULL, VS_TRANSFORMERS, assert_close


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_prefill_then_steps_equals_full_forward(tiny_ckpt, model_type):
    path, _ = tiny_ckpt(model_type, False)
    m = spd_jax.load_model(path)
    cfg = m.config
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 24))
    full = m.logits(ids)

    P = 17
    cache = decoder.init_cache(cfg, 1, 32)
    step = jax.jit(decoder.forward, static_argnames="cfg", donate_argnames="cache")
    logits, cache = step(m.params, jnp.asarray(ids[:, :P]), cache, jnp.int32(0), cfg=cfg)
    got = [np.asarray(logits)]
    for t in range(P, ids.shape[1]):
        logits, cache = step(m.params, jnp.asarray(ids[:, t:t + 1]), cache, jnp.int32(t), cfg=cfg)
        got.append(np.asarray(logits))
    assert_close(np.concatenate(got, axis=1), full, CACHED_VS_FULL, depth=cfg.num_layers, what="logits")


def test_layer_ranges_compose_and_expose_hidden_states(tiny_ckpt):
    path, ref = tiny_ckpt("qwen3", True)
    m = spd_jax.load_model(path)
    cfg = m.config
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 9)))
    x0 = decoder.embed(m.params, ids)
    cache = decoder.init_cache(cfg, 1, 16)
    whole, _, hidden = decoder.run_layers(m.params["layers"], x0, cache, jnp.int32(0), cfg, collect_hidden=True)

    # Stage split 1 | 3 layers, each stage with only its own weights and cache slice.
    x = x0
    for a, b in [(0, 1), (1, 4)]:
        lp, c, kinds = decoder.slice_layers(m.params["layers"], cache, cfg, a, b)
        x, _, _ = decoder.run_layers(lp, x, c, jnp.int32(0), cfg, kinds)
    assert_close(x, whole, CACHED_VS_FULL, depth=cfg.num_layers, what="stage-split output")

    # hidden[i] is the output of layer i, i.e. transformers' hidden_states[i + 1] (before the final norm).
    import torch
    with torch.no_grad():
        hs = ref(torch.as_tensor(np.array(ids)), output_hidden_states=True).hidden_states
    for i in range(cfg.num_layers - 1):  # the last HF entry has the final norm applied
        assert_close(hidden[i], hs[i + 1].numpy(), VS_TRANSFORMERS, depth=i + 1, what=f"hidden state {i + 1}")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_decode_step_equals_full_forward(tiny_ckpt, model_type):
    """The AR loop's step (per-layer weights with fused q/k/v, per-layer caches) after a stacked prefill."""
    path, _ = tiny_ckpt(model_type, False)
    m = spd_jax.load_model(path)
    cfg = m.config
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 24))
    full = m.logits(ids)

    P = 17
    cache = decoder.init_cache(cfg, 1, 32)
    logits, cache = jax.jit(decoder.forward, static_argnames="cfg")(m.params, jnp.asarray(ids[:, :P]), cache,
                                                                  jnp.int32(0), cfg=cfg)
    got = [np.asarray(logits)]
    layers, caches = decoder.decode_layers(m.params["layers"], cfg), decoder.split_cache(cache, cfg)
    step = jax.jit(decoder.decode_step, static_argnames="cfg", donate_argnames="caches")
    for t in range(P, ids.shape[1]):
        logits, caches = step(layers, m.params, jnp.asarray(ids[:, t:t + 1]), caches, jnp.int32(t), cfg=cfg)
        got.append(np.asarray(logits))
    assert_close(np.concatenate(got, axis=1), full, CACHED_VS_FULL, depth=cfg.num_layers, what="logits")
