"""The greedy schedule replayed from per-draft verdicts (`decode.schedule`) equals the SPD engine's run:
cycles, accepted and rejected drafts, under drafts right and wrong in any pattern, EOS and the budget;
and with a PSM, the teacher-forced drafts by fill (`psm.drafts_by_fill`) are the ones it verifies."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from infer import evaluate, replay
from spd_jax.datasets import read_benchmark
from spd_jax.decode import pipelined
from spd_jax.decode.schedule import replay_greedy
from spd_jax.drafters.psm import PSMConfig, drafts_by_fill, init_psm, save_psm
from spd_jax import methods

PROMPT = [1, 17, 42, 99, 5, 63, 7]
NEW = 24


@pytest.fixture(scope="module")
def deep(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])


@pytest.fixture(scope="module")
def reference(deep):
    return spd_jax.generate(deep, PROMPT, NEW, stop_at_eos=False).token_ids


def _counts(stats):
    return stats["tokens"], stats["cycles"], stats["accepted"], stats["rejected"]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_equals_the_engine_for_any_pattern_of_right_drafts(deep, reference, n, seed):
    """The oracle drafter proposes a reference with some tokens spoiled: a draft is right where its
    token was kept, at any fill, so the verdicts are known without the engine."""
    rng = np.random.default_rng(seed)
    keep = rng.random(NEW) < [0.9, 0.6, 0.3][seed]
    spoiled = [t if k else (t + 1) % deep.config.vocab_size for t, k in zip(reference, keep)]
    res = spd_jax.generate(deep, PROMPT, NEW, method=methods.SPD(n=n, drafter="oracle", oracle_tokens=spoiled),
                           stop_at_eos=False)
    assert res.token_ids == reference
    seq = PROMPT + reference
    right = np.zeros((len(seq), n), bool)
    right[len(PROMPT) - 1:-1] = np.asarray(keep)[:, None]  # the draft for t + 1 is spoiled[t + 1 - P]
    rep = replay_greedy(n, seq, len(PROMPT), right, NEW, eos_ids=())
    assert (rep.tokens, rep.cycles, rep.accepted, rep.rejected) == _counts(res.stats)
    assert rep.verified_fill.sum() == rep.accepted + rep.rejected
    assert rep.accepted_fill.sum() == rep.accepted and rep.verified_fill[0] >= rep.rejected


def test_replay_stops_at_eos_and_the_budget(deep, reference):
    eos = reference[9]
    stopper = dataclasses.replace(deep, config=dataclasses.replace(deep.config, eos_token_ids=(eos,)))
    seq = PROMPT + reference
    for new in (NEW, 5):
        res = spd_jax.generate(stopper, PROMPT, new, method=methods.SPD(n=4, drafter="oracle", oracle_tokens=reference))
        rep = replay_greedy(4, seq, len(PROMPT), np.ones((len(seq), 4), bool), new, eos_ids=(eos,))
        assert (rep.tokens, rep.cycles, rep.accepted, rep.rejected) == _counts(res.stats)
    with pytest.raises(ValueError, match="continuation"):
        replay_greedy(4, seq[:12], len(PROMPT), np.ones((12, 4), bool), NEW, eos_ids=())


@pytest.mark.parametrize("n,h_L", [(4, False), (8, False), (4, True)])
def test_psm_drafts_by_fill_replay_the_engines_run(deep, reference, n, h_L):
    """A (random) PSM in the engine against its teacher-forced drafts by fill, replayed; h_L: its completed
    rows also read the last layer's output (an anchor at L, which the last stage hands the drafter)."""
    plan = pipelined.plan_for(deep, n)
    anchors = PSMConfig.for_target(deep.config, plan.counts).anchors + ((deep.config.num_layers,) if h_L else ())
    spec = PSMConfig.for_target(deep.config, plan.counts, num_layers=1, anchors=anchors)
    variables = init_psm(deep.config, spec, deep.params, seed=3)
    res = spd_jax.generate(deep, PROMPT, NEW, method=methods.SPD(n=n, spec=(spec, variables)), stop_at_eos=False)
    assert res.token_ids == reference
    seq = PROMPT + reference
    nxt, drafts = (np.asarray(a)[0] for a in drafts_by_fill(deep.config, spec, variables, deep.params,
                                                             jnp.asarray([seq], jnp.int32)))
    assert (nxt[len(PROMPT) - 1:-1] == reference).all()  # teacher-forced argmax: the greedy continuation
    right = np.zeros((len(seq), n), bool)
    right[:-1] = drafts[:-1] == np.asarray(seq[1:])[:, None]
    rep = replay_greedy(n, seq, len(PROMPT), right, NEW, eos_ids=())
    assert (rep.tokens, rep.cycles, rep.accepted, rep.rejected) == _counts(res.stats)
    assert rep.rejected > 0


def test_replay_cli_reproduces_the_evaluated_spd_rows(deep, tmp_path):
    """infer.replay over an infer.evaluate run: every prompt's replayed counts equal the engine's spd
    row, and so do the pooled alpha and S0, and at a smaller budget the engine's runs with that budget;
    tables and plot are written. After another PSM is written to the same path, the run's spd rows (of
    the old one) are not checked against it."""
    n = 4
    spec = PSMConfig.for_target(deep.config, pipelined.plan_for(deep, n).counts, num_layers=1)
    psm = tmp_path / "psm"
    save_psm(psm, init_psm(deep.config, spec, deep.params, seed=5), spec)
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i, 3]}) + "\n" for i in range(3)))
    out = tmp_path / "eval"
    evaluate.evaluate(deep, {str(bench): read_benchmark(str(bench))}, ["ar", "spd"], [n], [0.0], 12, out,
                      spec=str(psm), progress=False)
    assert replay.main(["--from", str(out), "--model", str(deep.path), "--psm", str(psm), "--n", str(n)]) == 0
    res = json.loads((out / "replay" / "replay.json").read_text())["results"][0]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    spd = [r for r in rows if r["method"] == "spd"]
    pooled = res["pooled"]["all"]
    assert pooled["engine_checked"] == pooled["engine_equal"] == 3
    assert pooled["S0"] == pytest.approx(sum(r["tokens"] for r in spd) / sum(r["cycles"] for r in spd) * spec.n)
    assert len(res["agreement_by_fill"]) == n and (out / "replay" / "replay.png").stat().st_size > 0
    assert "3/3 prompts equal" in (out / "replay" / "replay.md").read_text()
    # the same runs with budget 8, replayed from the 12-token continuations, are the engine's own 8-token runs
    by = {e["L"]: e["pooled"] for e in res["by_length"]}
    assert [e["L"] for e in res["by_length"]] == [8, 12] and by[12]["all"]["S0"] == pooled["S0"]
    short = tmp_path / "eval8"
    evaluate.evaluate(deep, {str(bench): read_benchmark(str(bench))}, ["spd"], [n], [0.0], 8, short,
                      spec=str(psm), progress=False)
    spd8 = [json.loads(x) for x in (short / "results.jsonl").read_text().splitlines()]
    for key in ("tokens", "cycles", "accepted", "rejected"):
        assert by[8]["all"][key] == sum(r[key] for r in spd8), key
    assert by[8]["all"]["rejected"] > 0  # an untrained PSM: its drafts are rejected (schedule tests cover the rest)
    assert "L=8 | L=12" in (out / "replay" / "replay.md").read_text()
    ar = [r for r in rows if r["method"] == "ar"]
    for L in (8, 12):
        flags = [replay.repeats(r["token_ids"])[:L] for r in ar]
        assert by[L]["all"]["repeated"] == pytest.approx(sum(f.sum() for f in flags) / sum(len(f) for f in flags))
    # another PSM written to the same path: the engine's rows are the old one's (their drafter_id), not
    # checked against this one's replay
    shutil.rmtree(psm)
    save_psm(psm, init_psm(deep.config, spec, deep.params, seed=6), spec)
    assert replay.main(["--from", str(out), "--model", str(deep.path), "--psm", str(psm), "--n", str(n)]) == 0
    res = json.loads((out / "replay" / "replay.json").read_text())["results"][0]
    assert res["pooled"]["all"]["engine_checked"] == 0 and "no spd rows" in (out / "replay" / "replay.md").read_text()
    with pytest.raises(SystemExit):
        replay.main(["--n", "4"])  # --from is required
    assert replay.main(["--from", str(tmp_path / "none")]) == 2


def test_repeats_marks_the_tokens_that_close_a_seen_ngram():
    assert replay.repeats([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5]).tolist() == [False] * 7 + [True] * 4 + [False]
    assert not replay.repeats([7, 7, 7]).any() and replay.repeats([7, 7, 7, 7, 7]).tolist() == [False] * 4 + [True]
