"""python -m infer.replay: a PSM's (or PPSD head's) exact greedy alpha and S0 on benchmark prompts without
running the engine, and its acceptance by pipeline fill.

    python -m infer.replay --from runs/eval [--psm DIR ...] [--ppsd DIR ...] [--n 8] [--model NAME] [--out DIR]

Greedy SPD commits the target's own greedy continuation, and the drafts it verifies are the drafter's
teacher-forced drafts on it at each (newest token, fill) (`spd_jax.decode.schedule`; a PPSD head's are the
same at every fill). So one teacher-forced pass per fill over the continuations `ar` produced in an
`infer.evaluate` run (its rows at T = 0, with their token ids) gives, for each drafter given (its kind's
`teacher_drafts`), what the engine would count: tokens, cycles, accepted and rejected drafts per prompt,
pooled alpha and S0 as `infer.evaluate` pools them, in far less time than the cycle-by-cycle engine takes on
a CPU host. Where the run also holds rows of the drafter's method (`spd` for a PSM, `ppsd` for a PPSD head)
with the same drafter (its content, the rows' `drafter_id`, or "random" for an untrained one asked for by
name; by path for rows made before ids were recorded) and n, each prompt's replayed counts are checked
against them (equal up to the float near-ties of two different computations of one draft).

It also reports S0 at every smaller budget of new tokens (powers of two from 8): the engine's run with
budget L commits the first L tokens of the same continuation (up to float near-ties between two compiled
lengths), so one long `ar` run shows how S0 moves with the generation's length. And, per fill k (tokens
in flight when the draft is made), the teacher-forced agreement of the drafts with the target over every
generated position, and which fills the engine verified: after each rejection the next verified draft
was made at fill 1, so at a low acceptance those dominate.
Writes DIR/replay.json, DIR/replay.md and DIR/replay.png (default DIR: the evaluate run's replay/).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import spd_jax
from spd_jax import methods
from spd_jax.datasets import read_benchmark
from spd_jax.decode import pipelined
from spd_jax.decode.schedule import replay_greedy
from spd_jax.drafters import registry
from spd_jax.drafters.kind import DrafterRef, Form
from spd_jax.progress import progress_bar
from spd_jax.reports.replay import REPEAT, plot_replay, replay_markdown
from spd_jax.reports.results import read_rows, rows_of_drafter

BUCKET = 128  # sequences are padded to a multiple of this (few compiled shapes)
ROWS = 32  # the generated positions scored per sequence are padded to a multiple of this
BATCH = 4  # sequences per teacher-forced pass: its [B, T, n, T] attention scores must fit in memory

log = logging.getLogger(__name__)


def read_continuations(eval_dir: Path, n: int) -> tuple[str, int, list[dict], list[dict]]:
    """An infer.evaluate run -> (model name, max_new_tokens, its `ar` rows at T = 0 with token ids, its rows
    of the drafted pipelines (spd, ppsd) at T = 0 and depth n)."""
    path = eval_dir / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --from takes an infer.evaluate --out directory")
    rows = read_rows(path)
    ar = [r for r in rows if methods.get(r["method"]).baseline and r["temperature"] == 0
          and r.get("token_ids") is not None]
    if not ar:
        raise ValueError(f"{path} holds no greedy `ar` rows with token ids: run infer.evaluate with --methods ar "
                         "(and --temperature 0) into it first")
    setups = {(r["model"], r["max_new_tokens"]) for r in ar}
    if len(setups) > 1:
        raise ValueError(f"{path} mixes models or lengths {sorted(setups)}: replay one setup per directory")
    (model, max_new), = setups
    staged = {m.name for m in methods.METHODS.values() if m.drafter_kind is not None and m.drafter_kind.staged}
    drafted = [r for r in rows if r["method"] in staged and r["temperature"] == 0 and r["n"] == n
               and (r["model"], r["max_new_tokens"]) == (model, max_new)]
    return model, max_new, ar, drafted


def teacher_forced(model, kind, spec, variables, seqs: list[list[int]], starts: list[int],
                   show_progress: bool = True) -> list[np.ndarray]:
    """Each sequence [S] -> right [S, n] bool: the draft for t + 1 made at fill k equals seq[t + 1], for
    t >= its start (the first generated token's position, the prompt's length: the engine's first draft
    is made with that token newest; earlier rows stay False)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[np.ndarray | None] = [None] * len(seqs)
    bar = progress_bar(total=len(seqs), desc="teacher-forced drafts", unit="prompt", disable=not show_progress)
    for a in range(0, len(order), BATCH):
        idx = order[a:a + BATCH]
        T = -(-max(len(seqs[i]) for i in idx) // BUCKET) * BUCKET
        R = -(-max(len(seqs[i]) - starts[i] for i in idx) // ROWS) * ROWS
        tokens = np.zeros((BATCH, T), np.int32)  # a short last batch is padded with empty rows: one shape
        at = np.zeros((BATCH, R), np.int32)  # the positions whose drafts count: from each prompt's end
        for j, i in enumerate(idx):
            tokens[j, :len(seqs[i])] = seqs[i]
            at[j] = np.minimum(starts[i] + np.arange(R), T - 1)
        _, drafts = kind.teacher_drafts(model.config, spec, variables, model.params, jnp.asarray(tokens),
                                        jnp.asarray(at))
        drafts = np.asarray(drafts)
        for j, i in enumerate(idx):
            s = np.asarray(seqs[i])
            right = np.zeros((len(s), spec.n), bool)
            m = len(s) - 1 - starts[i]  # drafts for positions starts[i] + 1 .. len(s) - 1
            right[starts[i]:len(s) - 1] = drafts[j, :m] == s[starts[i] + 1:, None]
            out[i] = right
        bar.update(len(idx))
    bar.close()
    return out


def replay_drafter(model, kind, path: str | None, n: int, prompts: list[list[int]], ar: list[dict], max_new: int,
                   drafted_rows: list[dict], show_progress: bool = True) -> dict:
    """One drafter of a staged kind (the PSM, PPSD) over the continuations -> its rows (one per prompt),
    pooled figures and agreement by fill. path: its checkpoint, None (the shipped one) or "random" (asked
    for by name: seed 0, as the engine's random one)."""
    plan = pipelined.plan_for(model, n)
    method = methods.of_drafter(kind)
    random = DrafterRef.of(path).form is Form.RANDOM
    if not random and registry.source(kind, model, path, plan)[0] is None:  # asked before resolve announces one
        raise ValueError(f"no {kind.label} to replay: none ships for {model.path.name} at n={n}; pass "
                         f"--{kind.name} DIR (or --{kind.name} random)")
    spec, variables, label = registry.resolve(kind, model, path, plan, 2, method=method.name)
    seqs = [list(p) + list(r["token_ids"]) for p, r in zip(prompts, ar)]
    rights = teacher_forced(model, kind, spec, variables, seqs, [len(p) for p in prompts], show_progress)
    # the engine's rows of this drafter: by its content (drafter_id), not by the path, which may hold another
    # drafter now than when the rows were made; an untrained one's rows by their id "random"
    rows = [r for r in drafted_rows if r["method"] == method.name]
    mine, legacy = (([r for r in rows if r.get("drafter_id") == label], False) if random
                    else rows_of_drafter(rows, Path(label), method.label_key))
    if legacy:
        log.warning("the %s rows of %s record no drafter id (made before ids were recorded): checked against "
                    "them by path, so a drafter written there since would not match them", method.name, label)
    measured = {(r["bench"], r["prompt_index"]): r for r in mine}
    rows, agree, count = [], np.zeros(n), 0
    cut = {L: [] for L in budgets(max_new)}  # the same runs with a smaller budget of new tokens
    for p, r, seq, right in zip(prompts, ar, seqs, rights):
        for L in cut:
            cut[L].append(_row(r, replay_greedy(n, seq, len(p), right, L, model.eos_token_ids)))
        rep = replay_greedy(n, seq, len(p), right, max_new, model.eos_token_ids)
        if rep.tokens != r["tokens"]:
            raise ValueError(f"{r['bench']} prompt {r['prompt_index']}: the replay commits {rep.tokens} tokens, `ar` "
                             f"{r['tokens']}: the continuation does not belong to this model and length")
        row = _row(r, rep)
        m = measured.get((r["bench"], r["prompt_index"]))
        if m is not None:
            row["engine"] = dict(cycles=m["cycles"], accepted=m["accepted"], rejected=m["rejected"])
        rows.append(row)
        gen = right[len(p):len(seq) - 1]  # drafts the engine can make: newest token a generated one
        agree += gen.sum(0)
        count += len(gen)
    loops = [repeats(r["token_ids"]) for r in ar]
    full = pool(rows, model.config.num_layers, plan)
    pools = {L: pool(rs, model.config.num_layers, plan) for L, rs in cut.items()} | {max_new: full}
    by_length = []  # [{L, pooled: {bench: ...}}], L ascending
    for L, whole in pools.items():
        pooled = {b: {k: v[k] for k in ("tokens", "cycles", "alpha", "S0", "accepted", "rejected")}
                  for b, v in whole.items()}
        for b, v in pooled.items():
            mine = [x[:L] for x, r in zip(loops, ar) if b in ("all", r["bench"])]
            v["repeated"] = float(sum(x.sum() for x in mine) / max(sum(len(x) for x in mine), 1))
        by_length.append(dict(L=L, pooled=pooled))
    return dict(method=method.name, drafter=label, n=n, plan=list(plan.counts), rows=rows, pooled=full,
                agreement_by_fill=(agree / max(count, 1)).tolist(), positions=count, by_length=by_length)


def _row(r: dict, rep) -> dict:
    """An `ar` row and its replay -> the replayed row (the engine's counts for that prompt)."""
    return dict(bench=r["bench"], prompt_index=r["prompt_index"], tokens=rep.tokens, cycles=rep.cycles,
                accepted=rep.accepted, rejected=rep.rejected, verified_fill=rep.verified_fill.tolist(),
                accepted_fill=rep.accepted_fill.tolist())


def repeats(ids, k: int = REPEAT) -> np.ndarray:
    """ids [N] -> [N] bool: the token at i closes a k-gram that already occurred earlier in ids. Greedy
    continuations of a small model fall into loops as they grow, and a drafter predicts a loop easily, so
    the share of such tokens says how much of a long run is repetition."""
    seen, out = set(), np.zeros(len(ids), bool)
    for i in range(k - 1, len(ids)):
        gram = tuple(ids[i - k + 1:i + 1])
        out[i] = gram in seen
        seen.add(gram)
    return out


def budgets(max_new: int) -> list[int]:
    """The smaller budgets of new tokens a replay also reports (powers of two from 8 below max_new): the
    engine's run on a prompt with budget L commits the first L tokens of the same greedy continuation, so
    one continuation gives S0 at every shorter length, the same runs cut earlier."""
    return [2 ** i for i in range(3, max(max_new, 1).bit_length()) if 2 ** i < max_new]


def pool(rows: list[dict], num_layers: int, plan) -> dict:
    """Per benchmark and over all ("all"): alpha = sum(tokens) / sum(cycles), S0 = alpha L / max(stage
    layers), accepted and rejected drafts, verified drafts by fill, engine agreement where measured."""
    out = {}
    groups = defaultdict(list)
    for r in rows:
        groups[r["bench"]].append(r)
        groups["all"].append(r)
    for bench, rs in sorted(groups.items(), key=lambda g: (g[0] == "all", g[0])):  # "all" last
        tok, cyc = sum(r["tokens"] for r in rs), sum(r["cycles"] for r in rs)
        checked = [r for r in rs if "engine" in r]
        same = sum(all(r["engine"][k] == r[k] for k in ("cycles", "accepted", "rejected")) for r in checked)
        out[bench] = dict(prompts=len(rs), tokens=tok, cycles=cyc, alpha=tok / cyc,
                          S0=tok / cyc * num_layers / max(plan.counts),
                          accepted=sum(r["accepted"] for r in rs), rejected=sum(r["rejected"] for r in rs),
                          verified_fill=np.sum([r["verified_fill"] for r in rs], 0).tolist(),
                          accepted_fill=np.sum([r["accepted_fill"] for r in rs], 0).tolist(),
                          engine_checked=len(checked), engine_equal=same,
                          engine_S0=(tok / sum(r["engine"]["cycles"] for r in checked) * num_layers / max(plan.counts)
                                     if checked and len(checked) == len(rs) else None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="source", required=True, help="an infer.evaluate --out directory with ar rows at T=0")
    ap.add_argument("--psm", action="append", default=None,
                    help="PSM checkpoint directory, or 'random' (repeat to compare; default, without --ppsd: the one "
                         "shipped for the model and n)")
    ap.add_argument("--ppsd", action="append", default=None,
                    help="PPSD head checkpoint directory, or 'random' (repeat to compare)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--model", default=None, help="the model name or checkpoint path (default: the run's model)")
    ap.add_argument("--out", default=None, help="output directory (default: FROM/replay)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    source = Path(args.source)
    try:
        model_name, max_new, ar, drafted = read_continuations(source, args.n)
        benches = {}
        for b in sorted({r["bench"] for r in ar}):
            benches[b] = read_benchmark(b, 1 + max(r["prompt_index"] for r in ar if r["bench"] == b))
        model = spd_jax.load_model(args.model or model_name)
        prompts = []
        for r in ar:
            p = benches[r["bench"]][r["prompt_index"]]
            prompts.append(list(p["ids"]) if "ids" in p else list(model.encode(p["text"])))
            if len(prompts[-1]) != r["prompt_tokens"]:
                raise ValueError(f"{r['bench']} prompt {r['prompt_index']} encodes to {len(prompts[-1])} tokens, the run's "
                                 f"row says {r['prompt_tokens']}: the benchmark file or tokenizer changed since")
        asked = [(registry.PSM, p) for p in args.psm or ([] if args.ppsd else [None])]
        asked += [(registry.PPSD, p) for p in args.ppsd or []]
        results = [replay_drafter(model, kind, p, args.n, prompts, ar, max_new, drafted) for kind, p in asked]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else source / "replay"
    out.mkdir(parents=True, exist_ok=True)
    setup = {"model": model_name, "max_new_tokens": max_new, "prompts": len(ar), "from": str(source)}
    (out / "replay.json").write_text(json.dumps(dict(setup=setup, results=results), indent=1) + "\n")
    text = replay_markdown(results, setup)
    (out / "replay.md").write_text(text)
    plot_replay(results, out / "replay.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
