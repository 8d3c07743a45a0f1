"""Layer kinds as objects: what a layer of each kind is, in one place. A model is a list of kinds
(`cfg.layer_types` names them; `KINDS` maps a name to its kind, `of(cfg)` lists a model's), and every part of
the library that runs, places, counts or rewinds layers asks the kind, never which kind it is:

- `schema(cfg)`: the layer's weight leaves (`models.schema`, the one weight declaration);
- `init_cache(cfg, n, batch, max_len, ring, dtype)`: the cache of a stack of n layers (attention: a KV
  cache of max_len positions; Gated DeltaNet: a ring of `ring` saved states), `cache_bytes` its size
  without arrays, `layer_cache(stack, i)` layer i's own;
- `block(...)`: the layer (`layers.residual_block` around the kind's mixer) on its own buffers over T tokens
  (prefill, a pipeline stage, a drafter's block); `step(...)`: on one token, as the decode loop runs it;
  `scan_run(...)`: a run of same-kind layers of a stack, one `lax.scan`;
- rollback: an attention cache rewinds for free (entries past the position are masked); a Gated DeltaNet
  ring restores the state of k tokens ago by position (`deltanet`); `align_rows` moves per-row prefilled
  caches into one batch whose prompts end at the same slot, `take_rows` shrinks a batch to its live rows;
- cost: `context_flops`, `state_bytes` and `scores_bytes` per decoded token (`models.costs.kind_cost` adds
  the weights'; `every_row_leaves` what a block's non-querying tokens run),
  and `tp_mixer_axes`, the logical axes whose split splits the mixer's context work and its cache.

A new kind: a subclass here, its leaves in `models.schema`, an entry in `KINDS`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.models import schema
from spd_jax.models.attention import (KVCache, attention, group_queries, init_kv_cache, output_projection,
                                      project_qkv, softmax_blocks)
from spd_jax.models.deltanet import (LinearState, gated_deltanet, init_linear_state, read_slot, write_slot,
                                     write_slots)
from spd_jax.models.layers import residual_block, rms_norm


def after(t: jax.Array, x: jax.Array) -> jax.Array:
    """t, made data-dependent on x without changing it (0 * x is exactly 0 for finite x).

    A cache write whose value does not depend on the layer's output may be scheduled before the
    layer reads the cache; XLA then copies the whole cache to keep the old entries, every step."""
    return t + (jnp.zeros((), x.dtype) * x.reshape(-1)[0]).astype(t.dtype)


class Run(NamedTuple):
    """What a run of same-kind layers reads from a stack's cache before the run and writes after it."""

    cache: Any  # the stack's cache, updated by the runs that write it in place (attention)
    new: Any  # what the run leaves for the stack's write after all runs (Gated DeltaNet's new states), or None


class LayerKind:
    """One layer kind. Subclasses implement its mixer; the residual block around it is `layers.residual_block`."""

    name: str
    # the weight leaves every token of a block runs where only some of them query (`attention.attention`'s
    # `query`): none but attention's, whose q/k/v projection runs on every token before the queries are picked
    every_row_leaves: tuple[str, ...] = ()
    # logical axes whose split by tensor parallelism splits the mixer's context (or state) work, and its cache:
    # (the heads' axes, the cache's axes); a split needs every axis of a group split
    tp_mixer_axes: tuple[tuple[str, ...], tuple[str, ...]]

    def __repr__(self) -> str:
        return f"LayerKind({self.name!r})"

    def schema(self, cfg: ModelConfig) -> dict[str, schema.Leaf]:
        return schema.layer_schema(cfg, self.name)

    def params(self, cfg: ModelConfig) -> int:
        return schema.param_count(self.schema(cfg))

    def decode_weights(self, lp: dict, cfg: ModelConfig, fuse_qkv: bool = True) -> dict:
        """One layer's weights (no layer axis) as `step` reads them fastest (`decoder.decode_layers`)."""
        return lp

    def scores_bytes(self, cfg: ModelConfig, context_len: int, rows: int) -> int:
        """Intermediate bytes of `rows` querying tokens that grow with the context (none but attention's)."""
        return 0


class Attention(LayerKind):
    """Full (softmax) attention over a static KV cache (`models.attention`). Rollback is free: entries at
    positions >= the current one are masked, and the next write lands on them."""

    name = ATTENTION
    tp_mixer_axes = (("q_heads",), ("kv_heads",))
    every_row_leaves = ("wq", "wk", "wv")

    def init_cache(self, cfg: ModelConfig, n_layers: int, batch: int, max_len: int, ring: int, dtype) -> KVCache:
        return init_kv_cache(cfg, n_layers, batch, max_len, dtype)

    def cache_bytes(self, cfg: ModelConfig, n_layers: int, max_len: int, ring: int, cache_bytes: int,
                    split: int = 1) -> int:
        """K and V of n_layers layers, batch 1, [Nkv / split, S, D] each (split: the KV heads' tensor split)."""
        return 2 * n_layers * (cfg.num_kv_heads // split) * max_len * cfg.head_dim * cache_bytes

    def decode_weights(self, lp: dict, cfg: ModelConfig, fuse_qkv: bool = True) -> dict:
        """With fuse_qkv, w_qkv [H, (Nq + 2 Nkv) D] (and b_qkv) in place of wq/wk/wv: one matmul (small
        matrices run far below the memory bandwidth)."""
        if fuse_qkv:
            lp["w_qkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=-1)
            if cfg.qkv_bias:
                lp["b_qkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
        return lp

    def cache_axes(self, leading: tuple[str, ...] = ()) -> KVCache:
        """Logical axes of a stack's cache, k/v [layers, B, Nkv, S, D], `leading` axes prepended."""
        kv = (*leading, "layers", "batch", "kv_heads", "seq", "head_dim")
        return KVCache(kv, kv)

    def layer_cache(self, cache: KVCache, i: int) -> KVCache:
        """Layer i's cache of a stack's: k/v [B, Nkv, S, D]."""
        return KVCache(cache.k[i], cache.v[i])

    def align_rows(self, cache: KVCache, shift: jax.Array) -> KVCache:
        """A prefilled cache of B rows, k/v [B, 1, Nkv, S, D] (row b's prompt at slots [0, len_b)) -> [B, Nkv,
        S, D] with row b moved right by shift[b] = P - len_b, so every prompt ends at slot P. What wraps round
        to the front lies before the row's start and is masked."""
        roll = jax.vmap(lambda t, s: jnp.roll(t, s, axis=1))  # per row, over the cache axis of [Nkv, S, D]
        return KVCache(roll(cache.k[:, 0], shift), roll(cache.v[:, 0], shift))

    def take_rows(self, cache: KVCache, rows: jax.Array) -> KVCache:
        """A decode batch's layer cache, k/v [B, Nkv, S, D] -> the rows [B'] of it (a batch shrunk to its live rows)."""
        return KVCache(cache.k[rows], cache.v[rows])

    def context_flops(self, cfg: ModelConfig, context_len: int) -> int:
        """Scores and weighted values over the context, per query head."""
        return 2 * 2 * cfg.num_heads * cfg.head_dim * context_len

    def state_bytes(self, cfg: ModelConfig, context_len: int, cache_bytes: int) -> int:
        return 2 * cfg.kv_size * context_len * cache_bytes

    def scores_bytes(self, cfg: ModelConfig, context_len: int, rows: int) -> int:
        """The float32 scores [Nq, rows, context] of `rows` querying tokens, which an unfused attention (this
        library's, on every backend) passes through memory four times: written by the keys' product, read by
        the softmax, written as probabilities, read by the values' product. Next to the cache they matter only
        for many rows over few KV heads (SmolLM2's PSM block: 9 rows, 9 query heads over 3 KV heads)."""
        return 4 * rows * cfg.num_heads * context_len * 4

    def layer(self, lp, x, k_c, v_c, pos, cos, sin, cfg, query=None):
        """The layer over T tokens at [pos, pos+T): x [B, T, H], k_c/v_c [B, Nkv, S, D] read only -> (x, (k_new,
        v_new) [B, Nkv, T, D]), which the caller writes. With `query` ([Tq] indices), x out is theirs only
        ([B, Tq, H]; `attention.attention`)."""
        def mixer(h):
            o, k, v = attention(lp, h, k_c, v_c, pos, cos, sin, cfg, query)
            return o, (k, v)

        if query is None:
            return residual_block(lp, x, mixer, cfg)
        return residual_block(lp, x[:, query], mixer, cfg,
                              mixer_input=rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps, cfg.norm_offset))

    def scan_run(self, lp, x, a: int, n: int, pos, cos, sin, cfg, collect_hidden: bool, run: Run, length=None,
                 every_state: bool = False):
        """Layers [a, a+n) of a stack (lp: their weights, stacked) -> (x, Run, hidden [n, B, T, H] or None)."""
        kv = run.cache

        def body(x, xs):
            p, k_c, v_c = xs
            x, (k_new, v_new) = self.layer(p, x, k_c, v_c, pos, cos, sin, cfg)
            return x, (k_new, v_new, x if collect_hidden else None)

        x, (k_new, v_new, h) = jax.lax.scan(body, x, (lp, kv.k[a:a + n], kv.v[a:a + n]))
        # One in-place write per run (the cache is donated by the callers' jits).
        kv = KVCache(jax.lax.dynamic_update_slice(kv.k, k_new, (a, 0, 0, pos, 0)),
                     jax.lax.dynamic_update_slice(kv.v, v_new, (a, 0, 0, pos, 0)))
        return x, Run(kv, None), h

    def begin(self, cache: KVCache, pos) -> Run:
        return Run(cache, None)

    def end(self, run: Run, pos, T: int, length=None, every_state: bool = False) -> KVCache:
        return run.cache

    def block(self, lp, x, cache: KVCache, pos, cos, sin, cfg, length=None, query=None):
        """The layer on its own buffers (weights without a layer axis, k/v [B, Nkv, S, D]): x [B, T, H] at
        [pos, pos+T) -> (x, cache with the T keys and values written in place). A stage or a drafter running
        its layers one buffer each reads every weight and cache entry once. `query`: as in `layer`."""
        x, (k_new, v_new) = self.layer(lp, x, cache.k, cache.v, pos, cos, sin, cfg, query)
        return x, KVCache(jax.lax.dynamic_update_slice(cache.k, after(k_new, x), (0, 0, pos, 0)),
                          jax.lax.dynamic_update_slice(cache.v, after(v_new, x), (0, 0, pos, 0)))

    def step(self, lp, x, kv: KVCache, slot, cos, sin, cfg, start=None, block: int | None = None):
        """The layer for one token (x [B, 1, H]; cos/sin made for its position) on `decoder.decode_layers`
        weights; writes the token's key/value at cache slot `slot`. Same math as `attention.attention`: one
        softmax over the cached slots [start, slot) (start [B], default 0) and the new key; with `block`, over
        the cache's first ceil(slot / block) blocks only (`_live_blocks_attention`)."""
        B = x.shape[0]

        def mixer(h):
            q, k, v = project_qkv(lp, h, cos, sin, cfg)
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
            return output_projection(lp, o.reshape(B, 1, cfg.q_size), h, cfg), (k, v)

        x, (k, v) = residual_block(lp, x, mixer, cfg)
        kv = KVCache(jax.lax.dynamic_update_slice(kv.k, after(k, x)[:, :, None], (0, 0, slot, 0)),
                     jax.lax.dynamic_update_slice(kv.v, after(v, x)[:, :, None], (0, 0, slot, 0)))
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


class GatedDeltaNet(LayerKind):
    """Gated DeltaNet (Qwen3.5's linear attention, `models.deltanet`): a recurrent state in a ring of R slots
    indexed by position, so restoring the state of k < R tokens ago is running the next call at pos - k."""

    name = LINEAR
    tp_mixer_axes = (("conv", "v_heads"), ("conv", "v_heads"))  # the conv channels by key-head group, the state by value heads

    def init_cache(self, cfg: ModelConfig, n_layers: int, batch: int, max_len: int, ring: int, dtype) -> LinearState:
        return init_linear_state(cfg, n_layers, batch, ring, dtype)

    def cache_bytes(self, cfg: ModelConfig, n_layers: int, max_len: int, ring: int, cache_bytes: int,
                    split: int = 1) -> int:
        """Conv inputs [K-1, C] (cache dtype) and recurrent state [Hv, Dk, Dv] (float32), `ring` each, over
        split (the value heads' tensor split)."""
        lc = cfg.linear
        if lc is None or not n_layers:
            return 0
        per = (lc.conv_kernel - 1) * lc.conv_dim * cache_bytes + lc.num_v_heads * lc.k_dim * lc.v_dim * 4
        return n_layers * ring * per // split

    def cache_axes(self, leading: tuple[str, ...] = ()) -> LinearState:
        """Logical axes of a stack's ring: conv [layers, R, B, K-1, C], ssm [layers, R, B, Hv, Dk, Dv]."""
        return LinearState((*leading, "layers", "ring", "batch", None, "conv"),
                           (*leading, "layers", "ring", "batch", "v_heads", None, None))

    def layer_cache(self, cache: LinearState, i: int) -> LinearState:
        """Layer i's ring of a stack's, a stack of one: conv [1, R, B, K-1, C], ssm [1, R, B, Hv, Dk, Dv]."""
        return jax.tree.map(lambda t: t[i:i + 1], cache)

    def align_rows(self, cache: LinearState, shift: jax.Array) -> LinearState:
        """Recurrent states carry no positions: the stacked per-row rings [B, 1, R, 1, ...] (one prefill per
        row) become the batch axis [1, R, B, ...]."""
        return jax.tree.map(lambda t: jnp.moveaxis(t[:, :, :, 0], 0, 2), cache)

    def take_rows(self, cache: LinearState, rows: jax.Array) -> LinearState:
        """A decode batch's one-layer ring, [1, R, B, ...] -> the rows [B'] of it."""
        return jax.tree.map(lambda t: jnp.take(t, rows, axis=2), cache)

    def context_flops(self, cfg: ModelConfig, context_len: int) -> int:
        """Decay, S^T k, rank-1 update, S^T q: ~4 passes over the state, plus the conv."""
        lc = cfg.linear
        return 2 * lc.conv_kernel * lc.conv_dim + 8 * lc.num_v_heads * lc.k_dim * lc.v_dim

    def state_bytes(self, cfg: ModelConfig, context_len: int, cache_bytes: int) -> int:
        lc = cfg.linear
        return 2 * lc.num_v_heads * lc.k_dim * lc.v_dim * 4 + 2 * (lc.conv_kernel - 1) * lc.conv_dim * cache_bytes

    def layer(self, lp, x, conv_prev, s_prev, length, cfg, every_state: bool = False):
        """The layer over T tokens from the state (conv_prev, s_prev) -> (x, (conv_new, s_new))."""
        return residual_block(lp, x, lambda h: (lambda o, c, s: (o, (c, s)))(
            *gated_deltanet(lp, h, conv_prev, s_prev, cfg, length, every_state=every_state)), cfg)

    def begin(self, cache: LinearState, pos) -> Run:
        return Run(cache, (read_slot(cache, pos), [], []))

    def scan_run(self, lp, x, a: int, n: int, pos, cos, sin, cfg, collect_hidden: bool, run: Run, length=None,
                 every_state: bool = False):
        (conv_prev, s_prev), convs, ssms = run.new

        def body(x, xs):
            p, c_prev, st_prev = xs
            x, (conv_new, s_new) = self.layer(p, x, c_prev, st_prev, length, cfg, every_state)
            return x, (conv_new, s_new, x if collect_hidden else None)

        x, (conv_new, s_new, h) = jax.lax.scan(body, x, (lp, conv_prev[a:a + n], s_prev[a:a + n]))
        return x, Run(run.cache, ((conv_prev, s_prev), convs + [conv_new], ssms + [s_new])), h

    def end(self, run: Run, pos, T: int, length=None, every_state: bool = False) -> LinearState:
        _, convs, ssms = run.new
        if every_state:
            return write_slots(run.cache, jnp.concatenate(convs), jnp.concatenate(ssms), pos)
        last = pos + (T if length is None else length) - 1
        return write_slot(run.cache, jnp.concatenate(convs), jnp.concatenate(ssms), last)

    def block(self, lp, x, cache: LinearState, pos, cos, sin, cfg, length=None):
        """The layer on its own buffers (a one-layer ring, conv [1, R, B, K-1, C]): x [B, T, H] at [pos, pos+T),
        `length` of them real (default T) -> (x, the ring with the state after the last real token in its slot)."""
        conv_prev, s_prev = read_slot(cache, pos)
        x, (conv_new, s_new) = self.layer(lp, x, conv_prev[0], s_prev[0], length, cfg)
        last = pos + (x.shape[1] if length is None else length) - 1
        return x, write_slot(cache, after(conv_new, x)[None], after(s_new, x)[None], last)

    def step(self, lp, x, cache: LinearState, slot, cos, sin, cfg, start=None, block: int | None = None):
        """One token: `block` on one row (the state needs no positions, start and block unused)."""
        return self.block(lp, x, cache, slot, cos, sin, cfg)


KINDS: dict[str, LayerKind] = {k.name: k for k in (Attention(), GatedDeltaNet())}
# the drafters' layers (the PSM's, PPSD's, EAGLE-3's): full attention of the target's sizes
FULL_ATTENTION = KINDS[ATTENTION]


def of(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    """The kinds cfg's layers are, in the fixed order of `KINDS` (each once)."""
    return tuple(k for name, k in KINDS.items() if name in cfg.layer_types)


def layers_of(cfg: ModelConfig, kind: LayerKind) -> tuple[int, ...]:
    """The model layers of `kind`, in order: the i-th is the i-th of its stack (`params["layers"][kind.name]`)."""
    return tuple(i for i, name in enumerate(cfg.layer_types) if name == kind.name)
