"""Hugging Face checkpoint directory -> decoder params pytree (see `spd_jax.models.decoder`).

Reads config.json and model.safetensors (or a sharded `model.safetensors.index.json`). Every tensor's
HF shape is checked against the config before anything is loaded, and a missing, unexpected or
mis-shaped tensor fails with its name. Only safetensors is read: no pickles, no remote code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax.numpy as jnp
from safetensors import safe_open

from spd_jax.config import ModelConfig

log = logging.getLogger(__name__)

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names the offending tensor)."""


def _layer_table(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """our leaf name -> (HF name suffix under model.layers.{i}., HF shape, transpose to [in, out])."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    t = {
        "attn_norm": ("input_layernorm.weight", (H,), False),
        "wq": ("self_attn.q_proj.weight", (cfg.q_size, H), True),
        "wk": ("self_attn.k_proj.weight", (cfg.kv_size, H), True),
        "wv": ("self_attn.v_proj.weight", (cfg.kv_size, H), True),
        "wo": ("self_attn.o_proj.weight", (H, cfg.q_size), True),
        "mlp_norm": ("post_attention_layernorm.weight", (H,), False),
        "w_gate": ("mlp.gate_proj.weight", (I, H), True),
        "w_up": ("mlp.up_proj.weight", (I, H), True),
        "w_down": ("mlp.down_proj.weight", (H, I), True),
    }
    if cfg.qkv_bias:
        t |= {"bq": ("self_attn.q_proj.bias", (cfg.q_size,), False),
              "bk": ("self_attn.k_proj.bias", (cfg.kv_size,), False),
              "bv": ("self_attn.v_proj.bias", (cfg.kv_size,), False)}
    if cfg.o_bias:
        t |= {"bo": ("self_attn.o_proj.bias", (H,), False)}
    if cfg.qk_norm:
        t |= {"q_norm": ("self_attn.q_norm.weight", (D,), False),
              "k_norm": ("self_attn.k_norm.weight", (D,), False)}
    if cfg.mlp_bias:
        t |= {"b_gate": ("mlp.gate_proj.bias", (I,), False),
              "b_up": ("mlp.up_proj.bias", (I,), False),
              "b_down": ("mlp.down_proj.bias", (H,), False)}
    return t


def _global_table(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    t = {"embed": ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
         "final_norm": ("model.norm.weight", (cfg.hidden_size,))}
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

    layer_table, global_table = _layer_table(cfg), _global_table(cfg)
    expected: dict[str, tuple[int, ...]] = {hf: shape for hf, shape in global_table.values()}
    for i in range(cfg.num_layers):
        for suffix, shape, _ in layer_table.values():
            expected[f"model.layers.{i}.{suffix}"] = shape
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
                  and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise CheckpointError(f"checkpoint {ckpt} has unexpected tensor {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + f": it does not match its config (model_type={cfg.model_type})")
    for name, shape in expected.items():
        got = tuple(handles[files[name]].get_slice(name).get_shape())
        if got != shape:
            raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape} from config.json "
                                  f"(hidden_size={cfg.hidden_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
                                  f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size})")

    def get(name: str, transpose: bool = False):
        a = handles[files[name]].get_tensor(name).astype(dtype)
        return a.T if transpose else a

    params = {key: get(hf) for key, (hf, _) in global_table.items()}
    params["layers"] = {
        key: jnp.stack([get(f"model.layers.{i}.{suffix}", tr) for i in range(cfg.num_layers)])
        for key, (suffix, _, tr) in layer_table.items()
    }
    log.info("loaded %s (%s, %d layers) from %s", cfg.model_type, jnp.dtype(dtype).name, cfg.num_layers, ckpt)
    return cfg, params
