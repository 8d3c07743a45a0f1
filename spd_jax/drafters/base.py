"""What the two speculative engines ask of a drafter, and the drafters without a network: none (no
drafts: the chain loop is then autoregressive decoding, the SPD engine the plain pipeline) and oracle
(proposes given reference tokens; tests only).

`ChainDrafter` is what `decode.chain` asks (k drafts per round, then the verified count); `SpdDrafter`
what the SPD engine (`decode.spd`) asks (one draft per cycle for the token entering stage 0, from the
anchor states of the tokens in flight). A drafter implements the one its engine runs (the PSM
`drafters.psm.PSMDrafter`: SPD; the EAGLE-3-style `drafters.eagle3.Eagle3Drafter`: chain), none and
oracle both; the engines hold no drafter-specific branches, only these calls.

A drafter is a frozen dataclass: hashable, a static argument of the jitted loop, holding only static
configuration (chain length k, the target features it reads, its network's config). Its weights
(`params`) and its per-sequence state (a KV cache, a last hidden state) are pytrees passed in and
returned, so one compiled loop serves any weights of the same shapes. A drafter proposes and nothing
else: the loop owns the target, sampling and verification; a drafter sees sampling only through the
`choose` callback the loop hands to `propose`, and verification only as how many tokens were committed.

Positions: `pos` is the position of the newest committed token, the one the next target pass starts
with; the round's drafts are for positions pos+1 .. pos+k. Caches are indexed by position, so a
rejection needs no rollback: the next round overwrites the rejected rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp

from spd_jax.models import decoder

# choose(logits [V] float32 over the target's vocabulary, i) -> (draft token int32, q): the loop's rule
# for the draft at position pos + 1 + i (argmax when greedy; else a draw from the warped logits with the
# position's draft key, and q [V] float32 the warped distribution; q has shape [0] when greedy).
Choose = Callable[[jax.Array, int | jax.Array], tuple[jax.Array, jax.Array]]


class ChainDrafter(Protocol):
    k: int  # drafts per round: the chain length (static)
    feature_layers: tuple[int, ...]  # hidden-state indices it reads (h_0 = embedding, h_l = layer l-1's output)

    def init(self, params: Any, cache_len: int, dtype) -> Any:
        """-> a fresh per-sequence state for positions [0, cache_len)."""

    def prefill(self, params: Any, state: Any, feats: jax.Array, next_tokens: jax.Array,
                length: jax.Array) -> Any:
        """The prompt's positions [0, length): feats [T, F] the target's features at each position
        (F = len(feature_layers) * H), next_tokens [T] the token at position t + 1 (the last one is the
        prefill's committed token); rows past length are padding. -> state."""

    def propose(self, params: Any, state: Any, pos: jax.Array, choose: Choose):
        """-> (drafts [k] int32 for positions pos+1 .. pos+k, q [k, V] float32 their distributions (read
        only when sampling; a greedy `choose` returns an empty q, so [k, 0] is fine then), state)."""

    def commit(self, params: Any, state: Any, feats: jax.Array, next_tokens: jax.Array, pos: jax.Array,
               count: jax.Array) -> Any:
        """After a round: its target pass covered positions [pos, pos+k], feats [k+1, F] there;
        next_tokens [k+1] the committed token at position pos+1+i (valid for i < count); the positions
        [pos, pos+count) are now verified. -> state."""


class SpdCycle(NamedTuple):
    """What the SPD engine knows at the start of a cycle, for the draft of position t + 1 (replicated:
    the same on every device)."""

    seq: jax.Array  # [S] int32: committed tokens, then the in-flight drafts
    t: jax.Array  # position of the newest token (the one entering stage 0 this cycle)
    completed: jax.Array  # positions < completed are verified
    cached: jax.Array  # positions < cached are in the drafter's state (its cache) already
    table: jax.Array  # [W, m, H] the anchor states of positions t - W + 1 .. t (a ring: position % W)
    embeds: jax.Array  # [W, H] the embeddings (h_0) of the tokens at positions t - W + 1 .. t, the same ring
    # [m, H] the anchor states this device's stage made this cycle (zeros for the others): given to a drafter
    # that drafts after a stage's step (`SpdDrafter.after_stage`), on that stage's device; None otherwise
    made: jax.Array | None = None


class SpdOps(NamedTuple):
    """The SPD program's pieces a drafter runs through (inside one `shard_map` over the `stage` axis)."""

    final_norm: jax.Array  # [H] the target's final norm weight (a drafter sharing the target's head)
    # on_device(fn, other, operand): fn(operand) on the drafter's device, other(operand) elsewhere (a
    # `lax.cond`: a drafter's layers run once, on one device); both return the same (varying) types
    on_device: Callable[[Callable, Callable, Any], Any]
    vary: Callable[[Any], Any]  # a replicated value cast to per-device (varying), as loop carries need


# head(start, rows) -> float32 logits [rows] of a drafter head's rows [start, start + rows): the shard one
# device computes
Head = Callable[[jax.Array, int], jax.Array]


class SpdDrafter(Protocol):
    k: int  # drafts per cycle: 1, or 0 for none (the engine then runs the plain pipeline)
    anchors: tuple[int, ...]  # hidden-state indices it reads from the tokens in flight (() for none)
    plan: tuple[int, ...] | None  # the stage plan it was made for (its depth staircase), or None: any
    # None: it drafts from the states at the start of the cycle, concurrently with the stages' step (the PSM's
    # early start); s: after stage s's step, on stage s's device, from what that stage just made (`SpdCycle.made`:
    # PPSD's early exit reads the newest token's state after stage 0), so the draft waits for that stage
    after_stage: int | None
    # Optional (not a member: the engine reads it with a False default), `reads_target_head: bool`: its head is the
    # target's own rows in the target's order (the shared LM head), so the engine skips `spd_head` and computes the
    # draft's logits with the verification's in one pass over each device's rows (one read of the shard, not two)

    def init(self, params: Any, cache_len: int, dtype) -> Any:
        """-> a fresh per-sequence state for positions [0, cache_len) (one copy per device)."""

    def engine_params(self, variables: Any) -> Any:
        """A drafter with a network: its variables in the layout its calls here read (e.g. its layers one
        buffer each), made once when the engine places them."""

    def spd_prefill(self, params: Any, state: Any, anchor_states: jax.Array, ops: SpdOps) -> Any:
        """The prompt's positions, all verified: anchor_states [m, P_pad, H] (rows past the prompt are
        padding). -> state."""

    def spd_draft(self, params: Any, state: Any, cycle: SpdCycle, ops: SpdOps) -> tuple[jax.Array, Any]:
        """The drafter's network for the draft of position cycle.t + 1, run on its device (`ops.on_device`)
        -> (x [H]: its hidden state there, any value elsewhere; state). The engine sends the drafter's
        device's x to every device in the cycle's one exchange of [H] values, then asks `spd_head`. Asked at
        the start of the cycle, or after stage `after_stage`'s step with `cycle.made` set."""

    def spd_head(self, params: Any, h: jax.Array, cycle: SpdCycle, ops: SpdOps) -> tuple[Head, jax.Array | None]:
        """h [H]: `spd_draft`'s x from the drafter's device, on every device -> (head, token_ids): the
        draft head (`Head`), each device computing its shard of the rows, and token_ids [V'] the token id
        of each row (None: the whole vocabulary in order). The engine makes the choice (argmax, or a draw
        with the position's draft key) over the shards, as it does the target's."""


# ---------------------------------------------------------------- what drafters read of the target


def teacher_forward(target: dict, tokens: jax.Array, cfg) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The target teacher-forced on tokens [B, T] from position 0 -> (embedding [B, T, H], every layer's
    output [L, B, T, H], the last layer's output [B, T, H] before the final norm), in the dtype of
    target's weights: what a drafter's training reads its features and its teacher's logits from."""
    B, T = tokens.shape
    cache = decoder.init_cache(cfg, B, T, target["embed"].dtype)
    emb = decoder.embed(target, tokens)
    x, _, hidden = decoder.run_layers(target["layers"], emb, cache, jnp.int32(0), cfg, collect_hidden=True)
    return emb, hidden, x


def anchor_states(emb: jax.Array, hidden: jax.Array | None, anchors: Sequence[int]) -> jax.Array:
    """emb [B, T, H] and hidden [L, B, T, H] (output of every layer, `run_layers(collect_hidden=True)`)
    -> [B, T, m, H] with entry a = h_{b_a} (h_0 the embedding, h_k the output of layer k-1)."""
    if not anchors:
        return jnp.zeros((*emb.shape[:2], 0, emb.shape[-1]), emb.dtype)
    return jnp.stack([emb if b == 0 else hidden[b - 1] for b in anchors], axis=2)


def features(emb: jax.Array, hidden: jax.Array | None, layers: Sequence[int]) -> jax.Array:
    """`anchor_states` at layers, flattened: [B, T, len(layers) * H], h_l for each l in layers side by
    side (the EAGLE-3 fusion's input; [B, T, 0] for no layers)."""
    h = anchor_states(emb, hidden, layers)
    return h.reshape(*h.shape[:2], -1)


def split_params(variables: dict, trains_head: bool = False) -> tuple[dict, dict]:
    """Drafter variables (PSM or EAGLE-3) -> (trainable params, frozen variables): the LM head is the
    target's (its draft vocabulary rows), shared and frozen, unless the drafter trains its own
    (`Training.trains_head`); the draft vocabulary's ids ride along with the frozen part."""
    p = dict(variables["params"])
    if trains_head:
        return p, {**variables, "params": {}}
    head = p.pop("lm_head")
    return p, {**variables, "params": {"lm_head": head}}


def join_params(trainable: dict, frozen: dict) -> dict:
    """The inverse of `split_params`: the drafter's variables."""
    return {**frozen, "params": {**trainable, **frozen["params"]}}


class _Stateless:
    """Both interfaces' bookkeeping for a drafter without a network: no state, no features or anchors
    read, any stage plan."""

    def init(self, params, cache_len, dtype):
        return ()

    def prefill(self, params, state, feats, next_tokens, length):
        return state

    def commit(self, params, state, feats, next_tokens, pos, count):
        return state

    @property
    def anchors(self) -> tuple[int, ...]:
        return ()

    @property
    def plan(self) -> None:
        return None

    @property
    def after_stage(self) -> None:
        return None

    def spd_prefill(self, params, state, anchor_states, ops):
        return state


@dataclasses.dataclass(frozen=True)
class NoDrafter(_Stateless):
    """No drafts (k = 0): each chain round is one target pass that commits its own token, i.e. `ar`;
    the SPD engine with it is the plain pipeline (one token in flight)."""

    vocab_size: int
    k: int = 0
    feature_layers: tuple[int, ...] = ()

    def propose(self, params, state, pos, choose):
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0, self.vocab_size), jnp.float32), state

    def spd_draft(self, params, state, cycle, ops):
        raise AssertionError("the SPD engine asks a drafter with k = 0 for no draft")

    def spd_head(self, params, h, cycle, ops):
        raise AssertionError("the SPD engine asks a drafter with k = 0 for no draft")


@dataclasses.dataclass(frozen=True)
class OracleDrafter(_Stateless):
    """Proposes given reference tokens (tests only): params = `reference(prompt_len, tokens)`, the
    reference token at each absolute position (token 0 past its end). Its q is a point mass on the
    draft. In the SPD engine k = 1 (one draft per cycle)."""

    k: int
    vocab_size: int
    feature_layers: tuple[int, ...] = ()

    @staticmethod
    def reference(prompt_len: int, tokens: Sequence[int]) -> jax.Array:
        """[prompt_len + len(tokens)] int32: the continuation `tokens` at positions prompt_len, ..."""
        return jnp.zeros((prompt_len + len(tokens),), jnp.int32).at[prompt_len:].set(jnp.asarray(tokens, jnp.int32))

    def propose(self, params, state, pos, choose):
        drafts = jnp.take(params, pos + 1 + jnp.arange(self.k), mode="fill", fill_value=0)
        return drafts, jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32), state

    def spd_draft(self, params, state, cycle, ops):
        return jnp.zeros(cycle.table.shape[-1:], cycle.table.dtype), state  # no network: nothing to send

    def spd_head(self, params, h, cycle, ops):
        """A head with all its mass on the reference token: the argmax and any draw are that token, and
        its distribution q is the point mass on it."""
        ref = jnp.take(params, cycle.t + 1, mode="fill", fill_value=0)

        def head(start, rows):
            return jnp.where(start + jnp.arange(rows) == ref, 0.0, -jnp.inf).astype(jnp.float32)

        return head, None
