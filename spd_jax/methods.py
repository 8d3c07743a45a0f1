"""Decoding methods as typed options objects: `AR()`, `TP(n=2)`, `Pipeline(n=8)`, `SPD(n=8, psm_placement="auto")`,
`PPSD(n=8)` and `EAGLE3(k=3)`, each a small frozen dataclass whose fields are its options (checked when it is
made) and whose class holds its compile cache (as gemma's sampler and MaxText's engine interface keep
decoding apart from the network). `api.generate` takes one (or a name in `METHODS`: that method's
defaults), validates the request and runs it: the method runs a checked `Request` on a loaded model and
returns (token ids, stats). What differs between methods (devices, streaming, the drafter it takes, how a
CLI loads the model for it, a one-line summary of its stats) is said here, so callers never compare
method names.

The loops live in `spd_jax.decode`, which receive the options object as it is; the drafters in
`spd_jax.drafters`. This module does no request validation beyond each method's own options.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.decode import ar
from spd_jax.decode.chain import generate_chain
from spd_jax.decode.compile_cache import CompileCache, cache_events, compile_source
from spd_jax.decode.pipelined import generate_pipelined, plan_for
from spd_jax.decode.sampling import Sampling
from spd_jax.drafters import registry
from spd_jax.drafters.eagle3 import Eagle3Drafter, drafter_params
from spd_jax.drafters.kind import DrafterKind
from spd_jax.models import decoder, schema
from spd_jax.sharding import (STAGE_RULES, STAGE_TP_RULES, TP_RULES, Placement, Rules, model_mesh, put,
                              stage_mesh, stage_model_mesh)


class Request(NamedTuple):
    """One checked generation request (`api.generate` checks it)."""

    prompt: np.ndarray  # int64 [P] token ids
    max_new_tokens: int
    sp: Sampling
    stop_at_eos: bool = True
    stream: Callable[[int], None] | None = None


def _positive(name: str, v, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} ({what}) must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method and its options (a subclass's dataclass fields). Subclasses set `name` and `run`;
    each class has its own compile cache (`compiled`), shared by all its option values."""

    name: ClassVar[str]
    compiled: ClassVar[CompileCache]  # its executables, keyed by shapes and compile-time switches
    streams: ClassVar[bool] = False  # calls `stream` with each token as it commits
    multi_process: ClassVar[bool] = False  # runs over devices that may span processes (--processes)
    drafter_kind: ClassVar[DrafterKind | None] = None  # the network drafter it runs
    random_drafter_on_request: ClassVar[bool] = False  # a CLI runs a random drafter only when asked for it
    baseline: ClassVar[bool] = False  # the one-device autoregressive reference the others are compared with
    label_key: ClassVar[str | None] = None  # the stats key naming its drafter's weights (`registry.Resolved.label`)
    one_device: ClassVar[bool] = True  # runs on one device whatever its options (its rows have n = 1)
    staged: ClassVar[bool] = False  # runs over n pipeline stages (a stage plan the model must split into)
    chain: ClassVar[bool] = False  # k drafts per round, verified by one target pass (its steps are rounds)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.compiled = CompileCache()

    @classmethod
    def taking(cls, **given) -> "Method":
        """This method with those of given's options it takes (its fields; others ignored: a CLI passes every
        flag it has to whichever method it runs)."""
        return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})

    def devices(self) -> int:
        """How many devices a run uses."""
        return 1

    def load_placement(self, processes: bool) -> tuple[Any, Rules] | None:
        """(mesh, rules) a CLI loads the model with for this method (`api.load_model`), or None: whole."""
        return None

    def drafter_source(self, model) -> registry.Source | None:
        """Which drafter checkpoint a run would use, without loading it (None: no network drafter)."""
        return None

    def drafter_ref(self) -> Any:
        """The drafter this names, as given (a `DrafterRef` or its older forms; None: the shipped one, or no
        network drafter)."""
        return None

    def run(self, model, req: Request) -> tuple[list[int], dict]:
        raise NotImplementedError

    def steps(self, stats: dict) -> int:
        """The target steps a run took (tokens / steps: SPD's alpha, the chain's tokens per round)."""
        return stats["tokens"]

    def summary(self, stats: dict) -> str:
        """The stats a CLI prints after a run, in one line."""
        return f"decode {stats['decode_tokens_per_s']:.1f} tok/s on {stats['devices']} device(s)"


# ---------------------------------------------------------------- ar, tp


@dataclasses.dataclass(frozen=True)
class AR(Method):
    """Plain autoregressive decoding on one device: prefill and the decode loop, two programs on device."""

    name = "ar"
    streams = True
    baseline = True

    def placed(self, model) -> tuple[dict, dict, Placement | None]:
        """-> (params, per-layer decode copy, placement)."""
        return model.params, decode_layers(model), None

    def run(self, model, req: Request) -> tuple[list[int], dict]:
        cfg, sp, stream, P = model.config, req.sp, req.stream, int(req.prompt.size)
        max_new_tokens = req.max_new_tokens
        p_pad = ar.round_up(P, ar.PROMPT_BUCKET)
        cache_len = ar.round_up(max(P + max_new_tokens, p_pad), ar.CACHE_BUCKET)
        out_len = ar.round_up(max_new_tokens, ar.OUT_BUCKET)
        prompt_arr = jnp.zeros((1, p_pad), jnp.int32).at[0, :P].set(jnp.asarray(req.prompt, jnp.int32))
        eos = np.asarray(model.eos_token_ids if req.stop_at_eos else (), np.int32)
        eos_arr = jnp.asarray(eos if eos.size else np.array([-1], np.int32))
        rt = sp.runtime()
        statics = dict(cfg=cfg, greedy=sp.greedy, filtered=sp.filtered)
        plen = jnp.int32(P)
        model._require_layers(f"method={self.name!r}")
        params, layers, placement = self.placed(model)
        head = decoder.head_params(params)

        pre_args = (params, prompt_arr, plen, rt)
        pre_statics = dict(statics, cache_len=cache_len, placement=placement)
        events = cache_events()
        pre, c1 = self.compiled.get(("prefill", p_pad, cache_len, model.dtype, placement, *statics.items()),
                                    lambda: ar.prefill.lower(*pre_args, **pre_statics))
        loop_statics = dict(statics, out_len=out_len, stream=stream is not None)
        loop_key = ("loop", cache_len, eos_arr.shape, model.dtype, placement, *loop_statics.items())
        # Shapes only, for lowering: the real caches come out of prefill (donated into the loop), placed as
        # prefill places them (else the loop may choose another split of a cache prefill left whole)
        caches = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              jax.eval_shape(lambda: decoder.split_cache(decoder.init_cache(cfg, 1, cache_len,
                                                                                            model.dtype), cfg)),
                              pre.output_shardings[1])
        loop_args = (layers, head, jnp.int32(0), plen, caches, jnp.int32(max_new_tokens), eos_arr, rt)
        loop, c2 = self.compiled.get(loop_key, lambda: ar.decode_loop.lower(*loop_args, **loop_statics))
        compile_from = compile_source(events, c1 + c2)  # now: the run's own eager ops also touch the cache

        t0 = time.perf_counter()
        first, caches = pre(*pre_args)
        first.block_until_ready()
        t1 = time.perf_counter()
        if stream is not None:
            ar.set_stream_sink(lambda tok, i: stream(tok))
        try:
            out, count, _ = loop(layers, head, first, plen, caches, jnp.int32(max_new_tokens), eos_arr, rt)
            count = int(count)  # waits for the loop
            tokens = np.asarray(out[:count]).tolist()
        finally:
            ar.set_stream_sink(None)
        t2 = time.perf_counter()

        decode_s = t2 - t1
        multi = placement is not None and jax.process_count() > 1
        stats = dict(
            method=self.name, tokens=count, prompt_tokens=P,
            prefill_s=t1 - t0, decode_s=decode_s, wall_s=t2 - t0,
            tokens_per_s=count / (t2 - t0),
            decode_tokens_per_s=(count - 1) / decode_s if count > 1 else float("nan"),
            compile_s=c1 + c2, compile_from=compile_from,
            stopped_at_eos=bool(count and tokens[-1] in set(eos.tolist())),
            backend=jax.default_backend(), devices=placement.mesh.size if placement else 1,
            processes=jax.process_count() if placement else 1,
            timing_includes=("device compute, host dispatch and the device-to-host copy of the result"
                             + (", and the all-reduces after every attention-out and MLP-down projection and "
                                "across the vocabulary shards" if placement else "")
                             + (f" (across {jax.process_count()} processes)" if multi else "")
                             + (", plus one host callback per token for streaming" if stream else "")
                             + "; excludes compilation (compile_s, ahead of time, cached per shape bucket). "
                               "decode_tokens_per_s counts tokens after the first over the decode loop alone"),
        )
        return tokens, stats


def decode_layers(model) -> dict:
    """The model's layers as the decode loops read them (`decoder.decode_layers`), made once per model
    (`model.placements`' slot "host": kept)."""
    return model.placements.get("host", "decode_layers",
                                lambda: decoder.decode_layers(model.params["layers"], model.config))


def tp_runtime(model, n: int):
    """Params placed for n-way tensor parallelism (`sharding.TP_RULES`), their per-layer decode copy
    and the placement -> (params, layers, placement). Params loaded with that placement are used as
    they are; others are resharded once (`model.placements`' slot "tp": one tensor-parallel placement kept at
    a time)."""
    def build():
        cfg = model.config
        placement = Placement(model_mesh(n), TP_RULES, tuple(schema.axis_units(cfg).items()))
        shardings = placement.shardings(schema.param_axes(cfg))
        same = all(getattr(a, "sharding", None) == b for a, b in zip(jax.tree.leaves(model.params),
                                                                     jax.tree.leaves(shardings)))
        params = model.params if same else put(model.params, shardings)
        return params, decoder.decode_layers(params["layers"], cfg, fuse_qkv=False), placement

    return model.placements.get("tp", "params", build, placement=n)


@dataclasses.dataclass(frozen=True)
class TP(AR):
    """`ar`, tensor-parallel over n devices (`sharding.TP_RULES`)."""

    n: int = 8  # devices

    name = "tp"
    baseline = False
    one_device = False
    multi_process = True

    def __post_init__(self):
        if not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise ValueError(f"tp needs a positive device count n, got {self.n!r}")

    def placed(self, model):
        return tp_runtime(model, int(self.n))

    def devices(self) -> int:
        return self.n

    def load_placement(self, processes: bool):
        return model_mesh(self.n), TP_RULES  # every device reads only its own shard of each weight


# ---------------------------------------------------------------- pipeline, spd


@dataclasses.dataclass(frozen=True)
class Pipeline(Method):
    """n pipeline stages on n devices, one token in flight (`decode.pipelined` with no drafter)."""

    n: int = 8  # stages, one device each
    stage_layers: Sequence[int] | None = None  # explicit per-stage layer counts
    drafter: str | None = None  # the engine drafter by name (`registry.ENGINE_DRAFTERS`); None: the method's
    spec: Any = None  # the PSM: a `DrafterRef` or its older forms (a path, None: shipped, "random", a pair)
    psm_layers: int = 2  # Ls of a random PSM
    oracle_tokens: Sequence[int] | None = None  # the oracle drafter's reference continuation (tests)
    psm_placement: Any = "auto"  # where the PSM body runs: "auto", "last", "own" or a stage index
    tp: int = 1  # devices per stage, the stage tensor-parallel over them: n * tp devices in all

    name = "pipeline"
    one_device = False
    staged = True
    multi_process = True
    default_drafter: ClassVar[str] = registry.NO_DRAFTER

    def __post_init__(self):
        _positive("tp", self.tp, "tensor-parallel devices per stage")  # n: the stage plan checks it
        if self.drafter is not None:
            registry.engine_drafter(self.drafter)  # refused before anything is loaded

    @property
    def engine_drafter(self) -> str:
        """The name of the drafter the engine runs (`registry.ENGINE_DRAFTERS`)."""
        return self.drafter or self.default_drafter

    def devices(self) -> int:
        return (self.n + bool(self.drafter_kind is not None and self.psm_placement == "own")) * self.tp

    def load_placement(self, processes: bool):
        # in a multi-process job each process reads only its own stages' layers
        if not processes:
            return None
        stages = self.devices() // self.tp
        return (stage_mesh(stages), STAGE_RULES) if self.tp == 1 else (stage_model_mesh(stages, self.tp),
                                                                        STAGE_TP_RULES)

    def drafter_source(self, model):
        if self.drafter_kind is None:
            return None
        return registry.source(self.drafter_kind, model, self.drafter_ref(), plan_for(model, self.n, self.stage_layers))

    def drafter_ref(self):
        return self.spec

    def run(self, model, req: Request) -> tuple[list[int], dict]:
        return generate_pipelined(model, req.prompt, int(req.max_new_tokens), req.sp, self, stop_at_eos=req.stop_at_eos,
                                  compiled=self.compiled)

    def steps(self, stats: dict) -> int:
        return stats["cycles"]

    def summary(self, stats: dict) -> str:
        return (f"n={stats['n']} stages {stats['stage_layers']}, alpha {stats['alpha']:.3f}, S0 {stats['S0']:.2f}, "
                f"accepted {stats['accepted']}, rejected {stats['rejected']}, PSM {stats['psm']}")


@dataclasses.dataclass(frozen=True)
class SPD(Pipeline):
    """Speculative pipeline decoding: the pipeline with the PSM drafting one token per cycle."""

    name = "spd"
    default_drafter = registry.PSM.name
    drafter_kind = registry.PSM
    label_key = "psm"
    random_drafter_on_request = True


@dataclasses.dataclass(frozen=True)
class PPSD(Pipeline):
    """Pipeline-parallel self-speculative decoding (PPSD, `drafters.ppsd`): the pipeline with an early-exit head
    drafting one token per cycle after stage 0's step, from the newest token's state there."""

    drafter_spec: Any = None  # the early-exit head: a `DrafterRef` or its older forms (a path, None: shipped, "random")

    name = "ppsd"
    default_drafter = registry.PPSD.name
    drafter_kind = registry.PPSD
    label_key = "ppsd"
    random_drafter_on_request = True

    def devices(self) -> int:
        return self.n * self.tp  # the head runs on stage 0's devices

    def drafter_ref(self):
        return self.drafter_spec

    def summary(self, stats: dict) -> str:
        return (f"n={stats['n']} stages {stats['stage_layers']}, alpha {stats['alpha']:.3f}, S0 {stats['S0']:.2f}, "
                f"accepted {stats['accepted']}, rejected {stats['rejected']}, PPSD head {stats['ppsd']}")


# ---------------------------------------------------------------- eagle3


@dataclasses.dataclass(frozen=True)
class EAGLE3(Method):
    """Chain speculative decoding on one device (`decode.chain`) with the EAGLE-3-style drafter: k drafts
    per round, one target pass over k + 1 positions."""

    k: int = 3  # drafts per round: the chain length
    drafter_spec: Any = None  # the drafter: a `DrafterRef` or its older forms (a path, None: shipped, "random", a pair)

    name = "eagle3"
    chain = True
    drafter_kind = registry.EAGLE3
    label_key = "drafter_spec"

    def __post_init__(self):
        if not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ValueError(f"eagle3 needs a positive chain length k, got {self.k!r}")

    def drafter_source(self, model):
        return registry.source(self.drafter_kind, model, self.drafter_spec)

    def drafter_ref(self):
        return self.drafter_spec

    def run(self, model, req: Request) -> tuple[list[int], dict]:
        model._require_layers(f"method={self.name!r}")
        spec, variables, label = registry.resolve(self.drafter_kind, model, self.drafter_spec, method=self.name)
        tokens, stats = generate_chain(model, req.prompt, int(req.max_new_tokens),
                                       Eagle3Drafter(model.config, spec, int(self.k)),
                                       drafter_params(variables, model.params), req.sp, req.stop_at_eos,
                                       compiled=self.compiled)
        eos = set(model.eos_token_ids) if req.stop_at_eos else set()
        stats.update(method=self.name, drafter_spec=label, stopped_at_eos=bool(tokens and tokens[-1] in eos),
                     backend=jax.default_backend(), devices=1, processes=1)
        return tokens, stats

    def steps(self, stats: dict) -> int:
        return stats["rounds"]

    def summary(self, stats: dict) -> str:
        return (f"k={stats['k']}, {stats['rounds']} rounds, {stats['tokens_per_round']:.3f} tokens/round, accepted "
                f"{stats['accepted']}, rejected {stats['rejected']}, drafter {stats['drafter_spec']}")


METHODS: dict[str, Method] = {m.name: m for m in (AR(), TP(), Pipeline(), SPD(), PPSD(), EAGLE3())}  # defaults


def get(method: "str | Method") -> Method:
    """A method as `api.generate` takes it: a `Method` (options given) as it is, or a name in `METHODS` (that
    method's defaults); else a ValueError listing them."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: available: {', '.join(METHODS)}")
    return METHODS[method]


def of_drafter(k: DrafterKind) -> Method:
    """The method that runs a drafter kind's network (its evaluation rows are that method's)."""
    return next(m for m in METHODS.values() if m.drafter_kind is k)


def clear_compiled() -> None:
    """Drop every method's executables (a long test session's memory maps)."""
    for m in METHODS.values():
        m.compiled.clear()
