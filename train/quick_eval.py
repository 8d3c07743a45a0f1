"""The quick eval during training: greedy decoding with the drafter being trained on a few held-out
prompts (S0 for a PSM, tokens per round for an EAGLE-3 drafter). The learning curves of these figures are
`spd_jax.reports.plots.plot_curves`.

It only reads what the run hands it (model, variables, prompts); it trains nothing and writes nothing. The
full evaluation is infer.evaluate's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import spd_jax
from spd_jax import methods
from spd_jax.drafters import registry
from train.checkpoints import Spec
from train.config import TrainConfig


def eval_prompts(heldout: list, tc: TrainConfig, max_prompt: int = 120) -> list[np.ndarray]:
    """First-turn prompts of held-out conversations (up to the assistant header), short ones first so
    the engine compiles for few prompt buckets."""
    out = []
    for ids, mask in heldout:
        first = int(np.argmax(mask))  # mask[t]: t + 1 is the response's first token
        if mask[first] and first + 1 <= max_prompt:
            out.append(ids[:first + 1])
    return out[:tc.run.eval_prompts]


def eval_metric(spec: Spec) -> str:
    """The quick eval's headline figure: S0 (PSM) or tokens_per_round (EAGLE-3: tokens per target pass)."""
    return registry.of_config(spec).training.metric


def quick_eval(model, spec: Spec, variables: dict, prompts: list[np.ndarray], tc: TrainConfig) -> dict:
    """Greedy decoding with the drafter on the held-out prompts by the method that runs its kind, pooled over
    them as sum / sum (the paper's convention; `Training.eval_summary`). PSM: alpha and S0 of SPD at its n
    (sum(tokens) / sum(cycles)). EAGLE-3: tokens_per_round of chain decoding with k = tc.drafter.eval_k on one
    device (sum(tokens) / sum(rounds): tokens per target pass, its S0)."""
    if not prompts:
        return {}
    kind = registry.of_config(spec)
    method = dataclasses.replace(methods.of_drafter(kind), **kind.training.eval_options(spec, variables, tc.drafter))
    tokens = steps = 0
    for ids in prompts:
        res = spd_jax.generate(model, ids, tc.run.eval_tokens, method=method, stop_at_eos=False)
        tokens += res.stats["tokens"]
        steps += method.steps(res.stats)
    return kind.training.eval_summary(spec, tokens, steps, tc.drafter)
