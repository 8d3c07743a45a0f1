"""The evaluation harness end to end on a tiny model: every method, tables, plots, resume."""

import json

import pytest

import spd_jax
from infer import evaluate


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=4)[0])


def test_harness_runs_every_method_and_resumes(tiny, tmp_path, monkeypatch):
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i]}) + "\n" for i in range(2)))
    prompts = {"b": evaluate.read_benchmark(str(bench), limit=2)}
    out = tmp_path / "eval"
    rows = evaluate.evaluate(tiny, prompts, ["ar", "pipeline", "spd"], [2], [0.0], 8, out, spec="random",
                             progress=False)
    assert len(rows) == 6
    by = {(r["method"], r["prompt_index"]): r for r in rows}
    for i in range(2):  # greedy: every method commits exactly the autoregressive tokens
        assert by[("spd", i)]["token_ids"] == by[("pipeline", i)]["token_ids"] == by[("ar", i)]["token_ids"]
    table = evaluate.pooled(rows)
    spd_all = next(t for t in table if t["bench"] == "all" and t["method"] == "spd")
    assert spd_all["tokens"] == sum(r["tokens"] for r in rows if r["method"] == "spd")
    assert spd_all["alpha"] == spd_all["tokens"] / sum(r["cycles"] for r in rows if r["method"] == "spd")
    md = evaluate.results_markdown(table, dict(model="tiny"))
    assert "| b | spd | 2 | 0 | 2 |" in md
    evaluate.plot(table, out)
    assert (out / "s0_vs_n.png").stat().st_size > 0 and (out / "speed_vs_n.png").stat().st_size > 0

    # a rerun does not redo finished rows
    calls = []
    monkeypatch.setattr(spd_jax, "generate", lambda *a, **k: calls.append(1))
    again = evaluate.evaluate(tiny, prompts, ["ar", "pipeline", "spd"], [2], [0.0], 8, out, spec="random",
                              progress=False)
    assert calls == [] and len(again) == 6


def test_known_benchmarks_follow_the_reference_conventions():
    mt = evaluate.read_benchmark("mt_bench")
    assert len(mt) == 80 and mt[0]["text"].startswith("Compose an engaging travel blog post")  # first turn
    he = evaluate.read_benchmark("humaneval", limit=3)
    assert len(he) == 3 and he[0]["text"].startswith("Complete the code I provided.\nfrom typing import List")
    assert len(evaluate.read_benchmark("gsm8k", limit=5)) == 5
    with pytest.raises(FileNotFoundError, match="neither a known one"):
        evaluate.read_benchmark("nope")
