"""The README's set-up commands stay true: CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_cmd = [l for l in (ROOT / ".ci/run").read_text().splitlines() if l.startswith("python3 -m pip")]
    assert len(ci_cmd) == 1 and ci_cmd[0] in readme
    assert "python3 -m infer.generate" in readme
