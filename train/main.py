"""Train a Pipeline Speculation Module for a frozen target.

    python -m train.main --config configs/train/smollm2-n8.yaml [--mesh 8x1] [--steps N] [--out DIR]
                         [--resume] [key=value ...]

--mesh DxM: D-way data parallel x M-way model parallel over the devices (on a CPU-only machine the
command sets up that many host devices itself). key=value overrides any config key (e.g. n=4,
batch_size=16, stages=3,3,4,4). Writes to --out: orbax checkpoints (ckpt/), metrics.jsonl, run.json,
curves.png and, at the end, the trained PSM (psm/) that `infer.generate --spec` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import yaml

log = logging.getLogger("train")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.main", description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True, help="a YAML file of TrainConfig keys (configs/train/)")
    ap.add_argument("--mesh", default="1x1", help="DATAxMODEL device counts, e.g. 8x1, 4x2, 1x1")
    ap.add_argument("--steps", type=int, help="total optimiser steps (overrides the config)")
    ap.add_argument("--out", help="run directory (default runs/<config name>)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    return ap.parse_args(argv)


def load_config(args) -> dict:
    path = Path(args.config)
    if not path.is_file():
        raise SystemExit(f"error: training config {path} not found (see configs/train/)")
    d = yaml.safe_load(path.read_text()) or {}
    for ov in args.overrides:
        if "=" not in ov:
            raise SystemExit(f"error: override {ov!r} is not key=value")
        k, v = ov.split("=", 1)
        d[k] = yaml.safe_load(v)
    if args.steps is not None:
        d["steps"] = args.steps
    return d


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax reports every file it touches
    raw = load_config(args)

    from spd_jax.sharding import parse_mesh, request_cpu_devices

    data, model_par = parse_mesh(args.mesh)
    # The quick eval runs the SPD engine: n stage devices besides the training mesh's.
    request_cpu_devices(max(data * model_par, int(raw.get("n", 8))))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    import spd_jax
    from spd_jax.decode import pipelined
    from spd_jax.sharding import data_model_mesh
    from spd_jax.drafters.psm import PSMConfig, save_psm
    from train import loop

    tc = loop.TrainConfig.from_dict(raw)
    if tc.batch_size % data:
        raise SystemExit(f"error: batch_size {tc.batch_size} does not split over {data} data-parallel devices")
    out = Path(args.out or Path("runs") / Path(args.config).stem).absolute()
    mesh = data_model_mesh(data, model_par)

    model = spd_jax.load_model(tc.model)
    plan = pipelined.plan_for(model, tc.n, tc.stages)
    spec = PSMConfig.for_target(model.config, plan.counts, tc.psm_layers, tc.anchors, tc.draft_vocab)
    identity = json.loads(json.dumps(loop.run_identity(model, spec, tc)))  # as run.json holds it
    ckpts = loop.Checkpoints(out / "ckpt", tc)
    if ckpts.latest() is not None and not args.resume:
        raise SystemExit(f"error: {out} already holds a run (step {ckpts.latest()}); pass --resume to continue it "
                         "or --out for a new one")
    if args.resume:
        if ckpts.latest() is None:
            raise SystemExit(f"error: --resume: no checkpoint in {out / 'ckpt'}")
        was = json.loads((out / "run.json").read_text())
        from spd_jax.drafters.psm import spec_from_json, spec_to_json

        # runs written before a spec field existed: its default
        was["identity"]["spec"] = json.loads(json.dumps(spec_to_json(spec_from_json(was["identity"]["spec"]))))
        if was["identity"] != identity:
            raise SystemExit(f"error: --resume: {out} was trained for {was['identity']}, not {identity}")
    out.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python -m train.main", *(argv if argv is not None else sys.argv[1:])])
    run = json.loads((out / "run.json").read_text()) if args.resume else {}
    run.update(identity=identity, config=raw, mesh=args.mesh, commands=run.get("commands", []) + [cmd])
    (out / "run.json").write_text(json.dumps(run, indent=1))
    log.info("PSM for %s: n=%d, stages %s, anchors %s, staircase %s, Ls=%d; mesh %dx%d on %s",
             model.path.name, spec.n, list(spec.plan), list(spec.anchors), list(spec.staircase), spec.num_layers,
             data, model_par, jax.default_backend())

    cache_dir = Path(os.environ.get("SPD_JAX_CACHE") or Path.home() / ".cache" / "spd_jax") / "corpus"
    corpus = loop.encode_corpus(model, tc, cache_dir)
    train_set, heldout = loop.split_heldout(corpus, tc)
    batches = loop.Batches(train_set, tc)
    log.info("%d training conversations (%d response positions), %d batches per epoch; %d held out",
             len(train_set), sum(int(m.sum()) for _, m in train_set), len(batches), len(heldout))

    opt = loop.make_optimizer(tc)
    vocab_ids = None
    if spec.draft_vocab:
        vocab_ids = loop.draft_vocab_ids(train_set, spec.draft_vocab, model.config.vocab_size, model.eos_token_ids)
        hits = sum(int(np.isin(ids[1:][m[:-1]], vocab_ids).sum()) for ids, m in train_set)
        log.info("draft vocabulary: %d of %d tokens, covering %.2f%% of the training response tokens",
                 spec.draft_vocab, model.config.vocab_size, 100 * hits / max(1, sum(int(m.sum()) for _, m in train_set)))
    state, frozen = loop.init_state(model, spec, tc, opt, vocab_ids)
    start, positions, wall0 = 0, 0, 0.0
    if args.resume:
        state, meta = ckpts.restore(ckpts.latest(), jax.eval_shape(lambda: state))
        start, positions, wall0 = int(state["step"]), int(meta["positions"]), float(meta["wall_s"])
        log.info("resumed at step %d (%d positions seen)", start, positions)
    step_fn = loop.make_step(model.config, spec, tc, opt, mesh)
    # placed once: each device keeps only its `model` shard of the frozen target
    target = jax.device_put(loop.compute_target(model, tc), loop.target_shardings(model.config, mesh))
    metrics_path = out / "metrics.jsonl"
    _truncate_metrics(metrics_path, start)

    eval_prompts = loop.eval_prompts(heldout, tc)
    t_start = time.perf_counter()
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc="train", unit="step")
    for step in bar:
        for micro in range(tc.grad_accum):
            batch = batches.get(step * tc.grad_accum + micro)
            state, met = step_fn(state, frozen, target, batch)
        met = {k: float(v) for k, v in met.items()}
        positions += int(met["positions"]) * tc.grad_accum
        wall = wall0 + time.perf_counter() - t_start
        done = step + 1
        row = dict(step=done, positions=positions, wall_s=round(wall, 2), **{k: met[k] for k in ("loss", "agreement",
                                                                                                  "grad_norm")})
        if done % tc.eval_every == 0 or done == tc.steps:
            row |= loop.quick_eval(model, spec, _variables(state, frozen), eval_prompts, tc)
        if done % tc.log_every == 0 or "S0" in row or done == tc.steps:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        bar.set_postfix(loss=f"{met['loss']:.3f}", agree=f"{met['agreement']:.3f}",
                        pos_s=f"{positions / max(wall, 1e-9):.0f}", **({"S0": f"{row['S0']:.2f}"} if "S0" in row else {}))
        if done % tc.save_every == 0 or done == tc.steps:
            ckpts.save(done, state, dict(positions=positions, wall_s=wall))

    variables = jax.tree.map(lambda t: t.astype(jnp.bfloat16) if jnp.issubdtype(t.dtype, jnp.floating) else t,
                             _variables(state, frozen))
    final = out / "psm"
    if final.exists():
        import shutil
        shutil.rmtree(final)
    save_psm(final, {**variables, "params": {k: v for k, v in variables["params"].items() if k != "lm_head"}}, spec,
             extra=dict(head="shared", trained=dict(steps=tc.steps, positions=positions,
                                                    wall_s=round(wall0 + time.perf_counter() - t_start, 1),
                                                    mesh=args.mesh, backend=jax.default_backend(), config=raw)))
    loop.plot_curves(metrics_path, out / "curves.png")
    log.info("trained PSM written to %s (use: python -m infer.generate --n %d --spec %s)", final, spec.n, final)
    return 0


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
