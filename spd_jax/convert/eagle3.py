"""A standard EAGLE-3 checkpoint -> this project's EAGLE-3 drafter directory (`--drafter DIR`).

The standard layout is the one SpecForge trains and saves and SGLang serves (`--speculative-algorithm
EAGLE3`): a directory with config.json (architectures ["LlamaForCausalLMEagle3"], model_type "llama", the
draft layer's sizes, the target's vocab_size, draft_vocab_size and, optionally, eagle_config's
eagle_aux_hidden_state_layer_ids) and model.safetensors (or shards named by model.safetensors.index.json;
or pytorch_model.bin, read only with torch.load(weights_only=True)), holding, optionally under "model.":

    fc.weight                                  [H, 3H]   the three target features (layer order) -> H
    midlayer.input_layernorm.weight            [H]       norms the token's embedding: the attention input's first half
    midlayer.hidden_norm.weight                [H]       norms the feature: its second half
    midlayer.self_attn.{q,k,v}_proj.weight     [N*D, 2H] [Nkv*D, 2H]
    midlayer.self_attn.o_proj.weight           [H, N*D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.{gate,up,down}_proj.weight    [I, H] [I, H] [H, I]
    norm.weight                                [H]       the final norm
    lm_head.weight                             [V', H]   the head over the draft vocabulary
    d2t                                        [V'] int  row i drafts target token i + d2t[i]
    t2d                                        [V] bool  which target tokens are drafted (optional; checked)
    embed_tokens.weight                        [V, H]    optional and unused: the target's embedding is used

Feature layers: eagle_aux_hidden_state_layer_ids [a, b, c] name target layers whose output is read (SGLang
captures the input of layer id + 1), so the hidden-state indices here are a + 1, b + 1, c + 1, in layer order;
without them, SGLang's default: the inputs of layers 2, L // 2 and L - 3. The draft layer's RoPE is its own
config's (rope_theta, rope_scaling), over the whole head. Refused, each with a one-line error naming the key
or field: another architecture, a draft hidden size or vocabulary other than the target's, more than one
decoder layer, biases, tied or absent LM head, SpecForge's fc_norm / norm_output=false variants, a missing,
unexpected or mis-shaped tensor, a d2t that is not sorted ascending inside the vocabulary or disagrees with t2d.
Every tensor's shape is asserted against the one `drafters.eagle3.weight_schema` derives from the configs.

The output is an ordinary drafter directory: eagle3.json (the spec, the target's weights fingerprint, the
source's digest), params/ (orbax, in the source's float dtype), CARD.md and lineage.json (the source's
digest, files and config.json). No pickle is read except by torch.load(weights_only=True); nothing remote.

    python -m spd_jax.convert.eagle3 IN_DIR OUT_DIR --model MODEL
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spd_jax.config import ConfigError, ModelConfig, read_json
from spd_jax.convert import defaults
from spd_jax.convert.hf import CheckpointReader
from spd_jax.drafters import eagle3, store
from spd_jax.drafters.shared import target_signature

ARCHITECTURES = ("LlamaForCausalLMEagle3",)  # SpecForge's draft model and SGLang's EntryClass
SOURCE_FORMAT = "standard EAGLE-3 (SpecForge / SGLang LlamaForCausalLMEagle3)"
PREFIX = "model."  # SGLang loads a name with or without it
# RoPE tables some exporters persist: recomputed from the config
_IGNORED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# (config field, its default, the value the standard draft model has): another value is another model (SpecForge's
# fc_norm / norm_output=false variants, biases, a head tied to the embedding, more decoder layers)
_FIXED = (("model_type", None, "llama"), ("num_hidden_layers", None, 1), ("tie_word_embeddings", False, False),
          ("attention_bias", False, False), ("bias", False, False), ("mlp_bias", False, False),
          ("fc_norm", False, False), ("norm_output", True, True), ("rope_is_neox_style", True, True))
_FLOAT_DTYPES = {"torch.bfloat16": jnp.bfloat16, "torch.float16": jnp.float16, "torch.float32": jnp.float32}


class Eagle3FormatError(ValueError):
    """A standard EAGLE-3 checkpoint that this converter cannot turn into the same function, or one made for
    another target; the message names the key or field."""


# ---------------------------------------------------------------- config


def feature_layers(d: dict, num_layers: int, where: str) -> tuple[int, ...]:
    """config.json's eagle_aux_hidden_state_layer_ids (output of layer id = hidden-state index id + 1) or
    SGLang's default (hidden-state indices 2, L // 2, L - 3) -> three distinct hidden-state indices in
    [1, L - 1], sorted: the order SGLang concatenates them in (it captures them as its layer loop reaches them)."""
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        hidden, what = [2, num_layers // 2, num_layers - 3], "SGLang's default for a target of this depth"
    elif isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        hidden, what = [i + 1 for i in ids], f"eagle_aux_hidden_state_layer_ids {ids}"
    else:
        raise Eagle3FormatError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ints, "
                                f"got {ids!r}")
    if len(hidden) != 3 or len(set(hidden)) != 3 or min(hidden) < 1 or max(hidden) > num_layers - 1:
        raise Eagle3FormatError(f"{where}: {what} gives hidden-state indices {hidden}; the fused feature needs three "
                                f"distinct ones in [1, {num_layers - 1}] (layer ids in [0, {num_layers - 2}]) of this "
                                f"{num_layers}-layer target")
    return tuple(sorted(hidden))


def read_spec(d: dict, cfg: ModelConfig, where: str) -> eagle3.Eagle3Config:
    """A standard checkpoint's config.json (d) for the target cfg -> the drafter's spec, or Eagle3FormatError
    naming the field that makes it another architecture or another target's."""
    archs = d.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
        raise Eagle3FormatError(f"{where}: architectures {archs} is not a standard EAGLE-3 draft model "
                                f"({', '.join(ARCHITECTURES)})")
    fixed = {key: (d.get(key, default), want) for key, default, want in _FIXED}
    fixed["use_aux_hidden_state"] = ((d.get("eagle_config") or {}).get("use_aux_hidden_state", True), True)
    for key, (got, want) in fixed.items():
        if got != want:
            raise Eagle3FormatError(f"{where}: {key} = {got!r} is not supported (the standard EAGLE-3 draft model "
                                    f"has {want!r})")
    for key, want in (("hidden_size", cfg.hidden_size), ("target_hidden_size", cfg.hidden_size),
                      ("vocab_size", cfg.vocab_size)):
        if key in d and d[key] != want:
            raise Eagle3FormatError(f"{where}: {key} = {d[key]} but the target has {want}: a drafter for another model")
    dv = d.get("draft_vocab_size")
    if not isinstance(dv, int) or not 1 <= dv <= cfg.vocab_size:
        raise Eagle3FormatError(f"{where}: draft_vocab_size must be an int in [1, {cfg.vocab_size}], got {dv!r}")
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # SpecForge's draft attention ignores it; SGLang's Llama attention reads it at the top level
        raise Eagle3FormatError(f"{where}: partial_rotary_factor = {partial} is ambiguous (SpecForge trains the draft "
                                "layer with RoPE over the whole head, SGLang's Llama attention would rotate a part)")
    try:  # the draft layer's sizes, RoPE and activation, read (and refused) as any Llama config is
        lc = ModelConfig.from_hf_dict(d)
    except KeyError as e:
        raise Eagle3FormatError(f"{where}: config.json has no {e.args[0]!r}") from None
    except ConfigError as e:
        raise Eagle3FormatError(f"{where}: {e}") from None
    layer = eagle3.DraftLayer(lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size, lc.rms_norm_eps,
                              lc.rope)
    return eagle3.Eagle3Config(feature_layers(d, cfg.num_layers, where), target_signature(cfg),
                               0 if dv == cfg.vocab_size else dv, layer)


# ---------------------------------------------------------------- tensors


def _weight_files(src: Path) -> list[Path]:
    """The files holding the weights: an index's shards, model.safetensors, or the PyTorch .bin forms."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (src / index).is_file():
            wmap = read_json(src / index, "copy the checkpoint again").get("weight_map")
            if not isinstance(wmap, dict):
                raise Eagle3FormatError(f"{src / index} has no weight_map: copy the checkpoint again")
            names = sorted(set(wmap.values()))
            missing = [n for n in names if not (src / n).is_file()]
            if missing:
                raise Eagle3FormatError(f"{src / index} names shard {missing[0]}, which is missing from {src}")
            return [src / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return [src / single]
    raise Eagle3FormatError(f"{src} holds no model.safetensors, pytorch_model.bin or an index of their shards")


def _load_file(f: Path) -> dict[str, Any]:
    """One weights file -> {name: torch tensor}. A .bin only through torch.load(weights_only=True), which
    refuses anything but tensors and plain containers: never a free unpickle."""
    import torch

    if f.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(f)
        except (SafetensorError, OSError) as e:
            raise Eagle3FormatError(f"{f} is not a readable safetensors file ({e}): copy it again") from None
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- the unpickler raises many kinds; each means "not weights only"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise Eagle3FormatError(f"{f} does not load with torch.load(weights_only=True) ({first}): it is damaged "
                                "or holds more than tensors; re-save it as safetensors where its source is trusted"
                                ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise Eagle3FormatError(f"{f} is not a state dict of named tensors")
    return state


def read_tensors(src: Path) -> dict[str, Any]:
    """Every tensor of the checkpoint -> {name without SGLang's optional "model." prefix: torch tensor}."""
    out: dict[str, Any] = {}
    for f in _weight_files(src):
        for name, t in _load_file(f).items():
            key = name[len(PREFIX):] if name.startswith(PREFIX) else name
            if key in out:
                raise Eagle3FormatError(f"{src}: tensor {key!r} appears twice (with and without {PREFIX!r}, or in two "
                                        "shards)")
            out[key] = t
    return out


def draft_ids(tensors: dict, spec: eagle3.Eagle3Config, cfg: ModelConfig, where: str) -> np.ndarray:
    """d2t [V'] (and t2d [V], when there) -> the target token id of each head row [V'] int32: row + d2t[row],
    SGLang's hot_token_id; sorted, distinct and inside the vocabulary, as this engine's draft vocabularies
    are, and as SpecForge's t2d (the rows' tokens in target order) assumes."""
    V, rows = cfg.vocab_size, spec.draft_vocab or cfg.vocab_size
    d2t = tensors.get("d2t")
    if d2t is None:
        if spec.draft_vocab:
            raise Eagle3FormatError(f"{where}: missing tensor 'd2t' (the draft rows' target ids), which a draft "
                                    f"vocabulary of {rows} < {V} tokens needs")
        ids = np.arange(V)
    else:
        if tuple(d2t.shape) != (rows,) or d2t.is_floating_point() or d2t.dtype.is_complex:
            raise Eagle3FormatError(f"{where}: tensor 'd2t' has shape {tuple(d2t.shape)} {d2t.dtype}, expected "
                                    f"({rows},) integers (draft_vocab_size)")
        ids = np.arange(rows) + d2t.numpy().astype(np.int64)
    if ids[0] < 0 or ids[-1] >= V or (np.diff(ids) <= 0).any():
        raise Eagle3FormatError(f"{where}: d2t maps the draft rows to target ids that are not sorted ascending, "
                                f"distinct and in [0, {V})")
    t2d = tensors.get("t2d")
    if t2d is not None:
        mask = np.zeros(V, bool)
        mask[ids] = True
        if tuple(t2d.shape) != (V,) or not np.array_equal(t2d.numpy().astype(bool), mask):
            raise Eagle3FormatError(f"{where}: tensor 't2d' (shape {tuple(t2d.shape)}) does not mark exactly the "
                                    "target tokens d2t maps the draft rows to")
    return ids.astype(np.int32)


def read_variables(tensors: dict, spec: eagle3.Eagle3Config, cfg: ModelConfig, where: str) -> dict:
    """The checkpoint's tensors -> the drafter's variables (float32 numpy; `vocab`/`ids` with a draft vocabulary),
    each tensor's name and shape asserted against `eagle3.weight_schema`."""
    schema = {leaf.hf: (path, leaf) for path, leaf in eagle3.weight_schema(cfg, spec).items()}
    optional = ("d2t", "t2d", "embed_tokens.weight")  # d2t and t2d: `draft_ids`
    missing = [n for n in schema if n not in tensors]
    if missing:
        raise Eagle3FormatError(f"{where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                             if len(missing) > 1 else ""))
    unexpected = [n for n in tensors if n not in schema and n not in optional and not n.endswith(_IGNORED)]
    if unexpected:
        raise Eagle3FormatError(f"{where}: unexpected tensor {unexpected[0]!r}" + (
            f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "") + ": not part of the standard "
            "EAGLE-3 draft model this converter reads")
    lc = spec.layer_config(cfg)
    shapes = {name: leaf.hf_shape for name, (_, leaf) in schema.items()}
    for name, want in (shapes | {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}).items():
        t = tensors.get(name)
        if t is not None and (tuple(t.shape) != tuple(want) or not t.is_floating_point()):
            raise Eagle3FormatError(
                f"{where}: tensor {name!r} has shape {tuple(t.shape)} {t.dtype}, expected {tuple(want)} floats "
                f"(hidden {cfg.hidden_size}, heads {lc.num_heads}/{lc.num_kv_heads} of {lc.head_dim}, intermediate "
                f"{lc.intermediate_size}, draft vocabulary {spec.draft_vocab or cfg.vocab_size}, "
                f"{len(spec.layers)} features)")
    params: dict = {}
    for name, (path, leaf) in schema.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf.transform.apply(tensors[name].float().numpy())
    out = {"params": params}
    ids = draft_ids(tensors, spec, cfg, where)
    if spec.draft_vocab:
        out["vocab"] = {"ids": ids}
    # every variable the module has, of its shape: none is left at a random initial value
    want = store.abstract_variables(eagle3.KIND, spec, cfg)
    assert jax.tree.structure(out) == jax.tree.structure(want) and all(
        np.shape(a) == b.shape for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want))), (out, want)
    return out


def read_checkpoint(src: str | Path, cfg: ModelConfig) -> tuple[eagle3.Eagle3Config, dict, dict, Any]:
    """A standard EAGLE-3 directory for the target cfg -> (spec, variables (float32 numpy), its config.json,
    the float dtype its weights are stored in, or float32 where they mix dtypes: writing them in it is exact)."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a standard EAGLE-3 checkpoint directory")
    d = read_json(src / "config.json", "copy the checkpoint again")
    where = str(src)
    spec = read_spec(d, cfg, where)
    tensors = read_tensors(src)
    variables = read_variables(tensors, spec, cfg, where)
    stored = {str(tensors[leaf.hf].dtype) for leaf in eagle3.weight_schema(cfg, spec).values()}
    return spec, variables, d, _FLOAT_DTYPES.get(stored.pop(), jnp.float32) if len(stored) == 1 else jnp.float32


# ---------------------------------------------------------------- a drafter directory


def source_digest(src: Path) -> tuple[str, list[str]]:
    """sha256 over config.json and the weight files (relative name, size and bytes each, in name order) ->
    (its hex digest, the file names)."""
    files = sorted({src / "config.json", *_weight_files(src),
                    *(src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (src / n).is_file())})
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest(), [f.name for f in files]


def _target(model) -> tuple[ModelConfig, str, str]:
    """A loaded `spd_jax.Model`, a known default name or an HF directory -> (its config, its weights'
    fingerprint, its name). Only the config and the embedding are read from a directory."""
    if hasattr(model, "weights_fingerprint"):
        return model.config, model.weights_fingerprint, str(model.path)
    name = str(model)
    reader = CheckpointReader(defaults.ensure_checkpoint(name) if defaults.canonical_name(name)
                              else Path(name).expanduser())
    embed = reader.read_global("embed", (), jnp.bfloat16)  # the fingerprint is over bf16: half the bytes of f32
    return reader.cfg, store.target_weights({"embed": embed}), str(model)


def card(spec: eagle3.Eagle3Config, cfg: ModelConfig, d: dict, src: Path, model: str, digest: str, dtype) -> str:
    """The converted drafter's CARD.md: where it came from, what it reads and computes, how to run it."""
    lay, ids = spec.layer, (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vocab = (f"a draft vocabulary of {spec.draft_vocab} tokens (`d2t`)" if spec.draft_vocab
             else f"the whole vocabulary ({cfg.vocab_size} tokens)")
    return "\n".join([
        f"# EAGLE-3 drafter for {model}, converted from a standard EAGLE-3 checkpoint", "",
        f"Converted by `python -m spd_jax.convert.eagle3` from `{src}` ({SOURCE_FORMAT}), source digest sha256 "
        f"`{digest}` (config.json and weight files; lineage.json lists them with the source's config.json).", "",
        f"- target: {model} ({cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary "
        f"{cfg.vocab_size}); its weights' fingerprint is in eagle3.json",
        f"- features: hidden states {list(spec.layers)} (" + (f"eagle_aux_hidden_state_layer_ids {ids}, plus one"
                                                            if ids is not None else "SGLang's default layers")
        + ") fused by `fc`",
        f"- layer: a Llama layer of {lay.num_heads} heads ({lay.num_kv_heads} kv) of {lay.head_dim}, MLP "
        f"{lay.intermediate_size}, RoPE {lay.rope.rope_type} theta {lay.rope.theta:g} over the whole head, norm eps "
        f"{lay.rms_norm_eps:g}",
        f"- head: its own, over {vocab}; the token embedding is the target's",
        f"- weights: {jnp.dtype(dtype).name}, as stored in the source", "",
        "Run: `python -m infer.generate --model MODEL --mode eagle3 --k 3 --drafter DIR`. Evaluate: "
        "`python -m infer.evaluate --model MODEL --methods ar,eagle3 --k 3 --drafter DIR`. How the conversion "
        "reads each weight and what was tested: docs/eagle3-standard.md. No acceptance figure of this drafter "
        "has been measured here.", ""])


def convert(src: str | Path, out: str | Path, model) -> Path:
    """Convert the standard EAGLE-3 checkpoint at src for the target `model` (a loaded `spd_jax.Model`, a
    known default name or an HF directory) into a new drafter directory `out` -> out. The weights are written in
    the source's float dtype (exact); the spec records the target's weights fingerprint, so another model of
    the same shape refuses the drafter."""
    src, out = Path(src).absolute(), Path(out).absolute()
    cfg, fingerprint, name = _target(model)
    spec, variables, d, dtype = read_checkpoint(src, cfg)
    digest, files = source_digest(src)
    cast = lambda a: jnp.asarray(a, dtype if np.issubdtype(np.asarray(a).dtype, np.floating) else None)  # noqa: E731
    eagle3.save_eagle3(out, jax.tree.map(cast, variables), spec, target_weights=fingerprint,
                       extra=dict(converted=dict(source=SOURCE_FORMAT, source_digest=digest)))
    lineage = [dict(converted_from=SOURCE_FORMAT, source=str(src), source_digest=digest, files=files, config=d,
                    target=name, converter="spd_jax.convert.eagle3")]
    (out / "lineage.json").write_text(json.dumps(lineage, indent=1) + "\n")
    (out / "CARD.md").write_text(card(spec, cfg, d, src, name, digest, dtype))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spd_jax.convert.eagle3", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="the standard EAGLE-3 checkpoint directory (config.json + weights)")
    ap.add_argument("out", help="the drafter directory to write (must not exist); then --drafter OUT")
    ap.add_argument("--model", required=True,
                    help="the target it drafts for: a known default (smollm2-135m-instruct) or an HF checkpoint "
                         "directory (its config and embedding are read)")
    args = ap.parse_args(argv)
    try:
        print(convert(args.src, args.out, args.model))
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:  # ConfigError, CheckpointError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
