"""Real wall-clock, everything counted: the same prompts through every method, each configuration in its
own processes on this machine, next to the cost model's prediction for the same set-up.

    python -m bench.wallclock [--model smollm2-135m-instruct] [--bench mt_bench] [--prompts 4]
                              [--max-new-tokens 128] [--spec PATH | --random-psm] [--out runs/wallclock]
                              [--configs ar1,ar,tp,pipeline,spd,spd1] [--against CHECKOUT]

Configurations (each one `python -m infer.generate --json` run over the same prompt file, greedy, no EOS
stop, a first warm-up prompt dropped):
  ar, 1 core        one process pinned to one core
  ar, 2 cores       one process, both cores (XLA's intra-op threads)
  tp n=2            2 processes x 1 core, tensor parallel (all-reduces over gloo)
  pipeline n=2      2 processes x 1 core, one stage each, one token in flight
  spd n=2           2 processes x 1 core, one stage each, the PSM drafting
  spd n=2, 1 proc   one process, 2 host devices sharing both cores (what a single process gets)
tokens/s = generated tokens / wall time of `generate` (prefill + the on-device decode loop + every
collective + the result's copy to the host; compilation excluded, ahead of time).
--against CHECKOUT runs each chosen configuration a second time with another checkout's code (a git
worktree at an older commit, say), right after this one's: a before/after of a change in one run, each
row's "vs ar" against its own checkout's ar.

Prediction: the cost model (`spd_jax.costs.cycle.predict`, decode only) with this machine's
profile: per-part times fitted from `profile_cycle` run pinned to one core (one core = one device), and
the link from gloo collectives timed between two one-core processes; at the spd run's measured alpha.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import spd_jax  # imports JAX without starting its backend: each part still picks its devices first
from spd_jax import distributed
from spd_jax.datasets import read_benchmark
from spd_jax.decode.pipelined import plan_for
from spd_jax.drafters.psm import PSMConfig, read_spec
from spd_jax.methods import METHODS
from spd_jax.costs import calibration, cycle
from spd_jax.costs.profile import profile_cycle
from spd_jax.progress import progress_bar
from spd_jax.sharding import STAGE, request_cpu_devices, stage_mesh, vary

ROOT = Path(__file__).resolve().parents[1]


def _pinned(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def _run(cmd: list[str], pin: int | None = None, timeout: float = 3600,
         checkout: Path = ROOT) -> subprocess.CompletedProcess:
    """cmd in `checkout` (a checkout of this repository: its code runs, this one's unless told)."""
    env = os.environ | ({"PYTHONPATH": str(checkout)} if checkout != ROOT else {})
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=timeout, env=env,
                       preexec_fn=_pinned(pin) if pin is not None else None)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed (code {r.returncode}):\n{r.stderr[-3000:]}")
    return r


# ---------------------------------------------------------------- parts run in their own processes


def part_profile(args) -> None:
    """One process, pinned by the parent to one core: every part of an n=2 cycle timed alone."""
    request_cpu_devices(2)  # before JAX initialises its backend
    model = spd_jax.load_model(args.model)
    prof = profile_cycle(model, plan_for(model, 2), psm_layers=args.psm_layers, context=args.context)
    Path(args.part_out).write_text(json.dumps(prof))


def part_link(args) -> None:
    """In each of 2 one-core processes: the per-call time of the collectives a cycle uses (and tp's), over gloo,
    each inside an on-device loop of `iters` calls (dispatch amortised)."""
    cluster = distributed.cluster_from(args)
    distributed.initialize(cluster, 1)  # before JAX initialises its backend
    H = spd_jax.load_model(args.model).config.hidden_size
    mesh, iters = stage_mesh(2), 200

    def timed(op, x):
        def body(x):
            return jax.lax.fori_loop(0, iters, lambda i, v: vary(op(v) * 0.5, STAGE), x)  # psum: invariant

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(STAGE), out_specs=P(STAGE)))
        xs = jax.device_put(jnp.ones((2, *x.shape), x.dtype), jax.sharding.NamedSharding(mesh, P(STAGE)))
        jax.block_until_ready(f(xs))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(xs))
            ts.append((time.perf_counter() - t0) / iters)
        return statistics.median(ts)

    res = dict(hidden=H,
               ppermute_hidden_s=timed(lambda v: jax.lax.ppermute(v, STAGE, [(0, 1), (1, 0)]), jnp.ones((1, H))),
               allreduce_hidden_s=timed(lambda v: jax.lax.psum(v, STAGE), jnp.ones((1, H))),
               allreduce_scalar_s=timed(lambda v: jax.lax.psum(v, STAGE), jnp.ones((1, 1))),
               allgather_hidden_s=timed(lambda v: jax.lax.all_gather(v, STAGE, to="invarying")[1], jnp.ones((1, H))),
               allgather_scalar_s=timed(lambda v: jax.lax.all_gather(v, STAGE, to="invarying")[1], jnp.ones((1, 1))))
    if distributed.is_leader():
        Path(args.part_out).write_text(json.dumps(res))


# ---------------------------------------------------------------- the parent


CONFIGS = {  # --configs name: (label, infer.generate flags, pin to one core, processes)
    "ar1": ("ar, 1 core", ["--mode", "ar"], True, 1),
    "ar": ("ar, 2 cores", ["--mode", "ar"], False, 1),  # the reference: always run
    "tp": ("tp n=2, 2 processes", ["--mode", "tp", "--n", "2", "--processes", "2"], False, 2),
    "pipeline": ("pipeline n=2, 2 processes", ["--mode", "pipeline", "--n", "2", "--processes", "2"], False, 2),
    "spd": ("spd n=2, 2 processes", ["--mode", "spd", "--n", "2", "--processes", "2"], False, 2),
    "spd1": ("spd n=2, 1 process", ["--mode", "spd", "--n", "2"], False, 1),
}
REFERENCE = CONFIGS["ar"][0]


def measure(args, prompt_file: Path) -> list[dict]:
    # no PSM ships for n = 2: a random one unless --spec gives one (generate asks for it explicitly)
    spec = ["--spec", args.spec] if args.spec and not args.random_psm else ["--random-psm"]
    runs = [(c, ROOT, c[0]) for name, c in CONFIGS.items() if c[0] == REFERENCE or name in args.configs]
    if args.against:  # the same configurations on the other checkout, each right after this one's
        other = Path(args.against).resolve()
        runs = [r for c, root, label in runs for r in ((c, root, label), (c, other, f"{label} [{args.against_label}]"))]
    out = []
    for (base, flags, pin, procs), checkout, label in progress_bar(runs, desc="wallclock", unit="config"):
        cmd = [sys.executable, "-m", "infer.generate", "--json", "--model", args.model, "--prompt-file",
               str(prompt_file), "--max-new-tokens", str(args.max_new_tokens), "--no-eos", *flags,
               *(spec if METHODS[flags[flags.index("--mode") + 1]].random_drafter_on_request else [])]
        done = _run(cmd, pin=0 if pin else None, checkout=checkout)
        rows = [json.loads(x) for x in done.stdout.splitlines()][1:]  # the first prompt, a warm-up, dropped
        tokens = sum(r["stats"]["tokens"] for r in rows)
        wall = sum(r["stats"]["wall_s"] for r in rows)
        cycles = sum(r["stats"].get("cycles", r["stats"]["tokens"]) for r in rows)
        out.append(dict(config=label, base=base, checkout=str(checkout), processes=procs, cores=1 if pin else 2,
                        prompts=len(rows), tokens=tokens,
                        wall_s=wall, tokens_per_s=tokens / wall, alpha=tokens / cycles,
                        S0=(tokens / cycles * sum(rows[0]["stats"]["stage_layers"]) / max(rows[0]["stats"]["stage_layers"])
                            if "stage_layers" in rows[0]["stats"] else None),
                        psm=rows[0]["stats"].get("psm"), token_ids=[r["token_ids"] for r in rows],
                        timing_includes=rows[0]["stats"]["timing_includes"]))
    return out


def predictions(args, prof: dict, link: dict, alpha: float) -> dict:
    model = spd_jax.load_model(args.model)
    cfg, plan = model.config, plan_for(model, 2)
    psm_cfg = (read_spec(args.spec) if args.spec and not args.random_psm
               else PSMConfig.for_target(cfg, plan.counts, num_layers=args.psm_layers))
    fitted = calibration.fit_cpu(prof, cfg, PSMConfig.for_target(cfg, plan.counts, num_layers=args.psm_layers))
    H = link["hidden"]
    latency = link["allreduce_scalar_s"]
    bw = 4 * H / max(link["ppermute_hidden_s"] - latency, 1e-9)
    hw = dataclasses.replace(
        fitted, name="this CPU: one core per device, gloo over localhost", link_latency_s=latency,
        link_bytes_per_s=bw,
        assumes=fitted.assumes.split("; link:")[0] + f"; link measured between two one-core processes (gloo): "
                f"{1e6 * latency:.0f} us per collective (scalar all-reduce), {bw / 1e6:.0f} MB/s from a [H] permute")
    p = cycle.predict(cfg, 2, psm_cfg, hw, prof["context"], S0=0.0, plan=plan, param_bytes=4, alpha=alpha)
    return {"ar, 1 core": 1 / p["ar_step_s"], "tp n=2, 2 processes": 1 / p["tp_step_s"],
            "pipeline n=2, 2 processes": 1 / p["pipeline_token_s"], "spd n=2, 2 processes": alpha / p["spd_cycle_s"],
            "_hardware": dataclasses.asdict(hw), "_includes": p["includes"], "_alpha": alpha}


def table(rows: list[dict], pred: dict, setup: dict) -> str:
    ar2 = {r["checkout"]: r["tokens_per_s"] for r in rows if r["base"] == REFERENCE}  # each checkout's own
    lines = ["# Wall-clock, everything counted", "", "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), "",
             "| configuration | processes x cores | tokens | alpha | ms per cycle | measured tok/s | vs ar 2 cores "
             "| predicted tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pr = pred.get(r["config"])
        lines.append(f"| {r['config']} | {r['processes']} x {r['cores'] if r['processes'] == 1 else 1} | {r['tokens']} | "
                     f"{r['alpha']:.3f} | {1e3 * r['alpha'] / r['tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / ar2[r['checkout']]:.2f}x | "
                     f"{f'{pr:.1f}' if pr else '-'} |")
    lines += ["", "What each measurement includes (tokens / the wall time of `generate`; the JSON has each row's):", ""]
    seen = set()
    for r in rows:
        if r["timing_includes"] not in seen:
            seen.add(r["timing_includes"])
            lines.append(f"- {', '.join(x['config'] for x in rows if x['timing_includes'] == r['timing_includes'])}: "
                         f"{r['timing_includes']}")
    if pred:
        lines += ["", f"Predicted (decode only, no prefill): {pred['_includes']}", "",
                  f"Profile: {pred['_hardware']['name']}: {pred['_hardware']['assumes']}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wallclock", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bench", default="mt_bench", help="benchmark whose first prompts are used (infer.evaluate's)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--spec", default=None, help="PSM checkpoint for n=2 (default: a random PSM, as none ships for n=2)")
    ap.add_argument("--random-psm", action="store_true", help="a random PSM for n=2 (the default without --spec)")
    ap.add_argument("--psm-layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="context length of the per-part profile")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated configurations to run, of {', '.join(CONFIGS)} (ar, the reference, always "
                         "runs)")
    ap.add_argument("--against", default=None,
                    help="another checkout of this repository (e.g. a git worktree at an older commit): each "
                         "configuration also runs with its code, right after this checkout's, in the same run")
    ap.add_argument("--against-label", default="against", help="the label of --against's rows")
    ap.add_argument("--out", default="runs/wallclock")
    ap.add_argument("--part", choices=["profile", "link"], help=argparse.SUPPRESS)  # a child's job
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    distributed.add_arguments(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    if args.against and not (Path(args.against) / "spd_jax").is_dir():
        ap.error(f"--against {args.against}: not a checkout of this repository (no spd_jax/ in it)")
    if distributed.launching(args):  # the link part's two workers
        return distributed.launch(args.processes, "bench.wallclock", distributed.worker_argv(argv))
    if args.part == "profile":
        part_profile(args)
        return 0
    if args.part == "link":
        part_link(args)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("error: bench.wallclock needs 2 CPU cores (one per process)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = read_benchmark(args.bench, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        pf = Path(tmp) / "prompts.jsonl"
        pf.write_text("".join(json.dumps({"prompt": p["text"]}) + "\n" for p in [prompts[0], *prompts]))
        rows = measure(args, pf)
        base = rows[0]["token_ids"]
        for r in rows:  # every method is exact: the same tokens, so the same work per token
            if r["token_ids"] != base:
                raise SystemExit(f"error: {r['config']} generated other tokens than {rows[0]['config']}")
        spd = next((r for r in rows if r["config"] == CONFIGS["spd"][0]), None)  # this checkout's
        prof = link = None
        pred = {}
        if spd is not None:  # the cost model's prediction of this checkout, fitted to this machine
            prof_f, link_f = Path(tmp) / "profile.json", Path(tmp) / "link.json"
            common = [sys.executable, "-m", "bench.wallclock", "--model", args.model, "--psm-layers",
                      str(args.psm_layers), "--context", str(args.context)]
            _run(common + ["--part", "profile", "--part-out", str(prof_f)], pin=0)
            _run(common + ["--part", "link", "--part-out", str(link_f), "--processes", "2"])
            prof, link = json.loads(prof_f.read_text()), json.loads(link_f.read_text())
            pred = predictions(args, prof, link, spd["alpha"])
    setup = dict(model=args.model, bench=args.bench, prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                 psm=next((r["psm"] for r in rows if r["psm"]), None), cpu=os.cpu_count())
    if args.against:
        setup["against"] = f"{args.against_label}: {Path(args.against).resolve()}"
    md = table(rows, pred, setup)
    for r in rows:
        r.pop("token_ids")
    (out / "wallclock.json").write_text(json.dumps(dict(setup=setup, rows=rows, predicted=pred, profile=prof,
                                                        link=link), indent=1))
    (out / "wallclock.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
