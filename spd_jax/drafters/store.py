"""A drafter checkpoint: its variables (orbax) and its identity (JSON) in a new directory, written once
per job (every process takes part in the orbax save; process 0 alone writes the JSON), and read back
onto this process's first device."""

from __future__ import annotations

import json
from pathlib import Path


def save_drafter(path: str | Path, variables: dict, meta_name: str, meta: dict, what: str) -> None:
    """variables -> path/params (orbax), meta -> path/meta_name. path must not exist (never overwrite a
    checkpoint); what names the drafter in that error."""
    import orbax.checkpoint as ocp

    from spd_jax import distributed

    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} exists; save the {what} to a new directory")
    distributed.barrier(f"save {what}")  # in a multi-process job: every process checked before any writes
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", variables)
    ckptr.wait_until_finished()
    if distributed.is_leader():
        (path / meta_name).write_text(json.dumps(meta, indent=1))


def restore_variables(path: str | Path, abstract: dict) -> dict:
    """path/params (orbax) -> variables of `abstract`'s shapes and dtypes, on this process's first device,
    whatever mesh the trainer saved from (an 8x1 data-parallel run restores on a laptop); the engines place
    them from there."""
    import jax
    import orbax.checkpoint as ocp

    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), abstract)
    return ocp.StandardCheckpointer().restore(Path(path) / "params", abstract)
