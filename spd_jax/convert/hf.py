"""Hugging Face checkpoint directory -> decoder params pytree (layout: `spd_jax.models.schema`).

Reads config.json and model.safetensors (or a sharded `model.safetensors.index.json`), text-only
(`model.layers.*`) or multimodal (`model.language_model.layers.*`; vision tower and MTP head skipped,
with a log line). Names, shapes and layout transforms all come from the weight schema: every tensor's
HF shape is checked against the config before anything is read, and a missing, unexpected or
mis-shaped tensor fails with its name. Only safetensors is read: no pickles, no remote code.

Sharded loading: given a NamedSharding per leaf, each leaf is built with
`jax.make_array_from_callback`, whose callback reads from disk only the slice one device holds (a
column block of a transposed matrix reads the matching row block of the HF tensor). Stacked leaves
may follow any layer map (`CheckpointReader.read_stack`): the pipeline's per-stage stacks read, for
stage s, only stage s's layers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from spd_jax.config import ModelConfig
from spd_jax.models import schema
from spd_jax.models.schema import Leaf

log = logging.getLogger(__name__)

# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Parts of multimodal checkpoints that are not the text decoder: skipped with a log line.
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
VLM_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (names the offending tensor)."""


def _open(path: Path, framework: str):
    """safe_open, with a file cut short or damaged (its header promises more bytes than it holds) named."""
    try:
        return safe_open(path, framework=framework)
    except SafetensorError as e:
        from spd_jax.convert.defaults import cache_root

        converted = path.parent.parent.resolve() == cache_root().resolve()  # a default model converted here
        fix = (f"delete {path.parent} and the next run converts it again" if converted else
               "copy or convert the checkpoint again")
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}): it was cut short or damaged; "
                              f"{fix}") from None


def _safetensors_files(ckpt: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        files = {name: ckpt / fname for name, fname in wmap.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index.name} names shard {f.name}, which is missing from {ckpt}")
        return files
    single = ckpt / "model.safetensors"
    if single.is_file():
        with _open(single, "numpy") as f:
            return {name: single for name in f.keys()}
    if any(ckpt.glob("*.bin")) or any(ckpt.glob("*.pt")) or any(ckpt.glob("*.pth")):
        raise CheckpointError(f"{ckpt} holds only PyTorch pickle weights; spd-jax reads safetensors only "
                              "(never unpickles). Re-save the model with save_pretrained(safe_serialization=True).")
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {ckpt}")


def expected_tensors(cfg: ModelConfig, prefix: str = "model.") -> dict[str, Leaf]:
    """Every HF tensor a checkpoint of cfg holds (text weights under `prefix`), in the order transformers
    saves them (embedding, layers, final norm, head) -> its schema leaf. What the reader requires and
    `convert.random` writes."""
    g = schema.global_schema(cfg, prefix)
    out = {g["embed"].hf: g["embed"]}
    layers = {kind: schema.layer_schema(cfg, kind) for kind in schema.layer_kinds(cfg)}
    for i, kind in enumerate(cfg.layer_types):
        out |= {layer_tensor(prefix, i, leaf): leaf for leaf in layers[kind].values()}
    return out | {leaf.hf: leaf for key, leaf in g.items() if key != "embed"}


def layer_tensor(prefix: str, layer: int, leaf: Leaf) -> str:
    """The HF name of a layer leaf's tensor in layer `layer`."""
    return f"{prefix}layers.{layer}.{leaf.hf}"


class CheckpointReader:
    """An opened, validated checkpoint: config, schema and slice reads (nothing is read until asked)."""

    def __init__(self, ckpt_dir: str | Path):
        ckpt = Path(ckpt_dir)
        if not ckpt.is_dir():
            raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist: pass --model a known default "
                                    "name or the path of a Hugging Face checkpoint directory")
        self.path = ckpt
        self.cfg = cfg = ModelConfig.from_json(ckpt / "config.json")
        self.files = files = _safetensors_files(ckpt)
        self.prefix = prefix = VLM_PREFIX if any(n.startswith(VLM_PREFIX) for n in files) else "model."
        skipped = [n for n in files if n.startswith(_SKIPPED_PREFIXES)]
        if skipped:
            log.info("skipping %d non-text tensors (%s)", len(skipped),
                     ", ".join(sorted({p for p in _SKIPPED_PREFIXES for n in skipped if n.startswith(p)})))
        self.globals = schema.global_schema(cfg, prefix)
        self.layers = {kind: schema.layer_schema(cfg, kind) for kind in schema.layer_kinds(cfg)}
        expected = {name: leaf.hf_shape for name, leaf in expected_tensors(cfg, prefix).items()}
        allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()

        self._np = {f: _open(f, "numpy") for f in set(files.values())}
        self._jx: dict[Path, object] = {}  # numpy cannot hold bfloat16: those tensors are read through jax
        missing = [n for n in expected if n not in files]
        if missing:
            raise CheckpointError(f"checkpoint {ckpt} is missing tensor {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                                  + f" required by its config (model_type={cfg.model_type}, "
                                    f"num_hidden_layers={cfg.num_layers})")
        unexpected = [n for n in files if n not in expected and n not in allowed_extra
                      and not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(_SKIPPED_PREFIXES)]
        if unexpected:
            raise CheckpointError(f"checkpoint {ckpt} has unexpected tensor {unexpected[0]!r}"
                                  + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                                  + f": it does not match its config (model_type={cfg.model_type})")
        for name, shape in expected.items():
            got = tuple(self._np[files[name]].get_slice(name).get_shape())
            if got != shape:
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape} from config.json "
                                      f"(hidden_size={cfg.hidden_size}, heads={cfg.num_heads}/{cfg.num_kv_heads}, "
                                      f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size}"
                                      + (f", linear={cfg.linear}" if cfg.linear else "") + ")")

    def layer_name(self, layer: int, leaf: Leaf) -> str:
        return layer_tensor(self.prefix, layer, leaf)

    def _slice(self, name: str, hf_index: tuple) -> np.ndarray:
        f = self.files[name]
        sl = self._np[f].get_slice(name)
        if sl.get_dtype() != "BF16":
            return sl[hf_index]
        if f not in self._jx:
            self._jx[f] = _open(f, "flax")
        return np.asarray(self._jx[f].get_slice(name)[hf_index])

    def read(self, name: str, leaf: Leaf, index: tuple, dtype) -> np.ndarray:
        """our_array[index] of the HF tensor `name` transformed by leaf.transform."""
        index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
        return np.asarray(leaf.transform.read(lambda ix: self._slice(name, ix), index), dtype)

    def read_global(self, key: str, index: tuple = (), dtype=np.float32) -> np.ndarray:
        return self.read(self.globals[key].hf, self.globals[key], index, dtype)

    def read_stack(self, kind: str, key: str, layer_ids: np.ndarray, index: tuple = (), dtype=np.float32) -> np.ndarray:
        """A stacked leaf whose leading axes follow layer_ids (int array of model layer indices, -1 for
        a zero-padded slot): result[index] where the first layer_ids.ndim entries of index select
        slots and the rest slice within the layer."""
        leaf = self.layers[kind][key]
        lead = layer_ids.ndim
        index = tuple(index) + (slice(None),) * (lead + len(leaf.shape) - len(index))
        ids = np.asarray(layer_ids)[index[:lead]]
        inner = index[lead:]
        probe = np.zeros(leaf.shape, np.int8)[inner].shape  # the inner slice's shape
        out = np.zeros((*ids.shape, *probe), dtype)
        for pos in np.ndindex(*ids.shape):
            if ids[pos] >= 0:
                out[pos] = self.read(self.layer_name(int(ids[pos]), leaf), leaf, inner, dtype)
        return out

    def kind_layer_ids(self, kind: str) -> np.ndarray:
        """[n_kind] model layer indices of the per-kind stack (the params layout)."""
        return np.asarray([i for i, k in enumerate(self.cfg.layer_types) if k == kind], np.int32)

    def load(self, dtype=jnp.float32, shardings: dict | None = None, layers: bool = True) -> dict:
        """The params pytree. shardings: a matching pytree of NamedShardings (`spd_jax.sharding`); each
        device then reads and holds only its own slice. Without: whole arrays on the default device.
        layers=False: the embedding, final norm and head only (params["layers"] is None)."""
        np_dtype = jnp.dtype(dtype)

        def build(shape, sharding, read):
            if sharding is None:
                return jnp.asarray(read(()))
            return jax.make_array_from_callback(shape, sharding, read)

        params = {}
        for key, leaf in self.globals.items():
            params[key] = build(leaf.shape, shardings and shardings[key],
                                lambda ix, key=key: self.read_global(key, ix, np_dtype))
        params["layers"] = {} if layers else None
        for kind, leaves in (self.layers.items() if layers else ()):
            ids = self.kind_layer_ids(kind)
            params["layers"][kind] = {
                key: build((ids.size, *leaf.shape), shardings and shardings["layers"][kind][key],
                           lambda ix, kind=kind, key=key, ids=ids: self.read_stack(kind, key, ids, ix, np_dtype))
                for key, leaf in leaves.items()}
        log.info("loaded %s (%s, %d layers%s) from %s", self.cfg.model_type, np_dtype.name, self.cfg.num_layers,
                 ", sharded" if shardings else "", self.path)
        return params
