"""A trained drafter's model card (DRAFTER/CARD.md): one template for every drafter kind, filled from
plain data: the run's run.json and metrics.jsonl, its config with the training defaults filled in, the
drafter's psm.json / eagle3.json, the evaluation's results rows and the PSM directory's lineage.

What differs between a PSM's card, a PPSD head's and an EAGLE-3 drafter's is the KINDS table (their wording, their
quick-eval and evaluation columns); the template, the evaluation's row selection and the merge with a
card's hand-written sections are shared. Knows nothing of train/'s config classes (`train.card` hands
the config over as a dict); writes only the drafter directory's CARD.md, lineage.json and lineage.png.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Callable

from spd_jax.drafters import registry
from spd_jax.reports.lineage import lineage_lines, lineage_point, lineage_positions, update_lineage
from spd_jax.reports.plots import plot_lineage
from spd_jax.reports.results import DRAFTER_METHOD, SETUP, drafter_rows, pooled
from spd_jax.reports.tables import pooled_table, table_lines

# the run config's keys a card reads (train's config, defaults filled in, as a dict)
CONFIG_KEYS = ("sources", "limit", "skip", "responses", "max_len", "tau", "lr", "warmup", "batch_size", "grad_accum",
               "clip", "steps", "eval_every", "init_from", "ttt_steps", "eval_k")

TEMPERATURES = ("T = 0 is greedy; T = 1 samples at temperature 1 with top-k 50 and top-p 0.95 (the reference's "
                "setting); first turns, chat template")


@dataclasses.dataclass(frozen=True)
class CardKind:
    """What a drafter kind's card says in its own words. Text fields are str.format templates over
    `model` (the target's name), `meta` (its psm.json / eagle3.json), `c` (the run config), `trained`
    (meta's training record), `n` (a PSM's depth, an EAGLE-3 drafter's chain length k), `drafter` (the
    directory as given) and `backend`."""
    meta_file: str
    # runs on n stage devices (a PSM): its rows are at its depth n, its quick eval needs the n devices (a run
    # to its last step without one had fewer), and its directory keeps a lineage of S0
    staged: bool
    title: str
    describe: str  # the intro up to the vocabulary
    vocab_draft: str  # ... a draft vocabulary of V' tokens
    vocab_whole: str  # ... the target's whole vocabulary (V tokens)
    decoding: str  # said after the weights' size (a template too)
    data_note: str  # after the data line
    warm_start: bool  # whether the card names the run's warm start
    objective: str  # the loss, before the optimiser's settings
    last_steps: str  # over the last 10 logged steps' mean loss and agreement
    quick_eval: str  # the quick-eval table's title; its figure in the metrics rows: quick_key
    quick_key: str
    quick_heads: tuple[str, ...]
    quick_row: Callable[[dict], list[str]]
    no_rows_what: str
    no_rows_how: str
    about: str  # what the evaluation's figures are and which rows are shown
    columns: tuple[str, ...]  # tables.CELLS of the evaluation table
    heads: tuple[str, ...]
    where: Callable[[str, int], str]  # (backend, n) -> where the measured speed comes from

    def depth(self, meta: dict, config: dict | None) -> int:
        """n of a PSM (its plan's stages); k of an EAGLE-3 drafter's quick eval (3 without a run)."""
        if self.staged:
            return len(meta["plan"])
        return config["eval_k"] if config else 3


def _psm_where(backend: str, n: int) -> str:
    if backend == "cpu":
        return (f": the n = {n} stage devices are host devices sharing the host's cores (the stages run one after "
                "another), so tok/s and the ratio are not a projection for real devices; S0 is.")
    return f": one {backend} device per stage; S0 is the device-independent figure."


KINDS = {
    registry.PSM.name: CardKind(
        meta_file=registry.PSM.identity_file,
        staged=registry.PSM.staged,
        title="# PSM for {model}, n = {n}",
        describe="A Pipeline Speculation Module (SPD.md) for the target named above: {meta[num_layers]} decoder "
                 "layers of the target's kind, anchors {meta[anchors]}, stage plan {meta[plan]} (layers per stage; "
                 "the depth staircase depends on it), ",
        vocab_draft="a draft vocabulary of {meta[draft_vocab]} tokens",
        vocab_whole="the target's whole vocabulary ({meta[target][3]} tokens)",
        decoding="",
        data_note="",
        warm_start=True,
        objective="KL(teacher || PSM) at tau = {c[tau]:g} with the exact train/inference row layout and a simulated "
                  "pipeline fill",
        last_steps="- last 10 logged steps: KL {loss:.3f}, top-1 agreement with the target {agree:.3f}",
        quick_eval="Quick eval during training (greedy SPD on held-out training prompts, pooled):",
        quick_key="S0",
        quick_heads=("step", "positions", "alpha", "S0"),
        quick_row=lambda r: [f"{r['step']}", f"{r['positions']:,}", f"{r['alpha']:.3f}", f"{r['S0']:.2f}"],
        no_rows_what="`spd` row of this PSM at n = {n}",
        no_rows_how="python -m infer.evaluate --methods ar,spd --n {n} --spec {drafter} --out EVAL",
        about="alpha = committed tokens per cycle and S0 = alpha * L / (layers of the slowest stage), pooled over "
              "prompts as sum(tokens) / sum(cycles). The evaluation's `spd` rows of this PSM at n = {n}, with "
              "`ar`'s for reference",
        columns=("bench", "method", "n", "T", "prompts", "tokens", "alpha", "S0", "tok/s", "vs ar"),
        heads=("bench", "method", "n", "T", "prompts", "tokens", "alpha", "S0", "tok/s here", "vs ar here"),
        where=_psm_where),
    registry.EAGLE3.name: CardKind(
        meta_file=registry.EAGLE3.identity_file,
        staged=registry.EAGLE3.staged,
        title="# EAGLE-3-style drafter for {model}",
        describe="A chain drafter in the manner of EAGLE-3 (`spd_jax/drafters/eagle3/`), the baseline SPD is "
                 "compared with: the target's hidden states {meta[layers]} (low, mid, high) fused by one linear "
                 "layer, one standard EAGLE-3 decoder layer (a Llama layer whose attention reads the token's embedding "
                 "and the fused feature), its own final norm and the target's LM head ",
        vocab_draft="over a draft vocabulary of {meta[draft_vocab]} tokens",
        vocab_whole="(its whole vocabulary, {meta[target][3]} tokens)",
        decoding=" Decoding: k drafts per round, one target pass over k + 1 positions, the longest verified prefix "
                 "plus the target's token (`python -m infer.generate --mode eagle3 --k 3 --drafter DIR`).",
        data_note=", the same batches as the PSM's at equal positions",
        warm_start=False,
        objective="KL(teacher || drafter) at tau = {c[tau]:g} over {ttt_steps} unrolled draft steps (the "
                  "training-time test)",
        last_steps="- last 10 logged steps: KL per unrolled step {loss:.3f}, top-1 agreement of the first draft "
                   "step with the target {agree:.3f}",
        quick_eval="Quick eval during training (greedy chain decoding on held-out training prompts, pooled):",
        quick_key="tokens_per_round",
        quick_heads=("step", "positions", "k", "tokens per round"),
        quick_row=lambda r: [f"{r['step']}", f"{r['positions']:,}", f"{r.get('eval_k', '-')}",
                             f"{r['tokens_per_round']:.3f}"],
        no_rows_what="`eagle3` row of this drafter",
        no_rows_how="python -m infer.evaluate --methods ar,eagle3 --k {n} --drafter {drafter} --out EVAL",
        about="tokens per round = committed tokens per target pass (the chain's theoretical speedup), pooled over "
              "prompts as sum(tokens) / sum(rounds). The evaluation's `eagle3` rows of this drafter (k: drafts per "
              "round), with `ar`'s for reference",
        columns=("bench", "method", "T", "prompts", "tokens", "alpha", "tok/s", "vs ar"),
        heads=("bench", "method", "T", "prompts", "tokens", "tokens per round", "tok/s here", "vs ar here"),
        where=lambda backend, n: " (one device per run); tokens per round is the device-independent figure."),
    registry.PPSD.name: CardKind(
        meta_file=registry.PPSD.identity_file,
        staged=registry.PPSD.staged,
        title="# PPSD early-exit head for {model}, n = {n}",
        describe="PPSD's early-exit head (`spd_jax/drafters/ppsd.py`; what it is here: docs/engine.md) for the "
                 "target named above: {meta[num_layers]} decoder layer(s) of the target's kind reading the state "
                 "after stage 0 of the stage plan {meta[plan]} (the exit after layer {meta[plan][0]}), the target's "
                 "final norm and LM head over ",
        vocab_draft="a draft vocabulary of {meta[draft_vocab]} tokens",
        vocab_whole="the target's whole vocabulary ({meta[target][3]} tokens)",
        decoding=" Decoding: the SPD engine, the head drafting after stage 0's step (`python -m infer.generate "
                 "--mode ppsd --n {n} --drafter DIR`).",
        data_note=", the same batches as the PSM's at equal positions",
        warm_start=True,
        objective="KL(teacher || head) at tau = {c[tau]:g} (self-distillation), the engine's draft at every position",
        last_steps="- last 10 logged steps: KL {loss:.3f}, top-1 agreement with the target {agree:.3f}",
        quick_eval="Quick eval during training (greedy PPSD on held-out training prompts, pooled):",
        quick_key="S0",
        quick_heads=("step", "positions", "alpha", "S0"),
        quick_row=lambda r: [f"{r['step']}", f"{r['positions']:,}", f"{r['alpha']:.3f}", f"{r['S0']:.2f}"],
        no_rows_what="`ppsd` row of this head at n = {n}",
        no_rows_how="python -m infer.evaluate --methods ar,ppsd@{n} --ppsd {drafter} --out EVAL",
        about="alpha = committed tokens per cycle and S0 = alpha * L / (layers of the slowest stage), pooled over "
              "prompts as sum(tokens) / sum(cycles). The evaluation's `ppsd` rows of this head at n = {n}, with "
              "`ar`'s for reference",
        columns=("bench", "method", "n", "T", "prompts", "tokens", "alpha", "S0", "tok/s", "vs ar"),
        heads=("bench", "method", "n", "T", "prompts", "tokens", "alpha", "S0", "tok/s here", "vs ar here"),
        where=_psm_where),
}


def kind_of(directory: Path) -> str:
    """The kind of the exported drafter in `directory`: by its identity file (`registry.of_checkpoint`), else a
    PSM's."""
    try:
        return registry.of_checkpoint(directory).name
    except FileNotFoundError:
        return registry.PSM.name


# ---------------------------------------------------------------- the training section's lines

def training_commands(run: dict) -> list[str]:
    """The commands that trained the run (train.main records `--export` ones under "exports"; an older
    run.json has them among "commands")."""
    return [c for c in run.get("commands", []) if not any(w == "--export" or w.startswith("--export=")
                                                          for w in c.split())]


def setup_line(setup: dict) -> str:
    return ", ".join(f"{k} {setup[k]}" for k in SETUP)


def up_to(metrics: list[dict], trained: dict) -> list[dict]:
    """The run's metrics up to the exported step (an earlier step's export: not the run's later steps)."""
    if trained.get("steps") is not None:
        metrics = [r for r in metrics if r["step"] <= trained["steps"]]
    if not metrics:
        raise ValueError("the run's metrics.jsonl has no step up to the exported one: train at least log_every "
                         "steps first")
    return metrics


def time_line(metrics: list[dict], trained: dict) -> str:
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


def data_line(c: dict, note: str = "") -> str:
    """What the run trained on, from its config c (sources, skip, limit, responses, max_len)."""
    skip, limit = c["skip"], c["limit"]
    if skip:
        span = (f"conversations {skip:,} .. {skip + limit - 1:,} of each" if limit
                else f"the conversations from {skip:,} on of each")
    else:
        span = f"the first {limit:,} conversations of each" if limit else ""
    sources = ", ".join(c["sources"]) + (f" ({span})" if span else "")
    if c["responses"] == "target":
        what = (f"the first user turns of {sources} answered by the target itself (self-distillation: greedy, up "
                f"to {c['max_len']} tokens in all; train/distill.py), loss on the target's reply tokens")
    else:
        what = (f"{sources} (chat template, loss on response tokens only, conversations up to "
                f"{c['max_len']} tokens)")
    return f"- data: {what}{note}; never MT-Bench, GSM8K test or HumanEval prompts"


def warm_start_line(was: dict | None, trained: dict) -> list[str]:
    """What the run started from (its config's init_from; was: its warm-start record, as the export or
    the run kept it, else as the directory holds it now; None: no warm start): its positions are not
    among this run's."""
    if not was:
        return []
    if "positions" in was and "plan" in was:
        from_chain = lineage_positions(was.get("warm_start"))
        anchors = f", anchors {was['anchors']}" if "anchors" in was else ""
        what = (f"a {registry.kind(was.get('method', registry.PSM.name)).noun} for n = {len(was['plan'])} (plan "
                f"{was['plan']}{anchors}), trained on {was['positions']:,} response positions of its own"
                + (f" after a warm start of its own ({from_chain:,} positions before it)" if from_chain else ""))
        seen = trained.get("positions")
        total = (f"; {seen + lineage_positions(was):,} response positions in all, with this run's"
                 if seen is not None else "")
    else:
        what, total = "an exported drafter", ""
    return [f"- warm start: the weights of `{was['path']}`, {what}; a new optimiser state (the positions and "
            f"steps below are this run's only){total}"]


def no_quick_eval(kind: CardKind, c: dict, trained: dict, n: int) -> str:
    """Why a card has no quick-eval table: a PSM run's quick eval runs the engine on n stage devices, so a
    run to its last step without one had fewer (train.main switches it off); otherwise none fell due up
    to the exported step."""
    steps = trained.get("steps")
    if kind.staged and steps == c["steps"]:
        return f"No quick eval during training: it runs the SPD engine on n = {n} stage devices, and the run had fewer."
    return f"No quick eval during training up to step {steps} (one every {c['eval_every']} steps and at the last)."


# ---------------------------------------------------------------- the card

def card_markdown(kind: str, run: dict, config: dict, metrics: list[dict], meta: dict, table: list[dict],
                  eval_cmd: str, size_mib: float, setup: dict | None = None, drafter: str = "DRAFTER",
                  lineage: list[dict] | None = None, warm_start: dict | None = None) -> str:
    """The whole card. config: the run's config with the training defaults filled in (CONFIG_KEYS);
    table: `results.pooled` over this drafter's rows (`results.drafter_rows`), setup their setup (an empty
    table: the card says the evaluation holds none); lineage: `lineage.update_lineage`'s points;
    warm_start: the run's warm-start record (`warm_start_line`)."""
    k, c = KINDS[kind], config
    trained = meta.get("trained", {})
    metrics = up_to(metrics, trained)
    last = metrics[-10:]
    loss = sum(r["loss"] for r in last) / len(last)
    agree = sum(r["agreement"] for r in last) / len(last)
    evals = [r for r in metrics if k.quick_key in r]
    n = k.depth(meta, config)
    fill = dict(model=Path(run["identity"]["model"]).name, meta=meta, c=c, n=n,
                ttt_steps=trained.get("ttt_steps", c["ttt_steps"]))
    vocab = (k.vocab_draft if meta.get("draft_vocab") else k.vocab_whole).format(**fill)
    accum = f" x {c['grad_accum']} accumulated" if c["grad_accum"] > 1 else ""
    lines = [
        k.title.format(**fill), "",
        k.describe.format(**fill) + vocab + f". Weights bfloat16, {size_mib:.1f} MiB; the LM head is the target's "
        "(frozen in training, not stored)." + k.decoding.format(**fill),
        "", "## Training", "",
        "Commands (in order; `--resume` continues from the last checkpoint with the same optimiser state "
        "and data position):", "", "```", *training_commands(run), "```", "",
        data_line(c, k.data_note), *(warm_start_line(warm_start, trained) if k.warm_start else []),
        f"- objective: {k.objective.format(**fill)}; AdamW lr {c['lr']:g}, warm-up {c['warmup']}, batch "
        f"{c['batch_size']} sequences{accum}, clip {c['clip']:g}",
        time_line(metrics, trained),
        k.last_steps.format(loss=loss, agree=agree),
        "", *([k.quick_eval, "", *table_lines(list(k.quick_heads), [k.quick_row(r) for r in evals])]
              if evals else [no_quick_eval(k, c, trained, n)]),
        "", "![learning curves](curves.png)", "",
    ]
    return "\n".join(lines + evaluation_lines(kind, table, eval_cmd, setup, n, drafter, lineage))


def evaluation_lines(kind: str, table: list[dict], eval_cmd: str, setup: dict | None, n: int, drafter: str,
                     lineage: list[dict] | None = None) -> list[str]:
    """The card's "## Evaluation" section (lines) from this drafter's pooled rows (n: a PSM's depth, an
    EAGLE-3 drafter's chain length), ending with a PSM directory's lineage (its points of this
    evaluation's setup) when it has more than this PSM."""
    k = KINDS[kind]
    lines = ["## Evaluation", ""]
    if not table:
        return lines + [f"The evaluation (--eval) holds no {k.no_rows_what.format(n=n)}: no evaluation to report. "
                        f"Evaluate it with `{k.no_rows_how.format(n=n, drafter=drafter)}` and rebuild this card.", ""]
    backend = setup["backend"]
    lines += [
        *(["```", eval_cmd, "```", ""] if eval_cmd else []),
        f"{TEMPERATURES}; {k.about.format(n=n)}; setup: {setup_line(setup)}.", "",
        *pooled_table(table, list(k.columns), list(k.heads)),
        "", f"tok/s and the ratio to `ar` are measured on the evaluation's {backend} backend{k.where(backend, n)}", "",
    ]
    return lines + lineage_lines(lineage or [])


def converted_card(meta: dict, config: dict, base: str) -> str:
    """The card of a PSM converted from the SPD authors' checkpoint (`spd_jax.convert.reference_psm`): meta its
    psm.json (with `converted_from`: the source file's name, size and sha256), config the checkpoint's config
    verbatim (a draft vocabulary's id list shown by count and digest: it is whole in reference.json), base the
    base model as given. Its Evaluation section is train.card's to write (`--eval EVAL --psm DIR`)."""
    src, n = meta["converted_from"], len(meta["plan"])
    shown = dict(config)
    if isinstance(shown.get("draft_token_ids"), list):
        ids = shown["draft_token_ids"]
        digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
        shown["draft_token_ids"] = f"<{len(ids)} ids, sha256 of their JSON {digest}; whole in reference.json>"
    head = f"a draft vocabulary of {meta['draft_vocab']} tokens" if meta.get("draft_vocab") else "the whole vocabulary"
    fingerprint = meta.get("target_weights")
    return "\n".join([
        f"# PSM for {Path(base).name}, n = {n}: the SPD authors' checkpoint, converted", "",
        f"Converted with `python -m spd_jax.convert.reference_psm` from the authors' reference-code (v11) checkpoint, "
        "not trained here; how each part of their PSM maps onto this project's, and what was tested: "
        "docs/reference_psm.md in the spd-jax repository.", "",
        f"- source: `{src['file']}`, {src['bytes']:,} bytes, sha256 `{src['sha256']}`",
        f"- base model: `{base}` ({meta['target'][0]}, H = {meta['target'][1]}, L = {meta['target'][2]}, V = "
        f"{meta['target'][3]}); target weights fingerprint "
        + (f"`{fingerprint}` (loading refuses other weights)" if fingerprint else
           "not recorded (the base was a config name: it loads on any model of that architecture)"),
        f"- PSM: {meta['num_layers']} decoder layers of the base's attention kind"
        + (" with Qwen3's per-head q/k norms (qk_norm)" if meta.get("qk_norm") else "")
        + f", anchors {meta['anchors']}, stage plan {meta['plan']}; its own LM head (trained with it, stored) over "
        f"{head}; the base's final norm",
        f"- run: `python -m infer.generate --model {base} --n {n} --stages {','.join(map(str, meta['plan']))} "
        "--spec DIR --prompt ...`", "",
        "The checkpoint's config, verbatim:", "", "```json", json.dumps(shown, indent=1), "```", "",
        "## Evaluation", "",
        f"Not evaluated here. Evaluate it with `python -m infer.evaluate --model {base} --methods ar,spd --n {n} "
        "--spec DIR --out EVAL` and add the results with `python -m train.card --eval EVAL --psm DIR`.", ""])


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


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def write_card(directory: Path, meta: dict, rows: list[dict], eval_cmd: str, drafter: str, run: dict | None = None,
               metrics: list[dict] | None = None, config: dict | None = None, warm_start: dict | None = None,
               eval_name: str = "the evaluation", warn: Callable[[str], None] = _warn) -> str:
    """Build DIRECTORY/CARD.md from plain data and write it -> its text. meta: the drafter's psm.json or
    eagle3.json; rows: the evaluation's results rows (eval_name: where they came from, for the
    warnings); drafter: the directory as the user named it. With run (run.json), metrics and config (the
    run's config, defaults filled in) the whole card is written, keeping an existing card's hand-written
    sections; without, only the existing card's Evaluation section. A PSM's greedy pooled S0 joins
    DIRECTORY/lineage.json (drawn in lineage.png from its second point of a setup). ValueError: rows of
    more than one setup, a broken lineage.json, metrics with no step up to the exported one."""
    kind = kind_of(directory)
    staged = KINDS[kind].staged
    mine, setup, legacy = drafter_rows(rows, DRAFTER_METHOD[kind], directory,
                                       KINDS[kind].depth(meta, None) if staged else None)
    if legacy:
        warn(f"the evaluation's rows of {directory} record no drafter id (made before ids were recorded): taken by "
             "their path, so they may be an older drafter's that was there")
    if not mine:
        warn(f"{eval_name} holds no row of {directory}: the card says so")
    table, lineage = pooled(mine), None
    point = lineage_point(table, setup, meta, run, DRAFTER_METHOD[kind]) if staged else None
    if point is not None:
        lineage = update_lineage(directory, point)
        if len(lineage) > 1:
            plot_lineage(lineage, directory / "lineage.png")
    if run is not None:
        new = card_markdown(kind, run, config, metrics, meta, table, eval_cmd, _dir_mib(directory / "params"), setup,
                            drafter, lineage, warm_start)
    else:
        new = "\n".join(evaluation_lines(kind, table, eval_cmd, setup, KINDS[kind].depth(meta, None), drafter,
                                         lineage))
    card = directory / "CARD.md"
    text = merge_card(card.read_text(), new, evaluation_only=run is None) if card.is_file() else new
    card.write_text(text)
    return text
