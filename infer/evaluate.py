"""python -m infer.evaluate: acceptance (alpha, S0) and measured speed of every decoding method on
benchmark prompts, side by side in one run.

    python -m infer.evaluate --bench mt_bench,gsm8k,humaneval[,PATH.jsonl] --methods ar,pipeline,tp,eagle3,spd
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
theoretical speedup of a chain drafter).

DIR/results.jsonl gets one row per (benchmark, prompt, method, n or k, T) as it finishes; a rerun skips
the rows already there, unless the drafter at their path has changed since: each spd and eagle3 row
records its drafter's content (`drafter_id`, `store.content_id` of the checkpoint; "random" for an
untrained one), and rows of another one are computed again and not pooled with the new ones;
DIR/commands.txt lists the commands that made them. DIR/results.md holds the pooled tables, with the
cost model's projected wall-clock speedup on the H200-like and TPU-like profiles
(`spd_jax.pipeline.costs`) at each row's measured acceptance; DIR/s0_vs_n.png, DIR/speed_vs_n.png and
DIR/cycle_breakdown.png the plots. Each row says what its timing includes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

log = logging.getLogger(__name__)

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
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not a JSON object: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n} is not a JSON object (a benchmark line holds one prompt's fields)")
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
    """What makes a row: a rerun into the same directory with another model, PSM, drafter, chain length,
    length or seed computes new rows instead of reusing these (k and drafter: eagle3 rows only). The
    drafter counts by its content (drafter_id), not only by the path it was given: after another PSM is
    written to the same path, that path's rows are computed again. A row from before drafter ids were
    recorded has none (None, as rows without a drafter: ar, pipeline, tp), so its spd or eagle3 row is
    computed again too; its ar, pipeline and tp rows still count."""
    return (r["bench"], r["prompt_index"], r["method"], r["n"], r.get("k"), r["temperature"], r["model"], r["spec"],
            r.get("drafter"), r.get("drafter_id"), r["max_new_tokens"], r["seed"])


def drafter_id(model, method: str, n: int, spec=None, drafter=None) -> str | None:
    """What identifies the drafter a row of (method, n) runs, known before running it: None for the
    methods without one (ar, pipeline, tp), "random" for an untrained one (seed 0: always the same), else
    the content of its checkpoint (`store.content_id`), picked as `generate` picks it (`psm_source`: spec,
    or the PSM shipped for this model and n; `eagle3_source`: drafter, or the one shipped)."""
    from spd_jax.drafters.store import content_id

    if method == "spd":
        from spd_jax.decode import pipelined

        src, _ = pipelined.psm_source(model, pipelined.plan_for(model, n), spec)
    elif method == "eagle3":
        from spd_jax.api import eagle3_source

        src = eagle3_source(model, drafter)
    else:
        return None
    if src is None:
        return "random"
    return content_id(src) if isinstance(src, (str, Path)) else "given"


SETUP = ("model", "max_new_tokens", "seed", "backend")  # what the rows of one evaluation share


def label_is_dir(label, directory: Path) -> bool:
    """Whether a row's drafter label (the checkpoint path `resolve_psm` / `resolve_eagle3` were given, or
    "random" / "given" / None) names `directory`."""
    if not isinstance(label, str) or label in ("random", "given"):
        return False
    return Path(label).resolve() == Path(directory).resolve()


def rows_of_drafter(rows: list[dict], directory: Path, label_key: str) -> tuple[list[dict], bool]:
    """The rows (of one method) made with the drafter now in `directory` -> (rows, legacy). A row records
    the path its drafter was given (label_key: "psm" for spd rows, "drafter_spec" for eagle3's) and what
    was there (drafter_id); the path alone does not say which drafter it held then (a PSM shipped over an
    older one keeps the path), so a row counts when its drafter_id is the directory's content now, at
    whatever path it was evaluated. Rows from before ids were recorded carry none: when no row of this
    path records one (an evaluation made before them) those rows are taken by their path and legacy is True
    (the caller warns: they may be an older drafter's); when some row of the path records another id, the
    rows without one are older still and left out. One row per (benchmark, prompt, method, n, k, T) and
    setup (SETUP): the same drafter evaluated under two paths (given by --spec, then shipped) counts once,
    the row under `directory` first, while its rows of two setups both stay (the card refuses them)."""
    from spd_jax.drafters.store import content_id

    want = content_id(directory)
    mine = sorted((r for r in rows if r.get("drafter_id") == want),
                  key=lambda r: not label_is_dir(r.get(label_key), directory))  # stable: this path's rows first
    seen, unique = set(), []
    for r in mine:
        key = (r["bench"], r["prompt_index"], r["method"], r["n"], r.get("k"), r["temperature"],
               *(r.get(k) for k in SETUP))
        if key not in seen:
            seen.add(key)
            unique.append(r)
    if unique:
        return unique, False
    at = [r for r in rows if label_is_dir(r.get(label_key), directory)]
    if any(r.get("drafter_id") is not None for r in at):
        return [], False
    return at, bool(at)


def method_label(t: dict) -> str:
    """A table row's method, with its chain length for eagle3 ("eagle3 k=3"), and marked where its drafter
    is untrained (no trained PSM for this n, or --random-psm / --drafter random: S0 then says nothing about
    a trained one)."""
    label = t["method"] if t.get("k") is None else f"{t['method']} k={t['k']}"
    untrained = (t["method"] == "spd" and t.get("psm") == "random") or (
        t["method"] == "eagle3" and t.get("drafter_spec") == "random")
    return label + (" (untrained drafter)" if untrained else "")


def pooled(rows: list[dict]) -> list[dict]:
    """Per (bench, method, n, k, T) and over all benchmarks ("all"): sum(tokens) / sum(cycles) and
    sum(tokens) / sum(wall), with each one's tokens/s over `ar`'s at the same bench and T. Also what the
    projections and the breakdown plot read: the measured prefill time where the method times it apart
    (ar, tp), the mean decode context (prompt + half the generated tokens), the stage plan and drafters."""
    groups = defaultdict(list)
    for r in rows:
        for bench in (r["bench"], "all"):
            groups[(bench, r["method"], r["n"], r.get("k"), r["temperature"])].append(r)
    table = []
    order = lambda kv: (kv[0][0] == "all", kv[0][:3], kv[0][3] or 0, kv[0][4:])  # noqa: E731  (k None first)
    for (bench, method, n, k, temp), rs in sorted(groups.items(), key=order):
        tok = sum(r["tokens"] for r in rs)
        cyc = sum(r["cycles"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        alpha = tok / cyc if cyc else float("nan")
        prefill = sum(r["prefill_s"] for r in rs) if all(r.get("prefill_s") is not None for r in rs) else None
        table.append(dict(bench=bench, method=method, n=n, k=k, temperature=temp, prompts=len(rs), tokens=tok,
                          cycles=cyc, alpha=alpha, S0=alpha * rs[0]["depth_ratio"], tokens_per_s=tok / wall,
                          wall_s=wall, prefill_s=prefill,
                          context=sum(r.get("prompt_tokens", 0) + r["tokens"] / 2 for r in rs) / len(rs),
                          stage_layers=rs[0].get("stage_layers"), psm=rs[0].get("psm"),
                          psm_device=rs[0].get("psm_device"),
                          drafter_spec=rs[0].get("drafter_spec"), timing_includes=rs[0]["timing_includes"]))
    ar = {(t["bench"], t["temperature"]): t["tokens_per_s"] for t in table if t["method"] == "ar"}
    for t in table:
        base = ar.get((t["bench"], t["temperature"]))
        t["speed_vs_ar"] = t["tokens_per_s"] / base if base else None
    return table


# ---------------------------------------------------------------- projections (the cost model)

PROFILES = ("H200", "TPU")  # the projection columns: costs.H200_NVLINK and costs.TPU_V5E_ICI


def project(table: list[dict], cfg) -> None:
    """Add each table row's projected wall-clock speedup over `ar` and its projected cycle by part on the
    H200-like and TPU-like profiles, in place: row["proj"][profile] = {speedup, parts_s}. spd at the row's
    measured alpha, stage plan and PSM device (`costs.predict`: busiest device + collectives); tp and
    pipeline from `costs.predict` at n; eagle3 from `costs.predict_eagle3` at its measured tokens per round;
    ar 1 (its parts: one step). The context is the rows' mean decode context; bf16, as the profiles assume."""
    from spd_jax.drafters import eagle3
    from spd_jax.drafters.psm import PSMConfig, read_spec
    from spd_jax.pipeline import costs
    from spd_jax.pipeline.partition import StagePlan

    hws = dict(zip(PROFILES, (costs.H200_NVLINK, costs.TPU_V5E_ICI)))
    for t in table:
        ctx = max(int(round(t["context"])), 1)
        t["proj"] = {}
        for name, hw in hws.items():
            if t["method"] == "ar":
                step_s = costs.ar_step_s(cfg, hw, ctx)
                t["proj"][name] = dict(speedup=1.0, parts_s=dict(step=step_s))
            elif t["method"] == "eagle3":
                label = t.get("drafter_spec")
                dv = eagle3.read_spec(label).draft_vocab if label not in (None, "random", "given") else 0
                p = costs.predict_eagle3(cfg, t["k"], hw, ctx, t["alpha"], dv)
                t["proj"][name] = dict(speedup=p["speedup"], parts_s=p["parts_s"])
            else:
                plan = (StagePlan(tuple(t["stage_layers"])) if t.get("stage_layers") else
                        costs.default_plan(cfg, t["n"]))
                label = t.get("psm")
                psm_cfg = (read_spec(label) if label not in (None, "random", "given") else
                           PSMConfig.for_target(cfg, plan.counts))
                where = dict(psm_device=t["psm_device"]) if t.get("psm_device") is not None else {}  # as it ran
                pred = costs.predict(cfg, t["n"], psm_cfg, hw, ctx, S0=t["S0"], plan=plan,
                                     alpha=t["alpha"] if t["method"] == "spd" else None, **where)
                tp_compute = (pred["ar_step_s"] - hw.launch_s) / t["n"] + hw.launch_s  # 1/n of ar's, one launch
                parts = {"tp": dict(compute=tp_compute, collectives=pred["tp_step_s"] - tp_compute),
                         "pipeline": dict(step=pred["pipeline_token_s"]),
                         "spd": dict(busiest_device=pred["spd_cycle_s"] - pred["spd_comm_s"],
                                     collectives=pred["spd_comm_s"])}[t["method"]]
                t["proj"][name] = dict(speedup=pred[f"speedup_{t['method']}"], parts_s=parts)


def results_markdown(table: list[dict], setup: dict) -> str:
    proj = any("proj" in t for t in table)
    lines = ["# Evaluation results", "",
             "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "alpha = tokens committed per cycle (SPD, pipeline) or per verification round (eagle3: tokens "
             "per target pass), pooled as sum(tokens) / sum(cycles); S0 = alpha * L / (layers of the slowest "
             "stage), the speedup an ideal pipeline would turn it into (eagle3, on n = 1 device: its tokens "
             "per target pass). tok/s and the ratio to `ar` are measured in this run on this backend; on a "
             "CPU host the n stage devices share its cores, so the ratio is not a projection for real devices."
             + (" proj. H200 / proj. TPU: the cost model's projected wall-clock speedup over `ar` "
                "(`spd_jax.pipeline.costs`, H200-NVLink-like and TPU-v5e-like profiles: published figures, not "
                "measurements; communication included; bf16) at the row's measured alpha and mean decode "
                "context; spd: busiest device + the cycle's collectives; eagle3: one chain round on one device "
                "= k drafter steps + one target pass over k + 1 positions + the drafter's pass over the verified "
                "rows; prefill excluded." if proj else ""), "",
             "| bench | method | n | T | prompts | tokens | alpha | S0 | tok/s | vs ar |"
             + (" proj. H200 | proj. TPU |" if proj else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if proj else "")]
    for t in table:
        ratio = f"{t['speed_vs_ar']:.2f}x" if t["speed_vs_ar"] else "-"
        cols = "".join(f" {t['proj'][p]['speedup']:.2f}x |" if "proj" in t else " - |" for p in PROFILES if proj)
        lines.append(f"| {t['bench']} | {method_label(t)} | {t['n']} | {t['temperature']:g} | {t['prompts']} | "
                     f"{t['tokens']} | {t['alpha']:.3f} | {t['S0']:.2f} | {t['tokens_per_s']:.1f} | {ratio} |" + cols)
    lines += ["", "What each timing includes:", ""]
    for method in sorted({t["method"] for t in table}):
        lines.append(f"- `{method}`: " + next(t["timing_includes"] for t in table if t["method"] == method))
    return "\n".join(lines) + "\n"


def _series_style(labels: list[str]) -> dict[str, str]:
    """One colour per method label, the same in every panel and plot."""
    return {label: f"C{i % 10}" for i, label in enumerate(sorted(set(labels)))}


_T_STYLE = {0.0: ("o", "-"), 1.0: ("s", "--")}  # marker, line: greedy solid, sampling dashed


def _lines(ax, table: list[dict], value, colors: dict[str, str]) -> None:
    """One line per (method label, T) over n, from the table rows given; value(t) -> y or None."""
    series = defaultdict(list)
    for t in table:
        y = value(t)
        if y is not None:
            series[(method_label(t), t["temperature"])].append((t["n"], y))
    for (label, temp), pts in sorted(series.items()):
        pts.sort()
        marker, line = _T_STYLE.get(temp, ("^", ":"))
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, linestyle=line, color=colors[label],
                label=f"{label}, T={temp:g}")
    ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")  # ar
    ax.set_xticks(sorted({t["n"] for t in table} | {1}))


def plot(table: list[dict], out: Path) -> None:
    """s0_vs_n.png: S0 against n, one panel per benchmark and over all (the drafting methods; ar = 1).
    speed_vs_n.png: speedup over ar against n, every method over all benchmarks: measured here, and
    the cost model's projections for the H200-like and TPU-like profiles. cycle_breakdown.png: see
    plot_breakdown. Colour = method, solid = T 0, dashed = T 1; eagle3 runs on one device (n = 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = _series_style([method_label(t) for t in table if t["method"] != "ar"])
    benches = sorted({t["bench"] for t in table} - {"all"}) + ["all"]
    drafted = [t for t in table if t["method"] in ("spd", "eagle3")]
    fig, axes = plt.subplots(1, len(benches), figsize=(3.4 * len(benches), 4), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, bench in zip(axes[0], benches):
        _lines(ax, [t for t in drafted if t["bench"] == bench], lambda t: t["S0"], colors)
        ax.set(title=bench if bench != "all" else "all benchmarks (pooled)", xlabel="n (devices)")
    axes[0][0].set_ylabel("S0 (pooled); ar = 1")
    _legend(fig, axes)
    fig.suptitle("S0 vs devices n")
    fig.savefig(out / "s0_vs_n.png", dpi=110)
    plt.close(fig)

    rows = [t for t in table if t["bench"] == "all" and t["method"] != "ar"]
    panels = [("measured here", lambda t: t["speed_vs_ar"])]
    if any("proj" in t for t in rows):
        panels += [(f"projected, {p}-like (cost model)", lambda t, p=p: t["proj"][p]["speedup"] if "proj" in t
                    else None) for p in PROFILES]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False, layout="constrained")
    for ax, (title, value) in zip(axes[0], panels):
        _lines(ax, rows, value, colors)
        ax.set(title=title, xlabel="n (devices)")
    axes[0][0].set_ylabel("speedup over ar")
    _legend(fig, axes)
    fig.suptitle("speedup over ar vs devices n (all benchmarks)")
    fig.savefig(out / "speed_vs_n.png", dpi=110)
    plt.close(fig)
    plot_breakdown(table, out / "cycle_breakdown.png")


def _legend(fig, axes) -> None:
    """One legend under the panels (a constrained-layout figure), with every series any panel drew."""
    entries = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=min(len(entries), 4),
                   fontsize=8, frameon=False)


def plot_breakdown(table: list[dict], png: Path) -> None:
    """Time per cycle, stacked, one bar per (method, n, k, T) over all benchmarks. Left, measured here:
    wall time / cycles (rounds for eagle3, tokens for ar and tp), split only where the method times its
    parts apart (ar, tp: prefill and the decode loop; the others time prefill and loop as one). Right,
    when the table is projected: the cost model's H200-like cycle by part (spd: busiest device and
    collectives; tp: compute and all-reduces; eagle3: drafter steps, target pass, drafter commit; ar and
    pipeline: one step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [t for t in table if t["bench"] == "all" and t["cycles"]]
    proj = any("proj" in t for t in rows)
    fig, axes = plt.subplots(1, 2 if proj else 1, figsize=(13 if proj else 7, 5), squeeze=False)
    labels = [f"{method_label(t)}, n={t['n']}, T={t['temperature']:g}" for t in rows]
    panels = [("measured here: wall time / cycles (not a projection)", "ms per cycle", 1e3,
               lambda t: ([("prefill (timed apart)", t["prefill_s"]), ("decode loop", t["wall_s"] - t["prefill_s"])]
                          if t["prefill_s"] is not None else [("prefill + loop (one timing)", t["wall_s"])]),
               lambda t: 1 / t["cycles"])]
    if proj:
        panels.append(("projected, H200-like (cost model, not measured)", "us per cycle", 1e6,
                       lambda t: list(t["proj"]["H200"]["parts_s"].items()), lambda t: 1.0))
    for ax, (title, unit, scale, parts, per) in zip(axes[0], panels):
        colors: dict[str, str] = {}
        for i, t in enumerate(rows):
            bottom = 0.0
            for name, sec in parts(t):
                h = sec * per(t) * scale
                first = name not in colors
                ax.bar(i, h, bottom=bottom, color=colors.setdefault(name, f"C{len(colors)}"),
                       label=name if first else None)
                bottom += h
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60, ha="right")
        ax.set(title=title, ylabel=unit)
        if colors:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


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
             command: list[str] | None = None) -> list[dict]:
    """Run every (bench, prompt, method, n, T) not yet in out/results.jsonl, appending each row as it
    finishes (write=False: compute the same rows, write nothing: the other processes of a job); a method
    in method_ns runs at its own depths instead of ns (`parse_methods`); eagle3
    once per chain length k in ks (n = 1), with the EAGLE-3 drafter `drafter` (None: the shipped one,
    else random; "random"; a checkpoint directory); rows run in blocks of `block` prompts (`job_order`).
    `command` (the CLI's arguments) goes to out/commands.txt once every pipeline depth and drafter has been
    checked, before any row runs: a killed run's rows have their command, a command refused for its depths
    or drafters leaves no line.
    -> all rows of this setup."""
    import contextlib

    import spd_jax
    from spd_jax.decode import pipelined
    from spd_jax.progress import progress_bar

    path = out / "results.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    done = {row_key(r) for r in rows}
    known: dict[tuple, str | None] = {}  # (method, n) -> drafter_id: each checkpoint read once

    def id_of(method, n):
        if (method, n) not in known:
            known[(method, n)] = drafter_id(model, method, max(n, 1), spec, drafter)
        return known[(method, n)]

    chains = [(1, int(k)) for k in ks]  # eagle3: (n = 1 device, k)
    own = method_ns or {}  # a method's own depths (`spd@8`); the others run at every n of ns
    configs = [(m, n, k) for m in methods
               for n, k in (chains if m == "eagle3" else [(n, None) for n in ([1] if m == "ar" else own.get(m, ns))])]
    jobs = job_order(benches, temperatures, configs, block)
    same = dict(model=model.path.name, spec="default" if spec is None else str(spec), max_new_tokens=max_new_tokens,
                seed=seed)
    dlabel = "default" if drafter is None else str(drafter)

    def eagle3_fields(method):  # what only eagle3 rows carry (other rows keep their older shape)
        return dict(drafter=dlabel) if method == "eagle3" else {}

    todo = [j for j in jobs if row_key(dict(bench=j[0], prompt_index=j[1], method=j[3], n=j[4], k=j[5],
                                            temperature=j[6], **same, **eagle3_fields(j[3]),
                                            drafter_id=id_of(j[3], j[4]))) not in done]
    # only this setup's rows (and its drafter's eagle3 rows), made with the drafters there are now: a row of
    # an older drafter at the same path, or of an unrecorded one, is not pooled with this run's
    rows = [r for r in rows if all(r.get(k) == v for k, v in same.items())
            and (r["method"] != "eagle3" or r.get("drafter") == dlabel)]
    stale = [r for r in rows if r.get("drafter_id") != id_of(r["method"], r["n"])]
    if stale:
        log.warning("%d rows of %s were made with another drafter than the one at their path now (or before drafter "
                    "ids were recorded): left out of this run's rows and tables (they stay in the file)", len(stale),
                    path)
        rows = [r for r in rows if r.get("drafter_id") == id_of(r["method"], r["n"])]
    L = model.config.num_layers
    for m, n, _ in configs:  # a pipeline depth the model cannot split into fails here, not at its first row
        if m in ("pipeline", "spd"):
            pipelined.plan_for(model, n)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        if command is not None:
            record_command(out, command)
    with (path.open("a") if write else contextlib.nullcontext()) as f:
        for bench, i, p, method, n, k, temp in progress_bar(todo, desc="evaluate", unit="run", disable=not progress):
            ids = p["ids"] if "ids" in p else model.encode(p["text"])
            chain = dict(k=k, drafter_spec=drafter) if method == "eagle3" else {}
            res = spd_jax.generate(model, ids, max_new_tokens, seed=seed, method=method, n=max(n, 1), spec=spec,
                                   **chain, **SAMPLING[temp])
            s = res.stats
            # target passes after prefill: SPD / pipeline cycles, eagle3 verification rounds, one per ar token
            cycles = s["rounds"] if method == "eagle3" else s.get("cycles", s["tokens"])
            row = dict(bench=bench, prompt_index=i, method=method, n=n, temperature=temp, **same,
                       **(dict(k=k, drafter=dlabel, drafter_spec=s["drafter_spec"]) if method == "eagle3" else {}),
                       drafter_id=id_of(method, n),
                       prompt_tokens=s["prompt_tokens"], tokens=s["tokens"], cycles=cycles,
                       alpha=s["tokens"] / cycles if cycles else float("nan"),
                       depth_ratio=(L / max(s["stage_layers"])) if "stage_layers" in s else 1.0,
                       accepted=s.get("accepted"), rejected=s.get("rejected"), wall_s=s["wall_s"],
                       tokens_per_s=s["tokens_per_s"], compile_s=s["compile_s"], compile_from=s["compile_from"], psm=s.get("psm"),
                       stage_layers=s.get("stage_layers"), psm_device=s.get("psm_device"), prefill_s=s.get("prefill_s"),
                       token_ids=res.token_ids, timing_includes=s["timing_includes"], backend=s["backend"])
            row["S0"] = row["alpha"] * row["depth_ratio"]
            if f is not None:
                f.write(json.dumps(row) + "\n")
                f.flush()
            rows.append(row)
    return rows


def record_command(out: Path, argv: list[str]) -> None:
    """Append a command that writes (or resumes) OUT's rows to OUT/commands.txt, once per distinct
    command, so a card or a reader can tell how every row was made (`train.card` prints it)."""
    import shlex

    path = out / "commands.txt"
    cmd = "python -m infer.evaluate " + shlex.join(argv)
    seen = path.read_text().splitlines() if path.is_file() else []
    if cmd not in seen:
        path.write_text("".join(f"{c}\n" for c in [*seen, cmd]))


def spd_jax_methods() -> tuple[str, ...]:
    from spd_jax.api import METHODS  # imports JAX: only after the CPU devices are requested

    return METHODS


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
            if name in ("ar", "eagle3"):
                raise ValueError(f"--methods {item!r}: {name} runs on one device; depths are for pipeline, tp, spd")
            own.setdefault(name, []).append(int(depth))
    return names, own


def main(argv=None) -> int:
    from infer.generate import csv_of

    ap = argparse.ArgumentParser(prog="python -m infer.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bench", type=csv_of(str, "--bench", "gsm8k,my.jsonl"), default=list(BENCHMARKS),
                    help="comma-separated: mt_bench, gsm8k, humaneval, or JSONL paths")
    ap.add_argument("--methods", type=csv_of(str, "--methods", "ar,spd@8"), default=["ar", "pipeline", "spd"],
                    help="comma-separated: ar, tp, pipeline, spd, eagle3; name@n runs that method at depth n only "
                         "(repeat for more), the others at every --n")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=8,
                    help="prompts per block: each method runs a block's prompts in turn, then the next method "
                         "(1: strictly prompt by prompt; larger blocks place each method's weights less often)")
    ap.add_argument("--out", default="runs/eval")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use the persistent compilation cache")
    from spd_jax import distributed

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
    unknown = sorted(set(args.methods) - set(spd_jax_methods()))
    if unknown:
        ap.error(f"unknown methods {unknown}: available {', '.join(spd_jax_methods())}")
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
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import spd_jax

    if not args.no_compile_cache:
        spd_jax.enable_persistent_cache()
    try:
        benches = {b: read_benchmark(b, args.limit) for b in args.bench}  # a bad --bench fails before the load
        model = spd_jax.load_model(args.model)
        out = Path(args.out)
        spec = "random" if args.random_psm else args.spec
        rows = evaluate(model, benches, args.methods, args.n, args.temperature, args.max_new_tokens, out, spec,
                        args.seed, progress=leader, write=leader, ks=args.k, drafter=args.drafter,
                        method_ns=method_ns, block=args.block, command=argv)
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
    plot(table, out)
    print(results_markdown(table, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
