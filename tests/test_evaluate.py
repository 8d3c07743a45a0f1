"""The evaluation harness end to end on a tiny model: every method (eagle3 at two chain lengths), tables
with the cost model's projections, plots, resume; the EAGLE-3 round's projection on its own."""

import json
from types import SimpleNamespace

import pytest

import spd_jax
from infer import evaluate
from spd_jax.drafters.store import content_id
from spd_jax.datasets import read_benchmark
from spd_jax.reports.plots import plot_results
from spd_jax.reports.results import pooled
from spd_jax.reports.tables import PROFILES, project, results_markdown


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=4)[0])


def test_harness_runs_every_method_and_resumes(tiny, tmp_path, monkeypatch):
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i]}) + "\n" for i in range(2)))
    prompts = {"b": read_benchmark(str(bench), limit=2)}
    out = tmp_path / "eval"
    methods = ["ar", "pipeline", "spd", "eagle3"]
    rows = evaluate.evaluate(tiny, prompts, methods, [2], [0.0], 8, out, spec="random", progress=False, ks=(3, 7),
                             drafter="random")
    assert len(rows) == 10  # 2 prompts x (ar, pipeline, spd, eagle3 at k = 3 and 7)
    by = {(r["method"], r.get("k"), r["prompt_index"]): r for r in rows}
    for i in range(2):  # greedy: every method commits exactly the autoregressive tokens
        ar = by[("ar", None, i)]["token_ids"]
        assert by[("spd", None, i)]["token_ids"] == by[("pipeline", None, i)]["token_ids"] == ar
        assert by[("eagle3", 3, i)]["token_ids"] == by[("eagle3", 7, i)]["token_ids"] == ar
    e3 = by[("eagle3", 7, 0)]
    assert e3["n"] == 1 and e3["k"] == 7 and e3["drafter_spec"] == "random" and e3["S0"] == e3["alpha"]
    assert e3["alpha"] == e3["tokens"] / e3["cycles"]  # tokens per target pass (cycles = verification rounds)
    table = pooled(rows)
    spd_all = next(t for t in table if t["bench"] == "all" and t["method"] == "spd")
    assert spd_all["tokens"] == sum(r["tokens"] for r in rows if r["method"] == "spd")
    assert spd_all["alpha"] == spd_all["tokens"] / sum(r["cycles"] for r in rows if r["method"] == "spd")
    e3_all = next(t for t in table if t["bench"] == "all" and t["method"] == "eagle3" and t["k"] == 3)
    assert e3_all["S0"] == e3_all["tokens"] / sum(r["cycles"] for r in rows if r.get("k") == 3)
    md = results_markdown(table, dict(model="tiny"))
    # random drafters are marked, so no one reads their S0 as a trained drafter's
    assert "| b | spd (untrained drafter) | 2 | 0 | 2 |" in md and "| b | eagle3 k=7 (untrained drafter) | 1 | 0 | 2 |" in md
    assert "| b | pipeline | 2 | 0 | 2 |" in md
    project(table, tiny.config)
    md = results_markdown(table, dict(model="tiny"))
    assert "proj. H200 | proj. TPU |" in md and "| all | ar | 1 | 0 | 2 |" in md
    for t in table:
        assert all(t["proj"][p]["speedup"] > 0 for p in PROFILES)
    plot_results(table, out)
    for png in ("s0_vs_n.png", "speed_vs_n.png", "cycle_breakdown.png"):
        assert (out / png).stat().st_size > 0

    # a rerun does not redo finished rows
    calls = []

    def generate(*a, **kw):
        calls.append(kw)
        raise RuntimeError("a row to do")

    monkeypatch.setattr(spd_jax, "generate", generate)
    again = evaluate.evaluate(tiny, prompts, methods, [2], [0.0], 8, out, spec="random", progress=False, ks=(3, 7),
                              drafter="random")
    assert calls == [] and len(again) == 10
    # another drafter is another setup: its eagle3 rows are to do
    _fake_drafter(tmp_path / "other", "eagle3.json", 0)
    with pytest.raises(RuntimeError, match="a row to do"):
        evaluate.evaluate(tiny, prompts, ["eagle3"], [2], [0.0], 8, out, spec="random", progress=False, ks=(3,),
                          drafter=str(tmp_path / "other"))
    assert calls[0]["method"].k == 3 and calls[0]["method"].drafter_spec == str(tmp_path / "other")


def _fake_drafter(directory, meta_name, version: int):
    """A drafter directory as `store.content_id` reads it (its json and params/), version making its content."""
    (directory / "params").mkdir(parents=True, exist_ok=True)
    (directory / meta_name).write_text(json.dumps(dict(format=2)))
    (directory / "params" / "w").write_bytes(bytes([version]) * 64)


def test_a_changed_drafter_at_the_same_path_is_computed_again(tiny, tmp_path, monkeypatch, caplog):
    """Every row records its drafter's content (drafter_id): after another PSM or EAGLE-3 drafter is
    written to the same path, a rerun into the same --out computes that path's rows again and returns
    only the new ones; rows from before ids were recorded are computed again too (their drafter is
    unknown), while ar rows (no drafter) are still reused."""
    psm, drafter = tmp_path / "psm", tmp_path / "drafter"
    _fake_drafter(psm, "psm.json", 0)
    _fake_drafter(drafter, "eagle3.json", 0)
    calls = []
    fake = dict(tokens=4, cycles=2, rounds=2, prompt_tokens=2, wall_s=1.0, tokens_per_s=4.0, compile_s=0.0,
                compile_from="x", timing_includes="x", backend="cpu")

    def generate(model, ids, max_new, *, method, **kw):  # method: the row's options object
        calls.append(method.name)
        stats = dict(fake, drafter_spec=getattr(method, "drafter_spec", None),
                     psm=str(method.spec) if method.name == "spd" else None)
        return SimpleNamespace(stats=stats, token_ids=[3])

    monkeypatch.setattr(spd_jax, "generate", generate)
    out = tmp_path / "eval"

    def run():
        calls.clear()
        return evaluate.evaluate(tiny, {"b": [{"ids": [1, 2]}]}, ["ar", "spd", "eagle3"], [2], [0.0], 4, out,
                                 spec=str(psm), progress=False, ks=(3,), drafter=str(drafter))

    first = run()
    assert calls == ["ar", "spd", "eagle3"]
    assert {r["method"]: r["drafter_id"] for r in first} == dict(ar=None, spd=content_id(psm),
                                                                 eagle3=content_id(drafter))
    assert len(run()) == 3 and calls == []  # the same drafters: every row reused
    old_psm = content_id(psm)
    _fake_drafter(psm, "psm.json", 1)  # another PSM shipped to the same path
    assert content_id(psm) != old_psm
    with caplog.at_level("WARNING"):
        again = run()
    assert calls == ["spd"] and "1 rows of" in caplog.text
    assert sorted(r["method"] for r in again) == ["ar", "eagle3", "spd"]  # the old spd row is not pooled
    assert next(r for r in again if r["method"] == "spd")["drafter_id"] == content_id(psm)
    _fake_drafter(drafter, "eagle3.json", 1)
    assert len(run()) == 3 and calls == ["eagle3"]
    # rows written before drafter ids: their drafter is unknown, so spd and eagle3 rows are done again
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    (out / "results.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "drafter_id"}) + "\n"
                                               for r in rows))
    assert len(run()) == 3 and calls == ["spd", "eagle3"]
    assert evaluate.drafter_id(tiny, "spd", 2, "random") == evaluate.drafter_id(tiny, "eagle3", 1) == "random"
    with pytest.raises(FileNotFoundError, match="not a drafter checkpoint"):
        evaluate.drafter_id(tiny, "spd", 2, str(tmp_path / "nothing"))


def test_a_method_may_carry_its_own_depths(tiny, tmp_path, monkeypatch):
    """`spd@8` runs spd at n = 8 only while the other methods run at every --n, in one interleaved run."""
    assert evaluate.parse_methods(["ar", "pipeline", "spd@8", "spd@4", "eagle3"]) == (
        ["ar", "pipeline", "spd", "eagle3"], {"spd": [8, 4]})
    for bad, msg in (("spd@x", "positive integer"), ("spd@0", "positive integer"), ("ar@2", "runs on one device")):
        with pytest.raises(ValueError, match=msg):
            evaluate.parse_methods([bad])
    done = []  # the jobs in order, from a fake generate that records them
    fake = dict(tokens=1, cycles=1, prompt_tokens=2, wall_s=1.0, tokens_per_s=1.0, compile_s=0.0, compile_from="x",
                timing_includes="x", backend="cpu", drafter_spec=None)
    monkeypatch.setattr(spd_jax, "generate", lambda model, ids, max_new, *, method, **kw: (
        done.append((method.name, getattr(method, "n", 1))) or type("R", (), dict(stats=fake, token_ids=[3]))()))
    evaluate.evaluate(tiny, {"b": [{"ids": [1, 2]}]}, ["ar", "pipeline", "spd"], [2, 4], [0.0], 4, tmp_path / "x",
                      progress=False, write=False, method_ns={"spd": [4]})
    assert done == [("ar", 1), ("pipeline", 2), ("pipeline", 4), ("spd", 4)]


def test_rows_run_in_blocks_of_prompts_each_method_in_turn():
    benches = {"a": [{"i": i} for i in range(5)], "b": [{"i": 0}]}
    configs = [("ar", 1, None), ("eagle3", 1, 3)]
    jobs = evaluate.job_order(benches, [0, 1], configs, block=2)
    assert len(jobs) == len(set((b, i, m, k, t) for b, i, _, m, _, k, t in jobs)) == 6 * 2 * 2  # each row once
    head = [(b, i, m, t) for b, i, _, m, _, _, t in jobs[:8]]  # a's prompts 0-1: T = 0 then 1, each config in turn
    assert head == [("a", 0, "ar", 0.0), ("a", 1, "ar", 0.0), ("a", 0, "eagle3", 0.0), ("a", 1, "eagle3", 0.0),
                    ("a", 0, "ar", 1.0), ("a", 1, "ar", 1.0), ("a", 0, "eagle3", 1.0), ("a", 1, "eagle3", 1.0)]
    assert [(b, i) for b, i, *_ in jobs[-4:]] == [("b", 0)] * 4  # a last, partial block, then the next benchmark
    assert all(p is benches[b][i] for b, i, p, *_ in jobs)
    one = evaluate.job_order(benches, [0], configs, block=1)  # block 1: every method on a prompt, then the next
    assert [(i, m) for _, i, _, m, *_ in one[:4]] == [(0, "ar"), (0, "eagle3"), (1, "ar"), (1, "eagle3")]
    with pytest.raises(ValueError, match="block must be at least 1"):
        evaluate.job_order(benches, [0], configs, block=0)


def test_known_benchmarks_follow_the_reference_conventions():
    mt = read_benchmark("mt_bench")
    assert len(mt) == 80 and mt[0]["text"].startswith("Compose an engaging travel blog post")  # first turn
    he = read_benchmark("humaneval", limit=3)
    assert len(he) == 3 and he[0]["text"].startswith("Complete the code I provided.\nfrom typing import List")
    assert len(read_benchmark("gsm8k", limit=5)) == 5
    with pytest.raises(FileNotFoundError, match="neither a known one"):
        read_benchmark("nope")


def test_a_bad_benchmark_line_is_named(tmp_path):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "cut\n')
    with pytest.raises(ValueError, match=r"b.jsonl:2 is not a JSON object"):
        read_benchmark(str(bad))
    bad.write_text('["a list"]\n')
    with pytest.raises(ValueError, match=r"b.jsonl:1 is not a JSON object"):
        read_benchmark(str(bad))


def test_the_commands_that_made_the_rows_are_recorded(tmp_path):
    evaluate.record_command(tmp_path, ["--methods", "ar,spd", "--limit", "40"])
    evaluate.record_command(tmp_path, ["--methods", "eagle3", "--k", "3,7"])
    evaluate.record_command(tmp_path, ["--methods", "ar,spd", "--limit", "40"])  # a resumed run: once
    assert (tmp_path / "commands.txt").read_text().splitlines() == [
        "python -m infer.evaluate --methods ar,spd --limit 40", "python -m infer.evaluate --methods eagle3 --k 3,7"]


def test_a_refused_command_is_not_recorded(tiny, tmp_path, monkeypatch):
    """A depth the model cannot split into fails before any row and leaves no line in commands.txt; a
    setup that holds records its command before its first row."""
    out = tmp_path / "e"
    with pytest.raises(ValueError, match="n=64 pipeline stages for a model of 4 layers"):
        evaluate.evaluate(tiny, {"b": [{"ids": [1, 2]}]}, ["ar", "pipeline"], [64], [0.0], 4, out, progress=False,
                          command=["--methods", "ar,pipeline", "--n", "64"])
    assert not (out / "commands.txt").exists()
    first = []

    def killed(*a, **kw):  # a run killed at its first row
        first.append((out / "commands.txt").read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(spd_jax, "generate", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate.evaluate(tiny, {"b": [{"ids": [1, 2]}]}, ["ar"], [2], [0.0], 4, out, progress=False,
                          command=["--methods", "ar"])
    assert first == ["python -m infer.evaluate --methods ar\n"]


def test_limit_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--bench", "gsm8k", "--methods", "ar", "--limit", "0"])
    assert e.value.code == 2 and "--limit takes at least 1 prompt per benchmark, got 0" in capsys.readouterr().err
