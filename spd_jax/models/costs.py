"""Per-layer cost of decoding one token, for the stage partitioner and for roofline estimates; also the
embedding, the LM head and the PSM's draft (the parts `spd_jax.costs.cycle` times per SPD cycle).

A decode step is dominated by reading weights and caches (memory bound) on most hardware; prefill
and training by FLOPs. Both are counted per layer so a partitioner can balance stages whose layers
differ (Qwen3.5: Gated DeltaNet vs full attention). Counts are analytic, from the config alone.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from spd_jax.config import ModelConfig
from spd_jax.models import schema
from spd_jax.models import kinds
from spd_jax.models.kinds import FULL_ATTENTION, KINDS


@dataclasses.dataclass(frozen=True)
class LayerCost:
    kind: str
    params: int  # weights of this layer (norms included)
    flops: int  # per decoded token (multiply-add = 2)
    weight_bytes: int  # weights read per decoded token
    # cache/state read (+ written), and attention's scores, per decoded token at the given context length
    state_bytes: int

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
               if len(leaf.shape) == 2 and "conv_kernel" not in leaf.axes)


def kind_cost(cfg: ModelConfig, kind: str, context_len: int, param_bytes: int = 2, cache_bytes: int = 2,
              rows: int = 1, query_rows: int | None = None) -> LayerCost:
    """One layer of `kind` run on a block of `rows` tokens ending at position `context_len`: the weights and the
    cache are read once for the block (what a decode step or the PSM's per-cycle block does); FLOPs and the
    scores (`LayerKind.scores_bytes`) scale with the rows. With `query_rows` (1 .. rows) only that many run the
    layer past their projections (a drafter's last layer, whose newest row alone goes on; `attention.attention`'s
    `query`): the rest run the kind's `every_row_leaves` only. Parameter counts and projection FLOPs come from
    the weight schema; the mixer's context terms and cache bytes from the kind (`LayerKind.context_flops`,
    `.state_bytes`)."""
    k = KINDS[kind]
    leaves = k.schema(cfg)
    q = rows if query_rows is None else query_rows
    if not 1 <= q <= rows or (q != rows and not k.every_row_leaves):
        raise ValueError(f"query_rows {q} of {rows} rows: a {kind} layer runs 1 to all of its rows"
                         + ("" if k.every_row_leaves else ", all of them for this kind"))
    every = 2 * _matmul_params({name: leaves[name] for name in k.every_row_leaves})
    full = 2 * _matmul_params(leaves) + k.context_flops(cfg, context_len)
    params = schema.param_count(leaves)
    return LayerCost(kind, params, rows * every + q * (full - every), params * param_bytes,
                     k.state_bytes(cfg, context_len, cache_bytes) + k.scores_bytes(cfg, context_len, q))


def layer_costs(cfg: ModelConfig, context_len: int, param_bytes: int = 2, cache_bytes: int = 2) -> list[LayerCost]:
    """Cost of each layer (model order) for one token decoded at position `context_len`."""
    per_kind = {k.name: kind_cost(cfg, k.name, context_len, param_bytes, cache_bytes) for k in kinds.of(cfg)}
    return [per_kind[kind] for kind in cfg.layer_types]


def head_cost(cfg: ModelConfig, param_bytes: int = 2, vocab_rows: int | None = None) -> LayerCost:
    """Final norm + LM head for one token; `vocab_rows` (default V) rows of the head, e.g. a PSM's draft
    vocabulary V'. Its params are the head's [vocab_rows, H] and the final norm's [H]."""
    g = schema.global_schema(cfg)
    V = cfg.vocab_size if vocab_rows is None else int(vocab_rows)
    p = V * g["embed"].shape[1] + int(np.prod(g["final_norm"].shape))
    return LayerCost("lm_head", p, 2 * V * cfg.hidden_size, p * param_bytes, 0)


def embed_cost(cfg: ModelConfig, param_bytes: int = 2) -> LayerCost:
    """The embedding lookup of one token: one row of the table read. Its params are the table's, except
    with tied embeddings, where the table is the LM head's and `head_cost` counts it."""
    H = cfg.hidden_size
    params = 0 if cfg.tie_word_embeddings else int(np.prod(schema.global_schema(cfg)["embed"].shape))
    return LayerCost("embed", params, 0, H * param_bytes, 0)


def psm_costs(cfg: ModelConfig, num_layers: int, num_anchors: int, draft_vocab: int, rows: int, context_len: int,
              param_bytes: int = 2, cache_bytes: int = 2, projected: Sequence[int] | None = None) -> list[LayerCost]:
    """One draft of the Pipeline Speculation Module (`spd_jax.drafters.psm`, its fields passed plain so
    the models stay free of the drafter): [projections, Ls layers, head].

    - projections: the m aggregation types W_a [(a+1) H, H]; `projected` lists the type of each row projected,
      each by its own type only (`PSM.block_rows`: the in-flight depths' types and the completed rows'),
      default every type at every one of the `rows` rows. The types listed are read, once each;
    - Ls full-attention layers of the target's kind over the `rows`-row block (n + 1 rows per cycle with
      a full pipeline), weights and its own KV cache (about `context_len` completed rows) read once; the
      last layer's attention, output projection and MLP on the newest row only (what the draft reads);
    - the head on the newest row only: V' = `draft_vocab` rows (0: the target's V), and the target's
      final norm, which is shared, so read but not counted in the PSM's params.
    The rows' embedding gathers (rows x H) are left out: negligible next to the rest."""
    H, m = cfg.hidden_size, num_anchors
    proj_params = H * H * m * (m + 1) // 2  # sum over a of (a + 1) H x H
    projected = [a for a in range(m) for _ in range(rows)] if projected is None else list(projected)
    if any(not 0 <= a < m for a in projected):
        raise ValueError(f"projected row types must be in 0..{m - 1}, got {projected}")
    macs, read = sum((a + 1) * H * H for a in projected), sum((a + 1) * H * H for a in set(projected))
    proj = LayerCost("psm_proj", proj_params, 2 * macs, read * param_bytes, rows * m * H * cache_bytes)
    layer = kind_cost(cfg, FULL_ATTENTION.name, context_len, param_bytes, cache_bytes, rows)
    last = kind_cost(cfg, FULL_ATTENTION.name, context_len, param_bytes, cache_bytes, rows, query_rows=1)
    layers = [dataclasses.replace(c, kind="psm_layer") for c in [layer] * (num_layers - 1) + [last]]
    head = head_cost(cfg, param_bytes, draft_vocab or cfg.vocab_size)
    head = dataclasses.replace(head, kind="psm_head", params=head.params - H)  # the norm is the target's
    return [proj, *layers, head]
