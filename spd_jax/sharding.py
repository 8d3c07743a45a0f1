"""Meshes: the `data x model` mesh of training (and, with the stage axis in `pipeline/mesh.py`, the
pipeline's). Built from a string like "8x1" or from the devices present; on a CPU-only machine the
host devices are requested before JAX starts."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA, MODEL = "data", "model"


def parse_mesh(spec: str) -> tuple[int, int]:
    """"8x1" -> (8, 1): data-parallel x model-parallel device counts."""
    try:
        d, m = (int(p) for p in str(spec).lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must look like DATAxMODEL, e.g. 8x1 or 4x2; got {spec!r}") from None
    if d < 1 or m < 1:
        raise ValueError(f"--mesh sizes must be positive, got {spec!r}")
    return d, m


def request_cpu_devices(n: int) -> None:
    """Ask for n host (CPU) devices. Must run before JAX initialises its backends; it changes nothing on
    GPU/TPU backends, whose devices are real."""
    jax.config.update("jax_num_cpu_devices", max(int(n), 1))


def data_model_mesh(data: int, model: int) -> Mesh:
    """A (data, model) mesh over the first data*model devices, with Auto axes so jit propagates the
    shardings given at the inputs (batch over `data`, weights replicated or split over `model`)."""
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(f"--mesh {data}x{model} needs {data * model} devices, but JAX sees {len(devices)} "
                         f"({jax.default_backend()}); on a CPU-only machine the CLI requests host devices "
                         f"itself, elsewhere pick a mesh that fits the devices present")
    return Mesh(np.asarray(devices[:data * model]).reshape(data, model), (DATA, MODEL),
                axis_types=(AxisType.Auto, AxisType.Auto))
