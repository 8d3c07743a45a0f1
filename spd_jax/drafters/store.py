"""All drafter checkpoint I/O. A drafter checkpoint: its variables (orbax) and its identity (JSON, the
kind's `identity_file`) in a new directory, written once per job (every process takes part in the orbax
save; process 0 alone writes the JSON), and read back onto this process's first device (`save`,
`read_spec`, `load`, each given the drafter's `DrafterKind`). Also the two fingerprints that tie a
drafter to what it belongs to: `target_weights` (the target model's weights, recorded in the JSON,
checked on load) and `content_id` (the checkpoint's own content, recorded in `infer.evaluate`'s rows).
Nothing here knows a drafter's layout: the kind says it."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax import distributed
from spd_jax.config import ModelConfig, read_json
from spd_jax.drafters.kind import IDENTITY_FILES, DrafterKind
from spd_jax.drafters.shared import check_vocab_ids
from spd_jax.models import decoder


def _orbax():
    """orbax.checkpoint, imported on first use rather than at the top: it costs about a second, and most
    runs (ar, tp, a random drafter, every `import spd_jax`) never read or write a checkpoint."""
    import orbax.checkpoint as ocp

    return ocp


def save_drafter(path: str | Path, variables: dict, meta_name: str, meta: dict, what: str,
                 target_weights: str | None = None) -> None:
    """variables -> path/params (orbax), meta (plus TARGET_WEIGHTS: target_weights when given, over one in
    meta) -> path/meta_name. path must not exist (never overwrite a checkpoint); what names the drafter in
    that error."""
    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} exists; save the {what} to a new directory")
    ocp = _orbax()
    distributed.barrier(f"save {what}")  # in a multi-process job: every process checked before any writes
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", variables)
    ckptr.wait_until_finished()
    if distributed.is_leader():
        meta = dict(meta, **({TARGET_WEIGHTS: target_weights} if target_weights else {}))
        (path / meta_name).write_text(json.dumps(meta, indent=1))


_QUIET = False


def quiet_abandoned_reads() -> None:
    """Before an orbax restore: if it fails, the reads it left in flight report "Event loop is closed" once
    its event loop has gone (an unraisable exception, printed as a traceback beside the real error, and
    possibly before the caller catches it); this process drops that one report from then on."""
    global _QUIET
    if not _QUIET:
        _QUIET, default = True, sys.unraisablehook

        def hook(u):
            if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
                default(u)

        sys.unraisablehook = hook


def orbax_failure(e: Exception) -> str:
    """What orbax said of a checkpoint it could not read: the first line of its error (the rest is a
    TensorStore spec)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].split(" See full TensorStore")[0][:200]


# What restores a damaged drafter checkpoint (an identity file that does not parse, weights that do not read)
DAMAGED = "copy the checkpoint directory again from where it came, or write it again with train.main --export"


def read_identity(path: Path, meta_name: str, parse, error: type[Exception], missing: str):
    """A drafter directory's identity file (meta_name) -> parse(its JSON, str(path)). Absent:
    FileNotFoundError(missing); not JSON: ConfigError; a key missing or of another type: error(...), each
    naming the file and how to restore it."""
    meta = path / meta_name
    if not meta.is_file():
        raise FileNotFoundError(missing)
    d = read_json(meta, DAMAGED)
    try:
        return parse(d, str(path))
    except error:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise error(f"{meta} is not a whole drafter identity ({type(e).__name__}: {e}): {DAMAGED}") from None


def restore_variables(path: str | Path, abstract: dict) -> dict:
    """path/params (orbax) -> variables of `abstract`'s shapes and dtypes, on this process's first device,
    whatever mesh the trainer saved from (an 8x1 data-parallel run restores on a laptop); the engines place
    them from there. Weights that are missing, cut short or of other shapes than the identity file says
    raise ValueError naming the directory (orbax's own errors name neither it nor a fix)."""
    params = Path(path) / "params"
    if not params.is_dir():
        raise FileNotFoundError(f"{path} has an identity file but no params/ (its weights): {DAMAGED}")
    ocp = _orbax()
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), abstract)
    quiet_abandoned_reads()
    try:
        with ocp.StandardCheckpointer() as ckptr:  # closed on failure too
            return ckptr.restore(params, abstract)
    except Exception as e:  # noqa: BLE001 -- orbax raises bare Exception for a damaged file
        raise ValueError(f"the weights in {params} do not read as the drafter its identity file describes "
                         f"({orbax_failure(e)}): the checkpoint is damaged or its files are mixed up; {DAMAGED}") from e


# ---------------------------------------------------------------- identities

# The json key (psm.json, eagle3.json) holding the fingerprint of the target weights a drafter was trained
# for (`target_weights`). The architecture signature ("target") alone lets a drafter for one model load on
# another of the same shape (its base model, a fine-tune); this refuses those.
TARGET_WEIGHTS = "target_weights"
META_NAMES = IDENTITY_FILES  # a drafter directory's identity file, one of these (psm.json, eagle3.json)


def target_weights(params: dict) -> str:
    """A target's weights -> a short fingerprint: the first 16 hex digits of sha256 over its token-embedding
    table [V, H] cast to bfloat16 (row-major bytes). Cast first so float32 and bfloat16 loads of one
    checkpoint agree (a bfloat16 load rounds as this cast does); two models of one architecture differ
    unless their embeddings are equal to bfloat16 precision. Reads the table to the host once (V * H * 2
    bytes); `Model.weights_fingerprint` keeps the result."""
    table = distributed.to_host(jnp.asarray(params["embed"]).astype(jnp.bfloat16))  # [V, H]
    return hashlib.sha256(table.tobytes(order="C")).hexdigest()[:16]


def check_target_weights(meta: dict, have: str, where: str, model: str, what: str, fix: str, error) -> None:
    """Refuse a drafter whose json (meta) records target weights other than `have` (this model's
    `target_weights`), raising error(...) with both fingerprints, the model and fix (how to get a drafter
    for it). A drafter saved before the field existed loads with a warning: it is not checked."""
    want = meta.get(TARGET_WEIGHTS)
    if want is None:
        logging.getLogger(__name__).warning(
            "%s checkpoint %s does not record the target weights it was trained for (no %r in its json: saved "
            "before that check); it is not checked against %s (fingerprint %s)", what, where, TARGET_WEIGHTS,
            model, have)
        return
    if want != have:
        raise error(f"{what} checkpoint {where} was trained for another model of the same architecture: its target "
                    f"weights have fingerprint {want}, those of {model} {have} (a base model and its fine-tune, or "
                    f"another training of the same shape, differ so); {fix}")


def content_id(path: str | Path) -> str:
    """A drafter directory -> the first 16 hex digits of sha256 over what it is: its identity json
    (psm.json or eagle3.json, canonicalised: key order and whitespace do not count) and every file under
    params/ (relative path and bytes, in path order). Another drafter written to the same path (a PSM
    shipped over an older one) gets another id; CARD.md, curves and lineage.json beside them do not count.
    Reads the whole checkpoint (tens of MB for the shipped drafters)."""
    path = Path(path)
    meta = next((path / m for m in META_NAMES if (path / m).is_file()), None)
    if meta is None:
        raise FileNotFoundError(f"{path} is not a drafter checkpoint (no {' or '.join(META_NAMES)})")
    h = hashlib.sha256()
    h.update(meta.name.encode() + b"\0" + json.dumps(json.loads(meta.read_text()), sort_keys=True).encode() + b"\0")
    params = path / "params"
    for f in sorted(p for p in params.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(params).as_posix()}\0{f.stat().st_size}\0".encode())  # name, length: unambiguous
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- a kind's checkpoints


def save(kind: DrafterKind, path: str | Path, variables: dict, spec: Any, extra: dict | None = None,
         target_weights: str | None = None) -> None:
    """Write variables (orbax) and the spec (the kind's identity file, plus `extra` facts such as training
    provenance; "head": "shared" when variables lack the LM head) to a new directory `path`.
    target_weights: the target's `target_weights` fingerprint (also accepted in extra), recorded so that
    `load` refuses the drafter for another model of the same architecture; without it the drafter loads
    anywhere its architecture fits, with a warning."""
    save_drafter(path, variables, kind.identity_file, dict(kind.to_json(spec), **(extra or {})), kind.noun,
                 target_weights)


def read_spec(kind: DrafterKind, path: str | Path) -> Any:
    """A checkpoint directory -> the kind's config, from its identity file."""
    path = Path(path).absolute()
    return read_identity(path, kind.identity_file, kind.from_json, kind.error,
                         f"{path} is not {kind.a_label} checkpoint (no {kind.identity_file}){kind.missing_hint}")


def load(kind: DrafterKind, path: str | Path, cfg: ModelConfig, target_params: dict, dtype=jnp.float32, *,
         plan: Sequence[int] | None = None, expect: Sequence[int] | None = None, weights: str | None = None,
         model_name: str | None = None) -> tuple[Any, dict]:
    """Load a drafter saved by `save` -> (config, variables, floats in dtype), refusing one trained for
    another target (another architecture, or other weights: the identity's target_weights against
    weights, the target's `target_weights` fingerprint, computed from target_params when not given;
    model_name names the target in that error), another stage plan or other anchors / feature layers
    (expect), as the kind's `check` says. One saved without its LM head ("head": "shared") gets the
    target's (its draft vocabulary's rows of it), frozen in training."""
    path = Path(path).absolute()
    spec = read_spec(kind, path)
    kind.check(spec, cfg, str(path), plan, expect)
    model = model_name or "this model"
    check_target_weights(json.loads((path / kind.identity_file).read_text()),
                         weights or target_weights(target_params), str(path), model, kind.label,
                         kind.train_fix.format(model=model), kind.error)
    return spec, restore(kind, path, spec, cfg, target_params, dtype)


def abstract_variables(kind: DrafterKind, spec: Any, cfg: ModelConfig) -> dict:
    """The shapes and dtypes (float32, ids int32) of the variables of a drafter of spec for the target cfg. The
    kind's init is only traced (the target's zeros inside the trace: nothing vocabulary-sized is allocated)."""
    def shapes():
        zeros = {"embed": jnp.zeros((cfg.vocab_size, cfg.hidden_size)), "final_norm": jnp.zeros((cfg.hidden_size,))}
        if not cfg.tie_word_embeddings:
            zeros["lm_head"] = zeros["embed"]
        return kind.init(cfg, spec, zeros, vocab_ids=np.arange(spec.draft_vocab))

    return jax.eval_shape(shapes)


def restore(kind: DrafterKind, path: Path, spec: Any, cfg: ModelConfig, target_params: dict, dtype: Any) -> dict:
    """A saved drafter's variables, floats cast to dtype, token ids left integers."""
    shared = json.loads((path / kind.identity_file).read_text()).get("head") == "shared"
    abstract = abstract_variables(kind, spec, cfg)
    if shared:
        del abstract["params"]["lm_head"]
    variables = restore_variables(path, abstract)
    if spec.draft_vocab:
        check_vocab_ids(variables["vocab"]["ids"], spec, cfg)
    if shared:
        head = decoder.lm_head(target_params, cfg)
        variables["params"]["lm_head"] = head[variables["vocab"]["ids"]] if spec.draft_vocab else head
    return jax.tree.map(lambda t: jnp.asarray(t, dtype if jnp.issubdtype(t.dtype, jnp.floating) else t.dtype),
                        variables)
