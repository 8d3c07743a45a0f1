"""Checks at a model's published size, from abstract shapes (no weight is made): the cost model's FLOPs and
bytes per part of an SPD cycle of Qwen3.5-4B at n = 8 against XLA's own `cost_analysis()` of the compiled
programs (`bench.xla_costs`, about a minute of compiling); `bench.scale` end to end on a tiny config (about
two minutes); and `infer.generate --n 2` at Qwen3.5-0.8B's size, where one process of host devices deadlocks
XLA:CPU and the CLI runs processes instead (about two minutes). Marked `scale`: not in the default run; CI runs them as a step of its own. The full run at 4B is
`python -m bench.scale --config qwen3.5-4b --n 8` (docs/scale.md)."""

from __future__ import annotations

import json

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


def test_the_cli_runs_a_model_that_deadlocks_one_process_as_processes(tmp_path):
    """`infer.generate --n 2` at Qwen3.5-0.8B's size (a random 1.5 GB checkpoint) on this CPU: two host devices of
    one process deadlocked XLA:CPU there (3 of 5 runs, docs/scale.md), so the CLI runs two processes of one
    device each itself and says so; bounded by a timeout, as a hang would be."""
    import subprocess
    import sys

    from spd_jax.convert.random import write_random_checkpoint

    ckpt = write_random_checkpoint("qwen3.5-0.8b", tmp_path / "ckpt")
    r = subprocess.run([sys.executable, "-m", "infer.generate", "--model", str(ckpt), "--dtype", "bfloat16", "--n", "2",
                        "--random-psm", "--prompt-ids", "1,5,9,3,17,2", "--max-new-tokens", "8", "--no-eos", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "running 2 processes of one device each instead (--processes 2" in r.stderr
    row = json.loads(r.stdout.splitlines()[-1])
    assert len(row["token_ids"]) == 8 and row["stats"]["processes"] == 2 and row["stats"]["devices"] == 2
