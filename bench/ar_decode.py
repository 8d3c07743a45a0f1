"""Decode speed of spd_jax.generate against transformers' generate, side by side on the same weights.

    python -m bench.ar_decode [--model smollm2-135m-instruct] [--new-tokens 128] [--repeats 5]

Both decode greedily from the same prompt for exactly --new-tokens tokens (EOS ignored), in float32,
after one warm-up run each; runs alternate between the two so drift in machine load hits both, with a
pause after each transformers run (torch's OpenMP workers keep spinning for a while after it).
Reported per engine (median over repeats):
  e2e_tokens_per_s     new tokens / wall time of the whole generate call (prefill + decode, host
                       dispatch and the final device-to-host copy; compilation excluded by the warm-up)
  decode_tokens_per_s  spd_jax only: tokens after the first / time of its on-device decode loop
The ratio line compares e2e tokens/s, the like-for-like figure.

The reference for our own speed, measured in the same process between the same runs:
  weights_stream_ms     median time of one jitted reduction over every parameter leaf (each leaf summed):
                        reading all weights once, which a decode step must do at least once per token
  roofline_tokens_per_s 1000 / weights_stream_ms, the memory-bound ceiling for one-sequence decoding
  fraction_of_roofline  spd_jax decode_tokens_per_s / roofline_tokens_per_s (and its range over the
                        repeats, each against the weight streams measured just before and after it)
  transformers_fraction_of_roofline  the same for transformers' e2e tokens/s
  torch_weights_stream_ms  the same reduction in torch (one .sum() per parameter): what reading the
                        weights costs torch, against which its per-token time shows its overhead
  compile_s             spd_jax's compile time of the warm-up run (prefill + decode loop)
The stream is measured right before and after each of our runs, so both see the same machine state.
A figure from one machine does not transfer to another: compare only numbers printed by the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

import spd_jax
from spd_jax.progress import progress_bar

PROMPT = "Explain how a bicycle works, step by step."
SETTLE_S = 0.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ar_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # torch and transformers (the reference) load only when this benchmark runs: importing them costs
    # seconds, which `--help` and the docs-command test would pay
    import torch
    from transformers import AutoModelForCausalLM

    model = spd_jax.load_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    ids = model.encode(PROMPT)
    n = args.new_tokens

    def run_ours():
        r = spd_jax.generate(model, ids, max_new_tokens=n, stop_at_eos=False)
        assert r.stats["tokens"] == n
        return r.stats["wall_s"], r.stats["decode_tokens_per_s"], r.token_ids

    def run_hf():
        t = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(t, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        wall = time.perf_counter() - t0
        assert out.shape[1] - len(ids) == n
        return wall, out[0, len(ids):].tolist()

    @jax.jit
    def stream_weights(params):
        # One reduction per leaf, summed: every byte of every weight is read once; the scalar output
        # keeps writes negligible.
        return sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree.leaves(params))

    def run_stream(k=5):
        ts = []
        for _ in range(k):
            t0 = time.perf_counter()
            stream_weights(model.params).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return ts

    def run_torch_stream(k=5):
        ts = []
        with torch.no_grad():
            for _ in range(k):
                t0 = time.perf_counter()
                sum(float(p.sum()) for p in hf.parameters())
                ts.append(time.perf_counter() - t0)
        return ts

    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    run_stream(2)  # compiles
    r = spd_jax.generate(model, ids, max_new_tokens=n, stop_at_eos=False)  # warm-up (compiles)
    compile_s, ours_ids = r.stats["compile_s"], r.token_ids
    _, hf_ids = run_hf()
    same = ours_ids == hf_ids
    ours_wall, ours_dec, hf_wall, stream_s, torch_stream_s, fractions = [], [], [], [], [], []
    for _ in progress_bar(range(args.repeats), desc="alternating runs", disable=args.json):
        hf_wall.append(run_hf()[0])
        torch_stream_s += run_torch_stream()
        time.sleep(SETTLE_S)
        around = run_stream()
        w, d, _ = run_ours()
        around += run_stream()
        ours_wall.append(w)
        ours_dec.append(d)
        stream_s += around
        fractions.append(d * statistics.median(around))

    res = dict(
        model=str(model.path), new_tokens=n, prompt_tokens=len(ids), repeats=args.repeats,
        torch_threads=torch.get_num_threads(), jax_backend=__import__("jax").default_backend(),
        hf_attn=hf.config._attn_implementation, greedy_tokens_equal=same,
        spd_jax_e2e_tokens_per_s=n / statistics.median(ours_wall),
        spd_jax_decode_tokens_per_s=statistics.median(ours_dec),
        transformers_e2e_tokens_per_s=n / statistics.median(hf_wall),
    )
    res["ratio_e2e"] = res["spd_jax_e2e_tokens_per_s"] / res["transformers_e2e_tokens_per_s"]
    stream_med = statistics.median(stream_s)
    res["weight_bytes"] = weight_bytes
    res["weights_stream_ms"] = 1e3 * stream_med
    res["weights_stream_GB_per_s"] = weight_bytes / stream_med / 1e9
    res["roofline_tokens_per_s"] = 1.0 / stream_med
    res["fraction_of_roofline"] = res["spd_jax_decode_tokens_per_s"] / res["roofline_tokens_per_s"]
    res["fraction_of_roofline_range"] = [round(min(fractions), 3), round(max(fractions), 3)]
    res["transformers_fraction_of_roofline"] = res["transformers_e2e_tokens_per_s"] / res["roofline_tokens_per_s"]
    res["transformers_ms_per_token"] = 1e3 / res["transformers_e2e_tokens_per_s"]
    res["torch_weights_stream_ms"] = 1e3 * statistics.median(torch_stream_s)
    res["compile_s"] = compile_s
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:34s} {v:.2f}" if isinstance(v, float) else f"{k:34s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
