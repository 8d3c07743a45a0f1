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
    rows.append(dict(step=4, positions=4000, loss=1.0, agreement=0.4))  # after the exported step: not in the card
    for r, wall in zip(rows, (30, 60, 7200, 7230)):  # a pause between steps 2 and 3 does not move the median
        r["wall_s"] = wall
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (psm / "psm.json").write_text(json.dumps(dict(anchors=[0, 3], num_layers=2, plan=[3, 3, 4, 4, 4, 4, 4, 4],
                                                  target=["llama", 576, 30, 49152, 9, 3], draft_vocab=0,
                                                  trained=dict(steps=3, positions=3000, wall_s=7200, backend="cpu",
                                                               mesh="1x1"))))
    (psm / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    common = dict(prompt_tokens=5, wall_s=1.0, timing_includes="x", depth_ratio=7.5, temperature=0.0)
    res = [dict(bench="gsm8k", prompt_index=i, method="spd", n=8, tokens=10, cycles=20, **common) for i in range(2)]
    res += [dict(bench="gsm8k", prompt_index=i, method="ar", n=1, tokens=10, cycles=10, **common) for i in range(2)]
    res += [dict(bench="gsm8k", prompt_index=0, method="eagle3", k=3, n=1, tokens=10, cycles=5, **common)]
    (ev / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "n = 8" in text and "python -m train.main --config c.yaml" in text and "EVAL" in text
    assert "response positions seen **3,000**" in text and "2.00 h of wall clock" in text and "1.0 MB" in text
    assert "median 30.0 s per step" in text
    assert "| 3 | 3,000 | 0.500 | 3.75 |" in text  # the quick eval's S0 curve
    assert "| gsm8k | spd | 8 | 0 | 2 | 20 | 0.500 | 3.75 | 10.0 | 1.00x |" in text  # pooled 20/40 * 7.5
    assert "| eagle3 |" not in text  # the other drafter's rows go into its own card
    # an earlier step's export (train.main --export 2) gets that step's figures, not the run's later ones
    meta = json.loads((psm / "psm.json").read_text())
    meta["trained"].update(steps=2, positions=2000)
    (psm / "psm.json").write_text(json.dumps(meta))
    assert card.main(["--run", str(run), "--eval", str(ev), "--psm", str(psm), "--eval-command", "EVAL"]) == 0
    text = (psm / "CARD.md").read_text()
    assert "| 3 | 3,000 |" not in text and "KL 3.750" in text  # the mean of steps 1 and 2: 5.0 and 2.5


def test_eagle3_card(tmp_path):
    """An exported EAGLE-3 drafter (eagle3.json) gets its own card: tokens per round, its eval rows."""
    run, ev, d = tmp_path / "run", tmp_path / "eval", tmp_path / "drafter"
    for x in (run, ev, d / "params"):
        x.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(dict(
        identity=dict(model="/x/smollm2-135m-instruct", method="eagle3"),
        commands=["python -m train.main --config e.yaml"],
        config=dict(sources=["sharegpt"], max_len=512, lr=1e-4, warmup=100, batch_size=8, clip=1.0, ttt_steps=3))))
    rows = [dict(step=s, positions=1000 * s, loss=5.0 / s, agreement=0.1 * s) for s in range(1, 4)]
    rows[-1] |= dict(tokens_per_round=1.8, eval_k=3)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained = dict(steps=3, positions=3000, wall_s=3600, backend="cpu", mesh="1x1", ttt_steps=3)
    (d / "eagle3.json").write_text(json.dumps(dict(kind="eagle3", layers=[2, 15, 27], draft_vocab=0, trained=trained,
                                                   target=["llama", 576, 30, 49152, 9, 3])))
    (d / "params" / "w").write_bytes(b"\0" * 2 ** 20)
    common = dict(prompt_tokens=5, wall_s=1.0, timing_includes="x", depth_ratio=1.0, temperature=0.0, n=1)
    res = [dict(bench="gsm8k", prompt_index=i, method="eagle3", k=3, tokens=10, cycles=5, **common) for i in range(2)]
    res += [dict(bench="gsm8k", prompt_index=i, method="ar", tokens=10, cycles=10, **common) for i in range(2)]
    res += [dict(bench="gsm8k", prompt_index=0, method="spd", tokens=10, cycles=10, **common)]
    (ev / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))
    (ev / "commands.txt").write_text("python -m infer.evaluate --methods ar,eagle3 --k 3\n")  # infer.evaluate's
    assert card.main(["--run", str(run), "--eval", str(ev), "--drafter", str(d)]) == 0
    text = (d / "CARD.md").read_text()
    assert "```\npython -m infer.evaluate --methods ar,eagle3 --k 3\n```" in text
    assert text.startswith("# EAGLE-3-style drafter for smollm2-135m-instruct") and "[2, 15, 27]" in text
    assert "over 3 unrolled draft steps" in text and "| 3 | 3,000 | 3 | 1.800 |" in text
    assert "| gsm8k | eagle3 | 3 | 0 | 2 | 20 | 2.000 | 10.0 | 1.00x |" in text and "| spd |" not in text
