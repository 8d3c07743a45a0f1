"""Logits parity with transformers (PyTorch fp32, eager) on tiny random configs of every family."""

import numpy as np
import pytest
import torch

import spd_jax

from tolerances import BF16_VS_FP32, VS_TRANSFORMERS, assert_close

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False),
         ("qwen3", True), ("qwen3_5", False), ("qwen3_5", True)]


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("model_type,tie", CASES)
def test_logits_match_transformers(tiny_ckpt, model_type, tie):
    path, ref = tiny_ckpt(model_type, tie)
    model = spd_jax.load_model(path)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 37))
    ours = model.logits(ids)
    theirs = hf_logits(ref, ids)
    assert ours.shape == theirs.shape == (2, 37, model.config.vocab_size)
    assert np.abs(theirs).max() > 0.5  # the comparison is not between near-zero logits
    assert_close(ours, theirs, VS_TRANSFORMERS, depth=model.config.num_layers, what="logits")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
])
def test_rope_scaling_matches_transformers(tiny_ckpt, rope):
    path, ref = tiny_ckpt("llama", False, rope_parameters=rope)
    model = spd_jax.load_model(path)
    assert model.config.rope.rope_type == rope["rope_type"]
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(1, 200))
    assert_close(model.logits(ids), hf_logits(ref, ids), VS_TRANSFORMERS, depth=model.config.num_layers, what="logits")


def test_llama_attention_and_mlp_bias(tiny_ckpt):
    path, ref = tiny_ckpt("llama", False, attention_bias=True, mlp_bias=True)
    model = spd_jax.load_model(path)
    assert model.config.qkv_bias and model.config.o_bias and model.config.mlp_bias
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(1, 20))
    assert_close(model.logits(ids), hf_logits(ref, ids), VS_TRANSFORMERS, depth=model.config.num_layers, what="logits")


def test_bfloat16_params_track_float32(tiny_ckpt):
    path, _ = tiny_ckpt("qwen3", False)
    f32 = spd_jax.load_model(path)
    b16 = spd_jax.load_model(path, dtype="bfloat16")
    assert b16.params["layers"]["attention"]["wq"].dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(3).integers(0, f32.config.vocab_size, size=(1, 16))
    a, b = f32.logits(ids), b16.logits(ids)
    assert b.dtype == np.float32
    assert_close(b, a, BF16_VS_FP32, depth=f32.config.num_layers, what="bfloat16 logits")
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8
