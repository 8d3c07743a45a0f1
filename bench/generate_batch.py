"""Throughput of spd_jax.generate_batch against spd_jax.generate called once per prompt, side by side.

    python -m bench.generate_batch [--model smollm2-135m-instruct] [--batch 1,8,32] [--new-tokens 64]
                                   [--bench mt_bench] [--repeats 3] [--json]

The bulk-generation question (self-distillation data, train/distill.py): does continuing B prompts in one
on-device program beat B calls of the single-sequence decoder on this machine? For each batch size B,
the first B first-turn prompts of --bench (chat template) are continued greedily, EOS ignored, in float32,
to one max_len (the longest prompt + --new-tokens, generate_batch's one length), so each row gets
max_len - its prompt's length new tokens, and each single call is given exactly that many: both paths
make the same tokens at the same contexts.
  batch_tokens_per_s    tokens / wall time of one generate_batch call
  single_tokens_per_s   tokens / wall time of B generate calls, one after another
  ratio                 batch / single: what batching buys here
Both wall times include host dispatch and the final copy of the tokens to the host; compilation is
excluded by a warm-up call of each path with the same shapes. Runs alternate between the paths and the
median over --repeats is reported, so drift in machine load hits both. Also checked: each batched row
equals its single-prompt continuation (greedy; the batched matmuls may sum in another order, so a row can
differ after a near-tie: reported as a count, not asserted). Figures hold only for the machine that
printed them; compare only numbers from the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from spd_jax.progress import progress_bar


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.generate_batch", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--bench", default="mt_bench", help="a benchmark name of infer.evaluate or a JSONL file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch.split(",")]
    if min(sizes) < 1 or args.new_tokens < 1 or args.repeats < 1:
        ap.error("--batch sizes, --new-tokens and --repeats must be positive")

    import jax

    import spd_jax
    from infer.evaluate import read_benchmark

    model = spd_jax.load_model(args.model)
    prompts = [p["ids"] if "ids" in p else model.encode(p["text"]) for p in read_benchmark(args.bench, max(sizes))]
    if len(prompts) < max(sizes):
        ap.error(f"--bench {args.bench} holds {len(prompts)} prompts, fewer than the largest batch {max(sizes)}")
    n = args.new_tokens

    def run_batch(ps, max_len):
        t0 = time.perf_counter()
        out = spd_jax.generate_batch(model, ps, max_len, stop_at_eos=False)
        return time.perf_counter() - t0, out

    def run_single(ps, max_len):
        t0 = time.perf_counter()
        out = [spd_jax.generate(model, p, max_new_tokens=max_len - len(p), stop_at_eos=False).token_ids for p in ps]
        return time.perf_counter() - t0, out

    results = []
    for b in progress_bar(sizes, desc="batch sizes", disable=args.json):
        ps = prompts[:b]
        max_len = max(len(p) for p in ps) + n
        run_batch(ps, max_len)  # warm-up: compiles this batch's shapes
        run_single(ps, max_len)
        batch_s, single_s = [], []
        for _ in range(args.repeats):
            t, single_out = run_single(ps, max_len)
            single_s.append(t)
            t, batch_out = run_batch(ps, max_len)
            batch_s.append(t)
        tokens = sum(len(o) for o in single_out)
        assert tokens == sum(len(o) for o in batch_out) == sum(max_len - len(p) for p in ps)
        results.append(dict(
            batch=b, tokens=tokens, mean_prompt_tokens=round(statistics.mean(len(p) for p in ps), 1),
            batch_tokens_per_s=tokens / statistics.median(batch_s),
            single_tokens_per_s=tokens / statistics.median(single_s),
            rows_equal=sum(a == s for a, s in zip(batch_out, single_out))))
        results[-1]["ratio"] = results[-1]["batch_tokens_per_s"] / results[-1]["single_tokens_per_s"]

    setup = dict(model=str(model.path), bench=args.bench, repeats=args.repeats, jax_backend=jax.default_backend(),
                 devices=len(jax.devices()))
    if args.json:
        print(json.dumps(dict(setup, results=results)))
    else:
        print(" ".join(f"{k}={v}" for k, v in setup.items()))
        print(f"{'B':>4} {'prompt':>7} {'tokens':>7} {'batch tok/s':>12} {'single tok/s':>13} {'ratio':>6} "
              f"{'rows equal':>11}")
        for r in results:
            print(f"{r['batch']:>4} {r['mean_prompt_tokens']:>7} {r['tokens']:>7} {r['batch_tokens_per_s']:>12.1f} "
                  f"{r['single_tokens_per_s']:>13.1f} {r['ratio']:>6.2f} {r['rows_equal']:>6}/{r['batch']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
