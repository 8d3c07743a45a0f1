"""Qwen3.5 hybrid (Gated DeltaNet + gated attention): multimodal checkpoints, the two DeltaNet forms,
rewindable state, converter errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import spd_jax
from spd_jax import CheckpointError
from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.models import decoder
from spd_jax.models.deltanet import delta_rule_chunked, delta_rule_recurrent

from conftest import cache_free_greedy, edited_checkpoint, tiny_config
from tolerances import CACHED_VS_FULL, CHUNKED_VS_RECURRENT, VS_TRANSFORMERS, assert_close


def test_config_layer_types_and_partial_rope():
    cfg = ModelConfig.from_hf_dict(tiny_config("qwen3_5"))
    assert cfg.layer_types == (LINEAR,) * 3 + (ATTENTION,) + (LINEAR,) * 2
    assert cfg.rotary_dim == 8 and cfg.norm_offset == 1.0 and cfg.attn_gate
    explicit = dict(tiny_config("qwen3_5"), layer_types=["full_attention"] * 2 + ["linear_attention"] * 4)
    assert ModelConfig.from_hf_dict(explicit).layer_types == (ATTENTION,) * 2 + (LINEAR,) * 4
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": tiny_config("qwen3_5")}
    w = ModelConfig.from_hf_dict(wrapped)
    assert w.model_type == "qwen3_5_text" and w.tie_word_embeddings and w.linear.num_v_heads == 4


@pytest.fixture(scope="module")
def vlm_ckpt(tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration (vision tower included) with an MTP tensor added."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5")
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("qwen3_5_vlm")
    model.save_pretrained(d, safe_serialization=True)
    w = load_file(d / "model.safetensors")
    assert any(k.startswith("model.language_model.layers.") for k in w)
    assert any(k.startswith("model.visual.") for k in w)
    w["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return d, model


def test_multimodal_checkpoint_text_logits_match(vlm_ckpt, caplog):
    d, ref = vlm_ckpt
    with caplog.at_level("INFO"):
        model = spd_jax.load_model(d)
    assert "skipping" in caplog.text and "model.visual." in caplog.text and "mtp." in caplog.text
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(1, 29))
    with torch.no_grad():
        theirs = ref(input_ids=torch.as_tensor(ids)).logits.numpy()
    assert_close(model.logits(ids), theirs, VS_TRANSFORMERS, depth=model.config.num_layers, what="logits")


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 64), (150, 64), (150, 16)])
def test_chunked_delta_rule_equals_recurrent(T, chunk):
    rng = np.random.default_rng(T)
    B, Hv, Dk, Dv = 2, 3, 8, 5

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = jnp.asarray(unit(rng.normal(size=(B, T, Hv, Dk))) * Dk ** -0.5, jnp.float32)
    k = jnp.asarray(unit(rng.normal(size=(B, T, Hv, Dk))), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, Hv, Dv)), jnp.float32)
    g = jnp.asarray(-np.abs(rng.normal(size=(B, T, Hv))) * 0.3, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 1.0, size=(B, T, Hv)), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(B, Hv, Dk, Dv)), jnp.float32)
    o_r, s_r = delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert_close(o_c, o_r, CHUNKED_VS_RECURRENT, what="outputs")
    assert_close(s_c, s_r, CHUNKED_VS_RECURRENT, what="final state")


@pytest.fixture(scope="module")
def hybrid(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("qwen3_5", False)[0])


def _step_fn():
    return jax.jit(decoder.forward, static_argnames="cfg", donate_argnames="cache")


def test_rewind_restores_state_exactly(hybrid):
    """Advance k tokens, rewind k (continue at the old position), advance the same tokens: identical
    logits and state; advance other tokens: equal to a fresh run on that sequence."""
    cfg, step, R = hybrid.config, _step_fn(), 4
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(1, 11)))
    a = rng.integers(0, cfg.vocab_size, size=3)
    b = rng.integers(0, cfg.vocab_size, size=3)
    P = prompt.shape[1]

    cache = decoder.init_cache(cfg, 1, 32, ring=R)
    _, cache = step(hybrid.params, prompt, cache, jnp.int32(0), cfg=cfg)

    def advance(cache, toks):
        out = []
        for i, t in enumerate(toks):
            lg, cache = step(hybrid.params, jnp.asarray([[t]]), cache, jnp.int32(P + i), cfg=cfg)
            out.append(np.asarray(lg[0, 0]))
        return np.stack(out), cache

    logits_a, cache = advance(cache, a)
    ssm_after_a = np.asarray(cache.linear.ssm[:, (P + 2) % R])
    logits_a2, cache = advance(cache, a)  # rewound by 3 < R: positions P.. again
    np.testing.assert_array_equal(logits_a2, logits_a)
    np.testing.assert_array_equal(np.asarray(cache.linear.ssm[:, (P + 2) % R]), ssm_after_a)

    logits_b, cache = advance(cache, b)  # rewind by 3 again, now with other tokens
    fresh = hybrid.logits(np.concatenate([np.asarray(prompt)[0], b])[None])[0, P:]
    assert_close(logits_b, fresh, CACHED_VS_FULL, depth=cfg.num_layers, what="logits after a rewind")
    assert np.abs(logits_b - logits_a).max() > 1e-2  # the branch really differs


def test_padded_prefill_stops_the_recurrent_state_at_the_prompt(hybrid):
    cfg = hybrid.config
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=13).tolist()
    greedy = spd_jax.generate(hybrid, ids, max_new_tokens=12, stop_at_eos=False).token_ids  # prompt padded to 64
    assert greedy == cache_free_greedy(hybrid, ids, 12)
    # batched, each row's recurrent state stops at its own prompt length
    prompts = [ids, ids[:5], ids[3:]]
    assert spd_jax.generate_batch(hybrid, prompts, max_len=30, stop_at_eos=False) == [
        spd_jax.generate(hybrid, p, 30 - len(p), stop_at_eos=False).token_ids for p in prompts]


def test_hidden_states_follow_layer_order(hybrid, tiny_ckpt):
    _, ref = tiny_ckpt("qwen3_5", False)
    cfg = hybrid.config
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(1, 9))
    cache = decoder.init_cache(cfg, 1, 16)
    _, _, hidden = decoder.run_layers(hybrid.params["layers"], decoder.embed(hybrid.params, jnp.asarray(ids)),
                                      cache, jnp.int32(0), cfg, collect_hidden=True)
    with torch.no_grad():
        hs = ref(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    for i in range(cfg.num_layers - 1):
        assert_close(hidden[i], hs[i + 1].numpy(), VS_TRANSFORMERS, depth=i + 1, what=f"hidden state {i + 1}")


@pytest.mark.parametrize("edit,msg", [
    (lambda w: w.pop("model.layers.1.linear_attn.A_log"), r"missing tensor 'model\.layers\.1\.linear_attn\.A_log'"),
    (lambda w: w.__setitem__("model.layers.0.linear_attn.conv1d.weight", np.zeros((112, 1, 3), np.float32)),
     r"'model\.layers\.0\.linear_attn\.conv1d\.weight' has shape \(112, 1, 3\), expected \(112, 1, 4\)"),
    (lambda w: w.__setitem__("model.layers.3.self_attn.q_proj.weight", np.zeros((128, 64), np.float32)),
     r"'model\.layers\.3\.self_attn\.q_proj\.weight' has shape \(128, 64\), expected \(256, 64\)"),
])
def test_converter_names_the_bad_deltanet_tensor(tiny_ckpt, tmp_path, edit, msg):
    d = edited_checkpoint(tiny_ckpt("qwen3_5", False)[0], tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=msg):
        spd_jax.load_model(d)


def test_bad_layer_types_are_refused(tmp_path):
    from spd_jax import ConfigError

    bad = dict(tiny_config("qwen3_5"), layer_types=["mamba"] * 6)
    with pytest.raises(ConfigError, match="layer_types must list 6 entries"):
        ModelConfig.from_hf_dict(bad)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(ConfigError, match="no text_config"):
        spd_jax.load_model(tmp_path)
