"""Compile time and peak memory per method, pipeline depth and prompt length, cold and from the
persistent compilation cache.

    python -m bench.compile [--model smollm2-135m-instruct] [--methods ar,tp,pipeline,spd] [--n 2,4,8]
                            [--prompt-lens 128,512,2048] [--json]

Each measurement is a fresh process (so no in-process cache helps) generating 2 tokens from a prompt of
random ids: first with an empty persistent-cache directory (cold: `compile_s` is XLA compilation),
then again with that directory filled (`compile_s` is loading the executables). `peak_rss_mb` is the
child process's peak resident memory: model, compilation and run together, an upper bound on what
compilation needs. The prompt length sets the shape bucket; the tokens do not matter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

import spd_jax  # imports JAX without starting its backend: _child still picks the device count
from spd_jax.methods import METHODS
from spd_jax.progress import progress_bar
from spd_jax.sharding import request_cpu_devices


def _child(args) -> int:
    method = METHODS[args.method].taking(n=args.n, spec="random")
    if method.multi_process:
        request_cpu_devices(args.n)  # before JAX initialises its backend (the first array)
    spd_jax.enable_persistent_cache(args.cache)
    model = spd_jax.load_model(args.model)
    ids = np.random.default_rng(0).integers(10, model.config.vocab_size, args.prompt_len).tolist()
    res = spd_jax.generate(model, ids, 2, method=method, stop_at_eos=False)
    print(json.dumps(dict(compile_s=res.stats["compile_s"], compile_from=res.stats["compile_from"],
                          peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="ar,tp,pipeline,spd")
    ap.add_argument("--n", default="2,4,8")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.n = int(args.n)
        return _child(args)

    cases = [(m, int(n), int(p)) for m in args.methods.split(",")
             for n in (args.n.split(",") if METHODS[m].multi_process else ["1"]) for p in args.prompt_lens.split(",")]
    rows = []
    for method, n, plen in progress_bar(cases, desc="compile", unit="case"):
        with tempfile.TemporaryDirectory() as cache:
            row = dict(method=method, n=n, prompt_len=plen)
            for phase in ("cold", "cached"):
                cmd = [sys.executable, "-m", "bench.compile", "--child", "--model", args.model, "--method", method,
                       "--n", str(n), "--prompt-len", str(plen), "--cache", cache]
                r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if r.returncode != 0:
                    row[phase] = dict(error=r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed")
                    continue
                row[phase] = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| method | n | prompt | cold compile_s | cold peak MB | from cache s | source |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        c, w = r.get("cold", {}), r.get("cached", {})
        print(f"| {r['method']} | {r['n']} | {r['prompt_len']} | {c.get('compile_s', float('nan')):.1f} | "
              f"{c.get('peak_rss_mb', float('nan')):.0f} | {w.get('compile_s', float('nan')):.2f} | "
              f"{w.get('compile_from', w.get('error', '?'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
