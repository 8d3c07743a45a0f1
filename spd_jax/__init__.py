"""spd-jax: Speculative Pipeline Decoding for Qwen-family language models in JAX.

Layout: `models/` model math, `convert/` checkpoints -> params, `decode/` sampling and decode loops,
`api` the public entry points re-exported here.
"""

from spd_jax.api import GenerateResult, Model, generate, generate_batch, load_model
from spd_jax.config import ConfigError, ModelConfig
from spd_jax.convert.hf import CheckpointError
from spd_jax.decode.compile_cache import enable_persistent_cache
from spd_jax.decode.sampling import Sampling

__all__ = ["CheckpointError", "ConfigError", "GenerateResult", "Model", "ModelConfig", "Sampling",
           "enable_persistent_cache", "generate", "generate_batch", "load_model"]
__version__ = "0.1.0"
