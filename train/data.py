"""Training sequences for the PSM: prompt + response token ids with a mask of response positions.

The PSM is trained only where the next token is a response token (SPD.md section 6), and only on
training data: GSM8K's train split here (never the benchmark prompts). Files are read in place from
../shared/data; nothing is copied into the repository.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

# ../shared/data beside the repository; SPD_JAX_DATA points elsewhere.
DATA_ROOT = Path(os.environ.get("SPD_JAX_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")


def read_gsm8k(split: str = "train", root: Path = DATA_ROOT) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs of GSM8K's `split` ("train" or "test")."""
    path = Path(root) / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the data lives in ../shared/data beside the repository "
                                "(or set SPD_JAX_DATA to its folder)")
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
