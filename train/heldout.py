"""Score training runs side by side on one held-out set: the target's own greedy replies.

    python -m train.heldout RUN [RUN ...] [--offset 400] [--count 32] [--out DIR]

At inference a drafter is checked against the target's own continuation, so that is what the held-out
set holds, whatever a run trained on (the dataset's responses or the target's: `responses`). The set:
the first user turn of conversations offset .. offset + count - 1 of each source the runs trained on,
answered greedily by the target up to the runs' max_len (`train.distill.regenerate`, cached beside the
corpora). A run whose `limit` does not keep those conversations out of its training data is refused.

Every kept checkpoint of each run, and its initial state (step 0: where the run started, e.g. the
target's last layers against a random start), is scored teacher-forced with the training objective
(`loop.loss_fn`: KL(target || drafter) per response position, and top-1 agreement with the target,
which for a PSM is the chance a greedy draft is accepted at the simulated fill). The simulated pipeline
fills are one fixed draw shared by all runs, so every score differs only by the drafter's weights.
Writes heldout.json (a row per run and step), heldout.md (the table, and every run at the largest number
of training positions all reached: equal data) and heldout.png (both scores against training positions).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("train.heldout")

SEED = 20261202  # the fixed draw of simulated fills every run is scored under
BATCH = 8  # held-out sequences per scored batch


@dataclasses.dataclass(frozen=True)
class Run:
    path: Path
    config: dict  # as run.json recorded it
    tc: Any  # its loop.TrainConfig


def read_run(path: Path) -> Run:
    from train import loop

    path = Path(path)
    rec = path / "run.json"
    if not rec.is_file():
        raise FileNotFoundError(f"{rec} not found: {path} is not a training run directory (train.main --out)")
    config = json.loads(rec.read_text())["config"]
    return Run(path, config, loop.TrainConfig.from_dict(config))


def check_runs(runs: list[Run], offset: int) -> None:
    """One target and data definition for all; none may have trained on the held-out conversations."""
    first = runs[0].tc
    for r in runs:
        for key in ("model", "sources", "max_len"):
            if getattr(r.tc, key) != getattr(first, key):
                raise ValueError(f"{r.path} has {key}={getattr(r.tc, key)!r}, {runs[0].path} {getattr(first, key)!r}: "
                                 "runs are compared on one held-out set of one target's replies; compare like runs")
        if r.tc.limit is None or r.tc.limit > offset:
            raise ValueError(f"{r.path} trained on conversations 0 .. {'all' if r.tc.limit is None else r.tc.limit - 1} "
                             f"of each source, which overlaps the held-out set from --offset {offset}: pass --offset "
                             f">= its limit (train runs to compare with limit=N)")


def heldout_prompts(model, tc, offset: int, count: int) -> list[np.ndarray]:
    """First-turn prompts of conversations offset .. offset + count - 1 of each of tc.sources, in order;
    ones leaving the reply under distill.MIN_ROOM tokens of tc.max_len are skipped."""
    from train import distill, loop

    seen: collections.Counter = collections.Counter()
    out = []
    for src, msgs in loop.conversations(dataclasses.replace(tc, limit=offset + count)):
        seen[src] += 1
        if seen[src] > offset:
            ids = distill.first_turn_ids(model, msgs)
            if len(ids) <= tc.max_len - distill.MIN_ROOM:
                out.append(ids)
    return out


def heldout_set(model, tc, offset: int, count: int, batch: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, mask)]: the held-out prompts with the target's greedy replies (mask: t + 1 is a reply
    token), generated once and cached."""
    from train import distill, loop

    prompts = heldout_prompts(model, tc, offset, count)
    if not prompts:
        raise ValueError(f"no held-out conversations at offset {offset} of {list(tc.sources)} (fewer than "
                         f"{offset + 1} conversations, or none fits max_len {tc.max_len})")
    key = loop.corpus_key(model, dataclasses.replace(tc, limit=None), "heldout-target-greedy", offset, count,
                          distill.MIN_ROOM)
    log.info("held-out set: %d first turns (conversations %d .. %d of %s), the target's greedy replies",
             len(prompts), offset, offset + count - 1, ", ".join(tc.sources))
    return distill.regenerate(model, prompts, tc.max_len, batch, loop.corpus_dir() / f"heldout-{key}")


def scorer(model, spec, tc, seqs: list[tuple[np.ndarray, np.ndarray]]):
    """-> score(trainable, frozen) -> {kl, agreement, positions}: the objective summed over `seqs` (sorted
    by length into batches of BATCH, padded to tc.buckets), with sequence i's fills keyed by (SEED, i)."""
    import jax
    import jax.numpy as jnp

    from train import loop

    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), i))
    batches = [(loop.pad_batch([seqs[i] for i in order[a:a + BATCH]], tc.buckets), np.asarray(order[a:a + BATCH]))
               for a in range(0, len(order), BATCH)]
    target = loop.compute_target(model, tc)
    loss = jax.jit(loop.loss_fn(model.config, spec, tc))
    base = jax.random.key(SEED)

    def score(trainable, frozen) -> dict:
        tot = collections.Counter()
        for batch, idx in batches:
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(idx))
            _, sums = loss(trainable, frozen, target, batch, keys)
            tot["kl"] += float(sums["kl_sum"])
            tot["agree"] += float(sums["agree_sum"])
            tot["positions"] += float(sums["positions"])
            tot["agree_positions"] += float(sums.get("agree_positions", sums["positions"]))
        return dict(kl=tot["kl"] / tot["positions"], agreement=tot["agree"] / tot["agree_positions"],
                    positions=int(tot["positions"]))

    return score


def score_run(model, run: Run, seqs, show_progress: bool = True) -> list[dict]:
    """Rows {run, step, positions (training), kl, agreement} for the run's initial state and each kept
    checkpoint."""
    import jax

    from spd_jax.progress import progress_bar
    from train import loop

    tc = run.tc
    spec = loop.drafter_spec(model, tc)
    vocab_ids = None
    if spec.draft_vocab:
        vocab_file = run.path / "draft_vocab.npy"
        if not vocab_file.is_file():
            raise FileNotFoundError(f"{vocab_file} not found: the run's draft vocabulary is needed to score it")
        vocab_ids = np.load(vocab_file, allow_pickle=False)
    opt = loop.make_optimizer(tc)
    state, frozen = loop.init_state(model, spec, tc, opt, vocab_ids)
    score = scorer(model, spec, tc, seqs)
    rows = [dict(run=run.path.name, step=0, train_positions=0, **score(state["params"], frozen))]
    if not (run.path / "ckpt").is_dir():
        return rows
    ckpts = loop.Checkpoints(run.path / "ckpt", tc)
    for step in progress_bar(ckpts.all_steps(), desc=f"scoring {run.path.name}", unit="ckpt",
                             disable=not show_progress):
        restored, meta = ckpts.restore(step, jax.eval_shape(lambda: state))
        rows.append(dict(run=run.path.name, step=step, train_positions=int(meta["positions"]),
                         **score(restored["params"], frozen)))
    return rows


def differences(runs: list[Run]) -> dict[str, str]:
    """Run name -> the config keys that differ between the runs (what the comparison is about)."""
    keys = sorted({k for r in runs for k in r.config} - {"steps"})
    varying = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]
    return {r.path.name: ", ".join(f"{k}={r.config.get(k)}" for k in varying) or "-" for r in runs}


def at_equal_positions(rows: list[dict]) -> tuple[int, dict[str, dict]]:
    """The largest training positions every run reached, and each run's scores there, linearly
    interpolated between its two checkpoints around it."""
    by_run = collections.defaultdict(list)
    for r in rows:
        by_run[r["run"]].append(r)
    common = min(max(r["train_positions"] for r in rs) for rs in by_run.values())
    out = {}
    for name, rs in by_run.items():
        x = [r["train_positions"] for r in rs]
        out[name] = {k: float(np.interp(common, x, [r[k] for r in rs])) for k in ("kl", "agreement")}
    return common, out


def report(rows: list[dict], runs: list[Run], heldout: dict, out: Path) -> str:
    """Write heldout.json, heldout.md and heldout.png to `out`; -> the markdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    diff = differences(runs)
    common, equal = at_equal_positions(rows)
    (out / "heldout.json").write_text(json.dumps(dict(heldout=heldout, runs={k: str(r.path) for k, r in zip(diff, runs)},
                                                      differences=diff, rows=rows, equal_positions=common,
                                                      at_equal_positions=equal), indent=1))
    lines = [f"Held-out set: {heldout['sequences']} first turns (conversations {heldout['offset']} .. "
             f"{heldout['offset'] + heldout['count'] - 1} of each of {', '.join(heldout['sources'])}), the target's "
             f"greedy replies, {heldout['positions']} scored positions; fills drawn once (seed {SEED}) for all runs.",
             "", f"At {common:,} training positions (the most every run reached; interpolated between checkpoints):", "",
             "| run | differs in | held-out KL | held-out top-1 agreement |", "|---|---|---|---|"]
    lines += [f"| {name} | {diff[name]} | {v['kl']:.3f} | {v['agreement']:.4f} |" for name, v in equal.items()]
    lines += ["", "Every scored state (step 0: the initial weights):", "",
              "| run | step | training positions | held-out KL | held-out top-1 agreement |", "|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['step']} | {r['train_positions']:,} | {r['kl']:.3f} | {r['agreement']:.4f} |"
              for r in rows]
    md = "\n".join(lines) + "\n"
    (out / "heldout.md").write_text(md)

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in diff:
        rs = [r for r in rows if r["run"] == name]
        x = [r["train_positions"] for r in rs]
        label = f"{name} ({diff[name]})"
        ax[0].plot(x, [r["kl"] for r in rs], "o-", label=label)
        ax[1].plot(x, [r["agreement"] for r in rs], "o-", label=label)
    ax[0].set(title="held-out KL(target || drafter)", xlabel="training positions", yscale="log")
    ax[1].set(title="held-out top-1 agreement with the target", xlabel="training positions")
    for a in ax:
        a.grid(alpha=0.3)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=110)
    plt.close(fig)
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.heldout", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="training run directories (train.main --out), trained with limit <= --offset")
    ap.add_argument("--offset", type=int, default=400, help="first held-out conversation index of each source")
    ap.add_argument("--count", type=int, default=32, help="held-out conversations per source")
    ap.add_argument("--batch", type=int, default=32, help="prompts per generated batch (the target's replies)")
    ap.add_argument("--out", help="where heldout.json/.md/.png go (default: the first run's directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        if args.offset < 0 or args.count < 1:
            raise ValueError(f"--offset must be >= 0 and --count >= 1 (got {args.offset}, {args.count})")
        runs = [read_run(p) for p in args.runs]
        if len({r.path.name for r in runs}) < len(runs):
            raise ValueError("two runs share a directory name: the report names runs by it")
        check_runs(runs, args.offset)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import spd_jax

    tc = runs[0].tc
    model = spd_jax.load_model(tc.model)
    seqs = heldout_set(model, tc, args.offset, args.count, args.batch)
    rows = [row for run in runs for row in score_run(model, run, seqs)]
    heldout = dict(offset=args.offset, count=args.count, sources=list(tc.sources), max_len=tc.max_len,
                   sequences=len(seqs), positions=rows[0]["positions"])
    print(report(rows, runs, heldout, Path(args.out) if args.out else runs[0].path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
