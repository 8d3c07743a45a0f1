"""The Pipeline Speculation Module (PSM): a small drafter that reads hidden states at several depths.

Input rows, one per position: a token whose hidden states are known up to anchor b_a is projected by
its aggregation type a: g_a = W_a concat(h_{b_0}, ..., h_{b_a}) (h_0 = the embedding). Completed
tokens use the deepest type; an in-flight token at depth d uses f(d), the deepest type whose anchors
it already has (the "depth staircase"). The rows run through Ls full-attention decoder layers of the
target's kind (own KV cache, RoPE at absolute positions), the target's final norm (frozen, shared)
and an LM head initialised from the target's. Only the newest row's output is a draft.

The module is used the same way by the SPD engine (inside its jitted step) and by training, so the
two cannot drift apart. Checkpoints are orbax + a JSON sidecar naming the target and pipeline depth
they were trained for; loading one for another model or n is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from spd_jax.config import ATTENTION, ModelConfig
from spd_jax.models import decoder
from spd_jax.models.attention import KVCache, init_kv_cache
from spd_jax.models.layers import rms_norm


def default_anchors(num_layers: int) -> tuple[int, ...]:
    """The paper's anchors (0, 8, 16, 24, 31 for L = 32) scaled to L: quarters of the depth and the
    last layer's input (strictly increasing, duplicates dropped for tiny L)."""
    raw = [round(i * num_layers / 4) for i in range(4)] + [num_layers - 1]
    return tuple(sorted(set(b for b in raw if 0 <= b < num_layers)))


@dataclasses.dataclass(frozen=True)
class PSMConfig:
    anchors: tuple[int, ...]
    num_layers: int  # Ls
    n: int  # pipeline depth the staircase is built for
    target: tuple  # (model_type, hidden, layers, vocab, heads, kv heads): the target it belongs to

    @classmethod
    def for_target(cls, cfg: ModelConfig, n: int, num_layers: int = 2,
                   anchors: tuple[int, ...] | None = None) -> "PSMConfig":
        anchors = tuple(anchors) if anchors is not None else default_anchors(cfg.num_layers)
        if anchors[0] != 0 or list(anchors) != sorted(set(anchors)) or anchors[-1] >= cfg.num_layers + 1:
            raise ValueError(f"anchors must start at 0, increase strictly and stay <= {cfg.num_layers}: {anchors}")
        if num_layers < 1:
            raise ValueError(f"the PSM needs at least one layer, got {num_layers}")
        return cls(anchors, num_layers, n, target_signature(cfg))

    @property
    def m(self) -> int:
        return len(self.anchors)

    def staircase(self, depth_layers: tuple[int, ...]) -> tuple[int, ...]:
        """f(d) for d = 0..n-1 given the layers a token has passed at each depth, then the deepest
        type (completed tokens) as entry n."""
        f = [max(a for a, b in enumerate(self.anchors) if b <= depth_layers[d]) for d in range(len(depth_layers) - 1)]
        return tuple(f) + (self.m - 1,)


def target_signature(cfg: ModelConfig) -> tuple:
    return (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads)


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One full-attention decoder layer of the target's kind (see `spd_jax.models.decoder`)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    s = {"attn_norm": (H,), "mlp_norm": (H,), "wq": (H, cfg.q_size), "wk": (H, cfg.kv_size),
         "wv": (H, cfg.kv_size), "wo": (cfg.q_size, H), "w_gate": (H, I), "w_up": (H, I), "w_down": (I, H)}
    if cfg.attn_gate:
        s["wq_gate"] = (H, cfg.q_size)
    if cfg.qk_norm:
        s |= {"q_norm": (D,), "k_norm": (D,)}
    if cfg.qkv_bias:
        s |= {"bq": (cfg.q_size,), "bk": (cfg.kv_size,), "bv": (cfg.kv_size,)}
    if cfg.o_bias:
        s["bo"] = (H,)
    if cfg.mlp_bias:
        s |= {"b_gate": (I,), "b_up": (I,), "b_down": (H,)}
    return s


class PSM(nn.Module):
    cfg: ModelConfig  # the target's
    spec: PSMConfig

    def setup(self):
        H, Ls = self.cfg.hidden_size, self.spec.num_layers
        self.proj = [nn.Dense(H, use_bias=False, name=f"proj_{a}") for a in range(self.spec.m)]
        norm_one = 1.0 - self.cfg.norm_offset  # weights that make a norm the identity scale

        def init_for(name):
            if name.endswith("norm"):
                return lambda key, shape: jnp.full(shape, norm_one, jnp.float32)
            if name.startswith("b"):
                return nn.initializers.zeros
            return nn.initializers.normal(0.02)

        self.layers = {k: self.param(f"layer_{k}", init_for(k), (Ls, *shape))
                       for k, shape in _layer_shapes(self.cfg).items()}
        self.lm_head = self.param("lm_head", nn.initializers.normal(0.02), (self.cfg.vocab_size, H))

    def rows(self, h: jax.Array, types: jax.Array) -> jax.Array:
        """h [..., m, H] anchor states (absent ones may be anything: they are not read); types [...]
        -> rows [..., H]."""
        H, m = self.cfg.hidden_size, self.spec.m
        outs = [self.proj[a](h[..., :a + 1, :].reshape(*h.shape[:-2], (a + 1) * H)) for a in range(m)]
        return jnp.take_along_axis(jnp.stack(outs, -2), types[..., None, None], axis=-2)[..., 0, :]

    def forward(self, rows: jax.Array, cache: KVCache, pos: jax.Array, length: jax.Array | None = None):
        """rows [B, T, H] at positions [pos, pos+T) over the PSM's own cache -> (hidden [B, T, H], cache)."""
        kinds = (ATTENTION,) * self.spec.num_layers
        x, c, _ = decoder.run_layers({ATTENTION: self.layers}, rows.astype(self.lm_head.dtype),
                                     decoder.Cache(cache, None), pos, self.cfg, kinds, length=length)
        return x, c.kv

    def logits(self, x: jax.Array, final_norm: jax.Array) -> jax.Array:
        """x [..., H] -> float32 logits [..., V] (the target's final norm, the PSM's head)."""
        x = rms_norm(x, final_norm, self.cfg.rms_norm_eps, self.cfg.norm_offset)
        return jnp.einsum("...h,vh->...v", x, self.lm_head, preferred_element_type=jnp.float32)

    def __call__(self, h, types, cache, pos, final_norm):
        x, cache = self.forward(self.rows(h, types)[None], cache, pos)
        return self.logits(x[0], final_norm), cache


def init_psm(cfg: ModelConfig, spec: PSMConfig, target_params: dict, seed: int = 0, dtype=jnp.float32) -> dict:
    """Random PSM weights with the LM head copied from the target's."""
    params = jax.tree.map(lambda t: t.astype(dtype), _init_random(cfg, spec, seed))
    head = target_params["embed"] if cfg.tie_word_embeddings else target_params["lm_head"]
    params["lm_head"] = jnp.asarray(head, dtype)
    return {"params": params}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_random(cfg: ModelConfig, spec: PSMConfig, seed) -> dict:
    H, T = cfg.hidden_size, 2
    cache = init_kv_cache(cfg, spec.num_layers, 1, T, jnp.float32)
    return PSM(cfg, spec).init(jax.random.key(seed), jnp.zeros((T, spec.m, H)), jnp.zeros((T,), jnp.int32), cache,
                               jnp.int32(0), jnp.ones((H,), jnp.float32))["params"]


class PSMCheckpointError(ValueError):
    """A PSM checkpoint that does not belong to this target model or pipeline depth."""


def save_psm(path: str | Path, variables: dict, spec: PSMConfig) -> None:
    """Write variables (orbax) and the spec (JSON) to a new directory `path`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise FileExistsError(f"{path} exists; save the PSM to a new directory")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", variables)
    ckptr.wait_until_finished()
    (path / "psm.json").write_text(json.dumps(dataclasses.asdict(spec)))


def load_psm(path: str | Path, cfg: ModelConfig, n: int, dtype=jnp.float32) -> tuple[PSMConfig, dict]:
    """Load a PSM saved by `save_psm`, refusing one trained for another target model or n."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = path / "psm.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a PSM checkpoint (no psm.json); train one with train.main")
    d = json.loads(meta.read_text())
    spec = PSMConfig(tuple(d["anchors"]), int(d["num_layers"]), int(d["n"]), tuple(d["target"]))
    want = target_signature(cfg)
    if spec.target != want:
        names = ("model_type", "hidden_size", "num_layers", "vocab_size", "num_heads", "num_kv_heads")
        diff = [f"{k}: checkpoint {a} vs model {b}" for k, a, b in zip(names, spec.target, want) if a != b]
        raise PSMCheckpointError(f"PSM checkpoint {path} was trained for another model ({'; '.join(diff)})")
    if spec.n != n:
        raise PSMCheckpointError(f"PSM checkpoint {path} was trained for n={spec.n} pipeline stages, not n={n}; "
                                 f"run with --n {spec.n} or train a PSM for n={n}")
    abstract = jax.eval_shape(lambda: init_psm(cfg, spec, _zeros_target(cfg)))
    variables = ocp.StandardCheckpointer().restore(path / "params", abstract)
    return spec, jax.tree.map(lambda t: jnp.asarray(t, dtype), variables)


def _zeros_target(cfg: ModelConfig) -> dict:
    z = {"embed": jnp.zeros((cfg.vocab_size, cfg.hidden_size)), "final_norm": jnp.zeros((cfg.hidden_size,))}
    if not cfg.tie_word_embeddings:
        z["lm_head"] = z["embed"]
    return z

