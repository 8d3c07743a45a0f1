"""A second process with the same shapes loads its executables from the persistent compilation
cache instead of compiling them (counted through jax.monitoring's cache events)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import spd_jax

ROOT = Path(__file__).resolve().parents[1]


def test_second_process_reuses_the_persistent_cache(tiny_ckpt, tmp_path):
    path, _ = tiny_ckpt("llama", False)
    cmd = [sys.executable, "-m", "infer.generate", "--model", str(path), "--mode", "spd", "--n", "2",
           "--random-psm", "--prompt-ids", "1,5,9", "--max-new-tokens", "4", "--json"]
    env = dict(os.environ, SPD_JAX_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")

    def run():
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.splitlines()[-1]), r.stderr

    first, err1 = run()
    second, err2 = run()
    assert first["stats"]["compile_from"] == "compiled"
    assert second["stats"]["compile_from"] == "persistent cache"
    assert second["token_ids"] == first["token_ids"]
    # spd with an explicitly untrained PSM commits exactly the autoregressive tokens
    model = spd_jax.load_model(path)
    assert first["token_ids"] == spd_jax.generate(model, [1, 5, 9], 4).token_ids and first["stats"]["psm"] == "random"
    assert any((tmp_path / "cache" / "xla").iterdir())
    # a clean console: the random-PSM notice once, no XLA error-level lines
    assert err1.count("randomly initialised PSM") == 1 and " E1" not in err1 and "\nE1" not in err1
