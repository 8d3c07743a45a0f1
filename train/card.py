"""python -m train.card: a trained drafter's model card from its training run and its evaluation.

    python -m train.card --run runs/smollm2-n8 --eval runs/eval-n8 --psm spd_jax/psms/smollm2-135m-instruct-n8
    python -m train.card --run runs/smollm2-eagle3 --eval runs/eval --drafter spd_jax/eagle3s/smollm2-135m-instruct

Reads RUN/run.json (identity, config, the commands that trained it), RUN/metrics.jsonl (loss,
agreement, quick-eval S0 or tokens per round against training positions), the exported drafter's
psm.json or eagle3.json and EVAL/results.jsonl (`infer.evaluate` rows), and writes DRAFTER/CARD.md and
DRAFTER/curves.png (the learning curves). Every figure in the card comes from those files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def _up_to(metrics: list[dict], trained: dict) -> list[dict]:
    """The run's metrics up to the exported step (an earlier step's export: not the run's later steps)."""
    if trained.get("steps") is not None:
        metrics = [r for r in metrics if r["step"] <= trained["steps"]]
    if not metrics:
        raise ValueError("the run's metrics.jsonl has no step up to the exported one: train at least log_every "
                         "steps first")
    return metrics


def _time_line(metrics: list[dict], trained: dict) -> str:
    """Steps, positions and time. Logged wall clock runs on while a run is paused (SIGSTOP, a machine
    shared with other jobs), so the per-step figure is the median over the logged windows (the lower middle
    of an even count: a pause only lengthens a window), which a few paused windows do not move; the total is
    stated as what it is."""
    timed = [r for r in metrics if "wall_s" in r]
    per_step = sorted((b["wall_s"] - a["wall_s"]) / (b["step"] - a["step"])
                      for a, b in zip(timed, timed[1:]) if b["step"] > a["step"] and b["wall_s"] > a["wall_s"])
    median = f"median {per_step[(len(per_step) - 1) // 2]:.1f} s per step, " if per_step else ""
    return (f"- steps {trained.get('steps')}, response positions seen **{trained.get('positions', 0):,}**, "
            f"{median}{trained.get('wall_s', 0) / 3600:.2f} h of wall clock in all (pauses included) on "
            f"{trained.get('backend')} (mesh {trained.get('mesh')})")


TEMPERATURES = ("T = 0 is greedy; T = 1 samples at temperature 1 with top-k 50 and top-p 0.95 (the reference's "
                "setting); first turns, chat template")


def _data_line(cfg: dict, note: str = "") -> str:
    sources = ", ".join(cfg.get("sources", []))
    if cfg.get("responses") == "target":
        what = (f"the first user turns of {sources} answered by the target itself (self-distillation: greedy, up "
                f"to {cfg.get('max_len')} tokens in all; train/distill.py), loss on the target's reply tokens")
    else:
        what = (f"{sources} (chat template, loss on response tokens only, conversations up to "
                f"{cfg.get('max_len')} tokens)")
    return f"- data: {what}{note}; never MT-Bench, GSM8K test or HumanEval prompts"


def card_markdown(run: dict, metrics: list[dict], psm: dict, table: list[dict], eval_cmd: str, size_mb: float) -> str:
    spec, trained = psm, psm.get("trained", {})
    metrics = _up_to(metrics, trained)
    last = metrics[-10:]
    loss = sum(r["loss"] for r in last) / len(last)
    agree = sum(r["agreement"] for r in last) / len(last)
    evals = [r for r in metrics if "S0" in r]
    target = spec["target"]
    lines = [
        f"# PSM for {Path(run['identity']['model']).name}, n = {len(spec['plan'])}", "",
        "A Pipeline Speculation Module (SPD.md) for the target named above: "
        f"{spec['num_layers']} decoder layers of the target's kind, anchors {spec['anchors']}, stage plan "
        f"{spec['plan']} (layers per stage; the depth staircase depends on it), "
        + (f"a draft vocabulary of {spec['draft_vocab']} tokens" if spec.get("draft_vocab") else
           f"the target's whole vocabulary ({target[3]} tokens)")
        + f". Weights bfloat16, {size_mb:.1f} MB; the LM head is the target's (frozen in training, not stored).",
        "", "## Training", "",
        "Commands (in order; `--resume` continues from the last checkpoint with the same optimiser state "
        "and data position):", "", "```", *run.get("commands", []), "```", "",
        _data_line(run["config"]),
        f"- objective: KL(teacher || PSM) at tau = 1 with the exact train/inference row layout and a simulated "
        f"pipeline fill; AdamW lr {run['config'].get('lr')}, warm-up {run['config'].get('warmup')}, "
        f"batch {run['config'].get('batch_size')} sequences, clip {run['config'].get('clip')}",
        _time_line(metrics, trained),
        f"- last 10 logged steps: KL {loss:.3f}, top-1 agreement with the target {agree:.3f}",
        "", "Quick eval during training (greedy SPD on held-out training prompts, pooled):", "",
        "| step | positions | alpha | S0 |", "|---|---|---|---|",
        *[f"| {r['step']} | {r['positions']:,} | {r['alpha']:.3f} | {r['S0']:.2f} |" for r in evals],
        "", "![learning curves](curves.png)", "",
        "## Evaluation", "", *(["```", eval_cmd, "```", ""] if eval_cmd else []),
        f"{TEMPERATURES}; alpha = committed tokens per cycle and S0 = alpha * L / (layers of the slowest stage), "
        "pooled over prompts as sum(tokens) / sum(cycles). The evaluation's `spd` rows, with `ar`'s for reference.",
        "",
        "| bench | method | n | T | prompts | tokens | alpha | S0 | tok/s here | vs ar here |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        if t["method"] not in ("spd", "ar"):
            continue
        ratio = f"{t['speed_vs_ar']:.2f}x" if t.get("speed_vs_ar") else "-"
        lines.append(f"| {t['bench']} | {t['method']} | {t['n']} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['S0']:.2f} | {t['tokens_per_s']:.1f} | {ratio} |")
    lines += ["", "tok/s are measured on the machine named above, where the n stage devices share the host's "
              "cores (stages run one after another), so they are not a projection for real devices; S0 is.", ""]
    return "\n".join(lines)


def eagle3_card_markdown(run: dict, metrics: list[dict], meta: dict, table: list[dict], eval_cmd: str,
                         size_mb: float) -> str:
    """The card of an EAGLE-3-style drafter (eagle3.json): as `card_markdown`, with tokens per target
    pass (verification round) in place of alpha / S0, and the table's eagle3 rows (ar's for reference)."""
    trained, cfg = meta.get("trained", {}), run["config"]
    metrics = _up_to(metrics, trained)
    last = metrics[-10:]
    loss = sum(r["loss"] for r in last) / len(last)
    agree = sum(r["agreement"] for r in last) / len(last)
    evals = [r for r in metrics if "tokens_per_round" in r]
    target = meta["target"]
    lines = [
        f"# EAGLE-3-style drafter for {Path(run['identity']['model']).name}", "",
        "A chain drafter in the manner of EAGLE-3 (`spd_jax/drafters/eagle3.py`), the baseline SPD is compared "
        f"with: the target's hidden states {meta['layers']} (low, mid, high) fused by one linear layer, one "
        "decoder layer of the target's attention kind, its own final norm and the target's LM head "
        + (f"over a draft vocabulary of {meta['draft_vocab']} tokens" if meta.get("draft_vocab") else
           f"(its whole vocabulary, {target[3]} tokens)")
        + f". Weights bfloat16, {size_mb:.1f} MB; the LM head is the target's (frozen in training, not stored). "
        "Decoding: k drafts per round, one target pass over k + 1 positions, the longest verified prefix plus "
        "the target's token (`python -m infer.generate --mode eagle3 --k 3 --drafter DIR`).",
        "", "## Training", "",
        "Commands (in order; `--resume` continues from the last checkpoint with the same optimiser state "
        "and data position):", "", "```", *run.get("commands", []), "```", "",
        _data_line(cfg, ", the same batches as the PSM's at equal positions"),
        f"- objective: KL(teacher || drafter) at tau = 1 over {trained.get('ttt_steps', cfg.get('ttt_steps'))} "
        f"unrolled draft steps (the training-time test); AdamW lr {cfg.get('lr')}, warm-up {cfg.get('warmup')}, "
        f"batch {cfg.get('batch_size')} sequences, clip {cfg.get('clip')}",
        _time_line(metrics, trained),
        f"- last 10 logged steps: KL per unrolled step {loss:.3f}, top-1 agreement of the first draft step with "
        f"the target {agree:.3f}",
        "", "Quick eval during training (greedy chain decoding on held-out training prompts, pooled):", "",
        "| step | positions | k | tokens per round |", "|---|---|---|---|",
        *[f"| {r['step']} | {r['positions']:,} | {r.get('eval_k', '-')} | {r['tokens_per_round']:.3f} |"
          for r in evals],
        "", "![learning curves](curves.png)", "",
        "## Evaluation", "", *(["```", eval_cmd, "```", ""] if eval_cmd else []),
        f"{TEMPERATURES}; tokens per round = committed tokens per target pass (the chain's theoretical speedup), "
        "pooled over prompts as sum(tokens) / sum(rounds). The evaluation's `eagle3` rows, with `ar`'s for "
        "reference.", "",
        "| bench | method | k | T | prompts | tokens | tokens per round | tok/s here | vs ar here |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        if t["method"] not in ("eagle3", "ar"):
            continue
        ratio = f"{t['speed_vs_ar']:.2f}x" if t.get("speed_vs_ar") else "-"
        lines.append(f"| {t['bench']} | {t['method']} | {t.get('k') or '-'} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['tokens_per_s']:.1f} | {ratio} |")
    lines += ["", "tok/s are measured on the machine named above (one device per run); tokens per round is the "
              "device-independent figure.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.card", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="the training run's --out directory")
    ap.add_argument("--eval", required=True, help="an infer.evaluate --out directory for this PSM")
    ap.add_argument("--psm", "--drafter", dest="psm", required=True,
                    help="the exported drafter directory the card goes into (a PSM's psm/ or an EAGLE-3 drafter/)")
    ap.add_argument("--eval-command", default=None, help="the infer.evaluate commands that produced --eval "
                                                           "(default: EVAL/commands.txt, which infer.evaluate writes)")
    args = ap.parse_args(argv)
    from infer.evaluate import pooled

    run_dir, eval_dir, psm_dir = Path(args.run), Path(args.eval), Path(args.psm)
    meta_file = psm_dir / ("eagle3.json" if (psm_dir / "eagle3.json").is_file() else "psm.json")
    for p in (run_dir / "run.json", run_dir / "metrics.jsonl", eval_dir / "results.jsonl", meta_file):
        if not p.is_file():
            print(f"error: {p} not found", file=sys.stderr)
            return 2
    run = json.loads((run_dir / "run.json").read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    psm = json.loads(meta_file.read_text())
    rows = [json.loads(x) for x in (eval_dir / "results.jsonl").read_text().splitlines() if x.strip()]
    if (run_dir / "curves.png").is_file():
        shutil.copyfile(run_dir / "curves.png", psm_dir / "curves.png")
    try:
        write = eagle3_card_markdown if meta_file.name == "eagle3.json" else card_markdown
        eval_cmd = args.eval_command
        if eval_cmd is None:
            cmds = eval_dir / "commands.txt"
            eval_cmd = cmds.read_text().strip() if cmds.is_file() else ""
        text = write(run, metrics, psm, pooled(rows), eval_cmd, _dir_mb(psm_dir / "params"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (psm_dir / "CARD.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
