"""The SPD authors' published PSM checkpoints (their reference code's v11 `.pt` files) -> this project's PSM
directory, the form `drafters.store` writes for a trained PSM (params/, psm.json), with CARD.md and
reference.json (the source file's sha256 and its config verbatim).

    python -m spd_jax.convert.reference_psm Qwen3.5-4B_s8_l3.pt OUT_DIR --base QWEN3_5_4B_HF_DIR [--n 8]

The file is read with torch.load(weights_only=True) only: one that needs a free unpickle is refused.

Format (v11, read from the reference's behaviour; docs/reference_psm.md maps each part):
  {"state_dict": {name: tensor}, "config": {field: value}}   (torch.save; bfloat16 or float32 tensors)

  config fields
    version                 11 (v10 files record 10: another layout, refused)
    num_stages              n, the pipeline depth the PSM drafts for
    stage_layers            optional, layers per stage ("8;8;8;8" or a list); default L / n each (L % n == 0)
    num_spec_layers         Ls, the PSM's decoder layers
    aggr_feature_bound      [b_0 = 0 < ... < b_{m-1} <= L]: HF hidden-state indices (0 the embedding, k the
                            output of decoder layer k-1, before the final norm) = our anchors h_{b_a}, unchanged
    num_aggr_types          m = len(aggr_feature_bound)
    hidden_size, vocab_size H and V of the base model; model_type, base_model_path: the base (checked, recorded)
    draft_vocab_size        V' (V without a draft vocabulary)
    draft_token_ids         [V'] base token ids of the head's rows, in increasing order (with a draft vocabulary;
                            the reference's draft_vocab/*.json "token_ids", given by --draft-vocab if absent)
    trained_with_use_deepest, spec_init_from_base_layers, spec_intermediate_size_fallback: training only (recorded)

  state_dict (a < m, i < Ls; H hidden, D head_dim, Nq / Nkv heads, I intermediate size of the base)
    aggr_projs.{a}.weight                        [H, (a+1) H]  row type a = W_a concat(h_{b_0}, ..., h_{b_a})
    spec_layers.{i}.input_layernorm.weight       [H]           one full-attention decoder layer of the base's
    spec_layers.{i}.self_attn.q_proj.weight      [Nq D, H]     kind: Qwen3.5's (q_proj [2 Nq D, H], query | gate
    spec_layers.{i}.self_attn.k_proj.weight      [Nkv D, H]    per head), Qwen3's, and for a Llama base Qwen3's
    spec_layers.{i}.self_attn.v_proj.weight      [Nkv D, H]    over Llama's shapes (the q/k norms: PSM qk_norm);
    spec_layers.{i}.self_attn.o_proj.weight      [H, Nq D]     biases (q/k/v/o_proj.bias) where the base's
    spec_layers.{i}.self_attn.{q,k}_norm.weight  [D]           attention_bias is set
    spec_layers.{i}.post_attention_layernorm.weight  [H]
    spec_layers.{i}.mlp.{gate,up}_proj.weight    [I, H]
    spec_layers.{i}.mlp.down_proj.weight         [H, I]
    lm_head.weight                               [V', H]       the PSM's own head (trained; PSM own_head)
  The base's final norm is shared (not stored). rotary_emb.inv_freq / original_inv_freq, buffers some writers
  keep, are ignored; any other name is refused, as is a missing one or a shape the base does not give.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from spd_jax.config import WRAPPED, ModelConfig, named_config_names
from spd_jax.convert import defaults
from spd_jax.convert.hf import CheckpointReader
from spd_jax.drafters import store
from spd_jax.drafters.psm import PSMConfig, init_psm, save_psm
from spd_jax.drafters.psm.model import layer_config
from spd_jax.models import schema
from spd_jax.models.kinds import FULL_ATTENTION
from spd_jax.reports.cards import converted_card

log = logging.getLogger(__name__)

VERSION = 11
REFERENCE_JSON = "reference.json"  # in the PSM directory: the source file's name, size, sha256, config verbatim
CONFIG_FIELDS = {"version", "num_stages", "stage_layers", "num_spec_layers", "aggr_feature_bound", "num_aggr_types",
                 "hidden_size", "vocab_size", "model_type", "base_model_path", "draft_vocab_size", "draft_token_ids",
                 "trained_with_use_deepest", "spec_init_from_base_layers", "spec_intermediate_size_fallback"}
REQUIRED = ("version", "num_stages", "num_spec_layers", "aggr_feature_bound", "hidden_size", "vocab_size")
# model types the reference builds PSMs for (its pipeline_model's list, less the MoE ones this project lacks)
BASES = ("qwen3", "qwen3_5_text", "llama")
IGNORED = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")  # non-persistent RoPE buffers: no weights


class ReferenceCheckpointError(ValueError):
    """A reference checkpoint this converter refuses; the message (one line) names the problem and the fix."""


def read_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict, str]:
    """IN.pt -> (state_dict as numpy [bfloat16 or float32], config, sha256 of the file)."""
    import torch  # only reading the .pt needs torch

    path = Path(path)
    if not path.is_file():
        raise ReferenceCheckpointError(f"{path} does not exist: give the .pt file the authors published")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch raises many kinds; all mean "not a weights-only file"
        why = re.sub(r"\x1b\[[0-9;]*m", "", (str(e).strip().splitlines() or [""])[0]).split(". ")[0][:120]
        raise ReferenceCheckpointError(f"{path} does not load with torch.load(weights_only=True) ({type(e).__name__}: "
                                       f"{why}): it is not a plain {{'state_dict', 'config'}} file; this converter "
                                       "never unpickles freely: re-save it as plain tensors and a dict") from None
    if not (isinstance(ckpt, dict) and all(isinstance(ckpt.get(k), dict) for k in ("state_dict", "config"))):
        keys = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ReferenceCheckpointError(f"{path} holds {keys}, not {{'state_dict': ..., 'config': ...}}: not a "
                                       "reference v11 PSM checkpoint (speculation_head_final.pt)")
    state = {}
    for k, t in ckpt["state_dict"].items():
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            what = getattr(t, "dtype", type(t).__name__)
            raise ReferenceCheckpointError(f"{path}: state_dict entry {k!r} is {what}, not a floating-point tensor: "
                                           "not a reference PSM checkpoint")
        a = t.detach().to(torch.float32).numpy()  # exact for bfloat16 and float16
        state[k] = a.astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else a
    return state, ckpt["config"], digest.hexdigest()


def _int(config: dict, key: str) -> int:
    try:
        return int(config[key])
    except (TypeError, ValueError):
        raise ReferenceCheckpointError(f"config {key}={config[key]!r} is not an integer: the file is damaged") from None


def _ints(config: dict, key: str) -> list[int]:
    v = config[key]
    if isinstance(v, str):
        v = [p for p in v.replace(";", ",").split(",") if p.strip()]
    try:
        return [int(x) for x in v]
    except (TypeError, ValueError):
        raise ReferenceCheckpointError(f"config {key}={v!r} is not a list of integers") from None


def plan_of(config: dict, cfg: ModelConfig, n: int | None = None) -> tuple[int, ...]:
    """The stage plan the PSM drafts for: config stage_layers, else L / n layers per stage (as the reference)."""
    stages = _int(config, "num_stages")
    if n is not None and n != stages:
        raise ReferenceCheckpointError(f"the checkpoint drafts for n={stages} pipeline stages, not the n={n} asked "
                                       f"for: its depth staircase is n's; convert with --n {stages} (or without --n), "
                                       f"or use the authors' checkpoint for n={n}")
    L = cfg.num_layers
    if config.get("stage_layers") is not None:
        plan = tuple(_ints(config, "stage_layers"))
        if len(plan) != stages or sum(plan) != L or min(plan) < 1:
            raise ReferenceCheckpointError(f"config stage_layers {list(plan)} is not {stages} stages of the base's "
                                           f"{L} layers: the checkpoint was made for another base model or n")
        return plan
    if not 1 <= stages <= L or L % stages:
        raise ReferenceCheckpointError(f"n={stages} stages cannot split the base's {L} layers evenly, and the "
                                       "config gives no stage_layers: the checkpoint was made for another base "
                                       "model; give --base the model it was trained for")
    return (L // stages,) * stages


def reference_staircase(spec: PSMConfig, hi: int) -> tuple[int, ...]:
    """The types the reference's engine gives the rows of tokens in flight at depths 1..n-1: the deepest depth
    d <= hi whose type (read, as it reads it, at d times the largest stage's layers) has only anchors the token
    already has; hi = n - 1 when a completed row is pending, else n (its rank-0 controller's `_choose_depth`)."""
    n, L, big, b = spec.n, sum(spec.plan), max(spec.plan), spec.anchors
    by_depth = [max(a for a in range(spec.m) if b[a] <= min(L, d * big)) for d in range(n + 1)]
    return tuple(by_depth[max(d for d in range(hi + 1) if b[by_depth[d]] <= sum(spec.plan[:k]))]
                 for k in range(1, n))


def spec_of(config: dict, cfg: ModelConfig, plan: tuple[int, ...], rows: int) -> PSMConfig:
    """The PSM config equivalent to the checkpoint's (rows: its head's rows V')."""
    anchors = _ints(config, "aggr_feature_bound")
    if config.get("num_aggr_types", len(anchors)) != len(anchors):
        raise ReferenceCheckpointError(f"config num_aggr_types={config['num_aggr_types']} but aggr_feature_bound "
                                       f"{anchors} has {len(anchors)}: the file is damaged")
    if not anchors or anchors[0] != 0 or anchors != sorted(set(anchors)):
        raise ReferenceCheckpointError(f"config aggr_feature_bound {anchors} does not start at 0 and increase: the "
                                       "file is damaged")
    if anchors[-1] > cfg.num_layers:
        raise ReferenceCheckpointError(f"config aggr_feature_bound {anchors} reads hidden state {anchors[-1]}, beyond "
                                       f"the base's {cfg.num_layers} layers: the checkpoint was made for another base "
                                       "model; give --base the model it was trained for")
    if cfg.model_type not in BASES:
        raise ReferenceCheckpointError(f"the reference builds PSMs for {', '.join(BASES)} bases, not "
                                       f"{cfg.model_type}: give --base the model the checkpoint was trained for")
    if cfg.mlp_bias:  # the reference's PSM layers (Qwen3's, Qwen3.5's) never have one
        raise ReferenceCheckpointError("the base has MLP biases, which the reference's Qwen3-style PSM layers lack "
                                       "and this project's PSM layers would read: not convertible")
    if _int(config, "num_spec_layers") < 1:
        raise ReferenceCheckpointError(f"config num_spec_layers={config['num_spec_layers']}: a PSM has layers")
    spec = PSMConfig.for_target(cfg, plan, _int(config, "num_spec_layers"), anchors, rows, own_head=True,
                                qk_norm=not cfg.attn_gate)  # Qwen3.5 keeps its own layer; else Qwen3's q/k norms
    want = spec.staircase[1:spec.n]
    for hi in (spec.n - 1, spec.n):
        if reference_staircase(spec, hi) != want:
            raise ReferenceCheckpointError(f"for stage plan {list(plan)} the reference types in-flight rows at depths "
                                           f"1..{spec.n - 1} as {list(reference_staircase(spec, hi))}, this project "
                                           f"as {list(want)}: not expressible; use a checkpoint for even stages")
    return spec


def vocab_ids_of(config: dict, cfg: ModelConfig, rows: int, draft_vocab: str | Path | None = None) -> np.ndarray | None:
    """The head's rows' token ids [V'] (None: the whole vocabulary), sorted and distinct as the reference
    makes them, from the config's draft_token_ids or a draft_vocab/*.json file (which must then agree)."""
    lists = {}
    if config.get("draft_token_ids") is not None:
        lists["config draft_token_ids"] = _ints(config, "draft_token_ids")
    if draft_vocab is not None:
        lists[f"{draft_vocab} token_ids"] = _ints(json.loads(Path(draft_vocab).read_text()), "token_ids")
    ids = {k: np.asarray(sorted(set(v)), np.int32) for k, v in lists.items()}
    if len(ids) == 2 and not np.array_equal(*ids.values()):
        raise ReferenceCheckpointError(f"{' and '.join(ids)} differ: give --draft-vocab the vocabulary the "
                                       "checkpoint was trained with, or leave it out")
    if config.get("draft_vocab_size", rows) != rows:
        raise ReferenceCheckpointError(f"config draft_vocab_size={config['draft_vocab_size']} but lm_head.weight has "
                                       f"{rows} rows: the file is damaged")
    if not ids:
        if rows != cfg.vocab_size:
            raise ReferenceCheckpointError(f"lm_head.weight has {rows} rows, the base's vocabulary {cfg.vocab_size}, "
                                           "and the config holds no draft_token_ids: give --draft-vocab the "
                                           "draft_vocab/*.json it was trained with")
        return None
    (name, got), = list(ids.items())[:1]
    if got.size != rows or not (got.size and 0 <= got[0] and got[-1] < cfg.vocab_size):
        span = f" in [{got[0]}, {got[-1]}]" if got.size else ""
        raise ReferenceCheckpointError(f"{name} gives {got.size} distinct ids{span} for a head of {rows} rows over a "
                                       f"vocabulary of {cfg.vocab_size}: the ids are not this checkpoint's (give "
                                       "--draft-vocab the draft_vocab/*.json it was trained with) or the base is "
                                       "another model (give --base the model it was trained for)")
    return None if rows == cfg.vocab_size else got


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One state_dict tensor: its shape there, and where its values go: (path in params, the layer slot or None,
    the transform to our layout), one or more (Qwen3.5's q_proj holds two of our leaves)."""
    shape: tuple[int, ...]
    puts: tuple[tuple[tuple[str, ...], int | None, Callable[[np.ndarray], np.ndarray]], ...]


def tensor_table(cfg: ModelConfig, spec: PSMConfig, rows: int) -> dict[str, Tensor]:
    """Every state_dict name a v11 checkpoint of spec holds -> its Tensor: the layers' names, shapes and
    transforms are the base's weight schema's (`models.schema`, the layer kind the PSM runs)."""
    H, table = cfg.hidden_size, {}
    for a in range(spec.m):  # nn.Linear [H, (a+1) H] -> our Dense kernel [(a+1) H, H]; concat order b_0 .. b_a
        table[f"aggr_projs.{a}.weight"] = Tensor((H, (a + 1) * H),
                                                 (((f"proj_{a}", "kernel"), None, schema.TRANSPOSE.apply),))
    for i in range(spec.num_layers):
        for k, leaf in FULL_ATTENTION.schema(layer_config(cfg, spec)).items():
            name = f"spec_layers.{i}.{leaf.hf}"
            puts = table[name].puts if name in table else ()
            table[name] = Tensor(leaf.hf_shape, puts + (((f"layer_{k}",), i, leaf.transform.apply),))
    table["lm_head.weight"] = Tensor((rows, H), ((("lm_head",), None, schema.SAME.apply),))
    return table


def _check_names(state: dict, table: dict, cfg: ModelConfig, spec: PSMConfig, where: str) -> None:
    have = {k for k in state if not k.endswith(IGNORED)}
    what = (f"Ls={spec.num_layers}, m={spec.m} anchors, base {cfg.model_type} (H={cfg.hidden_size}, heads "
            f"{cfg.num_heads}/{cfg.num_kv_heads}, head_dim={cfg.head_dim}, intermediate={cfg.intermediate_size})")
    for names, fix in ((sorted(table.keys() - have), "lacks tensor"),
                       (sorted(have - table.keys()), "has unexpected tensor")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ReferenceCheckpointError(f"{where} {fix} {names[0]!r}{more} for a v11 PSM of its config ({what}): "
                                           "the file is cut short, edited or another format; use the file as published")
    for name, t in table.items():
        if tuple(state[name].shape) != t.shape:
            raise ReferenceCheckpointError(f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, expected "
                                           f"{t.shape} for {what}: the checkpoint was made for another base model; "
                                           "give --base the model it was trained for")


def _assemble(state: dict, table: dict[str, Tensor], abstract: dict, dtype) -> dict:
    """The PSM's params: every leaf the module declares (abstract: its shapes), filled from the state_dict
    through the table, in dtype. A leaf no tensor fills, or a transform of the wrong shape, is a bug here."""
    params = jax.tree.map(lambda a: np.zeros(a.shape, dtype), abstract)
    filled = set()
    for name, t in table.items():
        for path, layer, transform in t.puts:
            *up, leaf = path
            parent = params
            for p in up:
                parent = parent[p]
            value = transform(state[name])
            slot = parent[leaf] if layer is None else parent[leaf][layer]
            assert value.shape == slot.shape, f"{name} -> {'/'.join(path)}: {value.shape} vs {slot.shape}"
            if layer is None:
                parent[leaf] = value.astype(dtype)
            else:
                parent[leaf][layer] = value
            filled.add(path)
    declared = {tuple(str(k.key) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert declared == filled, f"no tensor fills {sorted(declared - filled)}"
    return params


def convert(state: dict, config: dict, cfg: ModelConfig, n: int | None = None, draft_vocab=None,
            where: str = "the checkpoint") -> tuple[PSMConfig, dict]:
    """A read checkpoint (`read_checkpoint`) and the base's config -> (PSM config, variables: params in the
    file's dtype, and the draft vocabulary's ids), exactly the reference's PSM (docs/reference_psm.md)."""
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ReferenceCheckpointError(f"{where}'s config lacks {', '.join(missing)}: not a reference v11 PSM "
                                       "checkpoint (speculation_head_final.pt)")
    if config["version"] != VERSION:
        raise ReferenceCheckpointError(f"{where} is version {config['version']!r}, not {VERSION}: this converter reads "
                                       "v11 checkpoints (v10's layout differs); use the authors' v11 files")
    unknown = sorted(config.keys() - CONFIG_FIELDS)
    if unknown:  # the reference ignores fields it does not know; so do we, said
        log.warning("%s's config has fields the reference's v11 code does not read, ignored: %s", where, unknown)
    mt = WRAPPED.get(config.get("model_type"), config.get("model_type"))
    for field, want in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size),
                        ("model_type", cfg.model_type)):
        got = mt if field == "model_type" else config[field]
        if got is not None and got != want:
            raise ReferenceCheckpointError(f"{where} was made for a base with {field}={got!r}, the base given has "
                                           f"{want!r}: give --base the model it was trained for "
                                           f"({config.get('base_model_path') or 'its base_model_path'})")
    if not config.get("trained_with_use_deepest", True):
        log.warning("%s was trained with trained_with_use_deepest=false: the reference's single-process demo types "
                    "verified rows inside the pipeline's window by their distance; this project and the reference's "
                    "distributed engine type them deepest (docs/reference_psm.md)", where)
    rows = int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else cfg.vocab_size
    spec = spec_of(config, cfg, plan_of(config, cfg, n), rows)
    ids = vocab_ids_of(config, cfg, rows, draft_vocab)
    table = tensor_table(cfg, spec, rows)
    _check_names(state, table, cfg, spec, where)
    dtype = ml_dtypes.bfloat16 if all(state[k].dtype == ml_dtypes.bfloat16 for k in table) else np.float32
    zeros = {"embed": jnp.zeros((cfg.vocab_size, cfg.hidden_size)), "final_norm": jnp.zeros((cfg.hidden_size,))}
    zeros |= {} if cfg.tie_word_embeddings else {"lm_head": zeros["embed"]}  # traced only: nothing is allocated
    abstract = jax.eval_shape(lambda: init_psm(cfg, spec, zeros, vocab_ids=np.arange(spec.draft_vocab)))["params"]
    params = _assemble(state, table, abstract, dtype)
    return spec, {"params": params, **({"vocab": {"ids": ids}} if spec.draft_vocab else {})}


def resolve_base(base: str | None, config: dict) -> tuple[ModelConfig, str | None, str]:
    """--base (an HF directory, a known default model or a configs/models name; default: the checkpoint's
    base_model_path, as a directory or by its name) -> (config, the target weights' fingerprint or None, label)."""
    cands = [base] if base else [config.get("base_model_path"), Path(str(config.get("base_model_path"))).name.lower()]
    for c in filter(None, cands):
        d = Path(defaults.ensure_checkpoint(c)) if defaults.canonical_name(c) else Path(c)
        if (d / "config.json").is_file():
            reader = CheckpointReader(d)
            embed = reader.read_global("embed", (), ml_dtypes.bfloat16)  # the fingerprint's bytes: [V, H] once
            return reader.cfg, store.target_weights({"embed": embed}), str(d)
        if c in named_config_names():
            log.warning("base %s is a config name: the PSM records no target-weights fingerprint, so it loads on any "
                        "model of that architecture (give --base the HF directory to record it)", c)
            return ModelConfig.named(c), None, c
    raise ReferenceCheckpointError(f"no base model found for {cands[0]!r}: give --base the HF directory of the "
                                   "model the checkpoint was trained for (config.json + safetensors) or a "
                                   "configs/models name")


def convert_file(pt: str | Path, out: str | Path, base: str | None = None, n: int | None = None,
                 draft_vocab: str | Path | None = None) -> PSMConfig:
    """IN.pt -> OUT (a new PSM directory: params/, psm.json, reference.json, CARD.md) -> the PSM's config."""
    pt, out = Path(pt), Path(out)
    if out.exists():
        raise ReferenceCheckpointError(f"{out} exists: write the converted PSM to a new directory")
    state, config, digest = read_checkpoint(pt)
    try:
        verbatim = json.loads(json.dumps(config))
    except (TypeError, ValueError):
        raise ReferenceCheckpointError(f"{pt}'s config holds values that are not plain data: not a reference "
                                       "v11 checkpoint") from None
    cfg, fingerprint, label = resolve_base(base, config)
    spec, variables = convert(state, config, cfg, n, draft_vocab, where=str(pt))
    source = dict(file=pt.name, bytes=pt.stat().st_size, sha256=digest, base=label)
    save_psm(out, variables, spec, extra=dict(converted_from=source), target_weights=fingerprint)
    (out / REFERENCE_JSON).write_text(json.dumps(dict(source, config=verbatim), indent=1) + "\n")
    (out / "CARD.md").write_text(converted_card(json.loads((out / "psm.json").read_text()), verbatim, label))
    return spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spd_jax.convert.reference_psm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="the authors' v11 .pt file (e.g. Qwen3.5-4B_s8_l3.pt)")
    ap.add_argument("out", help="the PSM directory to write (new)")
    ap.add_argument("--base", default=None, help="the base model: an HF checkpoint directory (its weights' fingerprint "
                    "is recorded), a known default or a configs/models name; default: the config's base_model_path")
    ap.add_argument("--n", type=int, default=None, help="refuse a checkpoint for another pipeline depth")
    ap.add_argument("--draft-vocab", default=None, help="the reference's draft_vocab/*.json, for a checkpoint whose "
                    "config lacks draft_token_ids (checked against them otherwise)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", force=True)  # not orbax's INFO
    try:
        spec = convert_file(args.checkpoint, args.out, args.base, args.n, args.draft_vocab)
    except ReferenceCheckpointError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    base = json.loads((Path(args.out) / "psm.json").read_text())["converted_from"]["base"]
    print(f"wrote {args.out}: PSM for n={spec.n}, stages {list(spec.plan)}, anchors {list(spec.anchors)}, "
          f"Ls={spec.num_layers}, head {spec.draft_vocab or spec.target[3]} rows (use: python -m infer.generate "
          f"--model {base} --n {spec.n} --stages {','.join(map(str, spec.plan))} --spec {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
