"""PSM training data: GSM8K train from the repository's data/, response-only loss mask."""

import numpy as np
import pytest

from train.data import encode_example, read_gsm8k


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


@pytest.mark.real_model
def test_loss_mask_covers_exactly_the_response(smollm2):
    q, a = next(read_gsm8k("train"))
    ids, mask = encode_example(smollm2, q, a, max_len=4096)
    prompt = smollm2.encode(q)
    assert ids[:len(prompt)].tolist() == prompt
    assert mask.sum() == len(ids) - len(prompt)  # every response token (EOS included) is predicted once
    assert not mask[:len(prompt) - 1].any() and mask[len(prompt) - 1]
    assert smollm2.decode(ids[len(prompt):]).strip().startswith(a.split()[0])
    short, short_mask = encode_example(smollm2, q, a, max_len=len(prompt) + 3)
    assert len(short) == len(prompt) + 3 and short_mask.sum() == 3
    assert np.array_equal(short, ids[:len(short)])
