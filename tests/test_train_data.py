"""PSM training data: GSM8K train read in place, response-only loss mask."""

import numpy as np
import pytest

from train.data import encode_example, read_gsm8k


def test_gsm8k_train_is_read_in_place():
    rows = list(read_gsm8k("train"))
    assert len(rows) == 7473 and all(q and a for q, a in rows[:10])


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="shared/data"):
        list(read_gsm8k("train", root=tmp_path))


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
