"""Token choice and the speculative acceptance rule over a vocabulary split across devices.

An LM head is as costly as several layers (SmolLM2's 49,152 x 576 head reads as many bytes as 8 of its
30 layers; Qwen3.5's 248k vocabulary is a third of the 0.8B model), so the SPD engine does not leave it
on one device: each of the n devices of the `stage` axis computes the logits of one contiguous shard of
the head's rows, and the argmax, the sampling draw and the accept/replace decision are made by
collectives over that axis that move scalars only (an argmax: one all-gather of each shard's maximum and
its id; and, for a top-k filter, each shard's k best logits; top-p without top-k is the one case that
gathers the vocabulary's logits). The one
vocabulary-sized cost left per draw is the Gumbel noise each device generates (below).

The draws are exactly those of the unsharded rules: `jax.random.categorical(key, w)` is
argmax(w + gumbel(key, [V])), so each shard adds its slice of the same [V] noise and the global argmax
(first index among equal maxima, as `jnp.argmax`) is the same token. With `axis=None` every function
is the plain single-device rule.

`verify_greedy` and `verify_sampled` are the one verification rule of every speculative method: the SPD
engine calls them for its one draft per cycle over the `stage` axis, the chain loop (`decode.chain`)
for each of its k drafts and the bonus position with `axis=None`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spd_jax.decode.sampling import warp_logits

_NO_ID = jnp.iinfo(jnp.int32).max
# Independent random streams of one position, fold_in'd into its token key (`sampling.token_key`): the
# draft's draw, the acceptance test, the residual's draw. The target's own sample uses the token key
# itself, exactly as autoregressive sampling does, so a position without a draft draws what `ar` draws.
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Shards:
    """`size` rows split into n contiguous shards of `rows` each (the last one moved back so it stays in
    range; rows it shares with the previous shard are not its own and are masked)."""

    size: int
    n: int

    @property
    def rows(self) -> int:
        return -(-self.size // self.n)

    def start(self, s: jax.Array) -> jax.Array:
        return jnp.minimum(s * self.rows, self.size - self.rows)

    def ids(self, s: jax.Array) -> jax.Array:
        """[rows] int32: the row index of each of shard s's rows."""
        return self.start(s) + jnp.arange(self.rows, dtype=jnp.int32)

    def own(self, s: jax.Array) -> jax.Array:
        """[rows] bool: the rows shard s answers for (each row belongs to exactly one shard)."""
        return self.ids(s) >= s * self.rows


def _psum(x, axis):
    return x if axis is None else jax.lax.psum(x, axis)


def _pmax(x, axis):
    return x if axis is None else jax.lax.pmax(x, axis)


def shard_best(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits [rows] (-inf off the shard's own rows), ids [rows] -> [2] int32: this shard's maximum
    (float32, its bits) and the smallest id at it: what one shard tells the others for an argmax."""
    top = jnp.max(logits).astype(jnp.float32)
    first = jnp.min(jnp.where(logits == top, ids, _NO_ID)).astype(jnp.int32)
    return jnp.stack([jax.lax.bitcast_convert_type(top, jnp.int32), first])


def best_of(best: jax.Array) -> jax.Array:
    """best [D, ..., 2]: every shard's `shard_best` -> [...] int32: the id of the global maximum, the
    smallest among equal maxima (the shards whose maximum is the global one hold their smallest id at it;
    the others hold no row equal to it)."""
    top = jax.lax.bitcast_convert_type(best[..., 0], jnp.float32)  # [D, ...]
    return jnp.min(jnp.where(top == jnp.max(top, axis=0), best[..., 1], _NO_ID), axis=0)


def as_words(rows: jax.Array) -> jax.Array:
    """rows [k, H] of a 2- or 4-byte dtype -> [k, H * itemsize / 4] int32, their bits: so rows travel in the
    same all-gather as `shard_best`'s int32 (one collective, not two)."""
    size = rows.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(rows, jnp.int32)
    if size == 2 and rows.shape[-1] % 2 == 0:
        return jax.lax.bitcast_convert_type(rows.reshape(*rows.shape[:-1], -1, 2), jnp.int32)
    raise ValueError(f"rows of {rows.dtype} and width {rows.shape[-1]} do not pack into int32 words")


def winner_rows(every: jax.Array, chosen: jax.Array, dtype) -> jax.Array:
    """every [D, k, 2 + words]: each shard's `shard_best` and its best token's row (`as_words`), gathered;
    chosen [k]: `best_of`'s ids -> [k, H] in dtype: the row the shard holding each chosen id sent."""
    winner = jnp.argmax(every[..., 1] == chosen[None], axis=0)  # [k] the shard whose best is the chosen id
    words = every[winner, jnp.arange(chosen.shape[0]), 2:]  # [k, words]
    if jnp.dtype(dtype).itemsize == 4:
        return jax.lax.bitcast_convert_type(words, dtype)
    return jax.lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], -1)


def gather(x: jax.Array, axis: str | None) -> jax.Array:
    """Every device's x, stacked: [D, ...] and the same on every device (one all-gather); [1, ...]
    with axis=None."""
    return x[None] if axis is None else jax.lax.all_gather(x, axis, to="invarying")


def argmax(logits: jax.Array, ids: jax.Array, axis: str | None) -> jax.Array:
    """logits [rows] (-inf off the shard's own rows), ids [rows] -> the id of the global maximum,
    the smallest id among equal maxima (int32, the same on every device): one all-gather of each
    shard's `shard_best` (the SPD engine gathers its two heads' in one, `decode.spd`)."""
    return best_of(gather(shard_best(logits, ids), axis))


def softmax(logits: jax.Array, axis: str | None) -> jax.Array:
    """[rows] shard of the logits -> the same shard of softmax over all rows (float32)."""
    logits = logits.astype(jnp.float32)
    e = jnp.exp(logits - _pmax(jnp.max(logits), axis))
    return e / _psum(jnp.sum(e), axis)


def pick(values: jax.Array, ids: jax.Array, own: jax.Array, token: jax.Array, axis: str | None) -> jax.Array:
    """The value at row `token` from whichever shard owns it (float32, the same on every device)."""
    return _psum(jnp.sum(jnp.where(own & (ids == token), values, 0.0)), axis)


def categorical(key: jax.Array, logits: jax.Array, token_ids: jax.Array, vocab_size: int,
                axis: str | None) -> jax.Array:
    """A draw from softmax(logits) over all shards: exactly `jax.random.categorical(key, full)` where
    full [vocab_size] holds each shard's logits at its rows' token ids (-inf elsewhere)."""
    noise = jax.random.gumbel(key, (vocab_size,), jnp.float32)[token_ids]
    return argmax(logits.astype(jnp.float32) + noise, token_ids, axis)


def warp(logits: jax.Array, own: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
         filtered: bool, cap: int, axis: str | None) -> jax.Array:
    """`sampling.warp_logits` (temperature, then `sampling.keep_mask`'s top-k and top-p) on a shard
    [rows] -> the warped shard (float32, -inf outside the kept set and off the shard's own rows). The
    filter's threshold comes from each shard's `cap` best logits gathered over the axis: exact when
    cap >= top_k (top-k keeps only tokens among them, top-p only ever drops more); cap = rows (top-p
    without top-k) is the one case that gathers the whole vocabulary."""
    def candidates(tempered):  # [rows] -> [n * cap]: every shard's best
        best = jax.lax.top_k(tempered, cap)[0]
        return best if axis is None else jax.lax.all_gather(best, axis).reshape(-1)

    return warp_logits(jnp.where(own, logits, -jnp.inf), temperature, top_k, top_p, filtered, candidates)


def residual(p: jax.Array, q: jax.Array, axis: str | None) -> jax.Array:
    """The distribution a rejected draft is replaced from, unnormalised: max(p - q, 0), or p itself
    where p <= q everywhere (q == p up to rounding: any token is then a correct draw)."""
    r = jnp.maximum(p - q, 0.0)
    return jnp.where(_psum(jnp.sum(r), axis) > 0, r, p)


def accept(p_draft: jax.Array, q_draft: jax.Array, u: jax.Array) -> jax.Array:
    """Speculative sampling's test for a draft d ~ q: accept with probability min(1, p(d) / q(d))."""
    return u * q_draft < p_draft


def verify_greedy(logits: jax.Array, ids: jax.Array, drafted: jax.Array, axis: str | None):
    """Greedy verification of one position: logits [rows] (-inf off the shard's own rows), ids [rows]
    -> (accepted: drafted == the target's argmax, the argmax: what the position commits otherwise)."""
    y = argmax(logits, ids, axis)
    return drafted == y, y


def verify_sampled(key: jax.Array, warped: jax.Array, q: jax.Array, drafted: jax.Array, has_draft: jax.Array,
                   ids: jax.Array, own: jax.Array, vocab_size: int, axis: str | None):
    """Speculative sampling at one position. key: the position's token key; warped [rows]: the target's
    warped logits (-inf outside the kept set and off the shard's own rows); q [rows]: the draft's
    distribution on the same rows (zeros off them); drafted: the draft token (ignored without one);
    has_draft: whether the position holds a draft (the same on every device).
    -> (accepted, token): accepted = has_draft and u q(d) < p(d); token = what the position commits when
    not accepted: a draw from norm(max(p - q, 0)) (p itself where that is all zero) after a draft, the
    target's own draw from p (with the key itself, as `ar`) without one. One draw either way: each costs
    Gumbel noise over the whole vocabulary."""
    p = softmax(warped, axis)
    u = jax.random.uniform(jax.random.fold_in(key, ACCEPT))
    ok = has_draft & accept(pick(p, ids, own, drafted, axis), pick(q, ids, own, drafted, axis), u)
    res_key = jax.random.fold_in(key, RESIDUAL)
    draw_key = jax.random.wrap_key_data(jnp.where(has_draft, jax.random.key_data(res_key), jax.random.key_data(key)))
    dist = jnp.where(has_draft, jnp.log(residual(p, q, axis)), warped)
    return ok, categorical(draw_key, dist, ids, vocab_size, axis)
