"""The notebooks run top to bottom on the CPU with their small settings (SPD_JAX_NOTEBOOK_SMALL=1, a tiny
random model): no cell raises, and the lines they print for checking say what they must (the methods'
tokens agree; the training loss is finite and falls; the checkpoint restores exactly). They are committed
with their outputs cleared, so they carry no hidden state."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import pytest

# CI runs these in their own step after the README's test command (`.ci/run`); `-m notebook` selects them
pytestmark = pytest.mark.notebook

nbformat = pytest.importorskip("nbformat", reason="the `test` extra is not installed")
nbclient = pytest.importorskip("nbclient", reason="the `test` extra is not installed")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _execute(name: str, tmp_path: Path, monkeypatch) -> str:
    """Run notebooks/<name> in a fresh kernel whose working directory is tmp_path -> its text output."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{name}: commit the notebook with outputs cleared"
    monkeypatch.setenv("SPD_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as on Colab
    monkeypatch.setenv("SPD_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    print(f"{name}: executed in {time.perf_counter() - t0:.1f} s")
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            assert o.output_type != "error", f"{name}: {o.ename}: {o.evalue}"
            if o.output_type == "stream":
                out.append(o.text)
            elif "text/plain" in o.get("data", {}):
                out.append(o.data["text/plain"] + "\n")
    return "".join(out)


def _value(text: str, key: str) -> str:
    m = re.search(rf"^{key} (\S+)", text, re.M)
    assert m, f"no line {key!r} in the notebook's output:\n{text[-3000:]}"
    return m.group(1)


def test_quickstart(tmp_path, monkeypatch):
    text = _execute("quickstart.ipynb", tmp_path, monkeypatch)
    assert _value(text, "TOKENS_AGREE") == "True"  # ar, tp, pipeline and spd commit the same tokens
    assert _value(text, "SWEEP_AGREE") == "True"  # and spd at every n of the sweep
    for method in ("ar", "tp", "pipeline", "spd"):
        assert re.search(rf"^{method}\s+24 tokens", text, re.M), method
    assert re.search(r"^n=2: .* S0 [\d.]+$", text, re.M) and re.search(r"^n=4: .* S0 [\d.]+$", text, re.M)
    assert "slowest stage" in text and "collectives" in text  # the cycle breakdown
    assert not list(Path(NOTEBOOKS).glob("spd_jax_notebook*"))  # written under the working directory only


def test_train_psm(tmp_path, monkeypatch):
    text = _execute("train_psm.ipynb", tmp_path, monkeypatch)
    assert math.isfinite(float(_value(text, "FINAL_LOSS")))
    assert _value(text, "LOSS_DECREASED") == "True"
    assert _value(text, "RESTORE_EXACT") == "True"
    assert _value(text, "SPD_OUTPUT_SAME") == "True"  # a PSM only drafts: SPD's output is the target's
    alpha = float(_value(text, "ALPHA"))
    assert 0 < alpha <= 1
    assert (tmp_path / "spd_jax_notebook" / "run" / "psm" / "psm.json").is_file()
