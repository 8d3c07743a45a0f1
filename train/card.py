"""python -m train.card: a trained drafter's model card from its training run and its evaluation.

    python -m train.card --run runs/smollm2-n8 --eval runs/eval-n8 --psm spd_jax/psms/smollm2-135m-instruct-n8
    python -m train.card --run runs/smollm2-eagle3 --eval runs/eval --drafter spd_jax/eagle3s/smollm2-135m-instruct

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

The evaluation table holds only this drafter's rows (`spd` rows at the PSM's n whose PSM is DRAFTER, or
`eagle3` rows whose drafter is DRAFTER: by the content the rows record, `drafter_id`, so an older drafter
evaluated at the same path is not reported as this one; rows from before ids were recorded by their
path), with the `ar` rows of the same setup (model, max_new_tokens, seed, backend) for reference; EVAL
rows of more than one setup for this drafter are refused (evaluate each setup into its own --out).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from infer.evaluate import SETUP  # what the rows of one evaluation share


def drafter_rows(rows: list[dict], meta: dict, directory: Path, eagle: bool) -> tuple[list[dict], dict | None]:
    """The results.jsonl rows of the drafter in `directory` (meta: its psm.json, or eagle3.json when
    `eagle`): a PSM's `spd` rows at its n, or an EAGLE-3 drafter's `eagle3` rows, plus the `ar` rows of
    their setup. A row is this drafter's by its content (`infer.evaluate.rows_of_drafter`: its drafter_id
    is the directory's content now), so the rows of an older drafter at the same path are left out; rows
    made before ids were recorded count by their path where no row of it records one (with a warning).
    -> (rows, setup); ([], None) when there is no row of this drafter; ValueError when its rows are of
    more than one setup."""
    from infer.evaluate import rows_of_drafter

    if eagle:
        mine, legacy = rows_of_drafter([r for r in rows if r["method"] == "eagle3"], directory, "drafter_spec")
    else:
        n = len(meta["plan"])
        mine, legacy = rows_of_drafter([r for r in rows if r["method"] == "spd" and r["n"] == n], directory, "psm")
    setups = sorted({tuple(r.get(k) for k in SETUP) for r in mine}, key=repr)
    if not setups:
        return [], None
    if len(setups) > 1:
        listed = "; ".join(", ".join(f"{k} {v}" for k, v in zip(SETUP, s)) for s in setups)
        raise ValueError(f"the evaluation holds {directory}'s rows of {len(setups)} setups ({listed}): a card "
                         "reports one; evaluate each setup into its own infer.evaluate --out and pass that as --eval")
    if legacy:
        print(f"warning: the evaluation's rows of {directory} record no drafter id (made before ids were recorded): "
              "taken by their path, so they may be an older drafter's that was there", file=sys.stderr)
    return mine + [r for r in rows if r["method"] == "ar" and tuple(r.get(k) for k in SETUP) == setups[0]], \
        dict(zip(SETUP, setups[0]))


def _train_config(run: dict):
    """The run's TrainConfig: the recorded keys over the defaults (a config that relied on a default
    recorded no value for it)."""
    from train.loop import TrainConfig

    return TrainConfig.from_dict(run["config"])


def _training_commands(run: dict) -> list[str]:
    """The commands that trained the run (train.main records `--export` ones under "exports"; an older
    run.json has them among "commands")."""
    return [c for c in run.get("commands", []) if not any(w == "--export" or w.startswith("--export=")
                                                          for w in c.split())]


def _setup_line(setup: dict) -> str:
    return ", ".join(f"{k} {setup[k]}" for k in SETUP)


def _no_rows(what: str, how: str) -> list[str]:
    return [f"The evaluation (--eval) holds no {what}: no evaluation to report. Evaluate it with "
            f"`{how}` and rebuild this card.", ""]


def _dir_mib(path: Path) -> float:
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
    mid = per_step[(len(per_step) - 1) // 2] if per_step else None
    median = "" if mid is None else f"median {mid:{'.1f' if mid >= 1 else '.2g'}} s per step, "
    return (f"- steps {trained.get('steps')}, response positions seen **{trained.get('positions', 0):,}**, "
            f"{median}{trained.get('wall_s', 0) / 3600:.2f} h of wall clock in all (pauses included) on "
            f"{trained.get('backend')} (mesh {trained.get('mesh')})")


TEMPERATURES = ("T = 0 is greedy; T = 1 samples at temperature 1 with top-k 50 and top-p 0.95 (the reference's "
                "setting); first turns, chat template")


def _no_quick_eval(tc, trained: dict, n: int | None = None) -> str:
    """Why a card has no quick-eval table: a PSM run's quick eval runs the engine on n stage devices, so a
    run to its last step without one had fewer (train.main switches it off); otherwise none fell due up
    to the exported step."""
    steps = trained.get("steps")
    if n is not None and steps == tc.steps:
        return f"No quick eval during training: it runs the SPD engine on n = {n} stage devices, and the run had fewer."
    return f"No quick eval during training up to step {steps} (one every {tc.eval_every} steps and at the last)."


def _data_line(tc, note: str = "") -> str:
    if tc.skip:
        span = (f"conversations {tc.skip:,} .. {tc.skip + tc.limit - 1:,} of each" if tc.limit
                else f"the conversations from {tc.skip:,} on of each")
    else:
        span = f"the first {tc.limit:,} conversations of each" if tc.limit else ""
    sources = ", ".join(tc.sources) + (f" ({span})" if span else "")
    if tc.responses == "target":
        what = (f"the first user turns of {sources} answered by the target itself (self-distillation: greedy, up "
                f"to {tc.max_len} tokens in all; train/distill.py), loss on the target's reply tokens")
    else:
        what = (f"{sources} (chat template, loss on response tokens only, conversations up to "
                f"{tc.max_len} tokens)")
    return f"- data: {what}{note}; never MT-Bench, GSM8K test or HumanEval prompts"


def _warm_start_line(run: dict, trained: dict) -> list[str]:
    """What the run started from (init_from): its positions are not among this run's. From the record the
    export or the run kept (`loop.warm_start_record`); a run from before the record: init_from's
    directory as it is now."""
    tc = _train_config(run)
    if not tc.init_from:
        return []
    was = trained.get("warm_start") or run.get("warm_start")
    if not was:
        from train.loop import warm_start_record

        try:
            was = warm_start_record(tc.init_from)
        except FileNotFoundError:
            was = dict(path=tc.init_from)
    if "positions" in was and "plan" in was:
        from train.loop import lineage_positions

        earlier = lineage_positions(was.get("warm_start"))
        what = (f"a PSM for n = {len(was['plan'])} (plan {was['plan']}, anchors {was['anchors']}), trained on "
                f"{was['positions']:,} response positions of its own"
                + (f" after a warm start of its own ({earlier:,} positions before it)" if earlier else ""))
        seen = trained.get("positions")
        total = (f"; {seen + lineage_positions(was):,} response positions in all, with this run's"
                 if seen is not None else "")
    else:
        what, total = "an exported drafter", ""
    return [f"- warm start: the weights of `{was['path']}`, {what}; a new optimiser state (the positions and "
            f"steps below are this run's only){total}"]


def card_markdown(run: dict, metrics: list[dict], psm: dict, table: list[dict], eval_cmd: str, size_mib: float,
                  setup: dict | None = None, drafter: str = "DRAFTER", lineage: list[dict] | None = None) -> str:
    """table: `infer.evaluate.pooled` over this PSM's rows (`drafter_rows`), setup their setup; an empty
    table: the card says the evaluation holds none. lineage: `update_lineage`'s points."""
    spec, trained = psm, psm.get("trained", {})
    tc = _train_config(run)
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
        + f". Weights bfloat16, {size_mib:.1f} MiB; the LM head is the target's (frozen in training, not stored).",
        "", "## Training", "",
        "Commands (in order; `--resume` continues from the last checkpoint with the same optimiser state "
        "and data position):", "", "```", *_training_commands(run), "```", "",
        _data_line(tc), *_warm_start_line(run, trained),
        f"- objective: KL(teacher || PSM) at tau = {tc.tau:g} with the exact train/inference row layout and a "
        f"simulated pipeline fill; AdamW lr {tc.lr:g}, warm-up {tc.warmup}, batch {tc.batch_size} sequences"
        f"{f' x {tc.grad_accum} accumulated' if tc.grad_accum > 1 else ''}, clip {tc.clip:g}",
        _time_line(metrics, trained),
        f"- last 10 logged steps: KL {loss:.3f}, top-1 agreement with the target {agree:.3f}",
        "", *(["Quick eval during training (greedy SPD on held-out training prompts, pooled):", "",
               "| step | positions | alpha | S0 |", "|---|---|---|---|",
               *[f"| {r['step']} | {r['positions']:,} | {r['alpha']:.3f} | {r['S0']:.2f} |" for r in evals]]
              if evals else [_no_quick_eval(tc, trained, len(spec["plan"]))]),
        "", "![learning curves](curves.png)", "",
    ]
    return "\n".join(lines + psm_evaluation(table, eval_cmd, setup, len(spec["plan"]), drafter, lineage))


def psm_evaluation(table: list[dict], eval_cmd: str, setup: dict | None, n: int, drafter: str,
                   lineage: list[dict] | None = None) -> list[str]:
    """The card's "## Evaluation" section (lines) from this PSM's pooled rows, ending with its directory's
    lineage (`update_lineage`: the points of this evaluation's setup) when it has more than this PSM."""
    lines = ["## Evaluation", ""]
    if not table:
        return lines + _no_rows(f"`spd` row of this PSM at n = {n}",
                                f"python -m infer.evaluate --methods ar,spd --n {n} --spec {drafter} --out EVAL")
    from infer.evaluate import method_label

    lines += [
        *(["```", eval_cmd, "```", ""] if eval_cmd else []),
        f"{TEMPERATURES}; alpha = committed tokens per cycle and S0 = alpha * L / (layers of the slowest stage), "
        f"pooled over prompts as sum(tokens) / sum(cycles). The evaluation's `spd` rows of this PSM at n = {n}, "
        f"with `ar`'s for reference; setup: {_setup_line(setup)}.", "",
        "| bench | method | n | T | prompts | tokens | alpha | S0 | tok/s here | vs ar here |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        ratio = f"{t['speed_vs_ar']:.2f}x" if t.get("speed_vs_ar") else "-"
        lines.append(f"| {t['bench']} | {method_label(t)} | {t['n']} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['S0']:.2f} | {t['tokens_per_s']:.1f} | {ratio} |")
    backend = setup["backend"]
    where = (f"the n = {n} stage devices are host devices sharing the host's cores (the stages run one after "
             "another), so tok/s and the ratio are not a projection for real devices; S0 is" if backend == "cpu" else
             f"one {backend} device per stage; S0 is the device-independent figure")
    lines += ["", f"tok/s and the ratio to `ar` are measured on the evaluation's {backend} backend: {where}.", ""]
    return lines + lineage_lines(lineage or [])


# ---------------------------------------------------------------- lineage: S0 across warm starts

LINEAGE = "lineage.json"  # in a PSM directory: the greedy S0 of each PSM it has held, kept by train.card
SAME_SETUP = ("model", "benches", "prompts", "max_new_tokens")  # what makes two lineage points comparable


def lineage_point(table: list[dict], setup: dict | None, psm: dict, run: dict | None) -> dict | None:
    """This PSM's lineage point: its pooled greedy (T = 0) S0 over every evaluated benchmark against the
    training positions of its whole warm-start chain (`loop.lineage_positions`). None without a T = 0
    `spd` row or a record of its training positions."""
    from train.loop import lineage_positions

    trained = psm.get("trained", {})
    spd = [t for t in table if t["method"] == "spd" and t["temperature"] == 0]
    pooled_all = next((t for t in spd if t["bench"] == "all"), None)
    if pooled_all is None or "positions" not in trained:
        return None
    config = next((c.split("--config", 1)[1].split()[0] for c in (run or {}).get("commands", []) if "--config" in c),
                  None)
    label = f"{config}, {trained.get('steps', '?')} steps" if config else f"{trained.get('steps', '?')} steps"
    return dict(positions=int(trained["positions"]) + lineage_positions(trained.get("warm_start")),
                S0=round(pooled_all["S0"], 4), alpha=round(pooled_all["alpha"], 4), tokens=pooled_all["tokens"],
                cycles=pooled_all["cycles"], prompts=pooled_all["prompts"],
                benches=sorted(t["bench"] for t in spd if t["bench"] != "all"),
                max_new_tokens=setup["max_new_tokens"], model=setup["model"], run=label,
                warm_started=bool(trained.get("warm_start")))


def update_lineage(psm_dir: Path, point: dict) -> list[dict]:
    """PSM_DIR/lineage.json with `point` in it (replacing one of the same setup and positions: the same
    PSM evaluated again), written atomically -> its points of point's setup, by positions. The file
    outlives the weights: a PSM trained on from this directory's is exported over it, and its point
    joins its predecessors'."""
    path = psm_dir / LINEAGE
    try:
        points = json.loads(path.read_text()) if path.is_file() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): fix or remove it (train.card rebuilds it from this "
                         "PSM's evaluation on)") from None
    key = lambda p: tuple(p.get(k) for k in SAME_SETUP)  # noqa: E731
    points = [p for p in points if (key(p), p.get("positions")) != (key(point), point["positions"])] + [point]
    points.sort(key=lambda p: (repr(key(p)), p["positions"]))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(points, indent=1) + "\n")
    tmp.replace(path)
    return [p for p in points if key(p) == key(point)]


def lineage_lines(points: list[dict]) -> list[str]:
    """The card's lineage table and plot (lines); none for fewer than two points."""
    if len(points) < 2:
        return []
    p0 = points[0]
    return [
        "### S0 against training positions", "",
        f"Each PSM this directory has held (every one trained on from the one before, except where the run says "
        f"otherwise), by the training positions of its whole warm-start chain: pooled greedy S0 on the same "
        f"{p0['prompts']} prompts ({', '.join(p0['benches'])}; max_new_tokens {p0['max_new_tokens']}). From "
        f"`{LINEAGE}` beside the weights, which `train.card` keeps.", "",
        "| positions in all | run | alpha | S0 |", "|---|---|---|---|",
        *[f"| {p['positions']:,} | {p['run']} | {p['alpha']:.3f} | {p['S0']:.2f} |" for p in points],
        "", "![S0 against training positions](lineage.png)", ""]


def lineage_chains(points: list[dict]) -> list[list[dict]]:
    """The lineage's points (by positions) split into warm-start chains: a PSM trained from scratch
    (`warm_started` false; points from before the key count as warm-started) starts a new one, so the
    plot draws no line into it from a PSM it did not train on from."""
    chains: list[list[dict]] = []
    for p in points:
        if not chains or p.get("warm_started", True) is False:
            chains.append([])
        chains[-1].append(p)
    return chains


def plot_lineage(points: list[dict], png: Path) -> None:
    """S0 against training positions (log scale) for the lineage's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.loop import positions_axis

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    pos, s0 = [p["positions"] for p in points], [p["S0"] for p in points]
    for chain in lineage_chains(points):
        ax.plot([p["positions"] for p in chain], [p["S0"] for p in chain], "o-", color="C0")
    ax.margins(y=0.15)  # room for the labels above the points
    # Runs a few hundred k positions apart sit on one spot of a log axis past 10 M: label the newest of
    # such a cluster only (overlapping labels read as neither; the card's table has every value).
    placed: list[tuple[float, float]] = []
    for x, y in sorted(zip(pos, s0), reverse=True):
        if all(abs(math.log10(x) - px) > 0.06 or abs(y - py) > 0.02 for px, py in placed):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
            placed.append((math.log10(x), y))
    ax.set(xscale="log", xlabel="training positions, whole warm-start chain (a gap: a run from scratch)",
           ylabel="S0 (greedy, pooled)", title=f"S0 of each PSM this directory held ({points[0]['prompts']} benchmark prompts)")
    positions_axis(ax)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def eagle3_card_markdown(run: dict, metrics: list[dict], meta: dict, table: list[dict], eval_cmd: str,
                         size_mib: float, setup: dict | None = None, drafter: str = "DRAFTER") -> str:
    """The card of an EAGLE-3-style drafter (eagle3.json): as `card_markdown`, with tokens per target
    pass (verification round) in place of alpha / S0, and this drafter's eagle3 rows (ar's for reference)."""
    trained, tc = meta.get("trained", {}), _train_config(run)
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
        + f". Weights bfloat16, {size_mib:.1f} MiB; the LM head is the target's (frozen in training, not stored). "
        "Decoding: k drafts per round, one target pass over k + 1 positions, the longest verified prefix plus "
        "the target's token (`python -m infer.generate --mode eagle3 --k 3 --drafter DIR`).",
        "", "## Training", "",
        "Commands (in order; `--resume` continues from the last checkpoint with the same optimiser state "
        "and data position):", "", "```", *_training_commands(run), "```", "",
        _data_line(tc, ", the same batches as the PSM's at equal positions"),
        f"- objective: KL(teacher || drafter) at tau = {tc.tau:g} over {trained.get('ttt_steps', tc.ttt_steps)} "
        f"unrolled draft steps (the training-time test); AdamW lr {tc.lr:g}, warm-up {tc.warmup}, "
        f"batch {tc.batch_size} sequences{f' x {tc.grad_accum} accumulated' if tc.grad_accum > 1 else ''}, "
        f"clip {tc.clip:g}",
        _time_line(metrics, trained),
        f"- last 10 logged steps: KL per unrolled step {loss:.3f}, top-1 agreement of the first draft step with "
        f"the target {agree:.3f}",
        "", *(["Quick eval during training (greedy chain decoding on held-out training prompts, pooled):", "",
               "| step | positions | k | tokens per round |", "|---|---|---|---|",
               *[f"| {r['step']} | {r['positions']:,} | {r.get('eval_k', '-')} | {r['tokens_per_round']:.3f} |"
                 for r in evals]] if evals else [_no_quick_eval(tc, trained)]),
        "", "![learning curves](curves.png)", "",
    ]
    return "\n".join(lines + eagle3_evaluation(table, eval_cmd, setup, tc.eval_k, drafter))


def eagle3_evaluation(table: list[dict], eval_cmd: str, setup: dict | None, k: int, drafter: str) -> list[str]:
    """The card's "## Evaluation" section (lines) from this EAGLE-3 drafter's pooled rows."""
    lines = ["## Evaluation", ""]
    if not table:
        return lines + _no_rows("`eagle3` row of this drafter",
                                f"python -m infer.evaluate --methods ar,eagle3 --k {k} --drafter {drafter} --out EVAL")
    from infer.evaluate import method_label

    lines += [
        *(["```", eval_cmd, "```", ""] if eval_cmd else []),
        f"{TEMPERATURES}; tokens per round = committed tokens per target pass (the chain's theoretical speedup), "
        "pooled over prompts as sum(tokens) / sum(rounds). The evaluation's `eagle3` rows of this drafter (k: "
        f"drafts per round), with `ar`'s for reference; setup: {_setup_line(setup)}.", "",
        "| bench | method | T | prompts | tokens | tokens per round | tok/s here | vs ar here |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        ratio = f"{t['speed_vs_ar']:.2f}x" if t.get("speed_vs_ar") else "-"
        lines.append(f"| {t['bench']} | {method_label(t)} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['tokens_per_s']:.1f} | {ratio} |")
    lines += ["", f"tok/s and the ratio to `ar` are measured on the evaluation's {setup['backend']} backend (one "
              "device per run); tokens per round is the device-independent figure.", ""]
    return lines


def _sections(text: str) -> list[tuple[str, str]]:
    """Markdown -> [(header, text)] split at "## " headers outside code fences; the part before the first
    has header ""."""
    out, head, buf, fenced = [], "", [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            out.append((head, "".join(buf)))
            head, buf = line.strip(), []
        buf.append(line)
    out.append((head, "".join(buf)))
    return out


def merge_card(old: str, new: str, evaluation_only: bool) -> str:
    """The card to write over `old`. Full (`new` a whole card): new, then old's sections new does not
    write (hand-written ones, e.g. "## Status and limits"), each once. Evaluation only (`new` the
    Evaluation section): old with its (first) Evaluation section replaced, or, without one, the section
    placed after "## Training" (else at the end)."""
    olds = _sections(old)
    if not evaluation_only:
        written = {h for h, _ in _sections(new)}
        parts = [new] + [t for h, t in olds if h and h not in written]
    else:
        heads = [h for h, _ in olds]
        at = heads.index("## Evaluation") if "## Evaluation" in heads else None
        if at is None:
            at = heads.index("## Training") + 1 if "## Training" in heads else len(olds)
            olds.insert(at, ("## Evaluation", ""))
        parts = [new if i == at else t for i, (h, t) in enumerate(olds) if h != "## Evaluation" or i == at]
    return "".join(p.rstrip("\n") + "\n\n" for p in parts if p.strip()).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.card", description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=None,
                    help="the training run's --out directory (without it: only the existing CARD.md's Evaluation "
                         "section is rewritten, e.g. for a drafter whose run directory is gone)")
    ap.add_argument("--eval", required=True, help="an infer.evaluate --out directory with this drafter's rows (only "
                                                  "they and `ar`'s of the same setup go into the card)")
    ap.add_argument("--psm", "--drafter", dest="psm", required=True,
                    help="the exported drafter directory the card goes into (a PSM's psm/ or an EAGLE-3 drafter/)")
    ap.add_argument("--eval-command", default=None, help="the infer.evaluate commands that produced --eval "
                                                           "(default: EVAL/commands.txt, which infer.evaluate writes)")
    args = ap.parse_args(argv)
    from infer.evaluate import pooled

    eval_dir, psm_dir = Path(args.eval), Path(args.psm)
    run_dir = Path(args.run) if args.run else None
    meta_file = psm_dir / ("eagle3.json" if (psm_dir / "eagle3.json").is_file() else "psm.json")
    card = psm_dir / "CARD.md"
    needed = [eval_dir / "results.jsonl", meta_file]
    needed += [run_dir / "run.json", run_dir / "metrics.jsonl"] if run_dir else [card]
    for p in needed:
        if not p.is_file():
            print(f"error: {p} not found" + ("" if run_dir else " (without --run the card must exist: its "
                                              "Evaluation section is rewritten)"), file=sys.stderr)
            return 2
    psm = json.loads(meta_file.read_text())
    rows = [json.loads(x) for x in (eval_dir / "results.jsonl").read_text().splitlines() if x.strip()]
    if run_dir and (run_dir / "curves.png").is_file():
        shutil.copyfile(run_dir / "curves.png", psm_dir / "curves.png")
    try:
        eagle = meta_file.name == "eagle3.json"
        write = eagle3_card_markdown if eagle else card_markdown
        eval_cmd = args.eval_command
        if eval_cmd is None:
            cmds = eval_dir / "commands.txt"
            eval_cmd = cmds.read_text().strip() if cmds.is_file() else ""
        mine, setup = drafter_rows(rows, psm, psm_dir, eagle)
        if not mine:
            print(f"warning: {eval_dir / 'results.jsonl'} holds no row of {psm_dir}: the card says so",
                  file=sys.stderr)
        run = json.loads((run_dir / "run.json").read_text()) if run_dir else None
        table, lineage = pooled(mine), None
        point = None if eagle else lineage_point(table, setup, psm, run)
        if point is not None:
            lineage = update_lineage(psm_dir, point)
            if len(lineage) > 1:
                plot_lineage(lineage, psm_dir / "lineage.png")
        if run_dir:
            metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            extra = {} if eagle else dict(lineage=lineage)
            new = write(run, metrics, psm, table, eval_cmd, _dir_mib(psm_dir / "params"), setup, args.psm, **extra)
        elif eagle:
            new = "\n".join(eagle3_evaluation(table, eval_cmd, setup, 3, args.psm))
        else:
            new = "\n".join(psm_evaluation(table, eval_cmd, setup, len(psm["plan"]), args.psm, lineage))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = merge_card(card.read_text(), new, evaluation_only=run_dir is None) if card.is_file() else new
    card.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
