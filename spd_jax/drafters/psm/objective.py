"""The PSM's training loss (`psm_loss`): KL(teacher || PSM) at temperature tau over the positions whose
next token is a response token, computed with `PSM.train_hidden`, the exact training counterpart of the
engine's per-cycle draft, for the in-flight slots each position's simulated fill has (`deal_fills`); plus an
optional hard-label term on the teacher's argmax. The training step (`train.step`) binds its settings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.drafters.base import join_params
from spd_jax.drafters.objective import distill_queries
from spd_jax.drafters.psm.fills import deal_fills, teacher_states
from spd_jax.drafters.psm.model import PSM, PSMConfig
from spd_jax.models.attention import init_kv_cache


def plain_hidden(psm: PSM, variables: dict, h: jax.Array, at: jax.Array, fills: jax.Array) -> jax.Array:
    """The drafts' hidden states [B, Q, H] computed the plain way, as the engine computes each: the chain of
    completed rows prefilled once (`PSM.prefill`), then for each query, one after another (`lax.map`), the
    engine's draft (`PSM.draft_hidden`) over the n + 1 rows from its first in-flight position, the newest
    token at at[b, q] with fills[q] tokens in flight. What `PSM.train_hidden` computes with its shared chain
    and groups (tests/test_psm_train.py), without either: a check on it, Q times its cost."""
    B, T = h.shape[:2]
    n = psm.spec.n
    cache0 = init_kv_cache(psm.cfg, psm.spec.num_layers, 1, T + n + 1, h.dtype)

    def sequence(h_b, at_b):
        chain = psm.apply(variables, h_b, cache0, method=PSM.prefill)  # every row completed: the deepest type

        def query(q):
            t, fill = q
            pc = jnp.maximum(t - fill + 1, 0)  # the first in-flight position; before it the completed chain
            rows = h_b[jnp.clip(pc + jnp.arange(n + 1), 0, T - 1)]
            return psm.apply(variables, rows, chain, pc, t, pc, method=PSM.draft_hidden)[0]

        return jax.lax.map(query, (at_b, fills))

    return jax.vmap(sequence)(h, at)


def psm_loss(trainable, frozen, target, batch, keys, *, cfg, spec: PSMConfig, tau: float,
             fill_accept: float | None = None, hard_weight: float = 0.0, plain: bool = False):
    """-> (sum of the masked KL (plus hard_weight x the cross-entropy on the teacher's argmax), metrics
    sums). batch (`pad_batch`): tokens [B, T] int32; query [B, Q] int32 and query_mask [B, Q] bool, the
    positions t that predict a response token. keys [B]: one per sequence, so the simulated fills of a
    sequence do not depend on how the batch is split over devices (they do depend on Q: `psm.deal_fills`).
    The frozen target runs on all T positions (the PSM's chain reads them all); the PSM's groups, both heads
    and the KL only on the queries. A batch that carries the target's features (anchor_states [B, T, m, H],
    final_hidden [B, T, H]: `teacher_states`' outputs, from the teacher cache) skips that forward; with
    teacher_argmax [B, Q] too (the teacher's greedy token at each query, from the cache) and a draft
    vocabulary, the teacher's logits are computed over the V' rows only. plain: the drafts computed query by
    query as the engine drafts (`plain_hidden`), to check the fast path's loss and gradient. The sums: kl_sum,
    agree_sum (top-1 agreement with the unrestricted teacher), positions, and agree_by_fill /
    positions_by_fill [n], the same per simulated fill."""
    tokens = batch["tokens"]
    cd = target["embed"].dtype  # the compute dtype: the caller casts the frozen target once
    variables = jax.tree.map(lambda p: p.astype(cd) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                             join_params(trainable, frozen))
    if "anchor_states" in batch:
        h, x = batch["anchor_states"], batch["final_hidden"]
    else:
        h, x = teacher_states(target, tokens, cfg, spec.anchors)
    h, x = jax.lax.stop_gradient((h, x))
    order, blocks = deal_fills(keys, batch["query"].shape[1], spec.n, fill_accept)
    at = jnp.take_along_axis(batch["query"], order, axis=1)  # [B, Q] in the blocks' order
    w = jnp.take_along_axis(batch["query_mask"], order, axis=1).astype(jnp.float32)
    psm = PSM(cfg, spec)
    if plain:
        ys = [plain_hidden(psm, variables, h, at, jnp.asarray(np.concatenate([f for _, f, _ in blocks])))]
    else:
        ys = psm.apply(variables, h, [(at[:, a:a + len(f)], f, K) for a, f, K in blocks], method=PSM.train_hidden)
    student = psm.apply(variables, jnp.concatenate(ys, axis=1), target["final_norm"],
                        method=PSM.head_logits)  # [B, Q, V']
    x_q = jax.lax.stop_gradient(jnp.take_along_axis(x, at[..., None], axis=1))  # [B, Q, H]
    top = jnp.take_along_axis(batch["teacher_argmax"], order, axis=1) if "teacher_argmax" in batch else None
    ids = variables["vocab"]["ids"] if spec.draft_vocab else None
    loss, kl_sum, agree = distill_queries(student, x_q, w, target, cfg, ids, top, tau, hard_weight)
    # by fill k (1 .. n: the draft's distance from the newest completed token): the slots' fills are static
    by_fill = jnp.asarray(np.concatenate([f for _, f, _ in blocks])[:, None] == np.arange(1, spec.n + 1), jnp.float32)
    return loss, dict(kl_sum=kl_sum, agree_sum=(agree * w).sum(), positions=w.sum(),
                      agree_by_fill=(agree * w).sum(0) @ by_fill, positions_by_fill=w.sum(0) @ by_fill)
