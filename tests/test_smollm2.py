"""The real embedded default (SmolLM2-135M-Instruct): greedy decoding equals transformers token for token."""

import numpy as np
import pytest
import torch

import spd_jax

pytestmark = pytest.mark.real_model

CHAT = ["What is the capital of France? Answer in one sentence.",
        "Give me three tips for staying focused while studying."]
CODE = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "# Python: check whether a string is a palindrome\ndef is_palindrome(s):"]
TIE = 1e-3  # transformers' top-2 logit margin below which a different choice is a tie, not an error


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.mark.parametrize("text,chat", [(t, True) for t in CHAT] + [(t, False) for t in CODE])
def test_greedy_equals_transformers(smollm2, hf_smollm2, text, chat):
    ids = smollm2.encode(text, chat=chat)
    n = 48
    ours = spd_jax.generate(smollm2, ids, max_new_tokens=n).token_ids
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, eos_token_id=list(smollm2.eos_token_ids))
    theirs = out.sequences[0, len(ids):].tolist()
    if ours == theirs:
        return
    j = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    top2 = np.sort(out.logits[j][0].float().numpy())[-2:] if j < len(out.logits) else None
    assert top2 is not None and top2[1] - top2[0] < TIE, (
        f"first difference at token {j}: ours {ours[j:j + 5]} vs transformers {theirs[j:j + 5]} "
        f"(top-2 margin {None if top2 is None else top2[1] - top2[0]})")
    assert ours[:j] == theirs[:j]


def test_logits_match_transformers(smollm2, hf_smollm2):
    ids = np.array([smollm2.encode("The quick brown fox jumps over the lazy dog.", chat=False)])
    with torch.no_grad():
        ref = hf_smollm2(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(smollm2.logits(ids), ref, atol=5e-4, rtol=0)  # fp32 rounding over 30 layers: ~1.4e-4 seen
    assert (smollm2.logits(ids).argmax(-1) == ref.argmax(-1)).all()
