"""Training sequences for the PSM: prompt + response token ids with a mask of response positions.

The PSM is trained only where the next token is a response token (SPD.md section 6), and only on
training data: GSM8K's train split here (never the benchmark prompts). The files ship in the
repository's data/ (sources, licences and checksums in data/README.md); `data_path` finds them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

REPO_DATA = Path(__file__).resolve().parents[1] / "data"
# A workspace copy beside the repository, used only for a file the repository's data/ lacks.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def data_roots() -> list[Path]:
    """Where data files are looked for, in order: $SPD_JAX_DATA alone when set (read at each call,
    so it can change at run time), else the repository's data/, then ../shared/data."""
    env = os.environ.get("SPD_JAX_DATA")
    return [Path(env)] if env else [REPO_DATA, SHARED_DATA]


def data_path(relative: str | Path, roots: list[Path] | None = None) -> Path:
    """The first existing roots[i] / relative (default roots: `data_roots()`), e.g. "gsm8k/train.jsonl"."""
    tried = [Path(r) / relative for r in (data_roots() if roots is None else roots)]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"data file {str(relative)!r} not found; looked for: {', '.join(map(str, tried))}. It ships in the "
        f"repository's data/ folder ({REPO_DATA}); restore it with `git checkout -- data`, or set "
        "SPD_JAX_DATA to a folder holding it.")


def read_gsm8k(split: str = "train", root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs of GSM8K's `split` ("train" or "test"); root: a data folder to use
    instead of `data_roots()`."""
    path = data_path(f"gsm8k/{split}.jsonl", None if root is None else [Path(root)])
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield row["question"], row["answer"]


def encode_example(model, prompt: str, response: str, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids [T], loss_mask [T]) where loss_mask[t] says position t predicts a response token
    (t + 1 is in the response). The prompt goes through the chat template when the tokenizer has one."""
    prompt_ids = model.encode(prompt)
    response_ids = model.tokenizer.encode(response, add_special_tokens=False) + list(model.eos_token_ids[:1])
    ids = (prompt_ids + response_ids)[:max_len]
    mask = np.zeros(len(ids), bool)
    mask[len(prompt_ids) - 1:len(ids) - 1] = True
    return np.asarray(ids, np.int32), mask
