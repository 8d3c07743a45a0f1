"""The real embedded default (SmolLM2-135M-Instruct): greedy decoding equals transformers token for token."""

import numpy as np
import pytest
import torch

import spd_jax

from tolerances import VS_TRANSFORMERS, assert_close, bound

pytestmark = pytest.mark.real_model

CHAT = ["What is the capital of France? Answer in one sentence."]
CODE = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


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
    assert j < len(out.logits), f"lengths differ: ours {len(ours)}, transformers {len(theirs)}"
    logits_j = out.logits[j][0].float().numpy()
    top2 = np.sort(logits_j)[-2:]
    # A tie: both logits may be off by the parity bound, so a margin below twice that may flip.
    tie = 2 * bound(logits_j, VS_TRANSFORMERS, depth=smollm2.config.num_layers)
    assert top2[1] - top2[0] < tie, (
        f"first difference at token {j}: ours {ours[j:j + 5]} vs transformers {theirs[j:j + 5]} "
        f"(top-2 margin {top2[1] - top2[0]:.3g}, a tie below {tie:.3g})")
    assert ours[:j] == theirs[:j]


def test_logits_match_transformers(smollm2, hf_smollm2):
    ids = np.array([smollm2.encode("The quick brown fox jumps over the lazy dog.", chat=False)])
    with torch.no_grad():
        ref = hf_smollm2(torch.as_tensor(ids)).logits.numpy()
    assert_close(smollm2.logits(ids), ref, VS_TRANSFORMERS, depth=smollm2.config.num_layers, what="logits")
    assert (smollm2.logits(ids).argmax(-1) == ref.argmax(-1)).all()
