"""The published measurements the hardware profiles (`spd_jax.costs.hardware`) are calibrated on, and
the cost model's figure for each through the same formulas the projections use (`baselines.ar_step_s`,
`baselines.tp_step_s`, `Hardware.all_gather_s`, `Hardware.all_reduce_s`); a published measurement kept out of
the fit (`held_out`: SGLang's batch-1 tensor-parallel decode on H100), predicted under both latency classes;
and the reference implementation's own cycle ratios (`paper_ratios`). `tests/test_calibration.py` holds them
to their tolerances; `spd_jax.reports.projections` prints them. Numbers only: nothing runs or compiles here.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models.costs import embed_cost, head_cost, layer_costs
from spd_jax.costs import baselines, cycle, factorisations
from spd_jax.costs.hardware import A100_GPT_FAST, H100_IB, H100_NVLINK, L40S_PCIE, TPU_V5E_ICI, Hardware
from spd_jax.pipeline.partition import StagePlan

# pytorch-labs/gpt-fast README.md, "Tensor Parallelism": Llama-2-7B bf16, batch 1, 8 x A100-80GB (330 W,
# hybrid cube mesh), tokens/s on 1 / 2 / 4 / 8 GPUs; a 5-token prompt and generate.py's 200 new tokens
if TYPE_CHECKING:  # the drafters (Flax) are imported only where their costs are counted
    from spd_jax.drafters.psm import PSMConfig

GPT_FAST_TOK_S = {1: 104.9, 2: 168.84, 4: 254.02, 8: 328.43}
GPT_FAST_CONTEXT = 105  # the mean decode position
# gpustack/gpustack docs/performance-lab/qwen3-8b/h100-latency.md, "Other Benchmark Cases", BS=1 baseline:
# vLLM v0.11.0, Qwen3-8B bf16, one H100 SXM, ShareGPT at concurrency 1, mean TPOT 7.28 ms (mean input 233
# tokens and output 221: mean decode position about 343)
VLLM_QWEN3_8B_STEP_S = 7.28e-3
VLLM_CONTEXT = 343
# jax-ml/scaling-book sharding.md, "A note on ICI latency": an all-gather of 32 kB shards over 4 TPU v5e
# chips (3 hops), measured "closer to 8us"
ICI_ALL_GATHER_S = 8e-6
# NVIDIA/nccl issue 1530: nccl-tests all_reduce_perf -g 8 on 8 RTX 4090 over PCIe (no NVLink), 8 B: 42.56 us;
# the L40S profile's per-step latency is fitted to it
PCIE_ALL_REDUCE_S = 42.56e-6
# NVIDIA/nccl issue 1453: NCCL's own tuner on 8-GPU H100 nodes over InfiniBand, a 128 B all-reduce:
# "128 Bytes -> Algo 0 proto 0 time 25.214764" (Tree / LL), what its constants give: a check of the formula
NCCL_IB_ALL_REDUCE_S = 25.214764e-6

# Kept out of the fit: sgl-project/sglang issue 1008 ("Torch.compile Performance Tracking"), python3 -m
# sglang.bench_latency --model meta-llama/Meta-Llama-3-8B --batch-size 1 --input 128 --output 8, CUDA graphs,
# decode median latency at TP 1 and TP 8 (vocabulary-parallel head; SGLang's custom all-reduce where it
# applies). The issue does not name the GPU; an H100 by the TP 1 step (16 GB of weights in 7.37 ms is 2.2 TB/s,
# past an A100's 2.04 TB/s peak).
SGLANG_LLAMA3_8B_STEP_S = {1: 7.37e-3, 8: 3.35e-3}
SGLANG_CONTEXT = 132  # 128 prompt tokens, 8 new: the mean decode position
# docs/SPD.md, section 8: the reference code's per-cycle time on GPUs for Qwen3.5-4B, n = 8, Ls = 3 (its
# n + 1 set-up: the PSM on a device of its own): cycle 5.41 ms, PSM 3.49 ms, slowest stage 4.20 ms
PAPER_CYCLE_MS, PAPER_PSM_MS, PAPER_STAGE_MS = 5.41, 3.49, 4.20


def gpt_fast_speedups(hw: Hardware = A100_GPT_FAST) -> dict[int, float]:
    """Llama-2-7B on `hw`: tp on n devices against one, in gpt-fast's placement (embedding and head whole)."""
    cfg = ModelConfig.named("llama-2-7b")
    one = baselines.ar_step_s(cfg, hw, GPT_FAST_CONTEXT)
    return {n: one / baselines.tp_step_s(cfg, hw, n, GPT_FAST_CONTEXT, vocab_split=False) for n in (2, 4, 8)}


def figures(a100: Hardware = A100_GPT_FAST, h100: Hardware = H100_NVLINK, v5e: Hardware = TPU_V5E_ICI,
            pcie: Hardware = L40S_PCIE, ib: Hardware = H100_IB) -> list[dict]:
    """Each calibration figure: {what, published, model, unit, source}."""
    gf_src = "pytorch-labs/gpt-fast README.md, Tensor Parallelism table"
    speedups = gpt_fast_speedups(a100)
    out = [dict(what="gpt-fast Llama-2-7B, 1 x A100, ms/token", unit="ms", source=gf_src,
                published=1e3 / GPT_FAST_TOK_S[1],
                model=1e3 * baselines.ar_step_s(ModelConfig.named("llama-2-7b"), a100, GPT_FAST_CONTEXT))]
    out += [dict(what=f"gpt-fast Llama-2-7B, TP {n} speedup", unit="x", source=gf_src,
                 published=GPT_FAST_TOK_S[n] / GPT_FAST_TOK_S[1], model=speedups[n]) for n in (2, 4, 8)]
    out.append(dict(what="vLLM Qwen3-8B, 1 x H100, batch 1, ms/token", unit="ms", published=1e3 * VLLM_QWEN3_8B_STEP_S,
                    model=1e3 * baselines.ar_step_s(ModelConfig.named("qwen3-8b"), h100, VLLM_CONTEXT),
                    source="gpustack/gpustack docs/performance-lab/qwen3-8b/h100-latency.md, BS=1"))
    out.append(dict(what="TPU v5e all-gather of 32 kB shards over 4 chips, us", unit="us",
                    published=1e6 * ICI_ALL_GATHER_S, model=1e6 * v5e.all_gather_s(32e3, 4),
                    source="jax-ml/scaling-book sharding.md, ICI latency"))
    out.append(dict(what="NCCL all-reduce of 8 B over 8 GPUs on PCIe, us", unit="us", published=1e6 * PCIE_ALL_REDUCE_S,
                    model=1e6 * pcie.with_latency("nccl").all_reduce_s(8, 8),
                    source="NVIDIA/nccl issue 1530, 8 x RTX 4090 (fits the PCIe per-step latency)"))
    out.append(dict(what="NCCL's tuner, 128 B all-reduce over 8-GPU H100 nodes on IB, us", unit="us",
                    published=1e6 * NCCL_IB_ALL_REDUCE_S,
                    model=1e6 * ib.with_latency("nccl").all_reduce_s(128, 16, 2),
                    source="NVIDIA/nccl issue 1453 (NCCL's own prediction: a check of the formula)"))
    return out


def held_out(h100: Hardware = H100_NVLINK) -> list[dict]:
    """SGLang's batch-1 Llama-3-8B decode on H100 at TP 1 and TP 8 (kept out of every fit) against the
    model: the TP 1 step, and the TP 8 step and speedup under each latency class ->
    [{what, published, model, latency, unit, source}]."""
    cfg, ctx, src = ModelConfig.named("llama-3-8b"), SGLANG_CONTEXT, "sgl-project/sglang issue 1008"
    one = baselines.ar_step_s(cfg, h100, ctx)
    out = [dict(what="SGLang Llama-3-8B, 1 x H100, batch 1, ms/token", unit="ms", latency="-",
                published=1e3 * SGLANG_LLAMA3_8B_STEP_S[1], model=1e3 * one, source=src)]
    for cls in ("nccl", "one-shot"):
        t8 = baselines.tp_step_s(cfg, h100.with_latency(cls), 8, ctx)
        out.append(dict(what="SGLang Llama-3-8B, TP 8 on H100, batch 1, ms/token", unit="ms", latency=cls,
                        published=1e3 * SGLANG_LLAMA3_8B_STEP_S[8], model=1e3 * t8, source=src))
        out.append(dict(what="SGLang Llama-3-8B, TP 8 speedup over TP 1", unit="x", latency=cls,
                        published=SGLANG_LLAMA3_8B_STEP_S[1] / SGLANG_LLAMA3_8B_STEP_S[8], model=one / t8, source=src))
    return out


def paper_ratios(hw: Hardware = H100_NVLINK, context: int = 1024) -> dict:
    """The reference code's cycle in the model: Qwen3.5-4B, n = 8, Ls = 3, the PSM on a device of its own
    (the paper's n + 1), the heads as the engine splits them -> {psm_over_stage: the PSM body over the
    slowest stage's layers, cycle_over_stage: the whole cycle (busiest device, head shards, collectives) over
    the same, and the paper's two}."""
    cfg = ModelConfig.named("qwen3.5-4b")
    plan = cycle.default_plan(cfg, 8)
    psm = baselines._drafter_kinds().PSM.random_config(cfg, plan, 3)
    cyc = factorisations.mesh_cycle(cfg, plan, psm, hw, context, psm_device=plan.n)
    stage = max(hw.part_s(s, stage=True) for s in cyc["costs"].stages)
    return dict(psm_over_stage=hw.part_s(cyc["costs"].psm_body) / stage, cycle_over_stage=cyc["cycle_s"] / stage,
                paper_psm_over_stage=PAPER_PSM_MS / PAPER_STAGE_MS,
                paper_cycle_over_stage=PAPER_CYCLE_MS / PAPER_STAGE_MS)


def fit_cpu(profile: dict, cfg: ModelConfig, psm_cfg: PSMConfig, param_bytes: int = 4,
            name: str = "this CPU (fitted)") -> Hardware:
    """This machine's profile, fitted to a `spd_jax.costs.profile.profile_cycle` dict, for the model
    `cfg` it was measured on with the PSM `psm_cfg`, in a dtype of `param_bytes`. The dict: stage_ms
    [n], psm_ms (the PSM body), psm_head_ms and verify_ms (one vocabulary shard of each head), ar_step_ms
    (one AR decoder step of the whole model; older profiles lack it), comm_ms (the cycle's collectives),
    context, stage_layers.

    Each measured part is taken as bytes / bandwidth + launch, with two bandwidths: the pipeline stages'
    programs and every other program (heads, the PSM, the AR step). The stages' own bandwidth dates from
    when their layers were stacked per stage (XLA:CPU copied each slot out before its matmul); with one
    buffer per layer the fit is free to make the two equal. The three unknowns come from a
    non-negative least-squares fit of the part times against their bytes (one bandwidth without an AR
    step). The fixed cost per layer is not separable from the bytes here (a stage's bytes grow with its
    layers) and is left at 0. FLOP/s is not identifiable from decode parts (their FLOPs grow with their
    bytes), so peak is set to the lowest value under which every fitted layer stays memory-bound. The
    link: the fitted bandwidth (host devices share memory) and a latency from the measured collectives
    less their bytes at that bandwidth."""
    plan = StagePlan(tuple(profile["stage_layers"]))
    ctx = int(profile["context"])
    # the heads' shards as the profile timed them: 1/n of the rows, 1/(n + 1) with the PSM on its own device
    cc = cycle.cycle_costs(cfg, plan, psm_cfg, ctx, param_bytes, psm_device=profile.get("psm_device"))
    parts = [*cc.stages, (cc.head_shard,), cc.psm_body, (cc.psm_head_shard,)]
    y = [*profile["stage_ms"], profile["verify_ms"], profile["psm_ms"], profile["psm_head_ms"]]
    two = bool(profile.get("ar_step_ms"))  # an AR step: a second bandwidth, the stages' programs apart
    if two:
        parts.append((embed_cost(cfg, param_bytes), *layer_costs(cfg, ctx, param_bytes, param_bytes),
                      head_cost(cfg, param_bytes)))
        y.append(profile["ar_step_ms"])
    y = 1e-3 * np.array(y)
    x = np.array([sum(c.bytes for c in p) for p in parts], float)
    stage = np.arange(len(parts)) < plan.n
    cols = [np.where(stage, x, 0.0), np.where(stage, 0.0, x)] if two else [x]
    *slopes, launch_s = _nonneg_lstsq(np.stack([*cols, np.ones_like(x)], 1), y)
    bw = 1.0 / slopes[-1] if slopes[-1] > 0 else float(np.max(x / y))  # no slope: the fastest part's rate
    stage_eff = slopes[-1] / slopes[0] if two and min(slopes) > 0 else 1.0
    # (the engine's one pass of both heads over a shard, `cycle.one_pass_heads`, among them: a two-row dot)
    peak = bw * max(c.flops / c.bytes for p in [*parts, cycle.one_pass_heads(cc)] for c in p if c.bytes)
    coll = cycle.collectives(cc, "sharded")
    moved = sum(b if kind == "ppermute" else (cc.devices - 1) * b for kind, b, _ in coll)  # each device receives
    latency = max(0.0, (1e-3 * profile["comm_ms"] - moved / bw) / len(coll)) if coll else 0.0
    pred = x * np.where(stage, 1.0 / (bw * stage_eff), 1.0 / bw) + launch_s
    resid_ms = 1e3 * (y - pred)
    names = [*(f"stage {s}" for s in range(plan.n)), "verify shard", "PSM body", "PSM head shard",
             *(["AR step"] if two else [])]
    return Hardware(
        name, peak_flops_per_s=float(peak), mem_bytes_per_s=float(bw), link_latency_s=float(latency),
        link_bytes_per_s=float(bw), launch_s=float(launch_s), projection=False, stage_efficiency=float(stage_eff),
        assumes=f"fitted here from {len(y)} measured parts ({', '.join(names)}; one jitted call each, incl. host "
                f"dispatch) as bytes/bandwidth + launch: {bw / 1e9:.1f} GB/s, the stages' programs at "
                f"{stage_eff:.2f} of it, launch {1e6 * launch_s:.0f} us; residuals (ms) "
                + ", ".join(f"{k} {r:+.2f}" for k, r in zip(names, resid_ms))
                + f"; peak FLOP/s not identifiable, set to {peak / 1e9:.0f} GFLOP/s (every fitted layer "
                f"memory-bound); link: the fitted bandwidth and {1e6 * latency:.1f} us per collective from comm_ms; "
                "on this host the n devices share its cores, so stages do not really run in parallel")


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares y ~ X c with c >= 0, by trying every set of free columns (the others held at 0) and
    keeping the best feasible fit: exact for the few columns used here."""
    k = X.shape[1]
    best, best_sse = np.zeros(k), float(y @ y)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            c, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.all(c >= 0):
                sse = float(np.sum((y - X[:, cols] @ c) ** 2))
                if sse < best_sse:
                    best, best_sse = np.zeros(k), sse
                    best[list(cols)] = c
    return best
