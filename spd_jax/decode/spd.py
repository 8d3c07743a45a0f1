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
from spd_jax.decode.heads import StageHeads
from spd_jax.decode.sampling import token_key
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


class Decision(NamedTuple):
    """A cycle's decisions, replicated (they come out of collectives): the token for the verified position
    p1 = t - (n - 1) + 1 and whether it equals the draft there, the draft for t + 1, the embeddings [H] of
    both, and this stage's ring of draft distributions (with the new draft's q)."""

    y: jax.Array
    ok: jax.Array
    draft: jax.Array
    emb_y: jax.Array
    emb_d: jax.Array
    qring: jax.Array


def _engine(ec: EngineConfig, stage_w, prog, shared, dparams, caches, dstate, prompt, prompt_len, max_new,
            eos_ids, sp):
    """The body `build` maps over the devices: each device's blocks of the per-stage buffers ([1, ...]) ->
    prefill, then the decode loop, one `_Engine.cycle` per iteration, until done (EOS or the budget)."""
    e = _Engine(ec, stage_w, prog, shared, dparams, sp, prompt_len, max_new, eos_ids)
    cache = jax.tree.map(lambda t: t[0], caches)
    dstate = jax.tree.map(lambda t: t[0], dstate)
    state, local = e.prefill(prompt, cache, dstate)
    max_cycles = max_new * ec.n + ec.n + 2  # a safety bound: every n cycles commit at least one token
    state, local = jax.lax.while_loop(lambda c: ~c[0].done & (c[0].cycles < max_cycles), e.cycle, (state, local))
    lift = lambda t: t[None]  # noqa: E731
    return (state.seq, state.n_commit, state.cycles, state.accepted, state.rejected,
            state.seq[None], jax.tree.map(lift, local.cache), jax.tree.map(lift, local.dstate))


class _Engine:
    """One device's part of the engine, traced once: the static layout (stage s, its weights, the anchors'
    makers) and the cycle's steps, each a method: draft (1), stage step (2), exchange (3), heads and
    decision (4), accept or roll back (5), then the hidden states move one stage on."""

    def __init__(self, ec: EngineConfig, stage_w, prog, shared, dparams, sp, prompt_len, max_new, eos_ids):
        cfg, lay, n = ec.cfg, ec.layout, ec.n
        self.ec, self.cfg, self.lay, self.n, self.last = ec, cfg, lay, n, n - 1
        self.m, self.H, self.S, self.Pp = len(lay.anchors), cfg.hidden_size, ec.cache_len, ec.prompt_pad
        self.W = n + 2  # anchor-table ring over positions; > the n + 1 positions a cycle can touch
        self.s = s = jax.lax.axis_index(STAGE)
        self.w = jax.tree.map(lambda t: t[0], stage_w)
        self.pr = jax.tree.map(lambda t: t[0], prog)
        self.dparams, self.sp, self.drafter = dparams, sp, ec.drafter
        self.prompt_len, self.max_new, self.eos_ids = prompt_len, max_new, eos_ids
        self.budget_end = prompt_len + max_new  # positions < budget_end may be generated
        self.drafts, self.gathers = ec.drafter.k > 0, bool(ec.drafter.anchors)  # static: what the cycle computes
        self.sampled_drafts = self.drafts and not ec.greedy
        self.early = self.drafts and ec.drafter.after_stage is None  # drafts at the cycle's start
        # a drafter whose head is the target's own rows (`SpdDrafter.reads_target_head`): both heads in one pass
        # over this device's shard, the verification's and the draft's hidden states as two rows of one dot
        self.one_head = self.drafts and getattr(ec.drafter, "reads_target_head", False)
        # the stage that makes each anchor (-1: none, e.g. h_0), static: where a cycle's anchor states land
        # in the table follows from it and the replicated bookkeeping, so only the states themselves travel
        made_by = [-1] * self.m
        for stage, ids in enumerate(program(cfg, lay)["anchor_id"]):
            for a in ids[ids >= 0]:
                made_by[int(a)] = stage
        self.made_by = jnp.asarray(made_by, jnp.int32)  # [m]
        self.heads = StageHeads(ec, shared, sp, s)
        self.ops = SpdOps(
            final_norm=shared["final_norm"],
            on_device=lambda fn, other, operand: jax.lax.cond(s == ec.psm_dev, fn, other, operand),
            vary=lambda v: vary(v, STAGE))

    def bcast(self, v, src=None):
        """A value computed on stage `src` (default the last) -> the same value on every stage."""
        v = jnp.asarray(v)
        src = self.last if src is None else src
        return jax.lax.psum(jnp.where(self.s == src, v, jnp.zeros_like(v)), STAGE).astype(v.dtype)

    def permute(self, x):
        """Each stage's x -> the next stage's (x [1, 1, H] or [1, Pp, H])."""
        return jax.lax.ppermute(x, STAGE, [(i, i + 1) for i in range(self.n - 1)]) if self.n > 1 else x

    def stage_or_skip(self, run, x, cache, pos, **length):
        """This stage's layers on x [1, T, H] from position pos when run (else x and cache as they are, no
        anchors) -> (x [1, T, H], cache, anchor states [m, 1, T, H]). length: the prompt's, in prefill."""
        m, H, cfg, lay = self.m, self.H, self.cfg, self.lay
        return jax.lax.cond(
            run,
            lambda a: stage_forward(self.w, a[1], self.pr, a[0], pos, cfg, lay, **length),
            lambda a: (a[0], a[1], vary(jnp.zeros((m, 1, a[0].shape[1], H), a[0].dtype), STAGE)),
            (x, cache))

    def prefill(self, prompt, cache, dstate) -> tuple[LoopState, StageCarry]:
        """prompt [1, Pp] through the stages in turn, one stage per iteration (a loop, not n unrolled copies of
        the stage, so compile time does not grow with n); the first new token from the last stage's state;
        the prompt's anchor states into the drafter's state -> the loop's first (LoopState, StageCarry)."""
        n, m, H, Pp, S, W, hd = self.n, self.m, self.H, self.Pp, self.S, self.W, self.heads
        prompt_len, max_new, eos_ids = self.prompt_len, self.max_new, self.eos_ids
        emb = hd.lookup(prompt)  # [1, Pp, H]
        x0 = vary(emb, STAGE)  # each stage's hidden state is its own from the first round on

        def prefill_round(r, carry):
            x, cache, anc_prompt = carry
            x, cache, anc = self.stage_or_skip(self.s == r, x, cache, jnp.int32(0), length=prompt_len)
            x = jnp.where(r < self.last, self.permute(x), x)  # the last stage keeps its output
            return x, cache, anc_prompt + anc

        x, cache, anc_prompt = jax.lax.fori_loop(0, n, prefill_round,
                                                 (x0, cache, vary(jnp.zeros((m, 1, Pp, H), emb.dtype), STAGE)))
        h_last = self.bcast(jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)[0, 0])  # [H], the last stage's
        y0 = hd.target_choice(hd.target_logits(h_last), prompt_len)
        if self.gathers:  # the prompt's anchor states, every position verified, into the drafter's state
            anchor_states = jax.lax.psum(anc_prompt[:, 0], STAGE).at[0].set(emb[0])  # [m, Pp, H]
            dstate = self.drafter.spd_prefill(self.dparams, dstate, anchor_states, self.ops)
        positions = jnp.arange(S)
        seq = jnp.where(positions < prompt_len, jnp.zeros((S,), jnp.int32).at[:Pp].set(prompt[0]), 0)
        seq = seq.at[prompt_len].set(y0)
        state = LoopState(seq=seq, t=prompt_len, valid=jnp.zeros((n,), bool).at[0].set(True), completed=prompt_len,
                          cached=prompt_len, n_commit=prompt_len + 1, table=jnp.zeros((W, m, H), emb.dtype),
                          embeds=jnp.zeros((W, H), emb.dtype).at[prompt_len % W].set(hd.lookup(y0)),
                          cycles=jnp.int32(0), accepted=jnp.int32(0), rejected=jnp.int32(0),
                          done=jnp.any(y0 == eos_ids) | (max_new <= 1))
        # per-stage carries: what the stages compute differs between them from the first cycle on
        local = vary(StageCarry(x=jnp.zeros((1, 1, H), emb.dtype), cache=cache, dstate=dstate,
                                qring=jnp.zeros((n, hd.vs.rows) if self.sampled_drafts else (1, 1), jnp.float32)),
                     STAGE)
        return state, local

    def cycle(self, carry: tuple[LoopState, StageCarry]) -> tuple[LoopState, StageCarry]:
        """One cycle: every stage advances its token, the drafter proposes the token for t + 1, the token
        leaving the last stage is verified, and the bookkeeping accepts or rolls back."""
        st, loc = carry
        cyc = SpdCycle(seq=st.seq, t=st.t, completed=st.completed, cached=st.cached, table=st.table,
                       embeds=st.embeds)
        x_draft, dstate = None, loc.dstate
        if self.early:  # 1. the drafter's network for x_{t+1}, from the states at the start of the cycle
            x_draft, dstate = self.drafter.spd_draft(self.dparams, dstate, cyc, self.ops)  # [H], the drafter's device's
        x_out, cache, anc = self.stage_step(st, loc)  # 2.
        if self.drafts and not self.early:  # a drafter reading what its stage made this cycle (PPSD's early exit)
            x_draft, dstate = self.drafter.spd_draft(self.dparams, dstate, cyc._replace(made=anc[:, 0, 0]), self.ops)
        every, table = self.exchange(st, x_out, anc, x_draft)  # 3.
        dec = self.decide(st, loc, every, x_out.dtype, x_draft, cyc)  # 4.
        new = self.advance(st, dec, table)  # 5.
        # 6. hidden states move one stage on
        return new, StageCarry(x=self.permute(x_out), cache=cache, dstate=dstate, qring=dec.qring)

    def stage_step(self, st: LoopState, loc: StageCarry):
        """Step 2: every stage advances its token in flight (stage s holds position t - s when valid; a PSM
        device of its own, s == n, holds no stage: never valid) -> (x_out [1, 1, H], cache, anchor states
        [m, 1, 1, H] it made)."""
        s, n, t = self.s, self.n, st.t
        pos_s, valid_s = t - s, (s < n) & st.valid[jnp.minimum(s, n - 1)]
        x_in = jnp.where(s == 0, st.embeds[t % self.W][None, None], loc.x)  # stage 0's token, embedded when chosen
        return self.stage_or_skip(valid_s, x_in, loc.cache, pos_s)

    def exchange(self, st: LoopState, x_out, anc, x_draft):
        """Step 3: the cycle's one broadcast of [H] values, every device's packet to every device (one
        all-gather): its output (the last stage's is the token verified), the anchor states it made (each
        anchor has one maker) and the drafter's hidden state. One dtype for the packet, the widest of them,
        so each value comes back exactly. (The next stage's input goes by the pipeline's own ppermute.)
        -> (every [D, 1 + m + drafts, H], the anchor table [W, m, H] with the states made this cycle)."""
        m, W, made_by, valid = self.m, self.W, self.made_by, st.valid
        parts = ([x_out[0, 0][None]] + ([anc[:, 0, 0]] if self.gathers else [])
                 + ([x_draft[None]] if self.drafts else []))
        dt = jnp.result_type(*parts)
        every = vocab.gather(jnp.concatenate([p.astype(dt) for p in parts]), STAGE)  # [D, 1 + m + drafts, H]
        table = st.table
        if self.gathers:
            fresh = every[jnp.maximum(made_by, 0), 1 + jnp.arange(m)].astype(table.dtype)  # [m, H] from the makers
            came = (made_by >= 0) & valid[jnp.maximum(made_by, 0)]  # [m], replicated
            slot, a_ids = (st.t - made_by) % W, jnp.arange(m)  # the maker's token position t - s, in the ring
            table = table.at[slot, a_ids].set(jnp.where(came[:, None], fresh, table[slot, a_ids]))
        return every, table

    def decide(self, st: LoopState, loc: StageCarry, every, x_dtype, x_draft, cyc: SpdCycle) -> Decision:
        """Step 4: the heads on every device's shard, the draft for t + 1 (from the drafter's hidden state in
        every [D, ., H]) and the verification of the token leaving the last stage (skipped while the
        pipeline refills: `verified` is replicated, so every stage takes the same branch); the decisions
        come out of collectives, identical everywhere."""
        h_verify = every[self.last, 0].astype(x_dtype)  # [H]
        d, token_ids, target = None, None, None
        if self.one_head:  # the draft's logits on the target's rows: this shard's, from the same pass when verifying
            hd, h_draft = self.heads, every[self.ec.psm_dev, -1].astype(x_dtype)
            target, drafted = jax.lax.cond(
                st.valid[self.last], lambda a: hd.target_logits(jnp.stack(a)),
                lambda a: jnp.stack([jnp.full((hd.vs.rows,), -jnp.inf, jnp.float32), hd.target_logits(a[1])]),
                (h_verify, h_draft))
            d = (drafted, hd.ids_v, hd.vs)
        elif self.drafts:
            head, token_ids = self.drafter.spd_head(self.dparams, every[self.ec.psm_dev, -1].astype(x_draft.dtype),
                                                    cyc, self.ops)
            d = self.heads.draft_logits(head, token_ids)
        if self.ec.greedy:
            return self.decide_greedy(st, loc, h_verify, d, token_ids, target)
        return self.decide_sampled(st, loc, h_verify, d, token_ids, target)

    def decide_greedy(self, st: LoopState, loc: StageCarry, h_verify, d, token_ids, target=None) -> Decision:
        """Greedy: both argmaxes (the target's at p1, the draft's) from one all-gather of each shard's best
        (`vocab.argmax`, two heads). d: the drafter head's (logits [rows], ids [rows], Shards) or None; target:
        the target's logits [rows] at h_verify when computed with the draft's (`one_head`), else computed here
        only when a token is verified."""
        hd, ec, last = self.heads, self.ec, self.last
        verified, p1 = st.valid[last], st.t - last + 1
        has_next = st.valid[last - 1] if self.n > 1 else jnp.bool_(False)
        none = vary(vocab.shard_best(jnp.full((1,), -jnp.inf), jnp.zeros((1,), jnp.int32)), STAGE)
        if target is None:
            verify = jax.lax.cond(verified, lambda h: vocab.shard_best(hd.target_logits(h), hd.ids_v),
                                  lambda h: none, h_verify)
        else:
            verify = jnp.where(verified, vocab.shard_best(target, hd.ids_v), none)
        best = jnp.stack([verify] + ([vocab.shard_best(d[0], d[1])] if self.drafts else []))  # [1 + drafts, 2]
        # split by rows, each shard's best token's embedding rides along (the device holds its row)
        packet = jnp.concatenate([best, vocab.as_words(hd.own_rows(best[:, 1]))], axis=-1) if ec.vocab_rows else best
        every_best = vocab.gather(packet, STAGE)  # [D, 1 + drafts, 2 (+ the row's words)]
        chosen = vocab.best_of(every_best[..., :2])  # [1 + drafts]
        y, draft = chosen[0], chosen[-1] if self.drafts else jnp.int32(0)
        ok = has_next & (st.seq[p1] == y)  # `vocab.verify_greedy`'s rule
        if ec.vocab_rows:
            rode = vocab.winner_rows(every_best, chosen, st.embeds.dtype)
            # a draft vocabulary's rows are not split as the embedding's: the shard of the best draft row need
            # not hold the draft's embedding row, so the draft is looked up (an all-reduce)
            emb_y, emb_d = rode[0], (rode[-1] if token_ids is None else hd.lookup(draft))
        else:
            emb_y, emb_d = hd.lookup(jnp.stack([y, draft]))
        return Decision(y, ok, draft, emb_y, emb_d, loc.qring)

    def decide_sampled(self, st: LoopState, loc: StageCarry, h_verify, d, token_ids, target=None) -> Decision:
        """Sampling: the draft drawn from the drafter head's shards (its q [rows] kept in this stage's ring for
        its verification n - 1 cycles later), the token at p1 verified against its draft by the
        accept/reject rule (`verify_sampled`)."""
        hd, t, draft, qring = self.heads, st.t, jnp.int32(0), loc.qring
        if self.drafts:
            draft, q = hd.draft_sampled(*d, token_ids, t + 1)
            if self.sampled_drafts:
                qring = qring.at[(t + 1) % self.n].set(q)
        given = target is not None  # the target's logits from the heads' one pass, else computed when verifying
        ok, y = jax.lax.cond(st.valid[self.last], lambda a: self.verify_sampled(*a, given=given),
                             lambda a: (jnp.bool_(False), jnp.int32(0)),
                             (st, loc._replace(qring=qring), target if given else h_verify))
        emb_y, emb_d = hd.lookup(jnp.stack([y, draft]))  # one all-reduce of both rows when split by rows
        return Decision(y, ok, draft, emb_y, emb_d, qring)

    def verify_sampled(self, st: LoopState, loc: StageCarry, h, given: bool = False):
        """Every stage, on its vocabulary shard: the token at p leaves the last stage (h [H], its output,
        on every device; given: h is already this shard's target logits [rows]); its logits decide position
        p+1 (the same decision on every stage: it comes out of collectives) -> (accepted, the token at p+1)."""
        hd, last, n = self.heads, self.last, self.n
        p1 = st.t - last + 1
        has_next = st.valid[last - 1] if n > 1 else jnp.bool_(False)
        logits = h if given else hd.target_logits(h)
        drafted = st.seq[p1]
        # the draft at p1's q (read only when has_next; without drafts there is none)
        q_dist = loc.qring[p1 % n] if self.sampled_drafts else jnp.zeros((hd.vs.rows,), jnp.float32)
        ok, y = vocab.verify_sampled(token_key(self.sp["seed"], p1), hd.warp(logits, hd.own_v, hd.vs.rows), q_dist,
                                     drafted, has_next, hd.ids_v, hd.own_v, hd.V, STAGE)
        if _TEST_ACCEPT_EVERY_DRAFT:
            ok = has_next
        return ok, y

    def advance(self, st: LoopState, dec: Decision, table) -> LoopState:
        """Step 5: accept or roll back. A verified token that equals its draft commits and the pipeline
        shifts (the new draft enters stage 0 at t + 1); one that differs is replaced, the pipeline flushed
        and refilled from p1 (caches are position-indexed: nothing to undo). -> the next LoopState."""
        n, S, W, last, seq = self.n, self.S, self.W, self.last, st.seq
        t, valid = st.t, st.valid
        verified, p1 = valid[last], t - last + 1
        has_next = valid[last - 1] if n > 1 else jnp.bool_(False)
        can_draft = (t + 1 < self.budget_end) & self.drafts
        accept, replace = verified & dec.ok, verified & ~dec.ok
        next_t = jnp.where(replace, p1, t + 1)
        seq = jnp.where(replace, seq.at[p1].set(dec.y), seq)
        committed = seq[p1]
        draft_ok = can_draft & ~replace
        seq = jnp.where(draft_ok, seq.at[jnp.minimum(t + 1, S - 1)].set(dec.draft), seq)
        n_commit = jnp.where(verified, p1 + 1, st.n_commit)
        flushed = jnp.zeros((n,), bool).at[0].set(True)
        shifted = jnp.concatenate([draft_ok[None], valid[:-1]])
        fed = replace | draft_ok  # the embedding of the token entering stage 0 next cycle
        embeds = jnp.where(fed, st.embeds.at[next_t % W].set(jnp.where(replace, dec.emb_y, dec.emb_d)), st.embeds)
        return LoopState(
            seq=seq, table=table, embeds=embeds,
            t=next_t,
            valid=jnp.where(replace, flushed, shifted),
            completed=jnp.where(verified, p1, st.completed),
            cached=st.completed,  # this cycle's draft block wrote every completed row
            n_commit=n_commit,
            cycles=st.cycles + 1,
            accepted=st.accepted + accept.astype(jnp.int32),
            rejected=st.rejected + (replace & has_next).astype(jnp.int32),
            done=(verified & jnp.any(committed == self.eos_ids)) | (n_commit - self.prompt_len >= self.max_new),
        )
