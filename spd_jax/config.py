"""Model configuration: the one place that reads a Hugging Face `config.json`.

`ModelConfig` is a frozen (hashable) dataclass so it can be a static argument of jitted functions.
It must not know about weights, caches or decoding.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# model_type -> family traits the decoder needs. Anything not listed is rejected up front.
_FAMILIES = {
    # qkv_bias: q/k/v projections carry a bias regardless of `attention_bias` (Qwen2 hard-codes it).
    # qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json the decoder cannot run exactly."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 frequency smoothing
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in _FAMILIES:
            raise ConfigError(
                f"unknown model_type {mt!r}: spd-jax supports {', '.join(SUPPORTED_MODEL_TYPES)}. "
                "Check that the directory holds a decoder-only LLM checkpoint of one of these families.")
        fam = _FAMILIES[mt]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only SwiGLU with silu)")
        if d.get("use_sliding_window") or (mt == "mistral" and d.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported; "
                              "set use_sliding_window=false only if the model was trained without it")
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or hidden // heads
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=mt,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=fam["qkv_bias"] or attention_bias,
            o_bias=attention_bias and not fam["qkv_bias"],
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}: point --model at a Hugging Face "
                                    "checkpoint directory (config.json + *.safetensors)")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs use `rope_theta` + `rope_scaling`.
    p = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = p.get("rope_theta", d.get("rope_theta", 10000.0))
    merged = {**legacy, **p}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is only supported for Qwen3.5 models")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> list[float]:
    """Inverse frequencies [head_dim // 2] for rotate-half RoPE, with the configured scaling."""
    inv = [1.0 / (rope.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    if rope.rope_type == "linear":
        inv = [f / rope.factor for f in inv]
    elif rope.rope_type == "llama3":
        low_wl = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wl = rope.original_max_position_embeddings / rope.high_freq_factor
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl > low_wl:
                out.append(f / rope.factor)
            elif wl < high_wl:
                out.append(f)
            else:
                smooth = (rope.original_max_position_embeddings / wl - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        inv = out
    return inv
