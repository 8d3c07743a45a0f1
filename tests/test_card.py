"""The model card is built from the run's and the evaluation's files, figures included, and reports only
the evaluation rows of its own drafter (and `ar`'s of the same setup)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spd_jax.drafters.store import content_id
from spd_jax.reports import cards, lineage
from spd_jax.reports.results import label_is_dir
from train import card
from train.checkpoints import warm_start_record

SETUP = dict(model="smollm2-135m-instruct", max_new_tokens=128, seed=0, backend="cpu")


def _write_rows(ev, rows):
    (ev / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _psm_run(tmp_path):
    run, ev, psm = tmp_path / "run", tmp_path / "eval", tmp_path / "psm"
    for d in (run, ev, psm / "params"):
        d.mkdir(parents=True)
    # lr as YAML reads "3e-4"; clip left to its default; tau other than 1
    (run / "run.json").write_text(json.dumps(dict(
        identity=dict(model="/x/smollm2-135m-instruct"),
        commands=["python -m train.main --config c.yaml", "python -m train.main --config c.yaml --export 2"],
        exports=["python -m train.main --config c.yaml --export 1"],
        config=dict(sources=["sharegpt"], max_len=512, lr="3e-4", warmup=100, batch_size=8, tau=2.0))))
    rows = [dict(step=s, positions=1000 * s, loss=5.0 / s, agreement=0.1 * s) for s in range(1, 4)]
    rows[-1] |= dict(alpha=0.5, S0=3.75)
    rows.append(dict(step=4, positions=4000, loss=1.0, agreement=0.4))  # after the exported step: not in the card
    for r, wall in zip(rows, (30, 60, 7200, 7230)):  # a pause between steps 2 and 3 does not move the median
        r["wall_s"] = wall
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (psm / "psm.json").write_text(json.dumps(dict(anchors=[0, 3], num_layers=2, plan=[3, 3, 4, 4, 4, 4, 4, 4],
                                                  target=["llama", 576, 30, 49152, 9, 3], draft_vocab=0,
                                                  trained=dict(steps=3, positions=3000, wall_s=7200, backend="cpu",
                                                               mesh="1x1"))))
    (psm / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    return run, ev, psm


def _res(method, n, count=2, tokens=10, cycles=20, **kw):
    common = dict(prompt_tokens=5, wall_s=1.0, timing_includes="x", depth_ratio=7.5, temperature=0.0, **SETUP)
    return [dict(bench="gsm8k", prompt_index=i, method=method, n=n, tokens=tokens, cycles=cycles, **(common | kw))
            for i in range(count)]


def test_card_from_run_and_eval_files(tmp_path, monkeypatch):
    run, ev, psm = _psm_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = _res("spd", 8, psm="psm")  # the label as infer.evaluate --spec got it: relative to where it ran
    res += _res("ar", 1, cycles=10, depth_ratio=1.0)
    res += _res("eagle3", 1, count=1, cycles=5, k=3, drafter_spec="/x/drafter")
    res += _res("spd", 8, count=1, cycles=10, psm="/elsewhere/psm")  # another PSM at the same n
    res += _res("spd", 8, count=1, cycles=10, psm="random")  # an untrained one
    res += _res("spd", 4, count=1, cycles=10, psm="psm")  # another n (not this PSM's plan)
    res += _res("ar", 1, count=1, cycles=10, tokens=99, seed=1, depth_ratio=1.0)  # ar of another setup
    _write_rows(ev, res)
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "n = 8" in text and "python -m train.main --config c.yaml\n```" in text and "EVAL" in text
    assert "--export" not in text  # exports trained nothing: not among the training commands
    assert "- data: sharegpt (chat template," in text  # all of it: no limit
    assert "response positions seen **3,000**" in text and "2.00 h of wall clock" in text and "1.0 MiB" in text
    assert "median 30.0 s per step" in text
    # from the TrainConfig: tau from the config, lr parsed, clip's default where the config has none
    assert "at tau = 2 " in text and "lr 0.0003," in text and "clip 1\n" in text and "None" not in text
    assert "| 3 | 3,000 | 0.500 | 3.75 |" in text  # the quick eval's S0 curve
    table = [x for x in text.splitlines() if x.startswith("| gsm8k") or x.startswith("| all")]
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 0.500 | 3.75 | 10.0 | 1.00x |" in table  # pooled 20/40 * 7.5
    assert "| gsm8k | ar | 1 | 0 | 2 | 20 | 1.000 | 1.00 | 10.0 | 1.00x |" in table  # seed 1's ar row left out
    assert len(table) == 4  # spd and ar, gsm8k and all: nothing of the other PSMs, n or eagle3
    assert "setup: model smollm2-135m-instruct, max_new_tokens 128, seed 0, backend cpu" in text
    assert "evaluation's cpu backend" in text and "sharing the host's cores" in text
    # an earlier step's export (train.main --export 2) gets that step's figures, not the run's later ones
    meta = json.loads((psm / "psm.json").read_text())
    meta["trained"].update(steps=2, positions=2000)
    (psm / "psm.json").write_text(json.dumps(meta))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "| 3 | 3,000 |" not in text and "KL 3.750" in text  # the mean of steps 1 and 2: 5.0 and 2.5
    assert "No quick eval during training up to step 2 (one every 250 steps" in text  # none up to step 2
    assert "| step | positions |" not in text
    assert "warm start" not in text
    # a run that started from another PSM (init_from) says so, with what that one saw
    (tmp_path / "n8").mkdir()
    (tmp_path / "n8" / "psm.json").write_text(json.dumps(dict(anchors=[0, 3, 10, 22, 29], plan=[3, 3, 4, 4, 4, 4, 4, 4],
                                                              trained=dict(positions=732018))))
    meta = json.loads((run / "run.json").read_text())
    meta["config"]["init_from"] = "n8"
    (run / "run.json").write_text(json.dumps(meta))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert ("- warm start: the weights of `n8`, a PSM for n = 8 (plan [3, 3, 4, 4, 4, 4, 4, 4], anchors "
            "[0, 3, 10, 22, 29]), trained on 732,018 response positions of its own; a new optimiser state (the "
            "positions and steps below are this run's only); 734,018 response positions in all") in text
    # what the export recorded at the run's start wins over what the directory holds now (a PSM trained
    # on in its place), and a chain of warm starts is summed
    meta = json.loads((psm / "psm.json").read_text())
    meta["trained"]["warm_start"] = warm_start_record(tmp_path / "n8")
    (psm / "psm.json").write_text(json.dumps(meta))
    (tmp_path / "n8" / "psm.json").write_text(json.dumps(dict(
        anchors=[0, 3, 10, 22, 29], plan=[3, 3, 4, 4, 4, 4, 4, 4],
        trained=dict(positions=900000, warm_start=dict(path="older", positions=100)))))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "trained on 732,018 response positions of its own;" in text and "900,000" not in text
    meta["trained"]["warm_start"] = warm_start_record(tmp_path / "n8")
    assert meta["trained"]["warm_start"]["warm_start"] == dict(path="older", positions=100)
    (psm / "psm.json").write_text(json.dumps(meta))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert ("trained on 900,000 response positions of its own after a warm start of its own (100 positions "
            "before it)") in text and "902,100 response positions in all" in text


def test_time_line_keeps_two_figures_of_a_sub_second_step():
    line = cards.time_line([dict(step=10, wall_s=100.0), dict(step=20, wall_s=101.38)], dict(steps=20))
    assert "median 0.14 s per step" in line


def test_card_without_rows_of_its_drafter(tmp_path, capsys):
    """No row of this PSM in --eval: the card says so instead of printing an empty table."""
    run, ev, psm = _psm_run(tmp_path)
    _write_rows(ev, _res("spd", 8, psm=str(tmp_path / "other")) + _res("ar", 1, cycles=10, depth_ratio=1.0))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "holds no `spd` row of this PSM at n = 8" in text and f"--spec {psm}" in text
    assert "| bench |" not in text and "| gsm8k |" not in text
    assert "holds no row of" in capsys.readouterr().err


def test_rows_of_an_older_drafter_at_the_same_path_are_not_this_ones(tmp_path, capsys):
    """Rows record their drafter's content (drafter_id): after another PSM is exported over the directory,
    the rows evaluated with the older one at that path are left out, those of this content counted (at
    any path: a copy is the same PSM). Rows from before ids were recorded count by their path only in an
    evaluation that records none, with a warning."""
    run, ev, psm = _psm_run(tmp_path)
    old = content_id(psm)
    (psm / "params" / "w").write_bytes(b"\1" * 2 ** 20)  # another PSM exported over it
    new = content_id(psm)
    assert new != old
    ar = _res("ar", 1, cycles=10, depth_ratio=1.0)
    _write_rows(ev, _res("spd", 8, psm=str(psm), cycles=10, drafter_id=old)  # the older PSM's: S0 7.5
                + _res("spd", 8, psm=str(psm), cycles=10)  # from before ids: older than the rows with one
                + _res("spd", 8, count=1, psm=str(psm), drafter_id=new)
                + [dict(r, prompt_index=1) for r in _res("spd", 8, count=1, psm="/copy/psm", drafter_id=new)] + ar)
    args = ["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]
    assert card.main(args) == 0
    text = (psm / "CARD.md").read_text()
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 0.500 | 3.75 |" in text and "7.50" not in text
    assert "record no drafter id" not in capsys.readouterr().err
    # the same PSM evaluated for the same prompts under another path too: each prompt counts once, this path's row
    _write_rows(ev, _res("spd", 8, psm=str(psm), cycles=10, drafter_id=new)
                + _res("spd", 8, psm="/copy/psm", cycles=5, drafter_id=new) + ar)
    assert card.main(args) == 0
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 1.000 | 7.50 |" in (psm / "CARD.md").read_text()
    # only the older PSM's rows: none of this one
    _write_rows(ev, _res("spd", 8, psm=str(psm), drafter_id=old) + _res("spd", 8, psm=str(psm)) + ar)
    assert card.main(args) == 0
    assert "holds no `spd` row of this PSM at n = 8" in (psm / "CARD.md").read_text()
    # an evaluation from before ids: its rows count by path, with a warning
    _write_rows(ev, _res("spd", 8, psm=str(psm), cycles=10) + ar)
    assert card.main(args) == 0
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 1.000 | 7.50 |" in (psm / "CARD.md").read_text()
    assert "record no drafter id (made before ids were recorded)" in capsys.readouterr().err


@pytest.mark.parametrize("with_ids", [False, True])
def test_card_refuses_rows_of_two_setups(tmp_path, capsys, with_ids):
    """Rows of this drafter under two setups (here two lengths) are refused, whether they are taken by the
    content they record (drafter_id; the same prompts under both setups) or, from before ids, by path."""
    run, ev, psm = _psm_run(tmp_path)
    ids = dict(drafter_id=content_id(psm)) if with_ids else {}
    _write_rows(ev, _res("spd", 8, psm=str(psm), **ids) + _res("spd", 8, psm=str(psm), max_new_tokens=64, **ids))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "rows of 2 setups" in err and "max_new_tokens 64" in err
    assert not (psm / "CARD.md").exists()


def test_hand_written_sections_survive_and_evaluation_alone_is_rewritten(tmp_path):
    """A rebuilt card keeps the sections it does not write (e.g. "## Status and limits"); without --run (a
    drafter whose run directory is gone) only the Evaluation section is rewritten."""
    run, ev, psm = _psm_run(tmp_path)
    _write_rows(ev, _res("spd", 8, psm=str(psm)) + _res("ar", 1, cycles=10, depth_ratio=1.0))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL1"]) == 0
    notes = "## Status and limits\n\n- written by hand\n"
    (psm / "CARD.md").write_text((psm / "CARD.md").read_text() + "\n" + notes)
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL2"]) == 0
    text = (psm / "CARD.md").read_text()
    assert text.count(notes) == 1 and "EVAL2" in text and "EVAL1" not in text
    training = text[:text.index("## Evaluation")]
    _write_rows(ev, _res("spd", 8, psm=str(psm), cycles=40) + _res("ar", 1, cycles=10, depth_ratio=1.0))
    assert card.main(["--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL3"]) == 0
    text = (psm / "CARD.md").read_text()
    assert text.startswith(training) and text.count(notes) == 1 and text.index("## Evaluation") < text.index(notes)
    assert "EVAL3" in text and "EVAL2" not in text and "| gsm8k | spd | 8 | 0 | 2 | 20 | 0.250 | 1.88 |" in text
    assert card.main(["--eval", str(ev), "--psm", str(tmp_path / "nothing")]) == 2  # no card to update


def test_lineage_plots_s0_across_the_psms_a_directory_held(tmp_path, capsys):
    """Each PSM's greedy pooled S0 joins its directory's lineage.json by its chain's positions; the card
    shows the points of its evaluation's setup from the second on, and a broken file is refused untouched."""
    run, ev, psm = _psm_run(tmp_path)
    args = ["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]
    _write_rows(ev, _res("spd", 8, psm=str(psm)) + _res("ar", 1, cycles=10, depth_ratio=1.0))
    assert card.main(args) == 0
    points = json.loads((psm / lineage.LINEAGE).read_text())
    assert [(p["positions"], p["S0"], p["run"]) for p in points] == [(3000, 3.75, "c.yaml, 3 steps")]
    assert "### S0 against training positions" not in (psm / "CARD.md").read_text()  # one point: no plot
    # trained on from that PSM (its record in psm.json), exported over it, evaluated: a second point
    meta = json.loads((psm / "psm.json").read_text())
    meta["trained"].update(steps=2, positions=2000, warm_start=dict(path=str(psm), positions=3000))
    (psm / "psm.json").write_text(json.dumps(meta))
    _write_rows(ev, _res("spd", 8, psm=str(psm), cycles=10) + _res("ar", 1, cycles=10, depth_ratio=1.0))
    for _ in range(2):  # evaluated again: the same point, not a third
        assert card.main(args) == 0
    points = json.loads((psm / lineage.LINEAGE).read_text())
    assert [(p["positions"], p["S0"]) for p in points] == [(3000, 3.75), (5000, 7.5)]
    assert [p["warm_started"] for p in points] == [False, True] and len(lineage.lineage_chains(points)) == 1
    # a later PSM trained from scratch starts a chain of its own: no line joins it to the earlier ones
    assert [len(c) for c in lineage.lineage_chains(points + [dict(points[0], positions=9000)])] == [2, 1]
    assert [len(c) for c in lineage.lineage_chains([{k: v for k, v in points[1].items() if k != "warm_started"}]
                                                * 2)] == [2]  # points from before the key: one chain
    text = (psm / "CARD.md").read_text()
    assert "| 3,000 | c.yaml, 3 steps | 0.500 | 3.75 |\n| 5,000 | c.yaml, 2 steps | 1.000 | 7.50 |" in text
    assert "![S0 against training positions](lineage.png)" in text and (psm / "lineage.png").stat().st_size > 0
    # only T = 0 rows make a point; another setup's point is kept but not drawn beside these
    _write_rows(ev, _res("spd", 8, psm=str(psm), temperature=1.0) + _res("ar", 1, depth_ratio=1.0, temperature=1.0))
    assert card.main(args) == 0 and len(json.loads((psm / lineage.LINEAGE).read_text())) == 2
    _write_rows(ev, _res("spd", 8, psm=str(psm), max_new_tokens=64) + _res("ar", 1, depth_ratio=1.0, max_new_tokens=64))
    assert card.main(["--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    assert len(json.loads((psm / lineage.LINEAGE).read_text())) == 3
    assert "### S0 against training positions" not in (psm / "CARD.md").read_text()
    (psm / lineage.LINEAGE).write_text("[{")
    assert card.main(args) == 2 and "lineage.json is not valid JSON" in capsys.readouterr().err
    assert (psm / lineage.LINEAGE).read_text() == "[{"


def test_data_line_names_a_limited_corpus_and_self_distilled_replies():
    config = card.run_config(dict(config=dict(sources=["sharegpt", "gsm8k"], limit=400, responses="target")))
    line = cards.data_line(config)
    assert line.startswith("- data: the first user turns of sharegpt, gsm8k (the first 400 conversations of each) "
                           "answered by the target itself")


def test_merge_card_edge_cases():
    # no Evaluation section yet: it goes after Training, before the hand-written one
    old = "# T\n\nintro\n\n## Training\n\nx\n\n## Status\n\nhand\n"
    assert cards.merge_card(old, "## Evaluation\n\nNEW", True) == (
        "# T\n\nintro\n\n## Training\n\nx\n\n## Evaluation\n\nNEW\n\n## Status\n\nhand\n")
    # two Evaluation sections: one replaced, the other dropped; a "## " line inside a fence is no header
    old = ("# T\n\n## Training\n\nx\n\n## Evaluation\n\nA\n\n## Evaluation\n\nB\n\n"
           "## Status\n\n```\n## not a header\n```\n")
    merged = cards.merge_card(old, "## Evaluation\n\nNEW\n", True)
    assert merged == "# T\n\n## Training\n\nx\n\n## Evaluation\n\nNEW\n\n## Status\n\n```\n## not a header\n```\n"
    full = cards.merge_card(old, "# T\n\n## Training\n\ny\n\n## Evaluation\n\nNEW\n", False)
    assert full == "# T\n\n## Training\n\ny\n\n## Evaluation\n\nNEW\n\n## Status\n\n```\n## not a header\n```\n"


@pytest.mark.parametrize("label", ["random", "given", None])
def test_untrained_or_unnamed_drafters_are_not_this_one(tmp_path, label):
    assert not label_is_dir(label, tmp_path)
    assert label_is_dir(str(tmp_path / "a" / ".."), tmp_path)


def test_eagle3_card(tmp_path):
    """An exported EAGLE-3 drafter (eagle3.json) gets its own card: tokens per round, its eval rows."""
    run, ev, d = tmp_path / "run", tmp_path / "eval", tmp_path / "drafter"
    for x in (run, ev, d / "params"):
        x.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(dict(
        identity=dict(model="/x/smollm2-135m-instruct", method="eagle3"),
        commands=["python -m train.main --config e.yaml"],
        config=dict(sources=["sharegpt"], max_len=512, lr=1e-4, warmup=100, batch_size=8, clip=1.0, ttt_steps=3))))
    rows = [dict(step=s, positions=1000 * s, loss=5.0 / s, agreement=0.1 * s) for s in range(1, 4)]
    rows[-1] |= dict(tokens_per_round=1.8, eval_k=3)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained = dict(steps=3, positions=3000, wall_s=3600, backend="cpu", mesh="1x1", ttt_steps=3)
    (d / "eagle3.json").write_text(json.dumps(dict(kind="eagle3", layers=[2, 15, 27], draft_vocab=0, trained=trained,
                                                   target=["llama", 576, 30, 49152, 9, 3])))
    (d / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    gpu = dict(depth_ratio=1.0, backend="gpu")
    res = _res("eagle3", 1, tokens=10, cycles=5, k=3, drafter=str(d), drafter_spec=str(d), **gpu)
    res += _res("ar", 1, tokens=10, cycles=10, **gpu)
    res += _res("spd", 8, count=1, cycles=10, psm="/x/psm", **gpu)
    res += _res("eagle3", 1, count=1, cycles=5, k=3, drafter_spec="random", **gpu)  # the untrained drafter
    res += _res("eagle3", 1, count=1, cycles=5, k=3, drafter_spec="/x/other", **gpu)  # another drafter
    _write_rows(ev, res)
    (ev / "commands.txt").write_text("python -m infer.evaluate --methods ar,eagle3 --k 3\n")  # infer.evaluate's
    assert card.main(["--run", str(run), "--eval", str(ev), "--drafter", str(d)]) == 0
    text = (d / "CARD.md").read_text()
    assert "```\npython -m infer.evaluate --methods ar,eagle3 --k 3\n```" in text
    assert text.startswith("# EAGLE-3-style drafter for smollm2-135m-instruct") and "[2, 15, 27]" in text
    assert "at tau = 1 over 3 unrolled draft steps" in text and "| 3 | 3,000 | 3 | 1.800 |" in text
    # method_label as in infer.evaluate's tables; the untrained and the other drafter's rows left out
    assert "| gsm8k | eagle3 k=3 | 0 | 2 | 20 | 2.000 | 10.0 | 1.00x |" in text and "| spd" not in text
    assert "untrained" not in text and "| all | eagle3 k=3 | 0 | 2 | 20 | 2.000 |" in text
    assert "evaluation's gpu backend (one device per run)" in text


def test_ppsd_card(tmp_path):
    """An exported PPSD head (ppsd.json) gets its own card: its exit and plan, the quick eval's S0, only its own
    ppsd rows at its n, a warm start from another head named as one, and its S0 in the directory's lineage."""
    run, ev, d = tmp_path / "run", tmp_path / "eval", tmp_path / "ppsd"
    for x in (run, ev, d / "params"):
        x.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(dict(
        identity=dict(model="/x/smollm2-135m-instruct", method="ppsd"),
        commands=["python -m train.main --config configs/train/smollm2-ppsd-n8.yaml"],
        config=dict(sources=["sharegpt"], max_len=512, lr=3e-4, warmup=100, batch_size=8, method="ppsd",
                    init_from="runs/p/ppsd"))))
    rows = [dict(step=s, positions=1000 * s, loss=5.0 / s, agreement=0.1 * s) for s in range(1, 4)]
    rows[-1] |= dict(alpha=0.2, S0=1.5)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    was = dict(path="runs/p/ppsd", method="ppsd", steps=9, positions=900, plan=[7, 7, 8, 8])
    trained = dict(steps=3, positions=3000, wall_s=3600, backend="cpu", mesh="1x1", method="ppsd", warm_start=was)
    (d / "ppsd.json").write_text(json.dumps(dict(kind="ppsd", format=1, num_layers=1, plan=[3, 3, 4, 4, 4, 4, 4, 4],
                                                 target=["llama", 576, 30, 49152, 9, 3], draft_vocab=0,
                                                 trained=trained)))
    (d / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    res = _res("ppsd", 8, ppsd=str(d), drafter_id=content_id(d)) + _res("ar", 1, tokens=10, cycles=10)
    res += _res("ppsd", 8, count=1, ppsd="random", drafter_id="random")  # the untrained head
    res += _res("spd", 8, count=1, psm="/x/psm")  # another method's rows
    _write_rows(ev, res)
    assert card.main(["--run", str(run), "--eval", str(ev), "--drafter", str(d)]) == 0
    text = (d / "CARD.md").read_text()
    assert text.startswith("# PPSD early-exit head for smollm2-135m-instruct, n = 8")
    assert "1 decoder layer(s) of the target's kind reading the state after stage 0 of the stage plan" in text
    assert "(the exit after layer 3)" in text and "--mode ppsd --n 8 --drafter DIR" in text
    assert "a PPSD head for n = 4 (plan [7, 7, 8, 8]), trained on 900 response positions" in text
    assert "| 3 | 3,000 | 0.200 | 1.50 |" in text and "| gsm8k | ppsd | 8 | 0 | 2 | 20 | 0.500 | 3.75 |" in text
    assert "| spd" not in text and "untrained" not in text
    assert json.loads((d / "lineage.json").read_text())[0]["S0"] == 3.75


@pytest.mark.parametrize("modules, apart", [
    ("spd_jax.reports.cards spd_jax.reports.tables spd_jax.reports.replay spd_jax.datasets", ("infer", "train", "bench")),
    ("infer.evaluate infer.replay", ("train",)),
    ("train.card", ("infer",)),
])
def test_reports_infer_and_train_import_apart(modules, apart):
    """The reports and the data lookups are the library's: they import neither infer nor train, and infer
    and train reach each other's figures only through them."""
    root = Path(__file__).resolve().parents[1]
    code = (f"import importlib, sys\nfor m in {modules.split()!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {apart!r}))")
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"
