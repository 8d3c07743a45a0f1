"""Bad input fails early with a message that names the problem and the fix, and writes nothing."""

import gc
import json
import shutil

import numpy as np
import pytest

import spd_jax
from spd_jax import CheckpointError, ConfigError, Sampling

from conftest import edited_checkpoint


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is neither a known default \(smollm2-135m-instruct\) nor an existing checkpoint"):
        spd_jax.load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        spd_jax.load_model(tmp_path)


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    d = edited_checkpoint(tiny_ckpt("llama", False)[0], tmp_path / "m",
                          lambda w: w.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        spd_jax.load_model(d)


def test_wrong_shape_is_named(tiny_ckpt, tmp_path):
    d = edited_checkpoint(tiny_ckpt("qwen3", False)[0], tmp_path / "m",
                          lambda w: w.update({"model.layers.1.self_attn.k_norm.weight": np.ones(7, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_norm\.weight' has shape \(7,\), "
                                              r"expected \(24,\)"):
        spd_jax.load_model(d)


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    d = edited_checkpoint(tiny_ckpt("llama", False)[0], tmp_path / "m",
                          lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        spd_jax.load_model(d)


def test_unknown_model_type(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt("llama", False)[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown model_type 'gpt_neox'.*supports llama"):
        spd_jax.load_model(d)


def test_pickle_only_checkpoint_is_refused(tmp_path, tiny_ckpt):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_ckpt("llama", False)[0] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="safetensors only"):
        spd_jax.load_model(d)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("llama", True)[0])


def test_prompt_longer_than_cache(model):
    with pytest.raises(ValueError, match=r"prompt \(500 tokens\) \+ max_new_tokens \(20\) = 520 exceeds the "
                                         r"cache limit of 512"):
        spd_jax.generate(model, [1] * 500, max_new_tokens=20)
    with pytest.raises(ValueError, match=r"exceeds the cache limit of 64 positions; .* or raise max_len \(--max-len\) "
                                         r"up to the model's max_position_embeddings \(512\)"):
        spd_jax.generate(model, [1] * 60, max_new_tokens=5, max_len=64)


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        spd_jax.generate(model, [], max_new_tokens=5)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_k=-3), "top_k must be a positive integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(method="beam"), "unknown method 'beam'"),
])
def test_invalid_generation_arguments(model, kw, msg):
    kw = dict(dict(max_new_tokens=4), **kw)
    sampling = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in kw}
    with pytest.raises(ValueError, match=msg):  # the sampling rule's values are checked once, by Sampling
        spd_jax.generate(model, [1, 2], sampling=Sampling(**sampling), **kw)


def test_token_ids_out_of_vocab(model):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 160\)"):
        spd_jax.generate(model, [1, 160], max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        model.logits(np.zeros((1, 0), np.int64))


def test_unknown_dtype(tiny_ckpt):
    with pytest.raises(ValueError, match="dtype must be one of"):
        spd_jax.load_model(tiny_ckpt("llama", True)[0], dtype="float8")


def test_damaged_config_json_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt("llama", False)[0], tmp_path / "m")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])  # cut short
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON .*copy it again"):
        spd_jax.load_model(d)
    cfg = json.loads(text)
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json has no 'num_hidden_layers', which a llama config needs"):
        spd_jax.load_model(d)


def test_truncated_safetensors_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt("llama", False)[0], tmp_path / "m")
    weights = d / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # a download or conversion cut short
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file .*cut short"):
        spd_jax.load_model(d)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads left in flight
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # and their coroutines
def test_damaged_drafter_checkpoint_is_named(model, tmp_path):
    """A PSM whose identity file does not parse, whose weights are cut short or gone, or whose identity
    promises other shapes than its weights have: an error naming the directory and how to restore it
    (orbax's own name neither), and the directory is left as it was."""
    from spd_jax.decode import pipelined
    from spd_jax.drafters.psm import PSMConfig, init_psm, load_psm, save_psm

    plan = pipelined.plan_for(model, 2).counts
    spec = PSMConfig.for_target(model.config, plan, num_layers=1)
    good = tmp_path / "good"
    save_psm(good, init_psm(model.config, spec, model.params), spec)
    load = lambda p: load_psm(p, model.config, plan, model.params)  # noqa: E731
    load(good)

    bad = _copy(good, tmp_path / "json")
    (bad / "psm.json").write_text((bad / "psm.json").read_text()[:20])
    with pytest.raises(ConfigError, match=r"psm\.json is not valid JSON .*train\.main --export"):
        load(bad)

    meta = json.loads((good / "psm.json").read_text())
    (bad / "psm.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "anchors"}))
    with pytest.raises(ValueError, match=r"psm\.json is not a whole drafter identity \(KeyError: 'anchors'\)"):
        load(bad)

    bad = _copy(good, tmp_path / "cut")
    data = max((p for p in (bad / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    before = sorted((p.name, p.stat().st_size) for p in bad.rglob("*") if p.is_file())
    with pytest.raises(ValueError, match=rf"the weights in {bad}/params do not read .*damaged"):
        load(bad)
    assert sorted((p.name, p.stat().st_size) for p in bad.rglob("*") if p.is_file()) == before

    bad = _copy(good, tmp_path / "shape")  # the identity says 2 layers, the weights hold 1
    (bad / "psm.json").write_text(json.dumps(dict(meta, num_layers=2)))
    with pytest.raises(ValueError, match=rf"the weights in {bad}/params do not read as the drafter"):
        load(bad)

    bad = _copy(good, tmp_path / "gone")
    shutil.rmtree(bad / "params")
    with pytest.raises(FileNotFoundError, match=r"has an identity file but no params/"):
        load(bad)
    gc.collect()  # the failed restores' coroutines are collected here, under this test's warning filters
