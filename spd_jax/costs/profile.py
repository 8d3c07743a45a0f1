"""Time the parts of one SPD cycle on the current backend, each as its own small jitted program:
every stage's layers on one token, the PSM's body, the PSM's head and the verification head on one
vocabulary shard (final norm + 1/D of the LM head + choice, D = n devices, or n + 1 with the PSM on a
device of its own; every device runs one of each), and the per-cycle collectives of the engine (greedy: the
hidden state's permute, one all-gather of every device's output, anchor states and drafter state, one of
the two heads' per-shard best logits), and, for comparison, one AR decoder step of the whole model as
`decode.ar` runs it (per-layer weights). Then each device's whole work of a cycle as one program (its
stage, a shard of each head, the PSM body on `psm_device`), the devices called in turn (`device_ms`).
`loop_collectives` counts the collectives a compiled loop runs per iteration.

Each figure is the median wall time of a call, including its host dispatch; the engine itself runs
all of them inside one on-device loop, so `cycle_ms - (slowest stage + PSM + verify + comm)` measured
on the real engine is the remaining overhead (synchronisation and what the parts' dispatch hides).
"""

from __future__ import annotations

import collections
import functools
import re
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spd_jax.models import decoder
from spd_jax.pipeline import stages
from spd_jax.sharding import STAGE, stage_mesh
from spd_jax.drafters.psm import PSM, PSMConfig, PSMDrafter, init_psm
from spd_jax.drafters.psm.engine import BLOCK_COMPLETED_ROWS


def median_ms(fn, *args, iters: int = 30) -> float:
    """The median wall time of fn(*args) in ms over `iters` calls, after one call that compiles and warms."""
    jax.block_until_ready(fn(*args))  # compile + warm
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def round_robin_ms(fns, iters: int = 30) -> list[float]:
    """Per fn the median wall time of a call in ms, the fns called in turn (fn 0, 1, .., 0, 1, ..) `iters`
    rounds, after one warm-up round: as the devices of a host take turns in the engine, so each call finds
    the caches as the others left them (timed alone and repeated, a part's weights can stay in the CPU's
    last-level cache, which the engine's cycle never offers: it streams every device's weights)."""
    for fn in fns:
        jax.block_until_ready(fn())
    ts = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts[i].append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in ts]


def profile_cycle(model, plan, psm_layers: int = 2, context: int = 128, iters: int = 30,
                  psm_device: int | None = None) -> dict:
    cfg, n = model.config, plan.n
    psm_device = n - 1 if psm_device is None else psm_device
    if not 0 <= psm_device <= n:
        raise ValueError(f"psm_device must be a stage 0..{n - 1} or {n} (a device of its own), got {psm_device}")
    devices = n + (psm_device == n)
    psm_cfg = PSMConfig.for_target(cfg, plan.counts, num_layers=psm_layers)
    layout = stages.StageLayout.of(cfg, plan, psm_cfg.anchors)
    weights = stages.stack_stage_weights(model.params["layers"], cfg, layout)
    prog = jax.tree.map(jnp.asarray, stages.program(cfg, layout))
    caches = stages.init_stage_caches(cfg, layout, 1, context + 64, ring=n, dtype=model.dtype)
    x = jnp.zeros((1, 1, cfg.hidden_size), model.dtype)
    pos = jnp.int32(context)

    @jax.jit
    def one_stage(w, c, p, x):
        return stages.stage_forward(w, c, p, x, pos, cfg, layout)[0]

    stage_ms = [median_ms(one_stage, *(jax.tree.map(lambda t, s=s: t[s], a) for a in (weights, caches, prog)), x,
                           iters=iters) for s in range(n)]

    # the PSM as the engine runs it (`PSMDrafter`: its layers and cache one buffer each)
    drafter = PSMDrafter(cfg, psm_cfg)
    psm_vars = drafter.engine_params(init_psm(cfg, psm_cfg, model.params, dtype=model.dtype))
    module = drafter.module
    pcache = drafter.init((), context + 64, model.dtype)
    h = jnp.zeros((n + 1, psm_cfg.m, cfg.hidden_size), model.dtype)

    @jax.jit
    def psm_body(v, c, h):  # a full pipeline: n tokens in flight, the block starts at the oldest
        return module.apply(v, h, c, pos - n + 1, pos, pos - n + 1, BLOCK_COMPLETED_ROWS, method=PSM.draft_hidden)[0]

    psm_ms = median_ms(psm_body, psm_vars, pcache, h, iters=iters)
    # the heads run vocabulary-parallel (decode.vocab): each device computes 1/n of the rows (1/(n + 1) with
    # the PSM on a device of its own)
    rows = -(-cfg.vocab_size // devices)

    @jax.jit
    def psm_head(v, x):
        return jnp.argmax(module.apply(v, x, model.params["final_norm"], 0, rows, method=PSM.head_logits))

    psm_head_ms = median_ms(psm_head, psm_vars, x[0, 0], iters=iters)

    @jax.jit
    def verify(params, x):  # x [..., H] -> the argmax of each row over the shard
        head = decoder.lm_head(params, cfg)
        return jnp.argmax(decoder.head_logits(x, params["final_norm"], head, cfg, 0, rows), axis=-1)

    verify_ms = median_ms(verify, decoder.head_params(model.params), x[0, 0], iters=iters)

    # each device's whole work of a cycle that verifies a token as ONE call, as the engine runs it inside one
    # program (one dispatch, not one per part): its stage (none on the PSM's own device), its shard of both heads
    # (one two-row dot: the PSM reads the target's head, `decode.spd`'s one pass) and, on the PSM's device, the
    # body; the devices timed in turn
    head_params = decoder.head_params(model.params)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def device_work(with_stage: bool, with_body: bool, stage, head, v, pcache, h):
        out = [verify(head, jnp.stack([x[0, 0], x[0, 0] + 1]))]  # this profile's PSM reads the target's head
        return out + ([one_stage(*stage, x)] if with_stage else []) + ([psm_body(v, pcache, h)] if with_body else [])

    def stage_of(s):  # stage s's weights, cache and program table; the PSM's own device has none
        return tuple(jax.tree.map(lambda t, s=s: t[s], a) for a in (weights, caches, prog)) if s < n else ()

    device_ms = round_robin_ms([functools.partial(device_work, s < n, s == psm_device, stage_of(s), head_params,
                                                  psm_vars, pcache, h) for s in range(devices)],
                               iters=iters)
    dispatch_ms = median_ms(jax.jit(lambda x: x + 1), x, iters=iters)

    ar_step_ms = _ar_step_ms(model, context, iters)
    return dict(stage_ms=stage_ms, slowest_stage_ms=max(stage_ms), psm_ms=psm_ms, psm_head_ms=psm_head_ms,
                verify_ms=verify_ms, ar_step_ms=ar_step_ms, device_ms=device_ms, psm_device=psm_device,
                dispatch_ms=dispatch_ms, comm_ms=_comm_ms(n, psm_cfg.m, cfg.hidden_size, model.dtype, iters, devices),
                context=context, n=n, stage_layers=list(plan.counts),
                includes="each part: median wall time of one jitted call incl. host dispatch; device_ms: per device "
                         "its stage, a shard of each head and (psm_device) the PSM body as one call, one dispatch; "
                         "dispatch_ms: a trivial jitted call's; comm: per cycle, amortised over an on-device loop; "
                         "ar_step: one decoder step of the whole model as decode.ar runs it")


def _ar_step_ms(model, context: int, iters: int) -> float:
    """One AR step of the whole model at position `context`, as decode.ar runs it: per-layer weights, the whole
    head, the argmax (the caches are not returned, so their one-slot write is left out; their reads are timed)."""
    cfg = model.config
    head_params = decoder.head_params(model.params)
    ar_layers = decoder.decode_layers(model.params["layers"], cfg)
    ar_caches = decoder.split_cache(decoder.init_cache(cfg, 1, context + 64, model.dtype), cfg)

    @jax.jit
    def ar_step(layers, head, caches, tok):
        return jnp.argmax(decoder.decode_step(layers, head, tok, caches, jnp.int32(context), cfg)[0][0, 0])

    return median_ms(ar_step, ar_layers, head_params, ar_caches, jnp.zeros((1, 1), jnp.int32), iters=iters)


def _comm_ms(n: int, m: int, H: int, dtype, iters: int, devices: int | None = None) -> float:
    """The engine's per-cycle collectives of n stages on a mesh of `devices` (default n; n + 1 with the PSM on
    a device of its own, which takes part in the all-gathers, not the stages' permute), m anchors, hidden size
    H, in ms per cycle, amortised over an on-device loop."""
    devices = n if devices is None else devices
    mesh = stage_mesh(devices)
    reps = 20
    fwd = [(i, i + 1) for i in range(n - 1)]

    def collectives(x, table):
        def body(_, c):
            x, table = c
            # the engine's cycle (`decode.spd`): the hidden state's permute to the next stage, one
            # all-gather of each device's [m + 2, H] packet (its output, the anchor states it made, the
            # drafter's hidden state), then one of each shard's best logit and its id for the two heads
            x = jax.lax.ppermute(x, STAGE, fwd) if n > 1 else x
            every = jax.lax.all_gather(jnp.concatenate([x[0], table, x[0]]), STAGE, to="invarying")
            best = jnp.stack([jnp.max(every, axis=(0, 1)).astype(jnp.int32)[:2]] * 2)  # [2 heads, 2]
            picked = jnp.min(jax.lax.all_gather(best, STAGE, to="invarying"))
            return x + picked.astype(x.dtype), table
        return jax.lax.fori_loop(0, reps, body, (x, table))

    comm = jax.jit(jax.shard_map(collectives, mesh=mesh, in_specs=(P(STAGE), P(STAGE)), out_specs=(P(STAGE), P(STAGE))))
    st = NamedSharding(mesh, P(STAGE))
    xs = jax.device_put(jnp.zeros((devices, 1, H), dtype), st)
    tables = jax.device_put(jnp.zeros((devices * m, H), dtype), st)  # each device's [m, H] anchor states
    return median_ms(comm, xs, tables, iters=max(3, iters // 5)) / reps


# ---------------------------------------------------------------- what a compiled loop communicates

_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(-start)?\(")


def loop_collectives(hlo_text: str) -> dict[str, int]:
    """The collectives one iteration of a compiled program's main loop runs, by HLO op kind, from its
    optimised HLO text (`compiled.as_text()`): of the `while` loops, the one whose body (with what it
    calls) holds the most (the SPD engine's decode loop; the prefill's holds one permute). Of a
    conditional's branches the one holding the most counts (one of them runs); a loop nested in the body
    counts once."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)

    @functools.cache
    def count(comp: str) -> collections.Counter:
        total = collections.Counter()
        for line in comps.get(comp, ()):
            hit = _COLLECTIVE.search(line)
            if hit:
                total[hit.group(1)] += 1
            for called in re.findall(r"\b(?:body|to_apply|calls)=%([\w.\-]+)", line):
                total += count(called)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            options = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                       else re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", line))
            if options:
                total += max((count(c) for c in options), key=lambda c: sum(c.values()))
        return total

    bodies = [b for lines in comps.values() for line in lines for b in re.findall(r"\bwhile\(.*\bbody=%([\w.\-]+)", line)]
    return dict(max((count(b) for b in bodies), key=lambda c: sum(c.values()), default=collections.Counter()))
