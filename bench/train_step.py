"""Cost of one PSM training step per variant (compute dtype, draft vocabulary), side by side in one run.

    python -m bench.train_step [--model smollm2-135m-instruct] [--n 8] [--batch 8] [--seq 512] [--repeats 3]
                               [--response-share 1.0] [--variants float32:0,float32:16384,bfloat16:0]

A variant is DTYPE:V'[:P][+cache] (V' = 0: the PSM head over the whole vocabulary; P: `fill_accept`,
omitted for the paper's fills; +cache: the step reads the target's features from the teacher cache, as
every pass after a corpus's first does (`teacher_cache=true`): the anchor states, last hidden state and
the teacher's greedy token per query, computed once before timing and fed as host arrays, so the step
runs no teacher forward and, with V' > 0, only V' rows of the teacher's head). Measures, per variant, on
one device (mesh 1x1), random tokens whose last --response-share of positions are in the loss (a prompt,
then a response; the PSM's groups and heads run only there, and a query at fill k costs k group slots,
so both move the step's cost):
  teacher_ms      the frozen target's forward alone (anchor states and logits), jitted
  step_ms         the whole optimiser step (PSM forward and backward, AdamW update; the teacher's
                  forward unless +cache)
  tokens_s        batch * seq / step time
  positions_s     response positions (those in the loss) per second: batch * share * seq / step time
  cold_positions_s  with +cache, a pass that fills the cache: positions over the step plus the cache's
                  teacher forward (`train.step.make_teacher`: anchor states, and the argmax at the queries)
and each variant's speedup over the first. Times are medians over --repeats after one compiling call; they
include the step's computation and the copy of its host (numpy) batch to the device on each call, as in
training (train.main feeds host batches, and host features read from the cache), with one block at the
end; compilation is excluded. The default compares the n = 8 recipe's path (float32, whole vocabulary,
the paper's fills, the teacher inside the step) with the fast one (a draft vocabulary of 16,384, the
fills at the shipped PSM's acceptance 0.45, the teacher cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.drafters.psm import PSMConfig, teacher_states
from spd_jax.models import decoder
from spd_jax.sharding import data_model_mesh, put
from train import corpus as train_corpus
from train import step as train_step
from train.config import TrainConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--response-share", type=float, default=1.0,
                    help="share of each sequence's positions in the loss (its end); 1.0: every position")
    ap.add_argument("--variants", default="float32:0,float32:16384:0.45+cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    model = spd_jax.load_model(args.model)
    plan = pipelined.plan_for(model, args.n)
    mesh = data_model_mesh(1, 1)
    rng = np.random.default_rng(0)
    if not 0.0 < args.response_share <= 1.0:
        ap.error(f"--response-share must be in (0, 1], got {args.response_share}")
    mask = np.zeros(args.seq, bool)
    mask[args.seq - max(round(args.response_share * args.seq), 1):] = True
    # buckets of 128 as the shipped configs' (128, 256, 384, 512): the queries pad to one of them
    buckets = tuple(range(128, args.seq, 128)) + (args.seq,)
    batch = train_corpus.pad_batch([(rng.integers(0, model.config.vocab_size, args.seq).astype(np.int32), mask)
                            for _ in range(args.batch)], buckets)

    def timed(fn):
        out = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    res, teacher_s = {}, {}
    for variant in args.variants.split(","):
        settings, _, cached = variant.partition("+")
        if cached not in ("", "cache"):
            ap.error(f"variant {variant!r}: DTYPE:V'[:P][+cache]")
        dt, dv, *fill = settings.split(":")
        tc = TrainConfig.of(model=args.model, n=args.n, batch_size=args.batch, compute_dtype=dt,
                              draft_vocab=int(dv), fill_accept=float(fill[0]) if fill else None)
        spec = PSMConfig.for_target(model.config, plan.counts, 2, draft_vocab=tc.draft_vocab)
        ids = np.arange(spec.draft_vocab) if spec.draft_vocab else None
        target = train_step.compute_target(model, tc)

        @jax.jit
        def teacher(target, tokens):
            h, x = teacher_states(target, tokens, model.config, spec.anchors)
            return h, decoder.lm_logits(target, x, model.config)

        if dt not in teacher_s:  # the same program for every variant of a dtype: timed once
            tokens = jnp.asarray(batch["tokens"])
            jax.block_until_ready(teacher(target, tokens))
            teacher_s[dt] = timed(lambda: teacher(target, tokens))
        t_teacher = teacher_s[dt]
        fed = batch
        if cached:  # what TeacherCache.get reads back: host arrays
            fill_teacher = train_step.make_teacher(model.config, spec, mesh)
            h, x, top = fill_teacher(target, batch["tokens"], batch["query"])
            t_fill = timed(lambda: fill_teacher(target, batch["tokens"], batch["query"]))  # a first pass's extra work
            fed = dict(batch, anchor_states=np.asarray(h), final_hidden=np.asarray(x), teacher_argmax=np.asarray(top))

        opt = train_step.make_optimizer(tc)
        state, frozen = train_step.init_state(model, spec, tc, opt, ids)
        step = train_step.make_step(model.config, spec, tc, opt, mesh)
        # placed as train.main places them: the step's outputs come back replicated, and an input
        # placed otherwise would compile the step a second time on the second call
        rep = NamedSharding(mesh, PartitionSpec())
        holder = {"s": put(state, rep)}
        frozen = put(frozen, rep)

        def one():
            holder["s"], met = step(holder["s"], frozen, target, fed)
            return met

        t0 = time.perf_counter()
        jax.block_until_ready(one())
        compile_s = time.perf_counter() - t0
        t_step = timed(one)
        positions = float(batch["mask"].sum())
        res[variant] = dict(teacher_ms=t_teacher * 1e3, step_ms=t_step * 1e3, first_call_s=compile_s,
                            tokens_s=args.batch * args.seq / t_step, positions_s=positions / t_step)
        if cached:
            res[variant]["cold_positions_s"] = positions / (t_step + t_fill)
    first = next(iter(res.values()))
    res["speedup_over_first"] = {k: dict(teacher=first["teacher_ms"] / r["teacher_ms"], step=first["step_ms"] / r["step_ms"],
                                        **({"cold": r["cold_positions_s"] / first["positions_s"]}
                                           if "cold_positions_s" in r else {}))
                                 for k, r in list(res.items())[1:]}
    res["setup"] = dict(model=args.model, n=args.n, batch=args.batch, seq=args.seq,
                        response_share=args.response_share, backend=jax.default_backend())
    print(json.dumps(res, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
