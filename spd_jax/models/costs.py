"""Per-layer cost of decoding one token, for the stage partitioner and for roofline estimates.

A decode step is dominated by reading weights and caches (memory bound) on most hardware; prefill
and training by FLOPs. Both are counted per layer so a partitioner can balance stages whose layers
differ (Qwen3.5: Gated DeltaNet vs full attention). Counts are analytic, from the config alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spd_jax.config import ATTENTION, ModelConfig
from spd_jax.models import schema


@dataclasses.dataclass(frozen=True)
class LayerCost:
    kind: str
    params: int  # weights of this layer (norms included)
    flops: int  # per decoded token (multiply-add = 2)
    weight_bytes: int  # weights read per decoded token
    state_bytes: int  # cache/state read (+ written) per decoded token at the given context length

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.state_bytes

    def seconds(self, flops_per_s: float, bytes_per_s: float) -> float:
        """Roofline time of one token through this layer."""
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)


def _matmul_params(leaves: dict[str, schema.Leaf]) -> int:
    """Weights used as matmul operands (one multiply-add each per token): every 2-D leaf but the
    depthwise conv kernel."""
    return sum(int(np.prod(leaf.shape)) for leaf in leaves.values()
               if len(leaf.shape) == 2 and leaf.transform is not schema.CONV)


def layer_costs(cfg: ModelConfig, context_len: int, param_bytes: int = 2, cache_bytes: int = 2) -> list[LayerCost]:
    """Cost of each layer (model order) for one token decoded at position `context_len`. Parameter
    counts and projection FLOPs come from the weight schema; the mixers' context terms are added here."""
    per_kind = {}
    for kind in schema.layer_kinds(cfg):
        leaves = schema.layer_schema(cfg, kind)
        params, flops = schema.param_count(leaves), 2 * _matmul_params(leaves)
        if kind == ATTENTION:
            # scores and weighted values over the context, per query head
            flops += 2 * 2 * cfg.num_heads * cfg.head_dim * context_len
            state = 2 * cfg.kv_size * context_len * cache_bytes
        else:
            lc = cfg.linear
            state_elems = lc.num_v_heads * lc.k_dim * lc.v_dim
            # decay, S^T k, rank-1 update, S^T q: ~4 passes over the state, plus the conv
            flops += 2 * lc.conv_kernel * lc.conv_dim + 8 * state_elems
            state = 2 * state_elems * 4 + 2 * (lc.conv_kernel - 1) * lc.conv_dim * cache_bytes  # f32 state r+w
        per_kind[kind] = LayerCost(kind, params, flops, params * param_bytes, state)
    return [per_kind[kind] for kind in cfg.layer_types]


def head_cost(cfg: ModelConfig, param_bytes: int = 2) -> LayerCost:
    """Final norm + LM head for one token."""
    g = schema.global_schema(cfg)
    p = int(np.prod(g["embed"].shape)) + int(np.prod(g["final_norm"].shape))
    return LayerCost("lm_head", p, 2 * cfg.vocab_size * cfg.hidden_size, p * param_bytes, 0)
