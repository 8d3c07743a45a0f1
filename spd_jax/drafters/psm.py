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

This module is the one home of the PSM's feature code: anchor gathering (`anchor_states`), staircase
typing (`row_types`), rows, the engine's per-cycle draft (`PSMDrafter`: `PSM.draft_hidden`, then the
head on vocabulary shards; `PSM.draft_step` is the same draft whole) and the training forward
(`PSM.train_hidden`), which computes for every query position and fill exactly what `draft_step`
computes at inference (tests/test_psm_train.py checks it), and the teacher-forced drafts by fill that
`decode.schedule` replays into the engine's greedy counts (`drafts_by_fill`, `infer.replay`).
Checkpoints are orbax + a JSON sidecar naming the target (its architecture and a fingerprint of its
weights), pipeline depth, stage plan and anchors they were trained for; a mismatch is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ATTENTION, ModelConfig
from spd_jax.drafters.base import anchor_states, teacher_forward
from spd_jax.drafters.store import read_identity, restore_variables
from spd_jax.models import decoder, schema
from spd_jax.models.attention import (KVCache, group_queries, init_kv_cache, output_projection, project_qkv,
                                      softmax_blocks)
from spd_jax.models.layers import mlp, rms_norm, rope_cos_sin

FORMAT = 2  # psm.json layout version
# Trained PSMs shipped with the package, one directory per (default model, n): "<model>-n<n>".
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "psms"


def shipped_psm(model_name: str | None, n: int) -> Path | None:
    """The trained PSM shipped for a known default model at n stages, if there is one."""
    p = SHIPPED_DIR / f"{model_name}-n{n}"
    return p if model_name and (p / "psm.json").is_file() else None


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

    @classmethod
    def for_target(cls, cfg: ModelConfig, stage_counts: Sequence[int], num_layers: int = 2,
                   anchors: Sequence[int] | None = None, draft_vocab: int = 0) -> "PSMConfig":
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
        return cls(anchors, num_layers, plan, target_signature(cfg), draft_vocab)

    @property
    def n(self) -> int:
        return len(self.plan)

    @property
    def m(self) -> int:
        return len(self.anchors)

    @property
    def staircase(self) -> tuple[int, ...]:
        """f(d) for depths d = 0..n-1 (the deepest type whose anchors a token that passed d stages
        has), then the deepest type (completed tokens) as entry n."""
        depth = [sum(self.plan[:d]) for d in range(self.n)]
        return tuple(max(a for a, b in enumerate(self.anchors) if b <= depth[d]) for d in range(self.n)) + (self.m - 1,)


def target_signature(cfg: ModelConfig) -> tuple:
    return (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads)


def row_types(spec: PSMConfig, depth: jax.Array, completed: jax.Array) -> jax.Array:
    """The aggregation type of a row: the deepest type for a completed token, else f(depth). The one
    typing rule (training's groups read the same `staircase` per slot, as static indices)."""
    stair = jnp.asarray(spec.staircase, jnp.int32)
    return jnp.where(completed, spec.m - 1, stair[jnp.clip(depth, 0, spec.n)])


def teacher_states(target: dict, tokens: jax.Array, cfg: ModelConfig, anchors: Sequence[int]):
    """The frozen target teacher-forced on tokens [B, T] -> (anchor states [B, T, m, H], the last layer's
    output [B, T, H], before the final norm): what a PSM reads and what its teacher's logits come from."""
    emb, hidden, x = teacher_forward(target, tokens, cfg)
    return anchor_states(emb, hidden, anchors), x


@functools.partial(jax.jit, static_argnums=(0, 1))
def drafts_by_fill(cfg: ModelConfig, spec: "PSMConfig", variables: dict, target: dict, tokens: jax.Array,
                   at: jax.Array | None = None):
    """tokens [B, T] -> (the target's greedy next token [B, R] at positions at [B, R] (default: all T),
    the PSM's greedy drafts [B, R, n] for position t + 1 made with newest token t at fill k = 1..n),
    teacher-forced: on the target's own greedy continuation these are the drafts the engine verifies
    (`decode.schedule`). Only the positions asked for pay for the heads."""
    h, x = teacher_states(target, tokens, cfg, spec.anchors)
    at = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if at is None else at
    pick = lambda a: jnp.take_along_axis(a, at[..., None], axis=1)  # noqa: E731  [B, T, H] -> [B, R, H]
    nxt = jnp.argmax(decoder.lm_logits(target, pick(x), cfg), -1)
    psm = PSM(cfg, spec)
    ids = psm.apply(variables, method=PSM.token_ids)
    ys = psm.apply(variables, h, [(at, k, k) for k in range(1, spec.n + 1)], method=PSM.train_hidden)
    drafts = [ids[jnp.argmax(psm.apply(variables, y, target["final_norm"], method=PSM.head_logits), -1)] for y in ys]
    return nxt, jnp.stack(drafts, -1)


def _layer_schema(cfg: ModelConfig) -> dict:
    """One full-attention decoder layer of the target's kind: the target's own weight schema."""
    return schema.layer_schema(cfg, ATTENTION)


class PSM(nn.Module):
    cfg: ModelConfig  # the target's
    spec: PSMConfig

    def setup(self):
        H, Ls = self.cfg.hidden_size, self.spec.num_layers
        # Logical axes (Flax's logical partitioning) from the target's schema: the rules tables of
        # `spd_jax.sharding` place the PSM with the same names as the target.
        logical = nn.with_logical_partitioning
        self.proj = [nn.Dense(H, use_bias=False, name=f"proj_{a}",
                              kernel_init=logical(nn.initializers.lecun_normal(), (None, "embed")))
                     for a in range(self.spec.m)]
        self.layers = {k: self.param(f"layer_{k}", logical(schema.initializer(leaf, self.cfg), ("layers", *leaf.axes)),
                                     (Ls, *leaf.shape))
                       for k, leaf in _layer_schema(self.cfg).items()}
        V = self.spec.draft_vocab or self.cfg.vocab_size
        # a draft vocabulary's rows are not the target's "vocab" axis (another size, other units)
        vocab_axis = "draft_vocab" if self.spec.draft_vocab else "vocab"
        self.lm_head = self.param("lm_head", logical(nn.initializers.normal(0.02), (vocab_axis, "embed")), (V, H))
        if self.spec.draft_vocab:  # [V'] token ids of the head's rows, sorted; not trained
            self.vocab_ids = self.variable("vocab", "ids", lambda: jnp.arange(V, dtype=jnp.int32))

    def project_all(self, h: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states -> [..., m, H]: every aggregation type's row (entry a reads
        h_{b_0} .. h_{b_a} only, so absent deeper anchors may hold anything)."""
        H, m = self.cfg.hidden_size, self.spec.m
        return jnp.stack([self.proj[a](h[..., :a + 1, :].reshape(*h.shape[:-2], (a + 1) * H)) for a in range(m)], -2)

    def rows(self, h: jax.Array, types: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states; types [...] -> rows [..., H]."""
        return _select(self.project_all(h), types)

    def forward(self, rows: jax.Array, cache: KVCache, pos: jax.Array, length: jax.Array | None = None):
        """rows [B, T, H] at positions [pos, pos+T) over the PSM's own cache -> (hidden [B, T, H], cache)."""
        kinds = (ATTENTION,) * self.spec.num_layers
        x, c, _ = decoder.run_layers({ATTENTION: self.layers}, rows.astype(self.lm_head.dtype),
                                     decoder.Cache(cache, None), pos, self.cfg, kinds, length=length)
        return x, c.kv

    def head_logits(self, x: jax.Array, final_norm: jax.Array, start: jax.Array | int = 0,
                    rows: int | None = None) -> jax.Array:
        """x [..., H] -> float32 logits [..., V'] over the head's rows (the target's final norm, the
        PSM's head; V' = V without a draft vocabulary), or over rows [start, start + rows) only."""
        return decoder.head_logits(x, final_norm, self.lm_head, self.cfg, start, rows)

    def token_ids(self) -> jax.Array:
        """[V'] int32: the token id of each head row."""
        if self.spec.draft_vocab:
            return self.vocab_ids.value
        return jnp.arange(self.cfg.vocab_size, dtype=jnp.int32)

    def expand(self, logits: jax.Array) -> jax.Array:
        """[..., V'] head logits -> [..., V] target-vocabulary logits, -inf off the draft vocabulary."""
        if not self.spec.draft_vocab:
            return logits
        full = jnp.full((*logits.shape[:-1], self.cfg.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., self.vocab_ids.value].set(logits)

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

    def draft_hidden(self, h: jax.Array, cache: KVCache, pc: jax.Array, t: jax.Array, completed: jax.Array):
        """`draft_step` up to the head: -> (the draft's hidden state [H] before the final norm, cache).
        The engine applies the head itself, one vocabulary shard per device (`decode.vocab`)."""
        pos = pc + jnp.arange(h.shape[0])
        rows = self.rows(h, row_types(self.spec, t - pos, pos < completed))
        x, cache = self.forward(rows[None], cache, pc)
        return x[0, t - pc], cache

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
        cfg, spec = self.cfg, self.spec
        B, T, m, H = h.shape
        Ls, dt = spec.num_layers, self.lm_head.dtype
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        g = self.project_all(h.astype(dt))  # [B, T, m, H]
        tpos = jnp.arange(T)

        # the chain: every layer's keys and values of the completed rows [B, T, Nkv, D]
        chain_kv = []
        x_c = g[:, :, m - 1]
        cos_c, sin_c = rope_cos_sin(cfg, tpos)
        cc_mask = jnp.tril(jnp.ones((T, T), bool))
        for layer in range(Ls):
            lp = jax.tree.map(lambda w: w[layer], self.layers)
            xn_c = rms_norm(x_c, lp["attn_norm"], eps, off)
            q_c, k_c, v_c = project_qkv(lp, xn_c, cos_c, sin_c, cfg)  # [B, T, N, D]
            chain_kv.append((k_c, v_c))
            if layer < Ls - 1:  # the chain's own next layer (nothing reads it after the last)
                s = jnp.einsum("btkgd,bskd->btkgs", group_queries(q_c, cfg), k_c, preferred_element_type=jnp.float32)
                (p,) = softmax_blocks([jnp.where(cc_mask[:, None, None, :], s, -jnp.inf)])
                o = jnp.einsum("btkgs,bskd->btkgd", p.astype(dt), v_c).reshape(B, T, cfg.q_size)
                y = x_c + output_projection(lp, o, xn_c, cfg)
                x_c = y + mlp(lp, rms_norm(y, lp["mlp_norm"], eps, off), cfg)
        return [self._groups(g, chain_kv, at, fill, k) for at, fill, k in blocks]

    def _groups(self, g: jax.Array, chain_kv: list, at: jax.Array, fill, k: int) -> jax.Array:
        """The groups of one block (`train_hidden`): g [B, T, m, H] every type's row, at [B, Q], fills
        (broadcast to [B, Q]) in 1..k, k slots -> [B, Q, H]."""
        cfg, spec = self.cfg, self.spec
        B, T, m, H = g.shape
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
        x_g = jnp.stack([jnp.take_along_axis(g[:, :, stair[j]], jnp.maximum(pos[:, :, j], 0)[..., None], axis=1)
                         for j in range(k)], 2)  # [B, Q, k, H]
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
            qg = group_queries(q_g[:, :, :J], cfg)  # [B, Q, J, Nkv, G, D]
            s_gc = jnp.einsum("bqjkgd,bskd->bqjkgs", qg, k_c, preferred_element_type=jnp.float32)
            s_gg = jnp.einsum("bqjkgd,bqikd->bqjkgi", qg, k_g, preferred_element_type=jnp.float32)
            p_gc, p_gg = softmax_blocks([jnp.where(gc_mask[:, :, None, None, None, :], s_gc, -jnp.inf),
                                         jnp.where(gg_mask[:, :, :J, None, None, :], s_gg, -jnp.inf)])
            o = (jnp.einsum("bqjkgs,bskd->bqjkgd", p_gc.astype(dt), v_c)
                 + jnp.einsum("bqjkgi,bqikd->bqjkgd", p_gg.astype(dt), v_g)).reshape(B, Q, J, cfg.q_size)
            y = x_g[:, :, :J] + output_projection(lp, o, xn_g[:, :, :J], cfg)
            x_g = y + mlp(lp, rms_norm(y, lp["mlp_norm"], eps, off), cfg)
        return x_g[:, :, 0]

    def __call__(self, h, types, cache, pos, final_norm):
        x, cache = self.forward(self.rows(h, types)[None], cache, pos)
        return self.logits(x[0], final_norm), cache


@dataclasses.dataclass(frozen=True)
class PSMDrafter:
    """The PSM as the SPD engine's drafter (`drafters.base.SpdDrafter`): its state is its KV cache of
    completed rows; each cycle it recomputes the block of rows from the first uncached position to the
    newest token (completed rows of the deepest type, in-flight rows typed by their depth) on the
    drafter's device, and its head runs on every device's shard. params: `init_psm` / `load_psm`'s
    variables."""

    cfg: ModelConfig  # the target's
    spec: PSMConfig
    k: int = 1

    @property
    def anchors(self) -> tuple[int, ...]:
        return self.spec.anchors

    @property
    def plan(self) -> tuple[int, ...]:
        return self.spec.plan

    @property
    def module(self) -> PSM:
        return PSM(self.cfg, self.spec)

    def init(self, params, cache_len: int, dtype):
        return init_kv_cache(self.cfg, self.spec.num_layers, 1, cache_len, dtype)

    def spd_prefill(self, params, state, anchor_states, ops):
        def prefill(cache):  # the rows meet the (per-device) cache inside the layer scan: cast them first
            return self.module.apply(params, ops.vary(jnp.moveaxis(anchor_states, 0, 1)), cache,
                                     method=PSM.prefill)

        return ops.on_device(prefill, lambda cache: cache, state)

    def spd_draft(self, params, state, cycle, ops):
        n, S, W = self.spec.n, cycle.seq.shape[0], cycle.table.shape[0]
        pos = cycle.cached + jnp.arange(n + 1)  # cached <= completed <= t <= cached + n

        def body(cache):
            h = cycle.table[pos % W].at[:, 0].set(ops.embed(cycle.seq[jnp.clip(pos, 0, S - 1)]))  # [n + 1, m, H]
            return self.module.apply(params, ops.vary(h), cache, cycle.cached, cycle.t, cycle.completed,
                                     method=PSM.draft_hidden)

        x, state = ops.on_device(body, lambda cache: (ops.vary(jnp.zeros((self.cfg.hidden_size,), cycle.table.dtype)),
                                                       cache), state)
        h = ops.broadcast(x)  # [H], the drafter device's

        def head(start, rows):
            return self.module.apply(params, h, ops.final_norm, start, rows, method=PSM.head_logits)

        ids = self.module.apply(params, method=PSM.token_ids) if self.spec.draft_vocab else None
        draft, q = ops.choose(head, ids, cycle.t + 1)
        return draft, q, state


def _select(g: jax.Array, types: jax.Array) -> jax.Array:
    """g [..., m, H], types [...] -> g[..., types, :]."""
    return jnp.take_along_axis(g, types[..., None, None], axis=-2)[..., 0, :]


def fill_weights(n: int, accept: float | None = None) -> np.ndarray:
    """[n] probabilities of the simulated pipeline fills 1..n of training.

    accept None: the paper's (SPD.md section 6): n (a full pipeline) with probability 1/2, else uniform on
    1..n-1. accept = p in (0, 1): the fills of the drafts the greedy engine verifies when each is accepted
    with probability p. After a flush the first draft verified was made at fill 1 (only the replacement
    in flight), the next, if that one was accepted, at fill 2, and so on; a full pipeline stays at fill n.
    So P(k) ~ p^(k-1) for k < n and P(n) ~ p^(n-1) / (1 - p). At a low acceptance most verified drafts
    are fill-1 drafts, which the paper's mix samples 1/(2(n-1)) of the time."""
    if n == 1:
        return np.ones(1)
    if accept is None:
        return np.array([0.5 / (n - 1)] * (n - 1) + [0.5])
    if not 0.0 < accept < 1.0:
        raise ValueError(f"fill_accept must be in (0, 1) (a per-draft acceptance), or null for the paper's "
                         f"fills; got {accept}")
    w = accept ** np.arange(n, dtype=np.float64)
    w[-1] /= 1.0 - accept
    return w / w.sum()


def fill_counts(slots: int, n: int, accept: float | None = None) -> tuple[int, ...]:
    """How many of a batch's `slots` query slots (per sequence) train at each pipeline fill 1..n:
    slots * fill_weights(n, accept) rounded by largest remainder, so they sum to slots. Training deals
    each sequence's response positions to its slots at random (`deal_fills`): a position's fill is then
    drawn from fill_weights up to that rounding (under 1/slots per fill), and each fill's queries have a
    static count."""
    w = fill_weights(n, accept) * slots
    counts = np.floor(w).astype(int)
    counts[np.argsort(-(w - counts), kind="stable")[:slots - counts.sum()]] += 1
    return tuple(int(c) for c in counts)


def group_sizes(n: int) -> tuple[int, ...]:
    """The group sizes (slots) training runs fills in: powers of two below n, and n. A fill k runs in
    the smallest that holds it: at most 2k slots, and log2(n) blocks to compile rather than n."""
    return tuple(sorted({min(2 ** i, n) for i in range(n.bit_length() + 1)}))


def deal_fills(keys: jax.Array, queries: int, n: int, accept: float | None = None):
    """keys [B] (one per sequence), Q = queries -> (order [B, Q], a random permutation of each row's query
    slots; blocks [(start, fills [size] int32, K)]: over the reordered slots, [start, start + size) train
    at those fills (`fill_counts(Q)` in all) in groups of K slots (`group_sizes`), for
    `PSM.train_hidden`)."""
    order = jax.vmap(lambda k: jax.random.permutation(k, queries))(keys)
    fills = np.repeat(np.arange(1, n + 1), fill_counts(queries, n, accept)).astype(np.int32)  # [Q] ascending
    blocks, start, lo = [], 0, 1
    for K in group_sizes(n):
        f = fills[(fills >= lo) & (fills <= K)]
        if f.size:
            blocks.append((start, f, K))
            start += f.size
        lo = K + 1
    return order, blocks


def target_head(cfg: ModelConfig, spec, target_params: dict, vocab_ids, dtype, what: str) -> dict:
    """A drafter's frozen LM head copied from the target's -> {"lm_head": [V', H]} (the caller puts it in
    its params), plus {"vocab": {"ids": [V']}} with a draft vocabulary (its rows at vocab_ids, which it
    then needs). what names the drafter in the error."""
    head = decoder.lm_head(target_params, cfg)
    out = {}
    if spec.draft_vocab:
        if vocab_ids is None:
            raise ValueError(f"{what} with a draft vocabulary needs its token ids (vocab_ids)")
        out["vocab"] = {"ids": check_vocab_ids(vocab_ids, spec, cfg)}
        head = head[out["vocab"]["ids"]]
    return dict(out, lm_head=jnp.asarray(head, dtype))


def check_vocab_ids(ids, spec: PSMConfig, cfg: ModelConfig) -> jax.Array:
    """A draft vocabulary's token ids [V']: sorted, distinct, inside the target's vocabulary."""
    a = np.asarray(ids)
    if a.shape != (spec.draft_vocab,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"the draft vocabulary needs {spec.draft_vocab} integer token ids, got shape {a.shape} "
                         f"{a.dtype}")
    if a.size and (a[0] < 0 or a[-1] >= cfg.vocab_size or (np.diff(a) <= 0).any()):
        raise ValueError(f"draft vocabulary ids must be sorted, distinct and in [0, {cfg.vocab_size})")
    return jnp.asarray(a, jnp.int32)


def init_psm(cfg: ModelConfig, spec: PSMConfig, target_params: dict, seed: int = 0, dtype=jnp.float32,
             layers_from_target: bool = False, vocab_ids=None) -> dict:
    """PSM weights: random layers and projections, the LM head copied from the target's (its rows at
    vocab_ids [V'] with a draft vocabulary, which then needs them: `train.loop.draft_vocab_ids`). With
    layers_from_target, the Ls layers start as copies of the target's last Ls full-attention layers."""
    variables = _init_random(cfg, spec, seed)
    params = jax.tree.map(lambda t: t.astype(dtype), variables["params"])
    out = {"params": params, **target_head(cfg, spec, target_params, vocab_ids, dtype, "a PSM")}
    params["lm_head"] = out.pop("lm_head")
    if layers_from_target:
        attn = target_params["layers"].get(ATTENTION)
        have = 0 if attn is None else attn["wq"].shape[0]
        if have < spec.num_layers:
            raise ValueError(f"layers_from_target: the PSM has {spec.num_layers} layers but the target only "
                             f"{have} full-attention layers to copy")
        for k in _layer_schema(cfg):
            # a copy: training donates the PSM's buffers, which must not alias the frozen target's
            params[f"layer_{k}"] = jnp.array(attn[k][have - spec.num_layers:], dtype, copy=True)
    return out


def _init_boxed(cfg: ModelConfig, spec: PSMConfig, seed) -> dict:
    """PSM variables with their logical axes (Flax `LogicallyPartitioned` boxes)."""
    H, T = cfg.hidden_size, 2
    cache = init_kv_cache(cfg, spec.num_layers, 1, T, jnp.float32)
    return PSM(cfg, spec).init(jax.random.key(seed), jnp.zeros((T, spec.m, H)), jnp.zeros((T,), jnp.int32), cache,
                               jnp.int32(0), jnp.ones((H,), jnp.float32))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_random(cfg: ModelConfig, spec: PSMConfig, seed) -> dict:
    return nn.unbox(_init_boxed(cfg, spec, seed))


def psm_axes(cfg: ModelConfig, spec: PSMConfig) -> dict:
    """The PSM's variables pytree with each leaf's logical axes (a tuple) in place of the array, for
    `spd_jax.sharding.tree_shardings` (the `vocab` ids collection: one replicated axis)."""
    boxed = jax.eval_shape(lambda: _init_boxed(cfg, spec, 0))
    return jax.tree.map(lambda x: tuple(x.names) if isinstance(x, nn.LogicallyPartitioned) else (None,) * len(x.shape),
                        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


class PSMCheckpointError(ValueError):
    """A PSM checkpoint that does not belong to this target model (architecture or weights), pipeline
    depth or stage plan."""


def spec_to_json(spec: PSMConfig) -> dict:
    return dict(format=FORMAT, **dataclasses.asdict(spec))


def spec_from_json(d: dict, where: str = "") -> PSMConfig:
    if d.get("format") != FORMAT:
        raise PSMCheckpointError(f"PSM checkpoint {where} has format {d.get('format')!r}, this version reads "
                                 f"format {FORMAT}; retrain it with train.main")
    return PSMConfig(tuple(d["anchors"]), int(d["num_layers"]), tuple(d["plan"]), tuple(d["target"]),
                     int(d.get("draft_vocab", 0)))


def save_psm(path: str | Path, variables: dict, spec: PSMConfig, extra: dict | None = None,
             target_weights: str | None = None) -> None:
    """Write variables (orbax) and the spec (JSON, plus `extra` facts such as training provenance) to a
    new directory `path`. target_weights: the target's `store.target_weights` fingerprint (also accepted in
    extra), recorded so that `load_psm` refuses the PSM for another model of the same architecture;
    without it the PSM loads anywhere its architecture fits, with a warning."""
    from spd_jax.drafters.store import save_drafter

    save_drafter(path, variables, "psm.json", dict(spec_to_json(spec), **(extra or {})), "PSM", target_weights)


def read_spec(path: str | Path) -> PSMConfig:
    path = Path(path).absolute()
    return read_identity(path, "psm.json", spec_from_json, PSMCheckpointError,
                         f"{path} is not a PSM checkpoint (no psm.json); train one with train.main")


def check_spec(spec: PSMConfig, cfg: ModelConfig, stage_counts: Sequence[int], where: str = "",
               anchors: Sequence[int] | None = None) -> None:
    """Refuse a PSM made for another target model, n, stage plan or anchors, naming the mismatch."""
    want = target_signature(cfg)
    if spec.target != want:
        names = ("model_type", "hidden_size", "num_layers", "vocab_size", "num_heads", "num_kv_heads")
        diff = [f"{k}: checkpoint {a} vs model {b}" for k, a, b in zip(names, spec.target, want) if a != b]
        raise PSMCheckpointError(f"PSM checkpoint {where} was trained for another model ({'; '.join(diff)})")
    plan = tuple(int(c) for c in stage_counts)
    if spec.n != len(plan):
        raise PSMCheckpointError(f"PSM checkpoint {where} was trained for n={spec.n} pipeline stages, not "
                                 f"n={len(plan)}; run with --n {spec.n} or train a PSM for n={len(plan)}")
    if spec.plan != plan:
        raise PSMCheckpointError(f"PSM checkpoint {where} was trained for the stage plan {list(spec.plan)} "
                                 f"(layers per stage), not {list(plan)}: its depth staircase depends on it; "
                                 f"run with --stages {','.join(map(str, spec.plan))}")
    if anchors is not None and tuple(anchors) != spec.anchors:
        raise PSMCheckpointError(f"PSM checkpoint {where} reads anchors {list(spec.anchors)}, not "
                                 f"{list(anchors)}")


def load_psm(path: str | Path, cfg: ModelConfig, stage_counts: Sequence[int], target_params: dict,
             dtype=jnp.float32, anchors: Sequence[int] | None = None, target_weights: str | None = None,
             model_name: str | None = None) -> tuple[PSMConfig, dict]:
    """Load a PSM saved by `save_psm`, refusing one trained for another target (another architecture, or
    other weights: psm.json's target_weights against target_weights, the target's `store.target_weights`,
    computed from target_params when not given), n, plan or anchors; model_name names the target in that
    error. A PSM saved without its LM head (psm.json "head": "shared") uses the target's, frozen in
    training."""
    from spd_jax.drafters.store import check_target_weights
    from spd_jax.drafters.store import target_weights as fingerprint

    path = Path(path).absolute()
    spec = read_spec(path)
    check_spec(spec, cfg, stage_counts, str(path), anchors)
    model = model_name or "this model"
    check_target_weights(json.loads((path / "psm.json").read_text()), target_weights or fingerprint(target_params),
                         str(path), model, "PSM", f"train a PSM for {model} (python -m train.main with model: "
                         f"{model}) or use one trained for it", PSMCheckpointError)
    init = lambda zeros: init_psm(cfg, spec, zeros, vocab_ids=np.arange(spec.draft_vocab))  # noqa: E731
    return spec, restore_drafter(path, "psm.json", init, spec, cfg, target_params, dtype)


def restore_drafter(path: Path, meta_name: str, init: Callable[[dict], dict], spec: Any,
                    cfg: ModelConfig, target_params: dict, dtype: Any) -> dict:
    """A saved drafter's variables (PSM or EAGLE-3: `spec` has draft_vocab), floats cast to dtype, token
    ids left integers. init(target params) -> its variables, only traced for their shapes (the target's
    zeros inside the trace: nothing vocabulary-sized is allocated). One saved without its LM head
    (meta_name's "head": "shared") gets the target's (its draft vocabulary's rows of it)."""
    shared = json.loads((path / meta_name).read_text()).get("head") == "shared"

    def shapes():
        zeros = {"embed": jnp.zeros((cfg.vocab_size, cfg.hidden_size)), "final_norm": jnp.zeros((cfg.hidden_size,))}
        if not cfg.tie_word_embeddings:
            zeros["lm_head"] = zeros["embed"]
        return init(zeros)

    abstract = jax.eval_shape(shapes)
    if shared:
        del abstract["params"]["lm_head"]
    variables = restore_variables(path, abstract)
    if spec.draft_vocab:
        check_vocab_ids(variables["vocab"]["ids"], spec, cfg)
    if shared:
        head = decoder.lm_head(target_params, cfg)
        variables["params"]["lm_head"] = head[variables["vocab"]["ids"]] if spec.draft_vocab else head
    return jax.tree.map(lambda t: jnp.asarray(t, dtype if jnp.issubdtype(t.dtype, jnp.floating) else t.dtype),
                        variables)
