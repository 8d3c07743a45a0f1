"""The model card is built from the run's and the evaluation's files, figures included."""

import json

from train import card


def test_card_from_run_and_eval_files(tmp_path):
    run, ev, psm = tmp_path / "run", tmp_path / "eval", tmp_path / "psm"
    for d in (run, ev, psm / "params"):
        d.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(dict(
        identity=dict(model="/x/smollm2-135m-instruct"), commands=["python -m train.main --config c.yaml"],
        config=dict(sources=["sharegpt"], max_len=512, lr=3e-4, warmup=100, batch_size=8, clip=1.0))))
    rows = [dict(step=s, positions=1000 * s, loss=5.0 / s, agreement=0.1 * s) for s in range(1, 4)]
    rows[-1] |= dict(alpha=0.5, S0=3.75)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (psm / "psm.json").write_text(json.dumps(dict(anchors=[0, 3], num_layers=2, plan=[3, 3, 4, 4, 4, 4, 4, 4],
                                                  target=["llama", 576, 30, 49152, 9, 3], draft_vocab=0,
                                                  trained=dict(steps=3, positions=3000, wall_s=7200, backend="cpu",
                                                               mesh="1x1"))))
    (psm / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    common = dict(prompt_tokens=5, wall_s=1.0, timing_includes="x", depth_ratio=7.5, temperature=0.0)
    res = [dict(bench="gsm8k", prompt_index=i, method="spd", n=8, tokens=10, cycles=20, **common) for i in range(2)]
    res += [dict(bench="gsm8k", prompt_index=i, method="ar", n=1, tokens=10, cycles=10, **common) for i in range(2)]
    (ev / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "n = 8" in text and "python -m train.main --config c.yaml" in text and "EVAL" in text
    assert "response positions seen **3,000**" in text and "2.00 h" in text and "1.0 MB" in text
    assert "| 3 | 3,000 | 0.500 | 3.75 |" in text  # the quick eval's S0 curve
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 0.500 | 3.75 | 10.0 | 1.00x |" in text  # pooled 20/40 * 7.5
