"""The sampling tests' one check (tests/test_spd.py, test_mesh2d.py, test_sixteen.py): the target's warped joint
distribution of a prompt's first two tokens (temperature 1, top-k 4, from its own logits), and the chi-square of
seeded runs' pair counts against it."""

from __future__ import annotations

import numpy as np
from scipy import stats as sstats

TOP_K = 4


def warped(model, ids: list[int]) -> dict[int, float]:
    """The target's next-token distribution after ids at temperature 1 under top-k: {token: probability}."""
    lg = model.logits(np.array([ids]))[0, -1]
    keep = np.argsort(lg)[::-1][:TOP_K]
    p = np.exp(lg[keep] - lg[keep].max())
    return dict(zip(keep.tolist(), (p / p.sum()).tolist()))


class TwoTokens:
    """The joint distribution of (first, second) token after `prompt` and the test of counts against it."""

    def __init__(self, model, prompt: list[int]):
        self.first = warped(model, prompt)
        joint = {(a, b): pa * pb for a, pa in self.first.items() for b, pb in warped(model, prompt + [a]).items()}
        self.cells = sorted(joint)
        self.expected = np.array([joint[c] for c in self.cells])

    def pvalue(self, counts: dict) -> tuple[int, float]:
        """{(a, b): runs} -> (runs outside the support, the chi-square p-value of those inside)."""
        obs = np.array([counts.get(c, 0) for c in self.cells])
        return (sum(counts.values()) - int(obs.sum()),
                sstats.chisquare(obs, self.expected / self.expected.sum() * obs.sum()).pvalue)
