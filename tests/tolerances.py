"""Numeric tolerances of the test suite, all from one error budget.

Every floating-point comparison in tests/ goes through `assert_close(actual, expected, KIND, depth)`
with one of the kinds below, never through a literal atol/rtol.

The budget. float32 rounds every operation to within u = 2**-24 (about 6e-8) relative. Two
computations of the same function agree bit for bit only when they perform the same operations in
the same order, and ours never do across the comparisons below: transformers runs other kernels
(MKL/oneDNN under PyTorch), and XLA picks different fusions, blockings and vector widths for
different shapes (T = 1 against T = 24), on different CPUs (AVX2 against AVX-512) and in different
versions. Reordering a sum of n terms changes it by up to n * u times the sum of the terms'
magnitudes, typically sqrt(n) * u. Each layer adds such an independent difference to the residual
stream, which carries it to the end (norms and softmax neither damp nor blow it up by much), so the
differences add up like a random walk, as sqrt(depth); the LM head turns the result into a logit
difference that grows with the logits themselves. So a bound is

    atol = rel * sqrt(depth) * max(1, max|expected|)

with depth the number of layers the compared values went through (1 for a single op or block) and
rel about ten times the largest relative error seen (err / (sqrt(depth) * scale)), so that a
machine, CPU or XLA version we have not measured still passes. Wrong math (a missing norm, a
shifted position, a wrong head) gives errors of order 1e-2 to 1 relative, far above every bound.

The "seen" figures were measured on a 2-core x86-64 (AMD EPYC, AVX-512) CPU with jax 0.10.2 and
torch 2.13.0; set SPD_JAX_TOLERANCE_LOG=path to append every comparison's largest error, scale,
depth and bound to that file as JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
    name: str
    rel: float  # relative to max(1, max|expected|), per sqrt(depth)
    why: str


# Logits or hidden states of our JAX model against transformers (PyTorch float32, eager attention).
# Seen: 2.2e-6 (tiny qwen3_5, 6 layers, logits up to 2.7: 1.5e-5 absolute); SmolLM2-135M 7.8e-7
# (30 layers, logits up to 31: 1.3e-4 absolute). Old fixed bounds: atol 1e-4 (tiny), 5e-4 (SmolLM2).
VS_TRANSFORMERS = Tolerance(
    "vs_transformers", 2e-5,
    "independent implementations: every matmul, norm and softmax reduced in its own order, sqrt(width) "
    "* u each, accumulated over depth and scaled by the values' magnitude")

# One JAX model computed two ways that are the same function: incrementally with a KV cache or a
# recurrent state (prefill + one-token steps, a rewind, the AR loop's per-layer decode step, a split
# into layer ranges) against one full forward: the softmax is split into a cached and a new block and
# XLA compiles T = 1 and T = 24 matmuls to different kernels. Seen: 1.4e-6 (tiny qwen3_5, 8.7e-6
# absolute); another machine reported 2.3e-5 absolute on that test (about 3.7e-6), which failed the
# old fixed atol=1e-5.
CACHED_VS_FULL = Tolerance(
    "cached_vs_full", 4e-5,
    "the same function with its reductions split and ordered differently (blocked softmax, T=1 against "
    "T=n kernels), a few u per reordered sum, accumulated over depth")

# Gated DeltaNet, chunked (within-chunk triangular solve and matmuls) against the token-by-token
# recurrence, outputs and final state over up to 150 tokens: the state sums T rounded outer products,
# in a different order. Seen: 3.1e-7. Kept at the old bound (2e-5 absolute at scale <= 1), which
# never failed, rather than tightened to ten times what one machine shows.
CHUNKED_VS_RECURRENT = Tolerance(
    "chunked_vs_recurrent", 2e-5,
    "two algorithms for one recurrence over T <= 150 tokens, the state's rounding growing with T")

# Elementwise work on logits against transformers' logits processors (temperature, top-k, top-p):
# one division per value, no reduction over the compared values. Seen: 9.3e-8. Old bound: rtol 1e-6.
ELEMENTWISE = Tolerance(
    "elementwise", 1e-6,
    "one or two rounded operations per value, a few u, no accumulation")

# bfloat16 weights against float32 weights, same model: bfloat16 keeps 8 significant bits (2**-8 =
# 3.9e-3 relative) of every weight and stored activation. Seen: 5.4e-3 (qwen3, 4 layers, 2.9e-2
# absolute). Old bound: 0.1 * max|logits| (the same at depth 4).
BF16_VS_FP32 = Tolerance(
    "bf16_vs_fp32", 5e-2,
    "bfloat16 rounding (2**-8 relative) of every weight and stored activation, accumulated over depth")


def bound(expected: np.ndarray, tol: Tolerance, depth: int = 1) -> float:
    """The absolute bound `assert_close` uses: tol.rel * sqrt(depth) * max(1, max|expected|)."""
    return tol.rel * float(np.sqrt(depth)) * max(1.0, float(np.max(np.abs(expected))))


def assert_close(actual, expected, tol: Tolerance, depth: int = 1, what: str = "") -> float:
    """assert max|actual - expected| <= bound(expected, tol, depth); returns the largest difference."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shapes differ, {actual.shape} vs {expected.shape}"
    err = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    atol = bound(expected, tol, depth)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    log = os.environ.get("SPD_JAX_TOLERANCE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(dict(test=os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], what=what,
                                    kind=tol.name, max_err=err, scale=scale, depth=depth, bound=atol,
                                    rel=err / (atol / tol.rel))) + "\n")
    assert err <= atol, (f"{what}: max |difference| {err:.3g} exceeds the {tol.name} bound {atol:.3g} "
                         f"= {tol.rel:g} x sqrt({depth}) x max(1, {scale:.3g}); {tol.why}")
    return err
