"""Cost of one SPD cycle against one autoregressive step, side by side on the same backend and model.

    python -m bench.spd_cycle [--model smollm2-135m-instruct] [--n 8] [--new-tokens 64] [--repeats 3] [--stages 4,4,..]
                              [--psm-placement auto|last|own]

Measures, in one run:
  ar_step_ms      the on-device AR decode loop's time per token (spd_jax.generate, method="ar")
  spd_cycle_ms    (SPD wall - SPD prefill wall) / cycles, with the default PSM (the one shipped for this
                  model and n, else a random one: acceptance hardly changes a cycle's cost); wall = the whole on-device loop incl. every stage, transfers
                  and all-reduces, and the final device-to-host copy; prefill measured by a 1-token run
  pipeline_cycle_ms  the same for the plain pipeline (no PSM)
  ratio           spd_cycle_ms / ar_step_ms
  collectives     per cycle, by kind: those in the body of the compiled decode loop (`profile.loop_collectives`),
                  for greedy spd and pipeline and sampled spd
and the cycle profile (spd_jax.costs.profile): each stage, the PSM body, one vocabulary shard of
the PSM head and of verification, the collectives. Per device, the busy time per cycle with the PSM
body on the last stage (its stage and one shard of each head; with `--psm-placement own` on a device of its
own, as the SPD runs then place it too: n + 1 devices, the heads split n + 1 ways): measured
(as one call per device, one dispatch as in the engine's one program; that less a trivial call's dispatch;
and the sum of its parts timed alone), and predicted by the cost model (spd_jax.costs.cycle) fitted to this
CPU, for the current stage plan and for the device-aware plan (an opt-in: pass its counts to
`infer.generate --stages`; the shipped PSM is tied to the default plan); with max/mean imbalance.
On a CPU host the n "devices" share its cores: were they to run one after another, a cycle would cost
the SUM of every device's busy time plus the collectives (about one AR step plus the PSM).
`rest_of_cycle_ms` is the cycle minus that sum: negative when the devices' work overlaps (more than one
core) or the parts' per-call dispatch, timed in the profile, is not paid inside the engine's loop. Last, projections of the wall-clock speedup of spd, tp and pipeline over ar (communication
included) on three profiles: this CPU as fitted (as if each stage had its own such device), an
H200-with-NVLink-like and a TPU-v5e-ICI-like one, with the heads whole on the last stage (the engine
before vocabulary-parallel heads) and sharded (now), at --alpha-S0 (default 1.5; "measured": this run's,
with the PSM it ran, `spd_psm`), and per profile the PSM body on the last stage, on the stage the cost model picks
(the engine's default, `--psm-placement auto`) and on a device of its own (n + 1 devices).
Projections are not measurements; each states what it assumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics

import jax.numpy as jnp

import spd_jax  # imports JAX without starting its backend: main still picks the device count
from spd_jax import methods
from spd_jax.decode.pipelined import plan_for
from spd_jax.decode.sampling import Sampling
from spd_jax.drafters.kind import Form
from spd_jax.drafters.psm import PSMConfig, read_spec
from spd_jax.costs import calibration, cycle
from spd_jax.costs.profile import loop_collectives, profile_cycle
from spd_jax.sharding import request_cpu_devices


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spd_cycle", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=None, help="stages (default 8, or the count of --stages)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--psm-layers", type=int, default=None,
                    help="run and profile a random PSM of this many layers (default: the default PSM, the shipped "
                         "one where there is one, and its layer count)")
    ap.add_argument("--stages", default=None,
                    help="per-stage layer counts, comma-separated (e.g. the device-aware plan this report prints); a "
                         "random PSM drafts (the shipped one is tied to the default plan), of --psm-layers layers (2)")
    ap.add_argument("--psm-placement", choices=("auto", "last", "own"), default="auto",
                    help="where the SPD runs put the PSM body (the engine's default: auto); the busy times put it on "
                         "the last stage, or with own on a device of its own for both (n + 1 devices, the heads split "
                         "n + 1 ways)")
    ap.add_argument("--alpha-S0", default="1.5",
                    help="S0 = alpha * L / max(stage layers) for the projections, or 'measured' (this run's)")
    ap.add_argument("--project-context", type=int, default=1024,
                    help="context length (tokens) of the H200 / TPU projections")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    # the SPD runs and the profile must describe one PSM: the default's layer count, or a random one's
    stage_layers, opts = method_options(args)
    own = args.psm_placement == "own"
    request_cpu_devices(args.n + own)
    logging.getLogger("spd_jax").setLevel(logging.ERROR)
    model = spd_jax.load_model(args.model)
    ids = model.encode("Explain how a bicycle works, step by step.")
    N = args.new_tokens
    spd_m, pipe_m = methods.SPD(**opts, psm_placement=args.psm_placement), methods.Pipeline(**opts)

    def ar_step():
        r = spd_jax.generate(model, ids, N, stop_at_eos=False)
        return 1e3 * r.stats["decode_s"] / (N - 1)

    def cycle(method):
        full = spd_jax.generate(model, ids, N, method=method, stop_at_eos=False).stats
        pre = spd_jax.generate(model, ids, 1, method=method, stop_at_eos=False).stats
        return 1e3 * (full["wall_s"] - pre["wall_s"]) / full["cycles"], full

    ar_step(), cycle(spd_m), cycle(pipe_m)  # warm-up (compiles)
    # what one cycle communicates: the collectives in the compiled loop's body, greedy and sampled
    comm = {}
    for label, method, temp in (("spd", spd_m, 0.0), ("pipeline", pipe_m, 0.0), ("spd, sampled T=1", spd_m, 1.0)):
        spd_jax.generate(model, ids, 2, sampling=Sampling(temperature=temp), method=method, stop_at_eos=False)
        comm[label] = loop_collectives(method.compiled.latest().as_text())
    ar, spd, pipe = [], [], []
    for _ in range(args.repeats):
        ar.append(ar_step())
        spd.append(cycle(spd_m)[0])
        pipe.append(cycle(pipe_m)[0])
    _, spd_stats = cycle(spd_m)
    plan = plan_for(model, args.n, stage_layers)  # what spd ran above: the engine's default, or --stages
    psm_layers = args.psm_layers or (read_spec(spd_stats["psm"]).num_layers if spd_stats["psm"] != Form.RANDOM.value else 2)
    psm_device = plan.n if own else plan.n - 1
    prof = profile_cycle(model, plan, psm_layers=psm_layers, context=len(ids) + N // 2, psm_device=psm_device)
    res = dict(model=str(model.path), n=args.n, new_tokens=N, stage_layers=spd_stats["stage_layers"],
               ar_step_ms=statistics.median(ar), spd_cycle_ms=statistics.median(spd),
               pipeline_cycle_ms=statistics.median(pipe), spd_alpha=spd_stats["alpha"],
               spd_psm=spd_stats["psm"], collectives_per_cycle=comm,
               profile=prof)
    res["ratio_spd_cycle_to_ar_step"] = res["spd_cycle_ms"] / res["ar_step_ms"]
    res["ratio_pipeline_cycle_to_ar_step"] = res["pipeline_cycle_ms"] / res["ar_step_ms"]
    res["sum_of_stage_ms"] = sum(prof["stage_ms"])
    S0 = spd_stats["S0"] if args.alpha_S0 == "measured" else float(args.alpha_S0)
    res |= device_report(model, plan, prof, psm_layers, S0, args.project_context)
    res["rest_of_cycle_ms"] = res["spd_cycle_ms"] - (sum(res["busy"]["less_dispatch_ms"]) + prof["comm_ms"])
    res["rest_of_cycle_includes"] = ("SPD cycle - (sum over the devices of their busy time, less a dispatch each, + "
                                     "collectives): ~0 if "
                                     "the devices sharing this host's cores ran one after another; negative when "
                                     "their work overlaps or the parts' per-call dispatch is not paid in the engine")
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {res['model']}  n={args.n} stages {res['stage_layers']}  backend {__import__('jax').default_backend()}")
    print(f"AR step            {res['ar_step_ms']:7.2f} ms")
    print(f"SPD cycle          {res['spd_cycle_ms']:7.2f} ms   ratio {res['ratio_spd_cycle_to_ar_step']:.2f}")
    print(f"pipeline cycle     {res['pipeline_cycle_ms']:7.2f} ms   ratio {res['ratio_pipeline_cycle_to_ar_step']:.2f}")
    print("collectives per cycle (the compiled loop's body): " + "; ".join(
        f"{k} {sum(c.values())} ({', '.join(f'{v} {op}' for op, v in sorted(c.items()))})"
        for k, c in res["collectives_per_cycle"].items()))
    print("profile (one call each, incl. dispatch):")
    print("  stages           " + " ".join(f"{t:.2f}" for t in prof["stage_ms"]) + f"  (sum {res['sum_of_stage_ms']:.2f},"
          f" slowest {prof['slowest_stage_ms']:.2f})")
    print(f"  PSM body         {prof['psm_ms']:7.2f} ms")
    print(f"  PSM head shard   {prof['psm_head_ms']:7.2f} ms (1/{args.n + own} of the head; every device runs one)")
    print(f"  verify shard     {prof['verify_ms']:7.2f} ms (1/{args.n + own} of the head; every device runs one)")
    print(f"  collectives      {prof['comm_ms']:7.2f} ms per cycle")
    print(f"  rest of a cycle  {res['rest_of_cycle_ms']:7.2f} ms (SPD cycle - (sum of every device's busy time below "
          "+ collectives); < 0: the devices' work overlaps or the parts' dispatch is not paid in the engine)")
    print_device_report(res)
    return 0


def method_options(args) -> tuple[tuple[int, ...] | None, dict]:
    """-> (the --stages counts or None, the SPD / pipeline methods' options): with --stages (n: their count) or
    --psm-layers a random PSM, of --psm-layers layers (2 with --stages: the shipped PSM's plan is the default's)."""
    stage_layers = tuple(int(c) for c in args.stages.split(",")) if args.stages else None
    if stage_layers:
        args.n = args.n or len(stage_layers)
        args.psm_layers = args.psm_layers or 2
    args.n = args.n or 8
    return stage_layers, (dict(n=args.n, stage_layers=stage_layers)
                          | (dict(spec="random", psm_layers=args.psm_layers) if args.psm_layers else {}))


def device_report(model, plan, prof: dict, psm_layers: int, S0: float, project_context: int) -> dict:
    """Per-device busy times per cycle (measured; predicted by the cost model fitted here, for the current
    and the device-aware plan) and the three profiles' projections, as one JSON-able dict."""
    cfg, n = model.config, plan.n
    psm_cfg = PSMConfig.for_target(cfg, plan.counts, num_layers=psm_layers)  # what profile_cycle timed
    # every device its stage and one shard of each head; the PSM body on the last stage (psm_placement
    # "last": the reference the placement table of the projections compares the others with) or, with
    # --psm-placement own, on a device of its own without a stage (n + 1 shards of each head). Measured as one
    # call per device (`profile_cycle`'s device_ms: one dispatch, as the engine's one program), and as the sum
    # of its parts timed alone (a dispatch per part: 4 on the PSM's device, 3 elsewhere)
    measured, psm_device = list(prof["device_ms"]), prof["psm_device"]
    # the heads: one pass for both where the PSM reads the target's head (about one shard's time), else two
    heads_ms = prof["verify_ms"] + (0.0 if psm_cfg.reads_target_head else prof["psm_head_ms"])
    parts_sum = [t + heads_ms for t in prof["stage_ms"] + ([0.0] if psm_device == n else [])]
    parts_sum[psm_device] += prof["psm_ms"]
    compute = [t - prof["dispatch_ms"] for t in measured]  # less one trivial call's dispatch each
    cpu_bytes = jnp.dtype(model.dtype).itemsize
    cpu = calibration.fit_cpu(prof, cfg, psm_cfg, param_bytes=cpu_bytes)
    ctx = prof["context"]

    def plans(hw, context, param_bytes, heads):
        busy = cycle.device_busy(cfg, plan, psm_cfg, hw, context, param_bytes, heads, psm_device)
        aware, aware_busy = cycle.device_aware_plan(cfg, n, psm_cfg, hw, context, param_bytes, heads, psm_device)
        return dict(current=dict(stage_layers=list(plan.counts), busy_ms=[1e3 * b for b in busy],
                                 imbalance=cycle.imbalance(busy)),
                    device_aware=dict(stage_layers=list(aware.counts), busy_ms=[1e3 * b for b in aware_busy],
                                      imbalance=cycle.imbalance(aware_busy))), aware

    predicted, _ = plans(cpu, ctx, cpu_bytes, "sharded")
    # validation on this host: each measured part against the fitted model (in-sample: the fit used them),
    # and two figures it did not use: the AR step, and the SPD cycle as the SUM of the parts (serial here)
    cc = cycle.cycle_costs(cfg, plan, psm_cfg, ctx, cpu_bytes, psm_device=psm_device)
    fit_parts = dict(stage_ms=[1e3 * cpu.part_s(st) for st in cc.stages], psm_ms=1e3 * cpu.part_s(cc.psm_body),
                     psm_head_ms=1e3 * cpu.part_s([cc.psm_head_shard]), verify_ms=1e3 * cpu.part_s([cc.head_shard]),
                     comm_ms=1e3 * cycle.comm_s(cc, cpu))
    cpu_pred = cycle.predict(cfg, n, psm_cfg, cpu, ctx, S0, plan, cpu_bytes, psm_device=psm_device)
    validation = dict(parts_predicted=fit_parts, ar_step_ms_predicted=1e3 * cpu_pred["ar_step_s"],
                      spd_cycle_serial_ms_predicted=1e3 * (sum(cpu_pred["device_busy_s"]) + cpu_pred["spd_comm_s"]))
    projections = []
    for hw, context, pb in ((cpu, ctx, cpu_bytes), (cycle.H200_NVLINK, project_context, 2),
                            (cycle.TPU_V5E_ICI, project_context, 2)):
        rows = {}
        for heads in ("last", "sharded"):
            _, aware = plans(hw, context, pb, heads)
            now = cycle.predict(cfg, n, psm_cfg, hw, context, S0, plan, pb, heads=heads)
            # the same acceptance rate (alpha) on the other plan
            alt = cycle.predict(cfg, n, psm_cfg, hw, context, S0, aware, pb, alpha=now["alpha"], heads=heads)
            rows[f"heads_{heads}"] = dict(current=now, device_aware=alt)
        # where the PSM body runs (sharded heads, the current plan, the same alpha): the last stage, the
        # stage the cost model picks (the engine's default), a device of its own (n + 1 devices)
        best, _ = cycle.best_psm_device(cfg, plan, psm_cfg, hw, context, pb)
        rows["psm_placement"] = {name: cycle.predict(cfg, n, psm_cfg, hw, context, S0, plan, pb, psm_device=d)
                                 for name, d in (("last stage", n - 1), (f"stage {best} (auto)", best),
                                                 (f"own device ({n + 1} devices)", n))}
        projections.append(dict(hardware=dataclasses.asdict(hw), **rows,
                                label="fitted here; projection for n such devices in parallel" if not hw.projection
                                else "projection: " + hw.assumes))
    return dict(busy=dict(psm_device=psm_device, measured_ms=measured, measured_imbalance=cycle.imbalance(measured),
                          less_dispatch_ms=compute, less_dispatch_imbalance=cycle.imbalance(compute),
                          parts_sum_ms=parts_sum, parts_sum_imbalance=cycle.imbalance(parts_sum),
                          includes="per device per cycle: its stage's layers, one shard of the verification and "
                                   "PSM heads, on psm_device (the last stage, or n: a device of its own without a "
                                   "stage) also the PSM body, as one jitted call, the devices called in turn (one "
                                   "host dispatch; less_dispatch: minus a trivial call's, the compute alone; "
                                   "parts_sum: the parts timed alone, a dispatch each, each repeated on its own, so "
                                   "its weights may stay in the CPU's cache); collectives excluded (all devices "
                                   "take part)"),
                cost_model=dict(cpu_fit=dataclasses.asdict(cpu), context=ctx, param_bytes=cpu_bytes,
                                heads="sharded", predicted=predicted, validation=validation),
                S0_projected=S0, projections=projections)


def print_device_report(res: dict) -> None:
    ms = lambda xs: " ".join(f"{x:6.2f}" for x in xs)  # noqa: E731
    b, cm = res["busy"], res["cost_model"]
    where = "its own device (the last column)" if res["busy"]["psm_device"] == res["n"] else "the last stage"
    print(f"busy per device per cycle (ms; stage + a shard of each head, the PSM body on {where}; collectives apart):")
    print(f"  measured, one call  {ms(b['measured_ms'])}   max/mean {b['measured_imbalance']:.2f}")
    print(f"  less its dispatch   {ms(b['less_dispatch_ms'])}   max/mean {b['less_dispatch_imbalance']:.2f}")
    print(f"  sum of parts alone  {ms(b['parts_sum_ms'])}   max/mean {b['parts_sum_imbalance']:.2f}  (a dispatch per "
          "part)")
    for key in ("current", "device_aware"):
        p = cm["predicted"][key]
        print(f"  model, {key:12s} {ms(p['busy_ms'])}   max/mean {p['imbalance']:.2f}  stages {p['stage_layers']}")
    print(f"  CPU fit: {cm['cpu_fit']['assumes']}")
    v, fp = cm["validation"], cm["validation"]["parts_predicted"]
    print(f"  fitted parts: stages {ms(fp['stage_ms'])}  PSM body {fp['psm_ms']:.2f}  PSM head shard "
          f"{fp['psm_head_ms']:.2f}  verify shard {fp['verify_ms']:.2f}  collectives {fp['comm_ms']:.2f}")
    print(f"  not fitted: AR step predicted {v['ar_step_ms_predicted']:.2f} ms (measured {res['ar_step_ms']:.2f}); SPD "
          f"cycle as the sum of its parts {v['spd_cycle_serial_ms_predicted']:.2f} ms (measured {res['spd_cycle_ms']:.2f})")
    print(f"  device-aware plan (opt-in): --stages {','.join(map(str, cm['predicted']['device_aware']['stage_layers']))}")
    print(f"projections at S0 {res['S0_projected']:.2f} (wall-clock speedup over ar, communication included):")
    for pr in res["projections"]:
        print(f"  {pr['hardware']['name']}: {pr['label']}")
        for heads in ("last", "sharded"):
            for tag, r in pr[f"heads_{heads}"].items():
                print(f"    heads {heads:7s} {tag:12s} {str(r['stage_layers']):26s} spd {r['speedup_spd']:5.2f}  tp "
                      f"{r['speedup_tp']:5.2f}  pipeline {r['speedup_pipeline']:5.2f}  (ar {1e6 * r['ar_step_s']:.0f} "
                      f"us, cycle {1e6 * r['spd_cycle_s']:.0f} us, max/mean {r['imbalance']:.2f})")
        for name, r in pr["psm_placement"].items():
            print(f"    PSM on {name:26s} spd {r['speedup_spd']:5.2f}  (cycle {1e6 * r['spd_cycle_s']:.0f} us, "
                  f"max/mean {r['imbalance']:.2f})")


if __name__ == "__main__":
    raise SystemExit(main())
