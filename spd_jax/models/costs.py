"""Per-layer cost of decoding one token, for the stage partitioner and for roofline estimates.

A decode step is dominated by reading weights and caches (memory bound) on most hardware; prefill
and training by FLOPs. Both are counted per layer so a partitioner can balance stages whose layers
differ (Qwen3.5: Gated DeltaNet vs full attention). Counts are analytic, from the config alone.
"""

from __future__ import annotations

import dataclasses

from spd_jax.config import ATTENTION, ModelConfig


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


def _mlp(cfg: ModelConfig) -> tuple[int, int]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    params = 3 * H * I + 2 * H + (2 * I + H if cfg.mlp_bias else 0)  # + the two layer norms
    return params, 2 * 3 * H * I


def layer_costs(cfg: ModelConfig, context_len: int, param_bytes: int = 2, cache_bytes: int = 2) -> list[LayerCost]:
    """Cost of each layer (model order) for one token decoded at position `context_len`."""
    H = cfg.hidden_size
    mlp_params, mlp_flops = _mlp(cfg)
    out = []
    for kind in cfg.layer_types:
        if kind == ATTENTION:
            q_out = cfg.q_size * (2 if cfg.attn_gate else 1)
            proj = H * (q_out + 2 * cfg.kv_size) + cfg.q_size * H
            extra = ((cfg.q_size + 2 * cfg.kv_size) if cfg.qkv_bias else 0) + (H if cfg.o_bias else 0) + (
                2 * cfg.head_dim if cfg.qk_norm else 0)
            params = proj + extra
            # scores and weighted values over the context, per query head
            flops = 2 * proj + 2 * 2 * cfg.num_heads * cfg.head_dim * context_len
            state = 2 * cfg.kv_size * context_len * cache_bytes
        else:
            lc = cfg.linear
            proj = H * (lc.conv_dim + lc.value_size + 2 * lc.num_v_heads) + lc.value_size * H
            params = proj + lc.conv_kernel * lc.conv_dim + 2 * lc.num_v_heads + lc.v_dim
            state_elems = lc.num_v_heads * lc.k_dim * lc.v_dim
            # decay, S^T k, rank-1 update, S^T q: ~4 passes over the state, plus the conv
            flops = 2 * proj + 2 * lc.conv_kernel * lc.conv_dim + 8 * state_elems
            state = 2 * state_elems * 4 + 2 * (lc.conv_kernel - 1) * lc.conv_dim * cache_bytes  # f32 state r+w
        total = params + mlp_params
        out.append(LayerCost(kind, total, flops + mlp_flops, total * param_bytes, state))
    return out


def head_cost(cfg: ModelConfig, param_bytes: int = 2) -> LayerCost:
    """Final norm + LM head for one token."""
    p = cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    return LayerCost("lm_head", p, 2 * cfg.vocab_size * cfg.hidden_size, p * param_bytes, 0)
