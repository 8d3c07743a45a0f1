"""The SPD engine's greedy schedule, replayed from per-draft verdicts.

Under greedy decoding the committed sequence is the target's own greedy continuation, whatever the
drafts. A draft is verified only when every token in flight before it was accepted (a rejection
flushes the later ones), so each verified draft is the one the PSM makes on that known sequence, with
newest token t and fill k (tokens in flight): what the teacher-forced training forward computes at
(t, k) (`PSM.train_hidden`, tested equal to the engine's draft). Given which of those drafts are right,
the engine's cycles, accepted and rejected drafts follow without running it: `replay_greedy` walks
`decode.spd`'s cycle (state for state: newest position, stage occupancy, completed prefix, budget,
EOS). It is checked against the engine in tests/test_replay.py, and against measured
`infer.evaluate` rows by `infer.replay`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Replay:
    tokens: int  # committed after the prompt (the prefill's first token counted), as the engine reports
    cycles: int
    accepted: int
    rejected: int
    verified_fill: np.ndarray  # [n] int: verified drafts by the fill they were made at (1..n)
    accepted_fill: np.ndarray  # [n] int: of those, the accepted ones


def replay_greedy(n: int, seq: Sequence[int], prompt_len: int, right: np.ndarray, max_new: int,
                  eos_ids: Sequence[int]) -> Replay:
    """The engine's greedy run at n stages on the target's greedy continuation.

    seq [S]: prompt (prompt_len tokens) then the target's greedy tokens, at least up to EOS or max_new
    of them; right [S, n] bool: right[t, k - 1] when the draft for t + 1 made with newest token t at
    fill k equals seq[t + 1]. -> the run's counts, as `spd_jax.generate` reports them in its stats."""
    seq = np.asarray(seq)
    eos = set(int(e) for e in eos_ids)
    P, last, budget_end = prompt_len, n - 1, prompt_len + max_new
    if len(seq) <= P:
        raise ValueError("seq holds no generated token after the prompt: pass the prompt and its continuation")
    t, completed, n_commit = P, P, P + 1
    valid = [True] + [False] * (n - 1)  # valid[s]: stage s holds the token at t - s
    token_right: dict[int, bool] = {}  # position -> its token (a draft, or committed) is the target's
    cycles = accepted = rejected = 0
    verified_fill, accepted_fill = np.zeros(n, np.int64), np.zeros(n, np.int64)
    fill_of: dict[int, int] = {}  # a draft's position -> the fill it was made at
    done = int(seq[P]) in eos or max_new <= 1
    while not done and cycles < max_new * n + n + 2:  # the engine's safety bound
        can_draft = t + 1 < budget_end
        if can_draft:
            fill = t - completed + 1
            draft_right = bool(right[t, fill - 1]) if t + 1 < len(seq) else False
        verified = valid[last]
        p1 = t - last + 1  # the position the token leaving the last stage decides
        has_next = valid[last - 1] if n > 1 else False
        ok = verified and has_next and token_right[p1]
        replace = verified and not ok
        if verified and has_next:
            verified_fill[fill_of[p1] - 1] += 1
            accepted_fill[fill_of[p1] - 1] += ok
        draft_ok = can_draft and not replace
        if draft_ok:
            token_right[t + 1], fill_of[t + 1] = draft_right, fill
        if verified:
            n_commit, completed = p1 + 1, p1
            if p1 >= len(seq):
                raise ValueError(f"seq ends at {len(seq)} tokens but the run commits position {p1}: pass the "
                                 "continuation up to EOS or max_new tokens")
        valid = [True] + [False] * (n - 1) if replace else [draft_ok] + valid[:-1]
        t = p1 if replace else t + 1
        cycles += 1
        accepted += ok
        rejected += replace and has_next
        done = (verified and int(seq[p1]) in eos) or n_commit - P >= max_new
    return Replay(n_commit - P, cycles, int(accepted), int(rejected), verified_fill, accepted_fill)
