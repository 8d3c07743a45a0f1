"""Gated DeltaNet (Qwen3.5 linear attention) with a rewindable recurrent state.

Shapes: B batch, T tokens, H hidden, C = conv channels (2 * Hk * Dk + Hv * Dv), K conv kernel,
Hk/Hv key/value heads, Dk/Dv key/value head dims, R ring depth.

The recurrence per value head (state S [Dk, Dv], float32):
    S <- S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
with q, k L2-normalised, q scaled by Dk^-0.5, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
`delta_rule_recurrent` runs it token by token (one-token steps); `delta_rule_chunked` runs the same
recurrence in chunks with a triangular solve per chunk (prefill, training); they are tested equal.

Rewind: the layer's state lives in a ring of R slots indexed by position. A call for tokens at
[pos, pos+T) reads the state after token pos-1 from slot (pos-1) % R and writes the state after
token pos+T-1 to slot (pos+T-1) % R. Restoring the state of k tokens ago is therefore just running
the next call at pos-k, valid while k < R and the k tokens were absorbed by calls that each ended on a
slot (one-token steps always do). The SPD engine sizes R to the pipeline depth n.

A call with `every_state=True` writes the state after each of its T tokens to that token's slot
(`write_slots`; needs R >= T), so chain verification can rewind into the middle of its multi-token
call: after accepting j of k drafts, the next call simply starts at the position after them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from spd_jax.config import ModelConfig
from spd_jax.models.layers import dense

CHUNK = 64


class LinearState(NamedTuple):
    """Ring of saved states of a stack of n Gated DeltaNet layers."""

    conv: jax.Array  # [n, R, B, K-1, C] the last K-1 conv inputs, oldest first
    ssm: jax.Array  # [n, R, B, Hv, Dk, Dv] float32 recurrent state

    @property
    def depth(self) -> int:
        return self.ssm.shape[1]


def init_linear_state(cfg: ModelConfig, n_layers: int, batch: int, ring: int, dtype) -> LinearState:
    lc = cfg.linear
    return LinearState(
        conv=jnp.zeros((n_layers, ring, batch, lc.conv_kernel - 1, lc.conv_dim), dtype),
        ssm=jnp.zeros((n_layers, ring, batch, lc.num_v_heads, lc.k_dim, lc.v_dim), jnp.float32))


def read_slot(state: LinearState, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The state after token pos-1 of every layer: conv [n, B, K-1, C], ssm [n, B, Hv, Dk, Dv]
    (zeros at pos 0)."""
    slot = (pos - 1) % state.depth
    conv = jax.lax.dynamic_index_in_dim(state.conv, slot, axis=1, keepdims=False)
    ssm = jax.lax.dynamic_index_in_dim(state.ssm, slot, axis=1, keepdims=False)
    fresh = pos == 0
    return jnp.where(fresh, 0, conv).astype(conv.dtype), jnp.where(fresh, 0.0, ssm)


def write_slot(state: LinearState, conv: jax.Array, ssm: jax.Array, last_pos: jax.Array,
               layer_offset: int = 0) -> LinearState:
    """Store layers [layer_offset, layer_offset+n)'s states after token last_pos in its slot."""
    slot = last_pos % state.depth
    conv_all = jax.lax.dynamic_update_slice(state.conv, conv[:, None].astype(state.conv.dtype),
                                            (layer_offset, slot, 0, 0, 0))
    ssm_all = jax.lax.dynamic_update_slice(state.ssm, ssm[:, None], (layer_offset, slot, 0, 0, 0, 0))
    return LinearState(conv_all, ssm_all)


def write_slots(state: LinearState, conv: jax.Array, ssm: jax.Array, first_pos: jax.Array,
                layer_offset: int = 0) -> LinearState:
    """Store layers [layer_offset, layer_offset+n)'s states after each of T tokens, token i (at position
    first_pos + i) in its slot: conv [n, B, T, K-1, C], ssm [n, B, T, Hv, Dk, Dv]. Needs T <= R (the
    slots of T consecutive positions are then distinct)."""
    T = ssm.shape[2]
    if T > state.depth:
        raise ValueError(f"a call of {T} tokens keeping every state needs a ring of >= {T} slots, not {state.depth}")
    n = ssm.shape[0]
    slots = (first_pos + jnp.arange(T)) % state.depth
    layers = layer_offset + jnp.arange(n)
    # [n, B, T, ...] -> [n, T, B, ...]: one scatter of n x T (layer, slot) blocks
    conv_all = state.conv.at[layers[:, None], slots[None, :]].set(jnp.swapaxes(conv, 1, 2).astype(state.conv.dtype))
    ssm_all = state.ssm.at[layers[:, None], slots[None, :]].set(jnp.swapaxes(ssm, 1, 2))
    return LinearState(conv_all, ssm_all)


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, s0, every_state: bool = False):
    """Token-by-token form. q, k [B, T, Hv, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; s0 [B, Hv, Dk, Dv].
    All float32, q/k already normalised and q scaled. Returns (o [B, T, Hv, Dv], s [B, Hv, Dk, Dv]), or
    with every_state (o, s [B, T, Hv, Dk, Dv]): the state after each token."""
    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        u = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * u[..., None, :]
        return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t), s if every_state else None)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, (o, states) = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1), (jnp.moveaxis(states, 0, 1) if every_state else s)


def delta_rule_chunked(q, k, v, g, beta, s0, chunk: int = CHUNK):
    """Chunked form of `delta_rule_recurrent` (same arguments and results).

    Within a chunk, with c_t the cumulative log decay and S0 the state at the chunk start, the deltas
    u solve the unit lower-triangular system
        u_t + beta_t sum_{j<t} e^{c_t - c_j} (k_t.k_j) u_j = beta_t (v_t - e^{c_t} S0^T k_t),
    then o_t = e^{c_t} S0^T q_t + sum_{j<=t} e^{c_t - c_j} (q_t.k_j) u_j and
    S_end = e^{c_C} S0 + sum_j e^{c_C - c_j} k_j u_j^T. Padding tokens (beta = 0, g = 0) change nothing.
    """
    B, T, Hv, Dk = k.shape
    n = -(-T // chunk)
    pad = n * chunk - T

    def prep(a):  # [B, T, Hv, ...] -> [n, B, Hv, chunk, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, n, chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3) if a.ndim == 5 else jnp.moveaxis(
            jnp.moveaxis(a, 1, 0), 2, 3)

    qc, kc, vc, gc, bc = (prep(a) for a in (q, k, v, g, beta))  # [n, B, Hv, C, ...]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)

    def step(s, xs):
        q_c, k_c, v_c, g_c, b_c = xs  # [B, Hv, C, D*] / [B, Hv, C]
        c = jnp.cumsum(g_c, axis=-1)
        diff = c[..., :, None] - c[..., None, :]
        decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # [B, Hv, C, C], zero above the diagonal
        kk = jnp.einsum("bhtk,bhjk->bhtj", k_c, k_c)
        a = jnp.where(strict, b_c[..., None] * decay * kk, 0.0)
        eye = jnp.eye(chunk, dtype=a.dtype)
        rhs = b_c[..., None] * (v_c - jnp.exp(c)[..., None] * jnp.einsum("bhtk,bhkv->bhtv", k_c, s))
        u = solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
        qk = jnp.einsum("bhtk,bhjk->bhtj", q_c, k_c) * decay
        o = jnp.exp(c)[..., None] * jnp.einsum("bhtk,bhkv->bhtv", q_c, s) + qk @ u
        tail = jnp.exp(c[..., -1:] - c)  # [B, Hv, C]
        s = jnp.exp(c[..., -1])[..., None, None] * s + jnp.einsum("bhtk,bhtv->bhkv", k_c * tail[..., None], u)
        return s, o

    s, o = jax.lax.scan(step, s0, (qc, kc, vc, gc, bc))  # o [n, B, Hv, C, Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, Hv, n * chunk, -1)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), s


def gated_deltanet(lp: dict, x: jax.Array, conv_prev: jax.Array, s_prev: jax.Array, cfg: ModelConfig,
                   length: jax.Array | None = None, chunked: bool | None = None, every_state: bool = False):
    """One Gated DeltaNet block on T tokens that follow the given state.

    x [B, T, H] (normed); conv_prev [B, K-1, C]; s_prev [B, Hv, Dk, Dv] float32.
    length: how many of the T tokens are real (default T); the padding after them leaves the states
    untouched, so a prompt padded to a shape bucket gives the state of the prompt alone.
    chunked: None picks the recurrent form for T == 1 and the chunked form otherwise.
    Returns (out [B, T, H], conv_new [B, K-1, C], s_new [B, Hv, Dk, Dv]); with every_state the states
    after each token, conv_new [B, T, K-1, C] and s_new [B, T, Hv, Dk, Dv], from the recurrent form
    whatever `chunked` says (it is the form that has them; a chain's pass is only k + 1 tokens).
    """
    lc = cfg.linear
    B, T, _ = x.shape
    K = lc.conv_kernel
    mixed = dense(x, lp["w_qkv"])  # [B, T, C]
    full = jnp.concatenate([conv_prev.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    # Depthwise causal conv: out[t] = sum_j w[j] * full[t + j]; conv_w [K, C].
    conv = sum(full[:, j:j + T] * lp["conv_w"][j] for j in range(K))
    conv = jax.nn.silu(conv)
    if every_state:
        if length is not None:
            raise ValueError("every_state keeps each token's state; a padded call (length) has no use for it")
        conv_new = jnp.stack([full[:, i + 1:i + K] for i in range(T)], axis=1)  # the K-1 inputs ending at token i
    elif length is None:
        conv_new = full[:, T:]  # the last K-1 inputs
    else:
        conv_new = jax.lax.dynamic_slice_in_dim(full, length, K - 1, axis=1)

    vs, dk = lc.value_size, lc.k_dim
    groups = conv.reshape(B, T, lc.num_k_heads, -1)  # channels grouped by key head (`schema.qkv_groups`)
    q = groups[..., :dk].astype(jnp.float32)  # [B, T, Hk, Dk]
    k = groups[..., dk:2 * dk].astype(jnp.float32)
    v = groups[..., 2 * dk:].reshape(B, T, lc.num_v_heads, lc.v_dim).astype(jnp.float32)
    q = _l2norm(q) * (lc.k_dim ** -0.5)
    k = _l2norm(k)
    rep = lc.num_v_heads // lc.num_k_heads  # value head h reads key head h // rep
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    beta = jax.nn.sigmoid(dense(x, lp["w_b"]).astype(jnp.float32))
    g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        dense(x, lp["w_a"]).astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    if length is not None:  # padding: no decay (g = 0), no write (beta = 0)
        real = (jnp.arange(T) < length)[None, :, None]
        beta, g = jnp.where(real, beta, 0.0), jnp.where(real, g, 0.0)

    if every_state:
        o, s_new = delta_rule_recurrent(q, k, v, g, beta, s_prev.astype(jnp.float32), every_state=True)
    else:
        use_chunked = (T > 1) if chunked is None else chunked
        rule = delta_rule_chunked if use_chunked else delta_rule_recurrent
        o, s_new = rule(q, k, v, g, beta, s_prev.astype(jnp.float32))  # o [B, T, Hv, Dv]

    # Gated RMSNorm per value head: plain weight, gated by silu(z), normalised in float32.
    z = dense(x, lp["w_z"]).reshape(B, T, lc.num_v_heads, lc.v_dim)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = lp["norm_w"] * o.astype(x.dtype)
    o = (o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    return dense(o.reshape(B, T, vs), lp["w_out"]), conv_new, s_new
