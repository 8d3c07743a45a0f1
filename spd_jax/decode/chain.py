"""Chain speculative decoding on one device: a drafter proposes k tokens, the target scores the k + 1
positions in one pass over its cache, and the longest verified prefix plus one token of the target's
commits. Prefill and the whole loop run in one jitted program (`lax.while_loop`, static caches);
`decode.ar` keeps its loop on device too, but compiles prefill and the decode loop as two programs.
With k = 0 (`NoDrafter`) it is autoregressive decoding.

Verification is `decode.vocab`'s, the rule the SPD engine uses, with `axis=None`: greedy accepts a
draft iff it equals the target's argmax; sampling accepts with probability min(1, p/q), replaces a
rejected draft by a draw from norm(max(p - q, 0)) (p where that is all zero), and after k accepted
drafts draws the bonus token from p with the position's own token key, exactly as `ar` draws it. p is
the target's distribution after `sampling.warp_logits` (temperature, top-k, top-p, as `ar`), q the
drafter's after the same warping. Keys come from (seed, position), so a draft redrafted at the same
position after a rejection reuses its key: harmless, as nothing committed depended on the discarded one.

Rewind: attention caches are position-indexed and Gated DeltaNet layers keep a ring of k + 1 states
written after every token of a round's pass (`run_layers(every_state=True)`), so after accepting j of
k drafts the next pass starts at the position after them and reads the state it left there.

This module does not know how a drafter works (`drafters.base.ChainDrafter`), nor any device layout.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.decode import ar, vocab
from spd_jax.decode.compile_cache import CompileCache, cache_events, compile_source
from spd_jax.decode.sampling import Sampling, choose, token_key, warp_logits
from spd_jax.drafters.base import ChainDrafter, features
from spd_jax.models import decoder


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    cfg: ModelConfig
    greedy: bool
    filtered: bool  # a top-k / top-p filter is active
    prompt_pad: int
    cache_len: int  # >= prompt + max_new + k + 1: a round's pass may run k + 1 positions past the budget


class ChainState(NamedTuple):
    """The loop's carry. Positions < n are committed; n - 1 is the newest, not yet run by the target."""

    seq: jax.Array  # [S] int32 committed tokens (garbage at >= n)
    n: jax.Array  # committed positions (prompt included)
    cache: decoder.Cache  # the target's; Gated DeltaNet rings of k + 1 states
    draft: Any  # the drafter's state
    rounds: jax.Array  # target passes after prefill (verification rounds)
    accepted: jax.Array  # drafts committed
    rejected: jax.Array  # rounds that rejected a draft
    done: jax.Array


# AOT-compiled loops, keyed by shapes and static switches (compile time is reported apart from run time)
_compiled = CompileCache()


class ChainResult(NamedTuple):
    seq: jax.Array  # [S]: prompt then generated tokens; valid below n
    n: jax.Array
    rounds: jax.Array
    accepted: jax.Array
    rejected: jax.Array


@functools.partial(jax.jit, static_argnames=("cc", "drafter"))
def decode(params: dict, dparams: Any, prompt: jax.Array, prompt_len: jax.Array, max_new: jax.Array,
           eos_ids: jax.Array, sp: dict, *, cc: ChainConfig, drafter: ChainDrafter) -> ChainResult:
    """prompt [1, prompt_pad] (valid up to prompt_len) -> up to max_new tokens after it (the prefill's
    token included), stopping after an EOS token (kept). params: the target's (stacked layers);
    dparams: the drafter's; sp: `Sampling.runtime()`."""
    cfg, k, S = cc.cfg, drafter.k, cc.cache_len
    V = cfg.vocab_size
    ids, own = jnp.arange(V, dtype=jnp.int32), jnp.ones((V,), bool)
    layers = drafter.feature_layers

    def target(tokens, cache, pos, **kw):
        """tokens [1, T] at [pos, pos+T) -> (last hidden [1, T, H], cache, features [T, F])."""
        emb = decoder.embed(params, tokens)
        x, cache, hidden = decoder.run_layers(params["layers"], emb, cache, pos, cfg, collect_hidden=bool(layers),
                                              **kw)
        return x, cache, features(emb, hidden, layers)[0]

    def warp(logits):
        return warp_logits(logits, sp["temperature"], sp["top_k"], sp["top_p"], cc.filtered)

    # prefill: the target on the prompt, its first token chosen as `ar.prefill` chooses it
    cache = decoder.init_cache(cfg, 1, S, params["embed"].dtype, ring=k + 1)
    x, cache, feats = target(prompt, cache, jnp.int32(0), length=prompt_len)
    last = jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)  # [1, 1, H]
    y0 = choose(decoder.lm_logits(params, last, cfg)[0, 0], prompt_len, sp, cc.greedy, cc.filtered)
    positions = jnp.arange(S)
    seq = jnp.where(positions < prompt_len, jnp.zeros((S,), jnp.int32).at[:cc.prompt_pad].set(prompt[0]), 0)
    seq = seq.at[prompt_len].set(y0)
    dstate = drafter.init(dparams, S, params["embed"].dtype)
    dstate = drafter.prefill(dparams, dstate, feats, seq[1:cc.prompt_pad + 1], prompt_len)
    budget_end = prompt_len + max_new  # positions < budget_end may be generated

    def round_(st: ChainState) -> ChainState:
        pos = st.n - 1

        def choose_draft(logits, i):
            if cc.greedy:
                return jnp.argmax(logits).astype(jnp.int32), jnp.zeros((0,), jnp.float32)
            w = warp(logits)
            key = jax.random.fold_in(token_key(sp["seed"], pos + 1 + i), vocab.DRAFT)
            return vocab.categorical(key, w, ids, V, None), vocab.softmax(w, None)

        drafts, q, dstate = drafter.propose(dparams, st.draft, pos, choose_draft)
        tokens = jnp.concatenate([st.seq[pos][None], drafts])  # [k + 1] at positions pos .. pos + k
        x, cache, feats = target(tokens[None], st.cache, pos, every_state=cfg.linear is not None)
        logits = decoder.lm_logits(params, x, cfg)[0]  # [k + 1, V]: row i decides position pos + 1 + i
        drafted = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])  # the bonus position has no draft
        has_draft = jnp.arange(k + 1) < k
        if cc.greedy:
            ok, y = jax.vmap(lambda lg, d: vocab.verify_greedy(lg, ids, d, None))(logits, drafted)
        else:
            qs = jnp.concatenate([q, jnp.zeros((1, V), jnp.float32)])
            keys = jax.vmap(lambda i: token_key(sp["seed"], pos + 1 + i))(jnp.arange(k + 1))
            ok, y = jax.vmap(lambda key, w, qd, d, h: vocab.verify_sampled(key, w, qd, d, h, ids, own, V, None))(
                keys, warp(logits), qs, drafted, has_draft)
        j = jnp.sum(jnp.cumprod((ok & has_draft).astype(jnp.int32)))  # drafts accepted: the verified prefix
        new = jnp.where(jnp.arange(k + 1) < j, drafted, y)  # new[i] for position pos + 1 + i; new[j] = y[j]
        count = jnp.minimum(j + 1, budget_end - st.n)
        is_eos = jnp.any(new[:, None] == eos_ids[None, :], axis=-1) & (jnp.arange(k + 1) < count)
        first_eos = jnp.argmax(is_eos)
        count = jnp.where(jnp.any(is_eos), first_eos + 1, count)
        seq = jax.lax.dynamic_update_slice(st.seq, new, (st.n,))  # past count: overwritten later
        dstate = drafter.commit(dparams, dstate, feats, new, pos, count)
        n = st.n + count
        return ChainState(seq, n, cache, dstate, st.rounds + 1, st.accepted + jnp.minimum(j, count),
                          st.rejected + (j < k).astype(jnp.int32),
                          jnp.any(is_eos) | (n >= budget_end))

    state = ChainState(seq, prompt_len + 1, cache, dstate, jnp.int32(0), jnp.int32(0), jnp.int32(0),
                       jnp.any(y0 == eos_ids) | (max_new <= 1))
    state = jax.lax.while_loop(lambda st: ~st.done, round_, state)
    return ChainResult(state.seq, state.n, state.rounds, state.accepted, state.rejected)


def chain_config(cfg: ModelConfig, prompt_len: int, max_new_tokens: int, k: int, sp: Sampling) -> ChainConfig:
    """The static configuration for a prompt and budget, padded to `ar`'s shape buckets."""
    p_pad = ar.round_up(prompt_len, ar.PROMPT_BUCKET)
    cache_len = ar.round_up(max(prompt_len + max_new_tokens + k + 1, p_pad + 1), ar.CACHE_BUCKET)
    return ChainConfig(cfg, sp.greedy, sp.filtered, p_pad, cache_len)


def generate_chain(model, prompt_ids: Sequence[int], max_new_tokens: int, drafter: ChainDrafter, dparams: Any,
                   sp: Sampling = Sampling(), stop_at_eos: bool = True,
                   compiled: CompileCache | None = None):
    """Host side: pad, run and report (compiled: the caller's compile cache, default this module's).
    model: `spd_jax.api.Model` (whole layers loaded). -> (generated
    token ids, stats). stats: tokens (N, the prefill's included), rounds (target passes after prefill),
    tokens_per_round = N / rounds (the chain's S0: tokens per target pass, prefill not counted, as SPD's
    alpha does not count it), accepted drafts, rejected rounds, timings."""
    cfg = model.config
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    P = int(prompt.size)
    # `api.generate` has checked its max_len (<= max_position_embeddings) already; this guards direct callers
    if P + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{cfg.max_position_embeddings} positions; shorten the prompt or lower max_new_tokens")
    # EOS ids go in as data: a model that differs only in them runs the same program
    cc = chain_config(dataclasses.replace(cfg, eos_token_ids=()), P, max_new_tokens, drafter.k, sp)
    prompt_arr = np.zeros((1, cc.prompt_pad), np.int32)
    prompt_arr[0, :P] = prompt
    eos = np.asarray(model.eos_token_ids if stop_at_eos else (), np.int32)
    eos = eos if eos.size else np.array([-1], np.int32)
    args = (model.params, dparams, jnp.asarray(prompt_arr), jnp.int32(P), jnp.int32(max_new_tokens),
            jnp.asarray(eos), sp.runtime())
    shapes = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), (model.params, dparams))
    events = cache_events()
    exe, compile_s = (_compiled if compiled is None else compiled).get((cc, drafter, eos.shape, str(shapes)),
                                   lambda: decode.lower(*args, cc=cc, drafter=drafter))
    compile_from = compile_source(events, compile_s)
    t0 = time.perf_counter()
    res = exe(*args)
    n = int(res.n)
    wall = time.perf_counter() - t0
    tokens = np.asarray(res.seq)[P:n].tolist()
    rounds = int(res.rounds)
    stats = dict(method="chain", drafter=type(drafter).__name__, k=drafter.k, tokens=len(tokens), prompt_tokens=P,
                 rounds=rounds, tokens_per_round=len(tokens) / rounds if rounds else float("nan"),
                 accepted=int(res.accepted), rejected=int(res.rejected), wall_s=wall,
                 tokens_per_s=len(tokens) / wall, compile_s=compile_s, compile_from=compile_from,
                 timing_includes="prefill and the whole on-device loop (drafts, target passes, verification) and "
                                 "the device-to-host copy of the result; excludes compilation (compile_s)")
    return tokens, stats
