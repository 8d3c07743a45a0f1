"""python -m infer.evaluate: acceptance (alpha, S0) and measured speed of every decoding method on
benchmark prompts, side by side in one run.

    python -m infer.evaluate --bench mt_bench,gsm8k,humaneval[,PATH.jsonl] --methods ar,pipeline,tp,eagle3,spd,ppsd
                             --n 2,4,8 --k 3,7 --temperature 0,1 --limit 80 --max-new-tokens 128 --out DIR

Conventions follow the SPD reference code so figures compare with the paper's: 80 prompts per
benchmark by default, first turn only, the chat template, HumanEval prompts prefixed "Complete the
code I provided.", T=1 meaning temperature 1 with top-k 50 and top-p 0.95, and alpha / S0 pooled over
prompts as sum(tokens) / sum(cycles). Any JSONL with a `prompt`, `text`, `question` or `turns` field
(or `prompt_ids`, token ids used as they are) is a benchmark.

A method may carry its own depths, `spd@8` (repeat for more: `spd@4,spd@8`), e.g. `spd` only where a
PSM is trained while `pipeline` and `tp` run at every --n: every row then still comes from one run.
Methods take turns in blocks of --block prompts (default 8): close enough in time that a machine's
drift hits them alike, and each method's weights are placed once per block instead of once per row.

`eagle3` is chain speculative decoding on one device with the EAGLE-3-style drafter, one row per chain
length k (`n` = 1 device); its alpha and S0 are tokens per target pass, tokens / rounds (the reference's
theoretical speedup of a chain drafter). `ppsd` is the SPD engine with PPSD's early-exit head (--ppsd), its
alpha and S0 counted as spd's.

DIR/results.jsonl gets one row per (benchmark, prompt, method, n or k, T) as it finishes; a rerun skips
the rows already there, unless the drafter at their path has changed since: each spd and eagle3 row
records its drafter's content (`drafter_id`, `store.content_id` of the checkpoint; "random" for an
untrained one), and rows of another one are computed again and not pooled with the new ones;
DIR/commands.txt lists the commands that made them. DIR/results.md holds the pooled tables, with the
cost model's projected wall-clock speedup on the H200 and TPU v5e profiles
(`spd_jax.costs.cycle`) at each row's measured acceptance; DIR/s0_vs_n.png, DIR/speed_vs_n.png and
DIR/cycle_breakdown.png the plots. Each row says what its timing includes.

This module runs the rows; the tables, projections and plots are `spd_jax.reports`' (which the cards use
too), built from the rows alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import sys
from pathlib import Path

# Importing spd_jax (and JAX with it) starts no backend: the CPU devices and the cluster are still
# requested in main, before the first computation.
import spd_jax
from infer.generate import csv_of
from spd_jax import distributed
from spd_jax.datasets import BENCHMARKS, read_benchmark
from spd_jax.decode import pipelined
from spd_jax.decode.sampling import Sampling
from spd_jax.drafters import registry, store
from spd_jax.drafters.kind import DrafterRef, Form
from spd_jax.drafters.store import content_id
from spd_jax.methods import METHODS
from spd_jax.methods import get as method_named
from spd_jax.progress import progress_bar
from spd_jax.reports.plots import plot_results
from spd_jax.reports.results import pooled, read_rows, row_shape
from spd_jax.reports.tables import project, results_markdown

log = logging.getLogger(__name__)

SAMPLING = {0.0: dict(temperature=0.0), 1.0: dict(temperature=1.0, top_k=50, top_p=0.95)}


def row_key(r: dict) -> tuple:
    """What makes a row: a rerun into the same directory with another model, PSM, drafter, chain length,
    length or seed computes new rows instead of reusing these (k and drafter: eagle3 rows only). The
    drafter counts by its content (drafter_id), not only by the path it was given: after another PSM is
    written to the same path, that path's rows are computed again. A row from before drafter ids were
    recorded has none (None, as rows without a drafter: ar, pipeline, tp), so its spd or eagle3 row is
    computed again too; its ar, pipeline and tp rows still count."""
    return (r["bench"], r["prompt_index"], r["method"], r["n"], r.get("k"), r["temperature"], r["model"], r["spec"],
            r.get("drafter"), r.get("drafter_id"), r["max_new_tokens"], r["seed"])


def drafter_ref(method: str, n: int, spec=None, drafter=None, ppsd=None):
    """The drafter a method's rows at depth n run, as given on the command line: spd's PSM (spec), eagle3's
    drafter, ppsd's head (ppsd: one, or a list of heads, each trained for one n: the one for n, else None);
    None for a method without a network drafter (ar, pipeline, tp) or the shipped one."""
    kind = method_named(method).drafter_kind
    given = {registry.PSM.name: spec, registry.EAGLE3.name: drafter, registry.PPSD.name: ppsd}
    ref = None if kind is None else given[kind.name]
    if not isinstance(ref, (list, tuple)):
        return ref
    at_n = [r for r in ref if DrafterRef.of(r).form is Form.RANDOM or store.read_spec(kind, r).n == n]
    if len(at_n) > 1:
        raise ValueError(f"{kind.label} drafters {at_n} were all given for n={n}: give one per n")
    return at_n[0] if at_n else None


def drafter_id(model, method: str, n: int, spec=None, drafter=None, ppsd=None) -> str | None:
    """What identifies the drafter a row of (method, n) runs, known before running it: None for the
    methods without one (ar, pipeline, tp), "random" for an untrained one (seed 0: always the same), else
    the content of its checkpoint (`store.content_id`), picked as `generate` picks it (the method's
    `drafter_source`: spd's spec, or the PSM shipped for this model and n; eagle3's drafter, or the one
    shipped; ppsd's head, or the one shipped for this model and n)."""
    m = method_named(method)
    ref = drafter_ref(method, n, spec, drafter, ppsd)
    source = m.taking(n=n, spec=ref, drafter_spec=ref).drafter_source(model)
    if source is None:
        return None
    src = source.found  # a checkpoint path, the given reference, or None for a random one
    if src is None:
        return "random"
    return content_id(src) if isinstance(src, (str, Path)) else "given"


def job_order(benches: dict[str, list[dict]], temperatures, configs: list[tuple], block: int) -> list[tuple]:
    """Every (bench, prompt index, prompt, method, n, k, T), for configs [(method, n, k)], in run order:
    per benchmark, blocks of `block` prompts; within a block each T and config runs its prompts in turn.
    Methods stay side by side (a block spans minutes, so a machine's drift hits them alike) while each
    config's weights are placed and its executables loaded once per block, not once per prompt: the
    runtime keeps one placement per kind at a time, so a strictly prompt-by-prompt order (block = 1)
    re-places the weights on nearly every row."""
    if block < 1:
        raise ValueError(f"block must be at least 1 prompt, got {block}")
    return [(b, i, ps[i], m, n, k, float(t)) for b, ps in benches.items() for lo in range(0, len(ps), block)
            for t in temperatures for m, n, k in configs for i in range(lo, min(lo + block, len(ps)))]


def evaluate(model, benches: dict[str, list[dict]], methods, ns, temperatures, max_new_tokens: int, out: Path,
             spec=None, seed: int = 0, progress: bool = True, write: bool = True, ks=(3,),
             drafter=None, method_ns: dict[str, list[int]] | None = None, block: int = 8,
             command: list[str] | None = None, ppsd=None) -> list[dict]:
    """Run every (bench, prompt, method, n, T) not yet in out/results.jsonl, appending each row as it
    finishes (write=False: compute the same rows, write nothing: the other processes of a job); a method
    in method_ns runs at its own depths instead of ns (`parse_methods`); eagle3
    once per chain length k in ks (n = 1), with the EAGLE-3 drafter `drafter` (None: the shipped one,
    else random; "random"; a checkpoint directory); spd with the PSM `spec`, ppsd with the head `ppsd` (None:
    the one shipped for the model and n; "random"; a checkpoint directory; a list of them, each used at the n
    it was trained for); rows run in blocks of `block` prompts (`job_order`).
    `command` (the CLI's arguments) goes to out/commands.txt once every pipeline depth and drafter has been
    checked, before any row runs: a killed run's rows have their command, a command refused for its depths
    or drafters leaves no line.
    -> all rows of this setup."""
    path = out / "results.jsonl"
    rows = read_rows(path) if path.is_file() else []
    done = {row_key(r) for r in rows}
    known: dict[tuple, str | None] = {}  # (method, n) -> drafter_id: each checkpoint read once

    def id_of(method, n):
        if (method, n) not in known:
            known[(method, n)] = drafter_id(model, method, max(n, 1), spec, drafter, ppsd)
        return known[(method, n)]

    chains = [(1, int(k)) for k in ks]  # a chain method (eagle3): (n = 1 device, k)
    own = method_ns or {}  # a method's own depths (`spd@8`); the others run at every n of ns
    configs = [(m, n, k) for m in methods
               for n, k in (chains if row_shape(m).chain else
                            [(n, None) for n in ([1] if row_shape(m).one_device else own.get(m, ns))])]
    jobs = job_order(benches, temperatures, configs, block)
    same = dict(model=model.path.name, spec="default" if spec is None else str(spec), max_new_tokens=max_new_tokens,
                seed=seed)
    dlabel = "default" if drafter is None else str(drafter)

    def eagle3_fields(method):  # what only eagle3 rows carry (other rows keep their older shape)
        return dict(drafter=dlabel) if row_shape(method).chain else {}

    todo = [j for j in jobs if row_key(dict(bench=j[0], prompt_index=j[1], method=j[3], n=j[4], k=j[5],
                                            temperature=j[6], **same, **eagle3_fields(j[3]),
                                            drafter_id=id_of(j[3], j[4]))) not in done]
    # only this setup's rows (and its drafter's eagle3 rows), made with the drafters there are now: a row of
    # an older drafter at the same path, or of an unrecorded one, is not pooled with this run's
    rows = [r for r in rows if all(r.get(k) == v for k, v in same.items())
            and (not row_shape(r["method"]).chain or r.get("drafter") == dlabel)]
    stale = [r for r in rows if r.get("drafter_id") != id_of(r["method"], r["n"])]
    if stale:
        log.warning("%d rows of %s were made with another drafter than the one at their path now (or before drafter "
                    "ids were recorded): left out of this run's rows and tables (they stay in the file)", len(stale),
                    path)
        rows = [r for r in rows if r.get("drafter_id") == id_of(r["method"], r["n"])]
    L = model.config.num_layers
    for m, n, _ in configs:  # a pipeline depth the model cannot split into fails here, not at its first row
        if row_shape(m).staged:
            pipelined.plan_for(model, n)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        if command is not None:
            record_command(out, command)
    with (path.open("a") if write else contextlib.nullcontext()) as f:
        for bench, i, p, method, n, k, temp in progress_bar(todo, desc="evaluate", unit="run", disable=not progress):
            ids = p["ids"] if "ids" in p else model.encode(p["text"])
            shape, ref = row_shape(method), drafter_ref(method, max(n, 1), spec, drafter, ppsd)
            # each method reads its own drafter option: spd `spec`, eagle3 and ppsd `drafter_spec`
            res = spd_jax.generate(model, ids, max_new_tokens, sampling=Sampling(**SAMPLING[temp], seed=seed),
                                   method=method_named(method).taking(n=max(n, 1), spec=spec, drafter_spec=ref,
                                                                      **(dict(k=k) if shape.chain else {})))
            s = res.stats
            # target passes after prefill: SPD / pipeline cycles, eagle3 verification rounds, one per ar token
            cycles = s["rounds"] if shape.chain else s.get("cycles", s["tokens"])
            row = dict(bench=bench, prompt_index=i, method=method, n=n, temperature=temp, **same,
                       **(dict(k=k, drafter=dlabel, drafter_spec=s["drafter_spec"]) if shape.chain else {}),
                       drafter_id=id_of(method, n),
                       prompt_tokens=s["prompt_tokens"], tokens=s["tokens"], cycles=cycles,
                       alpha=s["tokens"] / cycles if cycles else float("nan"),
                       depth_ratio=(L / max(s["stage_layers"])) if "stage_layers" in s else 1.0,
                       accepted=s.get("accepted"), rejected=s.get("rejected"), wall_s=s["wall_s"],
                       tokens_per_s=s["tokens_per_s"], compile_s=s["compile_s"], compile_from=s["compile_from"], psm=s.get("psm"),
                       stage_layers=s.get("stage_layers"), psm_device=s.get("psm_device"), prefill_s=s.get("prefill_s"),
                       token_ids=res.token_ids, timing_includes=s["timing_includes"], backend=s["backend"])
            label_key = method_named(method).label_key  # the drafter's label in the stats (a PPSD head's: "ppsd")
            if label_key and label_key not in row:
                row[label_key] = s.get(label_key)
            row["S0"] = row["alpha"] * row["depth_ratio"]
            if f is not None:
                f.write(json.dumps(row) + "\n")
                f.flush()
            rows.append(row)
    return rows


def record_command(out: Path, argv: list[str]) -> None:
    """Append a command that writes (or resumes) OUT's rows to OUT/commands.txt, once per distinct
    command, so a card or a reader can tell how every row was made (`train.card` prints it)."""
    path = out / "commands.txt"
    cmd = "python -m infer.evaluate " + shlex.join(argv)
    seen = path.read_text().splitlines() if path.is_file() else []
    if cmd not in seen:
        path.write_text("".join(f"{c}\n" for c in [*seen, cmd]))


def parse_methods(items: list[str]) -> tuple[list[str], dict[str, list[int]]]:
    """--methods items, each `name` or `name@n` -> (method names in order, {name: its own depths})."""
    names, own = [], {}
    for item in items:
        name, _, depth = item.partition("@")
        if name not in names:
            names.append(name)
        if depth:
            if not depth.isdigit() or int(depth) < 1:
                raise ValueError(f"--methods {item!r}: the depth after @ must be a positive integer (e.g. spd@8)")
            if row_shape(name).one_device:
                raise ValueError(f"--methods {item!r}: {name} runs on one device; depths are for pipeline, tp, spd")
            own.setdefault(name, []).append(int(depth))
    return names, own


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bench", type=csv_of(str, "--bench", "gsm8k,my.jsonl"), default=list(BENCHMARKS),
                    help="comma-separated: mt_bench, gsm8k, humaneval, or JSONL paths")
    ap.add_argument("--methods", type=csv_of(str, "--methods", "ar,spd@8"), default=["ar", "pipeline", "spd"],
                    help="comma-separated: ar, tp, pipeline, spd, ppsd, eagle3; name@n runs that method at depth n "
                         "only (repeat for more), the others at every --n")
    ap.add_argument("--n", type=csv_of(int, "--n", "2,4,8"), default=[8], help="pipeline depths, e.g. 2,4,8")
    ap.add_argument("--k", type=csv_of(int, "--k", "3,7"), default=[3, 7],
                    help="eagle3 chain lengths (drafts per round), e.g. 3,7")
    ap.add_argument("--drafter", default=None, help="EAGLE-3 drafter checkpoint for eagle3, or 'random' (default: "
                                                    "the one shipped for the model, else a random one)")
    ap.add_argument("--temperature", type=csv_of(float, "--temperature", "0,1"), default=[0.0],
                    help="0 (greedy) and/or 1")
    ap.add_argument("--limit", type=int, default=80, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--spec", default=None, help="PSM checkpoint (default: the one shipped for the model and n)")
    ap.add_argument("--random-psm", action="store_true", help="an untrained PSM (for testing the harness)")
    ap.add_argument("--ppsd", type=csv_of(str, "--ppsd", "runs/p4/ppsd,runs/p8/ppsd"), default=None,
                    help="PPSD heads for the ppsd rows, comma-separated, each used at the n it was trained for, or "
                         "'random' (default: the one shipped for the model and n, else a random one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=8,
                    help="prompts per block: each method runs a block's prompts in turn, then the next method "
                         "(1: strictly prompt by prompt; larger blocks place each method's weights less often)")
    ap.add_argument("--out", default="runs/eval")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    distributed.add_arguments(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    for t in args.temperature:
        if t not in SAMPLING:
            ap.error(f"--temperature takes 0 and/or 1 (the reference's settings), got {t}")
    if args.block < 1:
        ap.error(f"--block takes at least 1 prompt, got {args.block}")
    if args.limit < 1:
        ap.error(f"--limit takes at least 1 prompt per benchmark, got {args.limit}")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens takes at least 1, got {args.max_new_tokens}")
    if min(args.k) < 1:
        ap.error(f"--k takes chain lengths of at least 1 draft, got {args.k}")
    try:
        args.methods, method_ns = parse_methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}: available {', '.join(METHODS)}")
    if distributed.launching(args):
        return distributed.launch(args.processes, "infer.evaluate", distributed.worker_argv(argv), args.local_devices)
    try:
        # every process of a multi-process job runs every row (each method is SPMD over the job's devices;
        # `ar` runs in each process on its own device); process 0 alone writes and prints
        cluster = distributed.setup(args, max([*args.n, *(n for ns in method_ns.values() for n in ns)]))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    leader = cluster is None or distributed.is_leader()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    if not args.no_compile_cache:
        spd_jax.enable_persistent_cache()
    try:
        benches = {b: read_benchmark(b, args.limit) for b in args.bench}  # a bad --bench fails before the load
        model = spd_jax.load_model(args.model)
        out = Path(args.out)
        spec = "random" if args.random_psm else args.spec
        rows = evaluate(model, benches, args.methods, args.n, args.temperature, args.max_new_tokens, out, spec,
                        args.seed, progress=leader, write=leader, ks=args.k, drafter=args.drafter,
                        method_ns=method_ns, block=args.block, command=argv, ppsd=args.ppsd)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not leader:
        return 0
    table = pooled(rows)
    project(table, model.config)
    setup = dict(model=model.path.name, max_new_tokens=args.max_new_tokens, limit=args.limit,
                 backend=rows[0]["backend"] if rows else "?")
    (out / "results.md").write_text(results_markdown(table, setup))
    plot_results(table, out)
    print(results_markdown(table, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
