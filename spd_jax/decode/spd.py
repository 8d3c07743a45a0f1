"""The SPD engine: one jitted `shard_map` program over the `stage` mesh axis running prefill and the
whole decode loop (`lax.while_loop`) on device.

Placement (one device per stage; see SPD.md for the algorithm and notation):
- stage s holds only its layers' weights and caches and runs them on its in-flight token each cycle;
  hidden states move to stage s+1 with one `ppermute` per cycle;
- embedding, final norm and LM head are replicated (small next to the layers; stage 0 embeds, the last
  stage verifies);
- the PSM and verification run on the last stage (`lax.cond`): the draft distributions q that
  verification needs stay where they were made, and the only per-cycle collectives are the hidden
  state permute, one all-reduce that gathers the anchor states of the in-flight tokens, and three
  scalar all-reduces that make the draft and the accept/replace decision identical on every device;
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

import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.decode.sampling import choose, token_key, warp_logits
from spd_jax.models import decoder
from spd_jax.sharding import STAGE, STAGE_RULES, logical_spec, vary
from spd_jax.pipeline.stages import StageLayout, stage_forward
from spd_jax.drafters.psm import PSM, PSMConfig

DRAFTERS = ("psm", "none", "oracle")
# Independent random streams per position (fold_in of the token key): the target's own sample uses
# the token key itself, exactly as autoregressive sampling does.
_DRAFT, _ACCEPT, _RESIDUAL = 1, 2, 3
# Test hook only: accept every draft (a deliberately wrong rule the sampling test must detect).
_TEST_ACCEPT_EVERY_DRAFT = False


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cfg: ModelConfig
    layout: StageLayout
    psm: PSMConfig | None  # required for drafter "psm"
    drafter: str
    greedy: bool
    filtered: bool
    prompt_pad: int
    cache_len: int

    @property
    def n(self) -> int:
        return self.layout.plan.n


def build(ec: EngineConfig, mesh):
    """-> jitted fn(stage_w, prog, shared, psm_vars, caches, psm_cache, prompt, prompt_len, max_new,
    eos_ids, sp, ref) -> (seq [S], n_commit, cycles, accepted, rejected, seq_per_stage [n, S], caches,
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
    W = n + 2  # anchor-table ring over positions; > the n + 1 positions a cycle can touch
    s = jax.lax.axis_index(STAGE)
    is_last = s == last
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
    h_last = jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)
    y0 = jax.lax.cond(is_last, lambda h: choose(decoder.lm_logits(shared, h, cfg)[0, 0], prompt_len, sp,
                                                ec.greedy, ec.filtered),
                      lambda h: vary(jnp.int32(0), STAGE), h_last)
    y0 = bcast(y0)

    if use_psm:  # the prompt's rows, all of the deepest type, into the PSM cache
        anc_all = jax.lax.psum(anc_prompt, STAGE).at[0].set(emb)  # [m, 1, Pp, H]

        def psm_prefill(pc):
            # the PSM's rows meet its (per-stage) cache inside its layer scan: cast to that type first
            return module.apply(psm_vars, vary(jnp.moveaxis(anc_all[:, 0], 0, 1), STAGE), pc, method=PSM.prefill)

        pcache = jax.lax.cond(is_last, psm_prefill, lambda pc: pc, pcache)

    positions = jnp.arange(S)
    seq = jnp.where(positions < prompt_len, jnp.zeros((S,), jnp.int32).at[:Pp].set(prompt[0]), 0)
    seq = seq.at[prompt_len].set(y0)
    V = cfg.vocab_size
    sampling_psm = use_psm and not ec.greedy
    state = dict(seq=seq, t=prompt_len, valid=jnp.zeros((n,), bool).at[0].set(True), completed=prompt_len,
                 psm_len=prompt_len, n_commit=prompt_len + 1, table=jnp.zeros((W, m, H), emb.dtype),
                 cycles=jnp.int32(0), accepted=jnp.int32(0), rejected=jnp.int32(0),
                 done=jnp.any(y0 == eos_ids) | (max_new <= 1))
    # per-stage carries: what the stages compute differs between them from the first cycle on
    local = vary(dict(x=jnp.zeros((1, 1, H), emb.dtype), cache=cache, pcache=pcache,
                      qring=jnp.zeros((n, V) if sampling_psm else (1, 1), jnp.float32)), STAGE)
    budget_end = prompt_len + max_new  # positions < budget_end may be generated

    def draft_psm(st, loc):
        t, pc = st["t"], st["psm_len"]
        rows_pos = pc + jnp.arange(n + 1)  # pc <= completed <= t <= pc + n
        h = st["table"][rows_pos % W].at[:, 0].set(
            decoder.embed(shared, st["seq"][jnp.clip(rows_pos, 0, S - 1)][None])[0])
        logits, pcache = module.apply(psm_vars, vary(h, STAGE), loc["pcache"], pc, t, st["completed"], shared["final_norm"],
                                      method=PSM.draft_step)
        if ec.greedy:
            return jnp.argmax(logits).astype(jnp.int32), pcache, loc["qring"]
        warped = warp_logits(logits, sp["temperature"], sp["top_k"], sp["top_p"], ec.filtered)
        d = jax.random.categorical(jax.random.fold_in(token_key(sp["seed"], t + 1), _DRAFT), warped)
        qring = loc["qring"].at[(t + 1) % n].set(jax.nn.softmax(warped))
        return d.astype(jnp.int32), pcache, qring

    def verify(st, loc, x_out):
        """On the last stage: the token at p leaves; its logits decide position p+1."""
        p1 = st["t"] - last + 1
        has_next = st["valid"][last - 1] if n > 1 else jnp.bool_(False)
        logits = decoder.lm_logits(shared, x_out, cfg)[0, 0]
        drafted = st["seq"][p1]
        if ec.greedy:
            y = jnp.argmax(logits).astype(jnp.int32)
            return has_next & (drafted == y), y
        key = token_key(sp["seed"], p1)
        warped = warp_logits(logits, sp["temperature"], sp["top_k"], sp["top_p"], ec.filtered)
        p_dist = jax.nn.softmax(warped)
        q_dist = loc["qring"][p1 % n] if sampling_psm else jax.nn.one_hot(drafted, V)  # oracle: q is a point mass
        u = jax.random.uniform(jax.random.fold_in(key, _ACCEPT))
        ok = has_next & (u * q_dist[drafted] < p_dist[drafted])  # accept with prob min(1, p/q)
        if _TEST_ACCEPT_EVERY_DRAFT:
            ok = has_next
        residual = jnp.maximum(p_dist - q_dist, 0.0)
        y_res = jax.random.categorical(jax.random.fold_in(key, _RESIDUAL), jnp.log(residual))
        y_own = jax.random.categorical(key, warped)
        return ok, jnp.where(has_next, y_res, y_own).astype(jnp.int32)

    def cycle(carry):
        st, loc = carry
        t, valid, seq = st["t"], st["valid"], st["seq"]

        # 1. draft x_{t+1} from the states at the start of the cycle (early start)
        can_draft = (t + 1 < budget_end) & (ec.drafter != "none")
        pcache, qring = loc["pcache"], loc["qring"]
        if use_psm:
            draft, pcache, qring = jax.lax.cond(is_last, lambda a: draft_psm(*a), lambda a: (
                vary(jnp.int32(0), STAGE), a[1]["pcache"], a[1]["qring"]), (st, loc))
            draft = bcast(draft)
        elif ec.drafter == "oracle":
            draft = ref[jnp.minimum(t + 1, S - 1)]
        else:
            draft = jnp.int32(0)

        # 2. every stage advances its token
        pos_s, valid_s = t - s, valid[s]
        x_in = jnp.where(s == 0, decoder.embed(shared, seq[t].reshape(1, 1)), loc["x"])
        x_out, cache, anc = jax.lax.cond(
            valid_s,
            lambda a: stage_forward(w, a[1], pr, a[0], pos_s, cfg, lay),
            lambda a: (a[0], a[1], vary(jnp.zeros((m, 1, 1, H), a[0].dtype), STAGE)),
            (x_in, loc["cache"]))

        # 3. anchor states of the in-flight tokens, gathered everywhere
        table = st["table"]
        if use_psm:
            slot = pos_s % W
            mine = produces & valid_s
            contrib = jax.lax.psum(jnp.zeros((W, m, H), anc.dtype).at[slot].set(anc[:, 0, 0] * mine[:, None]), STAGE)
            has = jax.lax.psum(jnp.zeros((W, m), jnp.int32).at[slot].set(mine.astype(jnp.int32)), STAGE) > 0
            table = jnp.where(has[..., None], contrib, table)

        # 4. verify on the last stage; the decision is made identical everywhere
        verified = valid[last]
        ok, y = jax.lax.cond(is_last & verified, lambda a: vary(verify(*a), STAGE),
                             lambda a: vary((jnp.bool_(False), jnp.int32(0)), STAGE),
                             (st, dict(loc, qring=qring), x_out))
        ok, y = bcast(ok.astype(jnp.int32)) > 0, bcast(y)
        p1 = t - last + 1
        has_next = valid[last - 1] if n > 1 else jnp.bool_(False)
        accept = verified & ok
        replace = verified & ~ok
        seq = jnp.where(replace, seq.at[p1].set(y), seq)
        committed = seq[p1]
        draft_ok = can_draft & ~replace
        seq = jnp.where(draft_ok, seq.at[jnp.minimum(t + 1, S - 1)].set(draft), seq)
        n_commit = jnp.where(verified, p1 + 1, st["n_commit"])
        flushed = jnp.zeros((n,), bool).at[0].set(True)
        shifted = jnp.concatenate([draft_ok[None], valid[:-1]])
        new = dict(
            seq=seq, table=table,
            t=jnp.where(replace, p1, t + 1),
            valid=jnp.where(replace, flushed, shifted),
            completed=jnp.where(verified, p1, st["completed"]),
            psm_len=st["completed"],  # this cycle's PSM block wrote every completed row
            n_commit=n_commit,
            cycles=st["cycles"] + 1,
            accepted=st["accepted"] + accept.astype(jnp.int32),
            rejected=st["rejected"] + (replace & has_next).astype(jnp.int32),
            done=(verified & jnp.any(committed == eos_ids)) | (n_commit - prompt_len >= max_new),
        )
        # 5. hidden states move one stage on
        return new, dict(x=permute(x_out), cache=cache, pcache=pcache, qring=qring)

    max_cycles = max_new * n + n + 2  # a safety bound: every n cycles commit at least one token
    state, local = jax.lax.while_loop(lambda c: ~c[0]["done"] & (c[0]["cycles"] < max_cycles), cycle,
                                      (state, local))
    lift = lambda t: t[None]  # noqa: E731
    return (state["seq"], state["n_commit"], state["cycles"], state["accepted"], state["rejected"],
            state["seq"][None], jax.tree.map(lift, local["cache"]), jax.tree.map(lift, local["pcache"]))
