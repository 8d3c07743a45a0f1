"""Plain autoregressive decoding: prefill, then a decode loop that runs entirely on device.

The loop is a `lax.while_loop` inside one jitted program (no host round trip per token unless a
stream sink is attached); prompt, cache and output lengths are padded to buckets so a new prompt or
length rarely recompiles; the KV cache is donated so it is updated in place. This is the reference
every speculative path is tested against.

Prefill runs the model's stacked layers; the loop runs `decoder.decode_step` on a per-layer copy of
the weights (`decoder.decode_layers`, built once per model by the caller) and per-layer caches, so
a step reads each weight once, in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from spd_jax.config import ModelConfig
from spd_jax.decode.sampling import choose
from spd_jax.models import decoder, schema
from spd_jax.sharding import Placement

PROMPT_BUCKET = 64
CACHE_BUCKET = 128
OUT_BUCKET = 64


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# A stream sink is host state; the compiled loop calls this trampoline so that attaching a different
# sink does not change (and recompile) the program.
_stream_sink = None


def set_stream_sink(fn) -> None:
    global _stream_sink
    _stream_sink = fn


def _emit(token, index):
    if _stream_sink is not None:
        _stream_sink(int(token), int(index))


@functools.partial(jax.jit, static_argnames=("cfg", "greedy", "filtered", "cache_len", "placement"))
def prefill(params, prompt: jax.Array, prompt_len: jax.Array, sp: dict, *, cfg: ModelConfig, greedy: bool,
            filtered: bool, cache_len: int, placement: Placement | None = None):
    """prompt [1, P_pad] (valid up to prompt_len) -> (first token [], per-layer caches of cache_len
    positions, as `decode_loop` takes them).

    Padding positions write garbage keys past prompt_len, which decode overwrites before they are
    ever attended to (attention only reaches positions <= the query's own); recurrent layers stop
    their state at prompt_len. placement (tensor parallelism): the caches are pinned to their logical
    shardings (KV heads split where the weights' are), which the decode loop then keeps.
    """
    cache = decoder.init_cache(cfg, 1, cache_len, params["embed"].dtype)
    if placement is not None:
        cache = placement.constrain(cache, schema.cache_axes(cfg))
    x, cache, _ = decoder.run_layers(params["layers"], decoder.embed(params, prompt), cache,
                                     jnp.int32(0), cfg, length=prompt_len)
    last = jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)  # [1, 1, H]
    logits = decoder.lm_logits(params, last, cfg)[0, 0]
    if placement is not None:
        cache = placement.constrain(cache, schema.cache_axes(cfg))
    return choose(logits, prompt_len, sp, greedy, filtered), decoder.split_cache(cache, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "greedy", "filtered", "out_len", "stream"),
                   donate_argnames=("caches",))
def decode_loop(layers, head, first: jax.Array, prompt_len: jax.Array, caches: list, max_new: jax.Array,
                eos_ids: jax.Array, sp: dict, *, cfg: ModelConfig, greedy: bool, filtered: bool,
                out_len: int, stream: bool):
    """Generate up to max_new tokens (first included) -> (tokens [out_len], count, caches).

    layers: `decoder.decode_layers`; head: embedding, final norm (and LM head); caches: prefill's.
    Token i (0-based) sits at position prompt_len + i; stops after an EOS token (which is kept).
    """
    out = jnp.zeros((out_len,), jnp.int32).at[0].set(first)
    done0 = jnp.any(first == eos_ids)
    if stream:
        io_callback(_emit, None, first, jnp.int32(0), ordered=True)

    def cond(c):
        i, _, _, _, done = c
        return (i < max_new) & ~done

    def body(c):
        i, tok, caches, out, _ = c
        pos = prompt_len + i - 1  # position of `tok`
        logits, caches = decoder.decode_step(layers, head, tok.reshape(1, 1), caches, pos, cfg)
        nxt = choose(logits[0, 0], pos + 1, sp, greedy, filtered)
        out = jax.lax.dynamic_update_index_in_dim(out, nxt, i, 0)
        if stream:
            io_callback(_emit, None, nxt, i, ordered=True)
        return i + 1, nxt, caches, out, jnp.any(nxt == eos_ids)

    n, _, caches, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), first, caches, out, done0))
    return out, n, caches


@functools.partial(jax.jit, static_argnames=("cfg", "greedy", "filtered", "cache_len", "out_len"))
def generate_batch(params, layers, prompts: jax.Array, prompt_lens: jax.Array, max_new: jax.Array,
                   eos_ids: jax.Array, sp: dict, seeds: jax.Array, *, cfg: ModelConfig, greedy: bool,
                   filtered: bool, cache_len: int, out_len: int):
    """B independent sequences in one program: prompts [B, P_pad] (row b valid up to prompt_lens[b]),
    max_new [B], seeds [B] (sampling) -> (tokens [B, out_len], counts [B]).

    Each row runs `prefill` and then `decode_loop`'s step on its own cache and position (vmapped per
    step), so its tokens are the ones a batch of one would give, up to the matmul's summation order.
    The loop is written out rather than vmapped whole: a vmapped while_loop freezes finished rows by
    selecting every carry, caches included, at every step (a full copy of all caches per token); here
    finished rows keep stepping on garbage and only their outputs are masked. For bulk generation on
    the device (self-distillation data), not latency."""
    head = {k: v for k, v in params.items() if k != "layers"}

    def prefill_row(prompt, plen, seed):
        return prefill(params, prompt[None], plen, dict(sp, seed=seed), cfg=cfg, greedy=greedy, filtered=filtered,
                       cache_len=cache_len)

    def step_row(tok, caches, pos, seed):
        logits, caches = decoder.decode_step(layers, head, tok.reshape(1, 1), caches, pos, cfg)
        return choose(logits[0, 0], pos + 1, dict(sp, seed=seed), greedy, filtered), caches

    first, caches = jax.vmap(prefill_row)(prompts, prompt_lens, seeds)  # [B], per-row caches
    B = prompts.shape[0]
    out = jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids) | (max_new <= 1)

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < out_len) & ~jnp.all(done)

    def body(c):
        i, tok, caches, out, done, count = c
        pos = jnp.minimum(prompt_lens + i - 1, cache_len - 1)  # finished rows: clamped, their output unused
        nxt, caches = jax.vmap(step_row)(tok, caches, pos, seeds)
        live = ~done
        out = out.at[:, i].set(jnp.where(live, nxt, 0))
        done = done | jnp.isin(nxt, eos_ids) | (i + 1 >= max_new)
        return i + 1, nxt, caches, out, done, count + live

    _, _, _, out, _, count = jax.lax.while_loop(cond, body, (jnp.int32(1), first, caches, out, done,
                                                             jnp.ones((B,), jnp.int32)))
    return out, count
