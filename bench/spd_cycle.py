"""Cost of one SPD cycle against one autoregressive step, side by side on the same backend and model.

    python -m bench.spd_cycle [--model smollm2-135m-instruct] [--n 8] [--new-tokens 64] [--repeats 3]

Measures, in one run:
  ar_step_ms      the on-device AR decode loop's time per token (spd_jax.generate, method="ar")
  spd_cycle_ms    (SPD wall - SPD prefill wall) / cycles, with a random PSM (acceptance does not change
                  the cost of a cycle); wall = the whole on-device loop incl. every stage, transfers
                  and all-reduces, and the final device-to-host copy; prefill measured by a 1-token run
  pipeline_cycle_ms  the same for the plain pipeline (no PSM)
  ratio           spd_cycle_ms / ar_step_ms
and the cycle profile (spd_jax.pipeline.profile): each stage, the PSM draft, verification, collectives.
On a CPU host the n "devices" share its cores, so stages run one after another: the ideal cycle costs
about one AR step (all layers) plus the PSM and the collectives.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spd_cycle", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--psm-layers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from spd_jax.sharding import request_cpu_devices

    request_cpu_devices(args.n)
    import logging

    logging.getLogger("spd_jax").setLevel(logging.ERROR)
    import spd_jax
    from spd_jax.decode.pipelined import plan_for
    from spd_jax.pipeline.profile import profile_cycle

    model = spd_jax.load_model(args.model)
    ids = model.encode("Explain how a bicycle works, step by step.")
    N = args.new_tokens
    kw = dict(stop_at_eos=False, n=args.n, psm_layers=args.psm_layers)

    def ar_step():
        r = spd_jax.generate(model, ids, N, stop_at_eos=False)
        return 1e3 * r.stats["decode_s"] / (N - 1)

    def cycle(method):
        full = spd_jax.generate(model, ids, N, method=method, **kw).stats
        pre = spd_jax.generate(model, ids, 1, method=method, **kw).stats
        return 1e3 * (full["wall_s"] - pre["wall_s"]) / full["cycles"], full

    ar_step(), cycle("spd"), cycle("pipeline")  # warm-up (compiles)
    ar, spd, pipe = [], [], []
    for _ in range(args.repeats):
        ar.append(ar_step())
        spd.append(cycle("spd")[0])
        pipe.append(cycle("pipeline")[0])
    _, spd_stats = cycle("spd")
    prof = profile_cycle(model, plan_for(model, args.n), psm_layers=args.psm_layers, context=len(ids) + N // 2)
    res = dict(model=str(model.path), n=args.n, new_tokens=N, stage_layers=spd_stats["stage_layers"],
               ar_step_ms=statistics.median(ar), spd_cycle_ms=statistics.median(spd),
               pipeline_cycle_ms=statistics.median(pipe), spd_alpha_random_psm=spd_stats["alpha"],
               profile=prof)
    res["ratio_spd_cycle_to_ar_step"] = res["spd_cycle_ms"] / res["ar_step_ms"]
    res["ratio_pipeline_cycle_to_ar_step"] = res["pipeline_cycle_ms"] / res["ar_step_ms"]
    res["sum_of_stage_ms"] = sum(prof["stage_ms"])
    res["unexplained_ms"] = res["spd_cycle_ms"] - (res["sum_of_stage_ms"] + prof["psm_ms"] + prof["verify_ms"]
                                                   + prof["comm_ms"])
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {res['model']}  n={args.n} stages {res['stage_layers']}  backend {__import__('jax').default_backend()}")
    print(f"AR step            {res['ar_step_ms']:7.2f} ms")
    print(f"SPD cycle          {res['spd_cycle_ms']:7.2f} ms   ratio {res['ratio_spd_cycle_to_ar_step']:.2f}")
    print(f"pipeline cycle     {res['pipeline_cycle_ms']:7.2f} ms   ratio {res['ratio_pipeline_cycle_to_ar_step']:.2f}")
    print("profile (one call each, incl. dispatch):")
    print("  stages           " + " ".join(f"{t:.2f}" for t in prof["stage_ms"]) + f"  (sum {res['sum_of_stage_ms']:.2f},"
          f" slowest {prof['slowest_stage_ms']:.2f})")
    print(f"  PSM draft        {prof['psm_ms']:7.2f} ms")
    print(f"  verify           {prof['verify_ms']:7.2f} ms")
    print(f"  collectives      {prof['comm_ms']:7.2f} ms per cycle")
    print(f"  rest of a cycle  {res['unexplained_ms']:7.2f} ms (cycle - sum of stages - PSM - verify - collectives)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
