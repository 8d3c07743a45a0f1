"""Full (softmax) attention over a static KV cache: GQA, optional q/k norm, partial RoPE, output gate."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.models.layers import apply_rope, dense, rms_norm


class KVCache(NamedTuple):
    """Static, preallocated KV cache of a stack of attention layers. Entries at positions >= the
    current length are garbage and never attended to (the mask is position based), so cropping after
    a rejection is free: the next write simply lands on them."""

    k: jax.Array  # [n, B, Nkv, S, D]
    v: jax.Array  # [n, B, Nkv, S, D]


def init_kv_cache(cfg: ModelConfig, n_layers: int, batch: int, max_len: int, dtype) -> KVCache:
    # Heads before positions: per head, keys are a contiguous [S, D] matrix, so the score and value
    # products are plain batched matmuls with no transposed copy of the cache.
    shape = (n_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def project_qkv(lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig):
    """x [B, T, H] (normed) at the positions cos/sin [T, R] were made for -> q [B, T, Nq, D],
    k/v [B, T, Nkv, D], with q/k norm and RoPE applied (q not yet scaled). The one statement of attention's
    projections: the layers of every path (prefill, decode step, the drafters' training forwards) use it."""
    B, T, _ = x.shape
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "w_qkv" in lp:  # `decoder.decode_layers`' fused projection: one matmul
        qkv = dense(x, lp["w_qkv"])
        if cfg.qkv_bias:
            qkv = qkv + lp["b_qkv"]
        q, k, v = qkv[..., :nq * d], qkv[..., nq * d:(nq + nkv) * d], qkv[..., (nq + nkv) * d:]
    else:
        q, k, v = dense(x, lp["wq"]), dense(x, lp["wk"]), dense(x, lp["wv"])
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(B, T, nq, d)
    k = k.reshape(B, T, nkv, d)
    v = v.reshape(B, T, nkv, d)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def group_queries(q: jax.Array, cfg: ModelConfig) -> jax.Array:
    """q [..., Nq, D] -> [..., Nkv, G, D] scaled by D^-0.5 (GQA: G query heads share a KV head)."""
    nkv, d = cfg.num_kv_heads, cfg.head_dim
    return q.reshape(*q.shape[:-2], nkv, cfg.num_heads // nkv, d) * jnp.asarray(d ** -0.5, q.dtype)


def softmax_blocks(scores: list[jax.Array]) -> list[jax.Array]:
    """One softmax over the concatenated last axes of several key blocks' float32 scores (masked
    entries -inf, broadcastable to each other but for that axis), returned split per block. Callers
    keep their keys in separate blocks (a cache and new rows; a shared chain and per-query rows) so
    no block is copied to build one big key axis."""
    m = functools.reduce(jnp.maximum, [s.max(-1, keepdims=True) for s in scores])
    p = [jnp.exp(s - m) for s in scores]
    denom = functools.reduce(jnp.add, [x.sum(-1, keepdims=True) for x in p])
    return [x / denom for x in p]


def output_projection(lp: dict, o: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """o [..., Nq*D] attention values, x [..., H] the layer's normed input (for the output gate) ->
    [..., H]."""
    if cfg.attn_gate:
        o = o * jax.nn.sigmoid(dense(x, lp["wq_gate"]))
    o = dense(o, lp["wo"])
    if cfg.o_bias:
        o = o + lp["bo"]
    return o


def attention(lp: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
              cos: jax.Array, sin: jax.Array, cfg: ModelConfig, query: jax.Array | None = None):
    """T new tokens at positions [pos, pos+T) over the cached positions [0, pos).

    x [B, T, H] (normed); k_cache/v_cache [B, Nkv, S, D], read only (entries >= pos are ignored).
    Returns (out [B, T, H], k_new [B, Nkv, T, D], v_new [B, Nkv, T, D]); the caller writes k_new/v_new
    into the cache. Keeping the cache read-only here lets a layer scan leave it in place instead of
    threading (and copying) it through the loop carry. With `query` ([Tq] indices into the T tokens, 0 <= i < T) only
    those tokens query (out [B, Tq, H]); every token still gives its key and value: a drafter whose last
    layer only its newest row leaves pays that layer's scores, output projection and MLP for one row.
    """
    B, T, _ = x.shape
    S = k_cache.shape[2]
    q, k, v = project_qkv(lp, x, cos, sin, cfg)
    k = k.astype(k_cache.dtype).transpose(0, 2, 1, 3)  # [B, Nkv, T, D]
    v = v.astype(v_cache.dtype).transpose(0, 2, 1, 3)
    at = jnp.arange(T) if query is None else query  # [Tq] the querying tokens' indices
    if query is not None:
        q, x = q[:, query], x[:, query]

    # Two key blocks, cached [0, pos) and new [pos, pos+T), under one softmax.
    qg = group_queries(q, cfg)
    s_old = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    # The mask goes through an optimisation barrier: with pos a compile-time constant (prefill at 0)
    # XLA would otherwise constant-fold the masked [B, Nkv, G, T, S] block and its max element by
    # element, which takes seconds to minutes at compile time for long prompts.
    s_old = jnp.where(jax.lax.optimization_barrier(jnp.arange(S) < pos), s_old, -jnp.inf)
    s_new = jnp.where(at[:, None] >= jnp.arange(T), s_new, -jnp.inf)
    p_old, p_new = softmax_blocks([s_old, s_new])
    # The values' product keeps the cache's head-major order in its output ([B, Nkv, G, T, D]) and the small
    # result is transposed after: asked for [B, T, ...] directly, XLA:CPU transposes the whole value cache first.
    o = (jnp.einsum("bkgts,bksd->bkgtd", p_old.astype(v.dtype), v_cache)
         + jnp.einsum("bkgts,bksd->bkgtd", p_new.astype(v.dtype), v)).transpose(0, 3, 1, 2, 4)
    return output_projection(lp, o.reshape(B, at.shape[0], cfg.q_size), x, cfg), k, v
