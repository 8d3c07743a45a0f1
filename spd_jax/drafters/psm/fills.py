"""What PSM training reads beyond the network: the simulated pipeline fills (SPD.md section 6: their
weights, how a batch's query slots are dealt to them, the group sizes they run in), the frozen target's
teacher-forced anchor states, and the teacher-forced drafts by fill that `decode.schedule` replays into
the engine's greedy counts (`drafts_by_fill`, `infer.replay`)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.drafters.base import anchor_states, teacher_forward
from spd_jax.drafters.psm.model import PSM, PSMConfig
from spd_jax.models import decoder


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

