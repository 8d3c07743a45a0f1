"""The SPD engine: one jitted `shard_map` program over the `stage` mesh axis running prefill and the
whole decode loop (`lax.while_loop`) on device.

Placement (one device per stage; see SPD.md for the algorithm and notation):
- stage s holds only its layers' weights and caches and runs them on its in-flight token each cycle;
  hidden states move to stage s+1 with one `ppermute` per cycle;
- embedding, final norm and LM head are replicated (stage 0 embeds); the heads are computed
  vocabulary-parallel (`decode.vocab`): the last stage's output and the PSM's hidden state are
  broadcast ([H] each) and every stage computes the logits of its 1/n of the vocabulary (the head
  weights stay replicated; each stage reads its rows);
- the PSM's layers run on one device (`lax.cond`): a stage (`psm_device`; the last when None; the
  host's default, placement "auto", is the stage whose placement gives the shortest predicted cycle,
  busiest device + collectives, `pipeline.costs.best_psm_device`) or a device of its own (n + 1
  devices, the paper's set-up; that device holds no layers, only its shards of the heads). Either way
  the draft starts from the states at the start of the cycle, not after that cycle's stage work. Its
  head runs on every device's shard; greedy choice, sampling draws and the accept/replace decision
  come out of collectives over `stage` that move scalars (plus each shard's k best logits under a
  top-k filter), so they are identical everywhere; the draft distributions q that sampling
  verification needs stay on the shard that made them;
- the committed sequence and the pipeline bookkeeping are replicated: each in-flight token's position
  follows from the newest position t and its depth (t - d), so nothing else travels.

Drafters: "psm" (the Pipeline Speculation Module), "none" (the plain pipeline, one token in flight:
the resource-matched baseline) and "oracle" (test only: proposes given reference tokens).

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
from spd_jax.pipeline.stages import StageLayout, stage_forward
from spd_jax.drafters.psm import PSM, PSMConfig

DRAFTERS = ("psm", "none", "oracle")
# Test hook only: accept every draft (a deliberately wrong rule the sampling test must detect).
_TEST_ACCEPT_EVERY_DRAFT = False


def check_drafter(drafter) -> None:
    """Refuse a drafter the engine does not run (it would otherwise draft token 0 every cycle)."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r} for the pipelined methods: one of {', '.join(DRAFTERS)} "
                         "(\"oracle\" for tests, with oracle_tokens); EAGLE-3 is not a drafter here but a method: "
                         "method=\"eagle3\"")


class LoopState(NamedTuple):
    """The decode loop's replicated carry (the same on every stage: it comes out of collectives)."""

    seq: jax.Array  # [S] int32: committed tokens, then the in-flight drafts
    t: jax.Array  # position of the newest token (the one entering stage 0)
    valid: jax.Array  # [n] bool: whether the token at depth d (position t - d) is in flight
    completed: jax.Array  # positions < completed are verified
    psm_len: jax.Array  # rows [0, psm_len) are in the PSM's cache
    n_commit: jax.Array  # positions < n_commit are committed
    table: jax.Array  # [W, m, H] anchor states of recent positions, a ring over positions
    cycles: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    done: jax.Array


class StageCarry(NamedTuple):
    """The decode loop's per-stage carry (varying over `stage`)."""

    x: jax.Array  # [1, 1, H] the hidden state entering this stage next cycle
    cache: Any  # this stage's layer caches
    pcache: Any  # the PSM's KV cache (used on the PSM's device)
    qring: jax.Array  # [n, rows] this stage's shard of q for each in-flight draft (sampling with the PSM)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cfg: ModelConfig
    layout: StageLayout
    psm: PSMConfig | None  # required for drafter "psm"
    drafter: str
    greedy: bool
    filtered: bool
    top_k_cap: int  # 0 = no top-k; else a power of two >= top_k: the candidates a top-k filter gathers per shard
    prompt_pad: int
    cache_len: int
    psm_device: int | None = None  # the PSM body's device: a stage 0..n-1 (None: the last) or n (its own)

    def __post_init__(self):
        check_drafter(self.drafter)
        if self.drafter == "psm" and self.psm is None:
            raise ValueError("drafter 'psm' needs the PSM's config (EngineConfig.psm), got None")
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


def build(ec: EngineConfig, mesh):
    """-> jitted fn(stage_w, prog, shared, psm_vars, caches, psm_cache, prompt, prompt_len, max_new,
    eos_ids, sp, ref) -> (seq [S], n_commit, cycles, accepted, rejected, seq_per_stage [devices, S], caches,
    psm_cache). Caches are donated."""
    # per-stage stacks (weights, programs, caches) lead with the "stage" logical axis; the rest is replicated
    rep, st = logical_spec((), STAGE_RULES), logical_spec(("stage",), STAGE_RULES)
    body = functools.partial(_engine, ec)
    smap = jax.shard_map(
        body, mesh=mesh,
        in_specs=(st, st, rep, rep, st, st, rep, rep, rep, rep, rep, rep),
        out_specs=(rep, rep, rep, rep, rep, st, st, st),
        # Varying-ness is checked: replicated values (the sequence, the bookkeeping, the decision) come
        # out of psum-broadcasts from the deciding stage, so JAX proves them identical on every stage;
        # per-stage values (hidden states, caches, PSM state) are cast varying where a replicated
        # constant meets them in a cond/switch branch or a loop carry (`vary`).
        check_vma=True)
    return jax.jit(smap, donate_argnums=(4, 5))


def _engine(ec: EngineConfig, stage_w, prog, shared, psm_vars, caches, psm_cache, prompt, prompt_len, max_new,
            eos_ids, sp, ref):
    cfg, lay, n = ec.cfg, ec.layout, ec.n
    last, m, H, S, Pp = n - 1, len(lay.anchors), cfg.hidden_size, ec.cache_len, ec.prompt_pad
    D = ec.devices  # n, or n + 1 with the PSM on its own device (which runs no layers)
    W = n + 2  # anchor-table ring over positions; > the n + 1 positions a cycle can touch
    s = jax.lax.axis_index(STAGE)
    is_psm = s == ec.psm_dev
    w = jax.tree.map(lambda t: t[0], stage_w)
    pr = jax.tree.map(lambda t: t[0], prog)
    cache = jax.tree.map(lambda t: t[0], caches)
    pcache = jax.tree.map(lambda t: t[0], psm_cache)
    fwd = [(i, i + 1) for i in range(n - 1)]
    use_psm = ec.drafter == "psm"
    module = PSM(cfg, ec.psm) if use_psm else None
    produces = jnp.stack([jnp.any(pr["anchor_id"] == a) for a in range(m)])  # anchors this stage makes

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
    head = decoder.lm_head(shared, cfg)

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

    # ---------------- prefill: the prompt through the stages in turn, one stage per iteration; a loop,
    # not n unrolled copies of the stage, so compile time does not grow with n
    emb = decoder.embed(shared, prompt)  # [1, Pp, H]
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

    if use_psm:  # the prompt's rows, all of the deepest type, into the PSM cache
        anc_all = jax.lax.psum(anc_prompt, STAGE).at[0].set(emb)  # [m, 1, Pp, H]

        def psm_prefill(pc):
            # the PSM's rows meet its (per-stage) cache inside its layer scan: cast to that type first
            return module.apply(psm_vars, vary(jnp.moveaxis(anc_all[:, 0], 0, 1), STAGE), pc, method=PSM.prefill)

        pcache = jax.lax.cond(is_psm, psm_prefill, lambda pc: pc, pcache)

    positions = jnp.arange(S)
    seq = jnp.where(positions < prompt_len, jnp.zeros((S,), jnp.int32).at[:Pp].set(prompt[0]), 0)
    seq = seq.at[prompt_len].set(y0)
    sampling_psm = use_psm and not ec.greedy
    state = LoopState(seq=seq, t=prompt_len, valid=jnp.zeros((n,), bool).at[0].set(True), completed=prompt_len,
                      psm_len=prompt_len, n_commit=prompt_len + 1, table=jnp.zeros((W, m, H), emb.dtype),
                      cycles=jnp.int32(0), accepted=jnp.int32(0), rejected=jnp.int32(0),
                      done=jnp.any(y0 == eos_ids) | (max_new <= 1))
    # per-stage carries: what the stages compute differs between them from the first cycle on
    local = vary(StageCarry(x=jnp.zeros((1, 1, H), emb.dtype), cache=cache, pcache=pcache,
                            qring=jnp.zeros((n, vs.rows) if sampling_psm else (1, 1), jnp.float32)), STAGE)
    budget_end = prompt_len + max_new  # positions < budget_end may be generated

    if use_psm:  # the PSM's head rows (its draft vocabulary's, or the whole vocabulary's), sharded the same way
        tok_ids = module.apply(psm_vars, method=PSM.token_ids)  # [V'] token id of each head row
        qs = vocab.Shards(tok_ids.shape[0], D)
        rows_q, own_q = qs.ids(s), qs.own(s)

    def draft_psm(st, loc):
        """The draft for t + 1: the PSM body on its device, its head and the choice over every device.
        -> (draft token, PSM cache, q ring with this stage's shard of q for t + 1 when sampling)."""
        t, pc = st.t, st.psm_len
        rows_pos = pc + jnp.arange(n + 1)  # pc <= completed <= t <= pc + n

        def body(a):
            st, pcache = a
            h = st.table[rows_pos % W].at[:, 0].set(
                decoder.embed(shared, st.seq[jnp.clip(rows_pos, 0, S - 1)][None])[0])
            return module.apply(psm_vars, vary(h, STAGE), pcache, pc, t, st.completed, method=PSM.draft_hidden)

        x_d, pcache = jax.lax.cond(is_psm, body, lambda a: (vary(jnp.zeros((H,), emb.dtype), STAGE), a[1]),
                                   (st, loc.pcache))
        h_d = bcast(x_d, ec.psm_dev)  # [H], the PSM device's
        logits = jnp.where(own_q, module.apply(psm_vars, h_d, shared["final_norm"], qs.start(s), qs.rows,
                                               method=PSM.head_logits), -jnp.inf)  # [rows_q]
        if ec.greedy:
            return vocab.argmax(logits, tok_ids[rows_q], STAGE), pcache, loc.qring
        warped = warp(logits, own_q, qs.rows)
        d = vocab.categorical(jax.random.fold_in(token_key(sp["seed"], t + 1), vocab.DRAFT), warped, tok_ids[rows_q],
                              V, STAGE)
        q = vocab.softmax(warped, STAGE)  # over this stage's head rows
        if ec.psm.draft_vocab:  # head rows -> this stage's target-vocabulary shard (V' values cross, not V)
            every = jax.lax.all_gather(q, STAGE)  # [D, rows_q]
            row_of = jnp.stack([qs.ids(r) for r in range(D)])
            q_rows = jnp.zeros(tok_ids.shape, q.dtype).at[row_of].add(
                jnp.where(jnp.stack([qs.own(r) for r in range(D)]), every, 0.0))
            at = tok_ids - vs.start(s)  # position in this stage's target-vocabulary shard
            mine = (at >= 0) & (at < vs.rows) & (tok_ids >= s * vs.rows)
            q = jnp.zeros((vs.rows,), q.dtype).at[jnp.where(mine, at, vs.rows)].add(q_rows, mode="drop")
        return d, pcache, loc.qring.at[(t + 1) % n].set(q)

    def verify(st, loc, x_out):
        """Every stage, on its vocabulary shard: the token at p leaves the last stage; its logits decide
        position p+1 (the same decision on every stage: it comes out of collectives)."""
        p1 = st.t - last + 1
        has_next = st.valid[last - 1] if n > 1 else jnp.bool_(False)
        logits = target_logits(bcast(x_out[0, 0]))
        drafted = st.seq[p1]
        if ec.greedy:
            ok, y = vocab.verify_greedy(logits, ids_v, drafted, STAGE)
            return has_next & ok, y
        # oracle drafts: q is a point mass
        q_dist = loc.qring[p1 % n] if sampling_psm else (own_v & (ids_v == drafted)).astype(jnp.float32)
        ok, y = vocab.verify_sampled(token_key(sp["seed"], p1), warp(logits, own_v, vs.rows), q_dist, drafted,
                                     has_next, ids_v, own_v, V, STAGE)
        if _TEST_ACCEPT_EVERY_DRAFT:
            ok = has_next
        return ok, y

    def cycle(carry):
        st, loc = carry
        t, valid, seq = st.t, st.valid, st.seq

        # 1. draft x_{t+1} from the states at the start of the cycle (early start)
        can_draft = (t + 1 < budget_end) & (ec.drafter != "none")
        pcache, qring = loc.pcache, loc.qring
        if use_psm:
            draft, pcache, qring = draft_psm(st, loc)
        elif ec.drafter == "oracle":
            draft = ref[jnp.minimum(t + 1, S - 1)]
        else:
            draft = jnp.int32(0)

        # 2. every stage advances its token
        # a PSM device of its own (s == n) holds no stage: never valid
        pos_s, valid_s = t - s, (s < n) & valid[jnp.minimum(s, n - 1)]
        x_in = jnp.where(s == 0, decoder.embed(shared, seq[t].reshape(1, 1)), loc.x)
        x_out, cache, anc = jax.lax.cond(
            valid_s,
            lambda a: stage_forward(w, a[1], pr, a[0], pos_s, cfg, lay),
            lambda a: (a[0], a[1], vary(jnp.zeros((m, 1, 1, H), a[0].dtype), STAGE)),
            (x_in, loc.cache))

        # 3. anchor states of the in-flight tokens, gathered everywhere
        table = st.table
        if use_psm:
            slot = pos_s % W
            mine = produces & valid_s
            contrib = jax.lax.psum(jnp.zeros((W, m, H), anc.dtype).at[slot].set(anc[:, 0, 0] * mine[:, None]), STAGE)
            has = jax.lax.psum(jnp.zeros((W, m), jnp.int32).at[slot].set(mine.astype(jnp.int32)), STAGE) > 0
            table = jnp.where(has[..., None], contrib, table)

        # 4. verify on the last stage; the decision is made identical everywhere
        verified = valid[last]
        # skipped while the pipeline refills (`verified` is replicated, so every stage takes the same
        # branch and the collectives inside stay matched)
        ok, y = jax.lax.cond(verified, lambda a: verify(*a), lambda a: (jnp.bool_(False), jnp.int32(0)),
                             (st, loc._replace(qring=qring), x_out))
        p1 = t - last + 1
        has_next = valid[last - 1] if n > 1 else jnp.bool_(False)
        accept = verified & ok
        replace = verified & ~ok
        seq = jnp.where(replace, seq.at[p1].set(y), seq)
        committed = seq[p1]
        draft_ok = can_draft & ~replace
        seq = jnp.where(draft_ok, seq.at[jnp.minimum(t + 1, S - 1)].set(draft), seq)
        n_commit = jnp.where(verified, p1 + 1, st.n_commit)
        flushed = jnp.zeros((n,), bool).at[0].set(True)
        shifted = jnp.concatenate([draft_ok[None], valid[:-1]])
        new = LoopState(
            seq=seq, table=table,
            t=jnp.where(replace, p1, t + 1),
            valid=jnp.where(replace, flushed, shifted),
            completed=jnp.where(verified, p1, st.completed),
            psm_len=st.completed,  # this cycle's PSM block wrote every completed row
            n_commit=n_commit,
            cycles=st.cycles + 1,
            accepted=st.accepted + accept.astype(jnp.int32),
            rejected=st.rejected + (replace & has_next).astype(jnp.int32),
            done=(verified & jnp.any(committed == eos_ids)) | (n_commit - prompt_len >= max_new),
        )
        # 5. hidden states move one stage on
        return new, StageCarry(x=permute(x_out), cache=cache, pcache=pcache, qring=qring)

    max_cycles = max_new * n + n + 2  # a safety bound: every n cycles commit at least one token
    state, local = jax.lax.while_loop(lambda c: ~c[0].done & (c[0].cycles < max_cycles), cycle,
                                      (state, local))
    lift = lambda t: t[None]  # noqa: E731
    return (state.seq, state.n_commit, state.cycles, state.accepted, state.rejected,
            state.seq[None], jax.tree.map(lift, local.cache), jax.tree.map(lift, local.pcache))
