"""Self-distillation data: the training prompts answered by the target itself.

    python -m train.distill --config configs/train/smollm2-n8.yaml [key=value ...] [--batch 32]

A drafter is judged on the target's own continuations, so it may learn more from them than from the
dataset's human (or other-model) responses. With `responses: target` in a training config, each
conversation's first user turn (chat template, generation prompt) is continued by the target, greedily
and on device in batches (`spd_jax.generate_batch`), until its EOS or max_len tokens in all; the loss
covers the generated tokens. Later turns are dropped: continuing them would put the dataset's next
user turn after a reply it never answered. A reply cut by max_len is kept up to it (every position is
still the target's own token, an exact teacher target; the dataset rule of whole turns only is about
replies another writer finished).

Generation runs once per (sources, skip, limit, prompt_pattern, max_len, model, template) and is cached
beside the tokenised corpus (`corpus-<key>.npz`), in chunks written atomically as they finish, so a
killed run resumes at the first missing chunk. Greedy tokens can differ between machines in the last
bits of a near tie: the cache is this machine's. This command only builds the cache (and says what it
holds); `train.main` with the same config reads it, or builds it first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import jax
import numpy as np

import spd_jax
from spd_jax.progress import progress_bar
from train import config, data
from train.config import TrainConfig

log = logging.getLogger("train.distill")

CHUNK = 256  # prompts per cached chunk: what a killed run loses at most
MIN_ROOM = 16  # a first turn is answered only if it leaves at least this many tokens of max_len


def first_turn_prompts(model, tc: TrainConfig) -> list[np.ndarray]:
    """The chat-templated first user turn (with the generation prompt) of every conversation of
    tc.data.sources (tc.data.limit per source), in corpus order; ones leaving under MIN_ROOM tokens of
    tc.data.max_len are skipped."""
    prompts = [first_turn_ids(model, msgs) for _, msgs in data.conversations(tc)]
    return [ids for ids in prompts if len(ids) <= tc.data.max_len - MIN_ROOM]


def first_turn_ids(model, msgs: list[dict]) -> np.ndarray:
    """A conversation's first user turn through the chat template, with the generation prompt -> [T] int32."""
    out = model.tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
    return np.asarray(out["input_ids"] if hasattr(out, "keys") else out, np.int32)


def _chunk_matches(seqs, chunk) -> bool:
    """A cached chunk belongs to these prompts (a changed dataset or filter regenerates it): each sequence
    is its prompt, then a reply whose loss starts at the prompt's last position."""
    return len(seqs) == len(chunk) and all(
        np.array_equal(ids[:len(p)], p) and mask[len(p) - 1] and not mask[:len(p) - 1].any()
        for (ids, mask), p in zip(seqs, chunk))


def regenerate(model, prompts: list[np.ndarray], max_len: int, batch: int, work: Path | None = None,
               show_progress: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each prompt continued greedily by the target to EOS or max_len tokens in all -> [(ids [T],
    loss_mask [T])], loss_mask[t] where t + 1 is a generated token. Chunks of CHUNK prompts go to
    work/chunk-<i>.npz as they finish and are reused when they hold these prompts; within a chunk,
    prompts of similar length share a batch (less padding, fewer compiled shapes)."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    bar = progress_bar(total=len(prompts), desc="regenerating responses", unit="prompt", disable=not show_progress)
    for c in range(0, len(prompts), CHUNK):
        path = work / f"chunk-{c // CHUNK:05d}.npz" if work is not None else None
        chunk = prompts[c:c + CHUNK]
        cached = data.load_sequences(path) if path is not None and path.is_file() else None
        if cached is not None and _chunk_matches(cached, chunk):
            out += cached
            bar.update(len(chunk))
            continue
        seqs = [None] * len(chunk)
        order = np.argsort([len(p) for p in chunk], kind="stable")
        for a in range(0, len(order), batch):
            idx = order[a:a + batch]
            for i, g in zip(idx, spd_jax.generate_batch(model, [chunk[i] for i in idx], max_len)):
                p = chunk[i]
                mask = np.zeros(len(p) + len(g), bool)
                mask[len(p) - 1:len(p) + len(g) - 1] = True
                seqs[i] = (np.concatenate([p, np.asarray(g, np.int32)]), mask)
            bar.update(len(idx))
        if path is not None:
            data.save_sequences(seqs, path)
        out += seqs
    bar.close()
    return out


def distilled_corpus(model, tc: TrainConfig, cache_dir: Path | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The `responses: target` corpus of tc: cached whole (corpus-<key>.npz), else generated (resuming
    from cache_dir/distill-<key>/'s chunks) and cached."""
    key = data.corpus_key(model, tc, "target-greedy-first-turn", MIN_ROOM)
    path = cache_dir / f"corpus-{key}.npz" if cache_dir else None
    if path is not None and path.is_file():
        return data.load_sequences(path)
    if jax.process_count() > 1:
        raise ValueError("responses: target needs its regenerated corpus built once, in one process: run "
                           f"`python -m train.distill --config <this config>` first (cache: {cache_dir})")
    prompts = first_turn_prompts(model, tc)
    log.info("regenerating the responses of %d first turns with the target (greedy, up to %d tokens in all, "
             "batches of %d)", len(prompts), tc.data.max_len, tc.data.distill_batch)
    seqs = regenerate(model, prompts, tc.data.max_len, tc.data.distill_batch,
                      cache_dir / f"distill-{key}" if cache_dir else None)
    if path is not None:
        data.save_sequences(seqs, path)
    return seqs


def summary(seqs: list[tuple[np.ndarray, np.ndarray]], eos_ids) -> dict:
    """What a corpus holds: sequences, response positions, replies that ended with EOS, mean reply."""
    replies = [int(m.sum()) for _, m in seqs]
    ended = sum(int(ids[-1] in eos_ids) for ids, _ in seqs)
    return dict(sequences=len(seqs), response_positions=sum(replies), ended_with_eos=ended,
                mean_reply_tokens=round(float(np.mean(replies)), 1) if replies else 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a training config (configs/train/); responses=target is implied")
    ap.add_argument("--batch", type=int, help="prompts per generated batch (default: the config's distill_batch)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:  # bad input (config, overrides, model, data, a missing package): `error: ...`, status 2
        overrides = [*args.overrides, "responses=target"]
        if args.batch is not None:
            overrides.append(f"distill_batch={args.batch}")
        tc, _ = config.load(args.config, overrides)
        model = spd_jax.load_model(tc.model.name)
        seqs = distilled_corpus(model, tc, data.corpus_dir())
    except config.SETUP_ERRORS as e:
        return config.setup_failed(e)
    print(json.dumps(dict(model=model.path.name, sources=list(tc.data.sources), max_len=tc.data.max_len,
                          **summary(seqs, model.eos_token_ids))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
