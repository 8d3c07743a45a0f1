"""Run a sweep's arms one after another, each trained (`train.main`) and then scored on the fixed held-out set
(`train.heldout`), its report kept: a sweep longer than a session, resumed by the next one.

    python -m train.sweep configs/sweeps/smollm2-n8-replies.yaml [--until HH:MM] [--dry-run] [--only NAME ...]

A sweep file names the training recipe, the arms (name: overrides), the seeds, how arms are scored, and where
their reports go. An arm at a seed is a run `runs/<prefix>-<arm>-s<seed>`; it is done when
`<reports>/<run>.json` exists, so a session starts where the last one stopped. Arms run seed by seed, in the
file's order (every arm at the first seed, then at the next). After each arm the table is rebuilt from every
report (`train.heldout --merge`). A run directory left by an interrupted command of this session is resumed.

--until: the wall-clock time (its next occurrence on this machine's clock, so 01:30 at 23:00 is tomorrow's) by
which the sweep must have stopped: an arm starts only if its estimate ends before it. The estimates are the sweep file's `minutes` (required; measured on the
machine it names): `first`, for the first arm this command runs (it fills the teacher cache and generates the held-out
set, both lost with the machine), then `arm`, raised to the longest arm this command has run. A report is
never written for a run that did not finish: a stopped one is not a row of the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from train.config import load
from train.data import write_atomic

KEYS = {"recipe", "mesh", "prefix", "runs", "reports", "table", "seeds", "arms", "score", "minutes"}
REQUIRED = ("recipe", "arms", "seeds", "reports", "minutes")
SCORE_KEYS = ("offset", "count", "turns", "steps")
NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # an arm's or prefix's name becomes part of a directory's


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm at one seed: a training run."""
    name: str  # the run's name: <prefix>-<arm>-s<seed>
    arm: str
    seed: int
    overrides: tuple[str, ...]  # the arm's, then seed=<seed>


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep file, read (`load_sweep`): its arms at every seed, in the order they run."""
    recipe: str
    mesh: str
    runs: Path
    reports: Path
    table: Path
    score: dict
    minutes: dict  # {"first": estimate of the first arm a command runs, "arm": of the others}
    arms: tuple[Arm, ...]

    def train_cmd(self, arm: Arm) -> list[str]:
        """train.main for the arm; --resume when its run directory holds a checkpoint (a command of this session
        stopped after saving one; `ckpt/` alone is made before the first step, so it does not count)."""
        ckpt = self.runs / arm.name / "ckpt"
        saved = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())  # orbax's step directories
        return [sys.executable, "-m", "train.main", "--config", self.recipe, "--mesh", self.mesh,
                "--out", str(self.runs / arm.name), *(["--resume"] if saved else []), *arm.overrides]

    def score_cmd(self, arm: Arm) -> list[str]:
        opts = [x for k in SCORE_KEYS if k in self.score for x in (f"--{k}", str(self.score[k]))]
        return [sys.executable, "-m", "train.heldout", str(self.runs / arm.name), *opts,
                "--out", str(self.runs / f"score-{arm.name}")]

    def merge_cmd(self) -> list[str]:
        return [sys.executable, "-m", "train.heldout", "--merge", *map(str, sorted(self.reports.glob("*.json"))),
                "--out", str(self.table)]


def _check_arms(path: Path, d: dict) -> None:
    """The arms' names and overrides, and that every arm's config loads (a misspelt key fails now, not
    sessions later)."""
    arms = d["arms"]
    if not isinstance(arms, dict) or not arms or not all(
            isinstance(v, list) and all(isinstance(o, str) and "=" in o for o in v) for v in arms.values()):
        raise ValueError(f"{path}: arms map each arm's name to its list of key=value overrides (e.g. lr3e-4: "
                         "[lr=3e-4]; the recipe's own arm: [])")
    bad = [str(a) for a in arms if not NAME.fullmatch(str(a))]
    if bad:
        raise ValueError(f"{path}: arm names {bad} must be letters, digits, '.', '_' or '-' (they name directories)")
    for name, o in arms.items():
        if any(x.split("=", 1)[0] in ("seed", "steps") for x in o):
            raise ValueError(f"{path}: arm {name} sets seed or steps: the sweep's seeds set seed, and every arm "
                             "keeps the recipe's steps (score.steps scores its last checkpoint)")
        try:
            load(d["recipe"], [*o, "seed=0"])
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{path}: arm {name}: {e}") from None


def _check_rest(path: Path, d: dict) -> None:
    """Seeds, scoring, estimates and places."""
    seeds = d["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(type(x) is int and x >= 0 for x in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ValueError(f"{path}: seeds must be a list of distinct integers >= 0, got {seeds!r}")
    score = d.get("score") or {}
    if not isinstance(score, dict) or set(score) - set(SCORE_KEYS):
        raise ValueError(f"{path}: score takes {', '.join(SCORE_KEYS)} (train.heldout's options), got {score!r}")
    m = d["minutes"]
    if not isinstance(m, dict) or set(m) != {"first", "arm"} or not all(
            isinstance(v, (int, float)) and v > 0 for v in m.values()) or m["first"] < m["arm"]:
        raise ValueError(f"{path}: minutes takes first and arm, each arm's estimate in minutes above 0 (first, "
                         f"which pays the session's one-off work, at least arm's); got {m!r}")
    if not NAME.fullmatch(str(d.get("prefix", "x"))):
        raise ValueError(f"{path}: prefix {d.get('prefix')!r} must be letters, digits, '.', '_' or '-'")
    if Path(d.get("table", Path(d["reports"]).parent)).resolve() == Path(d["reports"]).resolve():
        raise ValueError(f"{path}: table and reports must differ (the table's own heldout.json would join the next "
                         "merge as a report)")


def load_sweep(path: Path) -> Sweep:
    """A sweep file -> Sweep (paths relative to the working directory, as the recipe's); ValueError naming
    what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sweep file {path} not found (see configs/sweeps/)")
    d = yaml.safe_load(path.read_text()) or {}
    if not isinstance(d, dict) or set(d) - KEYS or not set(REQUIRED) <= set(d):
        raise ValueError(f"{path}: a sweep file has the keys {sorted(KEYS)}, of which {', '.join(REQUIRED)} are "
                         f"required; got {sorted(d) if isinstance(d, dict) else type(d).__name__}")
    _check_arms(path, d)
    _check_rest(path, d)
    prefix = d.get("prefix", Path(d["recipe"]).stem)
    arms = [Arm(f"{prefix}-{a}-s{s}", a, s, (*o, f"seed={s}")) for s in d["seeds"] for a, o in d["arms"].items()]
    return Sweep(recipe=d["recipe"], mesh=str(d.get("mesh", "1x1")), runs=Path(d.get("runs", "runs")),
                 reports=Path(d["reports"]), table=Path(d.get("table", Path(d["reports"]).parent)),
                 score=dict(d.get("score") or {}), minutes=dict(d["minutes"]), arms=tuple(arms))


def todo(sweep: Sweep, only: list[str] | None = None) -> list[Arm]:
    """The arms without a report (of `only`, run names or arm names, when given), in the sweep's order; a
    name in `only` that is neither is refused (ValueError)."""
    unknown = sorted(set(only or ()) - {a.name for a in sweep.arms} - {a.arm for a in sweep.arms})
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: no such arm or run; the arms: {', '.join(dict.fromkeys(a.arm for a in sweep.arms))}")
    left = [a for a in sweep.arms if not (sweep.reports / f"{a.name}.json").is_file()]
    return [a for a in left if not only or a.name in only or a.arm in only]


def run_sweep(sweep: Sweep, arms: list[Arm], until: dt.datetime | None, run: Callable[[list[str]], None],
              now: Callable[[], dt.datetime] = dt.datetime.now) -> list[str]:
    """Train, score and report each arm while its estimate ends before `until` -> the names done. run(cmd)
    runs a command to its end (raising on failure)."""
    done, longest = [], 0.0
    for i, arm in enumerate(arms):
        estimate = sweep.minutes["first"] if i == 0 else max(sweep.minutes["arm"], longest)
        if until is not None and now() + dt.timedelta(minutes=estimate) > until:
            print(f"sweep: stopping before {arm.name}: its estimate ({estimate:.0f} min) ends after "
                  f"{until:%H:%M}; {len(arms) - i} arm(s) left", flush=True)
            break
        t0 = now()
        print(f"sweep: {arm.name} ({i + 1}/{len(arms)}), about {estimate:.0f} min", flush=True)
        run(sweep.train_cmd(arm))
        run(sweep.score_cmd(arm))
        sweep.reports.mkdir(parents=True, exist_ok=True)
        report = (sweep.runs / f"score-{arm.name}" / "heldout.json").read_bytes()
        write_atomic(sweep.reports / f"{arm.name}.json", lambda f: f.write(report))  # whole or absent: it marks the arm done
        run(sweep.merge_cmd())
        done.append(arm.name)
        if i > 0:  # the first arm's time holds the session's one-off work
            longest = max(longest, (now() - t0).total_seconds() / 60)
    return done


def deadline(text: str | None, now: dt.datetime) -> dt.datetime | None:
    """--until HH:MM -> the next datetime at that time of day after `now` (a session may cross midnight)."""
    if text is None:
        return None
    try:
        at = dt.datetime.combine(now.date(), dt.time.fromisoformat(text))
    except ValueError:
        raise ValueError(f"--until takes a time of day as HH:MM, got {text!r}") from None
    return at if at > now else at + dt.timedelta(days=1)


def _run(cmd: list[str]) -> None:
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    what = cmd[cmd.index("--out") + 1] if "--out" in cmd else cmd[2]
    print(f"sweep: {cmd[2]} for {what} took {(time.perf_counter() - t) / 60:.1f} min", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("sweep", help="a sweep file (configs/sweeps/)")
    ap.add_argument("--until", help="stop before an arm whose estimate ends after this time of day (HH:MM)")
    ap.add_argument("--only", nargs="+", help="only these arms (arm names, or run names <prefix>-<arm>-s<seed>)")
    ap.add_argument("--dry-run", action="store_true", help="print the arms left and their commands, run nothing")
    args = ap.parse_args(argv)
    try:
        sweep = load_sweep(Path(args.sweep))
        until = deadline(args.until, dt.datetime.now())
        left = todo(sweep, args.only)
    except (ValueError, FileNotFoundError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unreported = todo(sweep)
    reported = [a.name for a in sweep.arms if a not in unreported]
    print(f"sweep: {len(reported)} of {len(sweep.arms)} arms reported; {len(left)} to run", flush=True)
    if until is not None:
        print(f"sweep: stopping before {until:%Y-%m-%d %H:%M}", flush=True)
    skipped = [a.name for a in sweep.arms if a.name in reported and args.only and {a.name, a.arm} & set(args.only)]
    if skipped:
        print(f"sweep: already reported (delete a report to run its arm again): {', '.join(skipped)}", flush=True)
    if args.dry_run:
        for arm in left:
            print(json.dumps(dict(run=arm.name, train=sweep.train_cmd(arm)[1:], score=sweep.score_cmd(arm)[1:])))
        return 0
    try:
        run_sweep(sweep, left, until, _run)
    except subprocess.CalledProcessError as e:
        print(f"error: {' '.join(e.cmd[1:])} failed with status {e.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
