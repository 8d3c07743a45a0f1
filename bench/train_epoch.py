"""A pass of PSM training over a recipe's real batches, from per-shape timings: how long a pass that reads the
teacher cache takes, and one that fills it, in the data order `train.corpus` forms (ORDER 2: by token bucket,
then by response count) and in the length order before it (ORDER 1).

    python -m bench.train_epoch [--config configs/train/smollm2-n8-replies.yaml] [--repeats 2] [--mesh 1x1]
                                [--json] [override ...]

The recipe's first epoch of batches (`train.corpus.batch_order` at its seed) is grouped by padded shape
(T tokens, Q queries: one compiled step each). Every shape either order uses is timed on one real batch of
it, after one compiling call, as the median of --repeats, on the recipe's path (`train.loop.fit`):
  read_ms   a cached pass's host part: the batch padded (`pad_batch`) and its features read by
            `TeacherCache.get` from a cache on disk (written for those sequences, warm in the page cache)
  fill_ms   a filling pass's: `TeacherCache.get` on an empty cache, which runs the teacher forward
            (`train.step.make_teacher`), copies the features to the host and writes them
  step_ms   the optimiser step fed the read features (host arrays, copied to the device; their values
            random, which the step's cost does not depend on)
A cached pass's time is the sum over its batches of read + step, a filling pass's of fill + step (a filling
step is fed device arrays: one host copy fewer, not counted); positions/s are the pass's response positions
over that time. Compilation is excluded. Also reported per order: the padded tokens and query slots, and
the share of the query slots that is real.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import spd_jax
from spd_jax.sharding import data_model_mesh, parse_mesh, put, request_cpu_devices
from train import corpus as train_corpus
from train import data as train_data
from train import step as train_step
from train.config import load
from train.features import TeacherCache
from bench.generate_batch import timed


def orders(train_set: list, tc) -> dict[str, list[np.ndarray]]:
    """The first epoch's batches in each order: ORDER 2 (train.corpus's) and ORDER 1 (by length)."""
    lengths = np.asarray([len(i) for i, _ in train_set])
    return {"bucket_then_responses": train_corpus.batch_order(train_corpus.sort_keys(train_set, tc.data.buckets), tc, 0),
            "length": train_corpus.batch_order(lengths, tc, 0)}


def shape_of(train_set: list, idx: np.ndarray, buckets) -> tuple[int, int]:
    """The padded (T, Q) of the batch of those sequences: its compiled step."""
    b = train_corpus.pad_batch([train_set[k] for k in idx], buckets)
    return b["tokens"].shape[1], b["query"].shape[1]


def time_shape(fns: dict, idx: np.ndarray, train_set: list, tc, repeats: int) -> dict:
    """One real batch's read, fill and step times (ms, medians of repeats after one compiling call)."""
    seqs = [train_set[k] for k in idx]
    rows = range(len(seqs))
    cache_args = (fns["model_path"], fns["spec"].anchors, fns["hidden"], fns["dtype"], fns["num_layers"])

    def fill():  # a new, empty cache each call: every get misses
        with tempfile.TemporaryDirectory() as d:
            b = train_corpus.pad_batch(seqs, tc.data.buckets)
            return TeacherCache(d, seqs, *cache_args).get(rows, b, lambda: fns["teacher"](b["tokens"], b["query"]))

    with tempfile.TemporaryDirectory() as d:
        cache = TeacherCache(d, seqs, *cache_args)
        values = np.random.default_rng(0).standard_normal(cache.features.shape, np.float32)
        cache.features[:] = (values.astype(ml_dtypes.bfloat16).view(np.uint16) if fns["dtype"] == "bfloat16"
                             else values)
        cache.argmax[:] = 0
        cache.filled[:] = True

        def read():
            b = train_corpus.pad_batch(seqs, tc.data.buckets)
            return dict(b, **cache.get(rows, b, None))

        read_ms = 1e3 * timed(read, repeats=repeats)
        fed = read()
    return dict(read_ms=read_ms, fill_ms=1e3 * timed(fill, repeats=repeats),
                step_ms=1e3 * timed(lambda: fns["step"](fed), repeats=repeats))


def pass_times(batches: list, shapes: list, times: dict, train_set: list) -> dict:
    """A pass's summed times over its batches, and its padding."""
    positions = sum(int(train_set[k][1].sum()) for b in batches for k in b)
    read = sum(times[s]["read_ms"] + times[s]["step_ms"] for s in shapes) / 1e3
    fill = sum(times[s]["fill_ms"] + times[s]["step_ms"] for s in shapes) / 1e3
    B = len(batches[0])
    queries = sum(B * Q for _, Q in shapes)
    return dict(batches=len(batches), positions=positions, cached_pass_s=round(read),
                cached_positions_s=round(positions / read), filling_pass_s=round(fill),
                filling_positions_s=round(positions / fill), padded_tokens=sum(B * T for T, _ in shapes),
                padded_queries=queries, real_query_share=round(positions / queries, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_epoch", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/train/smollm2-n8-replies.yaml")
    ap.add_argument("--mesh", default="1x1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    tc, _ = load(args.config, args.overrides)
    n_data, n_model = parse_mesh(args.mesh)
    request_cpu_devices(n_data * n_model)
    mesh = data_model_mesh(n_data, n_model)
    model = spd_jax.load_model(tc.model.name)
    spec = train_step.drafter_spec(model, tc)
    train_set, _ = train_corpus.split_heldout(train_corpus.encode_corpus(model, tc, train_data.corpus_dir()), tc)
    by_order = orders(train_set, tc)
    shapes = {k: [shape_of(train_set, b, tc.data.buckets) for b in v] for k, v in by_order.items()}
    counts = collections.Counter(s for v in shapes.values() for s in v)
    todo = [s for s, _ in counts.most_common()]
    example = {s: b for k in by_order for b, s in zip(by_order[k], shapes[k])}

    target = put(train_step.compute_target(model, tc), train_step.target_shardings(model.config, mesh))
    opt = train_step.make_optimizer(tc)
    state, frozen = train_step.init_state(model, spec, tc, opt, np.arange(spec.draft_vocab) if spec.draft_vocab else None)
    rep = NamedSharding(mesh, PartitionSpec())
    holder = {"s": put(state, rep)}
    frozen, step = put(frozen, rep), train_step.make_step(model.config, spec, tc, opt, mesh)
    teacher = train_step.make_teacher(model.config, spec, mesh)

    def one(fed):
        holder["s"], met = step(holder["s"], frozen, target, put(fed, train_step.batch_sharding(mesh)))
        return met

    fns = dict(step=one, teacher=lambda tokens, query: teacher(target, tokens, query), spec=spec,
               model_path=str(model.path), hidden=model.config.hidden_size, dtype=train_step.compute_dtype(tc),
               num_layers=model.config.num_layers)
    times = {}
    for i, s in enumerate(todo):
        times[s] = time_shape(fns, example[s], train_set, tc, args.repeats)
        print(f"shape {i + 1}/{len(todo)} T={s[0]} Q={s[1]}: " + ", ".join(f"{k} {v:.0f}" for k, v in times[s].items()),
              flush=True)
    res = {k: pass_times(by_order[k], shapes[k], times, train_set) for k in by_order}
    res["shapes"] = [dict(T=s[0], Q=s[1], **{k: shapes[k].count(s) for k in shapes},
                          **{k: round(v) for k, v in times[s].items()}) for s in todo]
    res["setup"] = dict(config=args.config, overrides=args.overrides, mesh=args.mesh, repeats=args.repeats,
                        backend=jax.default_backend(), compute_dtype=train_step.compute_dtype(tc))
    print(json.dumps(res, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
