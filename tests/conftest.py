"""Shared fixtures: tiny random Hugging Face checkpoints written to disk, and the transformers reference.

Every reference runs in PyTorch float32 with eager attention and the hub switched off.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# Pipeline tests need 8 devices; on the CPU they are host devices, set before JAX initialises.
jax.config.update("jax_num_cpu_devices", 8)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def tiny_config(model_type: str) -> dict:  # qwen3_5 -> tiny-qwen3_5.yaml
    return yaml.safe_load((CONFIGS / f"tiny-{model_type}.yaml").read_text())


def tiny_hf_model(model_type: str, tie: bool, seed: int = 0, **overrides):
    """A random transformers model of `model_type` with norm weights perturbed away from 1 and
    non-zero biases, so a mistake in any of them changes the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(tiny_config(model_type), tie_word_embeddings=tie, **overrides)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint dir src to dst and apply edit(weights: dict name -> np.ndarray) to its tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    edit(w)
    save_file(w, dst / "model.safetensors")
    return dst


def cache_free_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, each from a full forward from position 0 (no cache). Every
    forward has the final length (padded with token 0), so it compiles once: causal logits at t do not
    depend on the tokens after t."""
    import numpy as np

    seq = np.zeros((1, len(prompt) + n), np.int64)
    seq[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        seq[0, t] = int(model.logits(seq)[0, t - 1].argmax())
    return seq[0, len(prompt):].tolist()


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


# The tiny-model suite is compile bound (hundreds of small programs): XLA:CPU's backend optimisation is
# most of each compile and buys nothing at these sizes (tests/test_spd.py on 2 cores: 424 s -> 296 s).
# Paths compared for exact equality are compiled with the same flags; comparisons against transformers
# keep their tolerances (tests/tolerances.py), which cover reassociation. Runs that select the real
# model keep full optimisation: there execution, not compilation, is the cost.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    import re

    # before any test initialises the backend, which reads XLA_FLAGS once (subprocesses inherit it)
    if not re.search(r"(?<!not )real_model", config.getoption("markexpr") or ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Drop compiled programs after each test module: every live XLA CPU executable holds memory
    mappings, and a whole suite's worth exceeds the kernel's map limit (vm.max_map_count)."""
    yield
    import gc

    from spd_jax import api
    from spd_jax.decode import chain, pipelined

    api._compiled.clear()
    pipelined._compiled.clear()
    chain._compiled.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: (model_type, tie, **overrides) -> (checkpoint dir, torch model); cached per arguments."""
    made = {}

    def make(model_type: str = "llama", tie: bool = False, **overrides):
        key = (model_type, tie, repr(sorted(overrides.items())))
        if key not in made:
            m = tiny_hf_model(model_type, tie, **overrides)
            d = tmp_path_factory.mktemp(f"{model_type}_{'tied' if tie else 'untied'}")
            made[key] = (save_hf(m, d), m)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default model (converted from its packaged GGUF on first use)."""
    import spd_jax

    return spd_jax.load_model("smollm2")
