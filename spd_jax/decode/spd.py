"""The SPD engine: one jitted `shard_map` program over the `stage` mesh axis running prefill and the
whole decode loop (`lax.while_loop`) on device.

Placement (one device per stage; see SPD.md for the algorithm and notation):
- stage s holds only its layers' weights and caches and runs them on its in-flight token each cycle;
  hidden states move to stage s+1 with one `ppermute` per cycle;
- embedding and LM head are split by vocabulary rows over the devices where their count divides the
  vocabulary (`ec.vocab_rows`; else each holds them whole and reads its rows), the final norm replicated.
  The heads are computed vocabulary-parallel (`decode.vocab`): the last stage's output and the PSM's
  hidden state are broadcast ([H] each) and every device computes the logits of its 1/D of the
  vocabulary (a PSM without a draft vocabulary reads the same placed head, `pipelined.place_psm`);
- the embedding of each token is looked up once, when it is chosen, and kept by position (`LoopState.embeds`):
  stage 0 and the drafter read it there. Split by rows, a greedy choice's embedding rides the choices'
  all-gather (each device sends the row of its own shard's best token, which it holds; the winner's is
  kept), so the cycle keeps its three collectives; a sampled choice, or a draft from a draft vocabulary,
  adds an all-reduce of the rows;
- the PSM's layers run on one device (`lax.cond`): a stage (`psm_device`; the last when None; the
  host's default, placement "auto", is the stage whose placement gives the shortest predicted cycle,
  busiest device + collectives, `costs.cycle.best_psm_device`) or a device of its own (n + 1
  devices, the paper's set-up; that device holds no layers, only its shards of the heads). Either way
  the PSM's draft starts from the states at the start of the cycle, not after that cycle's stage work (a
  drafter with `after_stage` set, PPSD's early-exit head, drafts after that stage's step instead, on its
  device, from what it made: `SpdCycle.made`). Its
  head runs on every device's shard; greedy choice, sampling draws and the accept/replace decision
  come out of collectives over `stage` that move scalars (plus each shard's k best logits under a
  top-k filter), so they are identical everywhere; the draft distributions q that sampling
  verification needs stay on the shard that made them;
- the committed sequence and the pipeline bookkeeping are replicated: each in-flight token's position
  follows from the newest position t and its depth (t - d), so nothing else travels.

Drafters (`drafters.base.SpdDrafter`, a static part of the engine's config): the Pipeline Speculation
Module (`drafters.psm.PSMDrafter`), PPSD's early-exit head (`drafters.ppsd.PPSDDrafter`), none
(`NoDrafter`: the plain pipeline, one token in flight, the resource-matched baseline) and oracle
(`OracleDrafter`, tests only: proposes given reference tokens).
The engine hands a drafter the cycle's state and its own pieces (`SpdCycle`, `SpdOps`): the embedding,
a cond onto the drafter's device, the broadcast from it, and the choice over the vocabulary shards.

Rollback after a rejection at position r is free of copies: attention caches are position-indexed,
Gated DeltaNet layers read their state for position r-1 from a ring of n saved states, and the PSM's
rows at positions >= its completed prefix are recomputed every cycle anyway.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.decode import vocab
from spd_jax.decode.sampling import token_key
from spd_jax.models import decoder
from spd_jax.sharding import STAGE, STAGE_RULES, logical_spec, vary
from spd_jax.pipeline.stages import StageLayout, program, stage_forward
from spd_jax.drafters.base import SpdCycle, SpdDrafter, SpdOps

# Test hook only: accept every draft (a deliberately wrong rule the sampling test must detect).
_TEST_ACCEPT_EVERY_DRAFT = False


class LoopState(NamedTuple):
    """The decode loop's replicated carry (the same on every stage: it comes out of collectives)."""

    seq: jax.Array  # [S] int32: committed tokens, then the in-flight drafts
    t: jax.Array  # position of the newest token (the one entering stage 0)
    valid: jax.Array  # [n] bool: whether the token at depth d (position t - d) is in flight
    completed: jax.Array  # positions < completed are verified
    cached: jax.Array  # positions < cached are in the drafter's state
    n_commit: jax.Array  # positions < n_commit are committed
    table: jax.Array  # [W, m, H] anchor states of recent positions, a ring over positions
    embeds: jax.Array  # [W, H] the embedding of each recent position's token, the same ring
    cycles: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    done: jax.Array


class StageCarry(NamedTuple):
    """The decode loop's per-stage carry (varying over `stage`)."""

    x: jax.Array  # [1, 1, H] the hidden state entering this stage next cycle
    cache: Any  # this stage's layer caches
    dstate: Any  # the drafter's state (its cache: used on the drafter's device)
    qring: jax.Array  # [n, rows] this stage's shard of q for each in-flight draft (sampling with drafts)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cfg: ModelConfig
    layout: StageLayout
    drafter: SpdDrafter  # hashable: a frozen dataclass of static configuration
    greedy: bool
    filtered: bool
    top_k_cap: int  # 0 = no top-k; else a power of two >= top_k: the candidates a top-k filter gathers per shard
    prompt_pad: int
    cache_len: int
    psm_device: int | None = None  # the drafter's device: a stage 0..n-1 (None: the last) or n (its own)
    vocab_rows: bool = False  # the embedding and heads split by vocabulary rows over the devices (else whole on each)

    def __post_init__(self):
        if self.drafter.k not in (0, 1):
            raise ValueError(f"the SPD engine drafts one token per cycle (k = 1) or none (k = 0); "
                             f"{type(self.drafter).__name__} has k = {self.drafter.k}")
        if self.drafter.plan is not None and tuple(self.drafter.plan) != self.layout.plan.counts:
            raise ValueError(f"the drafter was made for the stage plan {list(self.drafter.plan)}, the engine runs "
                             f"{list(self.layout.plan.counts)}")
        if self.drafter.anchors and self.drafter.anchors != self.layout.anchors:
            raise ValueError(f"the drafter reads anchors {self.drafter.anchors}, the stage layout gathers "
                             f"{self.layout.anchors}")
        after = self.drafter.after_stage
        if after is not None and self.psm_dev != after:
            raise ValueError(f"{type(self.drafter).__name__} drafts after stage {after}'s step, on that stage's "
                             f"device; psm_device is {self.psm_dev}")
        if not 0 <= self.psm_dev <= self.n or (self.psm_dev == self.n) != (self.layout.devices == self.n + 1):
            raise ValueError(f"psm_device {self.psm_device} with {self.layout.devices} devices for {self.n} stages: "
                             f"a stage 0..{self.n - 1}, or {self.n} (its own device) with a layout of n + 1 devices")

    @property
    def n(self) -> int:
        return self.layout.plan.n

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def psm_dev(self) -> int:
        return self.n - 1 if self.psm_device is None else self.psm_device


def build(ec: EngineConfig, mesh, placed: tuple | None = None):
    """-> jitted fn(stage_w, prog, shared, drafter_params, caches, drafter_state, prompt, prompt_len,
    max_new, eos_ids, sp) -> (seq [S], n_commit, cycles, accepted, rejected, seq_per_stage [devices, S],
    caches, drafter_state). Caches and the drafter's state ([devices, ...], one copy per device) are
    donated. mesh: `stage`, or `stage x model` (each stage tensor-parallel). placed: the PartitionSpecs
    of `shared` and `drafter_params` as placed (`arg_specs`: the
    embedding and heads split by vocabulary rows where `ec.vocab_rows`, a drafter's head with them or
    replicated); default replicated. Per-stage stacks are split, the rest replicated."""
    # per-stage buffers (weights, programs, caches) lead with the "stage" logical axis; the rest is replicated
    rep, st = logical_spec((), STAGE_RULES), logical_spec(("stage",), STAGE_RULES)
    body = functools.partial(_engine, ec)
    # On a `stage x model` mesh the body is manual over `stage` only: `model` stays automatic inside it, so
    # each stage's layers run on their weights as placed (split by heads and MLP columns, `STAGE_TP_RULES`)
    # and XLA's partitioner adds the all-reduces over `model` within the stage (the engine's own
    # collectives are over `stage`, between the stages' groups of devices).
    manual = {"axis_names": frozenset({STAGE})} if len(mesh.axis_names) > 1 else {}
    smap = jax.shard_map(
        body, mesh=mesh, **manual,
        in_specs=(st, st, *(placed or (rep, rep)), st, st, rep, rep, rep, rep, rep),
        out_specs=(rep, rep, rep, rep, rep, st, st, st),
        # Varying-ness is checked: replicated values (the sequence, the bookkeeping, the decision) come
        # out of psum-broadcasts from the deciding stage, so JAX proves them identical on every stage;
        # per-stage values (hidden states, caches, PSM state) are cast varying where a replicated
        # constant meets them in a cond/switch branch or a loop carry (`vary`).
        check_vma=True)
    return jax.jit(smap, donate_argnums=(4, 5))


def arg_specs(tree) -> Any:
    """The PartitionSpec of every leaf of a placed pytree (each a NamedSharding on the engine's mesh)."""
    return jax.tree.map(lambda a: a.sharding.spec, tree)


def _engine(ec: EngineConfig, stage_w, prog, shared, dparams, caches, dstate, prompt, prompt_len, max_new,
            eos_ids, sp):
    cfg, lay, n = ec.cfg, ec.layout, ec.n
    last, m, H, S, Pp = n - 1, len(lay.anchors), cfg.hidden_size, ec.cache_len, ec.prompt_pad
    D = ec.devices  # n, or n + 1 with the PSM on its own device (which runs no layers)
    W = n + 2  # anchor-table ring over positions; > the n + 1 positions a cycle can touch
    s = jax.lax.axis_index(STAGE)
    w = jax.tree.map(lambda t: t[0], stage_w)
    pr = jax.tree.map(lambda t: t[0], prog)
    cache = jax.tree.map(lambda t: t[0], caches)
    dstate = jax.tree.map(lambda t: t[0], dstate)
    fwd = [(i, i + 1) for i in range(n - 1)]
    drafter = ec.drafter
    drafts, gathers = drafter.k > 0, bool(drafter.anchors)  # static: what the cycle computes
    # the stage that makes each anchor (-1: none, e.g. h_0), static: where a cycle's anchor states land
    # in the table follows from it and the replicated bookkeeping, so only the states themselves travel
    made_by = [-1] * m
    for stage, ids in enumerate(program(cfg, lay)["anchor_id"]):
        for a in ids[ids >= 0]:
            made_by[int(a)] = stage
    made_by = jnp.asarray(made_by, jnp.int32)  # [m]
    produces = made_by == s  # [m] the anchors this stage makes

    def bcast(v, src=last):
        """A value computed on stage `src` -> the same value on every stage."""
        v = jnp.asarray(v)
        return jax.lax.psum(jnp.where(s == src, v, jnp.zeros_like(v)), STAGE).astype(v.dtype)

    def permute(x):
        return jax.lax.ppermute(x, STAGE, fwd) if n > 1 else x

    # ---------------- the heads, one vocabulary shard per stage (decode.vocab): target logits of rows
    # [start, start + rows) from the final hidden state broadcast by the last stage
    V = cfg.vocab_size
    vs = vocab.Shards(V, D)
    ids_v, own_v = vs.ids(s), vs.own(s)
    head = decoder.lm_head(shared, cfg)  # this device's rows [vs.rows, H] with vocab_rows, else all [V, H]

    def own_rows(ids):
        """Token ids [...] -> [..., H]: their embeddings where this device holds the row, zeros elsewhere (the
        table split by rows), or every embedding (the table whole on each device)."""
        if not ec.vocab_rows:
            return decoder.embed(shared, ids)
        at = ids - vs.start(s)
        mine = (at >= 0) & (at < vs.rows)
        rows = jnp.take(shared["embed"], jnp.clip(at, 0, vs.rows - 1), axis=0)
        return jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))

    def lookup(ids):
        """Token ids [...] -> the embeddings [..., H], the same on every device (split by rows: an all-reduce of
        each device's rows; every device calls it)."""
        return jax.lax.psum(own_rows(ids), STAGE) if ec.vocab_rows else own_rows(ids)

    def cap(rows):  # candidates per shard for a filter: without top-k, top-p may keep any of them
        return min(rows, ec.top_k_cap) if ec.top_k_cap else rows

    def warp(logits, own, rows):
        return vocab.warp(logits, own, sp["temperature"], sp["top_k"], sp["top_p"], ec.filtered, cap(rows), STAGE)

    def target_logits(h):
        """h [H], the same on every stage -> this stage's shard of the target's logits [rows]."""
        return jnp.where(own_v, decoder.head_logits(h, shared["final_norm"], head, cfg, vs.start(s), vs.rows),
                         -jnp.inf)

    def target_choice(logits, pos):
        if ec.greedy:
            return vocab.argmax(logits, ids_v, STAGE)
        return vocab.categorical(token_key(sp["seed"], pos), warp(logits, own_v, vs.rows), ids_v, V, STAGE)

    # ---------------- the drafter's head, sharded over the devices as the target's is: its rows (V, or a
    # draft vocabulary's V') split D ways, the choice made by collectives
    on_drafter = s == ec.psm_dev

    def draft_logits(drafter_head, token_ids):
        """-> (this device's shard of the drafter head's logits [rows] (-inf off its own rows), their
        token ids [rows], the head's `Shards`)."""
        hs = vocab.Shards(V if token_ids is None else token_ids.shape[0], D)
        rows, own = hs.ids(s), hs.own(s)
        logits = jnp.where(own, drafter_head(hs.start(s), hs.rows), -jnp.inf)
        return logits, rows if token_ids is None else token_ids[rows], hs

    def draft_sampled(logits, ids, hs, token_ids, pos):
        """A draw for `pos` with its draft key from the drafter head's shard -> (token, q [vs.rows]: this
        device's shard of the draft's target-vocabulary distribution, which verification reads)."""
        own = hs.own(s)
        warped = warp(logits, own, hs.rows)
        d = vocab.categorical(jax.random.fold_in(token_key(sp["seed"], pos), vocab.DRAFT), warped, ids, V, STAGE)
        q = vocab.softmax(warped, STAGE)  # over this device's head rows
        if token_ids is not None:  # head rows -> this device's target-vocabulary shard (V' values cross, not V)
            every = jax.lax.all_gather(q, STAGE)  # [D, rows]
            row_of = jnp.stack([hs.ids(r) for r in range(D)])
            q_rows = jnp.zeros(token_ids.shape, q.dtype).at[row_of].add(
                jnp.where(jnp.stack([hs.own(r) for r in range(D)]), every, 0.0))
            at = token_ids - vs.start(s)  # position in this device's target-vocabulary shard
            mine = (at >= 0) & (at < vs.rows) & (token_ids >= s * vs.rows)
            q = jnp.zeros((vs.rows,), q.dtype).at[jnp.where(mine, at, vs.rows)].add(q_rows, mode="drop")
        return d, q

    ops = SpdOps(
        final_norm=shared["final_norm"],
        on_device=lambda fn, other, operand: jax.lax.cond(on_drafter, fn, other, operand),
        vary=lambda v: vary(v, STAGE))

    # ---------------- prefill: the prompt through the stages in turn, one stage per iteration; a loop,
    # not n unrolled copies of the stage, so compile time does not grow with n
    emb = lookup(prompt)  # [1, Pp, H]
    x0 = vary(emb, STAGE)  # each stage's hidden state is its own from the first round on

    def prefill_round(r, carry):
        x, cache, anc_prompt = carry
        x, cache, anc = jax.lax.cond(
            s == r,
            lambda a: stage_forward(w, a[1], pr, a[0], jnp.int32(0), cfg, lay, length=prompt_len),
            lambda a: (a[0], a[1], vary(jnp.zeros((m, 1, Pp, H), a[0].dtype), STAGE)),
            (x, cache))
        x = jnp.where(r < last, permute(x), x)  # the last stage keeps its output
        return x, cache, anc_prompt + anc

    x, cache, anc_prompt = jax.lax.fori_loop(0, n, prefill_round, (x0, cache, vary(jnp.zeros((m, 1, Pp, H), emb.dtype), STAGE)))
    h_last = bcast(jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)[0, 0])  # [H], the last stage's
    y0 = target_choice(target_logits(h_last), prompt_len)

    if gathers:  # the prompt's anchor states, every position verified, into the drafter's state
        anchor_states = jax.lax.psum(anc_prompt[:, 0], STAGE).at[0].set(emb[0])  # [m, Pp, H]
        dstate = drafter.spd_prefill(dparams, dstate, anchor_states, ops)

    positions = jnp.arange(S)
    seq = jnp.where(positions < prompt_len, jnp.zeros((S,), jnp.int32).at[:Pp].set(prompt[0]), 0)
    seq = seq.at[prompt_len].set(y0)
    sampled_drafts = drafts and not ec.greedy
    state = LoopState(seq=seq, t=prompt_len, valid=jnp.zeros((n,), bool).at[0].set(True), completed=prompt_len,
                      cached=prompt_len, n_commit=prompt_len + 1, table=jnp.zeros((W, m, H), emb.dtype),
                      embeds=jnp.zeros((W, H), emb.dtype).at[prompt_len % W].set(lookup(y0)),
                      cycles=jnp.int32(0), accepted=jnp.int32(0), rejected=jnp.int32(0),
                      done=jnp.any(y0 == eos_ids) | (max_new <= 1))
    # per-stage carries: what the stages compute differs between them from the first cycle on
    local = vary(StageCarry(x=jnp.zeros((1, 1, H), emb.dtype), cache=cache, dstate=dstate,
                            qring=jnp.zeros((n, vs.rows) if sampled_drafts else (1, 1), jnp.float32)), STAGE)
    budget_end = prompt_len + max_new  # positions < budget_end may be generated

    def verify_sampled(st, loc, h):
        """Every stage, on its vocabulary shard: the token at p leaves the last stage (h [H], its output,
        on every device); its logits decide position p+1 (the same decision on every stage: it comes
        out of collectives). Greedy verification is in the cycle, its argmax gathered with the draft's."""
        p1 = st.t - last + 1
        has_next = st.valid[last - 1] if n > 1 else jnp.bool_(False)
        logits = target_logits(h)
        drafted = st.seq[p1]
        # the draft at p1's q (read only when has_next; without drafts there is none)
        q_dist = loc.qring[p1 % n] if sampled_drafts else jnp.zeros((vs.rows,), jnp.float32)
        ok, y = vocab.verify_sampled(token_key(sp["seed"], p1), warp(logits, own_v, vs.rows), q_dist, drafted,
                                     has_next, ids_v, own_v, V, STAGE)
        if _TEST_ACCEPT_EVERY_DRAFT:
            ok = has_next
        return ok, y

    def cycle(carry):
        st, loc = carry
        t, valid, seq = st.t, st.valid, st.seq

        # 1. the drafter's network for x_{t+1}, from the states at the start of the cycle (early start)
        can_draft = (t + 1 < budget_end) & drafts
        dstate, qring = loc.dstate, loc.qring
        cyc = SpdCycle(seq=seq, t=t, completed=st.completed, cached=st.cached, table=st.table, embeds=st.embeds)
        early = drafts and drafter.after_stage is None
        if early:
            x_draft, dstate = drafter.spd_draft(dparams, dstate, cyc, ops)  # [H], the drafter's device's

        # 2. every stage advances its token
        # a PSM device of its own (s == n) holds no stage: never valid
        pos_s, valid_s = t - s, (s < n) & valid[jnp.minimum(s, n - 1)]
        x_in = jnp.where(s == 0, st.embeds[t % W][None, None], loc.x)  # stage 0's token, embedded when chosen
        x_out, cache, anc = jax.lax.cond(
            valid_s,
            lambda a: stage_forward(w, a[1], pr, a[0], pos_s, cfg, lay),
            lambda a: (a[0], a[1], vary(jnp.zeros((m, 1, 1, H), a[0].dtype), STAGE)),
            (x_in, loc.cache))
        if drafts and not early:  # a drafter reading what its stage made this cycle (PPSD's early exit): after it
            x_draft, dstate = drafter.spd_draft(dparams, dstate, cyc._replace(made=anc[:, 0, 0]), ops)

        # 3. the cycle's one broadcast of [H] values: every device's packet to every device (one all-gather):
        # its output (the last stage's is the token verified), the anchor states it made (each anchor has
        # one maker) and the drafter's hidden state. One dtype for the packet, the widest of them, so each
        # value comes back exactly. (The next stage's input goes by the pipeline's own ppermute, step 5.)
        parts = [x_out[0, 0][None]] + ([anc[:, 0, 0]] if gathers else []) + ([x_draft[None]] if drafts else [])
        dt = jnp.result_type(*parts)
        every = vocab.gather(jnp.concatenate([p.astype(dt) for p in parts]), STAGE)  # [D, 1 + m + drafts, H]
        h_verify = every[last, 0].astype(x_out.dtype)
        table = st.table
        if gathers:
            fresh = every[jnp.maximum(made_by, 0), 1 + jnp.arange(m)].astype(table.dtype)  # [m, H] from the makers
            came = (made_by >= 0) & valid[jnp.maximum(made_by, 0)]  # [m], replicated
            slot, a_ids = (t - made_by) % W, jnp.arange(m)  # the maker's token position t - s, in the ring
            table = table.at[slot, a_ids].set(jnp.where(came[:, None], fresh, table[slot, a_ids]))

        # 4. the heads on every device's shard: the draft for t + 1, and the verification of the token
        # leaving the last stage (skipped while the pipeline refills: `verified` is replicated, so every
        # stage takes the same branch); the decisions come out of collectives, identical everywhere
        verified = valid[last]
        p1 = t - last + 1
        has_next = valid[last - 1] if n > 1 else jnp.bool_(False)
        draft, token_ids = jnp.int32(0), None
        if drafts:
            head, token_ids = drafter.spd_head(dparams, every[ec.psm_dev, -1].astype(x_draft.dtype), cyc, ops)
            d_logits, d_ids, hs = draft_logits(head, token_ids)
        if ec.greedy:  # both argmaxes from one all-gather of each shard's best (`vocab.argmax`, two heads)
            none = vary(vocab.shard_best(jnp.full((1,), -jnp.inf), jnp.zeros((1,), jnp.int32)), STAGE)
            best = jnp.stack([jax.lax.cond(verified, lambda h: vocab.shard_best(target_logits(h), ids_v),
                                           lambda h: none, h_verify)]
                             + ([vocab.shard_best(d_logits, d_ids)] if drafts else []))  # [1 + drafts, 2]
            # split by rows, each shard's best token's embedding rides along (the device holds its row)
            packet = jnp.concatenate([best, vocab.as_words(own_rows(best[:, 1]))], axis=-1) if ec.vocab_rows else best
            every_best = vocab.gather(packet, STAGE)  # [D, 1 + drafts, 2 (+ the row's words)]
            chosen = vocab.best_of(every_best[..., :2])  # [1 + drafts]
            y, draft = chosen[0], chosen[-1] if drafts else draft
            ok = has_next & (seq[p1] == y)  # `vocab.verify_greedy`'s rule
            rode = vocab.winner_rows(every_best, chosen, emb.dtype) if ec.vocab_rows else None
        else:
            if drafts:
                draft, q = draft_sampled(d_logits, d_ids, hs, token_ids, t + 1)
                if sampled_drafts:
                    qring = qring.at[(t + 1) % n].set(q)
            ok, y = jax.lax.cond(verified, lambda a: verify_sampled(*a), lambda a: (jnp.bool_(False), jnp.int32(0)),
                                 (st, loc._replace(qring=qring), h_verify))
        accept = verified & ok
        replace = verified & ~ok
        # the embedding of the token entering stage 0 next cycle (t + 1's draft, or p1's replacement)
        if ec.greedy and ec.vocab_rows:
            # a draft vocabulary's rows are not split as the embedding's: the shard of the best draft row need not
            # hold the draft's embedding row, so the draft is looked up (an all-reduce)
            emb_y, emb_d = rode[0], (rode[-1] if token_ids is None else lookup(draft))
        else:
            emb_y, emb_d = lookup(jnp.stack([y, draft]))  # one all-reduce of both rows when split by rows
        next_t = jnp.where(replace, p1, t + 1)
        seq = jnp.where(replace, seq.at[p1].set(y), seq)
        committed = seq[p1]
        draft_ok = can_draft & ~replace
        seq = jnp.where(draft_ok, seq.at[jnp.minimum(t + 1, S - 1)].set(draft), seq)
        n_commit = jnp.where(verified, p1 + 1, st.n_commit)
        flushed = jnp.zeros((n,), bool).at[0].set(True)
        shifted = jnp.concatenate([draft_ok[None], valid[:-1]])
        fed = replace | draft_ok
        embeds = jnp.where(fed, st.embeds.at[next_t % W].set(jnp.where(replace, emb_y, emb_d)), st.embeds)
        new = LoopState(
            seq=seq, table=table, embeds=embeds,
            t=next_t,
            valid=jnp.where(replace, flushed, shifted),
            completed=jnp.where(verified, p1, st.completed),
            cached=st.completed,  # this cycle's draft block wrote every completed row
            n_commit=n_commit,
            cycles=st.cycles + 1,
            accepted=st.accepted + accept.astype(jnp.int32),
            rejected=st.rejected + (replace & has_next).astype(jnp.int32),
            done=(verified & jnp.any(committed == eos_ids)) | (n_commit - prompt_len >= max_new),
        )
        # 5. hidden states move one stage on
        return new, StageCarry(x=permute(x_out), cache=cache, dstate=dstate, qring=qring)

    max_cycles = max_new * n + n + 2  # a safety bound: every n cycles commit at least one token
    state, local = jax.lax.while_loop(lambda c: ~c[0].done & (c[0].cycles < max_cycles), cycle,
                                      (state, local))
    lift = lambda t: t[None]  # noqa: E731
    return (state.seq, state.n_commit, state.cycles, state.accepted, state.rejected,
            state.seq[None], jax.tree.map(lift, local.cache), jax.tree.map(lift, local.dstate))
