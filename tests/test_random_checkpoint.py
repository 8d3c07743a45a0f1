"""The random checkpoint writer (`spd_jax.convert.random`): what it writes is what the real loading path
reads (every tensor, HF names and shapes, sharded as transformers shards), and transformers reads it too."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors import safe_open

import spd_jax
from spd_jax.config import ModelConfig, named_config_names
from spd_jax.convert.hf import VLM_PREFIX, expected_tensors
from spd_jax.convert.random import hf_config, shard_plan, write_random_checkpoint
from spd_jax.config import named_hf_dict
from spd_jax.sharding import TP_RULES, model_mesh

from tolerances import VS_TRANSFORMERS, assert_close

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3_5"]


def _tensors(path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "numpy") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


@pytest.mark.parametrize("name", TINY)
def test_written_checkpoint_loads_sharded_and_runs(tmp_path, name):
    path = write_random_checkpoint(name, tmp_path / name, max_shard_bytes=50_000)
    assert (path / "model.safetensors.index.json").is_file()  # several shards: the index path is the one read
    whole = spd_jax.load_model(path, dtype="bfloat16")
    assert whole.config == ModelConfig.named(name)
    ids = np.random.default_rng(0).integers(0, whole.config.vocab_size, (1, 24))
    logits = whole.logits(ids)
    assert np.isfinite(logits).all() and logits.std() > 0.01
    # sharded by the tensor-parallel rules: each device reads its slices, which together are the whole arrays
    tp = spd_jax.load_model(path, dtype="bfloat16", mesh=model_mesh(2), rules=TP_RULES)
    assert any(len(a.sharding.device_set) == 2 and not a.sharding.is_fully_replicated
               for a in jax.tree.leaves(tp.params))
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(tp.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("multimodal", [None, False])
def test_every_tensor_the_loader_expects_is_written_with_its_hf_shape(tmp_path, multimodal):
    path = write_random_checkpoint("tiny-qwen3_5", tmp_path, max_shard_bytes=30_000, multimodal=multimodal)
    config = json.loads((path / "config.json").read_text())
    wrapped = multimodal is None  # Qwen3.5 publishes its multimodal layout
    assert (config["model_type"], "text_config" in config) == (("qwen3_5", True) if wrapped else ("qwen3_5_text", False))
    cfg = ModelConfig.from_json(path / "config.json")
    want = expected_tensors(cfg, VLM_PREFIX if wrapped else "model.")
    got = _tensors(path)
    assert sorted(got) == sorted(want)
    for name, leaf in want.items():
        assert got[name].shape == leaf.hf_shape, name
        assert got[name].dtype == np.dtype("bfloat16"), name
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
    # values at their init's scale: norms at the identity of (1 + w), the gated norm and dt_bias at 1, A_log in range
    assert (got[f"{VLM_PREFIX if wrapped else 'model.'}norm.weight"] == 0).all()
    lin = {k.split(".linear_attn.")[1]: v for k, v in got.items() if ".layers.0.linear_attn." in k}
    assert (lin["norm.weight"] == 1).all() and (lin["dt_bias"] == 1).all()
    assert np.log(0.01) <= lin["A_log"].astype(np.float32).min() <= lin["A_log"].astype(np.float32).max() <= np.log(16)
    assert abs(float(lin["in_proj_qkv.weight"].astype(np.float32).std()) - 0.02) < 0.002


@pytest.mark.parametrize("name", named_config_names())
@pytest.mark.parametrize("max_shard_bytes", [2 * 10**9, 5 * 10**9])
def test_shards_as_transformers_splits_them(name, max_shard_bytes):
    """Every shipped config at its published size, from sizes alone (nothing materialised)."""
    hf = hf_config(named_hf_dict(name))
    cfg = ModelConfig.from_hf_dict(hf)
    tensors = expected_tensors(cfg, VLM_PREFIX if "text_config" in hf else "model.")
    sizes = {k: 2 * int(np.prod(leaf.hf_shape)) for k, leaf in tensors.items()}
    split = split_state_dict_into_shards_factory(sizes, get_storage_size=lambda s: s, max_shard_size=max_shard_bytes,
                                                 filename_pattern="model{suffix}.safetensors")
    assert shard_plan(sizes, max_shard_bytes) == split.filename_to_tensors


def test_same_seed_same_bytes(tmp_path):
    a = write_random_checkpoint("tiny-qwen3_5", tmp_path / "a", seed=3, max_shard_bytes=40_000)
    b = write_random_checkpoint("tiny-qwen3_5", tmp_path / "b", seed=3, max_shard_bytes=40_000)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    # another shard size: other files, the same tensors; another seed: other values
    one = _tensors(write_random_checkpoint("tiny-qwen3_5", tmp_path / "c", seed=3))
    assert (tmp_path / "c" / "model.safetensors").is_file()
    other = _tensors(write_random_checkpoint("tiny-qwen3_5", tmp_path / "d", seed=4))
    ta = _tensors(a)
    assert all(np.array_equal(ta[k], one[k]) for k in ta)
    assert not np.array_equal(ta[next(iter(ta))], other[next(iter(ta))])


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3_5"])
def test_transformers_reads_it_as_its_own(tmp_path, name):
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(name, tmp_path, max_shard_bytes=60_000, dtype="float32", multimodal=False)
    ref, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = spd_jax.load_model(path)
    ids = np.random.default_rng(1).integers(0, ours.config.vocab_size, (1, 19))
    with torch.no_grad():
        theirs = ref.eval()(torch.as_tensor(ids)).logits.numpy()
    assert_close(ours.logits(ids), theirs, VS_TRANSFORMERS, depth=ours.config.num_layers, what="logits")
