"""Vocabulary-parallel token choice (spd_jax.decode.vocab) against the single-device rules of
spd_jax.decode.sampling: the same argmax, the same draws for the same keys, the same top-k/top-p set,
the same distributions, on uneven shards (the last one moved back and masked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spd_jax.decode import vocab
from spd_jax.decode.sampling import warp_logits
from spd_jax.sharding import STAGE, stage_mesh
from tolerances import CACHED_VS_FULL, assert_close

V = 203  # not a multiple of any n below: the last shard overlaps its neighbour


def _sharded(fn, n):
    """fn(s, shards) run under shard_map over n stage devices; returns stage 0's (replicated) result."""
    shards = vocab.Shards(V, n)

    def body(dummy):
        out = fn(jax.lax.axis_index(STAGE), shards)
        return jax.tree.map(lambda x: x[None], out)

    smap = jax.shard_map(body, mesh=stage_mesh(n), in_specs=P(STAGE), out_specs=P(STAGE))
    return jax.tree.map(lambda x: np.asarray(x)[0], jax.jit(smap)(jnp.zeros((n,))))


@pytest.mark.parametrize("n", [1, 3, 8])
def test_sharded_choices_equal_the_single_device_rules(n):
    rng = np.random.default_rng(n)
    logits = jnp.asarray(rng.normal(size=V) * 3, jnp.float32)
    top = logits.max() + 1
    logits = logits.at[17].set(top).at[150].set(top)  # a tie: the smaller id wins
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=V), jnp.float32))
    temp, top_k, top_p = jnp.float32(0.7), jnp.int32(9), jnp.float32(0.8)
    keys = [jax.random.key(i) for i in range(16)]
    full = warp_logits(logits, temp, top_k, top_p, True)
    p_full = jax.nn.softmax(full)

    def fn(s, sh):
        ids, own = sh.ids(s), sh.own(s)
        mine = logits[ids]
        w = vocab.warp(mine, own, temp, top_k, top_p, True, 16, STAGE)
        p = vocab.softmax(w, STAGE)
        qs = jnp.where(own, q[ids], 0.0)
        r = vocab.residual(p, qs, STAGE)
        tot = jax.lax.psum(jnp.sum(jnp.where(own, r, 0.0)), STAGE)
        return dict(
            argmax=vocab.argmax(jnp.where(own, mine, -jnp.inf), ids, STAGE),
            draws=jnp.stack([vocab.categorical(k, w, ids, V, STAGE) for k in keys]),
            kept=jax.lax.psum(jnp.sum(own & jnp.isfinite(w)), STAGE),
            p_at=jnp.stack([vocab.pick(p, ids, own, t, STAGE) for t in range(0, V, 7)]),
            res_at=jnp.stack([vocab.pick(r, ids, own, t, STAGE) for t in range(0, V, 7)]) / tot)

    got = _sharded(fn, n)
    assert got["argmax"] == 17
    assert got["draws"].tolist() == [int(jax.random.categorical(k, full)) for k in keys]
    assert got["kept"] == int(jnp.isfinite(full).sum())
    # float32 softmax: the shards sum exp in another order (a few ulps)
    assert_close(got["p_at"], np.asarray(p_full)[::7], CACHED_VS_FULL, what="sharded softmax")
    res = np.maximum(np.asarray(p_full) - np.asarray(q), 0)
    assert_close(got["res_at"], (res / res.sum())[::7], CACHED_VS_FULL, what="sharded residual")


def test_residual_falls_back_to_p_when_q_covers_it():
    p = jnp.asarray([0.5, 0.5, 0.0])
    assert np.asarray(vocab.residual(p, p, None)).tolist() == [0.5, 0.5, 0.0]
