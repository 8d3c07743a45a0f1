"""The drafters by name: those with a network (`KINDS`: the PSM, EAGLE-3 and PPSD), and what the SPD engine
can run (`ENGINE_DRAFTERS`: the staged kinds, none, the test oracle); and how a call's `DrafterRef`
becomes weights to run (`source`, `resolve`), the same way for every kind. Adding a drafter: its own
module defines a `DrafterKind` (with its `Training`, what train/ asks of it); list it here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from spd_jax.convert.defaults import canonical_name
from spd_jax.drafters import eagle3, ppsd, psm, store
from spd_jax.drafters.kind import DrafterKind, DrafterRef, Form

log = logging.getLogger(__name__)

KINDS: dict[str, DrafterKind] = {k.name: k for k in (psm.KIND, eagle3.KIND, ppsd.KIND)}
PSM, EAGLE3, PPSD = psm.KIND, eagle3.KIND, ppsd.KIND

# The SPD engine's drafters by name (a pipelined method's `drafter` option): each staged kind's network
# (`DrafterKind.spd_drafter`), none (the plain pipeline: one token in flight) and the oracle (tests: it
# proposes given reference tokens)
NO_DRAFTER, ORACLE = "none", "oracle"
ENGINE_DRAFTERS = (*(k.name for k in KINDS.values() if k.staged), NO_DRAFTER, ORACLE)

SLOT = "drafters"  # `model.placements`' slot of the loaded drafters (each kept, on the default device)

_random_noted: set[str] = set()  # kinds whose random-drafter notice this process has given


def kind(name: str) -> DrafterKind:
    """The drafter kind of a name, or a ValueError listing them."""
    if name not in KINDS:
        raise ValueError(f"unknown drafter {name!r}: one of {', '.join(KINDS)}")
    return KINDS[name]


def engine_drafter(name: str) -> DrafterKind | None:
    """An SPD engine drafter's name -> its kind (a network), or None ("none", "oracle"); a ValueError for
    another name."""
    if name not in ENGINE_DRAFTERS:
        raise ValueError(f"unknown drafter {name!r} for the pipelined methods: one of {', '.join(ENGINE_DRAFTERS)} "
                         "(\"oracle\" for tests, with oracle_tokens); EAGLE-3 is not a drafter here but a method: "
                         "method=\"eagle3\"")
    return KINDS.get(name)


def of_config(config: Any) -> DrafterKind:
    """The kind whose config class config is (what a training run's spec is a kind of)."""
    for k in KINDS.values():
        if type(config) is k.config:
            return k
    raise TypeError(f"{type(config).__name__} is no drafter kind's config (one of "
                    f"{', '.join(k.config.__name__ for k in KINDS.values())})")


def of_checkpoint(path: str | Path) -> DrafterKind:
    """The kind whose identity file a checkpoint directory holds."""
    for k in KINDS.values():
        if (Path(path) / k.identity_file).is_file():
            return k
    raise FileNotFoundError(f"{path} is not a drafter checkpoint (no {' or '.join(store.META_NAMES)})")


class Source(NamedTuple):
    """What a reference runs, found without loading weights: a checkpoint path (trained or shipped), the
    given reference (in memory), or None (a random drafter), and why a random one."""

    found: Any
    why: str


def source(k: DrafterKind, model, ref: Any, plan=None) -> Source:
    """ref (a `DrafterRef`, or a form `DrafterRef.of` takes) -> its `Source` for model (and the stage plan,
    for a drafter tied to one). Shipped: the one shipped for model's default name (and plan.n), unless
    none ships, it was trained for another plan, or for other weights under that name (an original HF
    checkout rather than the embedded GGUF): then a random one. Loads nothing (`infer.evaluate` asks
    which checkpoint a row will use before running it)."""
    ref = DrafterRef.of(ref)
    if ref.form is Form.RANDOM:
        return Source(None, k.why_random)
    if ref.form is Form.TRAINED:
        return Source(ref.path, "")
    if ref.form is Form.GIVEN:
        return Source(ref, "")
    found = k.shipped(canonical_name(model.path.name), plan)
    if found is None:
        return Source(None, f"no {k.label} checkpoint given ({k.flag}) and none ships for this model"
                      + (" at this n" if plan is not None else ""))
    misfit = k.misfit(store.read_spec(k, found), plan)
    if misfit is not None:
        return Source(None, misfit)
    want = json.loads((found / k.identity_file).read_text()).get(store.TARGET_WEIGHTS)
    if want is not None and want != model.weights_fingerprint:
        return Source(None, f"the {k.label} shipped for this model's name{f' at n={plan.n}' if plan else ''} was "
                      f"trained on other weights (target fingerprint {want}, these {model.weights_fingerprint}: e.g. "
                      "the embedded GGUF's against another checkpoint of the model)")
    return Source(found, "")


def is_checkpoint(label: str | None) -> bool:
    """Whether a `Resolved.label` (as stats record it) names a checkpoint directory, not a random or given
    drafter (or none)."""
    return label is not None and label not in (Form.RANDOM.value, Form.GIVEN.value)


class Resolved(NamedTuple):
    config: Any  # the kind's config
    variables: dict  # in the model's dtype (integer leaves, e.g. a draft vocabulary's ids, as they are)
    label: str  # "random", "given" or the checkpoint path: what stats record


def keep_placed(model, variables: dict, placed: dict) -> None:
    """The drafter `resolve` keeps in `model.placements` as `variables` is kept as `placed` from now on: the same
    values placed on an engine's mesh, so a process holds one copy, not the unplaced one beside it (a
    replicated placement over processes copies through the host; Qwen3.5-4B's PSM is 0.63 GB a process). In
    the layout the engine reads (`SpdDrafter.engine_params`: a PSM's layers one buffer each), so a later
    `resolve` on this model returns that layout: the engine's own calls accept it (`engine_params` leaves it
    as it is); a consumer of the stacked layout (`infer.replay`'s teacher-forced drafts) loads its own model."""
    kept = model.placements.entries(SLOT)
    for key, value in list(kept.items()):
        if value is variables:
            kept[key] = placed
        elif isinstance(value, tuple) and value[-1] is variables:
            kept[key] = (*value[:-1], placed)


def resolve(k: DrafterKind, model, ref: Any, plan=None, random_layers: int = 2, method: str = "") -> Resolved:
    """ref -> the drafter to run, loaded (once per model: `model.placements` keeps it) and checked against
    model and plan. A random one (seed 0: the drafter is a model, not sampling randomness) is announced
    once per process and kind, naming `method` and why."""
    found, why = source(k, model, ref, plan)
    counts = plan.counts if plan is not None else None
    if found is None:
        spec = k.random_config(model.config, plan, random_layers)
        if k.name not in _random_noted:  # once per process, not once per call
            _random_noted.add(k.name)
            log.warning(f"{method}: {why}; using a randomly initialised {k.noun}. Output is still exactly the "
                        "target's, but few drafts will be accepted.")
        variables = model.placements.get(SLOT, (k.name, "random", spec),
                                         lambda: k.init(model.config, spec, model.params, 0, model.dtype))
        return Resolved(spec, variables, Form.RANDOM.value)
    if isinstance(found, DrafterRef):  # given in memory: checked and cast, not kept
        k.check(found.config, model.config, "(given)", counts)
        # the engines mix the drafter's activations with the target's: one dtype, as a loaded one gets
        cast = lambda a: a.astype(model.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        return Resolved(found.config, jax.tree.map(cast, found.variables), Form.GIVEN.value)
    spec, variables = model.placements.get(SLOT, (k.name, str(Path(found).absolute()), counts), lambda: store.load(
        k, found, model.config, model.params, model.dtype, plan=counts, weights=model.weights_fingerprint,
        model_name=str(model.path)))
    return Resolved(spec, variables, str(found))
