"""Score training runs side by side on one held-out set: the target's own greedy replies.

    python -m train.heldout RUN [RUN ...] [--offset 400] [--count 32] [--steps 20,40] [--turns first|every]
                            [--merge REPORT.json ...] [--out DIR]
    python -m train.heldout --merge REPORT.json [REPORT.json ...] --out DIR

At inference a drafter is checked against the target's own continuation, so that is what the held-out
set holds, whatever a run trained on (the dataset's responses or the target's: `responses`). The set:
the first user turn of conversations offset .. offset + count - 1 of each source the runs trained on,
answered greedily by the target up to the runs' max_len (`train.distill.regenerate`, cached beside the
corpora), less any whose prompt repeats a training conversation's first turn (ShareGPT has duplicates).
`--turns every` asks every user turn of those conversations with its context, as a `train.replies` corpus
asks its own (more held-out positions, and the distribution such a corpus trains on). A run on a replies
corpus (`replies=DIR`) is held out by the corpus's own range (its `--heldout`), and a held-out prompt that
its chunks hold is dropped. A run whose `limit` does not keep those conversations out of its training data
is refused, as is one that started from another drafter (`init_from`: what that one saw is not checked here).

Every kept checkpoint of each run (or those of --steps), and its initial state (step 0: where the run started, e.g. the
target's last layers against a random start), is scored teacher-forced with the training objective
(`step.loss_fn`, in float32 whatever the run computed in, on one bucket set): KL(target || drafter) per
response position (an EAGLE-3 drafter's: averaged over its unrolled draft steps, so runs of one method
are compared) and top-1 agreement with the target, which for a PSM is the chance a greedy draft is
accepted at the simulated fill. The simulated pipeline fills are one fixed draw shared by all runs, so
the scores differ only by the drafters' weights. Runs meant for comparison should keep many checkpoints
(`save_every`, `keep`): the comparison at equal data interpolates between the two around it.
Writes heldout.json (a row per run and step, each run's config, the held-out set with its digest),
heldout.md (the table, and every run at the largest number of training positions all reached, with the
checkpoints it lies between) and heldout.png (both scores against training positions).

`--merge` joins earlier reports' rows to this one's: a sweep too long for one session is scored a few
runs at a time, and its table is built from the reports (the runs' directories need not exist any more).
The rows compare because the set (its digest: every sequence's tokens and mask) and the fills' seed are
fixed; a report on another set is refused, as is a run name two reports share.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import spd_jax
from spd_jax.progress import progress_bar
from train import checkpoints, corpus, data, distill, replies, step
from train.config import TrainConfig
from train.heldout_report import read_reports, report, same_set

log = logging.getLogger("train.heldout")

SEED = 20261202  # the fixed draw of simulated fills every run is scored under
BATCH = 8  # held-out sequences per scored batch: a training batch's size, so its memory is known to fit


@dataclasses.dataclass(frozen=True)
class Run:
    path: Path
    tc: TrainConfig


def read_run(path: Path) -> Run:
    path = Path(path)
    rec = path / "run.json"
    if not rec.is_file():
        raise FileNotFoundError(f"{rec} not found: {path} is not a training run directory (train.main --out)")
    return Run(path, TrainConfig.from_dict(json.loads(rec.read_text())["config"]))


def check_like(configs: dict[str, dict]) -> None:
    """One target, method, data definition and fill rate for all runs (configs: name -> flat config)."""
    first, theirs = next(iter(configs.items()))
    for name, mine in configs.items():
        for key in ("model", "method", "sources", "max_len", "fill_accept"):
            if mine.get(key) != theirs.get(key):
                raise ValueError(f"{name} has {key}={mine.get(key)!r}, {first} {theirs.get(key)!r}: "
                                 "runs are compared on one held-out set of one target's replies with one objective; "
                                 "compare like runs")


def check_runs(runs: list[Run], offset: int, count: int) -> None:
    """One target, method and data definition for all (`check_like`); none may have seen the held-out
    conversations."""
    check_like({str(r.path): r.tc.to_flat() for r in runs})
    for r in runs:
        d = r.tc.data
        if d.replies is not None:
            check_replies_heldout(r, offset, count)
        elif d.limit is None:
            raise ValueError(f"{r.path} trained on every conversation of {', '.join(d.sources)} (no limit), so none is "
                             f"held out: train the runs to compare with limit=N (N <= --offset {offset})")
        elif d.skip + d.limit > offset:
            raise ValueError(f"{r.path} trained on conversations {d.skip} .. {d.skip + d.limit - 1} of each source, "
                             f"which overlaps the held-out set from --offset {offset}: pass --offset "
                             f"{d.skip + d.limit} (or more)")
        if r.tc.drafter.init_from:
            raise ValueError(f"{r.path} started from {r.tc.drafter.init_from} (init_from), whose training data is not "
                             "checked "
                             "against the held-out set: compare runs that start from the target or at random")


def check_replies_heldout(run: Run, offset: int, count: int) -> None:
    """A run on a `train.replies` corpus (`replies=DIR`): the corpus must have kept conversations offset ..
    offset + count - 1 of each source out (its `--heldout` range; it also drops any prompt repeating one of
    their first turns)."""
    manifest = Path(run.tc.data.replies).expanduser() / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{run.path} trained on replies={run.tc.data.replies}, which has no manifest.json")
    settings = json.loads(manifest.read_text())["settings"]
    a, b = settings["heldout"]
    if settings.get("limit") is not None and settings["limit"] < b:
        # its prompt list stopped before the held-out conversations, so it never saw their first turns to drop
        # their repeats from training
        raise ValueError(f"{run.path} trained on a replies corpus of the first {settings['limit']} conversations, "
                         f"which never read its held-out range {a} .. {b - 1}: it may hold their first turns; "
                         "compare runs on a corpus made without --limit")
    if not a <= offset < offset + count <= b:
        raise ValueError(f"{run.path} trained on a replies corpus holding out conversations {a} .. {b - 1} of each "
                         f"source, which does not cover the held-out set {offset} .. {offset + count - 1}: pass "
                         f"--offset and --count within {a} .. {b - 1}")


def heldout_prompts(model, tc, offset: int, count: int, seen_below: int = 0,
                    every_turn: bool = False) -> tuple[list[np.ndarray], int]:
    """-> (first-turn prompts [T_i] int32 of conversations offset .. offset + count - 1 of each source, or with
    every_turn each user turn's with its context (`replies.turn_prompts`, as a replies corpus asks them), in
    order; how many were dropped as repeats of a first turn among conversations 0 .. seen_below - 1 of their
    source). Ones leaving the reply under distill.MIN_ROOM tokens of tc.data.max_len are skipped."""
    index: collections.Counter = collections.Counter()
    trained: set[tuple[str, bytes]] = set()
    out, repeats = [], 0
    # every conversation, whatever prompt_pattern the run trained with: its skip and limit count them all
    every = tc.replace(skip=0, limit=max(offset + count, seen_below), prompt_pattern=None)
    for src, msgs in data.conversations(every):
        i = index[src]
        index[src] += 1
        if i >= offset + count and i >= seen_below:
            continue
        ids = distill.first_turn_ids(model, msgs)
        if i < seen_below:
            trained.add((src, ids.tobytes()))
        if offset <= i < offset + count and every_turn:
            out += [(src, p) for p in replies.turn_prompts(model, msgs, tc.data.max_len)]
        elif offset <= i < offset + count and len(ids) <= tc.data.max_len - distill.MIN_ROOM:
            out.append((src, ids))
    kept = [ids for src, ids in out if (src, ids.tobytes()) not in trained]
    return kept, len(out) - len(kept)


def heldout_set(model, tc, offset: int, count: int, seen_below: int = 0, batch: int = 32,
                every_turn: bool = False) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """-> ([(ids [T_i] int32, mask [T_i] bool)]: the held-out prompts with the target's greedy replies,
    mask[t] where t + 1 is a reply token; prompts dropped as repeats of training ones), generated once
    and cached."""
    prompts, repeats = heldout_prompts(model, tc, offset, count, seen_below, every_turn)
    if not prompts:
        raise ValueError(f"no held-out conversations at --offset {offset} of {', '.join(tc.data.sources)} "
                         f"(fewer than {offset + 1} conversations, or none fits max_len {tc.data.max_len}): pass a "
                         "smaller --offset and train the runs with a limit below it")
    key = data.corpus_key(model, tc.replace(skip=0, limit=None, prompt_pattern=None),
                          "heldout-target-greedy", offset, count,
                          seen_below, distill.MIN_ROOM, *(["every-turn"] if every_turn else []))
    log.info("held-out set: %d %s (conversations %d .. %d of %s; %d dropped as repeats of training "
             "prompts), the target's greedy replies", len(prompts), "turns" if every_turn else "first turns",
             offset, offset + count - 1,
             ", ".join(tc.data.sources), repeats)
    return distill.regenerate(model, prompts, tc.data.max_len, batch, data.corpus_dir() / f"heldout-{key}"), repeats


def without_trained_prompts(seqs: list[tuple[np.ndarray, np.ndarray]], runs: list[Run]) -> list:
    """The held-out sequences less those whose prompt a run on a replies corpus trained on: ShareGPT repeats
    whole conversations, and a corpus drops only the repeats of its held-out range's first turns."""
    trained = set()
    for r in runs:
        d = r.tc.data
        if d.replies is not None:
            trained |= {np.asarray(ids[:int(np.argmax(m)) + 1], np.int32).tobytes()
                        for ids, m in replies.read_corpus(Path(d.replies).expanduser(), d.replies_chunks)}
    return [(ids, m) for ids, m in seqs if np.asarray(ids[:int(np.argmax(m)) + 1], np.int32).tobytes() not in trained]


class Teacher:
    """The held-out batches (`seqs` sorted by length into batches of BATCH, padded to `buckets`) and, for
    PSMs, the target's features at the union of their anchors (`anchors`: every run's), computed once
    in float32 and shared by every run and checkpoint scored: a PSM's score then runs the PSM alone."""

    def __init__(self, model, tc, seqs: list[tuple[np.ndarray, np.ndarray]], buckets=None,
                 anchors: tuple[int, ...] | None = None):
        self.tc = tc.replace(compute_dtype="float32")  # one teacher for every run
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), i))
        self.batches = [(corpus.pad_batch([seqs[i] for i in order[a:a + BATCH]], buckets or tc.data.buckets),
                         np.asarray(order[a:a + BATCH])) for a in range(0, len(order), BATCH)]
        self.target = step.compute_target(model, self.tc)
        self.anchors, self.features = anchors, None
        if anchors is not None:
            teacher = jax.jit(functools.partial(step.teacher_features, model.config, anchors))
            self.features = [teacher(self.target, b["tokens"], b["query"])
                             for b, _ in progress_bar(self.batches, desc="held-out teacher", unit="batch")]

    def batch(self, i: int, anchors: tuple[int, ...] | None) -> dict:
        """Batch i, with the features at `anchors` (a subset of the union) when they were computed."""
        b = self.batches[i][0]
        if self.features is None or anchors is None:
            return b
        h, x, top = self.features[i]
        pick = np.asarray([self.anchors.index(a) for a in anchors])
        return dict(b, anchor_states=h[:, :, pick], final_hidden=x, teacher_argmax=top)


def scorer(model, spec, tc, teacher: Teacher):
    """-> score(trainable, frozen) -> {kl, agreement[, agreement_by_fill, positions_by_fill]: a PSM's, fills
    1 .. n}: the objective
    in float32 over the teacher's batches, sequence i's fills keyed by (SEED, i) and dealt over its batch's
    query slots (`psm.deal_fills`): the same fills for every run scored on the same sequences and buckets."""
    loss = jax.jit(step.loss_fn(model.config, spec, teacher.tc))
    base = jax.random.key(SEED)
    anchors = getattr(spec, "anchors", None) if teacher.features is not None else None

    def score(trainable, frozen) -> dict:
        tot = collections.Counter()
        by_fill = [0.0, 0.0]
        for i, (_, idx) in enumerate(teacher.batches):
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(idx))
            _, sums = loss(trainable, frozen, teacher.target, teacher.batch(i, anchors), keys)
            tot["kl"] += float(sums["kl_sum"])
            tot["agree"] += float(sums["agree_sum"])
            tot["positions"] += float(sums["positions"])
            tot["agree_positions"] += float(sums.get("agree_positions", sums["positions"]))
            if "agree_by_fill" in sums:
                by_fill = [by_fill[0] + np.asarray(sums["agree_by_fill"]), by_fill[1] + np.asarray(sums["positions_by_fill"])]
        out = dict(kl=tot["kl"] / tot["positions"], agreement=tot["agree"] / tot["agree_positions"])
        if np.ndim(by_fill[0]):
            out["agreement_by_fill"] = (by_fill[0] / np.maximum(by_fill[1], 1)).round(6).tolist()
            out["positions_by_fill"] = [int(c) for c in by_fill[1]]
        return out

    return score


def checkpoints_to_score(run: Run, steps: set[int] | None = None) -> list[int]:
    """The run's kept checkpoint steps, or those of `steps` (each must be kept), ascending; raises for a run
    that cannot be scored."""
    if run.tc.drafter.draft_vocab and not (run.path / "draft_vocab.npy").is_file():
        raise FileNotFoundError(f"{run.path / 'draft_vocab.npy'} not found: the run's draft vocabulary (train.main "
                                "writes it beside ckpt/) is needed to score it; restore the file from the run")
    kept = checkpoints.Checkpoints(run.path / "ckpt", run.tc).all_steps() if (run.path / "ckpt").is_dir() else []
    if steps is not None and set(steps) - set(kept):
        raise ValueError(f"{run.path} keeps no checkpoint of step(s) {sorted(set(steps) - set(kept))} (kept: {kept}): "
                         "pass --steps from those")
    return kept if steps is None else sorted(steps)


def score_run(model, run: Run, teacher: Teacher, steps: list[int] = (), show_progress: bool = True) -> list[dict]:
    """Rows {run, step, train_positions, kl, agreement[, agreement_by_fill]} for the run's initial state and
    its checkpoints of `steps` (`checkpoints_to_score`) by `scorer` on the teacher's batches."""
    tc = run.tc
    spec = step.drafter_spec(model, tc)
    vocab_ids = None
    if spec.draft_vocab:
        vocab_ids = np.load(run.path / "draft_vocab.npy", allow_pickle=False)
    opt = step.make_optimizer(tc)
    state, frozen = step.init_state(model, spec, tc, opt, vocab_ids)
    score = scorer(model, spec, tc, teacher)
    rows = [dict(run=run.path.name, step=0, train_positions=0, **score(state["params"], frozen))]
    if not steps:
        return rows
    ckpts = checkpoints.Checkpoints(run.path / "ckpt", tc)
    for at in progress_bar(steps, desc=f"scoring {run.path.name}", unit="ckpt", disable=not show_progress):
        restored, meta = ckpts.restore(at, jax.eval_shape(lambda: state))
        rows.append(dict(run=run.path.name, step=at, train_positions=int(meta["positions"]),
                         **score(restored["params"], frozen)))
    return rows


def set_digest(seqs: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """What makes two held-out sets one: every sequence's tokens and loss mask, in order."""
    return data.hash_sequences(seqs).hexdigest()[:16]


def inputs(args) -> tuple:
    """-> (runs, the target, each run's steps to score, the held-out sequences, the held-out set's record,
    the merged reports' rows and configs), every argument, run and report checked; raises ValueError,
    FileNotFoundError or ImportError for what the user can fix. Only --merge: (None, ..., the reports')."""
    if args.offset < 0 or args.count < 1:
        raise ValueError(f"--offset must be >= 0 and --count >= 1 (got {args.offset}, {args.count})")
    try:
        steps = None if args.steps is None else {int(x) for x in args.steps.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"--steps {args.steps!r} is not a comma-separated list of steps (e.g. 20,40,60)") from None
    old_rows, old_configs, old_held = read_reports(args.merge)
    if not args.runs:
        if not args.merge or not args.out:
            raise ValueError("name the runs to score, or the reports to join (--merge) and where the joined one goes (--out)")
        check_like(old_configs)
        return None, None, None, None, old_held, old_rows, old_configs
    runs = [read_run(p) for p in args.runs]
    if len({r.path.name for r in runs}) < len(runs):
        raise ValueError("two runs share a directory name, which the report names them by: rename one")
    if both := sorted({r.path.name for r in runs} & set(old_configs)):
        raise ValueError(f"run(s) {', '.join(both)} are in a merged report already: score a run once, or leave that "
                         "report out")
    check_runs(runs, args.offset, args.count)
    check_like({**old_configs, **{r.path.name: r.tc.to_flat() for r in runs}})
    tc = runs[0].tc
    model = spd_jax.load_model(tc.model.name)
    scored = [checkpoints_to_score(r, steps) for r in runs]
    # a replies corpus has dropped its own repeats of held-out first turns: nothing of it to drop here
    seen = max(0 if r.tc.data.replies else r.tc.data.skip + r.tc.data.limit for r in runs)
    seqs, repeats = heldout_set(model, tc, args.offset, args.count, seen, args.batch, args.turns == "every")
    kept = without_trained_prompts(seqs, runs)
    seqs, repeats = kept, repeats + len(seqs) - len(kept)
    heldout = dict(offset=args.offset, count=args.count, turns=args.turns, sources=list(tc.data.sources),
                   max_len=tc.data.max_len, sequences=len(seqs), repeats=repeats,
                   positions=sum(int(m.sum()) for _, m in seqs), digest=set_digest(seqs), fills_seed=SEED)
    if old_held is not None:
        same_set(old_held, heldout, f"the runs named and {args.merge[0]}")
    return runs, model, scored, seqs, heldout, old_rows, old_configs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.heldout", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="training run directories (train.main --out), trained with limit <= --offset")
    ap.add_argument("--offset", type=int, default=400, help="first held-out conversation index of each source")
    ap.add_argument("--count", type=int, default=32, help="held-out conversations per source")
    ap.add_argument("--steps", help="the checkpoints to score, e.g. 20,40,60 (default: every kept one; the "
                                     "initial state is always scored)")
    ap.add_argument("--batch", type=int, default=32, help="prompts per generated batch (the target's replies)")
    ap.add_argument("--turns", choices=["first", "every"], default="first",
                    help="the held-out conversations' first user turns, or every turn with its context (as a "
                         "replies corpus asks them)")
    ap.add_argument("--merge", nargs="+", default=[], metavar="REPORT",
                    help="earlier reports (heldout.json) on the same held-out set, whose rows join this report's")
    ap.add_argument("--out", help="where heldout.json/.md/.png go (default: the first run's directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)
    # What the user can fix (arguments, run directories, reports, data, a missing file or the `train` extra)
    # ends with `error: ...` and status 2; errors while scoring are not caught.
    try:
        runs, model, scored, seqs, heldout, old_rows, old_configs = inputs(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if runs is None:
        print(report(old_rows, old_configs, heldout, Path(args.out)))
        return 0
    tc = runs[0].tc
    specs = [step.drafter_spec(model, r.tc) for r in runs]
    # PSMs share one teacher forward (at all their anchors); EAGLE-3 drafters' loss runs its own
    anchors = (tuple(sorted({a for s in specs for a in s.anchors})) if all(r.tc.drafter.kind.staged for r in runs)
               else None)
    teacher = Teacher(model, tc, seqs, tc.data.buckets, anchors)
    rows = [row for run, st in zip(runs, scored) for row in score_run(model, run, teacher, st)]
    configs = {**old_configs, **{r.path.name: r.tc.to_flat() for r in runs}}
    print(report(old_rows + rows, configs, heldout, Path(args.out) if args.out else runs[0].path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
