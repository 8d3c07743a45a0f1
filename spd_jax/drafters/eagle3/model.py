"""An EAGLE-3 chain drafter: the resource-matched baseline of a standard speculative method, in the
architecture of the standard EAGLE-3 checkpoints (SpecForge's `LlamaForCausalLMEagle3`, as SGLang runs it).

The draft row at position t reads the target's hidden states at a low, a middle and a high layer
(concatenated in layer order, [3H]) fused to [H] by one linear layer (`fc`), and the embedding of the token at
t + 1 (the target's embedding, shared). One decoder layer with its own KV cache: its attention's q/k/v read
[input_layernorm(embedding) | hidden_norm(feature)] ([2H], embedding first); the residual stream is the
feature; then post_attention_layernorm and a SwiGLU MLP. Its own final norm and LM head (over a draft
vocabulary, whose rows' target ids are SpecForge's `d2t` offsets added to the row index) predict the token at
t + 2. The layer is a Llama layer (no biases, no q/k norm, no output gate, RoPE over the whole head, norms
scaling by w) of its own sizes (`DraftLayer`: heads, head size, MLP width, norm epsilon, RoPE; the target's
by default), or, in checkpoints written before it (format 1), the target's own attention layer, which for a
Llama target is the same function. Drafting k tokens: the first comes from the last verified row; draft step
i > 0 adds a row at the next position whose feature is the drafter's own previous output before its final
norm (not passed through `fc`: the target has not run that token yet) and whose token is the previous draft.

Training ("training-time test", `Eagle3.train_logits`, `eagle3_loss`) unrolls those steps over every
position of a teacher-forced sequence with the attention pattern inference has: step i's row at index t
(position t + i) attends to the step-0 rows at positions <= t and to the rows of steps 1..i at index t,
so what is trained is what `Eagle3Drafter.propose` computes (tests/test_chain.py checks it).

This module holds the drafter's config and network, the chain loop's drafter (`Eagle3Drafter`; the loop is
`decode.chain`) and its weight schema (`weight_schema`: each weight's name and shape in a standard EAGLE-3
checkpoint, which `spd_jax.convert.eagle3` reads); its loss, checkpoints and registry entry are `kind`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig, RopeConfig
from spd_jax.drafters.shared import DraftHead, logical_axes, random_variables, target_signature
from spd_jax.models import decoder, schema
from spd_jax.models.attention import (KVCache, attention, group_queries, init_kv_cache, output_projection,
                                      project_qkv, softmax_blocks)
from spd_jax.models.kinds import FULL_ATTENTION
from spd_jax.models.layers import dense_dot_general, residual_block, rms_norm, rope_cos_sin


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers, as hidden-state indices (h_l = the input of layer l): the inputs of
    layers 2, L/2 and L-3, clipped into [0, L] and sorted for tiny models."""
    L = num_layers
    return tuple(sorted((min(2, L), L // 2, max(L - 3, 0))))


@dataclasses.dataclass(frozen=True)
class DraftLayer:
    """The sizes of the standard EAGLE-3 decoder layer (a checkpoint's config.json holds them): a Llama layer
    of the target's hidden size, with its own heads, head size, MLP width, norm epsilon and RoPE."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size) < 1 or \
                self.num_heads % self.num_kv_heads:
            raise ValueError(f"an EAGLE-3 layer needs positive sizes and heads a multiple of its kv heads, got {self}")

    @classmethod
    def of_target(cls, cfg: ModelConfig) -> "DraftLayer":
        """The target's sizes and RoPE base (SpecForge's configs copy them), RoPE over the whole head."""
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps, cfg.rope)

    def config(self, target: ModelConfig) -> ModelConfig:
        """The one-layer Llama `ModelConfig` the layer's math follows (hidden size and vocabulary the target's)."""
        return ModelConfig(model_type="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope=self.rope, tie_word_embeddings=target.tie_word_embeddings, qkv_bias=False,
                           o_bias=False, mlp_bias=False, qk_norm=False,
                           max_position_embeddings=target.max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layers: tuple[int, ...]  # hidden-state indices of the fused features (low, mid, high)
    target: tuple  # `psm.target_signature` of the target it belongs to
    draft_vocab: int = 0  # V': the head over a draft vocabulary; 0 = the target's whole vocabulary
    layer: DraftLayer | None = None  # the standard layer's sizes; None: the target's own attention layer (format 1)

    @classmethod
    def for_target(cls, cfg: ModelConfig, layers: Sequence[int] | None = None, draft_vocab: int = 0,
                   layer: DraftLayer | None = None) -> "Eagle3Config":
        """A drafter for the target cfg: the standard layer (of the target's sizes unless given)."""
        layers = tuple(int(b) for b in layers) if layers is not None else default_layers(cfg.num_layers)
        if not layers or min(layers) < 0 or max(layers) > cfg.num_layers:
            raise ValueError(f"feature layers must be hidden-state indices in [0, {cfg.num_layers}], got {layers}")
        if not 0 <= draft_vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab must be in 0..{cfg.vocab_size} (0: the whole vocabulary), got {draft_vocab}")
        return cls(layers, target_signature(cfg), 0 if draft_vocab == cfg.vocab_size else int(draft_vocab),
                   layer or DraftLayer.of_target(cfg))

    def layer_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the decoder layer, its norms (the final one too) and its KV cache follow, for the target
        cfg: the standard layer's, or the target's own."""
        return cfg if self.layer is None else self.layer.config(cfg)


def layer_schema(cfg: ModelConfig) -> dict[str, schema.Leaf]:
    """The drafter's decoder layer of the layer config cfg (`Eagle3Config.layer_config`): a full-attention
    layer whose q/k/v (and output gate) projections read [2H] (normed embedding | normed feature), plus the
    feature half's norm (`hidden_norm`; `attn_norm` normalises the embedding half, EAGLE-3's input_layernorm)."""
    s = dict(FULL_ATTENTION.schema(cfg))
    for key in ("wq", "wk", "wv", "wq_gate"):
        if key in s:
            leaf = s[key]
            # [2H] is not the "embed" axis (another size, two things concatenated): replicated
            s[key] = dataclasses.replace(leaf, shape=(2 * leaf.shape[0], leaf.shape[1]), axes=(None, leaf.axes[1]),
                                         hf_shape=(leaf.hf_shape[0], 2 * leaf.hf_shape[1]))
    s["hidden_norm"] = dataclasses.replace(s["attn_norm"], hf="hidden_norm.weight")
    return s


def weight_schema(cfg: ModelConfig, spec: Eagle3Config) -> dict[tuple[str, ...], schema.Leaf]:
    """Every float weight of the drafter for the target cfg: its path in the variables' params -> its leaf,
    whose `hf` name and `hf_shape` are those of a standard EAGLE-3 checkpoint (`fc`, `midlayer.*`, `norm`,
    `lm_head`; SpecForge's names, without SGLang's optional "model." prefix)."""
    lcfg, H = spec.layer_config(cfg), cfg.hidden_size
    mH, V = len(spec.layers) * H, spec.draft_vocab or cfg.vocab_size
    out = {("fc", "kernel"): schema.Leaf((mH, H), (None, "embed"), "fc.weight", (H, mH), schema.TRANSPOSE, "normal")}
    out |= {(f"layer_{k}",): dataclasses.replace(leaf, hf=f"midlayer.{leaf.hf}")
            for k, leaf in layer_schema(lcfg).items()}
    out[("final_norm",)] = schema.global_schema(lcfg, "")["final_norm"]  # "norm.weight"
    axis = "draft_vocab" if spec.draft_vocab else "vocab"
    return out | {("lm_head",): schema.Leaf((V, H), (axis, "embed"), "lm_head.weight", (V, H), schema.SAME, "normal")}


class Eagle3(DraftHead, nn.Module):
    cfg: ModelConfig  # the target's
    spec: Eagle3Config

    def setup(self):
        H = self.cfg.hidden_size
        logical = nn.with_logical_partitioning
        self.fc = nn.Dense(H, use_bias=False, dot_general=dense_dot_general, name="fc",
                           kernel_init=logical(nn.initializers.lecun_normal(), (None, "embed")))
        lcfg, weights = self.lcfg, weight_schema(self.cfg, self.spec)

        def param(name):
            leaf = weights[(name,)]
            return self.param(name, logical(schema.initializer(leaf, lcfg), leaf.axes), leaf.shape)

        self.layer = {k: param(f"layer_{k}") for k in layer_schema(lcfg)}
        self.final_norm = param("final_norm")
        self.setup_head(logical)

    @property
    def lcfg(self) -> ModelConfig:
        """The decoder layer's config (`Eagle3Config.layer_config`)."""
        return self.spec.layer_config(self.cfg)

    def fuse(self, feats: jax.Array) -> jax.Array:
        """feats [..., m*H] (the target's hidden states at `spec.layers`, concatenated) -> [..., H]."""
        return self.fc(feats.astype(self.lm_head.dtype))

    def _inputs(self, feat: jax.Array, emb: jax.Array) -> jax.Array:
        lp, eps, off = self.layer, self.lcfg.rms_norm_eps, self.lcfg.norm_offset
        return jnp.concatenate([rms_norm(emb, lp["attn_norm"], eps, off), rms_norm(feat, lp["hidden_norm"], eps, off)],
                               axis=-1)

    def _block(self, feat: jax.Array, emb: jax.Array, mixer):
        """The drafter's layer: the residual block on feat, its attention (mixer) reading [norm(emb) |
        hidden_norm(feat)] -> (out, what the mixer gives besides its output)."""
        return residual_block(self.layer, feat, mixer, self.lcfg, mixer_input=self._inputs(feat, emb))

    def step(self, feat: jax.Array, emb: jax.Array, cache: KVCache, pos: jax.Array):
        """Rows at positions [pos, pos+T) over the drafter's cache (positions < pos): feat [B, T, H]
        (fused target features, or the drafter's own previous outputs), emb [B, T, H] (embeddings of the
        tokens one position later); cache k/v [B, Nkv, S, D]. -> (out [B, T, H] before the final norm,
        cache with the rows written)."""
        T = feat.shape[1]
        cos, sin = rope_cos_sin(self.lcfg, pos + jnp.arange(T))
        x, (k_new, v_new) = self._block(feat, emb, lambda h: (lambda a, k, v: (a, (k, v)))(
            *attention(self.layer, h, cache.k, cache.v, pos, cos, sin, self.lcfg)))
        cache = KVCache(jax.lax.dynamic_update_slice(cache.k, k_new, (0, 0, pos, 0)),
                        jax.lax.dynamic_update_slice(cache.v, v_new, (0, 0, pos, 0)))
        return x, cache

    def head_logits(self, x: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V'] over the head's rows."""
        return decoder.head_logits(x, self.final_norm, self.lm_head, self.lcfg)

    def logits(self, x: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V] over the target's vocabulary (-inf off a draft vocabulary)."""
        return self.expand(self.head_logits(x))

    def train_logits(self, feats: jax.Array, emb: jax.Array, steps: int) -> jax.Array:
        """The training-time test: feats [B, T, m*H] teacher-forced target features, emb [B, T, H] the
        embeddings of the sequence's tokens -> float32 head logits [steps, B, T, V'], entry [i, :, t]
        being draft step i made after the verified position t + 1 (the row at position t + i, predicting
        the token at t + i + 2), exactly as `Eagle3Drafter.propose` makes it when its earlier drafts were
        the sequence's tokens. Entries whose inputs run past the sequence's end are garbage."""
        cfg, lp = self.lcfg, self.layer
        B, T, _ = feats.shape
        dt = self.lm_head.dtype
        tpos = jnp.arange(T)
        causal = tpos[None, :] <= tpos[:, None]  # [T(query), T(key)]
        feat = self.fuse(feats)
        emb = emb.astype(dt)
        keys0 = None  # step 0's keys/values: the verified rows' chain
        diag = []  # steps 1..i's keys/values, one per index t (the row at position t + j)
        out = []
        for i in range(steps):
            tok = jnp.pad(emb, ((0, 0), (0, 1 + i), (0, 0)))[:, 1 + i:]  # the token at t + 1 + i
            cos, sin = rope_cos_sin(cfg, tpos + i)

            def mixer(x2, i=i, cos=cos, sin=sin, keys0=keys0, diag=diag):
                q, k, v = project_qkv(lp, x2, cos, sin, cfg)  # [B, T, N, D]
                qg = group_queries(q, cfg)  # [B, T, Nkv, G, D]
                keys0, diag = ((k, v), diag) if i == 0 else (keys0, [*diag, (k, v)])
                s0 = jnp.einsum("btkgd,bskd->btkgs", qg, keys0[0], preferred_element_type=jnp.float32)
                blocks = [jnp.where(causal[None, :, None, None, :], s0, -jnp.inf)]
                blocks += [jnp.einsum("btkgd,btkd->btkg", qg, kj, preferred_element_type=jnp.float32)[..., None]
                           for kj, _ in diag]
                p = softmax_blocks(blocks)
                o = jnp.einsum("btkgs,bskd->btkgd", p[0].astype(dt), keys0[1])
                for pj, (_, vj) in zip(p[1:], diag):
                    o = o + pj.astype(dt) * vj[:, :, :, None, :]
                return output_projection(lp, o.reshape(B, T, cfg.q_size), x2, cfg), (keys0, diag)

            # step i's output: step i + 1's feature at the same index
            feat, (keys0, diag) = self._block(feat, tok, mixer)
            out.append(self.head_logits(feat))
        return jnp.stack(out)

    def __call__(self, feats, emb, cache, pos):
        x, cache = self.step(self.fuse(feats), emb, cache, pos)
        return self.logits(x), cache

    def create(self, feats: jax.Array):
        """Touches every variable and runs nothing else: `init` through it traces no layer (fast)."""
        return self.fuse(feats), self.layer, self.final_norm, self.token_ids()


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """`drafters.base.ChainDrafter` of an EAGLE-3 network. params: `drafter_params(variables, target)`
    (its variables and the target's embedding, shared). State: (its KV cache [1, Nkv, S, D], the output
    [H] of the newest verified row, which predicts the first draft)."""

    cfg: ModelConfig
    spec: Eagle3Config
    k: int

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.spec.layers

    def _apply(self, params, *args, method):
        return Eagle3(self.cfg, self.spec).apply(params["vars"], *args, method=method)

    def init(self, params, cache_len, dtype):
        kv = init_kv_cache(self.spec.layer_config(self.cfg), 1, 1, cache_len, dtype)
        return KVCache(kv.k[0], kv.v[0]), jnp.zeros((self.cfg.hidden_size,), dtype)

    def _rows(self, params, cache, feats, next_tokens, pos, last):
        emb = decoder.embed(params, next_tokens[None])
        x, cache = self._apply(params, self._apply(params, feats[None], method=Eagle3.fuse), emb, cache, pos,
                               method=Eagle3.step)
        return cache, jax.lax.dynamic_index_in_dim(x[0], last, keepdims=False)

    def prefill(self, params, state, feats, next_tokens, length):
        return self._rows(params, state[0], feats, next_tokens, jnp.int32(0), length - 1)

    def commit(self, params, state, feats, next_tokens, pos, count):
        return self._rows(params, state[0], feats, next_tokens, pos, count - 1)

    def propose(self, params, state, pos, choose):
        cache, x = state
        d0, q0 = choose(self._apply(params, x, method=Eagle3.logits), 0)

        def step(carry, i):
            cache, x, d = carry
            x, cache = self._apply(params, x[None, None], decoder.embed(params, d.reshape(1, 1)), cache, pos - 1 + i,
                                   method=Eagle3.step)
            x = x[0, 0]
            d, q = choose(self._apply(params, x, method=Eagle3.logits), i)
            return (cache, x, d), (d, q)

        (cache, _, _), (ds, qs) = jax.lax.scan(step, (cache, x, d0), jnp.arange(1, self.k))
        # the state keeps the verified row's output: the next round starts from the rows commit writes
        return jnp.concatenate([d0[None], ds]), jnp.concatenate([q0[None], qs]), (cache, state[1])


def drafter_params(variables: dict, target_params: dict) -> dict:
    """The chain loop's drafter params: the EAGLE-3 variables and the target's embedding (shared)."""
    return {"vars": variables, "embed": target_params["embed"]}


def _init_boxed(cfg: ModelConfig, spec: Eagle3Config, seed) -> dict:
    return Eagle3(cfg, spec).init(jax.random.key(seed), jnp.zeros((1, len(spec.layers) * cfg.hidden_size)),
                                  method=Eagle3.create)


def init_eagle3(cfg: ModelConfig, spec: Eagle3Config, target_params: dict, seed: int = 0, dtype=jnp.float32,
                vocab_ids=None) -> dict:
    """Random drafter weights (seeded); the LM head and final norm copied from the target's (the head's
    rows at vocab_ids [V'] with a draft vocabulary, which then needs them; the norm scaling as the target's
    does, whichever of w and 1 + w each scales by)."""
    out = random_variables(_init_boxed, cfg, spec, target_params, seed, dtype, vocab_ids, "an EAGLE-3 drafter")
    shift = cfg.norm_offset - spec.layer_config(cfg).norm_offset
    # trained: a copy, not aliased
    out["params"]["final_norm"] = jnp.array(jnp.asarray(target_params["final_norm"], dtype) + shift, dtype, copy=True)
    return out


def eagle3_axes(cfg: ModelConfig, spec: Eagle3Config) -> dict:
    """The variables pytree with each leaf's logical axes in place of the array."""
    return logical_axes(_init_boxed, cfg, spec)
