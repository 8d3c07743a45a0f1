"""A run's checkpoints and what it starts from or hands on: the orbax manager, the resume identity,
the exported drafter, and the warm start named by the digest of its weights.

A run directory holds ckpt/ (orbax: params, optimiser state, step; with a JSON meta of positions and
wall time), run.json (the identity a resume must match, the resolved config, the commands) and, at the
end, the exported drafter (psm/ or drafter/) without the target's head. A warm start (`init_from`)
reads an exported drafter's weights; `weights_digest` names those weights by content, the run records
the digest (run.json's warm_start, and the export's trained.warm_start: the lineage), and a config that
states `init_digest` is refused when init_from holds other weights, so a rerun starts from the same
bytes or not at all. Nothing here computes a step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from spd_jax import distributed
from spd_jax.config import read_json
from spd_jax.drafters import registry, store
from spd_jax.drafters.store import orbax_failure, quiet_abandoned_reads
from train.config import ConfigError, TrainConfig

log = logging.getLogger("train.checkpoints")

Spec = Any  # what a run trains: a drafter kind's config (`DrafterKind.config`); its kind is the method
# run.json holds a run's identity and data order: without it the checkpoints cannot be resumed or exported
RUN_JSON_DAMAGED = "restore the file from a copy, or train a new run with another --out"


def export_name(spec: Spec) -> str:
    """The run directory's subdirectory the trained drafter is exported to (`Training.export_dir`)."""
    return registry.of_config(spec).training.export_dir


# ---------------------------------------------------------------- the warm start

def weights_digest(params: dict) -> str:
    """A drafter's trained weights -> "sha256:" and 16 hex digits of sha256 over every leaf in path order:
    its path, dtype, shape and row-major bytes. The weights as a warm start loads them (float32; the
    exported bfloat16 values cast exactly): every leaf given (`warm_start` passes the LM head only where the
    drafter trains its own; the target's is not the drafter's)."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in leaves:
        a = np.asarray(distributed.to_host(leaf))
        h.update(f"{jax.tree_util.keystr(path)}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return "sha256:" + h.hexdigest()[:16]


def check_digest(init_from: str, found: str, expected: str | None) -> None:
    """Refuse weights whose digest is not the config's init_digest, naming both and the fixes."""
    if expected is not None and found != expected:
        raise ConfigError(
            f"init_from {init_from} holds weights with digest {found}, this config expects init_digest={expected}: "
            "the directory now holds other weights than the run recorded (a drafter shipped or exported over "
            f"them). Point init_from at the weights of digest {expected} (docs/train/runs.md names the run that "
            f"makes them), or start from what is there now as a new run with init_digest={found}")


def warm_start(model, spec: Spec, tc: TrainConfig) -> tuple[dict, dict]:
    """-> (the trained params of tc.drafter.init_from, without the LM head unless the drafter trains its own
    (`Training.trains_head`), as float32 copies; its record,
    `warm_start_record` with the weights' digest). Refuses a drafter whose shapes do not fit this run's,
    one trained for another target, and weights other than tc.drafter.init_digest names."""
    init_from = tc.drafter.init_from
    record = warm_start_record(init_from)  # refuses a directory with no exported drafter
    # the kind refuses a drafter whose shapes do not fit spec, or one for another target
    training = registry.of_config(spec).training
    warm = training.warm_start(model, spec, init_from, log)
    # copies (training donates its buffers); proj_a are {kernel} dicts
    params = {k: jax.tree.map(lambda a: jnp.array(a, copy=True), w) for k, w in warm["params"].items()
              if k != "lm_head" or training.trains_head(spec)}
    digest = weights_digest(params)
    check_digest(init_from, digest, tc.drafter.init_digest)
    log.info("warm start from %s: weights %s", init_from, digest)
    return params, dict(path=record.pop("path"), digest=digest, **record)


def warm_start_record(init_from: str | Path, digest: str | None = None) -> dict[str, Any]:
    """What init_from held when a run started from it: its path, the digest of its weights (`weights_digest`,
    when the run read them) and its exported drafter's training facts (method, steps, positions; a PSM's
    plan and anchors; its own warm start, so a chain of warm starts stays whole). Runs and their exports
    keep this record rather than re-read the directory, which may later hold another drafter (a
    longer-trained PSM shipped in its place)."""
    path = Path(init_from)
    names = [k.identity_file for k in registry.KINDS.values()]  # psm.json, eagle3.json
    meta_file = next((path / f for f in names if (path / f).is_file()), None)
    if meta_file is None:
        raise FileNotFoundError(f"init_from {init_from}: no {' or '.join(names)} there (give a directory "
                                "train.main exported, e.g. runs/NAME/psm or spd_jax/psms/...)")
    meta = json.loads(meta_file.read_text())
    trained = meta.get("trained", {})
    rec: dict[str, Any] = dict(path=str(init_from), **(dict(digest=digest) if digest else {}),
                               **{k: trained[k] for k in ("method", "steps", "positions") if k in trained})
    rec.update({k: meta[k] for k in ("plan", "anchors") if k in meta})
    if "warm_start" in trained:
        rec["warm_start"] = trained["warm_start"]
    return rec


# ---------------------------------------------------------------- checkpoints and resume identity

class Checkpoints:
    """Periodic, atomic orbax checkpoints of the training state (params, optimiser, step) plus a JSON
    record of the run; keeps the last `keep`. A save killed midway leaves only a temporary directory,
    which orbax ignores, so a resume continues from the previous good step."""

    def __init__(self, directory: Path, tc: TrainConfig):
        self.ocp = ocp
        self.mngr = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=tc.run.keep, save_interval_steps=1,
                                                 enable_async_checkpointing=False))

    def latest(self) -> int | None:
        return self.mngr.latest_step()

    def all_steps(self) -> list[int]:
        """The kept checkpoints' steps, ascending."""
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        a = self.ocp.args
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)), force=True)
        self.mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """The state and meta saved at step; a checkpoint that does not read (a damaged file: a run killed
        mid-save never finalises one, so this is damage after the save) raises ValueError naming it and the
        step kept before it, which a resume reaches once it is moved aside. One holding another state tree
        (another version's) is told apart: nothing to move, only the version to match."""
        a = self.ocp.args
        quiet_abandoned_reads()
        try:
            out = self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(abstract_state),
                                                           meta=a.JsonRestore()))
        except Exception as e:  # noqa: BLE001 -- orbax raises bare Exception for a file it cannot read
            where = Path(self.mngr.directory) / str(step)
            earlier = [k for k in self.all_steps() if k < step]
            aside = (f"move it aside (mv {where} {where}.damaged) to resume from step {earlier[-1]}, the one before "
                     f"it, or --export {earlier[-1]}" if earlier else
                     "no earlier checkpoint is kept: train a new run with another --out")
            if isinstance(e, ValueError):  # orbax: a stored tree or shapes other than this state's
                raise ValueError(f"checkpoint {where} does not match the state this code builds ({orbax_failure(e)}): "
                                 "written by another version of spd-jax or optax, or its metadata is damaged. Do not "
                                 "delete it: resume it with the version that wrote it; if that is this one, "
                                 f"{aside}") from e
            raise ValueError(f"checkpoint {where} does not read ({orbax_failure(e)}): it is damaged; {aside}") from e
        return out["state"], out["meta"]


def run_identity(model, spec: Spec, tc: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed or used: the method, the drafter's spec, the target (and
    the kind's settings besides the spec, `Training.identity`: a PSM's psm_layers)."""
    kind = registry.of_config(spec)
    return dict(method=kind.name, spec=kind.to_json(spec), model=str(model.path),
                **kind.training.identity(tc.drafter))


def check_resume(was: dict, identity: dict) -> None:
    """Refuse to resume a run (`was`: the identity its run.json holds) as another one (`identity`, as
    JSON): another method, drafter spec or target raises ValueError naming both. Runs written before
    the method switch trained a PSM; PSM specs written before a field existed have its default."""
    was = dict(was)
    was.setdefault("method", registry.PSM.name)
    if was["method"] != identity["method"]:
        raise ValueError(f"it trained method {was['method']!r}; this config trains method {identity['method']!r} "
                         "(set method=... to match, or use a new --out)")
    was["spec"] = json.loads(json.dumps(registry.kind(was["method"]).training.recorded_spec(was["spec"])))
    if was != identity:
        def flat(d, pre=""):
            return {k2: v2 for k, v in d.items()
                    for k2, v2 in (flat(v, f"{pre}{k}.").items() if isinstance(v, dict) else [(pre + k, v)])}
        a, b = flat(was), flat(identity)
        diff = [f"{k}: run {a.get(k)!r}, this config {b.get(k)!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise ValueError(f"it was trained for another drafter or target ({'; '.join(diff)}); set the config to match "
                         "or use a new --out")


# What decides a run's data and its order: a resume must keep them, or "continues with the same data
# position" (and train.heldout's check that a run never saw its held-out conversations) would not hold.
DATA_KEYS = ("sources", "skip", "limit", "prompt_pattern", "max_len", "responses", "replies", "heldout", "seed",
             "batch_size", "grad_accum")


def check_same_data(was: dict, tc: TrainConfig) -> None:
    """Refuse to resume a run (`was`: the config its run.json holds) with other data keys (DATA_KEYS)."""
    old = TrainConfig.from_dict(was)
    changed = [k for k in DATA_KEYS if getattr(old, k) != getattr(tc, k)]
    if changed:
        raise ValueError("it trained with " + ", ".join(f"{k}={getattr(old, k)!r}" for k in changed) + ", this command "
                         "sets " + ", ".join(f"{k}={getattr(tc, k)!r}" for k in changed) + ": a resume keeps the run's "
                         "data and its order (drop those overrides, or train a new run with --out)")


def save_drafter(path: Path, variables: dict, spec: Spec, extra: dict) -> None:
    """Export trained variables to a new directory without the LM head (the target's, shared, which the
    loaders put back: "head": "shared") unless the drafter trained its own, with `extra` facts (training
    provenance) in its JSON: `store.save` of the spec's kind (psm.json, eagle3.json)."""
    kind = registry.of_config(spec)
    if not kind.training.trains_head(spec):
        variables = {**variables, "params": {k: v for k, v in variables["params"].items() if k != "lm_head"}}
        extra = dict(extra, head="shared")
    store.save(kind, path, variables, spec, extra)


def read_run(out: Path) -> dict:
    """out/run.json: the run's identity, config and commands; refused when it does not parse or lacks them."""
    run = read_json(out / "run.json", RUN_JSON_DAMAGED)
    if not isinstance(run, dict) or not {"identity", "config"} <= run.keys():
        raise ValueError(f"{out / 'run.json'} lacks the run's identity and config: {RUN_JSON_DAMAGED}")
    return run


def export_step(value: str, ckpts: Checkpoints, out: Path) -> int:
    """--export's STEP: "last" or one of the kept checkpoints' steps."""
    kept = ckpts.all_steps()
    if not kept:
        raise FileNotFoundError(f"--export: no checkpoint in {out / 'ckpt'}")
    if value == "last":
        return kept[-1]
    if not value.isdigit() or int(value) not in kept:
        raise ValueError(f"--export {value}: no such checkpoint in {out / 'ckpt'} (kept: {kept})")
    return int(value)


def export(final: Path, variables, spec: Spec, tc: TrainConfig, config: dict, mesh: str, step: int, positions: int,
           wall_s: float, target_weights: str, warm_start: dict | None = None, recipe: dict | None = None) -> None:
    """Write the drafter of `variables` (bf16, the target's head not stored) to `final`, with what trained it
    (config: the resolved config run.json holds; recipe: the recipe file and overrides it was resolved from;
    what it started from: `warm_start`, with its weights' digest) and the fingerprint of the target's
    weights (`Model.weights_fingerprint`), which loading it checks."""
    variables = jax.tree.map(lambda t: t.astype(jnp.bfloat16) if jnp.issubdtype(t.dtype, jnp.floating) else t,
                             variables)
    if distributed.is_leader() and final.exists():
        shutil.rmtree(final)
    distributed.barrier("drafter export")  # no process looks for the directory before it is gone
    trained = dict(method=tc.drafter.method, steps=step, positions=positions, wall_s=round(wall_s, 1), mesh=mesh,
                   backend=jax.default_backend(), config=config)
    if recipe:
        trained.update(recipe=recipe)
    t = registry.of_config(spec).training
    trained.update(t.trained(tc.drafter))  # the kind's own settings: an EAGLE-3 drafter's ttt_steps
    if warm_start:
        trained.update(warm_start=warm_start)
    save_drafter(final, variables, spec, dict(trained=trained, target_weights=target_weights))
    log.info("%s", t.exported(final, spec, step, tc.drafter))
