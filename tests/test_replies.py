"""The target's replies at scale (train/replies.py): greedy and seeded samples that do not depend on their
batch, chunks that a killed run resumes from, a manifest that refuses other settings and regenerates a
chunk to the same digest; on the real model, the CLI from the training sources to the training form."""

import json

import numpy as np
import pytest

import spd_jax
from spd_jax.decode.sampling import Sampling
from train import replies

SETTINGS = dict(sources=["gsm8k"], samples=2, max_len=40, batch=4, chunk=3, seed=7, weights_dtype="float32",
                heldout=[400, 500], limit=None)


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return spd_jax.load_model(tiny_ckpt("qwen3", False)[0])


@pytest.fixture
def prompts(tiny, monkeypatch):
    rng = np.random.default_rng(0)
    ps = [rng.integers(3, tiny.config.vocab_size, size=s).astype(np.int32) for s in (12, 5, 9, 20, 3)]
    names = [f"gsm8k:{i}:0" for i in range(len(ps))]
    monkeypatch.setattr(replies, "enumerate_prompts", lambda *a, **k: (names, ps))
    return ps


def test_replies_are_the_targets_and_do_not_depend_on_their_batch(tiny, prompts, tmp_path):
    totals = replies.run(tiny, tmp_path, SETTINGS, show_progress=False)
    assert totals["chunks_done"] == totals["chunks_total"] == 2 and totals["sequences"] == 15
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    order = manifest["order"]
    assert sorted(order) == list(range(5))
    seqs = replies.read_corpus(tmp_path)
    assert len(seqs) == 15 and totals["positions"] == sum(int(m.sum()) for _, m in seqs)
    i = 0
    for c in range(2):
        with np.load(tmp_path / f"chunk-{c:05d}.npz") as z:
            units = list(zip(z["prompt"].tolist(), z["sample"].tolist()))
        assert units == sorted((p, k) for p in order[3 * c:3 * c + 3] for k in range(3))
        for p, k in units:
            ids, mask = seqs[i]
            i += 1
            prompt = prompts[p]
            sample = Sampling() if k == 0 else Sampling(temperature=1.0, top_k=replies.TOP_K, top_p=replies.TOP_P,
                                                        seed=replies.unit_seed(7, p, k, 2))
            alone = spd_jax.generate(tiny, prompt.tolist(), 40 - len(prompt), sampling=sample).token_ids
            assert ids.tolist() == prompt.tolist() + alone  # what the target gives the prompt alone
            assert np.flatnonzero(mask).tolist() == list(range(len(prompt) - 1, len(ids) - 1))


def test_killed_runs_resume_and_other_settings_are_refused(tiny, prompts, tmp_path, monkeypatch):
    first = replies.run(tiny, tmp_path, SETTINGS, chunks=1, show_progress=False)
    assert first["chunks_done"] == 1 and not (tmp_path / "chunk-00001.npz").exists()
    calls = []
    real = spd_jax.generate_batch
    monkeypatch.setattr(replies.spd_jax, "generate_batch", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    done = replies.run(tiny, tmp_path, SETTINGS, show_progress=False)
    assert done["chunks_done"] == 2 and calls == [2, 4]  # only the last chunk: 2 greedy rows, 4 samples
    with pytest.raises(ValueError, match=r"other max_len, samples \(max_len=40, samples=2\)"):
        replies.run(tiny, tmp_path, dict(SETTINGS, samples=1, max_len=48), show_progress=False)
    check = replies.verify(tiny, tmp_path, SETTINGS, 1)
    assert check["equal"] and check["recorded"] == check["regenerated"]
    # a chunk whose tokens differ from the record is reported, not passed
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["chunks"]["0"]["digest"] = "0" * 16
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert not replies.verify(tiny, tmp_path, SETTINGS, 0)["equal"]


def test_chunks_made_together_are_batched_by_length_and_hold_the_same_replies(tiny, prompts, tmp_path, monkeypatch):
    """group=2: both chunks' greedy prompts run as batches sorted by length across the chunks (lengths 3, 5, 9,
    12 then 20, not a chunk at a time); each chunk's file holds what a chunk-at-a-time run writes, its record
    names the group, and verify regenerates the group."""
    replies.run(tiny, tmp_path / "alone", SETTINGS, show_progress=False)
    batches = []
    real = spd_jax.generate_batch
    monkeypatch.setattr(replies.spd_jax, "generate_batch",
                        lambda *a, **k: batches.append([len(p) for p in a[1]]) or real(*a, **k))
    assert replies.run(tiny, tmp_path / "together", SETTINGS, group=2, show_progress=False)["chunks_done"] == 2
    assert batches == [[3, 5, 9, 12], [20], [3, 3, 5, 5], [9, 9, 12, 12], [20, 20]]  # greedy, then 2 samples each
    alone, together = (json.loads((tmp_path / d / "manifest.json").read_text())["chunks"] for d in ("alone", "together"))
    assert [together[c]["digest"] for c in "01"] == [alone[c]["digest"] for c in "01"]
    assert together["1"]["group"] == [0, 1] and alone["1"]["group"] == [1]
    batches.clear()
    assert replies.verify(tiny, tmp_path / "together", SETTINGS, 1)["equal"]
    assert batches[:2] == [[3, 5, 9, 12], [20]]  # the group regenerated, not chunk 1 alone


def test_a_kept_corpus_resumes_without_its_prompt_list(tiny, prompts, tmp_path, monkeypatch):
    """What git keeps (manifest and compact chunks, no prompts.npz) resumes: the prompt list is derived
    again and checked against the manifest's digest; another list is refused."""
    replies.run(tiny, tmp_path, SETTINGS, chunks=1, show_progress=False)
    with np.load(tmp_path / "chunk-00000.npz") as z:
        assert z["ids"].dtype == np.uint16  # the tiny vocabulary fits: half the bytes of int32
    (tmp_path / "prompts.npz").unlink()
    assert replies.run(tiny, tmp_path, SETTINGS, show_progress=False)["chunks_done"] == 2
    assert (tmp_path / "prompts.npz").is_file()
    (tmp_path / "prompts.npz").unlink()
    monkeypatch.setattr(replies, "enumerate_prompts", lambda *a, **k: (["gsm8k:0:0"], prompts[:1]))
    with pytest.raises(ValueError, match="now differ from those"):
        replies.run(tiny, tmp_path, SETTINGS, show_progress=False)


def test_a_second_machine_starts_elsewhere_and_stops_at_its_deadline(tiny, prompts, tmp_path):
    import time

    late = replies.run(tiny, tmp_path, SETTINGS, start=1, deadline=time.time() - 1, show_progress=False)
    assert late["chunks_done"] == 0
    replies.run(tiny, tmp_path, SETTINGS, chunks=1, start=1, show_progress=False)
    assert sorted(json.loads((tmp_path / "manifest.json").read_text())["chunks"]) == ["1"]
    replies.run(tiny, tmp_path, SETTINGS, start=1, show_progress=False)  # wraps round to chunk 0
    assert sorted(json.loads((tmp_path / "manifest.json").read_text())["chunks"]) == ["0", "1"]


def test_the_committed_corpus_matches_its_manifest():
    """Every chunk of the corpus kept in data/replies holds the tokens its manifest recorded (digest and
    counts), so a clone trains on exactly the recorded replies."""
    roots = sorted(p.parent for p in (replies.REPO_REPLIES).glob("*/manifest.json"))
    assert roots, f"no corpus under {replies.REPO_REPLIES}"
    for root in roots:
        manifest = json.loads((root / "manifest.json").read_text())
        for c, rec in manifest["chunks"].items():  # a file without a record yet (a run writing) is not read
            assert replies.check_chunk(replies.load_chunk(root / f"chunk-{int(c):05d}.npz"), rec), (root, c)


def test_batch_seeds_one_per_prompt(tiny):
    ps = [[3, 4, 5], [1, 17, 42, 99, 5]]
    got = spd_jax.generate_batch(tiny, ps, max_len=24, temperature=1.0, seed=[11, 3], stop_at_eos=False)
    assert got == [spd_jax.generate(tiny, p, 24 - len(p), sampling=Sampling(temperature=1.0, seed=s), stop_at_eos=False).token_ids
                   for p, s in zip(ps, [11, 3])]
    with pytest.raises(ValueError, match="seed holds 1 seeds for 2 prompts"):
        spd_jax.generate_batch(tiny, ps, max_len=24, temperature=1.0, seed=[1])
    with pytest.raises(ValueError, match="weights_dtype must be"):
        spd_jax.generate_batch(tiny, ps, max_len=24, weights_dtype="float16")


@pytest.mark.real_model
def test_cli_from_the_training_sources(smollm2, tmp_path, capsys):
    """Two GSM8K questions, one sample each: prompts through the chat template, replies that end at EOS or
    max_len, the training form read back, and --verify regenerating chunk 0 to its digest."""
    args = ["--out", str(tmp_path), "--sources", "gsm8k", "--limit", "2", "--samples", "1", "--max-len", "96",
            "--batch", "4", "--chunk", "2"]
    assert replies.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks_done"] == out["chunks_total"] == 1 and out["sequences"] == 4
    seqs = replies.read_corpus(tmp_path)
    q0 = next(iter(replies.READERS["gsm8k"]()))[:1]
    prompt = replies.chat_ids(smollm2, q0)
    greedy = spd_jax.generate(smollm2, prompt.tolist(), 96 - len(prompt)).token_ids
    assert [ids.tolist() for ids, _ in seqs if ids[:len(prompt)].tolist() == prompt.tolist()][0] == \
        prompt.tolist() + greedy
    assert replies.main(args + ["--verify", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["equal"]
    assert replies.main(args[:-2] + ["--chunk", "3"]) == 2
    assert "other chunk (chunk=2)" in capsys.readouterr().err


def test_training_reads_the_finished_chunks(tiny, prompts, tmp_path):
    from train import corpus as train_corpus
    from train.config import TrainConfig

    tc = TrainConfig.from_dict(dict(replies=str(tmp_path), max_len=40))
    with pytest.raises(FileNotFoundError, match="no train.replies corpus there"):
        train_corpus.encode_corpus(tiny, tc)
    replies.run(tiny, tmp_path, SETTINGS, chunks=1, show_progress=False)
    seqs = train_corpus.encode_corpus(tiny, tc)
    assert len(seqs) == 9 and all(np.array_equal(a[0], b[0]) for a, b in zip(seqs, replies.read_corpus(tmp_path)))
    with pytest.raises(ValueError, match="over this run's max_len 32"):
        train_corpus.encode_corpus(tiny, TrainConfig.from_dict(dict(replies=str(tmp_path), max_len=32)))
    with pytest.raises(ValueError, match="drop responses='target'"):
        TrainConfig.from_dict(dict(replies=str(tmp_path), responses="target"))
    # replies_chunks: the first chunks alone, the same data however far the corpus has grown
    first = TrainConfig.from_dict(dict(replies=str(tmp_path), max_len=40, replies_chunks=1))
    with pytest.raises(ValueError, match=r"replies_chunks=2: chunks \[1\] .* are not finished \(1 of 2\)"):
        train_corpus.encode_corpus(tiny, TrainConfig.from_dict(dict(replies=str(tmp_path), max_len=40, replies_chunks=2)))
    replies.run(tiny, tmp_path, SETTINGS, show_progress=False)
    assert len(train_corpus.encode_corpus(tiny, tc)) == 15
    assert [a.tolist() for a, _ in train_corpus.encode_corpus(tiny, first)] == [a.tolist() for a, _ in seqs]
    with pytest.raises(ValueError, match="replies_chunks=3 counts the chunks of a replies corpus: set replies=DIR"):
        TrainConfig.from_dict(dict(replies_chunks=3))
