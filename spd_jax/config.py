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
    # Qwen3.5 hybrid: Gated DeltaNet + gated full attention, (1 + w) norms, partial RoPE.
    "qwen3_5_text": dict(qkv_bias=False, qk_norm=True),
}
WRAPPED = {"qwen3_5": "qwen3_5_text"}  # VLM configs whose text model sits under `text_config`
SUPPORTED_MODEL_TYPES = tuple(sorted([*_FAMILIES, *WRAPPED]))
ATTENTION, LINEAR = "attention", "linear"  # layer kinds
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"
_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json the decoder cannot run exactly, or a JSON file (config, drafter identity, run record)
    that does not parse."""


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON file at path; one that does not parse raises ConfigError naming the file and `fix` (what
    restores it), where json's own message names neither."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}): {fix}") from None


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
class LinearAttentionConfig:
    """Gated DeltaNet sizes (Qwen3.5 `linear_*` keys)."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size


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
    # Per-layer kind, ATTENTION or LINEAR (Gated DeltaNet); dense models are all ATTENTION.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None
    norm_offset: float = 0.0  # 1.0: RMSNorm scales by (1 + w) (Qwen3.5), 0.0: by w
    attn_gate: bool = False  # q_proj also yields a per-head output gate (Qwen3.5)
    rotary_dim: int = 0  # leading head dims that RoPE rotates (partial RoPE); 0 = head_dim

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (ATTENTION,) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(ATTENTION)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt in WRAPPED:
            text = dict(d.get("text_config") or {})
            if not text:
                raise ConfigError(f"model_type {mt!r} config has no text_config")
            if "tie_word_embeddings" in d:  # the wrapper's flag is the one transformers honours
                text["tie_word_embeddings"] = d["tie_word_embeddings"]
            d, mt = {**text, "model_type": WRAPPED[mt]}, WRAPPED[mt]
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
        hybrid = mt == "qwen3_5_text"
        n_layers = int(d["num_hidden_layers"])
        layer_types, linear = (ATTENTION,) * n_layers, None
        if hybrid:
            raw = d.get("layer_types") or [
                "full_attention" if (i + 1) % int(d.get("full_attention_interval", 4)) == 0 else "linear_attention"
                for i in range(n_layers)]
            kinds = {"full_attention": ATTENTION, "linear_attention": LINEAR}
            bad = [t for t in raw if t not in kinds]
            if bad or len(raw) != n_layers:
                raise ConfigError(f"layer_types must list {n_layers} entries of full_attention/linear_attention, "
                                  f"got {raw!r}")
            layer_types = tuple(kinds[t] for t in raw)
            linear = LinearAttentionConfig(
                num_k_heads=int(d["linear_num_key_heads"]), num_v_heads=int(d["linear_num_value_heads"]),
                k_dim=int(d["linear_key_head_dim"]), v_dim=int(d["linear_value_head_dim"]),
                conv_kernel=int(d.get("linear_conv_kernel_dim", 4)))
            if linear.num_v_heads % linear.num_k_heads:
                raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        rope, rotary_fraction = _rope_from_hf(d, allow_partial=hybrid)
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
            rope=rope,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=fam["qkv_bias"] or attention_bias,
            o_bias=attention_bias and not fam["qkv_bias"],
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            layer_types=layer_types,
            linear=linear,
            norm_offset=1.0 if hybrid else 0.0,
            attn_gate=hybrid,
            rotary_dim=int(int(head_dim) * rotary_fraction),
        )

    @classmethod
    def named(cls, name: str) -> "ModelConfig":
        """A config from configs/models/<name>.yaml (e.g. "qwen3.5-4b", "tiny-qwen3_5")."""
        return cls.from_hf_dict(named_hf_dict(name))

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}: point --model at a Hugging Face "
                                    "checkpoint directory (config.json + *.safetensors)")
        d = read_json(path, "the checkpoint's config.json is damaged; copy it again from the checkpoint's source")
        if not isinstance(d, dict):
            raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not a Hugging Face config (an object)")
        try:
            return cls.from_hf_dict(d)
        except KeyError as e:  # from_hf_dict reads the keys every model of its family has without a default
            if not e.args or e.args[0] in d:
                raise
            raise ConfigError(f"{path} has no {e.args[0]!r}, which a {d.get('model_type', '?')} config needs: the "
                              "file is incomplete; copy it again from the checkpoint's source") from None


def named_config_names() -> list[str]:
    """The configs under configs/models, by name."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def named_hf_dict(name: str) -> dict[str, Any]:
    """The HF config fields of configs/models/<name>.yaml, as written there."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no model config named {name!r} in {CONFIG_DIR} "
                                f"(known: {', '.join(named_config_names())})")
    import yaml

    return yaml.safe_load(path.read_text())


def _rope_from_hf(d: dict[str, Any], allow_partial: bool = False) -> tuple[RopeConfig, float]:
    """-> (rope, fraction of head_dim rotated)."""
    # transformers >= 5 writes `rope_parameters`; older configs use `rope_theta` + `rope_scaling`.
    p = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = p.get("rope_theta", d.get("rope_theta", 10000.0))
    merged = {**legacy, **p}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    fraction = float(merged.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if fraction != 1.0 and not allow_partial:
        raise ConfigError("partial_rotary_factor != 1 is only supported for Qwen3.5 models")
    # Text-only mRoPE (mrope_section) gives every section the same position: plain RoPE.
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    ), fraction


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> list[float]:
    """Inverse frequencies [rotary_dim // 2] for rotate-half RoPE, with the configured scaling."""
    inv = [1.0 / (rope.theta ** (2 * i / rotary_dim)) for i in range(rotary_dim // 2)]
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
