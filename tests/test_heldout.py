"""Scoring runs on a common held-out set (train/heldout.py, train/heldout_report.py): the score is the
training objective's mean per position under fills keyed by sequence, whatever the batching; runs that
may have trained on the held-out conversations are refused; runs compare at equal training positions,
and reports from several sessions join when they share a set; on the real model, the CLI scores a run's
start and checkpoints on the target's own greedy replies."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.drafters.psm import PSMConfig
from train import corpus as train_corpus, data as train_data, heldout, heldout_report, step as train_step
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])


def test_score_is_the_mean_per_position_whatever_the_batching(llama):
    tc = TrainConfig.of(model=str(llama.path), n=4, psm_layers=2, buckets=(48,), max_len=48)
    spec = PSMConfig.for_target(llama.config, pipelined.plan_for(llama, 4).counts, tc.psm_layers)
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(heldout.BATCH + 3):  # a partial last batch; lengths out of order (the scorer sorts)
        ids = rng.integers(3, llama.config.vocab_size, rng.integers(12, 48)).astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[rng.integers(2, 8):-1] = True
        seqs.append((ids, mask))
    state, frozen = train_step.init_state(llama, spec, tc, train_step.make_optimizer(tc))
    got = heldout.scorer(llama, spec, tc, heldout.Teacher(llama, tc, seqs))(state["params"], frozen)

    # each sequence alone, its fills keyed by its index in the set
    loss = jax.jit(train_step.loss_fn(llama.config, spec, tc))
    kl = agree = 0.0
    for i, s in enumerate(seqs):
        key = jax.random.fold_in(jax.random.key(heldout.SEED), i)[None]
        _, sums = loss(state["params"], frozen, llama.params, train_corpus.pad_batch([s], tc.buckets), key)
        kl, agree = kl + float(sums["kl_sum"]), agree + float(sums["agree_sum"])
    positions = sum(int(m.sum()) for _, m in seqs)
    # float32 sums over ~300 positions in another order: relative error well under 1e-5
    assert got["kl"] == pytest.approx(kl / positions, rel=1e-5)
    assert got["agreement"] == pytest.approx(agree / positions, abs=0.5 / positions)  # counts: exact
    # the score reads the weights it is given
    moved = jax.tree.map(lambda p: p * 1.5, state["params"])
    assert heldout.scorer(llama, spec, tc, heldout.Teacher(llama, tc, seqs))(moved, frozen)["kl"] != \
        pytest.approx(got["kl"], rel=1e-3)
    # by fill: the same counts split by the simulated fill, whose positions weight them back to the whole
    by, count = np.asarray(got["agreement_by_fill"]), np.asarray(got["positions_by_fill"])
    assert by.shape == (4,) and count.sum() == positions and (count > 0).all()
    assert (by * count).sum() / positions == pytest.approx(got["agreement"], abs=1e-5)
    # the teacher's features computed once at a union of anchors (one more than this PSM reads: h_L) and
    # shared: the same scores as the forward inside the loss
    union = tuple(sorted(set(spec.anchors) | {llama.config.num_layers}))
    shared = heldout.scorer(llama, spec, tc, heldout.Teacher(llama, tc, seqs, anchors=union))(state["params"], frozen)
    assert shared["kl"] == pytest.approx(got["kl"], rel=1e-5) and shared["agreement"] == got["agreement"]
    assert shared["agreement_by_fill"] == got["agreement_by_fill"]


def _run(tmp_path, name, **config):
    d = tmp_path / name
    d.mkdir()
    (d / "run.json").write_text(json.dumps(dict(config=config)))
    return heldout.read_run(d)


def test_runs_that_may_have_trained_on_the_heldout_set_are_refused(tmp_path):
    ok = _run(tmp_path, "a", limit=400)
    heldout.check_runs([ok], offset=400, count=32)
    with pytest.raises(ValueError, match=r"every conversation .* \(no limit\), so none is held out: .* limit=N"):
        heldout.check_runs([ok, _run(tmp_path, "b")], offset=400, count=32)
    with pytest.raises(ValueError, match=r"conversations 0 \.\. 499 .* overlaps .* pass --offset 500"):
        heldout.check_runs([_run(tmp_path, "c", limit=500)], offset=400, count=32)
    with pytest.raises(ValueError, match="has max_len=256, .* one held-out set"):
        heldout.check_runs([ok, _run(tmp_path, "d", limit=400, max_len=256)], offset=400, count=32)
    with pytest.raises(ValueError, match="has method='eagle3', .* one objective"):
        heldout.check_runs([ok, _run(tmp_path, "e", limit=400, method="eagle3")], offset=400, count=32)
    # a warm start's own training data is unknown here
    with pytest.raises(ValueError, match="started from spd_jax/psms/x \\(init_from\\)"):
        heldout.check_runs([_run(tmp_path, "f", limit=400, init_from="spd_jax/psms/x")], offset=400, count=32)
    with pytest.raises(FileNotFoundError, match="not a training run directory"):
        heldout.read_run(tmp_path / "missing")
    # a run on a replies corpus is held out by the corpus's own --heldout range
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps(dict(settings=dict(heldout=[400, 500]))))
    on_replies = _run(tmp_path, "g", replies=str(corpus))
    heldout.check_runs([on_replies, ok], offset=400, count=100)
    with pytest.raises(ValueError, match=r"holding out conversations 400 \.\. 499 .* held-out set 450 \.\. 549"):
        heldout.check_runs([on_replies], offset=450, count=100)
    with pytest.raises(ValueError, match="init_from"):
        heldout.check_runs([_run(tmp_path, "h", replies=str(corpus), init_from="spd_jax/psms/x")], offset=400, count=32)
    (corpus / "manifest.json").write_text(json.dumps(dict(settings=dict(heldout=[400, 500], limit=450))))
    with pytest.raises(ValueError, match="first 450 conversations, which never read its held-out range 400 .. 499"):
        heldout.check_runs([on_replies], offset=400, count=32)


def test_runs_compare_at_the_positions_all_reached():
    rows = [dict(run="a", step=s, train_positions=p, kl=k, agreement=g)
            for s, p, k, g in [(0, 0, 9, 0.0), (10, 100, 5, 0.2), (20, 200, 3, 0.4)]]
    rows += [dict(run="b", step=s, train_positions=p, kl=k, agreement=g) for s, p, k, g in [(0, 0, 8, 0.1), (5, 150, 4, 0.3)]]
    common, at = heldout_report.at_equal_positions(rows)
    assert common == 150  # b's last; a is interpolated between its steps 10 and 20, b is its step 5
    assert at["a"] == dict(kl=pytest.approx(4.0), agreement=pytest.approx(0.3), between=[10, 20])
    assert at["b"] == dict(kl=4.0, agreement=0.3, between=[5])


def test_runs_differing_only_in_seed_are_grouped(tmp_path):
    """by_setting: a setting's seeds pooled (mean, min, max; by fill the mean); the seed is not a setting."""
    runs = [_run(tmp_path, f"{arm}-s{seed}", limit=400, seed=seed, **kw)
            for arm, kw in (("base", {}), ("norm", dict(anchor_norm=True))) for seed in (0, 1, 2)]
    equal = {r.path.name: dict(kl=5.0 + i, agreement=0.1 * (i % 3 + 1), agreement_by_fill=[0.2, 0.1 * i])
             for i, r in enumerate(runs)}
    got = heldout_report.by_setting({r.path.name: r.tc.to_flat() for r in runs}, equal)
    assert set(got) == {"anchor_norm=False", "anchor_norm=True"}
    base = got["anchor_norm=False"]
    assert base["runs"] == ["base-s0", "base-s1", "base-s2"]
    assert base["kl"] == dict(mean=6.0, min=5.0, max=7.0)
    assert base["agreement"] == dict(mean=pytest.approx(0.2), min=0.1, max=pytest.approx(0.3))
    assert base["agreement_by_fill"] == [pytest.approx(0.2), pytest.approx(0.1)]


def test_reports_from_several_sessions_join_into_one_table(tmp_path, capsys):
    """--merge: two sessions' reports on one held-out set make one table, a setting's seeds pooled across
    them; a report on another set (its digest), one scoring a run again, or one without configs is refused."""
    held = dict(offset=400, count=100, turns="every", sources=["gsm8k"], max_len=512, sequences=3, repeats=0,
                positions=90, digest="ab12", fills_seed=heldout.SEED)
    configs = {f"{arm}-s{seed}": TrainConfig.of(seed=seed, lr=lr).to_flat()
               for arm, lr in (("lr1e-3", 1e-3), ("lr3e-4", 3e-4)) for seed in (0, 1, 2)}

    def session(names, agreement, held=held):
        rows = [dict(run=n, step=s, train_positions=100 * s, kl=5.0 - s, agreement=agreement + 0.01 * i + 0.1 * s)
                for i, n in enumerate(names) for s in (0, 2)]
        out = tmp_path / "-".join(names)
        heldout_report.report(rows, {n: configs[n] for n in names}, held, out)
        return str(out / "heldout.json")

    a, b = session(["lr1e-3-s0", "lr3e-4-s0"], 0.2), session(["lr1e-3-s1", "lr3e-4-s1"], 0.3)
    assert heldout.main(["--merge", a, b, "--out", str(tmp_path / "all")]) == 0
    joined = json.loads((tmp_path / "all" / "heldout.json").read_text())
    assert set(joined["configs"]) == set(configs) - {"lr1e-3-s2", "lr3e-4-s2"} and len(joined["rows"]) == 8
    fast = joined["by_setting"]["lr=0.001"]
    assert fast["runs"] == ["lr1e-3-s0", "lr1e-3-s1"]
    assert fast["agreement"] == dict(mean=pytest.approx(0.45), min=pytest.approx(0.4), max=pytest.approx(0.5))
    assert "| lr=0.0003 | 2 |" in (tmp_path / "all" / "heldout.md").read_text()

    other = session(["lr1e-3-s2"], 0.2, dict(held, digest="cd34"))
    assert heldout.main(["--merge", a, other, "--out", str(tmp_path / "x")]) == 2
    assert "different held-out sets (digest: ab12 vs cd34)" in capsys.readouterr().err
    assert heldout.main(["--merge", a, a, "--out", str(tmp_path / "x")]) == 2
    assert "'lr1e-3-s0' is in two of the reports" in capsys.readouterr().err
    old = json.loads(Path(a).read_text())
    del old["configs"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert heldout.main(["--merge", str(tmp_path / "old.json"), "--out", str(tmp_path / "x")]) == 2
    assert "score its runs again to merge them" in capsys.readouterr().err
    assert heldout.main(["--merge", a]) == 2  # nowhere to write the joined report
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


class _Tokenizer:
    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and len(msgs) == 1
        return [1] + [int(w) for w in msgs[0]["content"].split()]


def test_heldout_prompts_are_the_named_conversations_of_each_source(monkeypatch):
    """Conversations offset .. offset + count - 1 of each source, counted per source; a held-out first
    turn equal to one a run trained on (index < seen_below in its source) is dropped and counted. A run's
    prompt_pattern does not narrow the set: it is every conversation in that range."""
    def conversations(tc):  # as train_data.conversations: skip and limit count all, the pattern filters within
        for src, n in (("one", 9), ("two", 7)):  # "two"'s conversation 5 repeats its conversation 1
            for i in range(min(n, tc.limit)):
                text = f"{9 if src == 'one' else 7} {1 if (src, i) == ('two', 5) else i}"
                if tc.prompt_pattern is None or re.search(tc.prompt_pattern, text):
                    yield src, [dict(role="user", content=text), dict(role="assistant", content="x")]

    monkeypatch.setattr(train_data, "conversations", conversations)
    model = type("M", (), dict(tokenizer=_Tokenizer()))()
    tc = TrainConfig.of(max_len=64)
    prompts, repeats = heldout.heldout_prompts(model, tc, offset=4, count=3, seen_below=4)
    assert [p.tolist() for p in prompts] == [[1, 9, 4], [1, 9, 5], [1, 9, 6], [1, 7, 4], [1, 7, 6]]
    assert repeats == 1
    coded = TrainConfig.of(max_len=64, prompt_pattern="^9 [0-3]$")  # a run trained on a few of the first
    assert [p.tolist() for p in heldout.heldout_prompts(model, coded, offset=4, count=3, seen_below=4)[0]] == \
        [p.tolist() for p in prompts]
    prompts, repeats = heldout.heldout_prompts(model, tc, offset=4, count=3)  # nothing to compare with
    assert len(prompts) == 6 and repeats == 0


class _ChatTokenizer:
    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
        return [1] + [int(w) for m in msgs for w in m["content"].split()]


def test_every_turn_of_the_heldout_conversations_and_none_a_replies_run_trained_on(monkeypatch, tmp_path):
    """--turns every: each user turn with its context, up to the first past max_len - MIN_ROOM; a held-out
    prompt that a run's replies corpus holds (a repeated conversation) is dropped."""
    def conversations(tc):
        for i in range(min(6, tc.limit)):
            yield "one", [dict(role="user", content=f"{i}"), dict(role="assistant", content="50 " * (i + 1)),
                          dict(role="user", content="60"), dict(role="assistant", content="70")]

    monkeypatch.setattr(train_data, "conversations", conversations)
    model = type("M", (), dict(tokenizer=_ChatTokenizer()))()
    tc = TrainConfig.of(max_len=23)  # a prompt may hold 7 tokens: conversation 4's second turn is 1 + 1 + 5 + 1
    prompts, _ = heldout.heldout_prompts(model, tc, offset=3, count=2, every_turn=True)
    assert [p.tolist() for p in prompts] == [[1, 3], [1, 3] + [50] * 4 + [60], [1, 4]]
    first, _ = heldout.heldout_prompts(model, tc, offset=3, count=2)
    assert [p.tolist() for p in first] == [[1, 3], [1, 4]]
    seqs = [(np.asarray(p.tolist() + [9, 9]), np.arange(len(p) + 2) >= len(p) - 1) for p in prompts]
    run = heldout.Run(tmp_path, TrainConfig.of(replies=str(tmp_path), replies_chunks=2))
    monkeypatch.setattr(heldout.replies, "read_corpus", lambda out, chunks: [seqs[1]] if chunks == 2 else [])
    assert [ids.tolist() for ids, _ in heldout.without_trained_prompts(seqs, [run])] == [
        seqs[0][0].tolist(), seqs[2][0].tolist()]


@pytest.mark.real_model
def test_cli_scores_runs_on_the_targets_replies(smollm2, tmp_path, monkeypatch, capsys):
    """A two-step train.main run and a copy of its run.json with a random start (no checkpoints: scored
    at its start only), scored on the target's replies to GSM8K's train conversations 8 and 9."""
    monkeypatch.setattr(train_data, "corpus_dir", lambda: tmp_path / "corpus")  # the held-out replies are generated here
    run = tmp_path / "from-target"
    r = subprocess.run([sys.executable, "-m", "train.main", "--config", str(ROOT / "configs/train/smollm2-n8.yaml"),
                        "--mesh", "1x1", "--out", str(run), "sources=[gsm8k]", "limit=8", "buckets=[160]", "max_len=160",
                        "batch_size=2", "heldout=0", "eval_every=100", "save_every=1", "n=2", "--steps", "2"],
                       cwd=ROOT, env=dict(__import__("os").environ, JAX_PLATFORMS="cpu"), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((run / "run.json").read_text())
    rec["config"]["layers_from_target"] = False
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "run.json").write_text(json.dumps(rec))

    assert heldout.main([str(run), str(tmp_path / "random"), "--offset", "8", "--count", "2", "--batch", "2",
                         "--out", str(tmp_path / "cmp")]) == 0
    res = json.loads((tmp_path / "cmp" / "heldout.json").read_text())
    assert [(x["run"], x["step"]) for x in res["rows"]] == [("from-target", 0), ("from-target", 1),
                                                            ("from-target", 2), ("random", 0)]
    assert res["differences"] == {"from-target": "layers_from_target=True", "random": "layers_from_target=False"}
    assert res["rows"][2]["train_positions"] > res["rows"][1]["train_positions"] > 0
    assert res["rows"][0]["kl"] != res["rows"][3]["kl"]  # two starts, one held-out set
    assert res["equal_positions"] == 0 and (tmp_path / "cmp" / "heldout.png").is_file()

    # the held-out set: the 10th conversation's first turn and the target's own greedy reply (cached)
    tc = TrainConfig.from_dict(rec["config"])
    seqs, repeats = heldout.heldout_set(smollm2, tc, 8, 2, seen_below=8)
    ids, mask = seqs[1]
    prompt = heldout.heldout_prompts(smollm2, tc, 8, 2, seen_below=8)[0][1]
    assert ids[:len(prompt)].tolist() == prompt.tolist() and mask.sum() == len(ids) - len(prompt)
    assert ids[len(prompt):].tolist() == spd_jax.generate(smollm2, prompt.tolist(), 160 - len(prompt)).token_ids
    assert repeats == 0 and res["heldout"]["positions"] == sum(int(m.sum()) for _, m in seqs)
    # only the steps asked for; one the run does not keep, or a run that trained on conversation 8, is refused
    assert heldout.main([str(run), "--offset", "8", "--count", "2", "--steps", "2", "--out", str(tmp_path / "c2")]) == 0
    assert [x["step"] for x in json.loads((tmp_path / "c2" / "heldout.json").read_text())["rows"]] == [0, 2]
    # a report joins another session's only on the same set: this one's digest is the sequences'
    assert res["heldout"]["digest"] == heldout.set_digest(seqs)
    assert heldout.main([str(tmp_path / "random"), "--offset", "8", "--count", "2", "--merge",
                         str(tmp_path / "c2" / "heldout.json"), "--out", str(tmp_path / "c3")]) == 0
    joined = json.loads((tmp_path / "c3" / "heldout.json").read_text())["rows"]
    assert joined == [res["rows"][i] for i in (0, 2, 3)]  # c2's two states, then the random start, as scored before
    assert heldout.main([str(run), "--offset", "8", "--count", "2", "--steps", "5"]) == 2
    assert heldout.main([str(run), "--offset", "4"]) == 2
    err = capsys.readouterr().err
    assert "keeps no checkpoint of step(s) [5] (kept: [1, 2])" in err and "pass --offset 8" in err
