"""The one declaration of the decoder's weights: per leaf its shape, logical axes, Hugging Face source
and initialiser. Everything that needs a list of weights derives it from here: the converter
(`spd_jax.convert.hf`: names, shapes, transforms), the sharding rules (`spd_jax.sharding`: logical axes
-> mesh axes), the cost model (`spd_jax.models.costs`: parameter counts), random initialisation
(`init_params`) and the PSM's target-shaped layers (`spd_jax.drafters.psm`).

Layout of the params pytree (what `decoder` reads):
    embed [V, H]; final_norm [H]; lm_head [V, H] (untied embeddings only)
    layers: {kind: {leaf: [n_kind, *leaf shape]}}, kind in ("attention", "linear"), stacked over that
    kind's layers in model order (logical axis "layers").

Logical axes name what a dimension *is*, never how it is split: "vocab", "embed" (H), "mlp" (I),
"q_heads" / "kv_heads" (heads x head_dim, flattened; split by whole heads), "head_dim", "v_heads"
(Gated DeltaNet value heads), "conv" (its packed q|k|v conv channels), "conv_kernel", "v_dim",
"layers". `axis_units` says how many indivisible units each axis has (heads, not head_dim x heads),
so a rules table only splits an axis over a mesh axis whose size divides that count.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ATTENTION, LINEAR, ModelConfig

Index = tuple  # a tuple of slices / ints into an array


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor -> our layout. `source(index)` maps an index into our array to the HF index that holds
    the same elements (so a shard reads only its slice from disk); None: the whole tensor is read and
    transformed, then indexed (used only for packed tensors that need a reshape)."""

    name: str
    apply: Callable[[np.ndarray], np.ndarray]
    source: Callable[[Index], Index] | None

    def read(self, get_slice, index: Index) -> np.ndarray:
        """get_slice: HF index -> array (a safetensors slice). Returns our[index]."""
        if self.source is None:
            return self.apply(get_slice((slice(None),)))[index]
        return self.apply(get_slice(self.source(index)))


SAME = Transform("same", lambda a: a, lambda ix: ix)
TRANSPOSE = Transform("transpose", lambda a: a.T, lambda ix: tuple(reversed(ix)))


def qkv_groups(cfg: ModelConfig) -> np.ndarray:
    """Gated DeltaNet's packed q|k|v channels, regrouped by key head: for each key head g, its query and key
    channels [Dk each], then the value channels of the Hv / Hk value heads that read it -> [C]: the HF channel
    each of ours holds. HF packs all queries, then all keys, then all values, which no contiguous split falls on
    heads; grouped, a split into any divisor of Hk blocks gives each device whole heads (tensor parallelism)."""
    lc = cfg.linear
    nk, dk, dv, r = lc.num_k_heads, lc.k_dim, lc.v_dim, lc.num_v_heads // lc.num_k_heads
    ks = lc.key_size
    return np.concatenate([np.concatenate([g * dk + np.arange(dk), ks + g * dk + np.arange(dk),
                                           2 * ks + g * r * dv + np.arange(r * dv)]) for g in range(nk)])


def _grouped_qkv(cfg: ModelConfig) -> Transform:
    """in_proj_qkv [C, H] -> [H, C] with its channels grouped by key head (`qkv_groups`)."""
    order = qkv_groups(cfg)
    return Transform("grouped_qkv", lambda a: a[order].T, None)


def _grouped_conv(cfg: ModelConfig) -> Transform:
    """conv1d [C, 1, K] -> [K, C] with its channels grouped by key head (`qkv_groups`)."""
    order = qkv_groups(cfg)
    return Transform("grouped_conv", lambda a: a[order, 0, :].T, None)


def _gated_q(part: int, cfg: ModelConfig) -> Transform:
    """Qwen3.5's q_proj packs [query | gate] per head: rows [Nq, 2, D] -> part 0 (query) or 1 (gate)."""
    nq, d = cfg.num_heads, cfg.head_dim
    return Transform(f"gated_q[{part}]", lambda a: a.reshape(nq, 2, d, -1)[:, part].reshape(nq * d, -1).T, None)


# A leaf's initial values, as transformers initialises the family's modules: "normal" (std 0.02), "norm"
# (the identity scale of this model's RMSNorm: 1, or 0 where it scales by 1 + w), "ones", "zeros", "a_log"
# (Gated DeltaNet's log decay rates, log U(0.01, 16) per value head).
INITS = ("normal", "norm", "ones", "zeros", "a_log")
A_LOG_RANGE = (0.01, 16.0)


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]  # ours, per layer (no "layers" axis)
    axes: tuple[str | None, ...]  # logical axis per dimension
    hf: str  # HF tensor name (relative to "<prefix>layers.{i}." for layer leaves)
    hf_shape: tuple[int, ...]
    transform: Transform
    init: str  # one of INITS

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)
        assert self.init in INITS, self.init



def _linear_w(out_dim: int, in_dim: int, hf: str, axes: tuple[str | None, str | None]) -> Leaf:
    """An nn.Linear weight: HF [out, in] -> ours [in, out]."""
    return Leaf((in_dim, out_dim), axes, hf, (out_dim, in_dim), TRANSPOSE, "normal")


def _vector(n: int, hf: str, axis: str | None, init: str) -> Leaf:
    return Leaf((n,), (axis,), hf, (n,), SAME, init)


def common_schema(cfg: ModelConfig) -> dict[str, Leaf]:
    """Norms and SwiGLU MLP: every layer kind has them."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    s = {"attn_norm": _vector(H, "input_layernorm.weight", "embed", "norm"),
         "mlp_norm": _vector(H, "post_attention_layernorm.weight", "embed", "norm"),
         "w_gate": _linear_w(I, H, "mlp.gate_proj.weight", ("embed", "mlp")),
         "w_up": _linear_w(I, H, "mlp.up_proj.weight", ("embed", "mlp")),
         "w_down": _linear_w(H, I, "mlp.down_proj.weight", ("mlp", "embed"))}
    if cfg.mlp_bias:
        s |= {"b_gate": _vector(I, "mlp.gate_proj.bias", "mlp", "zeros"),
              "b_up": _vector(I, "mlp.up_proj.bias", "mlp", "zeros"),
              "b_down": _vector(H, "mlp.down_proj.bias", "embed", "zeros")}
    return s


def attention_schema(cfg: ModelConfig) -> dict[str, Leaf]:
    """The mixer of a full-attention layer (GQA; optional q/k norm, biases, output gate)."""
    H, D, Q, KV = cfg.hidden_size, cfg.head_dim, cfg.q_size, cfg.kv_size
    s = {"wk": _linear_w(KV, H, "self_attn.k_proj.weight", ("embed", "kv_heads")),
         "wv": _linear_w(KV, H, "self_attn.v_proj.weight", ("embed", "kv_heads")),
         "wo": _linear_w(H, Q, "self_attn.o_proj.weight", ("q_heads", "embed"))}
    if cfg.attn_gate:
        for key, part in (("wq", 0), ("wq_gate", 1)):
            s[key] = Leaf((H, Q), ("embed", "q_heads"), "self_attn.q_proj.weight", (2 * Q, H), _gated_q(part, cfg),
                          "normal")
    else:
        s["wq"] = _linear_w(Q, H, "self_attn.q_proj.weight", ("embed", "q_heads"))
    if cfg.qkv_bias:
        s |= {"bq": _vector(Q, "self_attn.q_proj.bias", "q_heads", "zeros"),
              "bk": _vector(KV, "self_attn.k_proj.bias", "kv_heads", "zeros"),
              "bv": _vector(KV, "self_attn.v_proj.bias", "kv_heads", "zeros")}
    if cfg.o_bias:
        s["bo"] = _vector(H, "self_attn.o_proj.bias", "embed", "zeros")
    if cfg.qk_norm:
        s |= {"q_norm": _vector(D, "self_attn.q_norm.weight", "head_dim", "norm"),
              "k_norm": _vector(D, "self_attn.k_norm.weight", "head_dim", "norm")}
    return s


def linear_schema(cfg: ModelConfig) -> dict[str, Leaf]:
    """The mixer of a Gated DeltaNet layer (Qwen3.5 linear attention)."""
    lc, H = cfg.linear, cfg.hidden_size
    C, K, nv = lc.conv_dim, lc.conv_kernel, lc.num_v_heads
    return {"w_qkv": Leaf((H, C), ("embed", "conv"), "linear_attn.in_proj_qkv.weight", (C, H), _grouped_qkv(cfg),
                          "normal"),
            "conv_w": Leaf((K, C), ("conv_kernel", "conv"), "linear_attn.conv1d.weight", (C, 1, K), _grouped_conv(cfg),
                           "normal"),
            "w_z": _linear_w(lc.value_size, H, "linear_attn.in_proj_z.weight", ("embed", "v_heads")),
            "w_b": _linear_w(nv, H, "linear_attn.in_proj_b.weight", ("embed", "v_heads")),
            "w_a": _linear_w(nv, H, "linear_attn.in_proj_a.weight", ("embed", "v_heads")),
            "dt_bias": _vector(nv, "linear_attn.dt_bias", "v_heads", "ones"),
            "A_log": _vector(nv, "linear_attn.A_log", "v_heads", "a_log"),
            # the gated norm scales by its plain weight in every family (no 1 + w)
            "norm_w": _vector(lc.v_dim, "linear_attn.norm.weight", "v_dim", "ones"),
            "w_out": _linear_w(H, lc.value_size, "linear_attn.out_proj.weight", ("v_heads", "embed"))}


def layer_schema(cfg: ModelConfig, kind: str) -> dict[str, Leaf]:
    """Every leaf of one layer of `kind`."""
    if kind == ATTENTION:
        return common_schema(cfg) | attention_schema(cfg)
    if kind == LINEAR:
        if cfg.linear is None:
            raise ValueError(f"{cfg.model_type} has no linear-attention layers")
        return common_schema(cfg) | linear_schema(cfg)
    raise ValueError(f"unknown layer kind {kind!r}")


def global_schema(cfg: ModelConfig, prefix: str = "model.") -> dict[str, Leaf]:
    """Embedding, final norm and (untied) LM head; HF names under `prefix`."""
    V, H = cfg.vocab_size, cfg.hidden_size
    s = {"embed": Leaf((V, H), ("vocab", "embed"), f"{prefix}embed_tokens.weight", (V, H), SAME, "normal"),
         "final_norm": _vector(H, f"{prefix}norm.weight", "embed", "norm")}
    if not cfg.tie_word_embeddings:
        s["lm_head"] = Leaf((V, H), ("vocab", "embed"), "lm_head.weight", (V, H), SAME, "normal")
    return s


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """The kinds present, in a fixed order."""
    return tuple(k for k in (ATTENTION, LINEAR) if k in cfg.layer_types)


def param_axes(cfg: ModelConfig) -> dict:
    """The params pytree with each leaf's logical axes (a tuple) in place of the array."""
    out = {k: leaf.axes for k, leaf in global_schema(cfg).items()}
    out["layers"] = {kind: {k: ("layers", *leaf.axes) for k, leaf in layer_schema(cfg, kind).items()}
                     for kind in layer_kinds(cfg)}
    return out


def axis_units(cfg: ModelConfig) -> dict[str, int]:
    """How many indivisible units each logical axis holds: a mesh axis may split it only when its size
    divides this count (heads are split whole; a flattened [heads x head_dim] axis counts heads)."""
    u = {"vocab": cfg.vocab_size, "embed": cfg.hidden_size, "mlp": cfg.intermediate_size,
         "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": 1, "layers": cfg.num_layers}
    if cfg.linear is not None:
        # the conv channels split by key-head group (`qkv_groups`), whole heads only
        u |= {"v_heads": cfg.linear.num_v_heads, "conv": cfg.linear.num_k_heads, "conv_kernel": 1, "v_dim": 1}
    return u


def param_count(leaves: dict[str, Leaf]) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in leaves.values())


def initializer(leaf: Leaf, cfg: ModelConfig) -> Callable:
    """(key, shape, dtype) -> array, following `leaf.init`."""
    if leaf.init == "norm":  # w such that the norm scales by 1: w (Llama) or 1 + w (Qwen3.5)
        return lambda key, shape, dtype=jnp.float32: jnp.full(shape, 1.0 - cfg.norm_offset, dtype)
    if leaf.init in ("ones", "zeros"):
        return lambda key, shape, dtype=jnp.float32: jnp.full(shape, float(leaf.init == "ones"), dtype)
    if leaf.init == "a_log":
        return lambda key, shape, dtype=jnp.float32: jnp.log(jax.random.uniform(key, shape, dtype, *A_LOG_RANGE))
    return lambda key, shape, dtype=jnp.float32: 0.02 * jax.random.normal(key, shape, dtype)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random decoder params in the converter's layout (jit this with out_shardings from
    `spd_jax.sharding` to create them sharded)."""
    leaves = [((k,), leaf, leaf.shape) for k, leaf in global_schema(cfg).items()]
    leaves += [(("layers", kind, k), leaf, (cfg.layer_types.count(kind), *leaf.shape))
               for kind in layer_kinds(cfg) for k, leaf in layer_schema(cfg, kind).items()]
    out: dict = {}
    for (path, leaf, shape), k in zip(leaves, jax.random.split(key, len(leaves))):
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = initializer(leaf, cfg)(k, shape, dtype)
    return out
