"""python -m bench.scale: a model at its published size end to end on n host devices, from a seeded random
checkpoint through the real loading path: greedy `spd` (random PSM), `ar` and `tp`, and one PSM training
step, each phase in a fresh process, with its memory, compile time and time per token or step.

    python -m bench.scale --config qwen3.5-4b --n 8 [--prompt 128] [--new 16] [--train-seq 512]
                          [--phases spd,ar,tp,train] [--ckpt DIR] [--dtype bfloat16] [--json]

The checkpoint (`spd_jax.convert.random`: bf16 safetensors, HF names and shards) goes to a temporary
directory, removed afterwards (--ckpt DIR: written there once and kept, reused when present). Each phase
loads it itself, as its method's CLI would: `spd` onto n stage devices (`STAGE_RULES`; each device reads
its stage's layers), `ar` whole on one device, `tp` split over n devices (`TP_RULES`), `train` on a 1 x 1
mesh (on host devices a replicated PSM and optimiser state would be held n times; `TRAIN_RULES` otherwise).
Per phase: peak resident memory of the process (VmHWM: JAX's start-up, the load and the run) against the
planner's figure for it (`costs.memory`: n host devices hold n devices' bytes, plus what the phase keeps
beside them), the bytes the busiest device holds after the run against the planner's weights per device,
compile time, and time per token (prefill included for `spd`; the decode loop alone for `ar`/`tp`) or per
step. Checks: the greedy tokens of `spd` and `tp` equal `ar`'s, or part from them only at a near tie (ar's top-2 logit
margin there within the dtype's rounding, from one full forward: random bf16 weights make ties likely); the
training step's loss is finite and its gradient norm equals, within its error budget, that of the same loss
computed the plain way (`psm_loss(plain=True)`: each query drafted as the engine drafts) on the same batch.
Exit status 1 if a check fails. The prompt and the training batch are seeded random token ids; 0.5 of the batch's positions (its end)
are in the loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import spd_jax
from spd_jax import distributed, methods
from spd_jax.config import ModelConfig
from spd_jax.convert.random import write_random_checkpoint
from spd_jax.decode.ar import CACHE_BUCKET, PROMPT_BUCKET, round_up
from spd_jax.decode.pipelined import engine_cache_len, plan_for
from spd_jax.drafters.psm import PSMConfig
from spd_jax.costs import memory
from spd_jax.sharding import data_model_mesh, put, request_cpu_devices

PHASES = ("spd", "ar", "tp", "train")
# the methods over several devices run as one process per device: XLA:CPU's collectives in one process stall at scale
MULTI = tuple(p for p in PHASES if p in methods.METHODS and not methods.METHODS[p].one_device)
# the gradient norms' relative error budget: the same loss computed two ways whose reductions differ in order
# and layout (tests/tolerances.py CACHED_VS_FULL in float32; bfloat16's 2**-8 per stored activation otherwise),
# per sqrt of the PSM's layers
GRAD_NORM_BUDGET = {"float32": 4e-5, "bfloat16": 5e-2}
GB = 1e9
# rounding of the stored activations (bf16: 2**-8 relative), per sqrt of the depth: a top-2 margin within it is a tie
TIE_BUDGET = {"float32": 2.0 ** -20, "bfloat16": 2.0 ** -8}
# XLA:CPU upcasts each bf16 weight to float32 for its dot; its default scheduler runs those converts as early as
# it can, and loop-invariant code motion lifts them out of the decode loops, so every weight a device holds has a
# float32 copy alive at once (3x the bf16 bytes). These flags keep one or two alive at a time (docs/scale.md).
HOST_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false "
                  "--xla_disable_hlo_passes=while-loop-invariant-code-motion")


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _peak_gb() -> float:
    return _status_kb("VmHWM") * 1024 / GB


class _AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon, sampled every 5 ms): what it allocated,
    without the checkpoint's pages it maps to read them (file-backed and reclaimable, but in VmHWM)."""

    def __init__(self):
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            self.peak = max(self.peak, _status_kb("RssAnon") * 1024)
            time.sleep(0.005)

    def gb(self) -> float:
        return max(self.peak, _status_kb("RssAnon") * 1024) / GB


def _busiest_device_bytes() -> int:
    """The bytes of the live arrays the busiest device holds."""
    per: dict = {}
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values(), default=0)


def _prompt(cfg: ModelConfig, length: int) -> list[int]:
    return np.random.default_rng(0).integers(0, cfg.vocab_size, length).tolist()


def _decode(phase: str, args, cfg: ModelConfig, pb: int, anon: _AnonPeak) -> dict:
    """spd, ar or tp: load as the method's CLI would (over this job's processes), greedy tokens, the figures."""
    multi = jax.process_count() > 1
    method = methods.get(phase).taking(n=args.n, spec="random", psm_layers=args.psm_layers)  # a random PSM
    mesh, rules = method.load_placement(True) or (None, None)  # each device reads only its shards
    t0 = time.perf_counter()
    model = spd_jax.load_model(args.ckpt, dtype=args.dtype, mesh=mesh, rules=rules)
    jax.block_until_ready(model.params)
    load_s, load_peak = time.perf_counter() - t0, _peak_gb()
    res = spd_jax.generate(model, _prompt(cfg, args.prompt), args.new, method=method, stop_at_eos=False)
    st = res.stats
    if method.staged:
        plan = plan_for(model, args.n)
        planned = memory.spd_device_bytes(cfg, args.n, engine_cache_len(args.prompt, args.new, args.n), pb, plan,
                                          memory.random_psm(cfg, plan, args.psm_layers))
        # (the random PSM model.placements keeps on each process's default device is that device's replica: no copy)
        host = args.n * planned.total
        per_token = st["wall_s"] / st["tokens"]
    else:
        devices = method.devices()
        cache_len = round_up(max(args.prompt + args.new, round_up(args.prompt, PROMPT_BUCKET)), CACHE_BUCKET)
        planned = memory.tp_device_bytes(cfg, devices, cache_len, pb)
        host = devices * planned.total  # loaded with the method's rules: used as placed, no resharded copy
        per_token = 1.0 / st["decode_tokens_per_s"]
    margins = None
    if method.baseline:  # the reference's top-2 logit margin at each generated position, from one full forward
        prompt = _prompt(cfg, args.prompt)
        logits = model.logits(np.asarray([prompt + res.token_ids[:-1]]))[0, len(prompt) - 1:]
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        margins = dict(margin=(top2[:, 0] - top2[:, 1]).tolist(), scale=np.abs(logits).max(-1).tolist())
    mine = dict(peak_gb=_peak_gb(), anon_peak_gb=anon.gb(), device_gb=_busiest_device_bytes() / GB, load_peak_gb=load_peak)
    if multi:  # every process's own figures, gathered by process 0 through files
        (Path(args.report_dir) / f"worker{jax.process_index()}.json").write_text(json.dumps(mine))
        distributed.barrier("bench.scale figures written")
        every = [json.loads(p.read_text()) for p in sorted(Path(args.report_dir).glob("worker*.json"))]
    else:
        every = [mine]
    return dict(phase=phase, tokens=res.token_ids, margins=margins, layers=cfg.num_layers, load_s=load_s,
                processes=len(every),
                load_peak_gb=sum(w["load_peak_gb"] for w in every), peak_gb=sum(w["peak_gb"] for w in every),
                anon_peak_gb=sum(w["anon_peak_gb"] for w in every), planned_host_gb=host / GB,
                device_gb=max(w["device_gb"] for w in every), planned_device_gb=planned.weights / GB,
                planned_device_total_gb=planned.total / GB, compile_s=st["compile_s"], per_token_s=per_token,
                devices=st["devices"], backend=jax.default_backend())


def _train(args, cfg: ModelConfig, pb: int, anon: _AnonPeak) -> dict:
    """One PSM training step (batch 1, --train-seq tokens) and the gradient norm computed the plain way."""
    from spd_jax.drafters.psm import psm_loss
    from train import corpus, step as train_step
    from train.config import TrainConfig

    mesh = data_model_mesh(1, 1)
    t0 = time.perf_counter()
    model = spd_jax.load_model(args.ckpt, dtype=args.dtype)
    jax.block_until_ready(model.params)
    load_s, load_peak = time.perf_counter() - t0, _peak_gb()
    plan = plan_for(model, args.n)
    # random PSM layers (the target's are random too): a small target may have fewer attention layers than Ls
    tc = TrainConfig.of(model=str(args.ckpt), n=args.n, batch_size=1, compute_dtype=args.dtype, layers_from_target=False,
                        psm_layers=args.psm_layers)
    spec = PSMConfig.for_target(cfg, plan.counts, tc.drafter.psm_layers)
    rng = np.random.default_rng(1)
    mask = np.arange(args.train_seq) >= args.train_seq // 2
    batch = corpus.pad_batch([(rng.integers(0, cfg.vocab_size, args.train_seq).astype(np.int32), mask)],
                             (args.train_seq,))
    opt = train_step.make_optimizer(tc)
    state, frozen = train_step.init_state(model, spec, tc, opt)
    target = train_step.compute_target(model, tc)
    dev = jax.tree.map(jnp.asarray, batch)

    # the reference first (the step donates the state): the same loss, keys and batch, drafted query by query
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(jax.random.key(tc.run.seed), 0), i))(jnp.arange(1))
    plain = functools.partial(psm_loss, cfg=cfg, spec=spec, tau=tc.drafter.tau, plain=True,
                              **dict(fill_accept=tc.drafter.fill_accept, hard_weight=tc.drafter.hard_weight))
    t0 = time.perf_counter()
    (_, sums), grads = jax.jit(jax.value_and_grad(plain, has_aux=True))(state["params"], frozen, target, dev, keys)
    ref_norm = float(optax.tree.norm(jax.tree.map(lambda g: g / jnp.maximum(sums["positions"], 1.0), grads)))
    ref_s = time.perf_counter() - t0
    del grads

    step = train_step.make_step(cfg, spec, tc, opt, mesh)
    # placed as train.main places them (replicated, as the step returns them): else the second call compiles again
    rep = NamedSharding(mesh, PartitionSpec())
    state, frozen = put(state, rep), put(frozen, rep)
    t0 = time.perf_counter()
    state, met = step(state, frozen, target, batch)
    first_s = time.perf_counter() - t0
    loss, norm = float(met["loss"]), float(met["grad_norm"])
    t0 = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, frozen, target, batch))
    step_s = time.perf_counter() - t0
    planned = memory.train_device_bytes(cfg, spec, 1, pb)
    budget = GRAD_NORM_BUDGET[args.dtype] * math.sqrt(spec.num_layers)
    return dict(phase="train", load_s=load_s, load_peak_gb=load_peak, peak_gb=_peak_gb(), anon_peak_gb=anon.gb(),
                planned_host_gb=planned.total / GB, device_gb=_busiest_device_bytes() / GB,
                planned_device_gb=planned.weights / GB, planned_device_total_gb=planned.total / GB,
                compile_s=max(first_s - step_s, 0.0), per_step_s=step_s, loss=loss, grad_norm=norm,
                grad_norm_plain=ref_norm, grad_norm_rel_err=abs(norm - ref_norm) / ref_norm, grad_norm_budget=budget,
                plain_s=ref_s, positions=int(batch["mask"].sum()), devices=1, processes=1,
                backend=jax.default_backend())


def _child(args) -> dict | None:
    """One phase in this process (or this worker of the phase's job) -> its figures (None: not process 0)."""
    anon = _AnonPeak()
    spd_jax.enable_persistent_cache()  # and a job of several processes compiles each program once (distributed)
    if args.child in MULTI:
        distributed.setup(args, args.n)  # joins the phase's job, or asks for n host devices; before JAX starts
    else:
        request_cpu_devices(args.n)
    jax.devices()
    cfg = ModelConfig.from_json(Path(args.ckpt) / "config.json")
    pb = jnp.dtype(args.dtype).itemsize
    out = _train(args, cfg, pb, anon) if args.child == "train" else _decode(args.child, args, cfg, pb, anon)
    return out if jax.process_index() == 0 else None


def _token_check(r: dict, ref: dict, dtype: str) -> str:
    """r's greedy tokens against the reference's: equal, or parting first at a near tie, where the reference's
    top-2 logit margin is within the dtype's rounding (TIE_BUDGET x sqrt(layers) x max(1, max|logit|)): two
    programs that sum in other orders may then pick either token, and every token after differs."""
    a, b = r["tokens"], ref["tokens"]
    what = f"{r['phase']} tokens vs {ref['phase']}'s"
    if a == b:
        return f"equal: {what} ({len(a)})"
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i >= len(ref["margins"]["margin"]):
        return f"differ: {what} in length"
    m, scale = ref["margins"]["margin"][i], ref["margins"]["scale"][i]
    budget = TIE_BUDGET[dtype] * math.sqrt(ref["layers"]) * max(1.0, scale)
    tie = "near tie" if m <= budget else "differ"
    return (f"{tie}: {what} equal for {i} tokens, then part where {ref['phase']}'s top-2 margin is {m:.3g} "
            f"({'<=' if m <= budget else '>'} the {dtype} budget {budget:.3g})")


def _write(args, out: Path) -> dict:
    t0 = time.perf_counter()
    write_random_checkpoint(args.config, out, seed=0, max_shard_bytes=int(args.max_shard_gb * GB))
    return dict(write_s=time.perf_counter() - t0, write_peak_gb=_peak_gb(),
                checkpoint_gb=sum(p.stat().st_size for p in out.iterdir()) / GB)


def report(res: dict) -> str:
    lines = [f"{res['config']} on {res['n']} host devices, {res['dtype']}; checkpoint {res['checkpoint_gb']:.2f} GB written "
             f"in {res['write_s']:.0f} s (peak {res['write_peak_gb']:.2f} GB)",
             "| phase | devices / processes | load s | peak RSS GB | peak anon GB | planned host GB | busiest device GB | "
             "planned device GB (weights / all) | compile s | per token / step s |", "|" + "---|" * 10]
    for r in res["phases"]:
        per = r.get("per_token_s", r.get("per_step_s"))
        lines.append(f"| {r['phase']} | {r['devices']} / {r['processes']} | {r['load_s']:.1f} | {r['peak_gb']:.2f} | "
                     f"{r['anon_peak_gb']:.2f} | {r['planned_host_gb']:.2f} | {r['device_gb']:.3f} | "
                     f"{r['planned_device_gb']:.3f} / {r['planned_device_total_gb']:.3f} | {r['compile_s']:.1f} | {per:.3f} |")
    for name, ok in res["checks"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}: {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3.5-4b", help="a model config under configs/models")
    ap.add_argument("--n", type=int, default=8, help="stages of spd, devices of tp; the PSM's pipeline depth")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--psm-layers", type=int, default=2, help="the random PSM's layers Ls (spd and train)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(GRAD_NORM_BUDGET))
    ap.add_argument("--ckpt", default=None, help="write the checkpoint here once and keep it (default: a temp dir)")
    ap.add_argument("--max-shard-gb", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one-process", action="store_true",
                    help="spd and tp on n host devices of one process (deadlocks at scale on XLA:CPU: docs/scale.md)")
    ap.add_argument("--keep-xla-flags", action="store_true", help=f"do not add {HOST_XLA_FLAGS} to XLA_FLAGS")
    ap.add_argument("--child", default=None, choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--report-dir", default=None, help=argparse.SUPPRESS)
    distributed.add_arguments(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.child:
        if distributed.launching(args):  # spd and tp: one process per device
            return distributed.launch(args.processes, "bench.scale", distributed.worker_argv(argv))
        out = _child(args)
        if out is not None:
            print(json.dumps(out))
        return 0
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase {bad[0]!r}: from {', '.join(PHASES)}")
    tmp = None if args.ckpt else tempfile.mkdtemp(prefix=f"spd-scale-{args.config}-")
    ckpt = Path(args.ckpt or tmp)
    try:
        made = (dict(write_s=0.0, write_peak_gb=0.0, checkpoint_gb=sum(p.stat().st_size for p in ckpt.iterdir()) / GB)
                if (ckpt / "config.json").is_file() else _write(args, ckpt))
        rows = []
        env = dict(os.environ)
        if not args.keep_xla_flags:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {HOST_XLA_FLAGS}".strip()
        for phase in phases:
            print(f"bench.scale: {phase} ...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="spd-scale-report-") as report_dir:
                cmd = [sys.executable, "-m", "bench.scale", "--child", phase, "--ckpt", str(ckpt), "--n", str(args.n),
                       "--prompt", str(args.prompt), "--new", str(args.new), "--train-seq", str(args.train_seq), "--psm-layers", str(args.psm_layers),
                       "--dtype", args.dtype, "--report-dir", report_dir]
                if phase in MULTI and not args.one_process and args.n > 1:
                    cmd += ["--processes", str(args.n)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"phase {phase} failed (exit {out.returncode})")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"bench.scale: {json.dumps(rows[-1])}", file=sys.stderr,
                  flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    checks = {}
    ref = next((r for r in rows if r.get("margins")), None)
    for r in rows:
        if ref is not None and "tokens" in r and r is not ref:
            checks[_token_check(r, ref, args.dtype)] = _token_check(r, ref, args.dtype).startswith(("equal", "near"))
    for r in rows:
        if r["phase"] == "train":
            checks["training loss finite"] = bool(np.isfinite(r["loss"]))
            checks[f"gradient norm {r['grad_norm']:.6g} vs plain {r['grad_norm_plain']:.6g}: relative error "
                   f"{r['grad_norm_rel_err']:.2g} <= {r['grad_norm_budget']:.2g}"] = r["grad_norm_rel_err"] <= r["grad_norm_budget"]
    res = dict(config=args.config, n=args.n, dtype=args.dtype, prompt=args.prompt, new=args.new,
               train_seq=args.train_seq, backend=rows[0]["backend"] if rows else None, **made, phases=rows,
               checks=checks)
    print(json.dumps(res) if args.json else report(res))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
