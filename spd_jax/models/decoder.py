"""The decoder: pure functions over a pytree of per-kind stacked layer weights.

Shapes: B batch, T new tokens, S cache length, H hidden, V vocab.

Params pytree (what `spd_jax.convert` produces):
    embed        [V, H]
    final_norm   [H]
    lm_head      [V, H]            only when the embeddings are untied
    layers: {kind: stack}, kind in cfg.layer_types ("attention", "linear"); every leaf of a stack has
        a leading axis over that kind's layers, in model order. Common to both kinds:
            attn_norm, mlp_norm [n, H]; w_gate, w_up [n, H, I]; w_down [n, I, H]
        attention: wq [n, H, Nq*D]; wk, wv [n, H, Nkv*D]; wo [n, Nq*D, H]; wq_gate [n, H, Nq*D]
            (gated attention); bq, bk, bv, bo (biases); q_norm, k_norm [n, D] (qk norm)
        linear (Gated DeltaNet): w_qkv [n, H, C]; conv_w [n, K, C]; w_z [n, H, Hv*Dv];
            w_b, w_a [n, H, Hv]; dt_bias, A_log [n, Hv]; norm_w [n, Dv]; w_out [n, Hv*Dv, H]

`run_layers` runs any contiguous range of layers given that range's weights and caches (`slice_layers`
cuts them), so a pipeline stage runs exactly its own layers. `decode_step` is the one-token step on
a per-layer copy of the weights (`decode_layers`) and caches (`split_cache`), the layout a decode
loop reads fastest on the CPU. This module knows nothing about sampling, pipelines or checkpoints.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.models.attention import (KVCache, attention, group_queries, init_kv_cache, output_projection,
                                      softmax_blocks)
from spd_jax.models.deltanet import (LinearState, gated_deltanet, init_linear_state, read_slot, write_slot,
                                     write_slots)
from spd_jax.models.layers import apply_rope, dense, low_precision_dot, mlp, rms_norm, rope_cos_sin

Params = dict


class Cache(NamedTuple):
    """Per-kind caches of a range of layers (None where the range has no layer of that kind)."""

    kv: KVCache | None
    linear: LinearState | None


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, ring: int = 1,
               kinds: tuple[str, ...] | None = None) -> Cache:
    """Caches for `kinds` (default: the whole model). ring: how many past Gated DeltaNet states each
    linear layer keeps, i.e. how far it can rewind (the SPD engine uses the pipeline depth)."""
    kinds = cfg.layer_types if kinds is None else kinds
    n_attn, n_lin = kinds.count(ATTENTION), kinds.count(LINEAR)
    return Cache(init_kv_cache(cfg, n_attn, batch, max_len, dtype) if n_attn else None,
                 init_linear_state(cfg, n_lin, batch, ring, dtype) if n_lin else None)


def slice_layers(params_layers: Params, cache: Cache, cfg: ModelConfig, start: int, stop: int):
    """Weights and caches of layers [start, stop) -> (layers, cache, kinds)."""
    kinds = cfg.layer_types[start:stop]
    before = cfg.layer_types[:start]
    out_layers, out = {}, {}
    for kind in (ATTENTION, LINEAR):
        a, n = before.count(kind), kinds.count(kind)
        if n:
            out_layers[kind] = jax.tree.map(lambda t: t[a:a + n], params_layers[kind])
            c = cache.kv if kind == ATTENTION else cache.linear
            out[kind] = jax.tree.map(lambda t: t[a:a + n], c)
    return out_layers, Cache(out.get(ATTENTION), out.get(LINEAR)), kinds


def attention_layer(lp, x, k_c, v_c, pos, cos, sin, cfg):
    h, k_new, v_new = attention(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset),
                                k_c, v_c, pos, cos, sin, cfg)
    x = x + h
    return x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, cfg.norm_offset), cfg), k_new, v_new


def linear_layer(lp, x, conv_prev, s_prev, length, cfg, every_state: bool = False):
    h, conv_new, s_new = gated_deltanet(lp, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset),
                                        conv_prev, s_prev, cfg, length, every_state=every_state)
    x = x + h
    return x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, cfg.norm_offset), cfg), conv_new, s_new


def run_layers(layers: Params, x: jax.Array, cache: Cache, pos: jax.Array, cfg: ModelConfig,
               kinds: tuple[str, ...] | None = None, collect_hidden: bool = False,
               length: jax.Array | None = None, every_state: bool = False):
    """Run a contiguous range of layers (weights/caches as cut by `slice_layers`; default: all).

    x [B, T, H] at positions [pos, pos+T) -> (x [B, T, H], cache with those positions written,
    hidden [n, B, T, H] or None), where hidden[i] is the output of the i-th layer of the range
    (h_{start+i+1} in SPD notation). Each maximal run of same-kind layers is one `lax.scan`.
    length: how many of the T tokens are real (default T; a prompt padded to a shape bucket), so
    recurrent states end at the last real token. Outputs past `length` are garbage.
    every_state: Gated DeltaNet layers write their state after every one of the T tokens into the
    ring (not only after the last; needs a ring of >= T slots), so the next call may start at any
    position in (pos, pos+T]: chain verification rewinding to its last accepted draft.
    """
    kinds = cfg.layer_types if kinds is None else kinds
    T = x.shape[1]
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(T))
    kv, lin = cache.kv, cache.linear
    lin_prev = read_slot(lin, pos) if lin is not None else None
    new_conv, new_ssm, hidden = [], [], []
    offset = {ATTENTION: 0, LINEAR: 0}
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        a = offset[kind]
        lp = jax.tree.map(lambda t: t[a:a + n], layers[kind])  # a no-op slice when the run is the stack
        if kind == ATTENTION:
            def body(x, xs):
                p, k_c, v_c = xs
                x, k_new, v_new = attention_layer(p, x, k_c, v_c, pos, cos, sin, cfg)
                return x, (k_new, v_new, x if collect_hidden else None)

            x, (k_new, v_new, h) = jax.lax.scan(body, x, (lp, kv.k[a:a + n], kv.v[a:a + n]))
            # One in-place write per run (the cache is donated by the callers' jits).
            kv = KVCache(jax.lax.dynamic_update_slice(kv.k, k_new, (a, 0, 0, pos, 0)),
                         jax.lax.dynamic_update_slice(kv.v, v_new, (a, 0, 0, pos, 0)))
        else:
            def body(x, xs):
                p, conv_prev, s_prev = xs
                x, conv_new, s_new = linear_layer(p, x, conv_prev, s_prev, length, cfg, every_state)
                return x, (conv_new, s_new, x if collect_hidden else None)

            x, (conv_new, s_new, h) = jax.lax.scan(body, x, (lp, lin_prev[0][a:a + n], lin_prev[1][a:a + n]))
            new_conv.append(conv_new)
            new_ssm.append(s_new)
        hidden.append(h)
        offset[kind] += n
    if lin is not None and every_state:
        lin = write_slots(lin, jnp.concatenate(new_conv), jnp.concatenate(new_ssm), pos)
    elif lin is not None:
        last = pos + (T if length is None else length) - 1
        lin = write_slot(lin, jnp.concatenate(new_conv), jnp.concatenate(new_ssm), last)
    return x, Cache(kv, lin), (jnp.concatenate(hidden) if collect_hidden else None)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, H]."""
    return jnp.take(params["embed"], tokens, axis=0)


def lm_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm + LM head: x [B, T, H] -> logits [B, T, V] float32."""
    return head_logits(x, params["final_norm"], lm_head(params, cfg), cfg)


def lm_head(params: Params, cfg: ModelConfig) -> jax.Array:
    """The LM head [V, H] (the embedding when tied)."""
    return params["embed"] if cfg.tie_word_embeddings else params["lm_head"]


def head_logits(x: jax.Array, norm_w: jax.Array, head: jax.Array, cfg: ModelConfig,
                start: jax.Array | int = 0, rows: int | None = None) -> jax.Array:
    """Final norm + the head's rows [start, start + rows) (default all): x [..., H] -> float32
    logits [..., rows]. A vocabulary shard reads only its rows of the head; a head of `rows` rows is that
    shard already (split by rows over the devices) and is read whole."""
    x = rms_norm(x, norm_w, cfg.rms_norm_eps, cfg.norm_offset)
    if rows is not None and head.shape[0] != rows:
        head = jax.lax.dynamic_slice_in_dim(head, start, rows, axis=0)
    if head.dtype == jnp.float32 or head.dtype == jnp.float64:
        return jnp.einsum("...h,vh->...v", x.astype(head.dtype), head, preferred_element_type=jnp.float32)
    return low_precision_dot(x.astype(head.dtype), head, 1)


def forward(params: Params, tokens: jax.Array, cache: Cache, pos: jax.Array, cfg: ModelConfig):
    """tokens [B, T] at positions [pos, pos+T) -> (logits [B, T, V] float32, updated cache).

    Prefill is T = prompt length at pos = 0; a decode step is T = 1.
    """
    x, cache, _ = run_layers(params["layers"], embed(params, tokens), cache, pos, cfg)
    return lm_logits(params, x, cfg), cache


# ---------------------------------------------------------------- one-token decoding, one buffer per layer
#
# A step reads every weight once, so a decode loop is as fast as the weights stream from memory,
# unless XLA adds traffic. On the CPU it does, with the stacked layout: it copies a layer's slice out
# of a stacked weight before the matmuls (in a scan or at static indices), and it copies a whole
# cache when the write of the new key cannot be shown to follow the reads of the old ones. Here each
# layer's weights and caches are separate buffers, the q/k/v projections are one matmul (small
# matrices run far below the memory bandwidth), and every cache write depends on the layer's output.


def decode_layers(layers: Params, cfg: ModelConfig, fuse_qkv: bool = True) -> list[Params]:
    """Per-kind stacks -> one weight dict per layer (model order, no leading axis), a copy for
    `decode_step`. With fuse_qkv, attention layers hold w_qkv [H, (Nq + 2 Nkv) D] (and b_qkv) instead
    of wq/wk/wv; tensor parallelism keeps them apart (a fused column split would not fall on heads)."""
    seen = {ATTENTION: 0, LINEAR: 0}
    out = []
    for kind in cfg.layer_types:
        i = seen[kind]
        seen[kind] += 1
        lp = {k: v[i] for k, v in layers[kind].items()}
        if kind == ATTENTION and fuse_qkv:
            lp["w_qkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=-1)
            if cfg.qkv_bias:
                lp["b_qkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
        out.append(lp)
    return out


def split_cache(cache: Cache, cfg: ModelConfig) -> list[KVCache | LinearState]:
    """A whole model's `Cache` -> one cache per layer in model order: KVCache k/v [B, Nkv, S, D] or a
    one-layer LinearState (conv [1, R, B, K-1, C], ssm [1, R, B, Hv, Dk, Dv])."""
    seen = {ATTENTION: 0, LINEAR: 0}
    out = []
    for kind in cfg.layer_types:
        i = seen[kind]
        seen[kind] += 1
        if kind == ATTENTION:
            out.append(KVCache(cache.kv.k[i], cache.kv.v[i]))
        else:
            out.append(jax.tree.map(lambda t: t[i:i + 1], cache.linear))
    return out


def _after(t: jax.Array, x: jax.Array) -> jax.Array:
    """t, made data-dependent on x without changing it (0 * x is exactly 0 for finite x).

    A cache write whose value does not depend on the layer's output may be scheduled before the
    layer reads the cache; XLA then copies the whole cache to keep the old entries, every step."""
    return t + (jnp.zeros((), x.dtype) * x.reshape(-1)[0]).astype(t.dtype)


def _attention_step(lp: Params, x: jax.Array, kv: KVCache, slot: jax.Array, cos: jax.Array, sin: jax.Array,
                    cfg: ModelConfig, start: jax.Array | None, block: int | None) -> tuple[jax.Array, KVCache]:
    """`attention_layer` for one token (x [B, 1, H]; cos/sin made for its position) on `decode_layers`
    weights; writes the token's key/value at cache slot `slot`. Same math as `attention.attention`: one
    softmax over the cached slots [start, slot) (start [B], default 0) and the new key; with `block`,
    over the cache's first ceil(slot / block) blocks only (`_live_blocks_attention`)."""
    B = x.shape[0]
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if "w_qkv" in lp:
        qkv = dense(h, lp["w_qkv"])
        if cfg.qkv_bias:
            qkv = qkv + lp["b_qkv"]
        q, k, v = qkv[..., :nq * d], qkv[..., nq * d:(nq + nkv) * d], qkv[..., (nq + nkv) * d:]
    else:
        q, k, v = dense(h, lp["wq"]), dense(h, lp["wk"]), dense(h, lp["wv"])
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = q.reshape(B, 1, nq, d), k.reshape(B, 1, nkv, d), v.reshape(B, 1, nkv, d)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, cfg.norm_offset)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = k[:, 0].astype(kv.k.dtype)  # [B, Nkv, D]
    v = v[:, 0].astype(kv.v.dtype)

    qg = group_queries(q[:, 0], cfg)  # [B, Nkv, G, D]
    S = kv.k.shape[2]
    s_new = jnp.einsum("bkgd,bkd->bkg", qg, k, preferred_element_type=jnp.float32)[..., None]
    if block is not None and S > block:
        o = _live_blocks_attention(qg, kv, s_new, v, slot, start, block)
    else:
        s_old = jnp.einsum("bkgd,bksd->bkgs", qg, kv.k, preferred_element_type=jnp.float32)
        valid = jnp.arange(S) < slot
        if start is not None:
            valid = valid & (jnp.arange(S) >= start[:, None, None, None])
        s_old = jnp.where(valid, s_old, -jnp.inf)
        p_old, p_new = softmax_blocks([s_old, s_new])
        o = (jnp.einsum("bkgs,bksd->bkgd", p_old.astype(v.dtype), kv.v)
             + p_new.astype(v.dtype) * v[:, :, None, :])
    x = x + output_projection(lp, o.reshape(B, 1, nq * d), h, cfg)
    x = x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps, cfg.norm_offset), cfg)
    kv = KVCache(jax.lax.dynamic_update_slice(kv.k, _after(k, x)[:, :, None], (0, 0, slot, 0)),
                 jax.lax.dynamic_update_slice(kv.v, _after(v, x)[:, :, None], (0, 0, slot, 0)))
    return x, kv


def _live_blocks_attention(qg: jax.Array, kv: KVCache, s_new: jax.Array, v_new: jax.Array, slot: jax.Array,
                           start: jax.Array | None, block: int) -> jax.Array:
    """Attention of qg [B, Nkv, G, D] over the cached slots [start, slot) and the new key (score s_new
    [B, Nkv, G, 1], value v_new [B, Nkv, D]) -> o [B, Nkv, G, D], reading only the cache blocks of
    `block` slots that hold live slots, with a running (online) softmax: a long preallocated cache
    costs what its filled part costs. Summation order differs from one softmax over all slots."""
    B, nkv, g, _ = qg.shape
    neg = jnp.float32(-1e30)  # finite: a block with no live slot for a row must not give exp(-inf + inf)

    def body(j, carry):
        m, l, acc = carry
        kb = jax.lax.dynamic_slice_in_dim(kv.k, j * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(kv.v, j * block, block, axis=2)
        sc = jnp.einsum("bkgd,bksd->bkgs", qg, kb, preferred_element_type=jnp.float32)
        idx = j * block + jnp.arange(block)
        valid = idx < slot
        if start is not None:
            valid = valid & (idx >= start[:, None, None, None])
        m_new = jnp.maximum(m, jnp.where(valid, sc, neg).max(-1, keepdims=True))
        p = jnp.where(valid, jnp.exp(sc - m_new), 0.0)
        scale = jnp.exp(m - m_new)
        acc = acc * scale + jnp.einsum("bkgs,bksd->bkgd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1, keepdims=True), acc

    init = (jnp.full((B, nkv, g, 1), neg), jnp.zeros((B, nkv, g, 1), jnp.float32),
            jnp.zeros(qg.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, (slot + block - 1) // block, body, init)
    m_f = jnp.maximum(m, s_new)
    scale, p_new = jnp.exp(m - m_f), jnp.exp(s_new - m_f)
    o = (acc * scale + p_new * v_new[:, :, None, :].astype(jnp.float32)) / (l * scale + p_new)
    return o.astype(v_new.dtype)


def attention_block(lp: Params, x: jax.Array, kv: KVCache, pos: jax.Array, cos: jax.Array, sin: jax.Array,
                    cfg: ModelConfig) -> tuple[jax.Array, KVCache]:
    """`attention_layer` on one layer's own buffers (weights without a layer axis, kv k/v [B, Nkv, S, D]):
    x [B, T, H] at positions [pos, pos+T) -> (x, kv with the T keys and values written in place). A stage
    or a drafter running its layers one buffer each reads every weight and cache entry once."""
    x, k_new, v_new = attention_layer(lp, x, kv.k, kv.v, pos, cos, sin, cfg)
    return x, KVCache(jax.lax.dynamic_update_slice(kv.k, _after(k_new, x), (0, 0, pos, 0)),
                      jax.lax.dynamic_update_slice(kv.v, _after(v_new, x), (0, 0, pos, 0)))


def linear_block(lp: Params, x: jax.Array, lin: LinearState, pos: jax.Array, cfg: ModelConfig,
                 length: jax.Array | None = None) -> tuple[jax.Array, LinearState]:
    """`linear_layer` on one layer's own buffers (lin: a one-layer ring, conv [1, R, B, K-1, C]): x [B, T, H]
    at [pos, pos+T), `length` of them real (default T) -> (x, lin with the state after the last real token
    in its slot)."""
    conv_prev, s_prev = read_slot(lin, pos)
    x, conv_new, s_new = linear_layer(lp, x, conv_prev[0], s_prev[0], length, cfg)
    last = pos + (x.shape[1] if length is None else length) - 1
    return x, write_slot(lin, _after(conv_new, x)[None], _after(s_new, x)[None], last)


def decode_step(layers: list[Params], params: Params, token: jax.Array, caches: list, pos: jax.Array,
                cfg: ModelConfig, positions: jax.Array | None = None, start: jax.Array | None = None,
                attn_block: int | None = None) -> tuple[jax.Array, list]:
    """token [B, 1] at pos -> (logits [B, 1, V] float32, caches with pos written).

    layers: `decode_layers` of params["layers"]; caches: `split_cache`'s list (ring states as in
    `init_cache`). params supplies the embedding, final norm and LM head. Unrolled over layers:
    compile time grows with depth, and that buys reading each weight once, in place.

    Rows of different lengths (`decode.ar.generate_batch`): pos is then the cache slot every row writes,
    positions [B] each row's token position (RoPE) and start [B] each row's first valid slot (its prompt
    left-aligned to end where the others' end), so the write stays one in-place slice. Recurrent
    (Gated DeltaNet) states carry no positions and need neither. attn_block: attention reads only the
    cache blocks of that many slots that hold filled slots (a bulk loop whose cache spans the whole
    reply), at the cost of another summation order."""
    x = embed(params, token)
    cos, sin = rope_cos_sin(cfg, (pos if positions is None else positions[:, None]) + jnp.arange(1))
    out = []
    for lp, kind, c in zip(layers, cfg.layer_types, caches):
        if kind == ATTENTION:
            x, c = _attention_step(lp, x, c, pos, cos, sin, cfg, start, attn_block)
        else:
            x, c = linear_block(lp, x, c, pos, cfg)
        out.append(c)
    return lm_logits(params, x, cfg), out
