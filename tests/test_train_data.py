"""PSM training data: GSM8K train from the repository's data/, response-only loss mask, whole turns."""

import itertools

import numpy as np
import pytest

from train.data import encode_conversation, read_gsm8k


def test_gsm8k_train_is_read_in_place():
    rows = list(read_gsm8k("train"))
    assert len(rows) == 7473 and all(q and a for q, a in rows[:10])


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'gsm8k/train\.jsonl' not found; looked for: .*SPD_JAX_DATA"):
        list(read_gsm8k("train", root=tmp_path))


def test_spd_jax_data_overrides_the_folder(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    monkeypatch.setenv("SPD_JAX_DATA", str(tmp_path))
    assert list(read_gsm8k("test")) == [("1 + 1?", "#### 2")]
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):  # set means only there
        list(read_gsm8k("train"))


def _turn(q, a):
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


@pytest.mark.real_model
def test_loss_mask_covers_exactly_the_reply(smollm2):
    q, a = next(read_gsm8k("train"))
    ids, mask = encode_conversation(smollm2.tokenizer, _turn(q, a), 4096, smollm2.eos_token_ids)
    prompt = smollm2.encode(q)  # the chat template with the generation prompt
    assert ids[:len(prompt)].tolist() == prompt
    end = ids.tolist().index(smollm2.eos_token_ids[0], len(prompt))  # the reply's end-of-turn token
    assert smollm2.decode(ids[len(prompt):end]).strip() == a.strip()
    # every reply token and its end-of-turn token is predicted once; the template's newline after it is not
    assert np.flatnonzero(mask).tolist() == list(range(len(prompt) - 1, end))
    assert end < len(ids) - 1


@pytest.mark.real_model
def test_conversations_are_cut_at_whole_turns_never_inside_a_reply(smollm2):
    (q1, a1), (q2, a2) = itertools.islice(read_gsm8k("train"), 2)
    conv = _turn(q1, a1) + _turn(q2, a2)

    def enc(msgs, max_len):
        return encode_conversation(smollm2.tokenizer, msgs, max_len, smollm2.eos_token_ids)

    full, full_mask = enc(conv, 4096)
    first, first_mask = enc(conv[:2], 4096)
    assert np.array_equal(full[:len(first)], first) and np.array_equal(full_mask[:len(first)], first_mask)
    assert full_mask[len(first):].any()  # the second reply is in the loss too
    got = enc(conv, len(full))  # exactly fits
    assert np.array_equal(got[0], full) and np.array_equal(got[1], full_mask)
    for max_len in (len(first), len(full) - 1):  # the second pair does not fit: the first, whole
        ids, mask = enc(conv, max_len)
        assert np.array_equal(ids, first) and np.array_equal(mask, first_mask)
    assert enc(conv, len(first) - 1) is None  # not even the first pair fits: dropped, never truncated


def test_a_batch_lays_out_each_rows_response_positions_as_its_queries_padded_to_a_small_count():
    from train.corpus import QUERY_STEP, pad_batch
    rows = []
    for length, reply in ((300, 292), (200, 10)):
        mask = np.zeros(length, bool)
        mask[length - reply:] = True
        rows.append((np.arange(length, dtype=np.int32), mask))
    b = pad_batch(rows, (128, 256, 384, 512))
    assert b["tokens"].shape == (2, 384)
    # 292 queries: the next multiple of QUERY_STEP, not the bucket of 384 (groups and heads run per query)
    assert b["query"].shape == (2, -(-292 // QUERY_STEP) * QUERY_STEP) and b["query"].shape[1] < 384
    assert b["query"][0].tolist() == list(range(8, 300)) + [0] * (b["query"].shape[1] - 292)
    assert b["query_mask"].sum(1).tolist() == [292, 10] and b["query"][1, :10].tolist() == list(range(190, 200))
    # small buckets stay the query sizes below QUERY_STEP, and Q never exceeds T
    small = pad_batch([(np.arange(30, dtype=np.int32), np.arange(30) >= 20)], (16, 32))
    assert small["query"].shape == (1, 16) and small["tokens"].shape == (1, 32)


def test_batches_share_a_token_bucket_and_sort_by_response_count_within_it():
    """ORDER 2: within a window, sequences sort by the bucket they pad to, then by response positions: the same
    padded tokens as sorting by length, fewer padded query slots (the cached step's cost), every sequence once."""
    from train.config import TrainConfig
    from train.corpus import Batches, batch_order, pad_batch

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(1024):  # prompts of any length, then replies of any length: length says little of either
        length = int(rng.integers(20, 512))
        mask = np.arange(length) >= length - int(rng.integers(1, length))
        rows.append((np.zeros(length, np.int32), mask))
    tc = TrainConfig.of(batch_size=8)
    batches = Batches(rows, tc)
    idx = np.concatenate([batches.indices(i) for i in range(len(batches))])
    assert len(idx) == len(set(idx.tolist())) == 1024

    def padded(order):
        shapes = [pad_batch([rows[k] for k in b], tc.data.buckets) for b in order]
        return sum(s["tokens"].size for s in shapes), sum(s["query"].size for s in shapes)

    by_length = batch_order(np.asarray([len(i) for i, _ in rows]), tc, 0)  # ORDER 1's key
    tokens, queries = padded(batches.indices(i) for i in range(len(batches)))
    tokens_1, queries_1 = padded(by_length)
    assert tokens == tokens_1 and queries < 0.85 * queries_1
