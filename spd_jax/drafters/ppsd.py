"""PPSD, pipeline-parallel self-speculative decoding (Li et al., arXiv 2509.19368), as a drafter of the SPD
engine: an early-exit head drafts the next token from the newest token's state at the end of stage 0.

PPSD splits the target into pipeline stages; the first ("early-exit") part ends in a small head that drafts
the next token as soon as the newest token has passed it, while the remaining stages verify the tokens
ahead of it ("verify-while-draft"). Run by the SPD engine that is: in the cycle where x_t passes stage 0,
the head reads h_e(x_t) (e = the layers of stage 0) and drafts x_{t+1}, which enters stage 0 the next
cycle; verification, rollback and sampling are the engine's. The one difference from the PSM is when the
draft runs: after stage 0's step of the cycle, on stage 0's device (`after_stage` = 0), not concurrently
with it from the states at the start of the cycle, so stage 0's device does its layers and the head in
series (PPSD's cost), and the draft sees only the shallow state h_e, never a deeper one.

What the sources leave open, chosen here (docs/engine.md, "PPSD"):
- the exit is the end of stage 0 (hidden-state index e = plan[0]): PPSD's early-exit layers form the first
  pipeline stage, and the SPD reference's tables configure PPSD only by its stage count and "layers=1";
- "layers=1" is the head's decoder layers (`num_layers`, default 1): Ls full-attention layers of the
  target's kind (its weight schema; the residual block the PSM runs, `decoder.run_layers`) over the rows
  h_e of every position (its own KV cache, RoPE at absolute positions, no projection: h_e is the residual
  stream), then the target's final norm and LM head (frozen, shared; optionally over a draft vocabulary);
- the head reads h_e only, not the token's embedding again (the early-exit state already carries it);
- trained by self-distillation: KL(target || head) on the frozen target's own logits at every response
  position (`ppsd_loss`), on the PSM's data and recipe machinery; its layers may start as copies of the
  target's full-attention layers that follow the exit (`layers_from_target`), the head is the target's.

A token's h_e depends only on the tokens up to it, and every position's row is written when its token
passes stage 0, so the head's cache is exact after a rollback without any rewind: the replacement and
the tokens after it overwrite their rows. Training is therefore one causal pass over teacher-forced h_e
(`EarlyExit.train_hidden`), equal to the engine's one row per cycle (tests/test_ppsd.py), and the
teacher-forced draft is the same at every pipeline fill (`drafts_by_fill`, for `infer.replay`).

This module holds the drafter's config, network, engine drafter, loss, checkpoints and registry entry
(`KIND`, with `TRAINING`); the engine is `decode.spd`."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.drafters import store
from spd_jax.drafters.base import anchor_states, join_params, teacher_forward
from spd_jax.drafters.kind import DrafterKind, Training
from spd_jax.drafters.objective import distill_queries
from spd_jax.drafters.shared import (DraftHead, attention_layers, check_target, init_layer_caches, logical_axes,
                                     module_params, param_count, random_variables, run_attention_layers, sharded_head,
                                     split_layers, target_signature)
from spd_jax.models import decoder
from spd_jax.models.attention import KVCache, init_kv_cache
from spd_jax.models.costs import head_cost, kind_cost
from spd_jax.models.kinds import FULL_ATTENTION, layers_of

FORMAT = 1  # ppsd.json layout version
KIND_NAME = "ppsd"
EXIT = 1  # the exit state's index among the anchors (0, e): anchor 0, the embedding, is the engine's convention
# Trained early-exit heads shipped with the package, one directory per (default model, n): "<model>-n<n>".
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "ppsds"


def shipped_ppsd(model_name: str | None, n: int) -> Path | None:
    """The trained PPSD head shipped for a known default model at n stages, if there is one."""
    p = SHIPPED_DIR / f"{model_name}-n{n}"
    return p if model_name and (p / "ppsd.json").is_file() else None


@dataclasses.dataclass(frozen=True)
class PPSDConfig:
    num_layers: int  # decoder layers of the early-exit head (the SPD reference's PPSD "layers=1")
    plan: tuple[int, ...]  # layers per pipeline stage: the exit is the end of stage 0
    target: tuple  # `target_signature` of the target it belongs to
    draft_vocab: int = 0  # V': the head over a draft vocabulary; 0 = the target's whole vocabulary

    @classmethod
    def for_target(cls, cfg: ModelConfig, stage_counts: Sequence[int], num_layers: int = 1,
                   draft_vocab: int = 0) -> "PPSDConfig":
        plan = tuple(int(c) for c in stage_counts)
        if sum(plan) != cfg.num_layers or min(plan) < 1:
            raise ValueError(f"stage plan {list(plan)} does not split the model's {cfg.num_layers} layers")
        if num_layers < 1:
            raise ValueError(f"the early-exit head needs at least one layer, got {num_layers}")
        if not 0 <= draft_vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab must be in 0..{cfg.vocab_size} (0: the whole vocabulary), got {draft_vocab}")
        draft_vocab = 0 if draft_vocab == cfg.vocab_size else int(draft_vocab)
        return cls(int(num_layers), plan, target_signature(cfg), draft_vocab)

    @property
    def n(self) -> int:
        return len(self.plan)

    @property
    def exit(self) -> int:
        """e: the hidden-state index the head reads, h_e = stage 0's output."""
        return self.plan[0]

    @property
    def anchors(self) -> tuple[int, ...]:
        """What the engine gathers: the embedding (its prefill convention) and h_e."""
        return (0, self.exit)

    @property
    def m(self) -> int:
        return len(self.anchors)


class EarlyExit(DraftHead, nn.Module):
    """PPSD's early-exit head: Ls full-attention decoder layers of the target's kind over rows h_e, then the
    target's final norm and the head's rows."""

    cfg: ModelConfig  # the target's
    spec: PPSDConfig
    per_layer: bool = False  # its layers one buffer each (`drafters.shared.split_layers`): the SPD engine's

    def setup(self):
        logical = nn.with_logical_partitioning
        self.layers = attention_layers(self, self.cfg, self.spec.num_layers, self.per_layer)
        self.setup_head(logical)

    def forward(self, h: jax.Array, cache: KVCache, pos: jax.Array) -> tuple[jax.Array, KVCache]:
        """h [B, T, H] exit states at positions [pos, pos + T) over the head's cache (positions < pos) ->
        (hidden [B, T, H] before the final norm, cache with the rows written)."""
        return run_attention_layers(self.layers, h.astype(self.lm_head.dtype), cache, pos, self.cfg)

    def train_hidden(self, h: jax.Array) -> jax.Array:
        """The training forward: h [B, T, H] teacher-forced exit states of positions 0..T-1 -> [B, T, H], entry
        t the hidden state of the draft for t + 1 (one causal pass: what the engine computes one row a cycle)."""
        cache = init_kv_cache(self.cfg, self.spec.num_layers, h.shape[0], h.shape[1], self.lm_head.dtype)
        return self.forward(h, cache, jnp.int32(0))[0]

    def head_logits(self, x: jax.Array, final_norm: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V'] over the head's rows (the target's final norm first)."""
        return decoder.head_logits(x, final_norm, self.lm_head, self.cfg)

    def logits(self, x: jax.Array, final_norm: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V] over the target's vocabulary (-inf off a draft vocabulary)."""
        return self.expand(self.head_logits(x, final_norm))

    def __call__(self, h, cache, pos, final_norm):
        x, cache = self.forward(h, cache, pos)
        return self.logits(x, final_norm), cache


@dataclasses.dataclass(frozen=True)
class PPSDDrafter:
    """`drafters.base.SpdDrafter` of a PPSD head: it drafts after stage 0's step, on stage 0's device, from
    the exit state stage 0 made of the newest token this cycle (`SpdCycle.made`); its state is its KV cache,
    one row per position, written as the position's token passes stage 0. params: `init_ppsd` / `load_ppsd`'s
    variables."""

    cfg: ModelConfig  # the target's
    spec: PPSDConfig
    k: int = 1

    @property
    def anchors(self) -> tuple[int, ...]:
        return self.spec.anchors

    @property
    def plan(self) -> tuple[int, ...]:
        return self.spec.plan

    @property
    def after_stage(self) -> int:
        return 0

    @property
    def module(self) -> EarlyExit:
        return EarlyExit(self.cfg, self.spec, per_layer=True)

    def engine_params(self, variables: dict) -> dict:
        return split_layers(variables)

    def init(self, params, cache_len: int, dtype):
        return init_layer_caches(self.cfg, self.spec.num_layers, cache_len, dtype, per_layer=True)

    def spd_prefill(self, params, state, anchor_states, ops):
        """The prompt's exit states (anchor_states [m, P_pad, H]) into the cache at [0, P_pad)."""
        params = module_params(params, self.cfg, self.spec.draft_vocab)

        def prefill(cache):  # the rows meet the (per-device) cache in the layers: cast them first
            return self.module.apply(params, ops.vary(anchor_states[EXIT][None]), cache, jnp.int32(0),
                                     method=EarlyExit.forward)[1]

        return ops.on_device(prefill, lambda cache: cache, state)

    def spd_draft(self, params, state, cycle, ops):
        params = module_params(params, self.cfg, self.spec.draft_vocab)

        def body(cache):  # the newest token's row at t: its exit state, made by stage 0 this cycle
            x, cache = self.module.apply(params, cycle.made[EXIT][None, None], cache, cycle.t, method=EarlyExit.forward)
            return x[0, 0], cache

        return ops.on_device(body, lambda cache: (ops.vary(jnp.zeros_like(cycle.made[EXIT])), cache), state)

    def spd_head(self, params, h, cycle, ops):
        ids = (self.module.apply(module_params(params, self.cfg, self.spec.draft_vocab), method=EarlyExit.token_ids)
               if self.spec.draft_vocab else None)
        return sharded_head(params, h, ops.final_norm, self.cfg), ids


def _init_boxed(cfg: ModelConfig, spec: PPSDConfig, seed) -> dict:
    """The head's variables with their logical axes (Flax boxes)."""
    H, T = cfg.hidden_size, 2
    cache = init_kv_cache(cfg, spec.num_layers, 1, T, jnp.float32)
    return EarlyExit(cfg, spec).init(jax.random.key(seed), jnp.zeros((1, T, H)), cache, jnp.int32(0),
                                     jnp.ones((H,), jnp.float32))


def init_ppsd(cfg: ModelConfig, spec: PPSDConfig, target_params: dict, seed: int = 0, dtype=jnp.float32,
              layers_from_target: bool = False, vocab_ids=None) -> dict:
    """Random head layers (seeded), the LM head copied from the target's (its rows at vocab_ids [V'] with a
    draft vocabulary, which then needs them). With layers_from_target, the Ls layers start as copies of the
    target's first Ls full-attention layers from the exit on: the layers that follow h_e in the target (on
    SmolLM2 their first-batch KL is near a random layer's, a copy of the last layer's is far above both)."""
    out = random_variables(_init_boxed, cfg, spec, target_params, seed, dtype, vocab_ids, "a PPSD head")
    if layers_from_target:
        attn = layers_of(cfg, FULL_ATTENTION)  # the target's full-attention layers, in their stack's order
        after = [i for i in attn if i >= spec.exit][:spec.num_layers]
        if len(after) < spec.num_layers:
            raise ValueError(f"layers_from_target: the PPSD head has {spec.num_layers} layers but the target only "
                             f"{len(after)} full-attention layers after its exit (layer {spec.exit}) to copy")
        stack = [attn.index(i) for i in after]  # their places in the target's attention stack
        for k in FULL_ATTENTION.schema(cfg):  # copies: training donates the head's buffers
            out["params"][f"layer_{k}"] = jnp.array(
                target_params["layers"][FULL_ATTENTION.name][k][jnp.asarray(stack)], dtype)
    return out


def ppsd_axes(cfg: ModelConfig, spec: PPSDConfig) -> dict:
    """The variables pytree with each leaf's logical axes in place of the array."""
    return logical_axes(_init_boxed, cfg, spec)


# ---------------------------------------------------------------- training


def exit_states(target: dict, tokens: jax.Array, cfg: ModelConfig, spec: PPSDConfig):
    """The frozen target teacher-forced on tokens [B, T] -> (anchor states [B, T, m, H] at spec.anchors, its
    last layer's output [B, T, H]): the teacher cache's layout (`train.features`), h_e at index EXIT."""
    emb, hidden, x = teacher_forward(target, tokens, cfg)
    return anchor_states(emb, hidden, spec.anchors), x


def ppsd_loss(trainable, frozen, target, batch, keys=None, *, cfg: ModelConfig, spec: PPSDConfig, tau: float = 1.0,
              hard_weight: float = 0.0):
    """Self-distillation, with `psm.psm_loss`'s conventions -> (sum of the masked KL (plus hard_weight x the
    cross-entropy on the teacher's argmax), metric sums). batch: tokens [B, T] int32; query [B, Q] and
    query_mask [B, Q], the positions t whose next token is a response token (their drafts for t + 1 are
    scored); optionally the teacher cache's anchor_states, final_hidden and teacher_argmax. keys: unused (the
    draft does not depend on a pipeline fill), accepted so a training step calls every loss alike. The head
    runs on all T positions (its causal chain), its LM head and the KL only at the queries. Sums: kl_sum,
    agree_sum (top-1 agreement with the unrestricted teacher), positions."""
    del keys
    cd = target["embed"].dtype  # the compute dtype: the caller casts the frozen target once
    variables = jax.tree.map(lambda p: p.astype(cd) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                             join_params(trainable, frozen))
    if "anchor_states" in batch:
        h, x = batch["anchor_states"], batch["final_hidden"]
    else:
        h, x = exit_states(target, batch["tokens"], cfg, spec)
    h, x = jax.lax.stop_gradient((h[:, :, EXIT], x))
    at, w = batch["query"], batch["query_mask"].astype(jnp.float32)
    head = EarlyExit(cfg, spec)
    y = jnp.take_along_axis(head.apply(variables, h, method=EarlyExit.train_hidden), at[..., None], axis=1)
    student = head.apply(variables, y, target["final_norm"], method=EarlyExit.head_logits)  # [B, Q, V']
    x_q = jnp.take_along_axis(x, at[..., None], axis=1)  # [B, Q, H]
    ids = variables["vocab"]["ids"] if spec.draft_vocab else None
    loss, kl_sum, agree = distill_queries(student, x_q, w, target, cfg, ids, batch.get("teacher_argmax"), tau,
                                          hard_weight)
    return loss, dict(kl_sum=kl_sum, agree_sum=(agree * w).sum(), positions=w.sum())


@functools.partial(jax.jit, static_argnums=(0, 1))
def drafts_by_fill(cfg: ModelConfig, spec: PPSDConfig, variables: dict, target: dict, tokens: jax.Array,
                   at: jax.Array | None = None):
    """tokens [B, T] -> (the target's greedy next token [B, R] at positions at [B, R] (default: all T), the
    head's greedy drafts [B, R, n] for position t + 1, teacher-forced: the same at every fill k = 1..n (the
    head reads no in-flight state but the newest token's), the layout `decode.schedule` replays."""
    h, x = exit_states(target, tokens, cfg, spec)
    at = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if at is None else at
    pick = lambda a: jnp.take_along_axis(a, at[..., None], axis=1)  # noqa: E731  [B, T, H] -> [B, R, H]
    nxt = jnp.argmax(decoder.lm_logits(target, pick(x), cfg), -1)
    head = EarlyExit(cfg, spec)
    y = pick(head.apply(variables, h[:, :, EXIT], method=EarlyExit.train_hidden))
    drafts = head.apply(variables, method=EarlyExit.token_ids)[
        jnp.argmax(head.apply(variables, y, target["final_norm"], method=EarlyExit.head_logits), -1)]
    return nxt, jnp.repeat(drafts[..., None], spec.n, -1)


# ---------------------------------------------------------------- checkpoints and the registry entry


class PPSDCheckpointError(ValueError):
    """A PPSD checkpoint that does not belong to this target model (architecture or weights) or stage plan."""


def spec_to_json(spec: PPSDConfig) -> dict:
    return dict(format=FORMAT, kind=KIND_NAME, **dataclasses.asdict(spec))


def spec_from_json(d: dict, where: str = "") -> PPSDConfig:
    if d.get("kind") != KIND_NAME:
        raise PPSDCheckpointError(f"checkpoint {where} is not a PPSD head (kind {d.get('kind')!r})")
    if d.get("format") != FORMAT:
        raise PPSDCheckpointError(f"PPSD checkpoint {where} has format {d.get('format')!r}, this version reads "
                                  f"format {FORMAT}")
    return PPSDConfig(int(d["num_layers"]), tuple(d["plan"]), tuple(d["target"]), int(d.get("draft_vocab", 0)))


def check_spec(spec: PPSDConfig, cfg: ModelConfig, stage_counts: Sequence[int] | None, where: str = "") -> None:
    """Refuse a head made for another target model or stage plan (its exit is the end of stage 0)."""
    check_target(spec.target, cfg, PPSDCheckpointError, "PPSD", where)
    if stage_counts is not None and spec.plan != tuple(int(c) for c in stage_counts):
        raise PPSDCheckpointError(f"PPSD checkpoint {where} was trained for the stage plan {list(spec.plan)} (its exit "
                                  f"after layer {spec.exit}, stage 0's end), not {[int(c) for c in stage_counts]}; "
                                  f"run with --n {spec.n} --stages {','.join(map(str, spec.plan))}")


def _misfit(spec: PPSDConfig, plan) -> str | None:
    if spec.plan == plan.counts:
        return None
    return (f"the PPSD head shipped for this model at n={plan.n} was trained for the stage plan {list(spec.plan)}, "
            f"not {list(plan.counts)}")


def _cost(cfg: ModelConfig, spec: PPSDConfig, context: int, param_bytes: int = 2, cache_bytes: int | None = None,
          rows: int | None = None) -> list:
    """One draft -> [Ls layers, head]: the head's layers on `rows` rows (default 1: the newest token's), its
    KV cache of about `context` rows read once, then its head on one row (V' rows; the final norm is the
    target's)."""
    layer = kind_cost(cfg, FULL_ATTENTION.name, context, param_bytes, param_bytes if cache_bytes is None else cache_bytes,
                      1 if rows is None else rows)
    head = head_cost(cfg, param_bytes, spec.draft_vocab or cfg.vocab_size)
    return ([dataclasses.replace(layer, kind="ppsd_layer")] * spec.num_layers
            + [dataclasses.replace(head, kind="ppsd_head", params=head.params - cfg.hidden_size)])


def _warm_start(model, spec: PPSDConfig, init_from: str, log) -> dict:
    """The head exported at init_from, for a run training spec: the same layer count and target; trained for
    another plan (another exit depth) it is still a warm start of the same shapes (noted)."""
    was = read_spec(init_from)
    if was.num_layers != spec.num_layers:
        raise ValueError(f"init_from {init_from} has {was.num_layers} head layers, this run {spec.num_layers}; set "
                         f"ppsd_layers={was.num_layers}")
    if was.plan != spec.plan:
        log.warning("init_from %s was trained for the plan %s (exit after layer %d); this run's is %s (exit after "
                    "layer %d): a warm start only", init_from, list(was.plan), was.exit, list(spec.plan), spec.exit)
    variables = load_ppsd(init_from, model.config, was.plan, model.params, jnp.float32,
                          target_weights=model.weights_fingerprint, model_name=str(model.path))[1]
    return {**variables, "params": {k: v for k, v in variables["params"].items() if k != "lm_head"}}


def _eval_summary(spec: PPSDConfig, tokens: int, cycles: int, d: Any) -> dict:
    """alpha (tokens per cycle) and S0 = alpha * L / max(stage layers), as SPD's."""
    alpha = tokens / cycles
    return dict(alpha=alpha, S0=alpha * sum(spec.plan) / max(spec.plan), eval_tokens=tokens, eval_cycles=cycles)


def _config(cfg: ModelConfig, plan, d: Any) -> PPSDConfig:
    if d.own_head:
        raise ValueError("own_head trains a PSM's own LM head; the PPSD head shares the target's (set own_head=false)")
    return PPSDConfig.for_target(cfg, plan.counts, d.ppsd_layers, d.draft_vocab)


TRAINING = Training(
    export_dir="ppsd", metric="S0", config=_config,
    loss=ppsd_loss, loss_options=lambda d: dict(hard_weight=d.hard_weight), axes=ppsd_axes, warm_start=_warm_start,
    # the PPSD method at the head's own n and plan (n stage devices: train.loop checks)
    eval_options=lambda spec, variables, d: dict(n=spec.n, stage_layers=spec.plan, drafter_spec=(spec, variables)),
    eval_summary=_eval_summary,
    describe=lambda name, spec, d: (f"PPSD early-exit head for {name}: n={spec.n}, stages {list(spec.plan)}, exit "
                                    f"after layer {spec.exit}, {spec.num_layers} head layer(s)"),
    exported=lambda final, spec, step, d: (f"PPSD head (step {step}) written to {final} (use: python -m "
                                           f"infer.generate --mode ppsd --n {spec.n} --drafter {final})"),
    init_options=lambda d: dict(layers_from_target=d.layers_from_target))


KIND = DrafterKind(
    name=KIND_NAME, label="PPSD", a_label="a PPSD", noun="PPSD head", identity_file="ppsd.json", config=PPSDConfig,
    error=PPSDCheckpointError, shipped_dir=SHIPPED_DIR, to_json=spec_to_json, from_json=spec_from_json,
    init=init_ppsd, check=lambda spec, cfg, where, plan=None, expect=None: check_spec(spec, cfg, plan, where),
    random_config=lambda cfg, plan, num_layers=None: PPSDConfig.for_target(cfg, plan.counts),  # the reference's 1 layer
    shipped=lambda model_name, plan: shipped_ppsd(model_name, plan.n), misfit=_misfit, cost=_cost,
    params=lambda cfg, spec: param_count(_init_boxed, cfg, spec, bool(spec.draft_vocab)),
    flag="--drafter", random_flag="--drafter random",
    train_fix="train a PPSD head for {model} (python -m train.main with method: ppsd, model: {model}) or use one "
              "trained for it",
    training=TRAINING, missing_hint="; train one with train.main (method: ppsd)", staged=True,
    teacher_drafts=drafts_by_fill, spd_drafter=PPSDDrafter,
    why_random="an untrained PPSD head was asked for (drafter_spec=\"random\"; infer.generate --drafter random, "
               "infer.evaluate --ppsd random)")


def save_ppsd(path: str | Path, variables: dict, spec: PPSDConfig, extra: dict | None = None,
              target_weights: str | None = None) -> None:
    """`store.save` of a PPSD head: variables (orbax) and ppsd.json (the spec, extra facts, target_weights)."""
    store.save(KIND, path, variables, spec, extra, target_weights)


def read_spec(path: str | Path) -> PPSDConfig:
    return store.read_spec(KIND, path)


def load_ppsd(path: str | Path, cfg: ModelConfig, stage_counts: Sequence[int], target_params: dict,
              dtype=jnp.float32, target_weights: str | None = None, model_name: str | None = None
              ) -> tuple[PPSDConfig, dict]:
    """`store.load` of a PPSD head for the stage plan stage_counts."""
    return store.load(KIND, path, cfg, target_params, dtype, plan=stage_counts, weights=target_weights,
                      model_name=model_name)
