"""Small shared pieces of decoder math: RMSNorm, rotary embeddings, the SwiGLU MLP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig, rope_inv_freq


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype. Low-precision (bf16) weights take x in their dtype
    and accumulate in float32 (`low_precision_dot`); float32 weights a plain dot."""
    if w.dtype == jnp.float32 or w.dtype == jnp.float64:
        return x @ w
    return low_precision_dot(x.astype(w.dtype), w, 0).astype(x.dtype)


def dense_dot_general(x: jax.Array, w: jax.Array, dimension_numbers, precision=None, **_) -> jax.Array:
    """`dense` as a Flax `nn.Dense(dot_general=...)`: a drafter's projections run the target's dot (a bf16
    kernel accumulating in float32, not a bf16-out dot that XLA:CPU converts whole to float32 first)."""
    assert tuple(map(tuple, dimension_numbers[0])) == ((x.ndim - 1,), (0,)) and not any(dimension_numbers[1]), \
        dimension_numbers
    return dense(x, w)


def low_precision_dot(x: jax.Array, w: jax.Array, w_contract: int) -> jax.Array:
    """x [..., K] against a 2-D low-precision weight w ([K, N] with w_contract 0, [N, K] with 1), both in w's
    dtype -> float32 [..., N]: products exact in float32, accumulated in float32.

    XLA:CPU runs this dot on its bf16 kernel (YNNPACK), which streams the weight as it is stored, only when the
    activation has two rows or more. With one row (batch-1 decode: every stage step, every head shard) it
    converts the whole weight to float32 first: a temporary of twice the weight's bytes per dot and about 9x
    the time (a [2560, 9216] weight: 35 ms against 3.8 ms; docs/scale.md). So on CPU one row is padded to
    two; other backends run the dot as it is.

    Its gradient takes the float32 cotangent in w's dtype into both products (accumulated in float32, as
    forward): the plain transpose would multiply a float32 cotangent by w, which XLA:CPU does by converting the
    whole weight to float32 (2.5 GB for a Qwen3.5-4B head in a training step), and mixed-precision training
    rounds the cotangent so anyway."""
    lead = x.shape[:-1]
    rows = math.prod(lead)
    y = _low_precision_dot_2d(x.reshape(rows, x.shape[-1]), w, w_contract)
    return y.reshape(*lead, y.shape[-1])


def _padded_dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """dot_general(a, b, dims) -> float32, a's single row padded to two on CPU (`low_precision_dot`)."""
    rows = a.shape[0]
    if rows == 1 and jax.default_backend() == "cpu":
        a = jnp.concatenate([a, jnp.zeros_like(a)])
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)[:rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _low_precision_dot_2d(x: jax.Array, w: jax.Array, w_contract: int) -> jax.Array:
    """x [R, K] (w's dtype) against w ([K, N] or [N, K]) -> float32 [R, N]."""
    return _padded_dot(x, w, (((1,), (w_contract,)), ((), ())))


def _low_precision_dot_fwd(x, w, w_contract):
    return _low_precision_dot_2d(x, w, w_contract), (x, w)


def _low_precision_dot_bwd(w_contract, res, g):
    x, w = res
    g = g.astype(w.dtype)  # [R, N]
    dx = _padded_dot(g, w, (((1,), (1 - w_contract,)), ((), ())))  # [R, K]
    a, b = (x, g) if w_contract == 0 else (g, x)  # dw in w's own layout, [K, N] or [N, K]: no transposed copy
    dw = jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_low_precision_dot_2d.defvjp(_low_precision_dot_fwd, _low_precision_dot_bwd)


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


def residual_block(lp: dict, x: jax.Array, mixer, cfg: ModelConfig, mixer_input: jax.Array | None = None):
    """The pre-norm residual block every layer is, the decoder's of each kind and the drafters' (PSM, PPSD,
    EAGLE-3): y = x + mixer(attn_norm(x)), out = y + mlp(mlp_norm(y)). The one definition of it.

    mixer: its input [..., H'] -> (its output [..., H], aux: what else it gives, e.g. the cache entries it
    made); mixer_input: what the mixer reads in place of attn_norm(x) (EAGLE-3's [norm(embedding) |
    hidden_norm(x)], or a norm computed once for several uses) -> (out [..., H], aux)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset) if mixer_input is None else mixer_input
    o, aux = mixer(h)
    y = x + o
    return y + mlp(lp, rms_norm(y, lp["mlp_norm"], cfg.rms_norm_eps, cfg.norm_offset), cfg), aux
