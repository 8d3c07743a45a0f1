"""The EAGLE-3 drafter's training loss (the training-time test, `eagle3_loss`), its checkpoints (orbax +
`eagle3.json` naming the target, its architecture and a fingerprint of its weights, the feature layers and
the layer's sizes; a mismatch is refused), its cost and its registry entry (`KIND`, with what training asks
of it: `TRAINING`). A drafter trained for a default model ships under `spd_jax/eagle3s/<model>/`
(`shipped_eagle3`). The network is `model`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from spd_jax.config import ModelConfig, RopeConfig
from spd_jax.distributed import to_host
from spd_jax.drafters import store
from spd_jax.drafters.base import features, join_params, teacher_forward
from spd_jax.drafters.eagle3.model import (DraftLayer, Eagle3, Eagle3Config, _init_boxed, eagle3_axes, init_eagle3,
                                           layer_schema)
from spd_jax.drafters.kind import DrafterKind, Training
from spd_jax.drafters.objective import distill_kl
from spd_jax.drafters.shared import check_target, param_count
from spd_jax.models import decoder, schema
from spd_jax.models.costs import head_cost, kind_cost
from spd_jax.models.kinds import FULL_ATTENTION

FORMAT = 2  # eagle3.json layout version (1: before `layer`, read as the target's own attention layer)
KIND_NAME = "eagle3"
# Trained drafters shipped with the package, one directory per default model: "<model>/".
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "eagle3s"


def shipped_eagle3(model_name: str | None) -> Path | None:
    """The trained EAGLE-3 drafter shipped for a known default model, if there is one."""
    p = SHIPPED_DIR / str(model_name)
    return p if model_name and (p / "eagle3.json").is_file() else None


# ---------------------------------------------------------------- training


def eagle3_loss(trainable, frozen, target, batch, keys=None, *, cfg: ModelConfig, spec: Eagle3Config, tau: float = 1.0,
                steps: int = 3):
    """The training-time-test loss, with `drafters.psm.psm_loss`'s conventions -> (sum of the masked KL,
    metrics sums). batch: tokens [B, T] int32, mask [B, T] bool (position t predicts a response
    token); keys: unused (no simulated randomness), accepted so a training step calls either loss alike.
    Step i's row at index t predicts the token at t + i + 2, i.e. matches the teacher's logits at
    position t + i + 1, weighted by mask[t + i + 1]; KL(teacher || drafter) at temperature tau, times
    tau^2, summed over the steps, each step weighted alike. metrics: kl_sum; positions (the weights' sum
    over steps: the loss's normaliser); agree_sum and agree_positions, the first step's agreement (its
    argmax equals the unrestricted teacher's) and weight: what the chain's first draft gets right;
    agree_by_step and positions_by_step [steps], the same per unrolled step."""
    del keys
    tokens, mask = batch["tokens"], batch["mask"]
    cd = target["embed"].dtype  # the compute dtype: the caller casts the frozen target once
    variables = jax.tree.map(lambda p: p.astype(cd) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                             join_params(trainable, frozen))
    emb, hidden, x = teacher_forward(target, tokens, cfg)
    feats = jax.lax.stop_gradient(features(emb, hidden, spec.layers))
    teacher = jax.lax.stop_gradient(decoder.lm_logits(target, x, cfg))  # [B, T, V]
    student = Eagle3(cfg, spec).apply(variables, feats, jax.lax.stop_gradient(emb), steps,
                                      method=Eagle3.train_logits)  # [steps, B, T, V']
    ids = variables["vocab"]["ids"] if spec.draft_vocab else None
    kl_sum = jnp.float32(0.0)
    agree, weight = [], []
    for i in range(steps):
        shift = lambda a: jnp.pad(a, [(0, 0), (0, 1 + i)] + [(0, 0)] * (a.ndim - 2))[:, 1 + i:]  # noqa: E731  a[t+1+i]
        t_logits, w = shift(teacher), shift(mask).astype(jnp.float32)
        drafted = jnp.argmax(student[i], -1)
        t_v = t_logits if ids is None else t_logits[..., ids]  # restricted to the draft vocabulary, renormalised
        if ids is not None:
            drafted = ids[drafted]
        kl = distill_kl(student[i], t_v, tau)
        kl_sum += (kl * w).sum()
        agree.append(((jnp.argmax(t_logits, -1) == drafted) * w).sum())
        weight.append(w.sum())
    agree, weight = jnp.stack(agree), jnp.stack(weight)
    return kl_sum, dict(kl_sum=kl_sum, positions=weight.sum(), agree_sum=agree[0], agree_positions=weight[0],
                        agree_by_step=agree, positions_by_step=weight)


# ---------------------------------------------------------------- checkpoints


class Eagle3CheckpointError(ValueError):
    """An EAGLE-3 checkpoint that does not belong to this target model (architecture or weights)."""


def spec_to_json(spec: Eagle3Config) -> dict:
    return dict(format=FORMAT, kind=KIND_NAME, **dataclasses.asdict(spec))


def _layer_from_json(d: dict | None) -> DraftLayer | None:
    return None if d is None else DraftLayer(**{**d, "rope": RopeConfig(**d["rope"])})


def spec_from_json(d: dict, where: str = "") -> Eagle3Config:
    if d.get("kind") != KIND_NAME:
        raise Eagle3CheckpointError(f"checkpoint {where} is not an EAGLE-3 drafter (kind {d.get('kind')!r})")
    if d.get("format") not in (1, FORMAT):
        raise Eagle3CheckpointError(f"EAGLE-3 checkpoint {where} has format {d.get('format')!r}, this version reads "
                                    f"formats 1 and {FORMAT}")
    return Eagle3Config(tuple(d["layers"]), tuple(d["target"]), int(d.get("draft_vocab", 0)),
                        _layer_from_json(d.get("layer")) if d["format"] > 1 else None)


def check_spec(spec: Eagle3Config, cfg: ModelConfig, where: str = "", layers: Sequence[int] | None = None) -> None:
    """Refuse a drafter made for another target model (or, when given, other feature layers)."""
    check_target(spec.target, cfg, Eagle3CheckpointError, "EAGLE-3", where)
    if max(spec.layers) > cfg.num_layers:
        raise Eagle3CheckpointError(f"EAGLE-3 checkpoint {where} reads hidden state {max(spec.layers)}; the model "
                                    f"has {cfg.num_layers} layers")
    if layers is not None and tuple(layers) != spec.layers:
        raise Eagle3CheckpointError(f"EAGLE-3 checkpoint {where} reads feature layers {list(spec.layers)}, not "
                                    f"{list(layers)}")


def _cost(cfg: ModelConfig, spec: Eagle3Config, context: int, param_bytes: int = 2, cache_bytes: int | None = None,
          rows: int | None = None) -> list:
    """One draft step -> [layer, head]: the drafter's decoder layer on `rows` rows (default 1; an attention
    layer of its layer config, q/k/v (and a gate) reading [2H]), then its head on one row (V' rows)."""
    H, r, lcfg = cfg.hidden_size, 1 if rows is None else rows, spec.layer_config(cfg)
    wide = layer_schema(lcfg)
    extra = schema.param_count(wide) - FULL_ATTENTION.params(lcfg)
    extra_mm = sum(H * wide[key].shape[1] for key in ("wq", "wk", "wv", "wq_gate") if key in wide)
    c = kind_cost(lcfg, FULL_ATTENTION.name, context, param_bytes, param_bytes if cache_bytes is None else cache_bytes, r)
    layer = dataclasses.replace(c, kind="eagle3_layer", params=c.params + extra, flops=c.flops + 2 * extra_mm * r,
                                weight_bytes=c.weight_bytes + extra * param_bytes)
    return [layer, head_cost(cfg, param_bytes, spec.draft_vocab or cfg.vocab_size)]


def _eval_options(spec: Eagle3Config, variables: dict, d: Any) -> dict:
    """Chain decoding at k = eval_k with these weights, on this process's default device (the training state
    is replicated over the training mesh)."""
    local = jax.tree.map(lambda a: jnp.asarray(to_host(a)), variables)
    return dict(k=d.eval_k, drafter_spec=(spec, local))


TRAINING = Training(
    export_dir="drafter", metric="tokens_per_round",  # tokens per target pass: the chain's S0
    config=lambda cfg, plan, d: Eagle3Config.for_target(cfg, d.feature_layers, d.draft_vocab),
    loss=eagle3_loss, loss_options=lambda d: dict(steps=d.ttt_steps), axes=eagle3_axes,
    # the loader refuses another target or other feature layers: the only shapes a run's settings change
    # besides the draft vocabulary, whose head is the target's (not loaded)
    warm_start=lambda model, spec, init_from, log: load_eagle3(
        init_from, model.config, model.params, jnp.float32, spec.layers, target_weights=model.weights_fingerprint,
        model_name=str(model.path))[1],
    eval_options=_eval_options,
    eval_summary=lambda spec, tokens, rounds, d: dict(
        tokens_per_round=tokens / rounds if rounds else float("nan"), eval_tokens=tokens, eval_rounds=rounds,
        eval_k=d.eval_k),
    describe=lambda name, spec, d: (f"EAGLE-3 drafter for {name}: feature layers {list(spec.layers)}, {d.ttt_steps} "
                                    f"training-time-test steps, quick eval at k={d.eval_k}"),
    exported=lambda final, spec, step, d: (f"EAGLE-3 drafter (step {step}) written to {final} (use: python -m "
                                           f"infer.generate --mode eagle3 --k {d.eval_k} --drafter {final})"),
    trained=lambda d: dict(ttt_steps=d.ttt_steps))


KIND = DrafterKind(
    name=KIND_NAME, label="EAGLE-3", a_label="an EAGLE-3", noun="EAGLE-3 drafter", identity_file="eagle3.json",
    config=Eagle3Config, error=Eagle3CheckpointError, shipped_dir=SHIPPED_DIR, to_json=spec_to_json,
    from_json=spec_from_json, init=init_eagle3,
    check=lambda spec, cfg, where, plan=None, expect=None: check_spec(spec, cfg, where, expect),
    random_config=lambda cfg, plan=None, num_layers=None: Eagle3Config.for_target(cfg),
    shipped=lambda model_name, plan=None: shipped_eagle3(model_name), misfit=lambda spec, plan: None, cost=_cost,
    params=lambda cfg, spec: param_count(_init_boxed, cfg, spec, bool(spec.draft_vocab)),
    flag="--drafter", train_fix="train an EAGLE-3 drafter for {model} (python -m train.main with method: eagle3, model: {model}) "
              "or use one trained for it", training=TRAINING,
    why_random="an untrained EAGLE-3 drafter was asked for (drafter_spec=\"random\", --drafter random)",
    missing_hint="; a standard EAGLE-3 checkpoint (SpecForge / SGLang: config.json and safetensors) is converted to "
                 "one first: python -m spd_jax.convert.eagle3 DIR OUT --model MODEL")


def save_eagle3(path: str | Path, variables: dict, spec: Eagle3Config, extra: dict | None = None,
                target_weights: str | None = None) -> None:
    """`store.save` of an EAGLE-3 drafter: variables (orbax) and eagle3.json (the spec, extra facts, the
    target's weights fingerprint)."""
    store.save(KIND, path, variables, spec, extra, target_weights)


def read_spec(path: str | Path) -> Eagle3Config:
    return store.read_spec(KIND, path)


def load_eagle3(path: str | Path, cfg: ModelConfig, target_params: dict, dtype=jnp.float32,
                layers: Sequence[int] | None = None, target_weights: str | None = None,
                model_name: str | None = None) -> tuple[Eagle3Config, dict]:
    """`store.load` of an EAGLE-3 drafter (refusing, when given, other feature layers)."""
    return store.load(KIND, path, cfg, target_params, dtype, expect=layers, weights=target_weights,
                      model_name=model_name)
