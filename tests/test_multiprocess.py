"""The same pipeline over several real processes (`jax.distributed`, gloo collectives on the CPU): each
process holds only its stages, and the committed tokens equal the single-process engine's exactly;
training over two processes gives the single-process losses; a dead worker or an absent coordinator
ends the job with an error naming it, within a bound.

Each case starts real worker processes (JAX start-up and compilation in each), so the file runs as a
CI step of its own (`-m multiprocess`), not in the default run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spd_jax
from spd_jax.decode.sampling import Sampling
from spd_jax import methods

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 3, 17, 2]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", SPD_JAX_INIT_TIMEOUT_S="60")


def _generate(args: list[str], timeout: float = 300) -> dict:
    r = subprocess.run([sys.executable, "-m", "infer.generate", "--json", "--no-compile-cache", *args], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in r.stdout.splitlines()]  # stdout holds the JSON rows and nothing else
    assert len(rows) == 1, r.stdout
    return rows[0]


# (model kind, mode, sampling flags): greedy spd and pipeline on both target kinds, sampling with a seed
CASES = [("llama", "spd", []), ("llama", "pipeline", []), ("llama", "spd", ["--temperature", "1", "--seed", "3"]),
         ("qwen3_5", "spd", []), ("qwen3_5", "pipeline", []),
         ("qwen3_5", "spd", ["--temperature", "0.8", "--top-k", "20", "--seed", "5"])]


@pytest.mark.parametrize("kind,mode,sampling", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_two_processes_equal_one(kind, mode, sampling, tiny_ckpt):
    ckpt = tiny_ckpt(kind, False, num_hidden_layers=4)[0]
    row = _generate(["--model", str(ckpt), "--mode", mode, "--n", "2", "--processes", "2", "--random-psm",
                     "--no-eos", "--max-new-tokens", "24", "--prompt-ids", ",".join(map(str, PROMPT)), *sampling])
    model = spd_jax.load_model(ckpt)
    flags = dict(zip(sampling[::2], sampling[1::2]))
    sp = Sampling(temperature=float(flags.get("--temperature", 0)),
                  top_k=int(flags["--top-k"]) if "--top-k" in flags else None, seed=int(flags.get("--seed", 0)))
    ref = spd_jax.generate(model, PROMPT, 24, sampling=sp, method=methods.get(mode).taking(n=2, spec="random"),
                           stop_at_eos=False)
    assert row["token_ids"] == ref.token_ids
    assert row["stats"]["cycles"] == ref.stats["cycles"] and row["stats"]["devices"] == 2
    if mode == "spd":  # drafts were both accepted and rejected: the rollback crossed processes too
        assert row["stats"]["accepted"] == ref.stats["accepted"] and row["stats"]["rejected"] > 0


def test_four_processes_and_tensor_parallel(tiny_ckpt):
    """Four processes of one device each (on 2 cores they share); tensor parallelism over two."""
    ckpt = tiny_ckpt("llama", False, num_hidden_layers=4)[0]
    model = spd_jax.load_model(ckpt)
    common = ["--model", str(ckpt), "--random-psm", "--no-eos", "--max-new-tokens", "16",
              "--prompt-ids", ",".join(map(str, PROMPT))]
    row = _generate([*common, "--n", "4", "--processes", "4"])
    assert row["token_ids"] == spd_jax.generate(model, PROMPT, 16, method=methods.SPD(n=4, spec="random"),
                                                stop_at_eos=False).token_ids
    row = _generate([*common, "--mode", "tp", "--n", "2", "--processes", "2"])
    assert row["token_ids"] == spd_jax.generate(model, PROMPT, 16, method="ar", stop_at_eos=False).token_ids


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_tensor_parallel_stages_over_two_processes(kind, tiny_ckpt):
    """A 2 x 2 (stage, model) mesh over two processes of two host devices each: each stage's layers split over
    `model` (its all-reduces inside a process), the stages' hand-over and the engine's collectives across the two
    processes; the tokens equal `ar`'s and the one-process 2 x 2 engine's."""
    ckpt = tiny_ckpt(kind, False, num_hidden_layers=4)[0]
    row = _generate(["--model", str(ckpt), "--n", "2", "--tp", "2", "--processes", "2", "--random-psm", "--no-eos",
                     "--max-new-tokens", "16", "--prompt-ids", ",".join(map(str, PROMPT))])
    model = spd_jax.load_model(ckpt)
    ref = spd_jax.generate(model, PROMPT, 16, method=methods.SPD(n=2, tp=2, spec="random"), stop_at_eos=False)
    assert row["token_ids"] == ref.token_ids == spd_jax.generate(model, PROMPT, 16, method="ar",
                                                                 stop_at_eos=False).token_ids
    assert row["stats"]["devices"] == 4 and row["stats"]["tp"] == 2 and row["stats"]["processes"] == 2
    assert row["stats"]["cycles"] == ref.stats["cycles"]


@pytest.mark.real_model
def test_training_over_two_processes_gives_the_single_process_losses(smollm2, tmp_path):
    """Data parallel 2x1: one process with two host devices vs two processes with one each."""
    common = [sys.executable, "-m", "train.main", "--config", str(ROOT / "configs/train/smollm2-n8.yaml"),
              "--mesh", "2x1", "--steps", "2", "sources=[gsm8k]", "limit=16", "buckets=[192]", "max_len=192",
              "batch_size=2", "heldout=2", "eval_every=100", "save_every=100", "log_every=1", "n=2"]
    losses = []
    for extra, out in (([], tmp_path / "one"), (["--processes", "2"], tmp_path / "two")):
        r = subprocess.run(common + ["--out", str(out), *extra], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([(x["step"], x["positions"], x["loss"], x["grad_norm"]) for x in rows])
        assert (out / "psm" / "psm.json").is_file()  # the export ran in every process, written once
    assert len(losses[0]) == 2
    # the same program on the same devices' worth of data: equal up to the all-reduce's summation order
    for a, b in zip(*losses):
        assert a[:2] == b[:2] and a[2:] == pytest.approx(b[2:], rel=1e-5)
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["processes"] == 2


@pytest.mark.real_model
def test_a_killed_worker_ends_the_job(smollm2):
    """SIGKILL one worker mid-run: the launcher stops the other and exits non-zero naming the dead one."""
    p = subprocess.Popen([sys.executable, "-m", "infer.generate", "--n", "2", "--processes", "2", "--random-psm",
                          "--no-eos", "--max-new-tokens", "1000", "--json"], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = {}
    for line in p.stderr:
        if m := re.match(r"launch: worker (\d+) is pid (\d+)", line):
            pids[int(m[1])] = int(m[2])
        if "[worker 1]" in line:  # worker 1 is up and past its imports
            break
    time.sleep(3)
    assert p.poll() is None, "the job ended before the kill"
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rest = p.stderr.read()
    p.wait(timeout=60)
    assert time.monotonic() - killed < 30
    assert p.returncode != 0
    assert f"worker 1 (pid {pids[1]}) was killed by SIGKILL" in rest
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # and worker 0 is gone too


def test_an_absent_coordinator_is_a_clear_error(tmp_path, tiny_ckpt):
    ckpt = tiny_ckpt("llama", False, num_hidden_layers=4)[0]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "infer.generate", "--model", str(ckpt), "--n", "2", "--prompt-ids", "1,2",
                        "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"], cwd=ROOT,
                       env=dict(ENV, SPD_JAX_INIT_TIMEOUT_S="3"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and time.monotonic() - t0 < 60
    assert "no coordinator answers at 127.0.0.1:9" in r.stderr


def test_evaluate_over_two_processes(tiny_ckpt, tmp_path):
    """The harness as one job: every row computed by both processes, written once by process 0."""
    ckpt = tiny_ckpt("llama", False, num_hidden_layers=4)[0]
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i]}) + "\n" for i in range(2)))
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "infer.evaluate", "--model", str(ckpt), "--bench", str(bench),
                        "--methods", "ar,pipeline,spd", "--n", "2", "--limit", "2", "--max-new-tokens", "8",
                        "--random-psm", "--out", str(out), "--processes", "2", "--no-compile-cache"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6  # once each, not once per process
    by = {(x["method"], x["prompt_index"]): x for x in rows}
    for i in range(2):
        assert by[("spd", i)]["token_ids"] == by[("pipeline", i)]["token_ids"] == by[("ar", i)]["token_ids"]
    assert "over 2 processes" in by[("spd", 0)]["timing_includes"] and (out / "results.md").is_file()
    assert r.stdout.count("# Evaluation results") == 1  # process 0 alone prints the tables
