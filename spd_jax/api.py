"""Public API: `load_model`, `Model`, `generate`.

Thin over the library: resolving a model name, holding config/params/tokenizer together, validating
requests and handing them to a decoding method (`spd_jax.methods`). The math lives in
`spd_jax.models`, the loops in `spd_jax.decode`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spd_jax import methods
from spd_jax.config import ModelConfig
from spd_jax.convert import defaults
from spd_jax.convert.hf import CheckpointReader
from spd_jax.decode import ar
from spd_jax.decode.sampling import Sampling
from spd_jax.drafters.store import target_weights
from spd_jax.models import decoder, schema
from spd_jax.placements import Placements
from spd_jax.sharding import STAGE, Placement, Rules

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: dict
    tokenizer: Any | None
    path: Path
    # The opened checkpoint, for placements that read their own slices later (a pipeline's stages).
    reader: Any | None = dataclasses.field(default=None, repr=False, compare=False)
    # Copies derived from params (decode layers, tensor-parallel and stage placements, drafters), built on first use
    placements: Placements = dataclasses.field(default_factory=Placements, repr=False, compare=False)

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def weights_fingerprint(self) -> str:
        """`drafters.store.target_weights` of these weights (the same for float32 and bfloat16 loads),
        computed once: what a drafter checkpoint records of the model it was trained for."""
        return self.placements.get("host", "weights_fingerprint", lambda: target_weights(self.params))

    @property
    def layers_loaded(self) -> bool:
        """False for a model loaded for the pipeline (stage rules): its layers live only in the
        per-stage stacks the pipeline reads from disk."""
        return self.params.get("layers") is not None

    def _require_layers(self, what: str) -> None:
        if not self.layers_loaded:
            raise ValueError(f"{what} needs the whole model's layers, but this model was loaded for the pipeline "
                             "(load_model(..., rules=STAGE_RULES)) and holds only its stages' layers; load it "
                             "without a stage mesh")

    def logits(self, token_ids) -> np.ndarray:
        """token_ids [B, T] ints -> float32 logits [B, T, V] (one full causal forward from position 0)."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [B, T] array, got shape {ids.shape}")
        self._check_ids(ids)
        self._require_layers("Model.logits")
        cache = decoder.init_cache(self.config, ids.shape[0], ids.shape[1], self.dtype)
        out, _ = _forward_jit(self.params, jnp.asarray(ids, jnp.int32), cache, cfg=self.config)
        return np.asarray(out)

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {ids.min()} max {ids.max()}")

    def encode(self, text: str, chat: bool | None = None) -> list[int]:
        """Text -> prompt ids; with chat (default: when the tokenizer has a template) as one user turn."""
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer files; pass token ids instead of text")
        if chat is None:
            chat = self.has_chat_template
        if chat:
            if not self.has_chat_template:
                raise ValueError(f"the tokenizer at {self.path} has no chat template; use --no-chat")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_jit(params, tokens, cache, *, cfg):
    return decoder.forward(params, tokens, cache, jnp.int32(0), cfg)


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A known default name (converted and cached on first use) or an HF checkpoint directory."""
    s = str(name_or_path)
    if defaults.canonical_name(s) is not None:
        return defaults.ensure_checkpoint(s)
    p = Path(s).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model {s!r} is neither a known default ({', '.join(defaults.DEFAULT_MODELS)}) "
                                "nor an existing checkpoint directory")
    return p


def load_model(name_or_path: str | Path = defaults.DEFAULT_MODEL, dtype: str = "float32", *,
               mesh: Mesh | None = None, rules: Rules | None = None) -> Model:
    """Load a model: config, params and tokenizer when the directory has one.

    Without mesh: whole arrays on the default device. With mesh and rules (`spd_jax.sharding`): every
    leaf placed with the sharding its logical axes get under rules, each device reading only its slice
    from disk (e.g. `model_mesh(n)` with `TP_RULES` for method="tp"). With stage rules
    (`stage_mesh(n)`, `STAGE_RULES`) only the embedding, final norm and head are loaded (split by vocabulary
    rows where the devices divide the vocabulary, else replicated); the pipeline reads each stage's layers
    onto that stage's device when it first runs."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if (mesh is None) != (rules is None):
        raise ValueError("load_model takes mesh and rules together (e.g. mesh=model_mesh(2), rules=TP_RULES)")
    path = resolve_checkpoint(name_or_path)
    reader = CheckpointReader(path)
    cfg = reader.cfg
    if mesh is None:
        params = reader.load(_DTYPES[dtype])
    else:
        placement = Placement(mesh, tuple(rules), tuple(schema.axis_units(cfg).items()))
        axes = schema.param_axes(cfg)
        if STAGE in dict(rules).values():
            axes["layers"] = None  # read per stage by the pipeline
        params = reader.load(_DTYPES[dtype], placement.shardings(axes), layers=axes["layers"] is not None)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        # imported here, not at the top: transformers pulls in torch (seconds), and only a checkpoint with
        # tokenizer files needs it. Local files only; never remote code.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return Model(cfg, params, tokenizer, path, reader)


def _token_ids(ids, what: str) -> np.ndarray:
    """Token ids (a sequence or array of ints) -> int64 [T]; text is refused with the way to encode it."""
    if isinstance(ids, (str, bytes)) or np.asarray(ids).dtype.kind in "US":
        raise ValueError(f"{what} must be token ids (ints), got {type(ids).__name__} {str(ids)[:40]!r}; encode "
                         "text with model.encode(text)")
    return np.asarray(ids, dtype=np.int64).reshape(-1)


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[int]  # generated tokens only (the EOS token included when it stopped there)
    stats: dict


def _request(model: Model, prompt_ids, max_new_tokens, max_len) -> np.ndarray:
    """Check a request against the model -> the prompt's ids, int64 [P]."""
    cfg = model.config
    prompt = _token_ids(prompt_ids, "prompt_ids")
    if prompt.size == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    model._check_ids(prompt)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max_len and max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    limit = max_len or cfg.max_position_embeddings
    P = int(prompt.size)
    # Every method's real tokens sit at positions < P + max_new_tokens (the pipeline's last draft in flight
    # at P + max_new_tokens - 1); rows past them (the PSM's block, the chain's last drafts) are scratch
    # each method sizes its own cache for, so the pipelined methods need no position more than "ar".
    if P + max_new_tokens > limit:
        raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) = {P + max_new_tokens} "
                         f"exceeds the cache limit of {limit} positions; shorten the prompt or lower "
                         + (f"max_new_tokens, or raise max_len (--max-len) up to the model's "
                            f"max_position_embeddings ({cfg.max_position_embeddings})" if max_len and
                            max_len < cfg.max_position_embeddings else
                            "max_new_tokens (the limit is the model's max_position_embeddings)"))
    return prompt


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int = 128, *,
             sampling: Sampling | None = None, method: methods.Method | str = "ar", stop_at_eos: bool = True,
             max_len: int | None = None, stream: Callable[[int], None] | None = None) -> GenerateResult:
    """Generate a continuation of one prompt with a decoding method.

    prompt_ids: the prompt's token ids (text: `model.encode(text)` first). sampling: how tokens are chosen
    (`Sampling(temperature, top_k, top_p, seed)`; default greedy). method: a `spd_jax.methods` options
    object, or its name for its defaults (`methods.METHODS`):
    `AR()` (plain autoregressive), `TP(n)` (the same, tensor-parallel over n devices), `Pipeline(n)` (n
    stages, one token in flight), `SPD(n, ...)` (speculative pipeline decoding: the PSM drafting one token per
    cycle), `PPSD(n, ...)` (the same engine with an early-exit drafter after stage 0's step) and `EAGLE3(k)`
    (chain speculative decoding on one device with the EAGLE-3-style drafter, k drafts per round, one target
    pass over k + 1 positions). Their options (stage_layers, spec, psm_layers, psm_placement, tp, drafter_spec,
    ...) are documented on the classes.
    max_len: the context limit, at most (and by default) the model's max_position_embeddings; the prompt
    plus max_new_tokens must fit in it. stream: called with each token id as it commits (a host callback
    from inside the on-device loop; `AR` and `TP`).
    Returns the generated ids and stats (tokens, timings and what they include).
    """
    m = methods.get(method)
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling (spd_jax.Sampling(temperature, top_k, top_p, seed)), got "
                        f"{type(sampling).__name__}")
    prompt = _request(model, prompt_ids, max_new_tokens, max_len)
    if stream is not None and not m.streams:
        raise ValueError("streaming is available for method="
                         + " and ".join(repr(x.name) for x in methods.METHODS.values() if x.streams) + " only")
    req = methods.Request(prompt, int(max_new_tokens), Sampling() if sampling is None else sampling, stop_at_eos,
                          stream)
    return GenerateResult(*m.run(model, req))


def cast_matrices(tree, dtype: str):
    """params (or `decoder.decode_layers`) with the layers' matrices (the schema's w* leaves: wq .. w_out)
    in dtype, for `layers.dense`'s dots. The embedding (so the activations and caches), the LM head,
    norms, biases and the conv kernel keep their dtype."""
    def cast(path, t):
        name = str(getattr(path[-1], "key", ""))
        return t.astype(dtype) if name.startswith("w") else t

    return jax.tree_util.tree_map_with_path(cast, tree)


def generate_batch(model: Model, prompts: Sequence[Sequence[int]], max_len: int, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None, seed: int | Sequence[int] = 0,
                   stop_at_eos: bool = True, weights_dtype: str = "float32") -> list[list[int]]:
    """Continue many prompts at once on one device (`decode.ar.generate_batch`): each prompt with up to
    max_len - len(prompt) new tokens, stopping after EOS (kept), greedy or sampled (row b seeded with
    seed + b: calls meant to draw independently step seed by the batch size; or seed[b] when seed is a
    sequence, one per prompt, so a row draws the same wherever it sits). -> each prompt's generated
    ids, as `generate(..., method="ar")` would give it alone (up to the matmul's summation order). For
    bulk generation (self-distillation data); shapes are bucketed as `generate`'s, so batches of similar
    prompt lengths share one compiled program.

    weights_dtype "bfloat16" runs a bf16 copy of the layers' matrices (`cast_matrices`, made once per
    model) through bf16-in, float32-accumulating dots: faster where the matmul unit has a bf16 path
    (AMX, accelerators), slower on an AVX2-only CPU (docs/train/replies.md); a slightly different model
    whose tokens part from the float32 target's after a near tie. Activations, caches and logits stay
    in the model's dtype."""
    cfg = model.config
    model._require_layers("generate_batch")
    rows = [_token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
    if not rows:
        return []
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    for i, p in enumerate(rows):
        if p.size == 0 or p.size >= max_len:
            raise ValueError(f"prompt {i} has {p.size} tokens; each needs 1 to {max_len - 1} (max_len {max_len}) "
                             "to leave room for a new token")
        model._check_ids(p)
    row_seeds = None if isinstance(seed, (int, np.integer)) else list(seed)
    if row_seeds is not None and len(row_seeds) != len(rows):
        raise ValueError(f"seed holds {len(row_seeds)} seeds for {len(rows)} prompts: give one per prompt, or one int")
    for s in row_seeds or ():
        Sampling(temperature, top_k, top_p, s)  # each checked as a seed
    sp = Sampling(temperature, top_k, top_p, seed if row_seeds is None else 0)
    out_len = ar.round_up(max_len - 1, ar.OUT_BUCKET)  # per-row max_new bounds the loop: one shape per max_len
    lens = np.asarray([p.size for p in rows], np.int32)
    eos = np.asarray(model.eos_token_ids if stop_at_eos else (), np.int32)
    if weights_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"weights_dtype must be 'float32' or 'bfloat16', got {weights_dtype!r}")
    params, layers = model.params, methods.decode_layers(model)
    if weights_dtype != model.dtype:
        params, layers = model.placements.get("host", ("batch_weights", weights_dtype), lambda: (
            cast_matrices(params, weights_dtype), cast_matrices(layers, weights_dtype)))
    seeds = (np.asarray(row_seeds, np.uint32) if row_seeds is not None
             else (np.uint32(sp.seed) + np.arange(len(rows), dtype=np.uint32)).astype(np.uint32))
    out, counts = ar.generate_batch(params, layers, rows, max_len - lens,
                                    jnp.asarray(eos if eos.size else np.array([-1], np.int32)), sp.runtime(),
                                    seeds, cfg=cfg, greedy=sp.greedy, filtered=sp.filtered, out_len=out_len)
    return [out[i, :counts[i]].tolist() for i in range(len(rows))]
