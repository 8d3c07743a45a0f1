"""Dense decoder math (Llama / Qwen2 / Qwen3): pure functions over a pytree of stacked layer weights.

Shapes: B batch, T new tokens, S cache length, H hidden, L layers, Nq/Nkv query/key-value heads,
D head dim, I MLP width, V vocab.

Params pytree (what `spd_jax.convert` produces):
    embed        [V, H]
    final_norm   [H]
    lm_head      [V, H]           only when the embeddings are untied
    layers: every leaf stacked on a leading layer axis [L, ...]
        attn_norm [L, H]; wq [L, H, Nq*D]; wk, wv [L, H, Nkv*D]; wo [L, Nq*D, H]
        bq [L, Nq*D], bk, bv [L, Nkv*D] (qkv bias); bo [L, H] (o bias)
        q_norm, k_norm [L, D] (qk norm)
        mlp_norm [L, H]; w_gate, w_up [L, H, I]; w_down [L, I, H] (+ b_gate, b_up [L, I], b_down [L, H])

Because the layer axis is leading and every function takes any stack of layers, a pipeline stage runs
`run_layers` on its own slice `layers[a:b]` (and its own cache slice) and nothing else changes. This
module knows nothing about sampling, pipelines or checkpoints.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig, rope_inv_freq

Params = dict


class KVCache(NamedTuple):
    """Static, preallocated KV cache. Entries at positions >= the current length are garbage and are
    never attended to (the mask is position based), so cropping after a rejection is free."""

    k: jax.Array  # [L, B, Nkv, S, D]
    v: jax.Array  # [L, B, Nkv, S, D]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               num_layers: int | None = None) -> KVCache:
    # Heads before positions: per head, keys are a contiguous [S, D] matrix, so the score and value
    # products are plain batched matmuls with no transposed copy of the cache.
    shape = (num_layers or cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # As transformers: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [T] int -> cos, sin [T, D] float32 (rotate-half layout: frequencies repeated twice)."""
    inv = jnp.asarray(np.asarray(rope_inv_freq(cfg.rope, cfg.head_dim), np.float32))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


def attention(lp: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
              cos: jax.Array, sin: jax.Array, cfg: ModelConfig):
    """One attention block: T new tokens at positions [pos, pos+T) over the cached positions [0, pos).

    x [B, T, H] (normed); k_cache/v_cache [B, Nkv, S, D], read only (entries >= pos are ignored).
    Returns (out [B, T, H], k_new [B, Nkv, T, D], v_new [B, Nkv, T, D]); the caller writes k_new/v_new
    into the cache. Keeping the cache read-only here lets a layer scan leave it in place instead of
    threading (and copying) it through the loop carry.
    """
    B, T, _ = x.shape
    S = k_cache.shape[2]
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = x @ lp["wq"]
    k = x @ lp["wk"]
    v = x @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(B, T, nq, d)
    k = k.reshape(B, T, nkv, d)
    v = v.reshape(B, T, nkv, d)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin).astype(k_cache.dtype).transpose(0, 2, 1, 3)  # [B, Nkv, T, D]
    v = v.astype(v_cache.dtype).transpose(0, 2, 1, 3)

    # Softmax over two key blocks, cached [0, pos) and new [pos, pos+T), merged with a shared max.
    qg = q.reshape(B, T, nkv, nq // nkv, d) * jnp.asarray(d ** -0.5, q.dtype)
    s_old = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s_old = jnp.where(jnp.arange(S) < pos, s_old, -jnp.inf)
    s_new = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_new, -jnp.inf)
    m = jnp.maximum(s_old.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    p_old, p_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
    denom = p_old.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    o = (jnp.einsum("bkgts,bksd->btkgd", (p_old / denom).astype(v.dtype), v_cache)
         + jnp.einsum("bkgts,bksd->btkgd", (p_new / denom).astype(v.dtype), v))
    o = o.reshape(B, T, nq * d) @ lp["wo"]
    if cfg.o_bias:
        o = o + lp["bo"]
    return o, k, v


def mlp(lp: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    gate = x @ lp["w_gate"]
    up = x @ lp["w_up"]
    if cfg.mlp_bias:
        gate, up = gate + lp["b_gate"], up + lp["b_up"]
    out = (jax.nn.silu(gate) * up) @ lp["w_down"]
    if cfg.mlp_bias:
        out = out + lp["b_down"]
    return out


def layer(lp: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
          cos: jax.Array, sin: jax.Array, cfg: ModelConfig):
    """One decoder layer. lp: this layer's weights (no layer axis). x [B, T, H].
    Returns (x [B, T, H], k_new, v_new [B, Nkv, T, D])."""
    h, k_new, v_new = attention(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps),
                                k_cache, v_cache, pos, cos, sin, cfg)
    x = x + h
    x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), cfg)
    return x, k_new, v_new


def run_layers(layers: Params, x: jax.Array, cache: KVCache, pos: jax.Array, cfg: ModelConfig,
               collect_hidden: bool = False):
    """Run a contiguous stack of layers (any slice of params["layers"], with the matching cache slice).

    x [B, T, H] at positions [pos, pos+T) -> (x [B, T, H], cache with those positions written,
    hidden [n, B, T, H] or None), where hidden[i] is the output of the i-th layer of the stack
    (h_{start+i+1} in SPD notation).
    """
    T = x.shape[1]
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(T))

    def body(x, lp_kv):
        lp, k_c, v_c = lp_kv
        x, k_new, v_new = layer(lp, x, k_c, v_c, pos, cos, sin, cfg)
        return x, (k_new, v_new, x if collect_hidden else None)

    x, (k_new, v_new, hidden) = jax.lax.scan(body, x, (layers, cache.k, cache.v))
    # One in-place write of every layer's new entries (the cache is donated by the callers' jits).
    k = jax.lax.dynamic_update_slice(cache.k, k_new, (0, 0, 0, pos, 0))
    v = jax.lax.dynamic_update_slice(cache.v, v_new, (0, 0, 0, pos, 0))
    return x, KVCache(k, v), hidden


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, H]."""
    return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm + LM head: x [B, T, H] -> logits [B, T, V] float32."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.einsum("bth,vh->btv", x, head, preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, cache: KVCache, pos: jax.Array, cfg: ModelConfig):
    """tokens [B, T] at positions [pos, pos+T) -> (logits [B, T, V] float32, updated cache).

    Prefill is T = prompt length at pos = 0; a decode step is T = 1.
    """
    x, cache, _ = run_layers(params["layers"], embed(params, tokens), cache, pos, cfg)
    return lm_logits(params, x, cfg), cache
