"""The engine's programs read each weight and cache once: XLA's own `cost_analysis()` of every part of an SPD
cycle (each stage's program as that device runs it, the PSM body, the heads' shards; `bench.xla_costs`)
against the cost model's bytes, at published widths with few layers and a short context (seconds of
compiling; Qwen3.5-4B itself at n = 8 is the `scale` test). A stacked weight indexed per slot was copied out
before its dot on XLA:CPU (3.3-3.8x the bytes of the stage programs, 1.9x the PSM body's), which this catches.
n divides both vocabularies: a head whose rows do not split evenly is read whole on each device and its shard
sliced out (3x its shard's bytes, docs/scale.md)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.xla_costs import compare_config
from spd_jax.config import ModelConfig


def _shortened(name: str, layers: int) -> ModelConfig:
    cfg = ModelConfig.named(name)
    return dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers])


@pytest.mark.parametrize("name, layers, n", [("smollm2-135m-instruct", 8, 4), ("qwen3.5-4b", 8, 4)])
def test_every_part_reads_what_the_cost_model_counts(name, layers, n):
    rows = compare_config(_shortened(name, layers), n, 256, "float32")
    assert any("stage program" in r["part"] for r in rows) and any("psm body" in r["part"] for r in rows)
    for r in rows:
        assert abs(r["bytes_ratio"] - 1) <= 0.10, r
        assert abs(r["flops_ratio"] - 1) <= 0.10, r
