"""python -m bench.load: peak host memory and per-device bytes of loading a model whole vs sharded.

Each measurement runs in a fresh process (peak RSS is a process-lifetime maximum): `whole` is
`load_model()` (every array on device 0), `tp` is `load_model(mesh=model_mesh(n), rules=TP_RULES)`,
`stage` loads with `STAGE_RULES` and reads the n per-stage stacks (`stages.load_stage_weights`).
Reported: the load's peak resident memory above the process's just before it (JAX and the devices
already up; sampled every 2 ms), what stays resident after it, and the bytes the first device holds. On a CPU host all "devices" share the host's memory, so
the sum over devices is the whole model either way; what sharding changes there is the transient
peak and what one device holds. On GPU/TPU the per-device figure is the device-memory one.

    python -m bench.load [--model smollm2] [--n 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

import jax

import spd_jax  # imports JAX without starting its backend: _measure still picks the device count
from spd_jax.decode.pipelined import plan_for
from spd_jax.models import schema
from spd_jax.pipeline import stages
from spd_jax.sharding import STAGE_RULES, TP_RULES, Placement, model_mesh, request_cpu_devices, stage_mesh


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _PeakRSS:
    """Samples the resident set every 2 ms on a thread (ru_maxrss is a high-water mark since process
    start, which JAX's own start-up can already exceed)."""

    def __enter__(self):
        self.before = self.peak = _rss()
        self._stop = threading.Event()

        def run():
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, _rss())

        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _measure(mode: str, model_name: str, n: int, dtype: str) -> dict:
    request_cpu_devices(n)  # before JAX initialises its backend (the first array or device query)
    jax.devices()  # the backend's own start-up is not the load's memory
    with _PeakRSS() as mem:
        arrays = LOADS[mode](model_name, n, dtype)
    dev0 = jax.devices()[0]
    on_dev0 = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev0)
    total = sum(s.data.nbytes for a in arrays for s in a.addressable_shards)
    return dict(mode=mode, n=n if mode != WHOLE else 1, load_peak_mb=(mem.peak - mem.before) / 2**20,
                held_mb=(_rss() - mem.before) / 2**20, device0_mb=on_dev0 / 2**20, all_devices_mb=total / 2**20)


def _whole(model_name: str, n: int, dtype: str) -> list:
    return _ready(jax.tree.leaves(spd_jax.load_model(model_name, dtype=dtype).params))


def _tp(model_name: str, n: int, dtype: str) -> list:
    m = spd_jax.load_model(model_name, dtype=dtype, mesh=model_mesh(n), rules=TP_RULES)
    return _ready(jax.tree.leaves(m.params))


def _stage(model_name: str, n: int, dtype: str) -> list:
    mesh = stage_mesh(n)
    m = spd_jax.load_model(model_name, dtype=dtype, mesh=mesh, rules=STAGE_RULES)
    layout = stages.StageLayout.of(m.config, plan_for(m, n), (0,))
    placement = Placement(mesh, STAGE_RULES, tuple(schema.axis_units(m.config).items()))
    return _ready(jax.tree.leaves(m.params) + jax.tree.leaves(
        stages.load_stage_weights(m.reader, m.config, layout, placement, m.dtype)))


def _ready(arrays: list) -> list:
    jax.block_until_ready(arrays)
    return arrays


WHOLE = "whole"
LOADS = {WHOLE: _whole, "tp": _tp, "stage": _stage}  # the placements measured, one process each


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(_measure(args._child, args.model, args.n, args.dtype)))
        return 0
    spd_jax.load_model(args.model)  # convert / cache the default model first: not part of any measurement
    rows = []
    for mode in LOADS:
        out = subprocess.run([sys.executable, "-m", "bench.load", "--model", args.model, "--n", str(args.n),
                              "--dtype", args.dtype, "--_child", mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.model} ({args.dtype}); one fresh process per row; peak = max RSS during the load minus RSS before")
    print(f"{'load':<8}{'devices':>8}{'peak host MB':>14}{'held MB':>9}{'device 0 MB':>13}{'all devices MB':>16}")
    for r in rows:
        print(f"{r['mode']:<8}{r['n']:>8}{r['load_peak_mb']:>14.0f}{r['held_mb']:>9.0f}{r['device0_mb']:>13.0f}"
              f"{r['all_devices_mb']:>16.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
