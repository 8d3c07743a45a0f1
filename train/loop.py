"""A training run from a command line's arguments: set up (config, devices, model, data, state, run.json),
then the steps, the checkpoints, the quick eval and the export.

`setup` does everything before the first step and raises one of `config.SETUP_ERRORS` for what the user
can fix (nothing is recorded until it holds); `fit` trains from the set-up state to the config's steps;
`export_run` writes a checkpoint's drafter. The pieces are train/config.py (the config), corpus.py and
data.py (the data), step.py (the jitted update), checkpoints.py (orbax, resume identity, warm start,
export) and quick_eval.py. This module must not be imported before `setup` has requested the devices
only in the sense that it starts no backend itself: importing JAX does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import spd_jax
from spd_jax import distributed
from spd_jax.drafters.base import join_params
from spd_jax.progress import progress_bar
from spd_jax.reports.plots import plot_curves
from spd_jax.reports.results import read_rows
from spd_jax.sharding import data_model_mesh, parse_mesh, put, request_cpu_devices
from train import checkpoints, corpus, data, quick_eval, step
from train.checkpoints import Checkpoints, Spec
from train.config import TrainConfig, load, read_yaml
from train.features import TeacherCache

log = logging.getLogger("train")


@dataclasses.dataclass
class Run:
    """A set-up run: what it trains and from where, on which devices, with which data and state."""
    tc: TrainConfig
    config: dict  # the resolved config run.json and the export record (a run's own, for --export)
    recipe: dict | None  # the recipe file and overrides it was resolved from (None: --export of a recorded run)
    out: Path
    mesh_arg: str  # --mesh of the command that trained it
    leader: bool  # process 0, or the only one: it reports and writes the run's files
    mesh: jax.sharding.Mesh
    model: spd_jax.Model
    spec: Spec
    ckpts: Checkpoints
    warm_start: dict | None  # what init_from held (`checkpoints.warm_start_record`, with its digest)
    state: dict
    frozen: dict
    opt: object
    heldout: list | None = None
    batches: corpus.Batches | None = None
    start: int = 0  # the restored step, positions and wall time (0 for a new run)
    positions: int = 0
    wall0: float = 0.0


def resolve(args) -> tuple[TrainConfig, dict, dict | None, Path, dict]:
    """-> (config, resolved config, recipe record, run directory, recorded run.json ({} for a new run)).
    --export uses the run's recorded config, not this command's."""
    out = Path(args.out or Path("runs") / Path(args.config).stem).absolute()
    if not args.export:
        tc, resolved = load(args.config, args.overrides, args.steps)
        steps = [f"steps={args.steps}"] if args.steps is not None else []  # --steps is one more override
        return tc, resolved, dict(file=args.config, overrides=[*args.overrides, *steps]), out, {}
    if not (out / "run.json").is_file():
        raise FileNotFoundError(f"--export: {out / 'run.json'} not found (no training run in {out})")
    read_yaml(Path(args.config))  # the command line still names a config that reads
    recorded = checkpoints.read_run(out)
    if args.overrides or args.steps is not None:
        log.warning("--export uses the run's recorded config: ignoring %s", " ".join(
            args.overrides + ([f"--steps {args.steps}"] if args.steps is not None else [])))
    return TrainConfig.from_dict(recorded["config"]), recorded["config"], None, out, recorded


def devices(args, tc: TrainConfig) -> tuple[int, int, bool]:
    """Request this command's devices (host devices on a CPU, or join a multi-process job) -> (data,
    model, leader)."""
    n_data, n_model = parse_mesh(args.mesh)
    if tc.data.batch_size % n_data:
        raise ValueError(f"batch_size {tc.data.batch_size} does not split over {n_data} data-parallel devices (--mesh "
                         f"{args.mesh}): pick a batch_size that {n_data} divides, or another --mesh")
    cluster = distributed.cluster_from(args)
    if cluster is None:
        # A PSM's quick eval runs the SPD engine: n stage devices besides the training mesh's (an EAGLE-3
        # drafter's runs the chain on one device).
        d = tc.drafter
        eval_devices = (len(d.stages) if d.stages else d.n) if d.kind.staged else 1
        request_cpu_devices(max(n_data * n_model, eval_devices))
    else:  # the training mesh spans every process's devices (the quick eval runs when n of them exist)
        try:
            distributed.initialize(cluster, distributed.local_device_count(cluster, n_data * n_model))
        except RuntimeError as e:  # no coordinator answers: the job's addresses are wrong, not the code
            raise ValueError(str(e)) from None
        if jax.device_count() != n_data * n_model:
            raise ValueError(f"--mesh {args.mesh} needs {n_data * n_model} devices; the job has {jax.device_count()} "
                             f"({jax.process_count()} process(es)); on a CPU host --processes P gives each process "
                             "devices / P of them")
    leader = cluster is None or distributed.is_leader()
    if not leader:  # every process trains; process 0 alone reports and writes the run's files
        logging.getLogger().setLevel(logging.WARNING)
    return n_data, n_model, leader


def restore_step(args, tc: TrainConfig, ckpts: Checkpoints, out: Path) -> int | None:
    """The checkpoint this command continues from or exports (None: a new run); refuses a new run over an
    old one, a resume past --steps, a resume or export with no checkpoint."""
    if args.resume and args.export:
        raise ValueError("--resume continues training, --export writes a checkpoint's drafter: pass one")
    latest = ckpts.latest()
    if latest is not None and not (args.resume or args.export):
        raise ValueError(f"{out} already holds a run (step {latest}); pass --resume to continue it "
                         "or --out for a new one")
    if args.export:
        return checkpoints.export_step(args.export, ckpts, out)
    if not args.resume:
        return None
    if latest is not None and latest > tc.optimiser.steps:
        raise ValueError(f"--resume: the last checkpoint (step {latest}) is past --steps {tc.optimiser.steps}; to "
                         f"write an earlier step's drafter use --export STEP (kept: {ckpts.all_steps()})")
    if latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'ckpt'}")
    return latest


def check_continues(args, recorded: dict, identity: dict, tc: TrainConfig, out: Path) -> dict:
    """A resume or export must be of this run: its run.json's identity (and, to resume, its data keys)
    -> the recorded run.json."""
    if args.resume:
        if not (out / "run.json").is_file():
            raise FileNotFoundError(f"--resume: {out / 'run.json'} not found beside the checkpoints (it holds "
                                    "the run's identity and data order): train a new run with another --out")
        recorded = checkpoints.read_run(out)
    try:
        checkpoints.check_resume(recorded["identity"], identity)
        if args.resume:
            checkpoints.check_same_data(recorded["config"], tc)
            if recorded.get("data_order", 1) != corpus.ORDER:  # recorded since order 2; before it, 1
                raise ValueError(f"its batches were formed in data order {recorded.get('data_order', 1)}, this "
                                 f"version forms them in order {corpus.ORDER} (train.corpus.ORDER): a resume would "
                                 "see other data; train a new run with --out")
    except ValueError as e:
        raise ValueError(f"--{'resume' if args.resume else 'export'}: {out}: {e}") from None
    return recorded


def draft_vocabulary(args, run: Run, train_set: list | None) -> np.ndarray | None:
    """The draft vocabulary's token ids (None without one): kept beside the checkpoints (draft_vocab.npy),
    so a resume or an export reuses it instead of recomputing it from a corpus that may differ (another
    machine's regenerated responses, another data file)."""
    spec, model = run.spec, run.model
    if not spec.draft_vocab:
        return None
    vocab_file = run.out / "draft_vocab.npy"
    stored = (np.load(vocab_file, allow_pickle=False) if (args.resume or args.export) and vocab_file.is_file()
              else None)
    if stored is not None and stored.shape != (spec.draft_vocab,):
        raise ValueError(f"{vocab_file} holds {stored.shape[0]} token ids, the run's draft_vocab is "
                         f"{spec.draft_vocab}: the file is not this run's (restore it, or delete it to recompute)")
    ids = stored if stored is not None else corpus.draft_vocab_ids(train_set, spec.draft_vocab,
                                                                   model.config.vocab_size, model.eos_token_ids)
    if train_set is not None:
        hits = sum(int(np.isin(t[1:][m[:-1]], ids).sum()) for t, m in train_set)
        log.info("draft vocabulary: %d of %d tokens, covering %.2f%% of the training response tokens",
                 spec.draft_vocab, model.config.vocab_size,
                 100 * hits / max(1, sum(int(m.sum()) for _, m in train_set)))
    if stored is None and args.export:  # a run from before the file: trained with this corpus's, if unchanged
        log.warning("%s not found: the draft vocabulary is recomputed from today's corpus", vocab_file)
    elif run.leader and stored is None:
        data.write_atomic(vocab_file, lambda f: np.save(f, ids))  # other processes may read it on a resume
    return ids


def setup(args, argv: list[str]) -> Run:
    """Everything before the first step: the config, the devices, the model, the data, the drafter's
    initial or restored state, run.json. Raises one of SETUP_ERRORS for what the user can fix."""
    tc, config, recipe, out, recorded = resolve(args)
    n_data, n_model, leader = devices(args, tc)
    if tc.data.teacher_cache and not args.export and jax.process_count() > 1:
        raise ValueError(f"teacher_cache is written by one process; this job has {jax.process_count()} "
                         "(set teacher_cache=false, or train on one process)")
    mesh = data_model_mesh(n_data, n_model)
    model = spd_jax.load_model(tc.model.name)
    if jax.default_backend() == "cpu" and n_data > 1 and n_model > 1 and model.config.num_linear_layers:
        # XLA:CPU's collectives stall on this program (step.make_step's known limit): refuse, not hang
        raise ValueError(f"--mesh {args.mesh}: a target with Gated DeltaNet layers ({model.path.name}) stalls in "
                         "XLA:CPU's collectives on a mesh with both axes above 1; on CPU use --mesh "
                         f"{n_data * n_model}x1 or 1x{n_model}")
    spec = step.drafter_spec(model, tc)
    identity = json.loads(json.dumps(checkpoints.run_identity(model, spec, tc)))  # as run.json holds it
    ckpts = Checkpoints(out / "ckpt", tc)
    at = restore_step(args, tc, ckpts, out)
    if at is not None:
        recorded = check_continues(args, recorded, identity, tc, out)
    restoring = at is not None
    # what init_from held at the run's start, kept with the run and its exports (the directory may change):
    # a new run reads its weights (checked against init_digest); a restored one keeps its record, or, recorded
    # before the record existed, gets the directory's facts today, or only its path when it is gone (its
    # weights are the checkpoint's, not init_from's)
    warm, warm_start = None, recorded.get("warm_start")
    if tc.drafter.init_from and not restoring:
        warm, warm_start = checkpoints.warm_start(model, spec, tc)
    elif tc.drafter.init_from and warm_start is None:
        gone = not Path(tc.drafter.init_from).is_dir()
        warm_start = (dict(path=str(tc.drafter.init_from)) if gone
                      else checkpoints.warm_start_record(tc.drafter.init_from))
    if leader:
        out.mkdir(parents=True, exist_ok=True)
    _describe(tc, spec, model, n_data, n_model)
    run = Run(tc=tc, config=config, recipe=recipe, out=out, mesh_arg=recorded.get("mesh", "?") if args.export
              else args.mesh, leader=leader, mesh=mesh, model=model, spec=spec, ckpts=ckpts, warm_start=warm_start,
              state={}, frozen={}, opt=step.make_optimizer(tc))
    train_set = None
    if not args.export or (spec.draft_vocab and not (out / "draft_vocab.npy").is_file()):
        train_set, run.heldout = corpus.split_heldout(corpus.encode_corpus(model, tc, data.corpus_dir()), tc)
    if not args.export:
        run.batches = corpus.Batches(train_set, tc)
        log.info("%d training conversations (%d response positions), %d batches per epoch; %d held out",
                 len(train_set), sum(int(m.sum()) for _, m in train_set), len(run.batches), len(run.heldout))
    vocab_ids = draft_vocabulary(args, run, train_set)
    # a restored state replaces init_from's weights: the directory is not read (it may since have moved,
    # or hold another drafter); the frozen head is the target's either way
    run.state, run.frozen = step.init_state(model, spec, tc.replace(init_from=None, init_digest=None) if restoring
                                            else tc, run.opt, vocab_ids, warm)
    if restoring:
        run.state, meta = ckpts.restore(at, jax.eval_shape(lambda: run.state))
        run.start, run.positions, run.wall0 = int(run.state["step"]), int(meta["positions"]), float(meta["wall_s"])
        log.info("%s step %d (%d positions seen)", "exporting" if args.export else "resumed at", run.start,
                 run.positions)
    if leader:  # once the set-up has held: a command refused or failed above leaves run.json as it was
        _record(args, argv, run, recorded, identity)
    return run


def _describe(tc: TrainConfig, spec: Spec, model, n_data: int, n_model: int) -> None:
    log.info("%s; mesh %dx%d on %s", tc.drafter.kind.training.describe(model.path.name, spec, tc.drafter), n_data,
             n_model, jax.default_backend())


def _record(args, argv: list[str], run: Run, recorded: dict, identity: dict) -> None:
    """Append this command to run.json (written whole): an export to `exports`; a training command to
    `commands`, with the identity, the resolved config (init_digest: the weights the run started from),
    the recipe and overrides it came from, the mesh and the warm start."""
    rec = dict(recorded)
    cmd = " ".join(["python -m train.main", *argv])
    if args.export:  # an export trains nothing: the run's config and its training commands stay as they are
        rec["exports"] = rec.get("exports", []) + [cmd]
    else:
        config = dict(run.config)
        if run.warm_start and run.warm_start.get("digest") and config.get("init_digest") is None:
            config["init_digest"] = run.warm_start["digest"]
        run.config = config
        rec.update(identity=identity, config=config, recipe=run.recipe, mesh=args.mesh,
                   processes=jax.process_count(), data_order=corpus.ORDER)
        rec["commands"] = rec.get("commands", []) + [cmd]
        if run.warm_start:
            rec["warm_start"] = run.warm_start
    # replaced whole: a kill mid-write leaves the old record
    data.write_atomic(run.out / "run.json", lambda f: f.write(json.dumps(rec, indent=1).encode()))


def export_to(run: Run) -> Path:
    """Where --export writes: OUT/psm (or drafter) for the last checkpoint, OUT/psm-step<STEP> for another."""
    name = checkpoints.export_name(run.spec)
    return run.out / (name if run.start == run.ckpts.latest() else f"{name}-step{run.start}")


def export_run(run: Run, final: Path, steps: int, wall_s: float, state: dict | None = None) -> None:
    """Write the drafter of `state` (default: the set-up one) with the run's provenance."""
    checkpoints.export(final, join_params((state or run.state)["params"], run.frozen), run.spec, run.tc, run.config,
                       run.mesh_arg, steps, run.positions, wall_s, run.model.weights_fingerprint, run.warm_start,
                       run.recipe)


def fit(run: Run) -> None:
    """The training loop from run's state to the config's steps, then the drafter's export and the curves."""
    tc, spec, model, mesh, out = run.tc, run.spec, run.model, run.mesh, run.out
    state, frozen = run.state, run.frozen
    step_fn = step.make_step(model.config, spec, tc, run.opt, mesh)
    # placed once: each device keeps only its `model` shard of the frozen target; the drafter replicated
    target = put(step.compute_target(model, tc), step.target_shardings(model.config, mesh))
    rep = NamedSharding(mesh, PartitionSpec())
    state, frozen = put(state, rep), put(frozen, rep)
    metrics_path = out / "metrics.jsonl"
    if run.leader:
        _truncate_metrics(metrics_path, run.start)

    prompts = quick_eval.eval_prompts(run.heldout, tc)
    key = quick_eval.eval_metric(spec)  # the quick eval's headline: S0, or tokens_per_round
    if tc.drafter.kind.staged and jax.device_count() < spec.n:
        log.info("quick eval off: it runs the SPD engine on n=%d stage devices, the job has %d", spec.n,
                 jax.device_count())
        prompts = []
    teacher = features = None
    if tc.data.teacher_cache:
        features = TeacherCache(data.corpus_dir(), run.batches.corpus, str(model.path), spec.anchors,
                                model.config.hidden_size, step.compute_dtype(tc), model.config.num_layers)
        teacher = step.make_teacher(model.config, spec, mesh)
        log.info("teacher cache %s: %.0f%% of the training sequences stored", features.path,
                 100 * features.coverage())
    steps, accum, positions = tc.optimiser.steps, tc.data.grad_accum, run.positions
    t_start = time.perf_counter()
    bar = progress_bar(range(run.start, steps), initial=run.start, total=steps, desc="train", unit="step",
                       disable=not run.leader)

    def micro_batch(i: int) -> dict:
        """Micro-step i's batch on the devices, with its teacher features when the cache is on."""
        batch = run.batches.get(i)
        if features is not None:
            tokens, query = put((batch["tokens"], batch["query"]), step.batch_sharding(mesh))
            batch = dict(batch, tokens=tokens, query=query,  # a miss: the features kept on the devices
                         **features.get(run.batches.indices(i), batch, lambda: teacher(target, tokens, query)))
        return put(batch, step.batch_sharding(mesh))

    for i in bar:
        micro = [micro_batch(i * accum + m) for m in range(accum)]
        state, met = step_fn(state, frozen, target, micro)
        met = {k: float(v) if np.ndim(v) == 0 else [round(float(x), 5) for x in v] for k, v in met.items()}
        positions += int(met["positions"])
        wall = run.wall0 + time.perf_counter() - t_start
        done = i + 1
        row = dict(step=done, positions=positions, wall_s=round(wall, 2),
                   **{k: met[k] for k in ("loss", "agreement", "agreement_by_step", "grad_norm") if k in met})
        if done % tc.run.eval_every == 0 or done == steps:
            row |= quick_eval.quick_eval(model, spec, join_params(state["params"], frozen), prompts, tc)
        if run.leader and (done % tc.run.log_every == 0 or key in row or done == steps):
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        bar.set_postfix(refresh=False, loss=f"{met['loss']:.3f}", agree=f"{met['agreement']:.3f}",
                        pos_s=f"{positions / max(wall, 1e-9):.0f}", **({key: f"{row[key]:.2f}"} if key in row else {}))
        if done % tc.run.save_every == 0 or done == steps:
            run.ckpts.save(done, state, dict(positions=positions, wall_s=wall))

    run.positions = positions
    export_run(run, out / checkpoints.export_name(spec), steps, run.wall0 + time.perf_counter() - t_start, state)
    if run.leader:
        plot_curves(read_rows(metrics_path), out / "curves.png")


def _truncate_metrics(path: Path, at: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop their old rows."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= at]
    path.write_text("".join(r + "\n" for r in rows))
