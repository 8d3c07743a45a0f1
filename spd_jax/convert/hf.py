"""Hugging Face checkpoint directory -> decoder params pytree (see `spd_jax.models.decoder`).

Reads config.json and model.safetensors (or a sharded `model.safetensors.index.json`), text-only
(`model.layers.*`) or multimodal (`model.language_model.layers.*`; vision tower and MTP head skipped,
with a log line). Per-layer tensors are stacked per layer kind (see `spd_jax.models.decoder`). Every tensor's
HF shape is checked against the config before anything is loaded, and a missing, unexpected or
mis-shaped tensor fails with its name. Only safetensors is read: no pickles, no remote code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
from safetensors import safe_open

from spd_jax.config import ATTENTION, LINEAR, ModelConfig

log = logging.getLogger(__name__)

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Parts of multimodal checkpoints that are not the text decoder: skipped with a log line.
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_VLM_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names the offending tensor)."""


def _T(a):
    return a.T


def _same(a):
    return a


Table = dict[str, tuple[str, tuple[int, ...], Callable]]


def _common_table(cfg: ModelConfig) -> Table:
    """our leaf -> (HF name under <prefix>layers.{i}., HF shape, HF tensor -> our layout)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    t = {"attn_norm": ("input_layernorm.weight", (H,), _same),
         "mlp_norm": ("post_attention_layernorm.weight", (H,), _same),
         "w_gate": ("mlp.gate_proj.weight", (I, H), _T),
         "w_up": ("mlp.up_proj.weight", (I, H), _T),
         "w_down": ("mlp.down_proj.weight", (H, I), _T)}
    if cfg.mlp_bias:
        t |= {"b_gate": ("mlp.gate_proj.bias", (I,), _same), "b_up": ("mlp.up_proj.bias", (I,), _same),
              "b_down": ("mlp.down_proj.bias", (H,), _same)}
    return t


def _attention_table(cfg: ModelConfig) -> Table:
    H, D, nq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    t = {"wk": ("self_attn.k_proj.weight", (cfg.kv_size, H), _T),
         "wv": ("self_attn.v_proj.weight", (cfg.kv_size, H), _T),
         "wo": ("self_attn.o_proj.weight", (H, cfg.q_size), _T)}
    if cfg.attn_gate:
        # q_proj packs [query | gate] per head: rows [Nq, 2, D].
        t["wq"] = ("self_attn.q_proj.weight", (2 * cfg.q_size, H), lambda a: a.reshape(nq, 2, D, H)[:, 0]
                   .reshape(nq * D, H).T)
        t["wq_gate"] = ("self_attn.q_proj.weight", (2 * cfg.q_size, H), lambda a: a.reshape(nq, 2, D, H)[:, 1]
                        .reshape(nq * D, H).T)
    else:
        t["wq"] = ("self_attn.q_proj.weight", (cfg.q_size, H), _T)
    if cfg.qkv_bias:
        t |= {"bq": ("self_attn.q_proj.bias", (cfg.q_size,), _same),
              "bk": ("self_attn.k_proj.bias", (cfg.kv_size,), _same),
              "bv": ("self_attn.v_proj.bias", (cfg.kv_size,), _same)}
    if cfg.o_bias:
        t |= {"bo": ("self_attn.o_proj.bias", (H,), _same)}
    if cfg.qk_norm:
        t |= {"q_norm": ("self_attn.q_norm.weight", (D,), _same),
              "k_norm": ("self_attn.k_norm.weight", (D,), _same)}
    return t


def _linear_table(cfg: ModelConfig) -> Table:
    lc, H = cfg.linear, cfg.hidden_size
    C, K, nv = lc.conv_dim, lc.conv_kernel, lc.num_v_heads
    return {"w_qkv": ("linear_attn.in_proj_qkv.weight", (C, H), _T),
            "conv_w": ("linear_attn.conv1d.weight", (C, 1, K), lambda a: a[:, 0, :].T),
            "w_z": ("linear_attn.in_proj_z.weight", (lc.value_size, H), _T),
            "w_b": ("linear_attn.in_proj_b.weight", (nv, H), _T),
            "w_a": ("linear_attn.in_proj_a.weight", (nv, H), _T),
            "dt_bias": ("linear_attn.dt_bias", (nv,), _same),
            "A_log": ("linear_attn.A_log", (nv,), _same),
            "norm_w": ("linear_attn.norm.weight", (lc.v_dim,), _same),
            "w_out": ("linear_attn.out_proj.weight", (H, lc.value_size), _T)}


def _layer_tables(cfg: ModelConfig) -> dict[str, Table]:
    common = _common_table(cfg)
    tables = {ATTENTION: common | _attention_table(cfg)}
    if cfg.linear is not None:
        tables[LINEAR] = common | _linear_table(cfg)
    return tables


def _global_table(cfg: ModelConfig, prefix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    t = {"embed": (f"{prefix}embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
         "final_norm": (f"{prefix}norm.weight", (cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        t["lm_head"] = ("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return t


def _safetensors_files(ckpt: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        files = {name: ckpt / fname for name, fname in wmap.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index.name} names shard {f.name}, which is missing from {ckpt}")
        return files
    single = ckpt / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="flax") as f:
            return {name: single for name in f.keys()}
    if any(ckpt.glob("*.bin")) or any(ckpt.glob("*.pt")) or any(ckpt.glob("*.pth")):
        raise CheckpointError(f"{ckpt} holds only PyTorch pickle weights; spd-jax reads safetensors only "
                              "(never unpickles). Re-save the model with save_pretrained(safe_serialization=True).")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {ckpt}")


def load_hf_checkpoint(ckpt_dir: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """Load an HF decoder checkpoint directory into (config, params). dtype: the params' dtype."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist: pass --model a known default "
                                "name or the path of a Hugging Face checkpoint directory")
    cfg = ModelConfig.from_json(ckpt / "config.json")
    files = _safetensors_files(ckpt)

    prefix = _VLM_PREFIX if any(n.startswith(_VLM_PREFIX) for n in files) else "model."
    skipped = [n for n in files if n.startswith(_SKIPPED_PREFIXES)]
    if skipped:
        log.info("skipping %d non-text tensors (%s)", len(skipped),
                 ", ".join(sorted({p for p in _SKIPPED_PREFIXES for n in skipped if n.startswith(p)})))
    tables, global_table = _layer_tables(cfg), _global_table(cfg, prefix)
    expected: dict[str, tuple[int, ...]] = {hf: shape for hf, shape in global_table.values()}
    for i, kind in enumerate(cfg.layer_types):
        for suffix, shape, _ in tables[kind].values():
            expected[f"{prefix}layers.{i}.{suffix}"] = shape
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()

    # Check names and shapes of everything before reading any data.
    handles = {f: safe_open(f, framework="flax") for f in set(files.values())}
    missing = [n for n in expected if n not in files]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + f" required by its config (model_type={cfg.model_type}, "
                                f"num_hidden_layers={cfg.num_layers})")
    unexpected = [n for n in files if n not in expected and n not in allowed_extra
                  and not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(_SKIPPED_PREFIXES)]
    if unexpected:
        raise CheckpointError(f"checkpoint {ckpt} has unexpected tensor {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + f": it does not match its config (model_type={cfg.model_type})")
    for name, shape in expected.items():
        got = tuple(handles[files[name]].get_slice(name).get_shape())
        if got != shape:
            raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape} from config.json "
                                  f"(hidden_size={cfg.hidden_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
                                  f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size}"
                                  + (f", linear={cfg.linear}" if cfg.linear else "") + ")")

    def get(name: str, fn: Callable = _same):
        return fn(handles[files[name]].get_tensor(name).astype(dtype))

    params = {key: get(hf) for key, (hf, _) in global_table.items()}
    params["layers"] = {}
    for kind, table in tables.items():
        idx = [i for i, k in enumerate(cfg.layer_types) if k == kind]
        if idx:
            params["layers"][kind] = {key: jnp.stack([get(f"{prefix}layers.{i}.{suffix}", fn) for i in idx])
                                      for key, (suffix, _, fn) in table.items()}
    log.info("loaded %s (%s, %d layers) from %s", cfg.model_type, jnp.dtype(dtype).name, cfg.num_layers, ckpt)
    return cfg, params
