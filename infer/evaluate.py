"""python -m infer.evaluate: acceptance (alpha, S0) and measured speed of every decoding method on
benchmark prompts, side by side in one run.

    python -m infer.evaluate --bench mt_bench,gsm8k,humaneval[,PATH.jsonl] --methods ar,pipeline,spd
                             --n 2,4,8 --temperature 0,1 --limit 80 --max-new-tokens 128 --out DIR

Conventions follow the SPD reference code so figures compare with the paper's: 80 prompts per
benchmark by default, first turn only, the chat template, HumanEval prompts prefixed "Complete the
code I provided.", T=1 meaning temperature 1 with top-k 50 and top-p 0.95, and alpha / S0 pooled over
prompts as sum(tokens) / sum(cycles). Any JSONL with a `prompt`, `text`, `question` or `turns` field
(or `prompt_ids`, token ids used as they are) is a benchmark.

DIR/results.jsonl gets one row per (benchmark, prompt, method, n, T) as it finishes; a rerun skips the
rows already there. DIR/results.md holds the pooled tables and DIR/s0_vs_n.png, DIR/speed_vs_n.png the
plots. Each row says what its timing includes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

# name -> (file under the data folder, prefix of the prompt)
BENCHMARKS = {
    "mt_bench": ("mt_bench/question.jsonl", ""),
    "gsm8k": ("gsm8k/test.jsonl", ""),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "Complete the code I provided.\n"),
}
SAMPLING = {0.0: dict(temperature=0.0), 1.0: dict(temperature=1.0, top_k=50, top_p=0.95)}


def read_benchmark(name: str, limit: int | None = None) -> list[dict]:
    """A benchmark's first-turn prompts: [{"text": str} or {"ids": [int]}], at most `limit`."""
    from infer.generate import PROMPT_FIELDS, prompt_field
    from train.data import data_path

    if name in BENCHMARKS:
        rel, prefix = BENCHMARKS[name]
        path = data_path(rel)
    else:
        path, prefix = Path(name), ""
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {name!r} is neither a known one ({', '.join(BENCHMARKS)}) nor a "
                                    "JSONL file")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "prompt_ids" in obj:
                out.append({"ids": [int(t) for t in obj["prompt_ids"]]})
            elif (text := prompt_field(obj)) is not None:
                out.append({"text": prefix + text})
            else:
                raise ValueError(f"{path}:{n} has none of the fields {', '.join(PROMPT_FIELDS)}, prompt_ids")
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"benchmark {name} ({path}) holds no prompts")
    return out


def row_key(r: dict) -> tuple:
    """What makes a row: a rerun into the same directory with another model, PSM, length or seed
    computes new rows instead of reusing these."""
    return (r["bench"], r["prompt_index"], r["method"], r["n"], r["temperature"], r["model"], r["spec"],
            r["max_new_tokens"], r["seed"])


def pooled(rows: list[dict]) -> list[dict]:
    """Per (bench, method, n, T) and over all benchmarks ("all"): sum(tokens) / sum(cycles) and
    sum(tokens) / sum(wall), with each one's tokens/s over `ar`'s at the same bench and T."""
    groups = defaultdict(list)
    for r in rows:
        for bench in (r["bench"], "all"):
            groups[(bench, r["method"], r["n"], r["temperature"])].append(r)
    table = []
    for (bench, method, n, temp), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        tok = sum(r["tokens"] for r in rs)
        cyc = sum(r["cycles"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        alpha = tok / cyc if cyc else float("nan")
        table.append(dict(bench=bench, method=method, n=n, temperature=temp, prompts=len(rs), tokens=tok,
                          cycles=cyc, alpha=alpha, S0=alpha * rs[0]["depth_ratio"], tokens_per_s=tok / wall,
                          timing_includes=rs[0]["timing_includes"]))
    ar = {(t["bench"], t["temperature"]): t["tokens_per_s"] for t in table if t["method"] == "ar"}
    for t in table:
        base = ar.get((t["bench"], t["temperature"]))
        t["speed_vs_ar"] = t["tokens_per_s"] / base if base else None
    return table


def results_markdown(table: list[dict], setup: dict) -> str:
    lines = ["# Evaluation results", "",
             "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "alpha = tokens committed per cycle (SPD, pipeline) or per verification round, pooled as "
             "sum(tokens) / sum(cycles); S0 = alpha * L / (layers of the slowest stage), the speedup an "
             "ideal pipeline would turn it into. tok/s and the ratio to `ar` are measured in this run on "
             "this backend; on a CPU host the n stage devices share its cores, so the ratio is not a "
             "projection for real devices.", "",
             "| bench | method | n | T | prompts | tokens | alpha | S0 | tok/s | vs ar |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        ratio = f"{t['speed_vs_ar']:.2f}x" if t["speed_vs_ar"] else "-"
        lines.append(f"| {t['bench']} | {t['method']} | {t['n']} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['S0']:.2f} | {t['tokens_per_s']:.1f} | {ratio} |")
    lines += ["", "What each timing includes:", ""]
    for method in sorted({t["method"] for t in table}):
        lines.append(f"- `{method}`: " + next(t["timing_includes"] for t in table if t["method"] == method))
    return "\n".join(lines) + "\n"


def plot(table: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, field, title in (("s0_vs_n.png", "S0", "S0 (pooled) vs pipeline depth n"),
                               ("speed_vs_n.png", "speed_vs_ar", "measured tokens/s over ar vs n")):
        fig, ax = plt.subplots(figsize=(6, 4))
        series = defaultdict(list)
        for t in table:
            if t["method"] != "ar" and t[field] is not None and (field != "S0" or t["method"] == "spd"):
                series[(t["bench"], t["method"], t["temperature"])].append((t["n"], t[field]))
        for (bench, method, temp), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{method} {bench} T={temp:g}")
        ax.set(title=title, xlabel="n (stages)", ylabel=field)
        if series:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def evaluate(model, benches: dict[str, list[dict]], methods, ns, temperatures, max_new_tokens: int, out: Path,
             spec=None, seed: int = 0, progress: bool = True, write: bool = True) -> list[dict]:
    """Run every (bench, prompt, method, n, T) not yet in out/results.jsonl, appending each row as it
    finishes (write=False: compute the same rows, write nothing: the other processes of a job). -> all rows."""
    import contextlib

    import spd_jax
    from tqdm import tqdm

    path = out / "results.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    done = {row_key(r) for r in rows}
    jobs = [(b, i, p, m, n, float(t)) for b, ps in benches.items() for i, p in enumerate(ps)
            for t in temperatures for m in methods for n in (ns if m != "ar" else [1])]
    same = dict(model=model.path.name, spec="default" if spec is None else str(spec), max_new_tokens=max_new_tokens,
                seed=seed)
    todo = [j for j in jobs if row_key(dict(bench=j[0], prompt_index=j[1], method=j[3], n=j[4], temperature=j[5],
                                            **same)) not in done]
    rows = [r for r in rows if all(r.get(k) == v for k, v in same.items())]  # only this setup's rows
    L = model.config.num_layers
    if write:
        out.mkdir(parents=True, exist_ok=True)
    with (path.open("a") if write else contextlib.nullcontext()) as f:
        for bench, i, p, method, n, temp in tqdm(todo, desc="evaluate", unit="run", disable=not progress):
            ids = p["ids"] if "ids" in p else model.encode(p["text"])
            res = spd_jax.generate(model, ids, max_new_tokens, seed=seed, method=method, n=max(n, 1), spec=spec,
                                   **SAMPLING[temp])
            s = res.stats
            cycles = s.get("cycles", s["tokens"])  # ar: one target step per token
            row = dict(bench=bench, prompt_index=i, method=method, n=n, temperature=temp, **same,
                       prompt_tokens=s["prompt_tokens"], tokens=s["tokens"], cycles=cycles,
                       alpha=s["tokens"] / cycles if cycles else float("nan"),
                       depth_ratio=(L / max(s["stage_layers"])) if "stage_layers" in s else 1.0,
                       accepted=s.get("accepted"), rejected=s.get("rejected"), wall_s=s["wall_s"],
                       tokens_per_s=s["tokens_per_s"], compile_s=s["compile_s"], compile_from=s["compile_from"], psm=s.get("psm"),
                       token_ids=res.token_ids, timing_includes=s["timing_includes"], backend=s["backend"])
            row["S0"] = row["alpha"] * row["depth_ratio"]
            if f is not None:
                f.write(json.dumps(row) + "\n")
                f.flush()
            rows.append(row)
    return rows


def spd_jax_methods() -> tuple[str, ...]:
    from spd_jax.api import METHODS  # imports JAX: only after the CPU devices are requested

    return METHODS


def _csv(kind):
    return lambda v: [kind(x) for x in v.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bench", type=_csv(str), default=list(BENCHMARKS),
                    help="comma-separated: mt_bench, gsm8k, humaneval, or JSONL paths")
    ap.add_argument("--methods", type=_csv(str), default=["ar", "pipeline", "spd"])
    ap.add_argument("--n", type=_csv(int), default=[8], help="pipeline depths, e.g. 2,4,8")
    ap.add_argument("--temperature", type=_csv(float), default=[0.0], help="0 (greedy) and/or 1")
    ap.add_argument("--limit", type=int, default=80, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--spec", default=None, help="PSM checkpoint (default: the one shipped for the model and n)")
    ap.add_argument("--random-psm", action="store_true", help="an untrained PSM (for testing the harness)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/eval")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    from spd_jax import distributed

    distributed.add_arguments(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    for t in args.temperature:
        if t not in SAMPLING:
            ap.error(f"--temperature takes 0 and/or 1 (the reference's settings), got {t}")
    unknown = sorted(set(args.methods) - set(spd_jax_methods()))
    if unknown:
        ap.error(f"unknown methods {unknown}: available {', '.join(spd_jax_methods())}")
    if distributed.launching(args):
        return distributed.launch(args.processes, "infer.evaluate", distributed.worker_argv(argv), args.local_devices)
    try:
        # every process of a multi-process job runs every row (each method is SPMD over the job's devices;
        # `ar` runs in each process on its own device); process 0 alone writes and prints
        cluster = distributed.setup(args, max(args.n))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    leader = cluster is None or distributed.is_leader()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import spd_jax

    if not args.no_compile_cache:
        spd_jax.enable_persistent_cache()
    try:
        model = spd_jax.load_model(args.model)
        benches = {b: read_benchmark(b, args.limit) for b in args.bench}
        out = Path(args.out)
        spec = "random" if args.random_psm else args.spec
        rows = evaluate(model, benches, args.methods, args.n, args.temperature, args.max_new_tokens, out, spec,
                        args.seed, progress=leader, write=leader)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not leader:
        return 0
    table = pooled(rows)
    setup = dict(model=model.path.name, max_new_tokens=args.max_new_tokens, limit=args.limit,
                 backend=rows[0]["backend"] if rows else "?")
    (out / "results.md").write_text(results_markdown(table, setup))
    plot(table, out)
    print(results_markdown(table, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
