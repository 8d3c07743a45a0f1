"""PPSD's early-exit head in the SPD engine (`drafters.ppsd`, method "ppsd"): greedy output is `ar`'s; the
draft for t + 1 reads x_t's exit state from this very cycle (a head that is the target's own last layer
drafts the target's tokens, every one accepted); the training forward is the engine's draft at every
position, and the teacher-forced drafts replay the engine's run; checkpoints load for their target and
plan only. Sampling's exactness: tests/test_spd.py's chi-square test, with a PPSD case."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.decode.schedule import replay_greedy
from spd_jax.drafters import ppsd
from spd_jax.drafters.objective import distill_kl
from spd_jax.drafters.ppsd import EXIT, EarlyExit, PPSDCheckpointError, PPSDConfig, init_ppsd, save_ppsd
from spd_jax.models import decoder
from spd_jax.models.attention import init_kv_cache
from spd_jax.placements import Placements
from spd_jax import methods
from tolerances import CACHED_VS_FULL, assert_close, bound

PROMPT = [1, 17, 42, 99, 5, 63, 7]
NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def deep(request, tiny_ckpt):
    """An 8-layer tiny model; Qwen3.5's pattern LLLA LLLA ends in a full-attention layer."""
    return spd_jax.load_model(tiny_ckpt(request.param, False, num_hidden_layers=8)[0])


@pytest.fixture(scope="module")
def reference(deep):
    return spd_jax.generate(deep, PROMPT, NEW, stop_at_eos=False).token_ids


def _ppsd(model, n, stage_layers=None, **kw):
    return spd_jax.generate(model, PROMPT, NEW, method=methods.PPSD(n=n, stage_layers=stage_layers, **kw),
                            stop_at_eos=False)


# llama: two depths and an uneven plan; Qwen3.5: the uneven plan with stages of both kinds and of one
@pytest.mark.parametrize("n,stage_layers", [(2, None), (4, [3, 1, 1, 3]), (3, [1, 4, 3])])
def test_greedy_equals_autoregressive(deep, reference, n, stage_layers):
    if deep.config.linear is not None and n != 3:
        pytest.skip("covered by llama; Qwen3.5 at [1, 4, 3]")
    res = _ppsd(deep, n, stage_layers, drafter_spec="random")
    assert res.token_ids == reference
    s = res.stats
    assert s["ppsd"] == "random" and s["psm"] is None and s["psm_device"] == 0 and s["tokens"] == NEW
    assert s["rejected"] > 0 and s["stage_layers"] == list(stage_layers or pipelined.plan_for(deep, n).counts)


def _rest_is_the_last_layer(model, plan):
    """(the target with the layers between the exit and its last layer made identities (their output
    projections zero: x + 0 + 0), a head whose one layer is a copy of its last layer): h_e then equals
    h_{L-1}, and the head computes the target's own h_L, final norm and head."""
    cfg = model.config
    spec = PPSDConfig.for_target(cfg, plan)
    kinds = cfg.layer_types
    assert kinds[-1] == "attention"
    layers = {kind: dict(stack) for kind, stack in model.params["layers"].items()}
    for i in range(spec.exit, cfg.num_layers - 1):
        j = kinds[:i].count(kinds[i])  # its place in its kind's stack
        for key in ("wo", "w_down", "w_out"):
            if key in layers[kinds[i]]:
                layers[kinds[i]][key] = layers[kinds[i]][key].at[j].set(0.0)
    edited = dataclasses.replace(model, params=dict(model.params, layers=layers), placements=Placements())
    v = init_ppsd(cfg, spec, model.params)
    for key, w in model.params["layers"]["attention"].items():
        v["params"][f"layer_{key}"] = w[-1:]
    return edited, spec, v


@pytest.mark.parametrize("plan", [(7, 1), (5, 1, 1, 1)])
def test_a_head_that_is_the_rest_of_the_target_drafts_every_token_right(deep, plan):
    """The draft for t + 1 must read x_t's exit state made in the cycle that drafts it (after stage 0's step):
    a head that computes the rest of the target then drafts the target's own token, every draft is accepted
    and the run takes the oracle's cycles. A head reading the state at the cycle's start (x_{t-1}'s) or
    another position's would be rejected at once."""
    if deep.config.linear is not None and len(plan) == 2:
        pytest.skip("llama case; Qwen3.5 at n = 4")
    target, spec, variables = _rest_is_the_last_layer(deep, plan)
    reference = spd_jax.generate(target, PROMPT, NEW, stop_at_eos=False).token_ids
    res = _ppsd(target, len(plan), list(plan), drafter_spec=(spec, variables))
    assert res.token_ids == reference
    s = res.stats
    assert s["rejected"] == 0 and s["accepted"] == NEW - 1 and s["cycles"] == NEW + len(plan) - 2
    assert s["ppsd"] == "given"


def _sensitive(model, spec, seed=0, scale=1.5):
    """Random head weights at a scale where attention is far from uniform: a row at a wrong position or a
    missing one moves the logits by far more than rounding."""
    v = init_ppsd(model.config, spec, model.params, seed)
    leaves, tree = jax.tree.flatten(v["params"])
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [x if x.ndim == 2 and x.shape[0] == model.config.vocab_size else  # the head: the target's
           x + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 2 else
           jax.random.normal(k, x.shape) * (scale / np.sqrt(x.shape[-2])) for k, x in zip(keys, leaves)]
    return {**v, "params": jax.tree.unflatten(tree, out)}


def test_train_forward_equals_engine_draft(deep):
    """For a random sequence, the training forward (one causal pass of `EarlyExit.train_hidden` over the
    teacher-forced exit states) and `ppsd_loss` give at every position what the engine's drafter computes:
    the prompt's rows prefilled (`spd_prefill`), then one row a cycle at the newest position over its cache
    (`spd_draft`). Control: the engine's row read one position late moves the draft."""
    cfg, T, P = deep.config, 20, 6
    spec = PPSDConfig.for_target(cfg, pipelined.plan_for(deep, 4).counts, num_layers=2)
    module, v = EarlyExit(cfg, spec), _sensitive(deep, spec)
    tokens = jax.random.randint(jax.random.key(0), (1, T), 3, cfg.vocab_size)
    h, x = ppsd.exit_states(deep.params, tokens, cfg, spec)
    fn = deep.params["final_norm"]
    got = module.apply(v, module.apply(v, h[:, :, EXIT], method=EarlyExit.train_hidden), fn,
                       method=EarlyExit.head_logits)[0]  # [T, V]

    @jax.jit
    def engine(v, rows, late):
        cache = init_kv_cache(cfg, spec.num_layers, 1, T + 1, jnp.float32)
        cache = module.apply(v, rows[None, :P], cache, jnp.int32(0), method=EarlyExit.forward)[1]  # the prompt

        def cycle(cache, t):  # the newest token's row (or, late, the one before it) at position t
            y, cache = module.apply(v, rows[t - late][None, None], cache, t, method=EarlyExit.forward)
            return cache, module.apply(v, y[0, 0], fn, method=EarlyExit.head_logits)

        return jax.lax.scan(cycle, cache, jnp.arange(P, T))[1]  # [T - P, V]

    want, late = (np.asarray(engine(v, h[0, :, EXIT], k)) for k in (0, 1))
    worst = max(assert_close(got[t], want[t - P], CACHED_VS_FULL, spec.num_layers, f"t={t}") for t in range(P, T))
    moved = sum(np.abs(late[t - P] - got[t]).max() > 10 * bound(got[t], CACHED_VS_FULL, spec.num_layers)
                for t in range(P, T))
    assert moved >= 0.8 * (T - P), moved
    # the loss reads the same drafts at its query positions, against the target's own logits there
    query = jnp.arange(P, T)[None]
    batch = dict(tokens=tokens, query=query, query_mask=jnp.ones_like(query, bool))
    params = dict(v["params"])
    frozen = {"params": {"lm_head": params.pop("lm_head")}}
    loss, sums = ppsd.ppsd_loss(params, frozen, deep.params, batch, cfg=cfg, spec=spec)
    teacher = decoder.lm_logits(deep.params, x[0, P:], cfg)
    kl = np.asarray(distill_kl(jnp.asarray(want), teacher)).sum()
    assert_close(float(sums["kl_sum"]), kl, CACHED_VS_FULL, spec.num_layers + cfg.num_layers, "kl_sum")
    assert float(loss) == float(sums["kl_sum"]) and float(sums["positions"]) == T - P
    print(f"{cfg.model_type}: max |train - engine| = {worst:.2e}; one position late moved {moved}/{T - P}")


@pytest.mark.parametrize("n", [2, 4])
def test_teacher_forced_drafts_replay_the_engines_run(deep, n):
    """The engine's run with a head drafting some tokens right and some wrong (the target's last layer,
    perturbed) against its teacher-forced drafts (`ppsd.drafts_by_fill`, the same at every fill), replayed
    (`decode.schedule`): the same cycles, accepted and rejected drafts."""
    if deep.config.linear is not None and n == 2:
        pytest.skip("llama case")
    plan = (8 - n + 1,) + (1,) * (n - 1)
    target, spec, v = _rest_is_the_last_layer(deep, plan)
    reference = spd_jax.generate(target, PROMPT, NEW, stop_at_eos=False).token_ids
    leaves, tree = jax.tree.flatten(v["params"])
    keys = jax.random.split(jax.random.key(n), len(leaves))
    noisy = [x if x.shape[0] == deep.config.vocab_size else x + 0.15 * jnp.std(x) * jax.random.normal(k, x.shape)
             for k, x in zip(keys, leaves)]
    v = {**v, "params": jax.tree.unflatten(tree, noisy)}
    res = _ppsd(target, n, list(plan), drafter_spec=(spec, v))
    assert res.token_ids == reference
    seq = PROMPT + reference
    nxt, drafts = (np.asarray(a)[0] for a in ppsd.drafts_by_fill(deep.config, spec, v, target.params,
                                                                  jnp.asarray([seq], jnp.int32)))
    assert (nxt[len(PROMPT) - 1:-1] == reference).all() and (drafts == drafts[..., :1]).all()
    right = np.zeros((len(seq), n), bool)
    right[:-1] = drafts[:-1] == np.asarray(seq[1:])[:, None]
    rep = replay_greedy(n, seq, len(PROMPT), right, NEW, eos_ids=())
    s = res.stats
    assert (rep.tokens, rep.cycles, rep.accepted, rep.rejected) == (s["tokens"], s["cycles"], s["accepted"],
                                                                     s["rejected"])
    assert s["accepted"] > 0 and s["rejected"] > 0, s


def test_checkpoints_load_for_their_target_and_plan(deep, reference, tmp_path, tiny_ckpt):
    """A saved head (its identity ppsd.json, the target's weights fingerprint) decodes exactly, reads back
    as saved, and is refused on another plan (another exit), another model, or as a PSM."""
    if deep.config.linear is not None:
        pytest.skip("the checkpoint's layout does not depend on the layer kinds")
    plan = pipelined.plan_for(deep, 4).counts
    spec = PPSDConfig.for_target(deep.config, plan)
    v = init_ppsd(deep.config, spec, deep.params, seed=2)
    save_ppsd(tmp_path / "h", v, spec, target_weights=deep.weights_fingerprint)
    meta = json.loads((tmp_path / "h" / "ppsd.json").read_text())
    assert meta["kind"] == "ppsd" and meta["plan"] == list(plan) and ppsd.read_spec(tmp_path / "h") == spec
    res = _ppsd(deep, 4, drafter_spec=str(tmp_path / "h"))
    assert res.token_ids == reference and res.stats["ppsd"] == str(tmp_path / "h")
    here = _ppsd(deep, 4, drafter_spec=(spec, v))
    assert (here.stats["accepted"], here.stats["cycles"]) == (res.stats["accepted"], res.stats["cycles"])
    other_plan = [1, 3, 2, 2] if list(plan) != [1, 3, 2, 2] else [2, 2, 1, 3]
    exit_2 = r"trained for the stage plan \[2, 2, 2, 2\] \(its exit after layer 2"
    with pytest.raises(PPSDCheckpointError, match=exit_2):
        _ppsd(deep, 4, other_plan, drafter_spec=str(tmp_path / "h"))
    other = spd_jax.load_model(tiny_ckpt("qwen3", False, num_hidden_layers=8)[0])
    with pytest.raises(PPSDCheckpointError, match="trained for another model"):
        spd_jax.generate(other, PROMPT, 4, method=methods.PPSD(n=4, drafter_spec=str(tmp_path / "h")))
    with pytest.raises(FileNotFoundError, match="not a PSM checkpoint"):
        spd_jax.generate(deep, PROMPT, 4, method=methods.SPD(n=4, spec=str(tmp_path / "h")))
    with pytest.raises(ValueError, match="drafts after stage 0's step, on its device: placement 'own'"):
        _ppsd(deep, 4, drafter_spec="random", psm_placement="own")


def test_trains_through_the_same_step_and_exports(tiny_ckpt, tmp_path):
    """method=ppsd through `train.step.make_step` (the PSM's batches and optimiser): the loss falls on a
    learnable corpus, the quick eval runs the ppsd method at the head's n, and the export (the target's
    head shared, not stored) loads and decodes exactly `ar`'s tokens, with the drafts of the weights in
    memory."""
    from spd_jax.drafters.base import join_params
    from spd_jax.sharding import data_model_mesh
    from train import checkpoints, corpus, quick_eval, step
    from train.config import TrainConfig

    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])
    rng = np.random.default_rng(0)
    data = []
    for _ in range(40):  # a random phrase repeated: predictable from the tokens seen, even for a random target
        ids = np.tile(rng.integers(3, model.config.vocab_size, 6), 8)[: rng.integers(30, 48)].astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[len(ids) // 2:-1] = True
        data.append((ids, mask))
    tc = TrainConfig.of(model=str(model.path), method="ppsd", n=4, buckets=(48,), max_len=48, batch_size=8,
                        warmup=5, steps=20, lr=3e-3, eval_tokens=12)
    spec = step.drafter_spec(model, tc)
    assert spec == PPSDConfig.for_target(model.config, (2, 2, 2, 2)) and checkpoints.export_name(spec) == "ppsd"
    opt = step.make_optimizer(tc)
    state, frozen = step.init_state(model, spec, tc, opt)
    update = step.make_step(model.config, spec, tc, opt, data_model_mesh(2, 1))
    batches = corpus.Batches(data, tc)
    losses = []
    for i in range(20):
        state, met = update(state, frozen, model.params, batches.get(i))
        losses.append(float(met["loss"]))
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    variables = join_params(state["params"], frozen)
    prompts = [ids[:12] for ids, _ in data[:2]]
    ev = quick_eval.quick_eval(model, spec, variables, prompts, tc)
    assert ev["S0"] == ev["alpha"] * 8 / 2 and ev["eval_tokens"] == 24
    checkpoints.save_drafter(tmp_path / "ppsd", variables, spec, dict(trained=dict(method="ppsd", steps=20)))
    assert json.loads((tmp_path / "ppsd" / "ppsd.json").read_text())["head"] == "shared"
    want = spd_jax.generate(model, prompts[1], 16, stop_at_eos=False).token_ids
    res = spd_jax.generate(model, prompts[1], 16, method=methods.PPSD(n=4, drafter_spec=str(tmp_path / "ppsd")),
                           stop_at_eos=False)
    assert res.token_ids == want and res.stats["accepted"] > 0
    here = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), variables)
    mem = spd_jax.generate(model, prompts[1], 16, method=methods.PPSD(n=4, drafter_spec=(spec, here)),
                           stop_at_eos=False)
    assert (mem.stats["accepted"], mem.stats["cycles"]) == (res.stats["accepted"], res.stats["cycles"])


@pytest.mark.real_model
def test_cli_trains_the_ppsd_head_and_it_decodes(smollm2, tmp_path):
    """train.main with configs/train/smollm2-ppsd-n8.yaml (at n = 2: the quick eval's engine compiles fast)
    on the PSM's data machinery, with a draft vocabulary and the teacher cache: metrics with the quick eval's
    S0, the exported head (bf16, the target's head rows shared) loads for SmolLM2 and its plan, records the
    target's weights, and decodes exactly `ar`'s tokens."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.main", "--config", str(root / "configs/train/smollm2-ppsd-n8.yaml"),
           "--mesh", "2x1", "--out", str(out), "--steps", "3", "sources=[gsm8k]", "limit=48", "buckets=[192]",
           "max_len=192", "batch_size=2", "eval_every=3", "eval_prompts=1", "eval_tokens=8", "save_every=3",
           "heldout=4", "log_every=1", "n=2", "draft_vocab=4096", "teacher_cache=true"]
    env = dict(__import__("os").environ, JAX_PLATFORMS="cpu")
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PPSD early-exit head for smollm2-135m-instruct: n=2, stages [15, 15], exit after layer 15" in r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3] and rows[-1]["eval_tokens"] == 8 and "S0" in rows[-1]
    meta = json.loads((out / "ppsd" / "ppsd.json").read_text())
    assert meta["target_weights"] == smollm2.weights_fingerprint and meta["head"] == "shared"
    assert meta["trained"]["method"] == "ppsd"
    assert json.loads((out / "run.json").read_text())["identity"]["method"] == "ppsd"
    spec, v = ppsd.load_ppsd(out / "ppsd", smollm2.config, (15, 15), smollm2.params)
    assert spec.plan == (15, 15) and spec.num_layers == 1 and spec.draft_vocab == 4096
    assert np.array_equal(v["params"]["lm_head"], np.asarray(smollm2.params["embed"])[v["vocab"]["ids"]])
    prompt = smollm2.encode("What is 7 times 8?")
    want = spd_jax.generate(smollm2, prompt, 16).token_ids
    assert spd_jax.generate(smollm2, prompt, 16, method=methods.PPSD(n=2, drafter_spec=str(out / "ppsd"))).token_ids == want


def test_evaluate_and_replay_take_the_ppsd_head(tiny_ckpt, tmp_path):
    """infer.evaluate runs ppsd rows beside spd's with the head given (--ppsd): they record its label and
    content and its projections; infer.replay --ppsd replays the head's teacher-forced drafts over the `ar`
    rows and equals each evaluated ppsd row (a saved head and an untrained one asked for by name)."""
    from infer import evaluate, replay
    from spd_jax.datasets import read_benchmark
    from spd_jax.drafters.store import content_id
    from spd_jax.reports.results import pooled
    from spd_jax.reports.tables import project, results_markdown

    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=8)[0])
    spec = PPSDConfig.for_target(model.config, pipelined.plan_for(model, 2).counts)
    save_ppsd(tmp_path / "h", _sensitive(model, spec, seed=4, scale=0.5), spec)
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 9, 7 + 2 * i, 3]}) + "\n" for i in range(2)))
    benches = {str(bench): read_benchmark(str(bench))}
    # --ppsd A,B: each head at the n it was trained for
    spec4 = PPSDConfig.for_target(model.config, pipelined.plan_for(model, 4).counts)
    save_ppsd(tmp_path / "h4", init_ppsd(model.config, spec4, model.params), spec4)
    heads = [str(tmp_path / "h4"), str(tmp_path / "h")]
    assert [evaluate.drafter_ref("ppsd", n, ppsd=heads) for n in (2, 4, 8)] == [heads[1], heads[0], None]
    assert evaluate.drafter_ref("ppsd", 8, ppsd=["random"]) == "random"
    with pytest.raises(ValueError, match="were all given for n=2: give one per n"):
        evaluate.drafter_ref("ppsd", 2, ppsd=[heads[1], heads[1]])
    for head, out in ((str(tmp_path / "h"), tmp_path / "eval"), ("random", tmp_path / "eval_random")):
        rows = evaluate.evaluate(model, benches, ["ar", "ppsd"], [2], [0.0], 10, out, ppsd=head, progress=False)
        mine = [r for r in rows if r["method"] == "ppsd"]
        assert len(mine) == 2 and all(r["ppsd"] == head and r["psm_device"] == 0 for r in mine)
        assert {r["drafter_id"] for r in mine} == {"random" if head == "random" else content_id(tmp_path / "h")}
        ar = {r["prompt_index"]: r["token_ids"] for r in rows if r["method"] == "ar"}
        assert all(r["token_ids"] == ar[r["prompt_index"]] for r in mine)
        assert replay.main(["--from", str(out), "--model", str(model.path), "--ppsd", head, "--n", "2"]) == 0
        res = json.loads((out / "replay" / "replay.json").read_text())["results"]
        assert [(r["method"], r["drafter"]) for r in res] == [("ppsd", head)]
        replayed = res[0]["pooled"]["all"]
        assert replayed["engine_checked"] == replayed["engine_equal"] == 2
        assert replayed["cycles"] == sum(r["cycles"] for r in mine)
    table = pooled(rows)
    project(table, model.config)  # the cost model's projection of a ppsd row: its head's cost on stage 0
    text = results_markdown(table, dict(model="m", max_new_tokens=10, limit=2, backend="cpu"))
    assert "| all | ppsd (untrained drafter) | 2 |" in text
    assert all(t["proj"]["H200"]["speedup"] > 0 for t in table if t["method"] == "ppsd")
