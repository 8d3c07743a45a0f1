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
import numpy as np
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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _batch_rows(row_caches: list, start: jax.Array, *, cfg: ModelConfig) -> list:
    """Per-row prefilled caches (a list over rows of per-layer lists, row b's prompt at slots [0, len_b))
    -> one batch's per-layer caches whose prompts all end at slot P (start [B] = P - len_b)."""
    stacked = jax.tree.map(lambda *rows: jnp.stack(rows), *row_caches)  # vmap's layout: a leading row axis
    return [KINDS[kind].align_rows(c, start) for kind, c in zip(cfg.layer_types, stacked)]


@functools.partial(jax.jit, static_argnames=("cfg", "greedy", "filtered"), donate_argnames=("carry",))
def _decode_rows(layers, head, carry: tuple, rows: tuple, eos_ids: jax.Array, sp: dict, p_end: jax.Array,
                 stop_live: jax.Array, *, cfg: ModelConfig, greedy: bool, filtered: bool) -> tuple:
    """Step every row of a batch until all are done, the output is full, or at most stop_live rows are
    still live (the caller then shrinks the batch to them) -> the carry.

    carry: (i [] the next output index, tok [B] the last token, per-layer caches, out [B, out_len], done [B],
    count [B]); rows: (prompt_lens, start, max_new, seeds) [B] each; p_end: the slot where every prompt ends.
    All rows write the one slot p_end + i - 1 (one in-place slice per layer, not a per-row scatter), with
    per-row RoPE positions and first valid slots (`decoder.decode_step`). Finished rows keep stepping on
    garbage and only their outputs are masked: freezing them would select every carry, caches included,
    at every step."""
    prompt_lens, start, max_new, seeds = rows
    out_len = carry[3].shape[1]
    choose_rows = jax.vmap(lambda logits, pos, seed: choose(logits, pos, dict(sp, seed=seed), greedy, filtered))

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < out_len) & (jnp.sum(~done) > stop_live)

    def body(c):
        i, tok, caches, out, done, count = c
        positions = prompt_lens + i - 1  # of `tok`, per row
        logits, caches = decoder.decode_step(layers, head, tok[:, None], caches, p_end + i - 1, cfg,
                                             positions=positions, start=start, attn_block=ATTN_BLOCK)
        nxt = choose_rows(logits[:, 0], positions + 1, seeds)
        live = ~done
        out = out.at[:, i].set(jnp.where(live, nxt, 0))
        done = done | jnp.isin(nxt, eos_ids) | (i + 1 >= max_new)
        return i + 1, nxt, caches, out, done, count + live

    return jax.lax.while_loop(cond, body, carry)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _take_rows(carry: tuple, rows: tuple, keep: jax.Array, n_live: jax.Array, *,
               cfg: ModelConfig) -> tuple[tuple, tuple]:
    """The carry and row arrays of `_decode_rows` -> those of the rows `keep` [B'] alone; slots from n_live
    on are padding (repeats of a live row), marked done."""
    i, tok, caches, out, done, count = carry
    caches = [KINDS[kind].take_rows(c, keep) for kind, c in zip(cfg.layer_types, caches)]
    done = done[keep] | (jnp.arange(keep.shape[0]) >= n_live)
    return (i, tok[keep], caches, out[keep], done, count[keep]), tuple(r[keep] for r in rows)


def generate_batch(params, layers, prompts: list[np.ndarray], max_new: np.ndarray, eos_ids: jax.Array, sp: dict,
                   seeds: np.ndarray, *, cfg: ModelConfig, greedy: bool, filtered: bool,
                   out_len: int) -> tuple[np.ndarray, np.ndarray]:
    """B independent sequences: prompts (B arrays of ids), max_new [B], seeds [B] (sampling) -> (tokens
    [B, out_len], counts [B]), row b as a batch of one gives it, up to the matmuls' summation order (and
    the weights' dtype: bf16 `layers`/params run the bf16 dots).

    Each row is prefilled alone at its own length bucket (`prefill`: a batch of prompts padded to the
    longest would spend most of its prefill on padding), then the caches are moved so that every prompt
    ends at slot P, the longest's bucket. Decoding steps the rows together (`_decode_rows`); once at most
    half of them are live the batch shrinks to the next power of two above the live rows (`_take_rows`),
    so a batch waiting for its longest reply does not step its finished rows all the way. out_len >=
    max(max_new). For bulk generation, not latency."""
    B = len(prompts)
    lens = np.asarray([p.size for p in prompts], np.int32)
    p_end = round_up(int(lens.max()), PROMPT_BUCKET)
    # the longest reply writes up to slot p_end + max(max_new) - 2; bucketed, so few cache shapes compile
    cache_len = round_up(p_end + min(out_len, int(np.max(max_new))), CACHE_BUCKET)
    firsts, row_caches = [], []
    for p, seed in zip(prompts, seeds):
        row = np.zeros((1, round_up(p.size, PROMPT_BUCKET)), np.int32)
        row[0, :p.size] = p
        first, c = prefill(params, jnp.asarray(row), jnp.int32(p.size), dict(sp, seed=jnp.uint32(seed)), cfg=cfg,
                           greedy=greedy, filtered=filtered, cache_len=cache_len)
        firsts.append(first)
        row_caches.append(c)
    first = jnp.stack(firsts)
    caches = _batch_rows(row_caches, jnp.asarray(p_end - lens), cfg=cfg)
    del row_caches, c  # the batch holds them now
    rows = tuple(jnp.asarray(a) for a in (lens, p_end - lens, np.asarray(max_new, np.int32),
                                          np.asarray(seeds, np.uint32)))
    out = jnp.zeros((B, out_len), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids) | (rows[2] <= 1)
    carry = (jnp.int32(1), first, caches, out, done, jnp.ones((B,), jnp.int32))
    tokens, counts = np.zeros((B, out_len), np.int32), np.zeros((B,), np.int32)
    head = decoder.head_params(params)
    slot_row = np.arange(B)  # the prompt each slot of the running batch holds, -1 for padding
    while True:
        width = slot_row.size
        carry = _decode_rows(layers, head, carry, rows, eos_ids, sp, jnp.int32(p_end),
                             jnp.int32(width // 2), cfg=cfg, greedy=greedy, filtered=filtered)
        done_h, out_h, count_h = (np.asarray(a) for a in (carry[4], carry[3], carry[5]))
        real = slot_row >= 0
        tokens[slot_row[real]], counts[slot_row[real]] = out_h[real], count_h[real]
        live = np.flatnonzero(~done_h & real)
        if live.size == 0 or int(carry[0]) >= out_len:
            return tokens, counts
        keep = np.full(1 << (live.size - 1).bit_length(), live[0])  # padding repeats a live row
        keep[:live.size] = live
        carry, rows = _take_rows(carry, rows, jnp.asarray(keep), jnp.int32(live.size), cfg=cfg)
        slot_row = np.where(np.arange(keep.size) < live.size, slot_row[keep], -1)

