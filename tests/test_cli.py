"""python -m infer.generate end to end (subprocess, as a user runs it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import spd_jax
from spd_jax.drafters.eagle3 import shipped_eagle3
from spd_jax.drafters.psm import shipped_psm

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "infer.generate", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_json_output_with_prompt_ids(tiny_ckpt):
    path, _ = tiny_ckpt("qwen2", True)
    p = run_cli("--model", str(path), "--mode", "ar", "--prompt-ids", "1,5,9", "--max-new-tokens", "12", "--no-eos",
                "--json")
    obj = json.loads(p.stdout.strip().splitlines()[-1])
    assert obj["prompt_ids"] == [1, 5, 9] and len(obj["token_ids"]) == 12
    model = spd_jax.load_model(path)
    assert obj["token_ids"] == spd_jax.generate(model, [1, 5, 9], 12, stop_at_eos=False).token_ids
    s = obj["stats"]
    assert s["tokens"] == 12 and s["tokens_per_s"] > 0 and "excludes compilation" in s["timing_includes"]
    # spd through the CLI with --random-psm: tests/test_compile_cache.py


def test_eagle3_mode_equals_ar(tiny_ckpt, tmp_path):
    """python -m infer.generate --mode eagle3 --k 3 --drafter PATH --json: a saved drafter loads and the
    chain commits `ar`'s greedy tokens."""
    from spd_jax.drafters import eagle3

    path, _ = tiny_ckpt("qwen2", True)
    model = spd_jax.load_model(path)
    spec = eagle3.Eagle3Config.for_target(model.config)
    eagle3.save_eagle3(tmp_path / "drafter", eagle3.init_eagle3(model.config, spec, model.params, seed=3), spec)
    p = run_cli("--model", str(path), "--mode", "eagle3", "--k", "3", "--drafter", str(tmp_path / "drafter"),
                "--prompt-ids", "1,5,9", "--max-new-tokens", "12", "--no-eos", "--json")
    obj = json.loads(p.stdout.strip().splitlines()[-1])
    assert obj["token_ids"] == spd_jax.generate(model, [1, 5, 9], 12, stop_at_eos=False).token_ids
    s = obj["stats"]
    assert s["method"] == "eagle3" and s["k"] == 3 and s["drafter_spec"] == str(tmp_path / "drafter")
    assert s["tokens"] == 12 and s["tokens_per_round"] == 12 / s["rounds"]


def test_bad_input_exits_with_a_clear_message(tiny_ckpt, tmp_path):
    path, _ = tiny_ckpt("qwen2", True)
    p = run_cli("--model", str(path), "--mode", "ar", "--prompt-ids", "1,2", "--temperature", "-1", check=False)
    assert p.returncode == 2 and "temperature must be a finite number >= 0" in p.stderr
    p = run_cli("--model", str(tmp_path / "missing"), "--prompt-ids", "1", check=False)
    assert p.returncode == 2 and "nor an existing checkpoint directory" in p.stderr
    p = run_cli("--model", str(path), "--mode", "ar", "--prompt", "hello", check=False)
    assert p.returncode == 2 and "has no tokenizer" in p.stderr
    p = run_cli("--model", str(path), "--prompt-ids", "1,2", check=False)  # default: spd, n=8 > 4 layers
    assert p.returncode == 2 and "n=8 pipeline stages for a model of 4 layers" in p.stderr
    # no PSM ships for this model: spd runs a random one only when asked for
    p = run_cli("--model", str(path), "--n", "2", "--prompt-ids", "1,2", check=False)
    assert p.returncode == 2 and "none ships for this model at this n" in p.stderr and "--random-psm" in p.stderr
    p = run_cli("--model", str(path), "--n", "2", "--spec", str(tmp_path), "--random-psm", "--prompt-ids", "1,2",
                check=False)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr
    p = run_cli("--model", str(path), "--stages", "2,x", "--prompt-ids", "1,2", check=False)
    assert p.returncode == 2 and "--stages takes comma-separated int values (e.g. 4,4,3,4), got '2,x'" in p.stderr
    p = run_cli("--model", str(path), "--mode", "ar", "--prompt-file", str(tmp_path / "none.txt"), check=False)
    assert p.returncode == 2 and f"error: --prompt-file {tmp_path / 'none.txt'} does not exist" in p.stderr


def test_prompt_file_reads_plain_and_jsonl(tmp_path):
    from infer.generate import read_prompt_file

    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    (tmp_path / "p.jsonl").write_text('{"turns": ["a", "b"]}\n{"question": "q"}\n')
    assert read_prompt_file(str(tmp_path / "p.txt")) == ["first", "second"]
    assert read_prompt_file(str(tmp_path / "p.jsonl")) == ["a", "q"]


@pytest.mark.real_model
@pytest.mark.parametrize("n, plan", [(8, [3, 3, 4, 4, 4, 4, 4, 4]), (4, [7, 7, 8, 8])])
def test_default_model_spd_equals_ar(smollm2, n, plan):
    """The user's main command: python -m infer.generate --mode spd --n 8 (8 CPU devices set up by the CLI),
    and --n 4; each with the PSM shipped for that n."""
    args = ("--prompt", "Name three primary colors.", "--max-new-tokens", "40", "--json")
    spd = json.loads(run_cli("--mode", "spd", "--n", str(n), *args).stdout.strip().splitlines()[-1])
    prompt_ids = smollm2.encode("Name three primary colors.")  # the chat template applied, as the CLI does
    assert spd["prompt_ids"] == prompt_ids
    ar_ids = spd_jax.generate(smollm2, prompt_ids, 40).token_ids  # AR in process: a subprocess costs ~10 s
    ar = dict(token_ids=ar_ids, text=smollm2.decode(ar_ids))
    assert spd["token_ids"] == ar["token_ids"] and spd["text"] == ar["text"]
    s = spd["stats"]
    assert s["n"] == n and s["stage_layers"] == plan
    shipped = shipped_psm("smollm2-135m-instruct", n)  # the trained PSM by default
    assert shipped is not None and s["psm"] == str(shipped)
    assert s["tokens"] == len(ar["token_ids"]) and s["cycles"] >= s["tokens"] and 0 < s["alpha"] <= 1


@pytest.mark.real_model
def test_default_model_eagle3_equals_ar(smollm2):
    """python -m infer.generate --mode eagle3: the EAGLE-3-style drafter shipped for the default model
    (a random one until it ships) drafts, and the committed tokens are ar's."""
    out = run_cli("--mode", "eagle3", "--k", "3", "--prompt", "Name three primary colors.", "--max-new-tokens", "24",
                  "--json")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["token_ids"] == spd_jax.generate(smollm2, res["prompt_ids"], 24).token_ids
    shipped = shipped_eagle3("smollm2-135m-instruct")
    s = res["stats"]
    assert s["drafter_spec"] == (str(shipped) if shipped else "random")
    assert s["k"] == 3 and s["tokens"] == len(res["token_ids"]) and 1 <= s["tokens"] / s["rounds"] <= 4


@pytest.mark.real_model
def test_default_model_tp_streams_ar_text(smollm2):
    """python -m infer.generate --mode tp --n 2 --prompt ...: a sharded load (MLP and vocabulary split;
    SmolLM2's 9/3 heads replicated on 2 devices) streams the chat answer ar gives, token for token in
    text (ar's CLI path is the same code with one device; tp == ar tokens: tests/test_sharding.py)."""
    p = run_cli("--mode", "tp", "--n", "2", "--prompt", "What is 2 + 2?", "--max-new-tokens", "24")
    assert "tok/s" in p.stderr and "on 2 device(s)" in p.stderr
    text = smollm2.decode(spd_jax.generate(smollm2, smollm2.encode("What is 2 + 2?"), 24).token_ids)
    assert text.strip() and p.stdout.strip() == text.strip()


def test_a_model_too_large_for_one_process_of_host_devices_is_run_as_processes(tmp_path, monkeypatch):
    """On a CPU host, several host devices of one process deadlock XLA:CPU from about 0.4 B parameters: the CLI
    asks for one process per device instead (tests/test_scale.py runs it at Qwen3.5-0.8B)."""
    import argparse
    import json as _json

    from spd_jax import distributed
    from spd_jax.config import named_hf_dict

    ap = argparse.ArgumentParser()
    distributed.add_arguments(ap)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for var in (distributed.ENV_PROCESS_ID, distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES):
        monkeypatch.delenv(var, raising=False)
    for name, want in (("qwen3.5-0.8b", 4), ("smollm2-135m-instruct", None)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(_json.dumps(named_hf_dict(name)))
        assert distributed.processes_for_size(ap.parse_args([]), d, 4) == want, name
    big = tmp_path / "qwen3.5-0.8b"
    for flags in (["--processes", "2"], ["--local-devices", "2"]):  # the caller chose how the devices are laid out
        assert distributed.processes_for_size(ap.parse_args(flags), big, 4) is None, flags
    assert distributed.processes_for_size(ap.parse_args([]), big, 1) is None
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")  # a worker of a job already
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    assert distributed.processes_for_size(ap.parse_args([]), big, 4) is None
    monkeypatch.delenv(distributed.ENV_COORDINATOR)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert distributed.processes_for_size(ap.parse_args([]), big, 4) is None
