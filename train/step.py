"""The training step: the drafter a config trains, its loss, the optimiser, the jitted update and the
initial state.

Two methods share everything here but the loss and the drafter's variables, which the drafter kind's
`Training` record gives (`TrainConfig.drafter.method` names the kind): "psm", the Pipeline Speculation
Module, and "eagle3", the EAGLE-3-style chain drafter (`spd_jax.drafters.eagle3`), so both see the same
batches, optimiser and positions.

The target is frozen and teacher-forced: one forward gives every anchor state and the teacher logits;
the PSM's drafts come from `PSM.train_hidden`, the exact training counterpart of the engine's
per-cycle draft (tests/test_psm_train.py), computed only at the positions in the loss and for the
in-flight slots their simulated fill has (`psm.deal_fills`). Loss (`psm.psm_loss`): KL(teacher || PSM) at
temperature tau, times tau^2, averaged over positions whose next token is a response token; top-1 agreement
is logged.
The EAGLE-3 drafter's loss is `eagle3.eagle3_loss` (the same KL over `ttt_steps` unrolled draft steps, its
training-time test); its logged agreement is the first step's.

Batches are [B, T] sharded over the mesh's `data` axis; the frozen target is split over `model`, the
drafter replicated. Randomness (the simulated pipeline fill) is keyed by (seed, step), so a resumed run
and an uninterrupted one take identical steps, and the same global batch gives the same loss on any
mesh. This module reads no file but a warm start's (through `train.checkpoints`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spd_jax.decode import pipelined
from spd_jax.drafters import registry
from spd_jax.drafters.base import split_params
from spd_jax.drafters.psm import teacher_states
from spd_jax.models import decoder, schema
from spd_jax.sharding import TRAIN_RULES, logical_spec, tree_shardings
from train import checkpoints
from train.checkpoints import Spec
from train.config import COMPUTE_DTYPES, TrainConfig

def drafter_spec(model, tc: TrainConfig) -> Spec:
    """The drafter a run trains: its kind's config from tc.drafter (`Training.config`); a PSM's for the stage
    plan `infer.generate` makes at n (or tc.drafter.stages) with tc's layers and anchors, an EAGLE-3
    drafter's with its feature layers and draft vocabulary."""
    d = tc.drafter
    plan = pipelined.plan_for(model, d.n, d.stages) if d.kind.staged else None  # staged: trained for one plan
    return d.kind.training.config(model.config, plan, d)


def compute_target(model, tc: TrainConfig) -> dict:
    """The frozen target's weights in the compute dtype (the losses compute in their dtype)."""
    return jax.tree.map(lambda t: t.astype(compute_dtype(tc)), model.params)


def compute_dtype(tc: TrainConfig) -> str:
    """tc.model.compute_dtype on this backend: "auto" is bfloat16 on TPU and GPU, float32 on CPU."""
    if tc.model.compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {tc.model.compute_dtype!r}")
    if tc.model.compute_dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return tc.model.compute_dtype


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and linear decay to zero over tc.optimiser.steps updates, global-norm clipping
    (the reference's values by default). Gradient accumulation is the step's (`make_step`)."""
    o = tc.optimiser
    sched = optax.join_schedules([optax.linear_schedule(0.0, o.lr, max(o.warmup, 1)),
                                  optax.linear_schedule(o.lr, 0.0, max(o.steps - o.warmup, 1))], [o.warmup])
    opt = optax.chain(optax.clip_by_global_norm(o.clip), optax.adamw(sched, weight_decay=o.weight_decay))
    return opt


def loss_fn(cfg, spec: Spec, tc: TrainConfig):
    """The method's loss with its settings bound: (trainable, frozen, target, batch, keys) -> (loss sum,
    metric sums): the kind's (`Training.loss`: `psm.psm_loss`, or `eagle3.eagle3_loss` unrolling
    tc.drafter.ttt_steps draft steps) at tc.drafter.tau, with its options from tc.drafter."""
    t = registry.of_config(spec).training
    return functools.partial(t.loss, cfg=cfg, spec=spec, tau=tc.drafter.tau, **t.loss_options(tc.drafter))


def frozen_axes(cfg, spec: Spec) -> dict:
    """The logical axes of the frozen variables `split_params` leaves (the shared head, vocabulary ids)."""
    training = registry.of_config(spec).training
    return split_params(training.axes(cfg, spec), training.trains_head(spec))[1]


def make_step(cfg, spec: Spec, tc: TrainConfig, opt, mesh, loss=None):
    """-> step(state, frozen, target, batch) -> (state, metrics): one optimiser update; state = {params,
    opt, step} with step counting updates. batch: a batch dict, or a sequence of tc.data.grad_accum of them
    (one update's micro-batches, in order).

    loss(trainable, frozen, target, batch, keys) -> (loss sum over the batch, sums) is the method's
    (default `loss_fn(cfg, spec, tc)`); sums: kl_sum, positions (the normaliser: the gradient and the
    logged loss are per position), agree_sum with agree_positions (its denominator; default positions),
    optionally agree_by_step / positions_by_step (per unrolled draft step) and agree_by_fill /
    positions_by_fill (per simulated fill: `train.heldout` reports them, the step does not). Logged `positions` are the
    update's response positions (its masks), whatever the method, so runs compare at equal data.

    One program over the `data x model` mesh, partitioned by XLA (GSPMD) from the shardings of its
    inputs under `TRAIN_RULES`: the batch is split over `data`; the frozen target is split over `model`
    as tensor-parallel decoding splits it (heads, MLP columns, vocabulary), so a device holds 1/M of
    it; the PSM's trained weights and optimizer state are replicated (a few layers: small next to the
    target). The loss is the mean over the update's response positions, so the gradient all-reduce over
    `data` and the matmul all-reduces over `model` are XLA's, and every device applies the same update.
    With grad_accum > 1 the micro-batches' gradient and metric sums are added up (two compiled programs
    per bucket pair, the first micro-batch's and the others', the accumulator donated) before one
    division and one update: the update a batch of grad_accum x batch_size sequences would take, with
    the same random fills per sequence where the micro-batches pad to that batch's bucket (`deal_fills`
    deals a sequence's fills over its query slots, whose count follows the bucket).

    Known limit: on XLA:CPU host devices, a Qwen3.5 (Gated DeltaNet) target on a mesh with both axes
    above 1 (e.g. 4x2) stalls in XLA:CPU's collectives (re-checked with this GSPMD step; the same
    program on 8x1 and 1x1, and Llama on 4x2, run); tests/test_train_loop.py keeps that case out.
    The PSM's frozen head follows the same rules (a full-vocabulary head split over `model` like the
    target's; a draft vocabulary's rows replicated)."""
    grad_fn = jax.value_and_grad(loss or loss_fn(cfg, spec, tc), has_aux=True)

    def micro_sums(params, frozen, target, batch, step, micro):
        """-> (gradient sums, metric sums) of one micro-batch of the update `step`."""
        B = batch["tokens"].shape[0]
        base = jax.random.fold_in(jax.random.key(tc.run.seed), step)
        # one key per sequence of the update's batch (micro-batches in order): the loss does not depend
        # on how the batch is split, over devices or into micro-batches
        keys = jax.vmap(lambda i: jax.random.fold_in(base, micro * B + i))(jnp.arange(B))
        (_, sums), grads = grad_fn(params, frozen, target, batch, keys)
        return grads, dict(sums, mask_positions=jnp.sum(batch["mask"], dtype=jnp.float32))

    def update(state, grads, sums):
        count = jnp.maximum(sums["positions"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        agree_count = jnp.maximum(sums.get("agree_positions", sums["positions"]), 1.0)
        metrics = dict(loss=sums["kl_sum"] / count, agreement=sums["agree_sum"] / agree_count,
                       positions=sums["mask_positions"], grad_norm=optax.tree.norm(grads))
        if "agree_by_step" in sums:
            metrics["agreement_by_step"] = sums["agree_by_step"] / jnp.maximum(sums["positions_by_step"], 1.0)
        return dict(params=params, opt=opt_state, step=state["step"] + 1), metrics

    rep = NamedSharding(mesh, P())
    frozen_s = tree_shardings(frozen_axes(cfg, spec), mesh, TRAIN_RULES, schema.axis_units(cfg))
    target_s, batch_s = target_shardings(cfg, mesh), batch_sharding(mesh)

    def _batches(batch) -> list:
        micro = [batch] if isinstance(batch, dict) else list(batch)
        if len(micro) != tc.data.grad_accum:
            raise ValueError(f"an update takes grad_accum={tc.data.grad_accum} micro-batches, got {len(micro)}")
        return micro

    if tc.data.grad_accum == 1:  # one program: gradient, update and metrics fused, the state donated
        fused = jax.jit(lambda state, frozen, target, batch: update(
            state, *micro_sums(state["params"], frozen, target, batch, state["step"], 0)),
            in_shardings=(rep, frozen_s, target_s, batch_s), out_shardings=(rep, rep), donate_argnums=(0,))
        return lambda state, frozen, target, batch: fused(state, frozen, target, *_batches(batch))

    def add(acc, params, frozen, target, batch, step, micro):
        sums = micro_sums(params, frozen, target, batch, step, micro)
        return sums if acc is None else jax.tree.map(jnp.add, acc, sums)  # None: the first micro-batch

    accumulate = jax.jit(add, in_shardings=(rep, rep, frozen_s, target_s, batch_s, rep, rep), out_shardings=rep,
                         donate_argnums=(0,))
    apply = jax.jit(lambda state, acc: update(state, *acc), in_shardings=(rep, rep), out_shardings=(rep, rep),
                    donate_argnums=(0,))

    def step(state, frozen, target, batch):
        acc = None
        for micro, b in enumerate(_batches(batch)):
            acc = accumulate(acc, state["params"], frozen, target, b, state["step"], jnp.int32(micro))
        return apply(state, acc)

    return step


def teacher_features(cfg, anchors, target, tokens, query):
    """(target, tokens [B, T], query [B, Q]) -> (anchor states [B, T, m, H] at anchors, last hidden [B, T, H],
    the teacher's greedy token at the query positions [B, Q] int32): the teacher forward `psm.psm_loss` runs."""
    h, x = teacher_states(target, tokens, cfg, anchors)
    x_q = jnp.take_along_axis(x, query[..., None], axis=1)
    return h, x, jnp.argmax(decoder.lm_logits(target, x_q, cfg), -1).astype(jnp.int32)


def make_teacher(cfg, spec: Spec, mesh):
    """-> jitted `teacher_features` at the drafter's anchors (a staged kind's), alone, for the teacher cache
    (`train.features`); sharded like the step's inputs."""
    bs = batch_sharding(mesh)
    return jax.jit(functools.partial(teacher_features, cfg, spec.anchors),
                   in_shardings=(target_shardings(cfg, mesh), bs, bs), out_shardings=bs)


def target_shardings(cfg, mesh) -> dict:
    """The frozen target's leaf shardings on the training mesh (`model`-split under TRAIN_RULES)."""
    return tree_shardings(schema.param_axes(cfg), mesh, TRAIN_RULES, schema.axis_units(cfg))


def batch_sharding(mesh) -> NamedSharding:
    """Batches [B, T]: the "batch" logical axis split over `data`."""
    return NamedSharding(mesh, logical_spec(("batch",), TRAIN_RULES))


def init_state(model, spec: Spec, tc: TrainConfig, opt, vocab_ids=None, warm: dict | None = None) -> tuple[dict, dict]:
    """-> (state {params, opt, step}, frozen variables) of a new run: the drafter's initial weights, with
    tc.drafter.init_from's in their place (`checkpoints.warm_start`; `warm`: those params, already read),
    their optimiser state, step 0. The head is the target's at this run's vocabulary: frozen, or the drafter's
    own from there (`Training.trains_head`)."""
    kind = registry.of_config(spec)
    variables = kind.init(model.config, spec, model.params, seed=tc.run.seed, vocab_ids=vocab_ids,
                          **kind.training.init_options(tc.drafter))
    if warm is None and tc.drafter.init_from:
        warm, _ = checkpoints.warm_start(model, spec, tc)
    if warm is not None:
        variables["params"].update(warm)
    if kind.training.trains_head(spec) and "lm_head" not in (warm or {}):
        # a copy: training donates the drafter's buffers, and the head is the target's own array (its
        # embedding, where tied), which the step also reads
        variables["params"]["lm_head"] = jnp.array(variables["params"]["lm_head"], copy=True)
    trainable, frozen = split_params(variables, kind.training.trains_head(spec))
    # the frozen variables (the target's head) in the compute dtype, as the loss reads them: in float32 beside a
    # bf16 target the head would be a second copy at twice its size, converted again every step (3.8 GB at 4B)
    cd = compute_dtype(tc)
    frozen = jax.tree.map(lambda p: p.astype(cd) if jnp.issubdtype(p.dtype, jnp.floating) else p, frozen)
    return dict(params=trainable, opt=opt.init(trainable), step=jnp.int32(0)), frozen
