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
from spd_jax.models import decoder
from spd_jax.models.kinds import KINDS
from spd_jax.sharding import Placement

PROMPT_BUCKET = 64
CACHE_BUCKET = 128
OUT_BUCKET = 64
# generate_batch's attention reads its cache in blocks of this many slots, up to the filled ones: on
# XLA:CPU (2 AVX2 cores) 32 beat 16, 64 and 128 by 1.2-1.6x in a decode step at B = 32 with 256 of 512
# slots filled (a scratch measurement; docs/train/replies.md).
ATTN_BLOCK = 32


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
        cache = placement.constrain(cache, decoder.cache_axes(cfg))
    x, cache, _ = decoder.run_layers(params["layers"], decoder.embed(params, prompt), cache,
                                     jnp.int32(0), cfg, length=prompt_len)
    last = jax.lax.dynamic_index_in_dim(x, prompt_len - 1, axis=1)  # [1, 1, H]
    logits = decoder.lm_logits(params, last, cfg)[0, 0]
    if placement is not None:
        cache = placement.constrain(cache, decoder.cache_axes(cfg))
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
    """B independent sequences in one program: prompts [B, P] (row b valid up to prompt_lens[b]),
    max_new [B], seeds [B] (sampling) -> (tokens [B, out_len], counts [B]).

    Each row is prefilled on its own (`prefill`, vmapped), its keys then moved so that every prompt
    ends at slot P; decoding steps all rows at once with one shared write slot P + i - 1 (one
    in-place slice per layer, not a per-row scatter) and per-row RoPE positions and first valid slots
    (`decoder.decode_step`), so row b's tokens are the ones a batch of one gives, up to the matmuls'
    summation order (and the weights' dtype: bf16 `layers`/params run the bf16 dots). Finished rows keep
    stepping on garbage and only their outputs are masked: freezing them would select every carry,
    caches included, at every step. Needs cache_len >= P + max(max_new) - 1. For bulk generation, not
    latency."""
    head = {k: v for k, v in params.items() if k != "layers"}
    B, P = prompts.shape

    def prefill_row(prompt, plen, seed):
        return prefill(params, prompt[None], plen, dict(sp, seed=seed), cfg=cfg, greedy=greedy, filtered=filtered,
                       cache_len=cache_len)

    first, caches = jax.vmap(prefill_row)(prompts, prompt_lens, seeds)  # [B], per-row caches
    start = P - prompt_lens  # [B] each row's first valid slot once aligned
    # each layer's per-row caches -> one batch whose prompts end at slot P (`LayerKind.align_rows`)
    caches = [KINDS[kind].align_rows(c, start) for kind, c in zip(cfg.layer_types, caches)]
    out = jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids) | (max_new <= 1)
    choose_rows = jax.vmap(lambda logits, pos, seed: choose(logits, pos, dict(sp, seed=seed), greedy, filtered))

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < out_len) & ~jnp.all(done)

    def body(c):
        i, tok, caches, out, done, count = c
        positions = prompt_lens + i - 1  # of `tok`, per row
        logits, caches = decoder.decode_step(layers, head, tok[:, None], caches, P + i - 1, cfg,
                                             positions=positions, start=start, attn_block=ATTN_BLOCK)
        nxt = choose_rows(logits[:, 0], positions + 1, seeds)
        live = ~done
        out = out.at[:, i].set(jnp.where(live, nxt, 0))
        done = done | jnp.isin(nxt, eos_ids) | (i + 1 >= max_new)
        return i + 1, nxt, caches, out, done, count + live

    _, _, _, out, _, count = jax.lax.while_loop(cond, body, (jnp.int32(1), first, caches, out, done,
                                                             jnp.ones((B,), jnp.int32)))
    return out, count
