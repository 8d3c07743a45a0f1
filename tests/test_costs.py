"""The per-layer cost model counts exactly the weights the model holds, and orders layer kinds sensibly."""

import numpy as np
import pytest

import spd_jax
from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.models.costs import head_cost, layer_costs


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_layer_params_match_the_loaded_weights(tiny_ckpt, model_type):
    m = spd_jax.load_model(tiny_ckpt(model_type, False)[0])
    costs = layer_costs(m.config, context_len=100, param_bytes=4)
    for kind, stack in m.params["layers"].items():
        per_layer = sum(int(np.prod(a.shape[1:])) for a in stack.values())
        got = {c.params for c in costs if c.kind == kind}
        assert got == {per_layer}, kind
        assert {c.weight_bytes for c in costs if c.kind == kind} == {4 * per_layer}
    assert head_cost(m.config).params == m.params["embed"].size + m.params["final_norm"].size


def test_qwen3_5_4b_costs():
    cfg = ModelConfig.named("qwen3.5-4b")
    short, long = layer_costs(cfg, 128), layer_costs(cfg, 32768)
    assert [c.kind for c in short].count(LINEAR) == 24
    attn = [c for c in short if c.kind == ATTENTION][0]
    lin = [c for c in short if c.kind == LINEAR][0]
    # DeltaNet state is fixed-size; attention's KV read grows with the context.
    assert [c for c in long if c.kind == LINEAR][0].state_bytes == lin.state_bytes
    assert [c for c in long if c.kind == ATTENTION][0].state_bytes > 100 * attn.state_bytes
    # ~4B parameters in all (embeddings tied)
    total = sum(c.params for c in short) + head_cost(cfg).params
    assert 3.5e9 < total < 5e9
