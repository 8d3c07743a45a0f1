"""The PSM as the SPD engine's drafter (`drafters.base.SpdDrafter`): what `decode.spd` runs each cycle.
It holds no weights (they are params passed in) and knows nothing of checkpoints."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from spd_jax.config import ModelConfig
from spd_jax.drafters.psm.model import PSM, PSMConfig
from spd_jax.drafters.shared import init_layer_caches, module_params, sharded_head, split_layers


# Completed rows in a draft block, at most: `decode.spd` verifies one token per cycle, so `completed` moves by
# one and `cached` (the last cycle's `completed`) trails it by at most one (`PSM.block_rows`).
BLOCK_COMPLETED_ROWS = 1


@dataclasses.dataclass(frozen=True)
class PSMDrafter:
    """The PSM as the SPD engine's drafter (`drafters.base.SpdDrafter`): its state is its KV cache of
    completed rows; each cycle it recomputes the block of rows from the first uncached position to the
    newest token (completed rows of the deepest type, in-flight rows typed by their depth) on the
    drafter's device (`spd_draft`), and its head runs on every device's shard (`spd_head`). params:
    `init_psm` / `load_psm`'s variables as `engine_params` lays them out (its layers one buffer each)."""

    cfg: ModelConfig  # the target's
    spec: PSMConfig
    k: int = 1

    @property
    def anchors(self) -> tuple[int, ...]:
        return self.spec.anchors

    @property
    def plan(self) -> tuple[int, ...]:
        return self.spec.plan

    @property
    def reads_target_head(self) -> bool:  # `PSMConfig.reads_target_head`
        return self.spec.reads_target_head

    @property
    def after_stage(self) -> None:  # it drafts from the states at the start of the cycle (early start)
        return None

    @property
    def module(self) -> PSM:
        return PSM(self.cfg, self.spec, per_layer=True)

    def engine_params(self, variables: dict) -> dict:
        return split_layers(variables)

    def init(self, params, cache_len: int, dtype):
        return init_layer_caches(self.cfg, self.spec.num_layers, cache_len, dtype, per_layer=True)

    def _module_params(self, params: dict) -> dict:
        return module_params(params, self.cfg, self.spec.draft_vocab)

    def spd_prefill(self, params, state, anchor_states, ops):
        params = self._module_params(params)

        def prefill(cache):  # the rows meet the (per-device) cache in the layers: cast them first
            return self.module.apply(params, ops.vary(jnp.moveaxis(anchor_states, 0, 1)), cache,
                                     method=PSM.prefill)

        return ops.on_device(prefill, lambda cache: cache, state)

    def spd_draft(self, params, state, cycle, ops):
        params = self._module_params(params)
        n, W = self.spec.n, cycle.table.shape[0]
        pos = cycle.cached + jnp.arange(n + 1)  # cached <= completed <= t <= cached + n

        def body(cache):  # the rows' h_0 is the tokens' embeddings, which the engine keeps by position
            h = cycle.table[pos % W].at[:, 0].set(cycle.embeds[pos % W])  # [n + 1, m, H]
            return self.module.apply(params, ops.vary(h), cache, cycle.cached, cycle.t, cycle.completed,
                                     BLOCK_COMPLETED_ROWS, method=PSM.draft_hidden)

        return ops.on_device(body, lambda cache: (ops.vary(jnp.zeros((self.cfg.hidden_size,), cycle.table.dtype)),
                                                  cache), state)

    def spd_head(self, params, h, cycle, ops):
        ids = self.module.apply(self._module_params(params), method=PSM.token_ids) if self.spec.draft_vocab else None
        return sharded_head(params, h, ops.final_norm, self.cfg), ids
