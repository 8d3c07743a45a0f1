"""The training corpus of a config and its batches: which source answers, the held-out split, the draft
vocabulary, the data order.

A corpus is [(ids [T] int32, loss_mask [T] bool)], loss_mask[t] where t + 1 is a response token. Its
responses come from one of three sources: the conversations' own (`train.data`, tokenised once and
cached), the target's greedy replies to their first turns (`responses: target`, `train.distill`), or a
`train.replies` corpus (`replies: DIR`). The batches are deterministic in (seed, epoch), so the data
position of a run is its step. Nothing here runs a device computation but the target's replies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from spd_jax.progress import progress_bar
from train import data, distill, replies
from train.config import TrainConfig


def encode_corpus(model, tc: TrainConfig, cache_dir: Path | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every training conversation of tc.data.sources -> [(ids, loss_mask)], tokenised once and cached;
    with responses "target", the first turns answered by the target instead (`train.distill`); with
    replies, that corpus's finished chunks (`train.replies`)."""
    if tc.data.replies is not None:
        return replies.training_corpus(model, Path(tc.data.replies), tc.data.max_len, tc.data.replies_chunks)
    if tc.data.responses == "target":
        return distill.distilled_corpus(model, tc, cache_dir)
    path = cache_dir / f"corpus-{data.corpus_key(model, tc)}.npz" if cache_dir else None
    if path and path.is_file():
        return data.load_sequences(path)
    out = []
    for _, msgs in progress_bar(data.conversations(tc), desc="tokenising", unit="conv"):
        enc = data.encode_conversation(model.tokenizer, msgs, tc.data.max_len, model.eos_token_ids)
        if enc is not None:
            out.append(enc)
    if path:
        data.save_sequences(out, path)
    return out


def draft_vocab_ids(corpus: list, size: int, vocab_size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The draft vocabulary: the `size` tokens most often predicted at response positions of the
    corpus [(ids, mask)] (ties to the lower id), with the `always` tokens (EOS: a draft must be able
    to end a reply) in place of the rarest ones. -> sorted int32 [size]."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab {size} must be in 1..{vocab_size}")
    if size < len(set(always)):
        raise ValueError(f"draft_vocab {size} cannot hold the {len(set(always))} tokens it must include (EOS)")
    counts = np.zeros(vocab_size, np.int64)
    for ids, mask in corpus:
        np.add.at(counts, ids[1:][mask[:-1]], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    always = [int(t) for t in dict.fromkeys(always) if 0 <= t < vocab_size]
    chosen = [int(t) for t in order if t not in always][: size - len(always)] + always
    return np.sort(np.asarray(chosen, np.int32))


def split_heldout(corpus: list, tc: TrainConfig) -> tuple[list, list]:
    """A fixed, seed-independent held-out split (every k-th conversation) for the quick eval."""
    if tc.data.heldout <= 0:
        return corpus, []
    stride = max(len(corpus) // tc.data.heldout, 2)
    held = set(range(stride // 2, len(corpus), stride)[:tc.data.heldout])
    return [c for i, c in enumerate(corpus) if i not in held], [corpus[i] for i in sorted(held)]


# How an epoch's batches are formed (run.json records it: a run resumes only in the order it began). 1: sorted
# by length; 2: by token bucket, then by response count. Within a bucket every row pads to the same T, and
# the cached step's cost is mostly the query slots (the PSM's groups and heads): on the greedy corpus's
# first 1 M positions, 2 pays for 27% fewer query slots than 1, with the same padded tokens.
ORDER = 2


def batch_order(keys: np.ndarray, tc: TrainConfig, epoch: int) -> list[np.ndarray]:
    """One epoch's batches (index arrays of batch_size) of the sequences with sort keys [N]: shuffled, then
    sorted by key within windows of 32 batches so that a batch pads little, then the batches shuffled.
    Deterministic in (seed, epoch): the data position of a run is just its step."""
    rng = np.random.default_rng([tc.run.seed, epoch])
    perm = rng.permutation(len(keys))
    B, win = tc.data.batch_size, 32 * tc.data.batch_size
    batches = []
    for a in range(0, len(perm) - B + 1, win):
        chunk = perm[a:a + win]
        chunk = chunk[np.argsort(keys[chunk], kind="stable")]
        batches += [chunk[i:i + B] for i in range(0, len(chunk) - B + 1, B)]
    return [batches[i] for i in rng.permutation(len(batches))]


def sort_keys(corpus: list, buckets: Sequence[int]) -> np.ndarray:
    """[(ids [T_i], mask)] -> [N] int64 keys ordering the sequences by the token bucket they pad to, then by
    their response positions (ORDER 2)."""
    lengths = np.asarray([len(i) for i, _ in corpus], np.int64)
    responses = np.asarray([int(np.sum(m)) for _, m in corpus], np.int64)
    bucket = np.searchsorted(np.asarray(buckets), lengths)  # ascending (the config's check); past the last: refused
    return bucket * (int(lengths.max(initial=0)) + 1) + responses


class Batches:
    """The batch of micro-step i (= step * grad_accum + micro), over as many epochs as needed."""

    def __init__(self, corpus: list, tc: TrainConfig):
        if len(corpus) < tc.data.batch_size:
            raise ValueError(f"{len(corpus)} training sequences are fewer than one batch ({tc.data.batch_size})")
        self.corpus, self.tc = corpus, tc
        self.keys = sort_keys(corpus, tc.data.buckets)
        self._epochs: dict[int, list] = {}

    def __len__(self):  # batches per epoch
        return len(self._order(0))

    def _order(self, epoch):
        if epoch not in self._epochs:
            self._epochs = {epoch: batch_order(self.keys, self.tc, epoch)}
        return self._epochs[epoch]

    def indices(self, i: int) -> np.ndarray:
        """The corpus indices of micro-step i's sequences."""
        epoch, j = divmod(i, len(self))
        return self._order(epoch)[j]

    def get(self, i: int) -> dict[str, np.ndarray]:
        return pad_batch([self.corpus[k] for k in self.indices(i)], self.tc.data.buckets)


# Query counts pad to a multiple of this too, not only to a bucket: the groups and heads that run per query
# are most of a step, and a batch whose rows hold 292 response positions would pay for 384 at buckets of 128.
QUERY_STEP = 64


def pad_batch(seqs: list[tuple[np.ndarray, np.ndarray]], buckets: Sequence[int]) -> dict[str, np.ndarray]:
    """[(ids, mask)] -> tokens [B, T] int32, mask [B, T] bool, zero-padded to the smallest bucket T that
    holds the longest; query [B, Q] int32, the positions of each row's mask (its response positions)
    padded with 0, and query_mask [B, Q] bool, Q the smallest bucket or multiple of QUERY_STEP that holds
    the most any row has: the drafter's groups and heads run only there. One compiled step per (T, Q) pair."""
    longest = max(len(ids) for ids, _ in seqs)
    T = next((b for b in buckets if b >= longest), None)
    if T is None:
        raise ValueError(f"a sequence of {longest} tokens exceeds the largest bucket {max(buckets)}")
    sizes = sorted(set(buckets) | set(range(QUERY_STEP, max(buckets), QUERY_STEP)))
    Q = next(b for b in sizes if b >= max(max(int(m.sum()) for _, m in seqs), 1))
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), bool)
    query = np.zeros((len(seqs), Q), np.int32)
    query_mask = np.zeros((len(seqs), Q), bool)
    for r, (ids, m) in enumerate(seqs):
        tokens[r, :len(ids)], mask[r, :len(m)] = ids, m
        at = np.flatnonzero(m)
        query[r, :len(at)], query_mask[r, :len(at)] = at, True
    return dict(tokens=tokens, mask=mask, query=query, query_mask=query_mask)

