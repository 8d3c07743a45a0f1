"""python -m bench.psm_rows: the PSM body's time against the rows it recomputes, to tell whether this backend is
bound by its arithmetic or its memory there (the bytes read stay the same as the rows grow; the FLOPs do not).

    python -m bench.psm_rows [--model smollm2-135m-instruct] [--n 8] [--context 72]

Per row count: the median of 30 calls of the PSM body as the engine runs it (`PSMDrafter`: layers and cache one
buffer each; a random PSM, one jitted call each, host dispatch included), with the cost model's GFLOP and MB; then
a plain [H, 8H] matmul at 1 and 9 rows for comparison."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import spd_jax
from spd_jax.drafters import registry
from spd_jax.drafters.psm import PSM, PSMConfig, PSMDrafter, init_psm
from spd_jax.drafters.psm.engine import BLOCK_COMPLETED_ROWS
from spd_jax.costs.cycle import default_plan
from spd_jax.costs.profile import median_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.psm_rows", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context", type=int, default=72)
    args = ap.parse_args(argv)
    model = spd_jax.load_model(args.model)
    cfg = model.config
    spec = PSMConfig.for_target(cfg, default_plan(cfg, args.n).counts, num_layers=2)
    drafter = PSMDrafter(cfg, spec)
    variables = drafter.engine_params(init_psm(cfg, spec, model.params, dtype=model.dtype))
    pos = args.context
    print("| rows | GFLOP | MB | ms |\n|---|---|---|---|")
    for rows in (1, 3, 5, 9, 17):
        cache = drafter.init((), pos + 64, model.dtype)
        h = jnp.zeros((rows, spec.m, cfg.hidden_size), model.dtype)
        body = jax.jit(lambda v, c, h, r=rows: drafter.module.apply(v, h, c, pos - r + 1, pos, pos - r + 1,
                                                                    BLOCK_COMPLETED_ROWS, method=PSM.draft_hidden)[0])
        nbytes = jnp.dtype(model.dtype).itemsize
        parts = registry.PSM.cost(cfg, spec, pos, nbytes, nbytes, rows=rows)[:-1]  # without the head
        print(f"| {rows} | {sum(c.flops for c in parts) / 1e9:.3f} | {sum(c.bytes for c in parts) / 1e6:.1f} | "
              f"{median_ms(body, variables, cache, h):.2f} |")
    W = jnp.ones((cfg.hidden_size, 8 * cfg.hidden_size), model.dtype)
    for rows in (1, 9):
        x = jnp.ones((rows, cfg.hidden_size), model.dtype)
        print(f"matmul [{rows}, {cfg.hidden_size}] x [{cfg.hidden_size}, {8 * cfg.hidden_size}] "
              f"({W.size * W.dtype.itemsize / 1e6:.1f} MB): {median_ms(jax.jit(lambda x, W: x @ W), x, W):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
