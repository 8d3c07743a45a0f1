"""Several processes, one mesh: spd-jax under JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program; the mesh spans all processes' devices; each process reads from
disk and holds only the shards its own devices own (sharded loading), and only process 0 prints or
writes files. This is the path a TPU pod slice or a multi-node GPU job takes; on one CPU machine, P
processes of one core each are where pipeline stages really run at the same time.

Two ways in, the same flags on `infer.generate`, `infer.evaluate` and `train.main`:
- one machine: `--processes P` starts P local workers (`launch`), each pinned to its share of the
  cores, with one host device each unless `--local-devices` says otherwise;
- a cluster: start one process per host yourself with `--coordinator HOST:PORT --num-processes P
  --process-id I` (or the environment variables SPD_JAX_COORDINATOR, SPD_JAX_NUM_PROCESSES,
  SPD_JAX_PROCESS_ID); `--coordinator auto` lets JAX detect them (Cloud TPU, SLURM, Open MPI).

On the CPU backend the cross-process collectives are gloo's (`jax_cpu_collectives_implementation`).

Failure is bounded: a worker that cannot reach the coordinator gives up after SPD_JAX_INIT_TIMEOUT_S
(default 60 s) with an error naming the address; once running, the coordination service declares a
worker dead after SPD_JAX_HEARTBEAT_S (default 15 s) without a heartbeat and aborts the others (XLA's
message names the task). Under `launch`, the first worker to fail stops the rest at once and the
launcher exits non-zero naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

ENV_COORDINATOR = "SPD_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "SPD_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SPD_JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "SPD_JAX_LOCAL_DEVICES"
ENV_INIT_TIMEOUT = "SPD_JAX_INIT_TIMEOUT_S"
ENV_HEARTBEAT = "SPD_JAX_HEARTBEAT_S"
# After the first failure, how long the launcher lets the other workers end on SIGTERM before SIGKILL.
STOP_GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One process's place in a multi-process job. coordinator "auto": JAX detects the cluster."""

    coordinator: str
    num_processes: int | None
    process_id: int | None
    local_devices: int | None = None  # host devices per process on the CPU backend (None: one)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--processes", type=int, default=None,
                   help="start this many local worker processes forming one mesh (one CPU core each where the "
                        "machine has enough); process 0 prints")
    g.add_argument("--coordinator", default=None,
                   help=f"HOST:PORT of process 0's coordinator, or 'auto' (Cloud TPU, SLURM, Open MPI); "
                        f"env {ENV_COORDINATOR}")
    g.add_argument("--num-processes", type=int, default=None, help=f"processes in the job; env {ENV_NUM_PROCESSES}")
    g.add_argument("--process-id", type=int, default=None, help=f"this process's index; env {ENV_PROCESS_ID}")
    g.add_argument("--local-devices", type=int, default=None,
                   help=f"host devices per process on a CPU backend (default: the devices the job needs / "
                        f"processes); env {ENV_LOCAL_DEVICES}")


def cluster_from(args: argparse.Namespace) -> Cluster | None:
    """The job this process belongs to, from the flags or else the environment (a launched worker's);
    None for a single-process run."""
    env = os.environ
    coord = args.coordinator or env.get(ENV_COORDINATOR)
    if coord is None:
        if args.num_processes is not None or args.process_id is not None:
            raise ValueError("--num-processes/--process-id need --coordinator HOST:PORT (process 0's address)")
        return None

    def num(flag, name):
        v = flag if flag is not None else env.get(name)
        return int(v) if v is not None else None

    c = Cluster(coord, num(args.num_processes, ENV_NUM_PROCESSES), num(args.process_id, ENV_PROCESS_ID),
                num(args.local_devices, ENV_LOCAL_DEVICES))
    if coord != "auto":
        if c.num_processes is None or c.process_id is None:
            raise ValueError(f"--coordinator {coord} needs --num-processes and --process-id (or {ENV_NUM_PROCESSES} "
                             f"and {ENV_PROCESS_ID})")
        if not 0 <= c.process_id < c.num_processes:
            raise ValueError(f"--process-id {c.process_id} is not in [0, {c.num_processes})")
    return c


def local_device_count(cluster: Cluster, needed: int) -> int:
    """Host devices this process asks for on a CPU backend: the flag's, else needed / processes."""
    if cluster.local_devices is not None:
        return cluster.local_devices
    p = cluster.num_processes or 1
    if needed % p:
        raise ValueError(f"{needed} devices do not split evenly over {p} processes; pick a device count that "
                         f"the process count divides, or set --local-devices")
    return max(needed // p, 1)


def initialize(cluster: Cluster, local_devices: int) -> None:
    """Join the job. Must run before anything touches a JAX backend (like `request_cpu_devices`)."""
    import jax

    _native_stdout_to_stderr()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    jax.config.update("jax_num_cpu_devices", local_devices)
    init_s = int(os.environ.get(ENV_INIT_TIMEOUT, 60))
    heartbeat_s = int(os.environ.get(ENV_HEARTBEAT, 15))
    kw = dict(initialization_timeout=init_s, heartbeat_timeout_seconds=heartbeat_s)
    if cluster.coordinator == "auto":
        jax.distributed.initialize(**kw)
        return
    # XLA aborts the process (no Python exception) when the job does not assemble in time; say first
    # what was expected, and check the coordinator is reachable at all, so the failure is readable.
    if cluster.process_id == 0:
        print(f"spd_jax: process 0 of {cluster.num_processes}: coordinating at {cluster.coordinator}; the job ends "
              f"if the others have not joined within {init_s} s ({ENV_INIT_TIMEOUT})", file=sys.stderr, flush=True)
    else:
        _wait_for_coordinator(cluster, init_s)
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id, **kw)


def _wait_for_coordinator(cluster: Cluster, timeout_s: float) -> None:
    host, _, port = cluster.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator must be HOST:PORT, got {cluster.coordinator!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"process {cluster.process_id} of {cluster.num_processes}: no coordinator answers at "
                                   f"{cluster.coordinator} after {timeout_s:.0f} s ({e}); start process 0 there "
                                   f"(it serves the job) or fix --coordinator") from None
            time.sleep(0.2)


def _native_stdout_to_stderr() -> None:
    """Native libraries print to file descriptor 1 (gloo announces every connection there), which would
    corrupt a worker's machine-readable stdout (--json): point descriptor 1 at stderr and keep Python's
    sys.stdout on the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8")


def setup(args: argparse.Namespace, needed_devices: int) -> Cluster | None:
    """For a CLI, before JAX initialises: join the job the flags/environment describe, or else ask for
    `needed_devices` host devices (a no-op off the CPU backend). -> the cluster, or None."""
    from spd_jax.sharding import request_cpu_devices

    cluster = cluster_from(args)
    if cluster is None:
        request_cpu_devices(needed_devices)
        return None
    initialize(cluster, local_device_count(cluster, needed_devices))
    return cluster


# One process of several host devices deadlocks XLA:CPU from about this size: its thunk executor resumes a
# device's program on an intra-op pool worker, an in-process collective then blocks that worker in its
# rendezvous, and a device whose work is still queued never runs (docs/scale.md). SmolLM2-135M never has (n up
# to 16); Qwen3.5-0.8B did at n = 2 in 3 of 5 runs, with or without the parallel-task pass.
ONE_PROCESS_MAX_PARAMS = 400_000_000


def _accelerator_present() -> bool:
    """Whether JAX may start on a GPU or TPU here, known without starting a backend: JAX_PLATFORMS names one,
    or an accelerator plugin (jax_cuda*, libtpu) is installed."""
    import importlib.metadata
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    return bool(list(importlib.metadata.entry_points(group="jax_plugins"))) or importlib.util.find_spec("libtpu") is not None


def model_params(model_ref) -> int | None:
    """The parameter count of a checkpoint directory's config.json; None for anything else (the packaged default
    models, converted on first use, are small)."""
    from pathlib import Path

    from spd_jax.config import ModelConfig
    from spd_jax.models import schema

    path = Path(str(model_ref)).expanduser() / "config.json"
    if not path.is_file():
        return None
    cfg = ModelConfig.from_json(path)
    return (sum(schema.param_count(schema.layer_schema(cfg, k)) for k in cfg.layer_types)
            + schema.param_count(schema.global_schema(cfg)))


def processes_for_size(args: argparse.Namespace, model_ref, devices: int) -> int | None:
    """A CLI about to run `devices` host devices in one process (no --processes, no job), on a host without an
    accelerator, for a model of at least ONE_PROCESS_MAX_PARAMS -> the processes to run instead (one device each);
    else None."""
    if devices <= 1 or args.processes is not None or getattr(args, "local_devices", None) is not None:
        return None
    if cluster_from(args) is not None:  # already one process of a job
        return None
    if _accelerator_present():
        return None
    params = model_params(model_ref)
    return devices if params is not None and params >= ONE_PROCESS_MAX_PARAMS else None


def launching(args: argparse.Namespace) -> bool:
    """True in the parent of a `--processes P` run (P > 1), which only launches; False in its workers."""
    return bool(args.processes and args.processes > 1 and ENV_PROCESS_ID not in os.environ
                and args.coordinator is None)


# ---------------------------------------------------------------- inside a job


def process_index() -> int:
    import jax

    return jax.process_index()


def is_leader() -> bool:
    """Process 0: the one that prints and writes files."""
    return process_index() == 0


def to_host(x) -> Any:
    """A jax.Array -> numpy on every process, whatever devices hold it (process_allgather when some
    of its shards live in other processes)."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def barrier(name: str) -> None:
    """Every process waits here for the others (a no-op in a single process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------- the local launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _core_groups(processes: int) -> list[set[int]] | None:
    """Split this process's CPU cores into one disjoint group per worker (None when there are fewer
    cores than workers: then they share)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < processes:
        return None
    per = len(cores) // processes
    return [set(cores[i * per:(i + 1) * per]) for i in range(processes)]


def _worker_setup(cores: set[int] | None) -> None:
    """In each worker, before it runs: its cores, and death with the launcher (Linux: the kernel sends
    SIGKILL when the launcher's process ends, however it ends), so no worker outlives its job."""
    if cores:
        os.sched_setaffinity(0, cores)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Stopped(Exception):
    pass


def _stop(signum, frame):
    raise _Stopped(signum)


def _forward(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stderr.write(prefix + line.decode(errors="replace"))
    stream.close()


def launch(processes: int, module: str, argv: Sequence[str], local_devices: int | None = None,
           pin: bool = True) -> int:
    """Run `python -m module *argv` as `processes` workers of one job on this machine; -> exit code.

    Worker i gets the coordinator address, process count and its index in the environment; with
    pin, its own 1/P of the cores. Worker 0's stdout is the launcher's; every worker's stderr is
    forwarded line by line, prefixed with its index. The first worker to exit non-zero (or to die on a
    signal) stops the others (SIGTERM, then SIGKILL after STOP_GRACE_S) and the launcher returns 1,
    naming it."""
    if processes < 2:
        raise ValueError(f"launch needs at least 2 processes, got {processes}")
    port = _free_port()
    groups = _core_groups(processes) if pin else None
    procs, threads = [], []
    for i in range(processes):
        env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                                  ENV_PROCESS_ID: str(i)})
        if local_devices is not None:
            env[ENV_LOCAL_DEVICES] = str(local_devices)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's INFO lines from every worker drown the output
        cores = groups[i] if groups else None
        p = subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                             stdout=None if i == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                             preexec_fn=lambda c=cores: _worker_setup(c))
        procs.append(p)
        print(f"launch: worker {i} is pid {p.pid}" + (f" on cores {sorted(cores)}" if cores else ""),
              file=sys.stderr, flush=True)
    # Only once every worker is spawned: preexec_fn runs between fork and exec, which CPython documents
    # as unsafe while other threads run (a lock a thread held at the fork stays held in the child).
    # Until then a worker's stderr waits in its pipe.
    for i, p in enumerate(procs):
        t = threading.Thread(target=_forward, args=(p.stderr, f"[worker {i}] "), daemon=True)
        t.start()
        threads.append(t)
    failed = None
    previous = signal.signal(signal.SIGTERM, _stop)  # a terminated launcher stops its workers first
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        failed = (None, -signal.SIGINT)
    except _Stopped:
        failed = (None, -signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed is not None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for t in threads:
        t.join(timeout=2.0)
    if failed is None:
        return 0
    i, code = failed
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    who = (f"the launcher was stopped ({signal.Signals(-code).name})" if i is None
           else f"worker {i} (pid {procs[i].pid}) {how}")
    print(f"launch: error: {who}; stopped the {'other ' if i is not None else ''}workers", file=sys.stderr,
          flush=True)
    return 1


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The CLI's own arguments minus --processes (a worker must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--processes":
            skip = True
            continue
        if a.startswith("--processes="):
            continue
        out.append(a)
    return out
