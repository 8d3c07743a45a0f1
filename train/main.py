"""Train a drafter for a frozen target: a Pipeline Speculation Module, or the EAGLE-3-style baseline.

    python -m train.main --config configs/train/smollm2-n8.yaml [--mesh 8x1] [--steps N] [--out DIR]
                         [--resume] [key=value ...]
    python -m train.main --config configs/train/smollm2-eagle3.yaml ...     # method: eagle3

--config names a recipe (configs/train/), which states what differs from configs/train/base.yaml.
--mesh DxM: D-way data parallel x M-way model parallel over the devices (on a CPU-only machine the
command sets up that many host devices itself). key=value overrides any config key (e.g. n=4
stages=6,8,8,8, which sum to SmolLM2's 30 layers; batch_size=16; method=eagle3; or by section,
optimiser.lr=2e-4). Both methods take the same data, batches, optimiser and checkpoints. Writes to --out:
orbax checkpoints (ckpt/), metrics.jsonl, run.json (the resolved config, the recipe and overrides it came
from, a warm start's weights digest, and the commands that trained the run; `--export` ones under
"exports"), curves.png
and, at the end, the trained drafter: psm/ (`infer.generate --spec`) or, for eagle3, drafter/
(`infer.generate --mode eagle3 --drafter`). `--export [STEP]` writes a kept checkpoint's drafter
without training (e.g. an earlier step, for a comparison at equal training positions). A bad command
line, config or missing optional package ends with `error: ...` on stderr and status 2. This module is
the command line only: the run is train/loop.py's.
"""

from __future__ import annotations

import argparse
import logging
import sys

import spd_jax
from spd_jax import distributed
from train import config, loop

log = logging.getLogger("train")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.main", description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True, help="a recipe of training config keys (configs/train/; its "
                                                    "defaults: configs/train/base.yaml)")
    ap.add_argument("--mesh", default="1x1", help="DATAxMODEL device counts, e.g. 8x1, 4x2, 1x1")
    ap.add_argument("--steps", type=int, help="total optimiser steps (overrides the config)")
    ap.add_argument("--out", help="run directory (default runs/<config name>)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ap.add_argument("--export", nargs="?", const="last", metavar="STEP",
                    help="write the drafter of the run's checkpoint STEP (default: the last) and exit without "
                         "training: OUT/psm or OUT/drafter for the last checkpoint, OUT/psm-step<STEP> or "
                         "OUT/drafter-step<STEP> for an earlier one; the run's recorded config is used")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not use the persistent compilation cache ($SPD_JAX_CACHE/xla, default ~/.cache/spd_jax/xla)"
                         ": a run of a recipe and shape already compiled (another seed, a resume) loads its programs")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (flat keys, or section.key)")
    distributed.add_arguments(ap)
    return ap.parse_intermixed_args(argv)  # key=value overrides may come before and after the options


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if distributed.launching(args):
        return distributed.launch(args.processes, "train.main", distributed.worker_argv(argv), args.local_devices)
    # force: importing orbax (train.checkpoints) already put absl's handler on the root logger, which would
    # make this call a no-op and drop every INFO line
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax reports every file it touches
    import jax

    if not args.no_compile_cache and not jax.config.jax_compilation_cache_dir:  # a caller's cache stays on
        spd_jax.enable_persistent_cache()
    try:
        run = loop.setup(args, argv)
    except config.SETUP_ERRORS as e:
        return config.setup_failed(e)
    if args.export:
        loop.export_run(run, loop.export_to(run), run.start, run.wall0)
        return 0
    loop.fit(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
