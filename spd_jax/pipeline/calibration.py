"""The published measurements the hardware profiles (`spd_jax.pipeline.hardware`) are calibrated on, and
the cost model's figure for each through the same formulas the projections use (`costs.ar_step_s`,
`costs.tp_step_s`, `Hardware.all_gather_s`). `tests/test_calibration.py` holds them to a tolerance;
`spd_jax.reports.projections` prints them. Numbers only: nothing runs or compiles here.
"""

from __future__ import annotations

from spd_jax.config import ModelConfig
from spd_jax.pipeline import costs
from spd_jax.pipeline.hardware import A100_GPT_FAST, H100_NVLINK, TPU_V5E_ICI, Hardware

# pytorch-labs/gpt-fast README.md, "Tensor Parallelism": Llama-2-7B bf16, batch 1, 8 x A100-80GB (330 W,
# hybrid cube mesh), tokens/s on 1 / 2 / 4 / 8 GPUs; a 5-token prompt and generate.py's 200 new tokens
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


def gpt_fast_speedups(hw: Hardware = A100_GPT_FAST) -> dict[int, float]:
    """Llama-2-7B on `hw`: tp on n devices against one, in gpt-fast's placement (embedding and head whole)."""
    cfg = ModelConfig.named("llama-2-7b")
    one = costs.ar_step_s(cfg, hw, GPT_FAST_CONTEXT)
    return {n: one / costs.tp_step_s(cfg, hw, n, GPT_FAST_CONTEXT, vocab_split=False) for n in (2, 4, 8)}


def figures(a100: Hardware = A100_GPT_FAST, h100: Hardware = H100_NVLINK, v5e: Hardware = TPU_V5E_ICI) -> list[dict]:
    """Each calibration figure: {what, published, model, unit, source}."""
    gf_src = "pytorch-labs/gpt-fast README.md, Tensor Parallelism table"
    speedups = gpt_fast_speedups(a100)
    out = [dict(what="gpt-fast Llama-2-7B, 1 x A100, ms/token", unit="ms", source=gf_src,
                published=1e3 / GPT_FAST_TOK_S[1],
                model=1e3 * costs.ar_step_s(ModelConfig.named("llama-2-7b"), a100, GPT_FAST_CONTEXT))]
    out += [dict(what=f"gpt-fast Llama-2-7B, TP {n} speedup", unit="x", source=gf_src,
                 published=GPT_FAST_TOK_S[n] / GPT_FAST_TOK_S[1], model=speedups[n]) for n in (2, 4, 8)]
    out.append(dict(what="vLLM Qwen3-8B, 1 x H100, batch 1, ms/token", unit="ms", published=1e3 * VLLM_QWEN3_8B_STEP_S,
                    model=1e3 * costs.ar_step_s(ModelConfig.named("qwen3-8b"), h100, VLLM_CONTEXT),
                    source="gpustack/gpustack docs/performance-lab/qwen3-8b/h100-latency.md, BS=1"))
    out.append(dict(what="TPU v5e all-gather of 32 kB shards over 4 chips, us", unit="us",
                    published=1e6 * ICI_ALL_GATHER_S, model=1e6 * v5e.all_gather_s(32e3, 4),
                    source="jax-ml/scaling-book sharding.md, ICI latency"))
    return out
