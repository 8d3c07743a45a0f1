"""Sampling rules, separate from the network: validation, logit warping and token choice.

Temperature, top-k and top-p are runtime values (no recompilation when they change); only whether
decoding is greedy and whether a top-k/top-p filter is active are compile-time switches (and, in the
SPD engine, top-k's power of two: how many candidates each vocabulary shard contributes). The random
key of a token is derived from (seed, position), never from loop state, so every drafter and every
device that must agree on a draw gets the same key for the same position.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _real(v) -> bool:  # Python and numpy numbers alike; a bool is a flag, not a number
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a method chooses tokens, checked once here: `generate(..., sampling=Sampling(temperature=0.7,
    top_p=0.9, seed=1))`; the default is greedy. Every path (ar, the chain, the SPD engine, batches) reads
    this one value: its compile-time switches (`greedy`, `filtered`) and its `runtime` arrays."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None or 0 = off
    top_p: float | None = None  # None or 1.0 = off
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if not _real(t) or math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (not _integer(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be a positive integer (or None/0 for no top-k), got {self.top_k!r}")
        p = self.top_p
        if p is not None and (not _real(p) or math.isnan(p) or not 0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (or None for no top-p), got {p!r}")
        if not _integer(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32) (it becomes a uint32 key), got {self.seed!r}")
        # numpy scalars pass the checks above; plain Python values from here on (e.g. int.bit_length on top_k)
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("seed", int)):
            v = getattr(self, name)
            object.__setattr__(self, name, None if v is None else kind(v))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Whether a top-k / top-p filter is active (a compile-time switch: it sorts the vocabulary)."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0)

    def runtime(self) -> dict[str, jax.Array]:
        """The values that go into the compiled loop as data."""
        return dict(temperature=jnp.float32(self.temperature or 1.0),
                    top_k=jnp.int32(self.top_k or 0),
                    top_p=jnp.float32(self.top_p if self.top_p is not None else 1.0),
                    seed=jnp.uint32(self.seed))


def keep_threshold(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [..., C] (temperature applied; any set holding every token top-k keeps, -inf padded) ->
    [..., 1]: the smallest logit that top-k then top-p keep (transformers' order)."""
    C = logits.shape[-1]
    asc = jnp.sort(logits, axis=-1)  # [..., C] ascending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, C), C)
    kth = jnp.take_along_axis(asc, jnp.broadcast_to(C - k, asc.shape[:-1] + (1,)), axis=-1)
    asc = jnp.where(asc >= kth, asc, -jnp.inf)
    # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always stays.
    # (Ascending cumsum, as transformers does, so float rounding picks the same set.)
    tail_mass = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)
    drop = (tail_mass <= 1.0 - top_p).at[..., -1].set(False)
    return jnp.min(jnp.where(drop, jnp.inf, asc), axis=-1, keepdims=True)


def keep_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, candidates: jax.Array | None = None) -> jax.Array:
    """The one filter rule: logits [..., V] (temperature applied) -> bool [..., V], the tokens top-k then
    top-p keep (transformers' order). candidates [..., C]: the logits the threshold is read from, any
    set holding every token top-k keeps (-inf padded); default the logits themselves. The
    vocabulary-parallel caller (`decode.vocab.warp`) passes each shard's best logits, gathered."""
    return logits >= keep_threshold(logits if candidates is None else candidates, top_k, top_p)


def warp_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                filtered: bool, candidates: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """logits [..., V] -> warped logits [..., V] (float32, -inf outside the kept set).

    Order as in transformers: temperature, then top-k, then top-p on what top-k kept (`keep_mask`).
    candidates(tempered logits) -> the logits `keep_mask` reads its threshold from (default: all).
    """
    logits = logits.astype(jnp.float32) / temperature
    if not filtered:
        return logits
    return jnp.where(keep_mask(logits, top_k, top_p, None if candidates is None else candidates(logits)),
                     logits, -jnp.inf)


def token_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), position)


def choose(logits: jax.Array, position: jax.Array, sp: dict[str, jax.Array], greedy: bool,
           filtered: bool) -> jax.Array:
    """Pick the token for `position` from logits [V] (int32 scalar)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    warped = warp_logits(logits, sp["temperature"], sp["top_k"], sp["top_p"], filtered)
    return jax.random.categorical(token_key(sp["seed"], position), warped).astype(jnp.int32)
