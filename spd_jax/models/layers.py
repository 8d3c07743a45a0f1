"""Small shared pieces of decoder math: RMSNorm, rotary embeddings, the SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig, rope_inv_freq


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype. Low-precision (bf16) weights take x in their dtype
    and accumulate in float32: XLA:CPU runs that dot on its fast bf16 kernel, while a bf16-out dot is
    converted to float32 first and a mixed f32 x bf16 dot upcasts the weight on every call."""
    if w.dtype == jnp.float32 or w.dtype == jnp.float64:
        return x @ w
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis. offset=0: w * norm(x) cast first (Llama); offset=1: (1 + w) * norm(x)
    in float32, then cast (Qwen3.5) -- the two round differently in low precision, as transformers does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * xf.astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [T] or [B, T] int -> cos, sin [..., T, rotary_dim] float32 (rotate-half layout:
    frequencies twice)."""
    inv = jnp.asarray(np.asarray(rope_inv_freq(cfg.rope, cfg.rotary_dim), np.float32))
    ang = positions.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D]; cos/sin [T, R] (one set of positions for the batch) or [B, T, R], R <= D: rotates
    the first R dims, passes the rest."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    half = r // 2
    rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]  # over the heads
    out = (xr.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, xp], axis=-1)


def mlp(lp: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """SwiGLU: x [B, T, H] -> [B, T, H]."""
    gate = dense(x, lp["w_gate"])
    up = dense(x, lp["w_up"])
    if cfg.mlp_bias:
        gate, up = gate + lp["b_gate"], up + lp["b_up"]
    out = dense(jax.nn.silu(gate) * up, lp["w_down"])
    if cfg.mlp_bias:
        out = out + lp["b_down"]
    return out
