"""n = 16, the paper's deepest pipeline: spd (a random PSM), the plain pipeline and ppsd (a random head) on
16 stage devices equal `ar`: greedy token for token, the pipeline's sampled tokens draw for draw (it draws
each token with `ar`'s key), spd's and ppsd's sampled tokens in distribution (chi-square). 16 host devices
need a process of their own (the test session has 8): `infer.evaluate` runs the rows there (which is also
the evaluation at n = 16), tests/pair_counts.py the seeded draws. A tiny 16-layer Qwen3.5 (one layer a
stage, the kinds mixed over the stages) and SmolLM2 (30 layers: an uneven plan)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import spd_jax
from spd_jax.reports.results import read_rows
from two_tokens import TwoTokens

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")
PROMPT = [5, 9, 11]


def _evaluate16(model: str, bench: str, out: Path, limit: int, new: int) -> list[dict]:
    """ar and, at n = 16, pipeline, spd and ppsd (random drafters) at T = 0 and 1 -> the results rows."""
    r = subprocess.run([sys.executable, "-m", "infer.evaluate", "--model", model, "--bench", bench, "--methods",
                        "ar,pipeline@16,spd@16,ppsd@16", "--temperature", "0,1", "--random-psm", "--ppsd", "random",
                        "--limit", str(limit), "--max-new-tokens", str(new), "--out", str(out),
                        "--no-compile-cache"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_rows(out / "results.jsonl")


def _check_rows(rows: list[dict], num_layers: int, prompts: int) -> None:
    ar = {(r["bench"], r["prompt_index"], r["temperature"]): r["token_ids"] for r in rows if r["method"] == "ar"}
    staged = [r for r in rows if r["method"] != "ar"]
    assert len(ar) == 2 * prompts and len(staged) == 3 * 2 * prompts
    for r in staged:
        plan = r["stage_layers"]
        assert r["n"] == 16 and len(plan) == 16 and sum(plan) == num_layers, r
        same = r["token_ids"] == ar[(r["bench"], r["prompt_index"], r["temperature"])]
        # greedy: every method; sampled: the pipeline draws each token with ar's key, the drafted ones differ
        # where a draft was accepted (their distribution: test_sampling_at_n16)
        assert same or (r["temperature"] == 1 and r["method"] != "pipeline"), r
        if r["method"] != "pipeline" and r["temperature"] == 0:
            assert r["rejected"] > 0, r  # random drafters: rollbacks across all 16 stages
    assert {r["psm_device"] for r in staged if r["method"] == "ppsd"} == {0}  # its head on stage 0's device


@pytest.fixture(scope="module")
def qwen16(tiny_ckpt):
    """A tiny Qwen3.5 of 16 layers (LLLA x 4): at n = 16 every stage holds one layer, of either kind."""
    return tiny_ckpt("qwen3_5", False, num_hidden_layers=16)[0]


def test_tiny_qwen3_5_at_n16_equals_ar(qwen16, tmp_path):
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i, 3]}) + "\n" for i in range(2)))
    _check_rows(_evaluate16(str(qwen16), str(bench), tmp_path / "eval", 2, 12), 16, 2)


def _pair_counts(model: str, method: str, runs: int, wrong: bool = False) -> dict[tuple, int]:
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "pair_counts.py"), "16", model, method, str(runs),
                        ",".join(map(str, PROMPT)), *(["--accept-every-draft"] if wrong else [])],
                       cwd=ROOT, env=dict(ENV, PYTHONPATH=os.pathsep.join([str(ROOT), ENV.get("PYTHONPATH", "")])),
                       capture_output=True, text=True, timeout=1800)  # a script: this checkout's spd_jax on its path
    assert r.returncode == 0, r.stderr[-3000:]
    return {tuple(int(t) for t in k.split(",")): v for k, v in json.loads(r.stdout).items()}


@pytest.mark.parametrize("method", ["spd", "ppsd"])
def test_sampling_at_n16_matches_the_target_distribution(qwen16, method):
    """The first two sampled tokens (the second a draft verified by speculative sampling after 15 cycles)
    follow the target's warped joint distribution (chi-square), and a deliberately wrong rule (accept every
    draft) fails the same test: tests/test_spd.py's check, at n = 16."""
    model = spd_jax.load_model(qwen16)

    pvalue = TwoTokens(model, PROMPT).pvalue
    outside, p_ok = pvalue(_pair_counts(str(qwen16), method, 300))
    outside_bad, p_bad = pvalue(_pair_counts(str(qwen16), method, 150, wrong=True))
    print(f"{method} at n=16: correct rule p={p_ok:.3g}; wrong rule {outside_bad} outside the support, p={p_bad:.3g}")
    assert outside == 0 and p_ok > 1e-3
    assert outside_bad > 0 or p_bad < 1e-6


@pytest.mark.real_model
def test_smollm2_at_n16_equals_ar(smollm2, tmp_path):
    """SmolLM2's 30 layers over 16 stages: an uneven plan (1 and 2 layers a stage), on benchmark prompts."""
    rows = _evaluate16("smollm2-135m-instruct", "gsm8k", tmp_path / "eval", 2, 8)
    _check_rows(rows, 30, 2)
    assert {max(r["stage_layers"]) for r in rows if r["method"] != "ar"} == {2}
