"""The Pipeline Speculation Module (PSM): a small drafter that reads hidden states at several depths.

Input rows, one per position: a token whose hidden states are known up to anchor b_a is projected by
its aggregation type a: g_a = W_a concat(h_{b_0}, ..., h_{b_a}) (h_0 = the embedding). Completed
tokens use the deepest type; an in-flight token at depth d uses f(d), the deepest type whose anchors
it already has (the "depth staircase", fixed by the anchors and the stage plan). The rows run through
Ls full-attention decoder layers of the target's kind (own KV cache, RoPE at absolute positions), the
target's final norm (frozen, shared) and an LM head initialised from the target's. Only the newest
row's output is a draft.

Optionally the head covers a draft vocabulary: the V' target tokens most frequent in the training
responses (their ids in the `vocab` collection). Drafts then never propose another token, q is zero
outside it (sampling stays lossless: verification only ever sees a q with zeros), and the head and
the training loss over V' cost V'/V of the full ones.

Optionally (`own_head`) the head is the PSM's own, trained with it from the target's rows (the reference
trains its head; by default it is the target's, shared and frozen, and a checkpoint does not store it).

Optionally (`qk_norm`) the layers norm q and k per head (RMSNorm over head_dim, their own weights) where the
target's attention does not: Qwen3's attention over the target's shapes, as the authors' reference builds its
PSM layers for a Llama target (`spd_jax.convert.reference_psm`); a no-op for targets that norm them already.

Optionally (`anchor_norm`) each anchor state is RMS-normalised over H with its own learned gain before the
projections: the target's states are badly scaled for a linear map (SmolLM2: RMS 0.12 for the embedding,
11.5 at h_22, 28 at h_29 with one dimension near 550: scales over two orders of magnitude apart in one
projection's input).

This module holds the PSM's config and network: staircase typing (`row_types`), rows, the engine's
per-cycle draft (`PSM.draft_hidden`, `PSM.draft_step` the same draft whole) and the training forward
(`PSM.train_hidden`), which computes for every query position and fill exactly what `draft_step`
computes at inference (tests/test_psm_train.py checks it). The engine adapter is `psm.engine`, the
training fills and teacher-forced drafts `psm.fills`, init and the registry entry `psm.kind`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.drafters.shared import DraftHead, attention_layers, run_attention_layers, target_signature
from spd_jax.models import decoder
from spd_jax.models.attention import KVCache, group_queries, output_projection, project_qkv, softmax_blocks
from spd_jax.models.kinds import FULL_ATTENTION
from spd_jax.models.layers import dense_dot_general, residual_block, rms_norm, rope_cos_sin


def quarter_anchors(num_layers: int) -> tuple[int, ...]:
    """The paper's anchors (0, 8, 16, 24, 31 for L = 32) scaled to L: quarters of the depth and the
    last layer's input (strictly increasing, duplicates dropped for tiny L)."""
    raw = [round(i * num_layers / 4) for i in range(4)] + [num_layers - 1]
    return tuple(sorted(set(b for b in raw if 0 <= b < num_layers)))


def default_anchors(num_layers: int, stage_counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """The reference code's depth-aware anchors [0, l, 3l, 6l, L-1]: the states a token has after 1, 3
    and 6 stages (with uneven stages, the plan's own depths), so in-flight tokens use what they already
    carry. Valid when 6 stages end before layer L-1; otherwise the quarters."""
    if stage_counts is not None and len(stage_counts) >= 7:
        depth = [sum(stage_counts[:d]) for d in range(len(stage_counts) + 1)]
        cand = (0, depth[1], depth[3], depth[6], num_layers - 1)
        if all(a < b for a, b in zip(cand, cand[1:])):
            return cand
    return quarter_anchors(num_layers)


@dataclasses.dataclass(frozen=True)
class PSMConfig:
    anchors: tuple[int, ...]
    num_layers: int  # Ls
    plan: tuple[int, ...]  # layers per pipeline stage: the staircase depends on it
    target: tuple  # (model_type, hidden, layers, vocab, heads, kv heads): the target it belongs to
    draft_vocab: int = 0  # V': the head's size over the draft vocabulary; 0 = the target's whole vocabulary
    anchor_norm: bool = False  # RMS-normalise each anchor state (own gain per anchor) before the projections
    own_head: bool = False  # the head is the PSM's own (trained, stored), not the target's shared frozen one
    qk_norm: bool = False  # the layers norm q and k per head though the target's do not (`layer_config`)

    @classmethod
    def for_target(cls, cfg: ModelConfig, stage_counts: Sequence[int], num_layers: int = 2,
                   anchors: Sequence[int] | None = None, draft_vocab: int = 0,
                   anchor_norm: bool = False, own_head: bool = False, qk_norm: bool = False) -> "PSMConfig":
        plan = tuple(int(c) for c in stage_counts)
        if sum(plan) != cfg.num_layers or min(plan) < 1:
            raise ValueError(f"stage plan {list(plan)} does not split the model's {cfg.num_layers} layers")
        anchors = tuple(int(a) for a in anchors) if anchors is not None else default_anchors(cfg.num_layers, plan)
        if not anchors:
            raise ValueError("anchors is empty: give at least anchor 0 (the embedding), e.g. "
                             f"{default_anchors(cfg.num_layers, plan)}, or None for the default")
        if anchors[0] != 0 or list(anchors) != sorted(set(anchors)) or anchors[-1] > cfg.num_layers:
            raise ValueError(f"anchors must start at 0, increase strictly and stay <= {cfg.num_layers}: {anchors}")
        if num_layers < 1:
            raise ValueError(f"the PSM needs at least one layer, got {num_layers}")
        if not 0 <= draft_vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab must be in 0..{cfg.vocab_size} (0: the whole vocabulary), got {draft_vocab}")
        draft_vocab = 0 if draft_vocab == cfg.vocab_size else int(draft_vocab)
        qk_norm = bool(qk_norm) and not cfg.qk_norm  # one identity for one network: on only where it adds norms
        return cls(anchors, num_layers, plan, target_signature(cfg), draft_vocab, bool(anchor_norm), bool(own_head),
                   qk_norm)

    @property
    def n(self) -> int:
        return len(self.plan)

    @property
    def m(self) -> int:
        return len(self.anchors)

    @property
    def reads_target_head(self) -> bool:
        """Its head is the target's (shared, frozen: no draft vocabulary, no head of its own): the SPD engine
        then computes the draft's logits with the verification's, in one pass over each device's rows."""
        return not self.draft_vocab and not self.own_head

    @property
    def staircase(self) -> tuple[int, ...]:
        """f(d) for depths d = 0..n-1 (the deepest type whose anchors a token that passed d stages
        has), then the deepest type (completed tokens) as entry n."""
        depth = [sum(self.plan[:d]) for d in range(self.n)]
        return tuple(max(a for a, b in enumerate(self.anchors) if b <= depth[d]) for d in range(self.n)) + (self.m - 1,)


def row_types(spec: PSMConfig, depth: jax.Array, completed: jax.Array) -> jax.Array:
    """The aggregation type of a row: the deepest type for a completed token, else f(depth). The one
    typing rule (training's groups read the same `staircase` per slot, as static indices)."""
    stair = jnp.asarray(spec.staircase, jnp.int32)
    return jnp.where(completed, spec.m - 1, stair[jnp.clip(depth, 0, spec.n)])


def layer_config(cfg: ModelConfig, spec: PSMConfig) -> ModelConfig:
    """The config the PSM's layers follow: the target's, with per-head q/k norms added under `qk_norm`.
    Only the layers read it (the anchors, RoPE, the final norm and the head are the target's)."""
    return dataclasses.replace(cfg, qk_norm=True) if spec.qk_norm else cfg


def _layer_schema(cfg: ModelConfig, spec: PSMConfig) -> dict:
    """One full-attention decoder layer of the target's kind (`layer_config`): the target's own weight schema."""
    return FULL_ATTENTION.schema(layer_config(cfg, spec))


class PSM(DraftHead, nn.Module):
    cfg: ModelConfig  # the target's
    spec: PSMConfig
    per_layer: bool = False  # its layers one buffer each (`drafters.shared.split_layers`): the SPD engine's

    def setup(self):
        H, Ls = self.cfg.hidden_size, self.spec.num_layers
        # Logical axes (Flax's logical partitioning) from the target's schema: the rules tables of
        # `spd_jax.sharding` place the PSM with the same names as the target.
        logical = nn.with_logical_partitioning
        self.proj = [nn.Dense(H, use_bias=False, dot_general=dense_dot_general, name=f"proj_{a}",
                              kernel_init=logical(nn.initializers.lecun_normal(), (None, "embed")))
                     for a in range(self.spec.m)]
        if self.spec.anchor_norm:
            # a gain per anchor [m, H], starting at the identity scale of the target's RMSNorm: w = 1, or
            # w = 0 where the norm scales by 1 + w (norm_offset 1, Qwen3.5)
            def identity(key, shape, dtype=jnp.float32):
                return jnp.full(shape, 1.0 - self.cfg.norm_offset, dtype)

            self.anchor_gain = self.param("anchor_gain", logical(identity, (None, "embed")), (self.spec.m, H))
        self.layers = attention_layers(self, layer_config(self.cfg, self.spec), Ls, self.per_layer)
        self.setup_head(logical)

    def norm_anchors(self, h: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states -> [..., m, H] as the projections read them: with anchor_norm, each
        state RMS-normalised over H and scaled by its anchor's gain (the target's rms_norm, eps and offset),
        else h unchanged. The one place both paths (`project_all`, `train_hidden`) normalise, so training
        and inference cannot diverge."""
        if not self.spec.anchor_norm:
            return h
        return rms_norm(h, self.anchor_gain, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def project_all(self, h: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states -> [..., m, H]: every aggregation type's row (entry a reads
        h_{b_0} .. h_{b_a} only, so absent deeper anchors may hold anything)."""
        H, m = self.cfg.hidden_size, self.spec.m
        h = self.norm_anchors(h)
        return jnp.stack([self.proj[a](h[..., :a + 1, :].reshape(*h.shape[:-2], (a + 1) * H)) for a in range(m)], -2)

    def rows(self, h: jax.Array, types: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states; types [...] -> rows [..., H]."""
        return _select(self.project_all(h), types)

    def block_rows(self, h: jax.Array, pc: jax.Array, t: jax.Array, completed: jax.Array,
                   completed_rows: int | None = None) -> jax.Array:
        """The draft block's rows, each projected by its own type only: h [R, m, H] anchor states at
        positions [pc, pc+R), completed before `completed`, in flight at depth t - position up to t ->
        rows [R, H], equal to `rows` with `row_types` (rows after t: unspecified, as there).

        In-flight depths are static (depth d holds the token at t - d, of type f(d)), so each depth's row
        is gathered and projected by its own W_{f(d)}, depths of one type in one matmul, and the deepest
        type W_{m-1} runs on the completed rows, at most the block's first `completed_rows` (default all
        R; the engine's block has at most one: `completed` moves by one per verified cycle, `cached`
        follows it). Per block sum_d (f(d) + 1) H^2 + completed_rows m H^2 multiply-adds instead of
        R m (m + 1) / 2 H^2 for every type at every row (SmolLM2 n = 8: 27 H^2 instead of 135 H^2); the
        weights read are those of the types present (all of them at SmolLM2 n = 8, 15 H^2)."""
        spec, (R, m, H) = self.spec, h.shape
        C = R if completed_rows is None else min(int(completed_rows), R)
        h = self.norm_anchors(h)
        deep = self.proj[m - 1](h[:C].reshape(C, m * H))  # [C, H]
        stair = spec.staircase[:spec.n]
        src = jnp.clip(t - pc - jnp.arange(spec.n), 0, R - 1)  # depth d's row in the block
        by_depth = [None] * spec.n
        for a in sorted(set(stair)):
            ds = [d for d in range(spec.n) if stair[d] == a]
            x_a = self.proj[a](h[src[jnp.asarray(ds)], :a + 1].reshape(len(ds), (a + 1) * H))  # [len(ds), H]
            for j, d in enumerate(ds):
                by_depth[d] = x_a[j]
        flight = jnp.stack(by_depth)  # [n, H]: depth d's row
        i = jnp.arange(R)
        x_flight = flight[jnp.clip(t - pc - i, 0, spec.n - 1)]
        x_deep = deep[jnp.minimum(i, C - 1)]
        return jnp.where((pc + i < completed)[:, None], x_deep, x_flight)

    def forward(self, rows: jax.Array, cache: KVCache, pos: jax.Array, length: jax.Array | None = None,
                last_query: jax.Array | None = None):
        """rows [B, T, H] at positions [pos, pos+T) over the PSM's own cache -> (hidden [B, T, H], cache);
        with `last_query` [Tq] the hidden states of those rows only, [B, Tq, H] (`run_attention_layers`)."""
        return run_attention_layers(self.layers, rows.astype(self.lm_head.dtype), cache, pos,
                                    layer_config(self.cfg, self.spec), length, last_query)

    def head_logits(self, x: jax.Array, final_norm: jax.Array, start: jax.Array | int = 0,
                    rows: int | None = None) -> jax.Array:
        """x [..., H] -> float32 logits [..., V'] over the head's rows (the target's final norm, the
        PSM's head; V' = V without a draft vocabulary), or over rows [start, start + rows) only."""
        return decoder.head_logits(x, final_norm, self.lm_head, self.cfg, start, rows)

    def logits(self, x: jax.Array, final_norm: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V] over the target's vocabulary."""
        return self.expand(self.head_logits(x, final_norm))

    def prefill(self, h: jax.Array, cache: KVCache) -> KVCache:
        """The prompt's rows (h [P, m, H], all completed: deepest type) into the cache at [0, P)."""
        rows = self.rows(h, jnp.full(h.shape[:1], self.spec.m - 1, jnp.int32))
        return self.forward(rows[None], cache, jnp.int32(0))[1]

    def draft_step(self, h: jax.Array, cache: KVCache, pc: jax.Array, t: jax.Array, completed: jax.Array,
                   final_norm: jax.Array):
        """One cycle's draft (the engine's inference path). h [R, m, H]: anchor states of the rows at
        positions [pc, pc+R) (cache holds the completed rows [0, pc); pc <= completed <= t < pc + R);
        t: the newest token. Rows before `completed` are completed (deepest type, they join the cached
        chain), rows in [completed, t] are in flight at depth t - position. -> (logits [V] of the draft
        for t + 1, cache with the block written)."""
        x, cache = self.draft_hidden(h, cache, pc, t, completed)
        return self.logits(x, final_norm), cache

    def draft_hidden(self, h: jax.Array, cache: KVCache, pc: jax.Array, t: jax.Array, completed: jax.Array,
                     completed_rows: int | None = None):
        """`draft_step` up to the head: -> (the draft's hidden state [H] before the final norm, cache).
        The engine applies the head itself, one vocabulary shard per device (`decode.vocab`), and passes
        completed_rows=1 (`block_rows`: completed - pc is at most that many)."""
        rows = self.block_rows(h, pc, t, completed, completed_rows)
        x, cache = self.forward(rows[None], cache, pc, last_query=(t - pc)[None])
        return x[0, 0], cache

    def train_hidden(self, h: jax.Array, blocks: Sequence[tuple[jax.Array, Any, int]]) -> list[jax.Array]:
        """The training forward up to the head: h [B, T, m, H] teacher-forced anchor states; blocks
        [(at [B, Q] query positions, fill [B, Q] / [Q] / int in 1..K, K slots static)] -> per block the
        drafts' hidden states [B, Q, H] before the final norm, entry (b, q) being exactly what
        `draft_hidden` computes for position at[b, q] + 1 when at[b, q] is the newest token and fill[b, q]
        tokens are in flight (tests/test_psm_train.py; `head_logits` then gives the draft logits).

        Layout (exact for any Ls, SPD.md section 6): one shared causal chain of completed rows (deepest
        type) at every position, run once for all blocks, plus per query a group of K slots, slot j =
        the token at at - j in flight at depth j (type f(j)), real for j < fill. A real slot attends to
        the chain up to at - fill and causally to the real slots of its own group (none before the
        sequence start); the others only to the chain and themselves, and no real slot reads them. The
        chain never reads a group, as cached rows never read in-flight ones at inference. The last layer
        runs only slot 0. A query costs K slots, so only positions in the loss pay for groups, and
        blocks of small fills for few slots (`deal_fills`).
        """
        spec = self.spec
        cfg = layer_config(self.cfg, spec)  # the layers' (the target's, but for `qk_norm`): the same RoPE and norms
        B, T, m, H = h.shape
        Ls, dt = spec.num_layers, self.lm_head.dtype
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        h = self.norm_anchors(h.astype(dt))  # once, for the chain and the groups (which gather from it)
        tpos = jnp.arange(T)

        # the chain: every layer's keys and values of the completed rows [B, Nkv, T, D]. Rows are projected
        # where they are used, the chain's deepest type here and a group slot's type at its gathered
        # position (`_groups`), not every type at every position: the gradient of a projection over
        # [B, T, m, H] gathered back into 16+ slots costs XLA:CPU more than the rest of the backward.
        chain_kv = []
        x_c = self.proj[m - 1](h.reshape(B, T, m * H))
        cos_c, sin_c = rope_cos_sin(cfg, tpos)
        cc_mask = jnp.tril(jnp.ones((T, T), bool))
        for layer in range(Ls):
            lp = jax.tree.map(lambda w: w[layer], self.layers)
            xn_c = rms_norm(x_c, lp["attn_norm"], eps, off)
            q_c, k_c, v_c = project_qkv(lp, xn_c, cos_c, sin_c, cfg)  # [B, T, N, D]
            # heads first ([B, Nkv, T, D]), here and in the groups: XLA:CPU then transposes the small q, k, v
            # and outputs rather than the scores (1.45x on the chain's attention forward and backward)
            k_c, v_c = jnp.moveaxis(k_c, 2, 1), jnp.moveaxis(v_c, 2, 1)
            chain_kv.append((k_c, v_c))
            if layer < Ls - 1:  # the chain's own next layer (nothing reads it after the last)
                def mixer(xn, lp=lp, q_c=q_c, k_c=k_c, v_c=v_c):
                    q_h = jnp.moveaxis(group_queries(q_c, cfg), 1, 3)  # [B, Nkv, G, T, D]
                    s = jnp.einsum("bkgtd,bksd->bkgts", q_h, k_c, preferred_element_type=jnp.float32)
                    (p,) = softmax_blocks([jnp.where(cc_mask, s, -jnp.inf)])
                    o = jnp.moveaxis(jnp.einsum("bkgts,bksd->bkgtd", p.astype(dt), v_c), 3, 1).reshape(B, T, cfg.q_size)
                    return output_projection(lp, o, xn, cfg), None

                x_c, _ = residual_block(lp, x_c, mixer, cfg, mixer_input=xn_c)
        return [self._groups(h, chain_kv, at, fill, k) for at, fill, k in blocks]

    def _groups(self, h: jax.Array, chain_kv: list, at: jax.Array, fill, k: int) -> jax.Array:
        """The groups of one block (`train_hidden`): h [B, T, m, H] anchor states, at [B, Q], fills
        (broadcast to [B, Q]) in 1..k, k slots -> [B, Q, H]."""
        spec = self.spec
        cfg = layer_config(self.cfg, spec)  # the layers' (the target's, but for `qk_norm`): the same RoPE and norms
        B, T, m, H = h.shape
        Q = at.shape[1]
        Ls, dt = spec.num_layers, self.lm_head.dtype
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        if not 1 <= k <= spec.n:
            raise ValueError(f"a group has 1..{spec.n} slots (the pipeline depth), got {k}")
        fill = jnp.broadcast_to(jnp.asarray(fill, jnp.int32), at.shape)
        slot = jnp.arange(k)
        pos = at[:, :, None] - slot  # [B, Q, k]: slot j holds the token at - j, in flight at depth j
        real = (slot < fill[..., None]) & (pos >= 0)
        stair = spec.staircase
        h_g = jnp.take_along_axis(h, jnp.maximum(pos, 0).reshape(B, Q * k)[..., None, None], axis=1)  # [B, Qk, m, H]
        h_g = h_g.reshape(B, Q, k, m, H)
        x_g = jnp.stack([self.proj[stair[j]](h_g[:, :, j, :stair[j] + 1].reshape(B, Q, (stair[j] + 1) * H))
                         for j in range(k)], 2)  # [B, Q, k, H]: slot j's row, of type f(j)
        x_g = jnp.where(real[..., None], x_g, 0)
        gg_mask = (real[:, :, None, :] & (slot[:, None] <= slot[None, :])) | jnp.eye(k, dtype=bool)  # [B, Q, J, I]
        gc_mask = jnp.arange(T) <= (at - fill)[..., None]  # [B, Q, S]
        cos_g, sin_g = rope_cos_sin(cfg, pos.reshape(B, Q * k))  # [B, Q*k, R]
        heads = lambda a: a.reshape(B, Q, k, *a.shape[2:])  # noqa: E731  [B, Q*k, ...] -> [B, Q, k, ...]
        for layer in range(Ls):
            lp = jax.tree.map(lambda w: w[layer], self.layers)
            k_c, v_c = chain_kv[layer]
            xn_g = rms_norm(x_g, lp["attn_norm"], eps, off)
            q_g, k_g, v_g = (heads(a) for a in project_qkv(lp, xn_g.reshape(B, Q * k, H), cos_g, sin_g, cfg))
            J = 1 if layer == Ls - 1 else k
            qg = jnp.moveaxis(group_queries(q_g[:, :, :J], cfg), 3, 1)  # [B, Nkv, Q, J, G, D]
            s_gc = jnp.einsum("bkqjgd,bksd->bkqjgs", qg, k_c, preferred_element_type=jnp.float32)
            s_gg = jnp.einsum("bkqjgd,bqikd->bkqjgi", qg, k_g, preferred_element_type=jnp.float32)
            p_gc, p_gg = softmax_blocks([jnp.where(gc_mask[:, None, :, None, None, :], s_gc, -jnp.inf),
                                         jnp.where(gg_mask[:, None, :, :J, None, :], s_gg, -jnp.inf)])
            o = (jnp.einsum("bkqjgs,bksd->bkqjgd", p_gc.astype(dt), v_c)
                 + jnp.einsum("bkqjgi,bqikd->bkqjgd", p_gg.astype(dt), v_g))
            o = jnp.moveaxis(o, 1, 3).reshape(B, Q, J, cfg.q_size)
            # the layer on the J slots that go on (its queries; every slot gave keys and values above)
            x_g, _ = residual_block(lp, x_g[:, :, :J], lambda xn, lp=lp, o=o: (output_projection(lp, o, xn, cfg), None),
                                    cfg, mixer_input=xn_g[:, :, :J])
        return x_g[:, :, 0]

    def __call__(self, h, types, cache, pos, final_norm):
        x, cache = self.forward(self.rows(h, types)[None], cache, pos)
        return self.logits(x[0], final_norm), cache


def _select(g: jax.Array, types: jax.Array) -> jax.Array:
    """g [..., m, H], types [...] -> g[..., types, :]."""
    return jnp.take_along_axis(g, types[..., None, None], axis=-2)[..., 0, :]

