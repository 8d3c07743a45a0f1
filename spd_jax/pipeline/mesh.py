"""The `stage` mesh: one device per pipeline stage."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

AXIS = "stage"


def stage_mesh(n: int):
    """A 1-D mesh of the first n devices along `stage`, with a clear error when there are too few."""
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(
            f"n={n} pipeline stages need {n} devices, but JAX sees {len(devices)} ({jax.default_backend()}). "
            f"On a CPU-only machine, set XLA_FLAGS=--xla_force_host_platform_device_count={n} or call "
            f"jax.config.update('jax_num_cpu_devices', {n}) before JAX initialises "
            f"(python -m infer.generate --n {n} does this itself).")
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices[:n])
