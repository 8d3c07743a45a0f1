"""Decode speed of spd_jax.generate against transformers' generate, side by side on the same weights.

    python -m bench.ar_decode [--model smollm2-135m-instruct] [--new-tokens 128] [--repeats 5]

Both decode greedily from the same prompt for exactly --new-tokens tokens (EOS ignored), in float32,
after one warm-up run each; runs alternate between the two so drift in machine load hits both.
Reported per engine (median over repeats):
  e2e_tokens_per_s     new tokens / wall time of the whole generate call (prefill + decode, host
                       dispatch and the final device-to-host copy; compilation excluded by the warm-up)
  decode_tokens_per_s  spd_jax only: tokens after the first / time of its on-device decode loop
The ratio line compares e2e tokens/s, the like-for-like figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tqdm import tqdm

PROMPT = "Explain how a bicycle works, step by step."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ar_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM

    import spd_jax

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

    _, _, ours_ids = run_ours()  # warm-up (compiles)
    _, hf_ids = run_hf()
    same = ours_ids == hf_ids
    ours_wall, ours_dec, hf_wall = [], [], []
    for _ in tqdm(range(args.repeats), desc="alternating runs", disable=args.json):
        w, d, _ = run_ours()
        ours_wall.append(w)
        ours_dec.append(d)
        hf_wall.append(run_hf()[0])

    res = dict(
        model=str(model.path), new_tokens=n, prompt_tokens=len(ids), repeats=args.repeats,
        torch_threads=torch.get_num_threads(), jax_backend=__import__("jax").default_backend(),
        hf_attn=hf.config._attn_implementation, greedy_tokens_equal=same,
        spd_jax_e2e_tokens_per_s=n / statistics.median(ours_wall),
        spd_jax_decode_tokens_per_s=statistics.median(ours_dec),
        transformers_e2e_tokens_per_s=n / statistics.median(hf_wall),
    )
    res["ratio_e2e"] = res["spd_jax_e2e_tokens_per_s"] / res["transformers_e2e_tokens_per_s"]
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v:.2f}" if isinstance(v, float) else f"{k:32s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
