"""Throughput of spd_jax.generate_batch, against the machine's bound for the same dots, in one run.

    python -m bench.generate_batch [--model smollm2-135m-instruct] [--batch 32] [--new-tokens 64]
                                   [--bench mt_bench] [--variants float32,bfloat16,single] [--repeats 3] [--json]

The bulk-generation question (the target's replies, train/replies.py): how close does continuing B prompts
in one on-device program come to what this machine's matmuls allow? For each batch size B, the first B
first-turn prompts of --bench (chat template) are continued greedily, EOS ignored, to one max_len (the
longest prompt + --new-tokens), so row b gets max_len - len(prompt b) new tokens. Variants:
  float32, bfloat16   generate_batch with the weights in that dtype (bf16: bf16-in, float32-out dots)
  single              generate called once per prompt, one after another (the batch-of-one path)
Per variant, tokens / wall time of one call, including prefill, host dispatch and the copy of the tokens
to the host; compilation is excluded by a warm-up call; runs alternate between variants and the median
over --repeats is reported, so drift in machine load hits all. Also: how many rows equal the float32
batch's (greedy; bf16 weights are another model, and summation order can break a near tie).

Two bounds, per dtype. dots: the decode step's matmuls alone ([B, K] x every weight matrix of the model,
its LM head included, in one program): B / that time is what a step doing nothing but its matmuls would
reach (attention, prefill, sampling and the loop are extra). peak: the step's FLOPs at the rate of a
large square matmul (2048^3), what the machine's compute allows at all. Figures hold for the machine that
printed them: compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import spd_jax
from spd_jax.datasets import read_benchmark
from spd_jax.models import decoder
from spd_jax.models.layers import dense
from spd_jax.progress import progress_bar

VARIANTS = ("float32", "bfloat16", "single")


def timed(f, *args, repeats: int = 5) -> float:
    """Median seconds of f(*args) after one warm-up call."""
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def step_matrices(model, dtype: str) -> list[jax.Array]:
    """Every weight matrix one decode step multiplies by (`decoder.decode_layers`' layout: q, k, v fused),
    its LM head [H, V] included, in dtype."""
    mats = [w for lp in decoder.decode_layers(model.params["layers"], model.config) for name, w in lp.items()
            if w.ndim == 2 and name != "conv_w"]  # a conv kernel is no dot
    head = decoder.lm_head(model.params, model.config).T
    return [w.astype(dtype) for w in mats + [head]]


@jax.jit
def _dots(xs: dict, mats: list) -> list[jax.Array]:
    return [dense(xs[str(w.shape[0])], w) for w in mats]  # outputs, not their sums: a fused sum slows the dot


def dots_bound(model, batch: int, dtype: str) -> dict:
    """The step's dots alone, [batch, K] x every weight matrix, in one program -> tokens/s and GFLOP/s;
    and the compute peak of a 2048^3 matmul in dtype."""
    rng = np.random.default_rng(0)
    mats = step_matrices(model, dtype)
    xs = {str(k): jnp.asarray(rng.standard_normal((batch, k), np.float32)) for k in {int(w.shape[0]) for w in mats}}
    s = timed(_dots, xs, mats)
    flops = sum(2 * batch * int(w.shape[0]) * int(w.shape[1]) for w in mats)
    a = jnp.asarray(rng.standard_normal((2048, 2048), np.float32))
    peak = 2 * 2048 ** 3 / timed(jax.jit(dense), a, a.astype(dtype)) / 1e9
    return dict(bound_tokens_per_s=batch / s, dots_gflop_s=flops / s / 1e9, square_peak_gflop_s=peak,
                peak_tokens_per_s=peak * 1e9 * batch / flops)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.generate_batch", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", default="32", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bench", default="mt_bench", help="a benchmark name of infer.evaluate or a JSONL file")
    ap.add_argument("--variants", default="float32,bfloat16", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    if min(sizes) < 1 or args.new_tokens < 1 or args.repeats < 1:
        ap.error("--batch sizes, --new-tokens and --repeats must be positive")
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants must name some of {', '.join(VARIANTS)}, got {args.variants!r}")

    model = spd_jax.load_model(args.model)
    prompts = [p["ids"] if "ids" in p else model.encode(p["text"]) for p in read_benchmark(args.bench, max(sizes))]
    if len(prompts) < max(sizes):
        ap.error(f"--bench {args.bench} holds {len(prompts)} prompts, fewer than the largest batch {max(sizes)}")

    def call(variant, ps, max_len):
        t0 = time.perf_counter()
        if variant == "single":
            out = [spd_jax.generate(model, p, max_new_tokens=max_len - len(p), stop_at_eos=False).token_ids
                   for p in ps]
        else:
            out = spd_jax.generate_batch(model, ps, max_len, stop_at_eos=False, weights_dtype=variant)
        return time.perf_counter() - t0, out

    results = []
    for b in progress_bar(sizes, desc="batch sizes", disable=args.json):
        ps = prompts[:b]
        max_len = max(len(p) for p in ps) + args.new_tokens
        for v in variants:
            call(v, ps, max_len)  # warm-up: compiles this batch's shapes
        times = collections.defaultdict(list)
        outs = {}
        for _ in range(args.repeats):
            for v in variants:
                t, outs[v] = call(v, ps, max_len)
                times[v].append(t)
        tokens = sum(max_len - len(p) for p in ps)
        ref = outs.get("float32")
        for v in variants:
            assert sum(len(o) for o in outs[v]) == tokens
            row = dict(batch=b, variant=v, tokens=tokens, mean_prompt_tokens=round(statistics.mean(map(len, ps)), 1),
                       tokens_per_s=tokens / statistics.median(times[v]),
                       rows_equal_float32=None if ref is None else sum(a == r for a, r in zip(outs[v], ref)))
            row.update(dots_bound(model, b, v) if v != "single" else {})
            if "bound_tokens_per_s" in row:
                row["share_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
            results.append(row)

    setup = dict(model=str(model.path), bench=args.bench, new_tokens=args.new_tokens, repeats=args.repeats,
                 jax_backend=jax.default_backend(), devices=len(jax.devices()))
    if args.json:
        print(json.dumps(dict(setup, results=results)))
        return 0
    print(" ".join(f"{k}={v}" for k, v in setup.items()))
    print(f"{'B':>4} {'variant':>9} {'prompt':>7} {'tokens':>7} {'tok/s':>8} {'dots bound':>11} {'share':>6} "
          f"{'dots GFLOP/s':>13} {'peak bound':>11} {'2048^3 GFLOP/s':>15} {'rows = f32':>10}")
    for r in results:
        bound = (f"{r['bound_tokens_per_s']:>11.1f} {r['share_of_bound']:>6.2f} {r['dots_gflop_s']:>13.1f} "
                 f"{r['peak_tokens_per_s']:>11.1f} {r['square_peak_gflop_s']:>15.1f}" if "bound_tokens_per_s" in r
                 else f"{'-':>11} {'-':>6} {'-':>13} {'-':>11} {'-':>15}")
        eq = "-" if r["rows_equal_float32"] is None else f"{r['rows_equal_float32']}/{r['batch']}"
        print(f"{r['batch']:>4} {r['variant']:>9} {r['mean_prompt_tokens']:>7} {r['tokens']:>7} "
              f"{r['tokens_per_s']:>8.1f} {bound} {eq:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
