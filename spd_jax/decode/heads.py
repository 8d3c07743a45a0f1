"""The SPD engine's heads on the stage mesh (`decode.spd`): the target's and the drafter's logits, one
vocabulary shard per device, the embeddings of chosen tokens, and the choices made from the shards by
collectives over `stage` (`decode.vocab`), so identical on every device.

Called only inside the engine's `shard_map` (every function runs on every device, and those with a
collective need every device to call them). It knows nothing of the cycle's bookkeeping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spd_jax.decode import vocab
from spd_jax.decode.sampling import token_key
from spd_jax.models import decoder
from spd_jax.sharding import STAGE


class StageHeads:
    """One device's view of the heads: the target's rows [vs.rows] of its vocabulary shard, and the drafter
    head's, split the same way over the D devices (a draft vocabulary's V' rows, else V).

    ec: the engine's `EngineConfig` (its greedy, filtered, top_k_cap, vocab_rows and devices are read);
    shared: the embedding, final norm and LM head as placed; sp: the sampling runtime values; s: this
    device's index along `stage`."""

    def __init__(self, ec, shared: dict, sp: dict, s: jax.Array):
        self.ec, self.cfg, self.shared, self.sp, self.s = ec, ec.cfg, shared, sp, s
        self.V, self.D = ec.cfg.vocab_size, ec.devices
        self.vs = vocab.Shards(self.V, self.D)
        self.ids_v, self.own_v = self.vs.ids(s), self.vs.own(s)  # [rows] each
        self.head = decoder.lm_head(shared, ec.cfg)  # this device's rows [vs.rows, H] with vocab_rows, else [V, H]

    def own_rows(self, ids: jax.Array) -> jax.Array:
        """Token ids [...] -> [..., H]: their embeddings where this device holds the row, zeros elsewhere (the
        table split by rows), or every embedding (the table whole on each device)."""
        if not self.ec.vocab_rows:
            return decoder.embed(self.shared, ids)
        vs, s = self.vs, self.s
        at = ids - vs.start(s)
        mine = (at >= 0) & (at < vs.rows)
        rows = jnp.take(self.shared["embed"], jnp.clip(at, 0, vs.rows - 1), axis=0)
        return jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))

    def lookup(self, ids: jax.Array) -> jax.Array:
        """Token ids [...] -> the embeddings [..., H], the same on every device (split by rows: an all-reduce of
        each device's rows; every device calls it)."""
        return jax.lax.psum(self.own_rows(ids), STAGE) if self.ec.vocab_rows else self.own_rows(ids)

    def warp(self, logits: jax.Array, own: jax.Array, rows: int) -> jax.Array:
        """A shard's logits [rows] -> the sampling rule's warped logits [rows] (`vocab.warp`). A filter
        gathers at most top_k_cap candidates per shard (without top-k, top-p may keep any of them)."""
        ec, sp = self.ec, self.sp
        cap = min(rows, ec.top_k_cap) if ec.top_k_cap else rows
        return vocab.warp(logits, own, sp["temperature"], sp["top_k"], sp["top_p"], ec.filtered, cap, STAGE)

    def target_logits(self, h: jax.Array) -> jax.Array:
        """h [..., H], the same on every stage -> this stage's shard of the target's logits [..., rows] (-inf off
        its own rows): several hidden states in one pass over the shard's rows (the engine's verification and a
        draft on the target's head, `SpdDrafter.reads_target_head`)."""
        vs, s = self.vs, self.s
        return jnp.where(self.own_v, decoder.head_logits(h, self.shared["final_norm"], self.head, self.cfg,
                                                         vs.start(s), vs.rows), -jnp.inf)

    def target_choice(self, logits: jax.Array, pos: jax.Array) -> jax.Array:
        """This shard's target logits [rows] -> the token chosen for position pos (greedy: the argmax; else
        the draw with pos's token key), the same on every device."""
        if self.ec.greedy:
            return vocab.argmax(logits, self.ids_v, STAGE)
        return vocab.categorical(token_key(self.sp["seed"], pos), self.warp(logits, self.own_v, self.vs.rows),
                                 self.ids_v, self.V, STAGE)

    def draft_logits(self, drafter_head, token_ids: jax.Array | None):
        """drafter_head(start, rows) -> [rows] logits; token_ids: a draft vocabulary's target ids [V'] or None
        -> (this device's shard of the drafter head's logits [rows] (-inf off its own rows), their token ids
        [rows], the head's `Shards`)."""
        s = self.s
        hs = vocab.Shards(self.V if token_ids is None else token_ids.shape[0], self.D)
        rows, own = hs.ids(s), hs.own(s)
        logits = jnp.where(own, drafter_head(hs.start(s), hs.rows), -jnp.inf)
        return logits, rows if token_ids is None else token_ids[rows], hs

    def draft_sampled(self, logits: jax.Array, ids: jax.Array, hs: vocab.Shards, token_ids: jax.Array | None,
                      pos: jax.Array):
        """A draw for `pos` with its draft key from the drafter head's shard (logits, ids [rows]) -> (token,
        q [vs.rows]: this device's shard of the draft's target-vocabulary distribution, which verification
        reads)."""
        s, vs, D = self.s, self.vs, self.D
        warped = self.warp(logits, hs.own(s), hs.rows)
        d = vocab.categorical(jax.random.fold_in(token_key(self.sp["seed"], pos), vocab.DRAFT), warped, ids, self.V,
                              STAGE)
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
