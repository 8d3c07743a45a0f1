"""python -m train.card: a trained drafter's model card from its training run and its evaluation.

    python -m train.card --run runs/smollm2-n8 --eval runs/eval-n8 --psm spd_jax/psms/smollm2-135m-instruct-n8
    python -m train.card --run runs/smollm2-eagle3 --eval runs/eval --drafter spd_jax/eagle3s/smollm2-135m-instruct
    python -m train.card --run runs/smollm2-ppsd-n8 --eval runs/eval-ppsd --drafter runs/smollm2-ppsd-n8/ppsd

Reads RUN/run.json (identity, config, the commands that trained it), RUN/metrics.jsonl (loss,
agreement, quick-eval S0 or tokens per round against training positions), the exported drafter's
psm.json or eagle3.json and EVAL/results.jsonl (`infer.evaluate` rows), and writes DRAFTER/CARD.md and
DRAFTER/curves.png (the learning curves). Every figure in the card comes from those files. A PSM's
greedy pooled S0 also goes into DRAFTER/lineage.json, which outlives the weights (a PSM trained on from
them is exported over them): the card plots S0 against training positions across the PSMs the directory
has held (DRAFTER/lineage.png).

Sections of an existing CARD.md the card does not write (hand-written ones, e.g. "## Status and limits")
are kept. Without --run only the existing card's Evaluation section is rewritten (a drafter whose run
directory is gone):

    python -m train.card --eval runs/eval-11 --psm spd_jax/psms/smollm2-135m-instruct-n8

The evaluation table holds only this drafter's rows (`spd` rows at the PSM's n whose PSM is DRAFTER, `ppsd`
rows at the head's n whose head is DRAFTER, or `eagle3` rows whose drafter is DRAFTER: by the content the
rows record, `drafter_id`, so an older drafter evaluated at the same path is not reported as this one; rows
from before ids were recorded by their path), with the `ar` rows of the same setup (model, max_new_tokens,
seed, backend) for reference; EVAL rows of more than one setup for this drafter are refused (evaluate each
setup into its own --out).

The card itself is `spd_jax.reports.cards`' (one template for PSMs, PPSD heads and EAGLE-3 drafters, from
plain data); this CLI reads the files and hands over the run's config with the training defaults filled in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from spd_jax.reports.cards import KINDS, kind_of, write_card
from spd_jax.reports.results import read_rows
from train.checkpoints import warm_start_record
from train.config import TrainConfig


def run_config(run: dict) -> dict:
    """The run's config as a dict: the recorded keys over the training defaults (a config that relied on
    a default recorded no value for it)."""
    return TrainConfig.from_dict(run["config"]).to_flat()


def warm_start_of(config: dict, run: dict, meta: dict) -> dict | None:
    """What the run started from (init_from), None without one: the record the export or the run kept
    (`checkpoints.warm_start_record`), or for a run from before the record, init_from's directory as it is now."""
    if not config.get("init_from"):
        return None
    was = meta.get("trained", {}).get("warm_start") or run.get("warm_start")
    if not was:
        try:
            was = warm_start_record(config["init_from"])
        except FileNotFoundError:
            was = dict(path=config["init_from"])
    return was


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.card", description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=None,
                    help="the training run's --out directory (without it: only the existing CARD.md's Evaluation "
                         "section is rewritten, e.g. for a drafter whose run directory is gone)")
    ap.add_argument("--eval", required=True, help="an infer.evaluate --out directory with this drafter's rows (only "
                                                  "they and `ar`'s of the same setup go into the card)")
    ap.add_argument("--psm", "--drafter", dest="psm", required=True,
                    help="the exported drafter directory the card goes into (a PSM's psm/, a PPSD head's ppsd/ or "
                         "an EAGLE-3 drafter/)")
    ap.add_argument("--eval-command", default=None, help="the infer.evaluate commands that produced --eval "
                                                           "(default: EVAL/commands.txt, which infer.evaluate writes)")
    args = ap.parse_args(argv)
    eval_dir, psm_dir = Path(args.eval), Path(args.psm)
    run_dir = Path(args.run) if args.run else None
    meta_file = psm_dir / KINDS[kind_of(psm_dir)].meta_file
    card = psm_dir / "CARD.md"
    needed = [eval_dir / "results.jsonl", meta_file]
    needed += [run_dir / "run.json", run_dir / "metrics.jsonl"] if run_dir else [card]
    for p in needed:
        if not p.is_file():
            print(f"error: {p} not found" + ("" if run_dir else " (without --run the card must exist: its "
                                              "Evaluation section is rewritten)"), file=sys.stderr)
            return 2
    psm = json.loads(meta_file.read_text())
    rows = read_rows(eval_dir / "results.jsonl")
    if run_dir and (run_dir / "curves.png").is_file():
        shutil.copyfile(run_dir / "curves.png", psm_dir / "curves.png")
    eval_cmd = args.eval_command
    if eval_cmd is None:
        cmds = eval_dir / "commands.txt"
        eval_cmd = cmds.read_text().strip() if cmds.is_file() else ""
    try:
        run = metrics = config = warm_start = None
        if run_dir:
            run = json.loads((run_dir / "run.json").read_text())
            metrics = read_rows(run_dir / "metrics.jsonl")
            config = run_config(run)
            warm_start = warm_start_of(config, run, psm)
        text = write_card(psm_dir, psm, rows, eval_cmd, args.psm, run, metrics, config, warm_start,
                          eval_name=str(eval_dir / "results.jsonl"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
