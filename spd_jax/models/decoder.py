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

from spd_jax.config import ModelConfig
from spd_jax.models.attention import KVCache
from spd_jax.models.deltanet import LinearState
from spd_jax.models.kinds import KINDS
from spd_jax.models.layers import low_precision_dot, rms_norm, rope_cos_sin

Params = dict


class Cache(NamedTuple):
    """Per-kind caches of a range of layers (None where the range has no layer of that kind): the field of a
    kind is its `CACHE_FIELD`."""

    kv: KVCache | None
    linear: LinearState | None


CACHE_FIELD = dict(zip(KINDS, Cache._fields))  # kind name -> its field of `Cache`


def kind_cache(cache: Cache, name: str):
    """The stack of the kind `name`'s caches in cache (None if it has none)."""
    return getattr(cache, CACHE_FIELD[name])


def cache_of(name: str, stack) -> Cache:
    """A `Cache` holding only the kind `name`'s stack (a drafter's layers, all of one kind)."""
    return Cache(**{f: stack if f == CACHE_FIELD[name] else None for f in Cache._fields})


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, ring: int = 1,
               kinds: tuple[str, ...] | None = None) -> Cache:
    """Caches for `kinds` (default: the whole model). ring: how many past Gated DeltaNet states each
    linear layer keeps, i.e. how far it can rewind (the SPD engine uses the pipeline depth)."""
    kinds = cfg.layer_types if kinds is None else kinds
    return Cache(**{CACHE_FIELD[name]: (kind.init_cache(cfg, kinds.count(name), batch, max_len, ring, dtype)
                                        if kinds.count(name) else None) for name, kind in KINDS.items()})


def cache_axes(cfg: ModelConfig, leading: tuple[str, ...] = ()) -> Cache:
    """Logical axes of a whole model's `Cache` leaves, each kind's (`LayerKind.cache_axes`); `leading` axes
    prepended (e.g. "stage")."""
    return Cache(**{CACHE_FIELD[name]: kind.cache_axes(leading) if name in cfg.layer_types else None
                    for name, kind in KINDS.items()})


def slice_layers(params_layers: Params, cache: Cache, cfg: ModelConfig, start: int, stop: int):
    """Weights and caches of layers [start, stop) -> (layers, cache, kinds)."""
    kinds = cfg.layer_types[start:stop]
    before = cfg.layer_types[:start]
    out_layers, out = {}, {}
    for kind in KINDS:
        a, n = before.count(kind), kinds.count(kind)
        if n:
            out_layers[kind] = jax.tree.map(lambda t: t[a:a + n], params_layers[kind])
            out[CACHE_FIELD[kind]] = jax.tree.map(lambda t: t[a:a + n], kind_cache(cache, kind))
    return out_layers, Cache(**{f: out.get(f) for f in Cache._fields}), kinds


def run_layers(layers: Params, x: jax.Array, cache: Cache, pos: jax.Array, cfg: ModelConfig,
               kinds: tuple[str, ...] | None = None, collect_hidden: bool = False,
               length: jax.Array | None = None, every_state: bool = False):
    """Run a contiguous range of layers (weights/caches as cut by `slice_layers`; default: all).

    x [B, T, H] at positions [pos, pos+T) -> (x [B, T, H], cache with those positions written,
    hidden [n, B, T, H] or None), where hidden[i] is the output of the i-th layer of the range
    (h_{start+i+1} in SPD notation). Each maximal run of same-kind layers is one `lax.scan` (the kind's
    `scan_run`). length: how many of the T tokens are real (default T; a prompt padded to a shape bucket),
    so recurrent states end at the last real token. Outputs past `length` are garbage.
    every_state: Gated DeltaNet layers write their state after every one of the T tokens into the
    ring (not only after the last; needs a ring of >= T slots), so the next call may start at any
    position in (pos, pos+T]: chain verification rewinding to its last accepted draft.
    """
    kinds = cfg.layer_types if kinds is None else kinds
    T = x.shape[1]
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(T))
    runs = {name: KINDS[name].begin(kind_cache(cache, name), pos) for name in KINDS if kind_cache(cache, name) is not None}
    hidden = []
    offset = dict.fromkeys(KINDS, 0)
    for name, run in itertools.groupby(kinds):
        n = len(list(run))
        a = offset[name]
        lp = jax.tree.map(lambda t: t[a:a + n], layers[name])  # a no-op slice when the run is the stack
        x, runs[name], h = KINDS[name].scan_run(lp, x, a, n, pos, cos, sin, cfg, collect_hidden, runs[name],
                                                length, every_state)
        hidden.append(h)
        offset[name] += n
    out = {CACHE_FIELD[name]: KINDS[name].end(r, pos, T, length, every_state) for name, r in runs.items()}
    return x, Cache(**{f: out.get(f) for f in Cache._fields}), (jnp.concatenate(hidden) if collect_hidden else None)


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
    of wq/wk/wv (`kinds.Attention.decode_weights`); tensor parallelism keeps them apart (a fused column split
    would not fall on heads)."""
    seen = dict.fromkeys(KINDS, 0)
    out = []
    for kind in cfg.layer_types:
        i = seen[kind]
        seen[kind] += 1
        out.append(KINDS[kind].decode_weights({k: v[i] for k, v in layers[kind].items()}, cfg, fuse_qkv))
    return out


def head_params(params: Params) -> Params:
    """The embedding, final norm (and untied LM head) of params: what `decode_step` reads besides the layers."""
    return {k: v for k, v in params.items() if k != "layers"}


def split_cache(cache: Cache, cfg: ModelConfig) -> list[KVCache | LinearState]:
    """A whole model's `Cache` -> one cache per layer in model order (`LayerKind.layer_cache`): KVCache k/v
    [B, Nkv, S, D] or a one-layer LinearState (conv [1, R, B, K-1, C], ssm [1, R, B, Hv, Dk, Dv])."""
    seen = dict.fromkeys(KINDS, 0)
    out = []
    for kind in cfg.layer_types:
        i = seen[kind]
        seen[kind] += 1
        out.append(KINDS[kind].layer_cache(kind_cache(cache, kind), i))
    return out


def decode_step(layers: list[Params], params: Params, token: jax.Array, caches: list, pos: jax.Array,
                cfg: ModelConfig, positions: jax.Array | None = None, start: jax.Array | None = None,
                attn_block: int | None = None) -> tuple[jax.Array, list]:
    """token [B, 1] at pos -> (logits [B, 1, V] float32, caches with pos written).

    layers: `decode_layers` of params["layers"]; caches: `split_cache`'s list (ring states as in
    `init_cache`). params supplies the embedding, final norm and LM head. Unrolled over layers:
    compile time grows with depth, and that buys reading each weight once, in place.

    Rows of different lengths (`decode.ar.generate_batch`'s decode loop): pos is then the cache slot every row
    writes, positions [B] each row's token position (RoPE) and start [B] each row's first valid slot (its
    prompt padded on the left to end where the others' end), so the write stays one in-place slice. Recurrent
    (Gated DeltaNet) states carry no positions and need neither. attn_block: attention reads only the
    cache blocks of that many slots that hold filled slots (a bulk loop whose cache spans the whole
    reply), at the cost of another summation order."""
    x = embed(params, token)
    cos, sin = rope_cos_sin(cfg, (pos if positions is None else positions[:, None]) + jnp.arange(1))
    out = []
    for lp, kind, c in zip(layers, cfg.layer_types, caches):
        x, c = KINDS[kind].step(lp, x, c, pos, cos, sin, cfg, start, attn_block)
        out.append(c)
    return lm_logits(params, x, cfg), out
