"""Self-distillation data (train/distill.py): the target's own replies, masked exactly, cached in chunks
that a killed run resumes from; on the real model, the CLI builds the corpus that training reads."""

import json
from pathlib import Path

import numpy as np
import pytest

import spd_jax
from train import corpus as train_corpus, data as train_data, distill
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("qwen3", False)[0])


def test_replies_are_the_targets_and_chunks_resume(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK", 3)
    rng = np.random.default_rng(0)
    # lengths out of order within each chunk: batches of similar length are made and undone
    prompts = [rng.integers(3, tiny.config.vocab_size, size=s).astype(np.int32) for s in (12, 5, 9, 20, 3)]
    seqs = distill.regenerate(tiny, prompts, max_len=40, batch=2, work=tmp_path, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-00000.npz", "chunk-00001.npz"]
    for p, (ids, mask) in zip(prompts, seqs):
        reply = spd_jax.generate(tiny, p.tolist(), 40 - len(p)).token_ids
        assert ids.tolist() == p.tolist() + reply and len(ids) <= 40
        # the loss covers exactly the positions whose next token is a generated one
        assert np.flatnonzero(mask).tolist() == list(range(len(p) - 1, len(ids) - 1))

    calls = []
    real = spd_jax.generate_batch
    monkeypatch.setattr(spd_jax, "generate_batch", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    (tmp_path / "chunk-00001.npz").unlink()  # a run killed before its second chunk was written
    again = distill.regenerate(tiny, prompts, max_len=40, batch=2, work=tmp_path, show_progress=False)
    assert calls == [2]  # only the missing chunk's two prompts are generated again
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(seqs, again))
    # a chunk cached for other prompts (a changed dataset) is not reused
    calls.clear()
    other = [prompts[1], prompts[0], prompts[2], *prompts[3:]]
    swapped = distill.regenerate(tiny, other, max_len=40, batch=2, work=tmp_path, show_progress=False)
    assert calls == [2, 1] and np.array_equal(swapped[0][0], seqs[1][0])


def test_responses_must_be_known():
    with pytest.raises(ValueError, match="responses must be one of dataset, target"):
        TrainConfig.from_dict(dict(responses="teacher"))


@pytest.mark.real_model
def test_cli_builds_the_corpus_training_reads(smollm2, tmp_path, monkeypatch, capsys):
    """`train.distill` regenerates GSM8K first turns with SmolLM2 (batched, greedy) into the cache;
    `encode_corpus` with responses=target reads it back (no generation); a reply equals the target's own
    greedy reply."""
    monkeypatch.setattr(train_data, "corpus_dir", lambda: tmp_path / "corpus")
    args = ["--config", str(ROOT / "configs/train/smollm2-n8.yaml"), "sources=[gsm8k]", "limit=6", "max_len=160",
            "--batch", "4"]
    assert distill.main(args) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["sequences"] == 6 and stats["response_positions"] > 6 and stats["max_len"] == 160
    tc = TrainConfig.from_dict(dict(sources=["gsm8k"], limit=6, max_len=160, buckets=[160], responses="target"))
    key = train_data.corpus_key(smollm2, tc, "target-greedy-first-turn", distill.MIN_ROOM)
    assert (tmp_path / "corpus" / f"corpus-{key}.npz").is_file()

    def no_generation(*a, **k):
        raise AssertionError("the corpus the CLI built is read, not generated again")

    monkeypatch.setattr(spd_jax, "generate_batch", no_generation)
    seqs = train_corpus.encode_corpus(smollm2, tc, tmp_path / "corpus")
    assert len(seqs) == 6 and sum(int(m.sum()) for _, m in seqs) == stats["response_positions"]
    prompt = distill.first_turn_prompts(smollm2, tc)[0]
    ids, mask = seqs[0]
    assert ids[:len(prompt)].tolist() == prompt.tolist() and not mask[:len(prompt) - 1].any()
    assert ids[len(prompt):].tolist() == spd_jax.generate(smollm2, prompt.tolist(), 160 - len(prompt)).token_ids
