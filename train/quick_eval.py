"""The quick eval during training and the learning curves: greedy decoding with the drafter being
trained on a few held-out prompts (S0 for a PSM, tokens per round for an EAGLE-3 drafter), and the plot
of loss, agreement and that figure against training positions (curves.png).

It only reads what the run hands it (model, variables, prompts, metrics.jsonl); it trains nothing and
writes only the figure. The full evaluation is infer.evaluate's.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator

import spd_jax
from spd_jax.distributed import to_host
from spd_jax.drafters.eagle3 import Eagle3Config
from train.checkpoints import Spec
from train.config import TrainConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- after the backend is chosen: no display is needed


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
    return "tokens_per_round" if isinstance(spec, Eagle3Config) else "S0"


def quick_eval(model, spec: Spec, variables: dict, prompts: list[np.ndarray], tc: TrainConfig) -> dict:
    """Greedy decoding with the drafter on the held-out prompts, pooled over them as sum / sum (the
    paper's convention). PSM: alpha and S0 of SPD at its n (sum(tokens) / sum(cycles)). EAGLE-3:
    tokens_per_round of chain decoding with k = tc.drafter.eval_k on one device (sum(tokens) / sum(rounds):
    tokens per target pass, its S0)."""
    if not prompts:
        return {}
    if isinstance(spec, Eagle3Config):
        # the state is replicated over the training mesh; the chain runs on this process's default device
        local = jax.tree.map(lambda a: jnp.asarray(to_host(a)), variables)
        tokens = rounds = 0
        for ids in prompts:
            res = spd_jax.generate(model, ids, tc.run.eval_tokens, method="eagle3", k=tc.drafter.eval_k,
                                   drafter_spec=(spec, local), stop_at_eos=False)
            tokens += res.stats["tokens"]
            rounds += res.stats["rounds"]
        return dict(tokens_per_round=tokens / rounds if rounds else float("nan"), eval_tokens=tokens,
                    eval_rounds=rounds, eval_k=tc.drafter.eval_k)
    tokens = cycles = 0
    for ids in prompts:
        res = spd_jax.generate(model, ids, tc.run.eval_tokens, method="spd", n=spec.n, stage_layers=spec.plan,
                               spec=(spec, variables), stop_at_eos=False)
        tokens += res.stats["tokens"]
        cycles += res.stats["cycles"]
    alpha = tokens / cycles
    return dict(alpha=alpha, S0=alpha * sum(spec.plan) / max(spec.plan), eval_tokens=tokens, eval_cycles=cycles)


def positions_axis(ax) -> None:
    """Training positions on ax's x axis as 50k, 1.5M, 2B (full numbers overlap at the plots' widths)."""
    def short(x, _):
        scale, suffix = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "k")) if abs(x) >= s), (1, ""))
        return f"{x / scale:g}{suffix}"

    ax.xaxis.set_major_formatter(FuncFormatter(short))
    if ax.get_xscale() == "log":  # within one decade only minor ticks fall in range: label a few of them
        ax.xaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
        ax.xaxis.set_minor_formatter(FuncFormatter(short))


def plot_curves(metrics_path: Path, png: Path) -> None:
    """Loss, agreement and the quick eval (S0, or an EAGLE-3 drafter's tokens per round) against
    training positions."""
    rows = [json.loads(r) for r in Path(metrics_path).read_text().splitlines() if r.strip()]
    if not rows:
        return
    pos = [r["positions"] for r in rows]
    chain = any("tokens_per_round" in r or "agreement_by_step" in r for r in rows)
    key = "tokens_per_round" if chain else "S0"
    ev = [r for r in rows if key in r]
    # a run without a quick eval (fewer devices than stages, or none fell due) gets no empty third panel
    fig, ax = plt.subplots(1, 3 if ev else 2, figsize=(13, 3.6) if ev else (9, 3.6))
    ax[0].plot(pos, [r["loss"] for r in rows])
    ax[0].set(title="KL(teacher || drafter) per unrolled step" if chain else "KL(teacher || PSM)",
              xlabel="training positions", yscale="log")
    ax[1].plot(pos, [r["agreement"] for r in rows])
    ax[1].set(title="top-1 agreement (train, 1st draft step)" if chain else "top-1 agreement (train batches)",
              xlabel="training positions")
    if ev:
        ax[2].plot([r["positions"] for r in ev], [r[key] for r in ev], "o-")
        ax[2].set(title=f"tokens/round, chain k={ev[0].get('eval_k', '?')}, held-out (greedy)" if chain
                  else "S0 on held-out prompts (greedy)", xlabel="training positions")
    for a in ax:
        a.grid(alpha=0.3)
        positions_axis(a)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)