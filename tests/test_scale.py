"""Checks at a model's published size, from abstract shapes (no weight is made): the cost model's FLOPs and
bytes per part of an SPD cycle of Qwen3.5-4B at n = 8 against XLA's own `cost_analysis()` of the compiled
programs (`bench.xla_costs`, about a minute of compiling); and `bench.scale` end to end on a tiny config (about
two minutes). Marked `scale`: not in the default run; CI runs them as a step of its own. The full run at 4B is
`python -m bench.scale --config qwen3.5-4b --n 8` (docs/scale.md)."""

from __future__ import annotations

import pytest

from bench.xla_costs import compare

pytestmark = pytest.mark.scale


@pytest.fixture(scope="module")
def rows():
    # float32: XLA:CPU then runs every weight's dot as the cost model counts it (in bfloat16 it converts each
    # weight to float32 first, docs/scale.md)
    return {r["part"]: r for r in compare("qwen3.5-4b", 8, 1024, "float32")}


def test_flops_within_10_percent_of_xla_for_every_part(rows):
    for part, r in rows.items():
        assert abs(r["flops_ratio"] - 1) <= 0.10, (part, r)


def test_bytes_within_10_percent_of_xla_for_every_part(rows):
    """Every part as the engine runs it, the stage programs and the PSM body included: each weight and cache is
    read once (one buffer per layer; a stacked layout made XLA:CPU copy each slot out first, 3.3x)."""
    for part, r in rows.items():
        assert abs(r["bytes_ratio"] - 1) <= 0.10, (part, r)


def test_bench_scale_end_to_end_on_a_small_config():
    """`bench.scale` as the full run takes it, on tiny Qwen3.5 at n = 2 (every phase a process of its own, `spd` and
    `tp` two): the greedy tokens of spd, ar and tp equal, the training loss finite, the step's gradient norm that
    of the loss computed query by query."""
    from bench import scale

    assert scale.main(["--config", "tiny-qwen3_5", "--n", "2", "--prompt", "40", "--train-seq", "64"]) == 0
