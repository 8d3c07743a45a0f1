"""The teacher-feature cache: the frozen target's anchor states and last hidden state of every training
sequence, written to disk the first time a run computes them, so that a later pass over the same data
(a second epoch, a rerun with another learning rate) runs only the PSM (`TrainConfig.teacher_cache`).

What is stored is exactly what the step's teacher forward returned (float32, or bfloat16's bits), and
the teacher's greedy token (the argmax over the whole vocabulary) at each response position: the LM head
recomputes the teacher's logits from the last hidden state, so a cached pass trains on the values the
first pass computed, and with a draft vocabulary it computes only those V' rows (the stored argmax
stands in for the whole head's, which top-1 agreement and `hard_weight` are measured against). An
uncached run recomputes them in another batch (another padded length, other neighbours), which XLA may
reduce in another order: the two agree to float32's last bits (tests/test_train_loop.py), not bit for bit.

One directory per (training sequences and their loss masks, target, anchors, dtype), under the corpus
cache. An anchor at the target's depth L (h_L, the last layer's output) is the last hidden state the cache
keeps anyway, so it is not stored twice, nor keyed: PSMs with and without h_L read one cache.

    teacher-<key>/meta.json      what the key stands for, shapes and sizes (checked on opening)
    teacher-<key>/features.npy   [tokens, m' + 1, H]: the m' anchor states below L, then the last layer's output
    teacher-<key>/argmax.npy     [tokens] int32: the teacher's greedy next token where t + 1 is a response
                                 token (the loss's query positions), -1 elsewhere
    teacher-<key>/filled.npy     [sequences] bool: whose rows are written

Rows are flushed before their flag, so a run killed mid-write leaves a sequence unflagged and the next
run recomputes it. One process writes: train.main refuses the cache in a multi-process job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import ml_dtypes
import numpy as np

from train.data import hash_sequences

# 2: the teacher's argmax at the query positions stored beside the features, the masks in the key; a
# version-1 directory is not read (its key differs): the first run recomputes, the old one can be deleted
VERSION = 2
STORED = {"float32": np.float32, "bfloat16": np.uint16}  # bfloat16 kept as its bits: .npy has no bfloat16


def cache_key(corpus: Sequence[tuple[np.ndarray, np.ndarray]], model_path: str, anchors: Sequence[int],
              hidden: int, dtype: str) -> str:
    """What the features depend on: every sequence's tokens and loss mask (in order: the mask places the
    stored argmax), the target, its anchors, the dtype."""
    h = hashlib.sha256(json.dumps([VERSION, str(model_path), list(anchors), hidden, dtype]).encode())
    return hash_sequences(corpus, h).hexdigest()[:16]


class TeacherCache:
    """The features of `corpus` ([(ids [T_i], mask)], the run's training sequences in Batches' indexing)
    under directory / f"teacher-{key}"; created (sparse, all unfilled) when it does not exist. anchors may
    end at num_layers (h_L): that state is read from the stored last hidden state."""

    def __init__(self, directory: Path, corpus: Sequence[tuple[np.ndarray, np.ndarray]], model_path: str,
                 anchors: Sequence[int], hidden: int, dtype: str, num_layers: int):
        if dtype not in STORED:
            raise ValueError(f"teacher_cache stores float32 or bfloat16 features, not {dtype!r}")
        self.dtype = dtype
        self.offsets = np.cumsum([0] + [len(ids) for ids, _ in corpus])
        self.reads_last = bool(anchors) and anchors[-1] == num_layers  # h_L: the stored last hidden state
        anchors = list(anchors[:-1] if self.reads_last else anchors)
        self.width = len(anchors) + 1  # the anchor states below L, then the last hidden state
        meta = dict(version=VERSION, model=str(model_path), anchors=list(anchors), hidden=hidden, dtype=dtype,
                    sequences=len(corpus), tokens=int(self.offsets[-1]))
        self.path = Path(directory) / f"teacher-{cache_key(corpus, model_path, anchors, hidden, dtype)}"
        if not self.path.is_dir():
            self._create(meta)
        was = json.loads((self.path / "meta.json").read_text())
        if was != meta:
            raise ValueError(f"{self.path} holds teacher features for {was}, not {meta}: the directory is not "
                             "this corpus's (delete it to rebuild the cache)")
        self.features = np.load(self.path / "features.npy", mmap_mode="r+")
        self.argmax = np.load(self.path / "argmax.npy", mmap_mode="r+")
        self.filled = np.load(self.path / "filled.npy", mmap_mode="r+")
        if (self.features.shape != (meta["tokens"], self.width, hidden) or self.argmax.shape != (meta["tokens"],)
                or self.filled.shape != (len(corpus),)):
            raise ValueError(f"{self.path}: features {self.features.shape}, argmax {self.argmax.shape} or flags "
                             f"{self.filled.shape} do not match {meta} (a damaged cache: delete the directory to "
                             "rebuild it)")

    def _create(self, meta: dict) -> None:
        """Build the directory beside its final name and rename it into place: a reader never sees half of it."""
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        np.lib.format.open_memmap(tmp / "features.npy", "w+", STORED[meta["dtype"]],
                                  (meta["tokens"], self.width, meta["hidden"])).flush()  # sparse: no data written
        np.lib.format.open_memmap(tmp / "argmax.npy", "w+", np.int32, (meta["tokens"],)).flush()
        np.lib.format.open_memmap(tmp / "filled.npy", "w+", bool, (meta["sequences"],)).flush()
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(self.path)
        except OSError:  # another process created it first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)

    def coverage(self) -> float:
        """The share of the sequences whose features are stored."""
        return float(self.filled.mean()) if len(self.filled) else 1.0

    def get(self, idx: Sequence[int], batch: dict[str, np.ndarray], compute: Callable[[], tuple]) -> dict:
        """The features of sequences idx as `pad_batch` padded them into batch (tokens [B, T], query and
        query_mask [B, Q]): dict(anchor_states [B, T, m, H], final_hidden [B, T, H], teacher_argmax [B, Q]
        int32; padded query slots hold 0 when read, the forward's value when computed), read from disk when all are stored; otherwise compute() -> the
        same three arrays for the batch (the teacher forward, `train.step.make_teacher`), whose rows are
        stored for the sequences not yet stored, and which are returned as computed: device arrays stay on
        their devices (one copy to the host to store them, none back). Padding rows are zero (read) or the
        forward's (computed): no response position attends to them (causal rows)."""
        idx = [int(i) for i in idx]
        T = batch["tokens"].shape[1]
        query, qmask = batch["query"], batch["query_mask"]
        if all(self.filled[i] for i in idx):
            m1, H = self.width, self.features.shape[-1]
            out = np.zeros((len(idx), T, m1, H), self.features.dtype)
            top = np.zeros(query.shape, np.int32)
            for r, i in enumerate(idx):
                a, b = self.offsets[i], self.offsets[i + 1]
                out[r, :b - a] = self.features[a:b]
                top[r] = np.where(qmask[r], self.argmax[a + np.where(qmask[r], query[r], 0)], 0)
                if (top[r] < 0).any():  # the key holds the masks: a flagged sequence has a token at each query
                    raise ValueError(f"{self.path}: sequence {i} is flagged stored but lacks the teacher's token at "
                                     "a response position (a damaged cache: delete the directory to rebuild it)")
            if self.dtype == "bfloat16":
                out = out.view(ml_dtypes.bfloat16)
            return dict(anchor_states=out if self.reads_last else out[:, :, :-1], final_hidden=out[:, :, -1],
                        teacher_argmax=top)
        h, x, top = compute()
        h_host, x_host, top_host = np.asarray(h), np.asarray(x), np.asarray(top)  # one transfer for the batch
        if self.reads_last:
            h_host = h_host[:, :, :-1]  # h_L is x: stored once
        new = [(r, i) for r, i in enumerate(idx) if not self.filled[i]]
        for r, i in new:
            a, b = self.offsets[i], self.offsets[i + 1]
            rows = np.concatenate([h_host[r, :b - a], x_host[r, :b - a, None]], axis=1)
            self.features[a:b] = rows.view(np.uint16) if self.dtype == "bfloat16" else rows
            self.argmax[a:b] = -1
            self.argmax[a + query[r][qmask[r]]] = top_host[r][qmask[r]]
        self.features.flush()  # the rows reach the files before their flags say so
        self.argmax.flush()
        for _, i in new:
            self.filled[i] = True
        self.filled.flush()
        return dict(anchor_states=h, final_hidden=x, teacher_argmax=top)
