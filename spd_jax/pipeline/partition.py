"""Split L decoder layers into n contiguous pipeline stages.

Three ways: uniform (n divides L), an explicit list of per-stage layer counts, or cost-balanced
(minimise the slowest stage given per-layer costs, e.g. `spd_jax.models.costs.layer_costs`, and
optionally each stage's fixed work besides its layers).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class StagePlan:
    counts: tuple[int, ...]  # layers per stage

    def __post_init__(self):
        if not self.counts or any(c < 1 for c in self.counts):
            raise ValueError(f"every stage needs at least one layer, got counts {self.counts}")

    @property
    def n(self) -> int:
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) layer range of each stage."""
        out, a = [], 0
        for c in self.counts:
            out.append((a, a + c))
            a += c
        return tuple(out)

    @property
    def max_layers(self) -> int:
        return max(self.counts)

    @property
    def depth_layers(self) -> tuple[int, ...]:
        """Layers a token has passed at depth d (after d stages), d = 0..n."""
        out = [0]
        for c in self.counts:
            out.append(out[-1] + c)
        return tuple(out)


def _check_n(num_layers: int, n: int) -> None:
    if not 1 <= n <= num_layers:
        raise ValueError(f"n={n} pipeline stages for a model of {num_layers} layers: n must be between 1 and "
                         f"{num_layers} (each stage needs at least one layer)")


def uniform(num_layers: int, n: int) -> StagePlan:
    _check_n(num_layers, n)
    if num_layers % n:
        raise ValueError(f"{num_layers} layers do not split uniformly into {n} stages; use a balanced split "
                         "or an explicit per-stage list")
    return StagePlan((num_layers // n,) * n)


def explicit(num_layers: int, counts: Sequence[int]) -> StagePlan:
    counts = tuple(int(c) for c in counts)
    _check_n(num_layers, len(counts))
    if sum(counts) != num_layers:
        raise ValueError(f"stage layer counts {list(counts)} sum to {sum(counts)}, but the model has "
                         f"{num_layers} layers")
    return StagePlan(counts)


def balanced(costs: Sequence[float], n: int, extra: Sequence[float] | None = None) -> StagePlan:
    """Contiguous split of layers with the given costs into n stages minimising the largest stage cost
    (ties broken toward equal layer counts). Exact dynamic programme, O(n L^2).

    extra [n]: fixed work of each stage besides its layers, in the costs' units (a device's embedding,
    head or PSM: `spd_jax.costs.cycle.device_aware_plan`); the largest of (its layers + extra[s]) is
    minimised then. None: no fixed work."""
    L = len(costs)
    _check_n(L, n)
    extra = [0.0] * n if extra is None else [float(e) for e in extra]
    if len(extra) != n:
        raise ValueError(f"extra needs one fixed cost per stage ({n}), got {len(extra)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max stage cost, max stage layers) splitting the first i layers into k stages
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, n + 1):
        for i in range(k, L - (n - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j] + extra[k - 1]), max(prev[1], i - j))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], L
    for k in range(n, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return StagePlan(tuple(reversed(counts)))


def plan_stages(num_layers: int, n: int, stage_layers: Sequence[int] | None = None,
                costs: Sequence[float] | None = None) -> StagePlan:
    """Explicit counts if given; else uniform when n divides L and every layer costs the same;
    else cost-balanced (costs default to one per layer)."""
    if stage_layers is not None:
        return explicit(num_layers, stage_layers)
    _check_n(num_layers, n)
    if num_layers % n == 0 and (costs is None or len(set(costs)) == 1):
        return uniform(num_layers, n)
    return balanced(costs if costs is not None else [1.0] * num_layers, n)
