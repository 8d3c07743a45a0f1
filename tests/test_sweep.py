"""train.sweep: the arms' order and names, which are done, the deadline, and a report only for a scored run."""

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from train import sweep as train_sweep

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs/sweeps/smollm2-n8-replies.yaml"


def _sweep_file(tmp_path, **over) -> Path:
    d = dict(recipe=str(ROOT / "configs/train/smollm2-n8-replies.yaml"), prefix="r1m", runs=str(tmp_path / "runs"),
             reports=str(tmp_path / "reports"), seeds=[0, 1], arms={"lr1e-3": [], "lr3e-4": ["lr=3e-4"]},
             score=dict(offset=400, count=100, turns="every", steps=1104), minutes=dict(first=100, arm=40))
    d.update(over)
    p = tmp_path / "sweep.yaml"
    p.write_text(json.dumps(d))  # JSON is YAML
    return p


def test_the_shipped_sweep_runs_every_arm_at_each_seed_in_order():
    sweep = train_sweep.load_sweep(SHIPPED)  # every arm's overrides load as a config
    # (whether this checkout's runs/ holds a checkpoint of it decides --resume: left out here)
    names = [a.name for a in sweep.arms]
    assert len(names) == len(set(names)) == 24
    assert names[:3] == ["r1m-lr1e-3-s0", "r1m-lr3e-4-s0", "r1m-lr2e-3-s0"] and names[8] == "r1m-lr1e-3-s1"
    assert [x for x in sweep.train_cmd(sweep.arms[1])[2:] if x != "--resume"] == [
        "train.main", "--config", "configs/train/smollm2-n8-replies.yaml", "--mesh", "1x1", "--out",
        "runs/r1m-lr3e-4-s0", "lr=3e-4", "seed=0"]
    assert sweep.score_cmd(sweep.arms[1])[2:] == [
        "train.heldout", "runs/r1m-lr3e-4-s0", "--offset", "400", "--count", "100", "--turns", "every",
        "--steps", "1104", "--out", "runs/score-r1m-lr3e-4-s0"]


def test_arms_run_until_the_deadline_and_a_report_marks_each_done(tmp_path):
    sweep = train_sweep.load_sweep(_sweep_file(tmp_path))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "r1m-lr1e-3-s0.json").write_text("{}")  # reported in an earlier session
    left = train_sweep.todo(sweep)
    assert [a.name for a in left] == ["r1m-lr3e-4-s0", "r1m-lr1e-3-s1", "r1m-lr3e-4-s1"]
    assert [a.name for a in train_sweep.todo(sweep, ["lr3e-4"])] == ["r1m-lr3e-4-s0", "r1m-lr3e-4-s1"]

    clock = [dt.datetime(2026, 12, 7, 20, 0)]
    ran = []

    def run(cmd):
        ran.append(cmd[2])
        if cmd[2] == "train.main":
            (Path(cmd[cmd.index("--out") + 1]) / "ckpt").mkdir(parents=True)
            clock[0] += dt.timedelta(minutes=50)  # longer than the file's estimate of 40
        elif "--merge" not in cmd:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "heldout.json").write_text(json.dumps(dict(run=cmd[3])))
            clock[0] += dt.timedelta(minutes=10)

    # the first arm takes first's 100 min, the second (est. 40) fits by 22:00, the third must fit 60 (measured)
    done = train_sweep.run_sweep(sweep, left, dt.datetime(2026, 12, 7, 22, 50), run, lambda: clock[0])
    assert done == ["r1m-lr3e-4-s0", "r1m-lr1e-3-s1"]
    assert ran == ["train.main", "train.heldout", "train.heldout"] * 2  # train, score, merge
    assert json.loads((tmp_path / "reports" / "r1m-lr1e-3-s1.json").read_text()) == {"run": str(tmp_path / "runs" / "r1m-lr1e-3-s1")}
    assert not (tmp_path / "reports" / "r1m-lr3e-4-s1.json").exists()
    # a run directory holding a checkpoint is resumed; one whose command stopped before its first save (orbax
    # makes ckpt/ at once) starts again, or train.main would refuse --resume without a checkpoint
    (tmp_path / "runs" / "r1m-lr1e-3-s0" / "ckpt" / "138").mkdir(parents=True)
    (tmp_path / "runs" / "r1m-lr3e-4-s1" / "ckpt").mkdir(parents=True)
    assert "--resume" in sweep.train_cmd(sweep.arms[0]) and "--resume" not in sweep.train_cmd(left[2])


def test_an_arm_whose_scoring_fails_gets_no_report(tmp_path):
    sweep = train_sweep.load_sweep(_sweep_file(tmp_path, seeds=[0]))

    def run(cmd):
        if cmd[2] == "train.heldout":
            raise subprocess.CalledProcessError(1, cmd)

    with pytest.raises(subprocess.CalledProcessError):
        train_sweep.run_sweep(sweep, train_sweep.todo(sweep), None, run)
    assert not (tmp_path / "reports").exists() or not list((tmp_path / "reports").iterdir())


@pytest.mark.parametrize("over, message", [
    (dict(arms={"x": ["lr"]}), "arms map each arm's name to its list of key=value overrides"),
    (dict(arms={"x": ["seed=3"]}), "arm x sets seed or steps"),
    (dict(arms={"x": ["lrr=3e-4"]}), "arm x: unknown"),
    (dict(score=dict(offset=1, turn="every")), "score takes offset, count, turns, steps"),
    (dict(arms={"x": ["steps=10"]}), "arm x sets seed or steps"),
    (dict(arms={"a/b": []}), "must be letters, digits"),
    (dict(arms=["lr=3e-4"]), "arms map each arm's name"),
    (dict(seeds=[0, 0]), "seeds must be a list of distinct integers"),
    (dict(seeds=3), "seeds must be a list"),
    (dict(score=dict(offset=1, turn="every")), "score takes offset, count, turns, steps"),
    (dict(score="every"), "score takes"),
    (dict(minutes=dict(first=-1, arm=1)), "minutes takes first and arm"),
    (dict(minutes=dict(first=10, arm=20)), "first, which pays the session's one-off work, at least arm's"),
    (dict(minutes=None), "minutes takes first and arm"),
    (dict(table="REPORTS"), "table and reports must differ"),
    (dict(colour="blue"), "a sweep file has the keys"),
])
def test_a_bad_sweep_file_is_refused_naming_the_problem(tmp_path, over, message):
    if over.get("table") == "REPORTS":
        over = dict(table=str(tmp_path / "reports"))
    with pytest.raises(ValueError, match=message):
        train_sweep.load_sweep(_sweep_file(tmp_path, **over))


def test_the_cli_lists_the_arms_left_and_refuses_a_malformed_deadline(tmp_path):
    path = _sweep_file(tmp_path)
    r = subprocess.run([sys.executable, "-m", "train.sweep", str(path), "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("sweep: 0 of 4 arms reported; 4 to run"), r.stderr
    assert [json.loads(x)["run"] for x in r.stdout.splitlines()[1:]] == [
        "r1m-lr1e-3-s0", "r1m-lr3e-4-s0", "r1m-lr1e-3-s1", "r1m-lr3e-4-s1"]
    r = subprocess.run([sys.executable, "-m", "train.sweep", str(path), "--only", "lr3e-5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--only lr3e-5: no such arm or run; the arms: lr1e-3, lr3e-4" in r.stderr
    r = subprocess.run([sys.executable, "-m", "train.sweep", str(path), "--until", "8pm"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--until takes a time of day as HH:MM, got '8pm'" in r.stderr


def test_a_deadline_is_the_next_time_of_day_so_a_session_may_cross_midnight():
    at_2300 = dt.datetime(2026, 12, 7, 23, 0)
    assert train_sweep.deadline("23:30", at_2300) == dt.datetime(2026, 12, 7, 23, 30)
    assert train_sweep.deadline("01:45", at_2300) == dt.datetime(2026, 12, 8, 1, 45)
    assert train_sweep.deadline("23:00", at_2300) == dt.datetime(2026, 12, 8, 23, 0)
    assert train_sweep.deadline(None, at_2300) is None
    with pytest.raises(ValueError, match="as HH:MM"):
        train_sweep.deadline("8pm", dt.datetime(2026, 12, 7, 20, 0))
