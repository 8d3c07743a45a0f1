"""What every drafter with a network takes from its target, in one place: the target's signature (what a
checkpoint records of the architecture it belongs to), the frozen LM head copied from the target's (its
rows of a draft vocabulary), the draft vocabulary's ids, the head's module half (`DraftHead`), and the
seeded random variables and logical axes of a drafter's Flax module, and its full-attention layers in the
two layouts (`attention_layers`). No checkpoint I/O (`store`), no drafter-specific layout (each drafter's
own module)."""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models import decoder, schema
from spd_jax.models.attention import KVCache, init_kv_cache
from spd_jax.models.kinds import FULL_ATTENTION
from spd_jax.models.layers import rope_cos_sin

SIGNATURE_FIELDS = ("model_type", "hidden_size", "num_layers", "vocab_size", "num_heads", "num_kv_heads")


def target_signature(cfg: ModelConfig) -> tuple:
    """(model_type, hidden, layers, vocab, heads, kv heads): the target a drafter belongs to."""
    return (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads)


def check_target(signature: tuple, cfg: ModelConfig, error: type[Exception], label: str, where: str) -> None:
    """Refuse a drafter whose recorded target signature is not cfg's, naming each field that differs."""
    want = target_signature(cfg)
    if tuple(signature) != want:
        diff = [f"{k}: checkpoint {a} vs model {b}" for k, a, b in zip(SIGNATURE_FIELDS, signature, want) if a != b]
        raise error(f"{label} checkpoint {where} was trained for another model ({'; '.join(diff)})")


def check_vocab_ids(ids, spec, cfg: ModelConfig) -> jax.Array:
    """A draft vocabulary's token ids [V']: sorted, distinct, inside the target's vocabulary."""
    a = np.asarray(ids)
    if a.shape != (spec.draft_vocab,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"the draft vocabulary needs {spec.draft_vocab} integer token ids, got shape {a.shape} "
                         f"{a.dtype}")
    if a.size and (a[0] < 0 or a[-1] >= cfg.vocab_size or (np.diff(a) <= 0).any()):
        raise ValueError(f"draft vocabulary ids must be sorted, distinct and in [0, {cfg.vocab_size})")
    return jnp.asarray(a, jnp.int32)


def target_head(cfg: ModelConfig, spec, target_params: dict, vocab_ids, dtype, what: str) -> dict:
    """A drafter's frozen LM head copied from the target's -> {"lm_head": [V', H]} (the caller puts it in
    its params), plus {"vocab": {"ids": [V']}} with a draft vocabulary (its rows at vocab_ids, which it
    then needs). what names the drafter in the error."""
    head = decoder.lm_head(target_params, cfg)
    out = {}
    if spec.draft_vocab:
        if vocab_ids is None:
            raise ValueError(f"{what} with a draft vocabulary needs its token ids (vocab_ids)")
        out["vocab"] = {"ids": check_vocab_ids(vocab_ids, spec, cfg)}
        head = head[out["vocab"]["ids"]]
    return dict(out, lm_head=jnp.asarray(head, dtype))


class DraftHead:
    """The head half of a drafter's Flax module (a mixin; the module has `cfg`, the target's, and `spec`
    with draft_vocab): an LM head [V', H] over the whole vocabulary or a draft vocabulary, whose rows'
    token ids ride in the `vocab` collection."""

    def setup_head(self, logical) -> None:
        """Call from setup: the `lm_head` param and, with a draft vocabulary, the `vocab`/`ids` variable."""
        V, H = self.spec.draft_vocab or self.cfg.vocab_size, self.cfg.hidden_size
        # a draft vocabulary's rows are not the target's "vocab" axis (another size, other units)
        vocab_axis = "draft_vocab" if self.spec.draft_vocab else "vocab"
        self.lm_head = self.param("lm_head", logical(nn.initializers.normal(0.02), (vocab_axis, "embed")), (V, H))
        if self.spec.draft_vocab:  # [V'] token ids of the head's rows, sorted; not trained
            self.vocab_ids = self.variable("vocab", "ids", lambda: jnp.arange(V, dtype=jnp.int32))

    def token_ids(self) -> jax.Array:
        """[V'] int32: the token id of each head row."""
        if self.spec.draft_vocab:
            return self.vocab_ids.value
        return jnp.arange(self.cfg.vocab_size, dtype=jnp.int32)

    def expand(self, logits: jax.Array) -> jax.Array:
        """[..., V'] head logits -> [..., V] target-vocabulary logits, -inf off the draft vocabulary."""
        if not self.spec.draft_vocab:
            return logits
        full = jnp.full((*logits.shape[:-1], self.cfg.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., self.vocab_ids.value].set(logits)


def module_params(params: dict, cfg: ModelConfig, draft_vocab: int) -> dict:
    """A drafter's variables as its module declares them, for a call inside the SPD engine's program: a head
    the engine placed split by vocabulary rows (this device's rows) is swapped for a stand-in of the declared
    shape [V', H], a broadcast no part of the body reads, so XLA never builds it; the head itself is applied
    as placed (`sharded_head`)."""
    head = params["params"]["lm_head"]
    whole = (draft_vocab or cfg.vocab_size, cfg.hidden_size)
    if head.shape == whole:
        return params
    stand_in = jnp.broadcast_to(jnp.zeros((), head.dtype), whole)
    return {**params, "params": {**params["params"], "lm_head": stand_in}}


def sharded_head(params: dict, h: jax.Array, final_norm: jax.Array, cfg: ModelConfig):
    """A drafter's head as the SPD engine places it -> head(start, rows): float32 logits [rows] of the head's
    rows [start, start + rows) for the hidden state h [H] (the target's final norm, then the head's rows, all
    of them or this device's when split by rows): one device's shard (`drafters.base.Head`)."""
    head_rows = params["params"]["lm_head"]

    def head(start, rows):
        return decoder.head_logits(h, final_norm, head_rows, cfg, start, rows)

    return head


# init_boxed(cfg, spec, seed) -> a drafter module's variables with their logical axes (Flax boxes)
InitBoxed = Callable[[ModelConfig, object, object], dict]


# above this many bytes of float32 params, a random drafter is made one leaf per program (`_random_params`)
ONE_PROGRAM_BYTES = 1 << 28


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _random_leaves(init_boxed: InitBoxed, cfg: ModelConfig, spec, seed, dtype, names: tuple[str, ...]) -> dict:
    """The module's random params named `names` (top-level keys), in dtype; the others, the random `lm_head`
    among them ([V, H] float32: 2.5 GB for Qwen3.5-4B), are dropped inside the program, so XLA never makes
    them."""
    params = nn.unbox(init_boxed(cfg, spec, seed))["params"]
    return jax.tree.map(lambda t: t.astype(dtype), {k: params[k] for k in names})


def _random_params(init_boxed: InitBoxed, cfg: ModelConfig, spec, seed, dtype) -> dict:
    """The module's random params in dtype, all but its `lm_head`, which the target's replaces. A large
    drafter's are made one top-level leaf per program: the values are the same (each leaf's key follows from
    its path), and XLA's float32 temporaries are one leaf's, not the whole module's (Qwen3.5-4B's PSM: 2.7 GB
    of them in one program, which n processes of a host make at once)."""
    shapes = jax.eval_shape(lambda: nn.unbox(init_boxed(cfg, spec, seed))["params"])
    names = tuple(k for k in shapes if k != "lm_head")
    if sum(4 * t.size for k in names for t in jax.tree.leaves(shapes[k])) <= ONE_PROGRAM_BYTES:
        return _random_leaves(init_boxed, cfg, spec, seed, dtype, names)
    return {k: _random_leaves(init_boxed, cfg, spec, seed, dtype, (k,))[k] for k in names}


def random_variables(init_boxed: InitBoxed, cfg: ModelConfig, spec, target_params: dict, seed: int, dtype,
                     vocab_ids, what: str) -> dict:
    """A drafter's seeded random variables in dtype, its LM head copied from the target's (`target_head`)."""
    params = _random_params(init_boxed, cfg, spec, seed, jnp.dtype(dtype))
    out = {"params": params, **target_head(cfg, spec, target_params, vocab_ids, dtype, what)}
    params["lm_head"] = out.pop("lm_head")
    return out


@functools.lru_cache(maxsize=None)
def param_count(init_boxed: InitBoxed, cfg: ModelConfig, spec, own_head: bool) -> int:
    """The drafter's weights, from the shapes its module declares (`jax.eval_shape` of its init, no arrays):
    every param but its `lm_head`, which counts only where the head is its own (own_head), not the target's."""
    shapes = jax.eval_shape(lambda: nn.unbox(init_boxed(cfg, spec, 0))["params"])
    return sum(t.size for k, v in shapes.items() if k != "lm_head" or own_head for t in jax.tree.leaves(v))


def logical_axes(init_boxed: InitBoxed, cfg: ModelConfig, spec) -> dict:
    """The drafter's variables pytree with each leaf's logical axes (a tuple) in place of the array, for
    `spd_jax.sharding.tree_shardings` (a collection without boxes, e.g. `vocab` ids: replicated)."""
    boxed = jax.eval_shape(lambda: init_boxed(cfg, spec, 0))
    return jax.tree.map(lambda x: tuple(x.names) if isinstance(x, nn.LogicallyPartitioned) else (None,) * len(x.shape),
                        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


# ---------------------------------------------------------------- a drafter's full-attention layers
#
# Stacked ({leaf: [Ls, ...]}): the checkpoints', training's and the converters' layout. Per layer ({leaf:
# (Ls arrays [...])}, `split_layers`): the SPD engine's, as the AR loop and the stages keep theirs, for XLA
# copies a layer's slice out of a stack before its matmuls (1.9x the PSM body's bytes on the CPU) and reads
# a buffer of its own in place. A module built with per_layer declares the same params in that form.


def attention_layers(module: nn.Module, cfg: ModelConfig, num_layers: int, per_layer: bool) -> dict:
    """Declare (from a module's setup) a drafter's Ls full-attention layers of cfg's kind as params
    `layer_<leaf>`: stacked [Ls, ...] with logical axes, or per_layer a tuple of Ls [...] buffers."""
    out = {}
    for k, leaf in FULL_ATTENTION.schema(cfg).items():
        init = schema.initializer(leaf, cfg)
        if per_layer:  # the engine's, made by splitting a stacked module's variables; a key per layer regardless
            out[k] = module.param(f"layer_{k}", lambda key, shape, init=init: tuple(
                init(k_, shape) for k_ in jax.random.split(key, num_layers)), leaf.shape)
        else:
            out[k] = module.param(f"layer_{k}", nn.with_logical_partitioning(init, ("layers", *leaf.axes)),
                                  (num_layers, *leaf.shape))
    return out


def split_layers(variables: dict) -> dict:
    """A drafter's variables with stacked layers -> the per-layer layout (each `layer_<leaf>` [Ls, ...] a
    tuple of Ls buffers, copied once). Already split: unchanged."""
    params = variables["params"]
    return {**variables, "params": {k: (tuple(v[i] for i in range(v.shape[0]))
                                         if k.startswith("layer_") and not isinstance(v, tuple) else v)
                                    for k, v in params.items()}}


def init_layer_caches(cfg: ModelConfig, num_layers: int, cache_len: int, dtype, per_layer: bool):
    """A drafter's KV cache of one sequence: KVCache k/v [Ls, 1, Nkv, S, D], or per_layer a tuple of Ls
    KVCache [1, Nkv, S, D]."""
    if not per_layer:
        return init_kv_cache(cfg, num_layers, 1, cache_len, dtype)
    return tuple(jax.tree.map(lambda t: t[0], init_kv_cache(cfg, 1, 1, cache_len, dtype)) for _ in range(num_layers))


def run_attention_layers(layers: dict, x: jax.Array, cache, pos: jax.Array, cfg: ModelConfig,
                         length: jax.Array | None = None, last_query: jax.Array | None = None):
    """x [B, T, H] at positions [pos, pos+T) through the layers over their cache -> (x, cache with the rows
    written), in either layout (the cache's matches the layers'). With `last_query` ([Tq] indices into the
    T rows) the last layer runs those rows' queries only (x out [B, Tq, H]), every row still giving its
    keys and values: what a draft that reads one row leaves of the last layer's work."""
    stacked = isinstance(cache, KVCache)
    if stacked and last_query is None:  # one scan
        name = FULL_ATTENTION.name
        x, c, _ = decoder.run_layers({name: layers}, x, decoder.cache_of(name, cache), pos, cfg,
                                     (name,) * cache.k.shape[0], length=length)
        return x, decoder.kind_cache(c, name)
    n = cache.k.shape[0] if stacked else len(cache)
    caches = [FULL_ATTENTION.layer_cache(cache, i) for i in range(n)] if stacked else list(cache)
    cos, sin = rope_cos_sin(cfg, pos + jnp.arange(x.shape[1]))
    for i in range(n):
        x, caches[i] = FULL_ATTENTION.block({k: v[i] for k, v in layers.items()}, x, caches[i], pos, cos, sin, cfg,
                                            query=last_query if i == n - 1 else None)
    return x, KVCache(*(jnp.stack(t) for t in zip(*caches))) if stacked else tuple(caches)
