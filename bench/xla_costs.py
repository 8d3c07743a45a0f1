"""python -m bench.xla_costs: the cost model's FLOPs and bytes per part of an SPD cycle against XLA's own
`cost_analysis()` of the compiled programs, from abstract shapes (no weight is made: any model size).

    python -m bench.xla_costs [--config qwen3.5-4b] [--n 8] [--context 1024] [--dtype float32] [--json]

Parts, each compiled for one token at a cache of --context positions (the cache the programs read whole):
  stage s        the engine's stage program as device s runs it (`stages.stage_forward` on its per-layer buffers,
                 its slot table a constant, so each slot's `lax.switch` is the branch it takes; its caches donated,
                 as the engine's loop carries them) against `models.costs.layer_costs` summed over stage s's layers;
                 and "its layers": each compiled alone at a static kind (`LayerKind.layer` of `models.kinds`)
  verify shard   final norm + one device's ceil(V / n) rows of the LM head, as the engine reads them (its
                 block where the head is split by rows, else a slice of the whole head), against `head_cost`
  psm body       the random PSM's draft over the n + 1 rows of a full pipeline as the engine runs it (`PSMDrafter`:
                 its layers and cache one buffer each, the cache donated) against `cycle_costs`' psm_body
  psm head shard the same over the PSM's head
  both heads     where the PSM's head is the target's (`CycleCosts.one_head`), the two as the engine runs them:
                 two rows (the verification's and the draft's hidden states) of one dot over the shard
and the cycle (every stage, the PSM body, both heads' shards on every device, in one pass where the engine
makes one) summed. XLA counts the bytes
of every operand and result of every (fused) instruction, a conditional as its costliest branch; the cost
model counts weights and caches read once, and attention's float32 scores four times (`LayerKind.scores_bytes`:
written, read by the softmax, written as probabilities, read; XLA:CPU passes over them about eight times, its
transposes and reductions apart). Other activations are left out. Where they part (on XLA:CPU) is said per row.
"XLA temp MB": each program's temporary buffer (`memory_analysis()`), allocated beside its arguments while it runs.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.drafters.psm import PSM, PSMConfig, PSMDrafter, init_psm
from spd_jax.drafters.psm.engine import BLOCK_COMPLETED_ROWS
from spd_jax.models import decoder, schema
from spd_jax.models.costs import layer_costs
from spd_jax.models.kinds import KINDS
from spd_jax.models.layers import rope_cos_sin
from spd_jax.pipeline import stages
from spd_jax.costs.cycle import cycle_costs, default_plan, one_pass_heads

NOTES = {
    "bf16": "a one-row bf16 dot runs as two rows on CPU (`layers.low_precision_dot`: XLA:CPU's bf16 kernel needs two; "
            "one row would convert the weight to float32 first): the weight read once, its FLOPs counted twice",
    "head": "the shard's rows are sliced out of the replicated head (a dynamic slice) before the dot",
}


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _cost(fn, *args, donate: tuple[int, ...] = ()) -> dict:
    """XLA's flops and bytes accessed of fn compiled for args (abstract), and its temporary buffer (what the
    program allocates beside its arguments and results while it runs); `donate`: the arguments (caches) the
    engine's loop updates in place, which a program of its own would otherwise copy whole to its output."""
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                temp=float(compiled.memory_analysis().temp_size_in_bytes))


def layer_program(cfg: ModelConfig, kind: str, context: int, dtype, rows: int = 1) -> dict:
    """One layer of kind on `rows` tokens at a static kind, per-layer weights (no stack)."""
    lp = {k: _sds(leaf.shape, dtype) for k, leaf in schema.layer_schema(cfg, kind).items()}
    x, pos = _sds((1, rows, cfg.hidden_size), dtype), _sds((), jnp.int32)
    if kind == ATTENTION:
        kv = _sds((1, cfg.num_kv_heads, context, cfg.head_dim), dtype)

        def attn(lp, k, v, x, pos):
            cos, sin = rope_cos_sin(cfg, pos + jnp.arange(rows))
            return KINDS[kind].layer(lp, x, k, v, pos, cos, sin, cfg)

        return _cost(attn, lp, kv, kv, x, pos)
    lc = cfg.linear
    conv = _sds((1, lc.conv_kernel - 1, lc.conv_dim), dtype)
    ssm = _sds((1, lc.num_v_heads, lc.k_dim, lc.v_dim), jnp.float32)
    return _cost(lambda lp, x, conv, ssm: KINDS[kind].layer(lp, x, conv, ssm, None, cfg), lp, x, conv, ssm)


def stage_program(cfg: ModelConfig, layout: stages.StageLayout, context: int, dtype, stage: int) -> dict:
    """The engine's stage program as device `stage` runs it, one token: its slot table a constant, so each
    slot's `lax.switch` is the branch that device takes (XLA counts a switch as its costliest branch); the
    caches donated, as the engine's loop carries them."""
    one = lambda t: _sds(t.shape[1:], t.dtype)  # noqa: E731  (one device's block of a [devices, ...] leaf)
    w = jax.tree.map(one, jax.eval_shape(lambda: stages.stack_stage_weights(
        jax.tree.map(lambda t: jnp.zeros(t.shape, dtype), _layer_stacks(cfg)), cfg, layout)))
    cache = jax.tree.map(one, jax.eval_shape(lambda: stages.init_stage_caches(cfg, layout, 1, context,
                                                                            layout.plan.n, dtype)))
    prog = {k: jnp.asarray(v[stage]) for k, v in stages.program(cfg, layout).items()}

    def fn(w, cache, x, pos):
        return stages.stage_forward(w, cache, prog, x, pos, cfg, layout)

    return _cost(fn, w, cache, _sds((1, 1, cfg.hidden_size), dtype), _sds((), jnp.int32), donate=(1,))


def spmd_stage_program(cfg: ModelConfig, layout: stages.StageLayout, context: int, dtype) -> dict:
    """The one program every device runs, its slot table a run-time input as in the engine (XLA counts each
    `lax.switch` as its costliest branch): what a conditional adds at its boundary (copies of the caches it
    passes) shows here."""
    one = lambda t: _sds(t.shape[1:], t.dtype)  # noqa: E731
    w = jax.tree.map(one, jax.eval_shape(lambda: stages.stack_stage_weights(
        jax.tree.map(lambda t: jnp.zeros(t.shape, dtype), _layer_stacks(cfg)), cfg, layout)))
    cache = jax.tree.map(one, jax.eval_shape(lambda: stages.init_stage_caches(cfg, layout, 1, context,
                                                                            layout.plan.n, dtype)))
    prog = {k: _sds((layout.slots,), jnp.int32) for k in ("branch", "anchor_id")}

    def fn(w, cache, prog, x, pos):
        return stages.stage_forward(w, cache, prog, x, pos, cfg, layout)

    return _cost(fn, w, cache, prog, _sds((1, 1, cfg.hidden_size), dtype), _sds((), jnp.int32), donate=(1,))


def _layer_stacks(cfg: ModelConfig) -> dict:
    """The model's per-kind layer stacks, abstract."""
    return {kind: {k: _sds((cfg.layer_types.count(kind), *leaf.shape), jnp.float32)
                   for k, leaf in schema.layer_schema(cfg, kind).items()} for kind in schema.layer_kinds(cfg)}


def head_shard(cfg: ModelConfig, vocab: int, devices: int, dtype, x_rows: int = 1) -> dict:
    """Final norm + one device's rows of a [vocab, H] head as the engine reads them: its block where the head is
    split by rows (devices divide vocab), else sliced out of the whole head; for x_rows hidden states at once
    (2: the verification's and a draft's on the target's head, `CycleCosts.one_head`)."""
    rows = -(-vocab // devices)
    split = vocab % devices == 0

    def fn(h, norm, head, start):
        return decoder.head_logits(h, norm, head, cfg, start, rows)

    H = cfg.hidden_size
    return _cost(fn, _sds((x_rows, H) if x_rows > 1 else (H,), dtype), _sds((H,), dtype),
                 _sds((rows if split else vocab, H), dtype), _sds((), jnp.int32))


def psm_body(cfg: ModelConfig, spec: PSMConfig, context: int, dtype) -> dict:
    """The PSM's draft over the n + 1 rows of a full pipeline (up to its head) on its cache of `context`
    positions, as the engine runs it: its layers one buffer each (`PSMDrafter`), the cache donated."""
    drafter = PSMDrafter(cfg, spec)
    target = jax.eval_shape(lambda: schema.init_params(cfg, jax.random.key(0), dtype))
    variables = jax.eval_shape(lambda t: drafter.engine_params(init_psm(cfg, spec, t, 0, dtype)), target)
    cache = jax.eval_shape(lambda: drafter.init((), context, dtype))
    R, i32 = spec.n + 1, jnp.int32

    def fn(variables, cache, h, pc, t, completed):
        return drafter.module.apply(variables, h, cache, pc, t, completed, BLOCK_COMPLETED_ROWS,
                                   method=PSM.draft_hidden)

    return _cost(fn, variables, cache, _sds((R, spec.m, cfg.hidden_size), dtype), _sds((), i32), _sds((), i32),
                 _sds((), i32), donate=(1,))


def compare(name: str, n: int, context: int, dtype: str = "float32") -> list[dict]:
    """Rows (part, model and XLA flops and bytes, their ratios, a note) for a named model."""
    return compare_config(ModelConfig.named(name), n, context, dtype)


def compare_config(cfg: ModelConfig, n: int, context: int, dtype: str = "float32") -> list[dict]:
    """`compare` for any config (e.g. a published model's widths with fewer layers, for a test)."""
    pb = jnp.dtype(dtype).itemsize
    plan = default_plan(cfg, n)
    spec = PSMConfig.for_target(cfg, plan.counts, num_layers=2)
    layout = stages.StageLayout.of(cfg, plan, spec.anchors)
    cc = cycle_costs(cfg, plan, spec, context, pb)
    layers = layer_costs(cfg, context, pb, pb)
    per_kind = {kind: layer_program(cfg, kind, context, dtype) for kind in schema.layer_kinds(cfg)}
    low = NOTES["bf16"] if pb < 4 else ""
    rows = []

    def row(part, model_flops, model_bytes, xla, note=""):
        rows.append(dict(part=part, model_flops=model_flops, xla_flops=xla["flops"],
                         flops_ratio=xla["flops"] / model_flops, model_bytes=model_bytes, xla_bytes=xla["bytes"],
                         bytes_ratio=xla["bytes"] / model_bytes, xla_temp_bytes=xla.get("temp"), note="; ".join(x for x in (note, low) if x)))

    programs = []
    for s, (a, b) in enumerate(plan.bounds):
        mine = layers[a:b]
        fl, by = sum(c.flops for c in mine), sum(c.bytes for c in mine)
        kinds = cfg.layer_types[a:b]
        alone = {k: sum(per_kind[kind][k] for kind in kinds) for k in ("flops", "bytes")}
        row(f"stage {s} ({kinds.count(LINEAR)} linear, {kinds.count(ATTENTION)} attention): its layers", fl, by, alone)
        programs.append(stage_program(cfg, layout, context, dtype, s))
        row(f"stage {s}: the engine's stage program", fl, by, programs[-1])
    busiest = max(range(plan.n), key=lambda s: sum(c.bytes for c in layers[slice(*plan.bounds[s])]))
    mine = layers[slice(*plan.bounds[busiest])]
    row(f"the SPMD stage program (slot table at run time) vs stage {busiest}", sum(c.flops for c in mine),
        sum(c.bytes for c in mine), spmd_stage_program(cfg, layout, context, dtype))
    verify = head_shard(cfg, cfg.vocab_size, cc.devices, dtype)
    sliced = cfg.vocab_size % cc.devices != 0
    row("verify head shard", cc.head_shard.flops, cc.head_shard.bytes, verify, NOTES["head"] if sliced else "")
    body = psm_body(cfg, spec, context, dtype)
    row(f"psm body ({spec.n + 1} rows)", sum(c.flops for c in cc.psm_body), sum(c.bytes for c in cc.psm_body), body)
    psm_head = head_shard(cfg, spec.draft_vocab or cfg.vocab_size, cc.devices, dtype)
    row("psm head shard", cc.psm_head_shard.flops, cc.psm_head_shard.bytes, psm_head,
        NOTES["head"] if (spec.draft_vocab or cfg.vocab_size) % cc.devices else "")
    heads = one_pass_heads(cc)
    if cc.one_head:  # what the engine runs: both heads as two rows of one dot over the shard
        both = head_shard(cfg, cfg.vocab_size, cc.devices, dtype, x_rows=2)
        row("both heads in one pass (the engine's)", sum(c.flops for c in heads), sum(c.bytes for c in heads), both,
            NOTES["head"] if sliced else "")
        per_device = both
    else:
        per_device = {k: verify[k] + psm_head[k] for k in ("flops", "bytes")}
    cyc = {k: sum(p[k] for p in programs) + body[k] + per_device[k] * cc.devices for k in ("flops", "bytes")}
    row("cycle (all devices)", sum(c.flops for st in cc.stages for c in st) + sum(c.flops for c in cc.psm_body)
        + cc.devices * sum(c.flops for c in heads), sum(c.bytes for st in cc.stages for c in st)
        + sum(c.bytes for c in cc.psm_body) + cc.devices * sum(c.bytes for c in heads), cyc)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.xla_costs", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="qwen3.5-4b")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = compare(args.config, args.n, args.context, args.dtype)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.config}, n = {args.n}, context {args.context}, {args.dtype}, {jax.default_backend()}: "
          "cost model vs XLA cost_analysis()")
    print(f"| part | model GFLOP | XLA GFLOP | ratio | model MB | XLA MB | ratio | XLA temp MB | note |\n|{'---|' * 9}")
    for r in rows:
        temp = "" if r["xla_temp_bytes"] is None else f"{r['xla_temp_bytes'] / 1e6:.1f}"
        print(f"| {r['part']} | {r['model_flops'] / 1e9:.3f} | {r['xla_flops'] / 1e9:.3f} | {r['flops_ratio']:.3f} | "
              f"{r['model_bytes'] / 1e6:.1f} | {r['xla_bytes'] / 1e6:.1f} | {r['bytes_ratio']:.3f} | {temp} | {r['note']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
