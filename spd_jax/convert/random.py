"""Seeded random Hugging Face checkpoints of any model config: the inverse of `convert.hf` for weights
nobody trained, so that loading, sharding, compilation and memory at a model's published size run through
the real loading path (config.json + safetensors, sharded loading by the rules tables).

Names, shapes and initial values all come from the weight schema (`convert.hf.expected_tensors`, which the
reader requires too; each leaf's `hf_shape` and `init`), in the layout the family publishes: Qwen3.5 as its
multimodal checkpoint (the text weights under `model.language_model.`, the text config under `text_config`;
no vision tower), the others as `*ForCausalLM`. Tensors are bf16 by default, split into shards of at most
`max_shard_bytes` as transformers' `save_pretrained` splits them (`shard_plan`): `model-0000i-of-0000k
.safetensors` with `model.safetensors.index.json`, or one `model.safetensors`.

Values: each tensor from its own generator, seeded by (seed, its name), so the bytes do not depend on the
shard size: "normal" leaves 0.02 x N(0, 1), norms their identity scale, Gated DeltaNet's A_log log U(0.01,
16) and dt_bias ones (`schema.INITS`), as transformers initialises them, so a forward stays finite. Written
shard by shard, each tensor generated in blocks of rows: peak memory is about one shard. Nothing here
reads a checkpoint back (the loader does).

    python -m spd_jax.convert.random qwen3.5-4b /tmp/qwen3.5-4b-random [--seed 0] [--max-shard-gb 2]
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from spd_jax.config import WRAPPED, ModelConfig, named_hf_dict
from spd_jax.convert.hf import VLM_PREFIX, expected_tensors
from spd_jax.models.schema import A_LOG_RANGE, Leaf

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
HF_SHARD_BYTES = 5 * 10**9  # transformers' max_shard_size of "5GB", as most published checkpoints are split
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                  "qwen3_5": "Qwen3_5ForConditionalGeneration"}
_BLOCK_ELEMENTS = 1 << 24  # float32 values generated at a time (64 MB)


def hf_config(fields: dict, multimodal: bool | None = None, dtype: str = "bfloat16") -> dict:
    """A model's HF config fields (a configs/models YAML) -> its config.json: as the family publishes it
    (multimodal None: Qwen3.5's text model inside its multimodal wrapper, `tie_word_embeddings` on the
    wrapper, which transformers honours; True/False force the wrapper or the plain text config)."""
    text = dict(fields)
    wrapper = {t: w for w, t in WRAPPED.items()}.get(text["model_type"])
    if multimodal is None:
        multimodal = wrapper is not None
    if multimodal and wrapper is None:
        raise ValueError(f"model_type {text['model_type']!r} has no multimodal checkpoint layout")
    if not multimodal:
        arch = _ARCHITECTURES.get(text["model_type"], f"{text['model_type']}ForCausalLM")
        return {"architectures": [arch], **text, "dtype": dtype}
    tie = bool(text.pop("tie_word_embeddings", False))
    return {"architectures": [_ARCHITECTURES[wrapper]], "model_type": wrapper, "text_config": text,
            "tie_word_embeddings": tie, "dtype": dtype}


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, list[str]]:
    """Tensor names (in order) with their byte sizes -> {file: its tensors}, as transformers splits and names
    a state dict (huggingface_hub's `split_state_dict_into_shards_factory`): tensors fill the current shard
    until the next would take it over the limit; a tensor over the limit by itself goes to a shard of its own
    at once; one shard is `model.safetensors`."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    shards += [current] if current else []
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}


def tensor_values(name: str, leaf: Leaf, cfg: ModelConfig, seed: int, dtype) -> np.ndarray:
    """One tensor of HF shape `leaf.hf_shape` in dtype, following `leaf.init`, from the generator of
    (seed, name); "normal" leaves are generated in blocks of rows, so at most one block is float32."""
    shape = leaf.hf_shape
    if leaf.init in ("norm", "ones", "zeros"):
        fill = {"norm": 1.0 - cfg.norm_offset, "ones": 1.0, "zeros": 0.0}[leaf.init]
        return np.full(shape, fill, dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if leaf.init == "a_log":
        return np.log(rng.uniform(*A_LOG_RANGE, size=shape)).astype(dtype)
    out = np.empty(shape, dtype)
    flat = out.reshape(shape[0], -1)
    rows = max(1, _BLOCK_ELEMENTS // max(flat.shape[1], 1))
    for a in range(0, shape[0], rows):
        b = min(a + rows, shape[0])
        flat[a:b] = (0.02 * rng.standard_normal((b - a, flat.shape[1]), dtype=np.float32)).astype(dtype)
    return out


def write_random_checkpoint(config: str | dict, out_dir: str | Path, seed: int = 0,
                            max_shard_bytes: int = HF_SHARD_BYTES, dtype: str = "bfloat16",
                            multimodal: bool | None = None) -> Path:
    """Write a seeded random HF checkpoint of `config` (a name under configs/models, or its HF config fields)
    to out_dir (created; files there of the same names are replaced) -> out_dir. The same arguments give the
    same bytes."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    fields = named_hf_dict(config) if isinstance(config, str) else dict(config)
    hf = hf_config(fields, multimodal, dtype)
    cfg = ModelConfig.from_hf_dict(hf)
    np_dtype = np.dtype(DTYPES[dtype])
    tensors = expected_tensors(cfg, VLM_PREFIX if "text_config" in hf else "model.")
    sizes = {name: int(np.prod(leaf.hf_shape)) * np_dtype.itemsize for name, leaf in tensors.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for fname, names in shards.items():  # one shard in memory at a time
        save_file({name: tensor_values(name, tensors[name], cfg, seed, np_dtype) for name in names}, out / fname,
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: fname for fname, names in shards.items() for name in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spd_jax.convert.random", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a model config under configs/models, e.g. qwen3.5-4b")
    ap.add_argument("out", help="the checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-gb", type=float, default=HF_SHARD_BYTES / 1e9, help="largest shard, in GB (1e9 B)")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    args = ap.parse_args(argv)
    print(write_random_checkpoint(args.config, args.out, args.seed, int(args.max_shard_gb * 1e9), args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
