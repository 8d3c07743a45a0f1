"""What a drafter with a network is to the rest of the library (`DrafterKind`), what training asks of it
(`Training`), and which weights of it a call runs (`DrafterRef`). Each drafter's own module defines its
kind; `drafters.registry` lists them and resolves references; `drafters.store` reads and writes their
checkpoints through the kind; train/ trains them through `DrafterKind.training`. Nothing here imports JAX
or a drafter."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Callable


# Every kind's identity file, in the order the kinds were made: what marks a directory as a drafter
# checkpoint (`store.content_id`), so a new kind needs no change there.
IDENTITY_FILES: list[str] = []


@dataclasses.dataclass(frozen=True)
class Training:
    """What training (train/) asks of a drafter kind, so that it never branches on which drafter it trains.
    `d` below is train's `DrafterConfig` section (duck-typed: this module imports nothing of train), `spec`
    the kind's config, `model` a loaded `spd_jax.Model`."""

    export_dir: str  # the run directory's subdirectory its trained drafter is exported to: "psm", "drafter"
    metric: str  # the quick eval's headline figure (a key of `eval_summary`'s dict): "S0", "tokens_per_round"
    # (cfg, plan, d) -> the config a run trains for the target cfg; plan: the stage plan `infer.generate`
    # makes for a `staged` kind (it is trained for one), None for the others
    config: Callable[[Any, Any, Any], Any]
    # (trainable, frozen, target, batch, keys, *, cfg, spec, tau, **loss_options(d)) -> (loss sum, metric
    # sums): the step's loss (`train.step.make_step` says what the sums hold)
    loss: Callable[..., tuple]
    loss_options: Callable[[Any], dict]  # d -> the loss's own keyword options (beyond cfg, spec, tau)
    axes: Callable[[Any, Any], dict]  # (cfg, spec) -> its variables with each leaf's logical axes
    # (model, spec, init_from, log) -> the variables exported at init_from (float32) for a warm start of a run
    # training spec: refused (ValueError, naming the setting to change) when their shapes do not fit spec;
    # a fit that is only a warm start (trained for another plan) is noted with log.warning
    warm_start: Callable[..., dict]
    # (spec, variables, d) -> the quick eval's options of the method that runs this kind (`methods.of_drafter`:
    # fields of its options object, e.g. n, stage_layers, spec)
    eval_options: Callable[[Any, dict, Any], dict]
    # (spec, tokens, steps, d) -> the quick eval's figures, pooled over its prompts; steps: the method's
    # target steps (`Method.steps`: SPD's cycles, the chain's rounds)
    eval_summary: Callable[[Any, int, int, Any], dict]
    describe: Callable[[str, Any, Any], str]  # (model name, spec, d) -> what a run trains, for its first log line
    exported: Callable[[Any, Any, int, Any], str]  # (directory, spec, step, d) -> the export's log line (how to run it)
    init_options: Callable[[Any], dict] = lambda d: {}  # d -> `DrafterKind.init`'s keyword options for a new run
    identity: Callable[[Any], dict] = lambda d: {}  # d -> settings the resume identity holds beside the spec
    trained: Callable[[Any], dict] = lambda d: {}  # d -> settings the export's "trained" record adds
    # a spec a run recorded in its identity (JSON) -> as this version writes it: the fields added since with
    # their defaults, so an older run still resumes
    recorded_spec: Callable[[dict], dict] = lambda s: s
    # spec -> whether the drafter's LM head trains with it (its own, exported with it) rather than being the
    # target's, shared and frozen (`drafters.base.split_params`)
    trains_head: Callable[[Any], bool] = lambda spec: False


@dataclasses.dataclass(eq=False, repr=False)
class DrafterKind:
    """One drafter with a network (the PSM, EAGLE-3): everything the registry, the store and the
    methods ask of it. Identity by object (a kind is a singleton in its module)."""

    name: str  # the registry key, as training's `method:` names it
    label: str  # how messages name it: "PSM", "EAGLE-3"
    a_label: str  # with its article: "a PSM", "an EAGLE-3"
    noun: str  # what a random one is called in notices and save errors: "PSM", "EAGLE-3 drafter"
    identity_file: str  # the JSON beside its weights: "psm.json"
    config: type  # its frozen config dataclass (hashable: a static argument)
    error: type[ValueError]  # raised for a checkpoint that does not belong to the target
    shipped_dir: Path  # where trained ones ship inside the package
    to_json: Callable[[Any], dict]  # config -> identity file content (format and kind included)
    from_json: Callable[[dict, str], Any]  # (identity, where) -> config, refusing another format
    # (cfg, config, target_params, seed=0, dtype=float32, vocab_ids=None) -> variables, the head the target's
    init: Callable[..., dict]
    # (config, cfg, where, plan=None, expect=None) -> None: refuse a config for another target / plan /
    # anchors or feature layers (expect)
    check: Callable[..., None]
    random_config: Callable[..., Any]  # (cfg, plan, num_layers) -> the config of a random one for this target
    shipped: Callable[[str | None, Any], Path | None]  # (default model name, plan) -> a shipped checkpoint
    misfit: Callable[[Any, Any], str | None]  # (config, plan) -> why a shipped config does not fit, or None
    # (cfg, config, context, param_bytes=2, cache_bytes=None, rows=None) -> [LayerCost] of one draft
    # (`spd_jax.models.costs`): weights and activations of param_bytes, cache elements of cache_bytes (None:
    # param_bytes), over `rows` rows (None: one draft's own, e.g. a PSM's full pipeline of n + 1). The one
    # count of the drafter's costs: the cost model (`spd_jax.costs.cycle`) reads it
    cost: Callable[..., list]
    # (cfg, config) -> the weights it holds of its own: every param its module declares but the LM head, and
    # the head where it is its own (a draft vocabulary's rows, a head it trains), counted from the module's
    # declared shapes (`drafters.shared.param_count`). The one count of its weights: the memory model reads it
    params: Callable[[Any, Any], int]
    flag: str  # the CLI flag (infer.generate) that names a checkpoint of it
    train_fix: str  # how to get one for a model ({model}): the fix a refusal names
    training: Training  # what train/ asks of it
    missing_hint: str = ""  # appended when a directory has no identity file
    why_random: str = "an untrained one was asked for"  # a random one on request, in the notice
    # drafts inside the pipeline for one stage plan (the PSM, PPSD): trained at a depth n from the target's
    # anchor states (a hard-label loss term, a teacher cache), run by the SPD engine on n stage devices
    staged: bool = False
    random_flag: str = ""  # how a CLI asks for an untrained one, where none ships ("--random-psm")
    # a staged kind: (cfg, config, variables, target_params, tokens [B, T], at [B, R]) -> (the target's greedy
    # token after each position at [B, R], the drafter's greedy drafts [B, R, n] for position at + 1 made with
    # at the newest token and k = 1..n tokens in flight), teacher-forced: what `decode.schedule` replays into
    # the engine's greedy counts (`infer.replay`)
    teacher_drafts: Callable[..., tuple] | None = None
    # a staged kind: (cfg, config) -> its `SpdDrafter`, what the SPD engine runs (`decode.pipelined`)
    spd_drafter: Callable[[Any, Any], Any] | None = None

    def __post_init__(self):
        if self.identity_file not in IDENTITY_FILES:
            IDENTITY_FILES.append(self.identity_file)

    def __repr__(self) -> str:
        return f"DrafterKind({self.name!r})"


class Form(enum.Enum):
    TRAINED = "trained"  # a checkpoint directory
    SHIPPED = "shipped"  # the one shipped for this default model (and plan), else a random one
    RANDOM = "random"  # untrained, seed 0 (the drafter is a model, not sampling randomness)
    GIVEN = "given"  # (config, variables) in memory


@dataclasses.dataclass(frozen=True)
class DrafterRef:
    """Which weights of a drafter to run. Build with `trained(path)`, `shipped()`, `random()`,
    `given(config, variables)`, or `of(value)` from the API's older argument forms."""

    form: Form
    path: str | Path | None = None
    config: Any = None
    variables: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def trained(cls, path: str | Path) -> "DrafterRef":
        return cls(Form.TRAINED, path)  # as given: its label (str(path)) is what stats record

    @classmethod
    def shipped(cls) -> "DrafterRef":
        return cls(Form.SHIPPED)

    @classmethod
    def random(cls) -> "DrafterRef":
        return cls(Form.RANDOM)

    @classmethod
    def given(cls, config: Any, variables: Any) -> "DrafterRef":
        return cls(Form.GIVEN, config=config, variables=variables)

    @classmethod
    def of(cls, value: Any) -> "DrafterRef":
        """A `DrafterRef` as it is; None -> shipped; "random" -> random; a path -> trained; a
        (config, variables) pair -> given."""
        if isinstance(value, DrafterRef):
            return value
        if value is None:
            return cls.shipped()
        if isinstance(value, str) and value == Form.RANDOM.value:
            return cls.random()
        if isinstance(value, (str, Path)):
            return cls.trained(value)
        if isinstance(value, tuple) and len(value) == 2:
            return cls.given(*value)
        raise TypeError(f"a drafter is a checkpoint path, None (the shipped one), \"random\" or (config, variables); "
                        f"got {type(value).__name__}")
