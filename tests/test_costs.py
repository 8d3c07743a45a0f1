"""The cost models: per layer / head / embedding / PSM counts equal the weights the model holds, layer
kinds order sensibly; the per-cycle model (`spd_jax.costs.cycle`) behaves as its formulas say, its
CPU fit recovers a known machine, and the balancer with fixed per-stage work is the brute-force optimum."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

import spd_jax
from spd_jax.config import ATTENTION, LINEAR, ModelConfig
from spd_jax.drafters import registry
from spd_jax.drafters.eagle3 import Eagle3Config
from spd_jax.drafters.psm import PSMConfig, init_psm
from spd_jax.models.costs import embed_cost, head_cost, layer_costs, psm_costs
from spd_jax.costs import baselines as base
from spd_jax.costs import calibration as calib
from spd_jax.costs import cycle as cyc
from spd_jax.costs import factorisations as fz
from spd_jax.pipeline.partition import StagePlan, balanced
from spd_jax.costs.profile import profile_cycle


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_5"])
def test_layer_params_match_the_loaded_weights(tiny_ckpt, model_type):
    m = spd_jax.load_model(tiny_ckpt(model_type, False)[0])
    costs = layer_costs(m.config, context_len=100, param_bytes=4)
    for kind, stack in m.params["layers"].items():
        per_layer = sum(int(np.prod(a.shape[1:])) for a in stack.values())
        got = {c.params for c in costs if c.kind == kind}
        assert got == {per_layer}, kind
        assert {c.weight_bytes for c in costs if c.kind == kind} == {4 * per_layer}
    assert head_cost(m.config).params == m.params["embed"].size + m.params["final_norm"].size


def test_qwen3_5_4b_costs():
    cfg = ModelConfig.named("qwen3.5-4b")
    short, long = layer_costs(cfg, 128), layer_costs(cfg, 32768)
    assert [c.kind for c in short].count(LINEAR) == 24
    attn = [c for c in short if c.kind == ATTENTION][0]
    lin = [c for c in short if c.kind == LINEAR][0]
    # DeltaNet state is fixed-size; attention's KV read grows with the context.
    assert [c for c in long if c.kind == LINEAR][0].state_bytes == lin.state_bytes
    assert [c for c in long if c.kind == ATTENTION][0].state_bytes > 100 * attn.state_bytes
    # ~4B parameters in all (embeddings tied)
    total = sum(c.params for c in short) + head_cost(cfg).params
    assert 3.5e9 < total < 5e9


# memory-bound, free links and launches: times are bytes / bandwidth alone
_PLAIN = cyc.Hardware("plain", 1e18, 1e11, 0.0, 1e18, 0.0, "test", True)


def _brute_force_max_cost(costs, extra) -> float:
    """The smallest max(stage layers + extra[s]) over every contiguous split into len(extra) stages."""
    L, n = len(costs), len(extra)
    best = float("inf")
    for cuts in itertools.combinations(range(1, L), n - 1):
        b = (0, *cuts, L)
        best = min(best, max(sum(costs[b[s]:b[s + 1]]) + extra[s] for s in range(n)))
    return best


def test_balanced_with_extra_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for L, n in [(5, 2), (7, 3), (9, 4), (10, 3), (8, 8)]:
        for _ in range(4):
            costs = rng.uniform(0.1, 2.0, L).tolist()
            extra = (rng.uniform(0, 3.0, n) * rng.integers(0, 2, n)).tolist()  # some stages with no fixed work
            plan = balanced(costs, n, extra)
            b = plan.bounds
            got = max(sum(costs[a:z]) + e for (a, z), e in zip(b, extra))
            assert plan.num_layers == L and plan.n == n
            assert np.isclose(got, _brute_force_max_cost(costs, extra), rtol=1e-12), (costs, extra, plan)
        # no fixed work: the plan without `extra`
        assert balanced(costs, n, [0.0] * n) == balanced(costs, n)
    with pytest.raises(ValueError, match="one fixed cost per stage"):
        balanced([1.0] * 6, 3, [0.0, 1.0])


def _psm_cfg(cfg, plan, **kw):
    return PSMConfig.for_target(cfg, plan.counts, num_layers=2, **kw)


def test_device_busy_and_predict_sanity():
    cfg = ModelConfig.named("qwen3.5-0.8b")
    n = 4
    plan = cyc.default_plan(cfg, n)
    psm = _psm_cfg(cfg, plan)
    busy = cyc.device_busy(cfg, plan, psm, _PLAIN, context=256)
    assert len(busy) == n and busy[-1] == max(busy)  # the PSM body sits on the last stage
    faster = cyc.device_busy(cfg, plan, psm, dataclasses.replace(_PLAIN, mem_bytes_per_s=2e11), context=256)
    assert all(f < b for f, b in zip(faster, busy))
    # whole heads on the last stage: the same work in all (a PSM with a head of its own: two heads either way),
    # the last device much busier
    own_psm = _psm_cfg(cfg, plan, own_head=True)
    busy_own = cyc.device_busy(cfg, plan, own_psm, _PLAIN, context=256)
    last = cyc.device_busy(cfg, plan, own_psm, _PLAIN, context=256, heads="last")
    assert sum(last) == pytest.approx(sum(busy_own), rel=1e-3) and last[-1] > busy_own[-1] and last[0] < busy_own[0]
    assert cyc.imbalance(last) > cyc.imbalance(busy_own) >= 1
    # the target's own head (the default PSM's): both heads in one pass over each shard, its rows read once
    assert cyc.cycle_costs(cfg, plan, psm, 256).one_head and not cyc.cycle_costs(cfg, plan, own_psm, 256).one_head
    shard = cyc.cycle_costs(cfg, plan, psm, 256).head_shard
    saved = [o - b for o, b in zip(busy_own, busy)]
    hidden = cyc.cycle_costs(cfg, plan, psm, 256).hidden_bytes  # the draft's row, read beside the verification's
    assert saved == pytest.approx([(shard.weight_bytes - hidden) / _PLAIN.mem_bytes_per_s] * n)
    # a draft vocabulary shrinks the device(s) that run the PSM's head only
    small_psm = _psm_cfg(cfg, plan, draft_vocab=1000)
    small = cyc.device_busy(cfg, plan, small_psm, _PLAIN, context=256, heads="last")
    assert small[:-1] == last[:-1] and small[-1] < last[-1]
    assert all(a < b for a, b in zip(cyc.device_busy(cfg, plan, small_psm, _PLAIN, context=256), busy_own))

    r = cyc.predict(cfg, n, psm, _PLAIN, context=256, S0=1.5)
    assert r["alpha"] == pytest.approx(1.5 * plan.max_layers / cfg.num_layers)
    assert r["speedup_spd"] == pytest.approx(r["alpha"] * r["ar_step_s"] / r["spd_cycle_s"])
    # tp: the KV heads (4) stay whole on 8 devices and each layer ends in all-reduces, so less than n-way
    assert 1 < r["speedup_tp"] < n and r["tp_comm_s"] < 1e-12
    assert r["spd_comm_s"] < 1e-12 and r["spd_cycle_s"] == pytest.approx(max(busy))
    # the plain pipeline: the engine without a drafter, n cycles per token, each its busiest device
    plain = cyc.cycle_costs(cfg, plan, None, 256)
    assert not plain.drafter and plain.packet_bytes == cfg.hidden_size * 2
    for heads in cyc.HEADS:
        p = cyc.predict(cfg, n, psm, _PLAIN, 256, 1.5, heads=heads)
        assert p["pipeline_token_s"] == pytest.approx(n * max(cyc._busy_s(plain, _PLAIN, heads)))
        assert p["speedup_pipeline"] <= 1.0
    assert r["speedup_pipeline"] > cyc.predict(cfg, n, psm, _PLAIN, 256, 1.5, heads="last")["speedup_pipeline"]
    slow_links = dataclasses.replace(_PLAIN, link_latency_s=1e-3, launch_s=1e-5)
    r2 = cyc.predict(cfg, n, psm, slow_links, context=256, S0=1.5)
    assert r2["speedup_tp"] < r["speedup_tp"] and r2["spd_cycle_s"] > r["spd_cycle_s"]
    # the engine's cycle: the stage output's ppermute, one all-gather of the hidden-state packets, one of the
    # choices, either heads placement
    assert r2["spd_comm_s"] == pytest.approx(3e-3)
    assert cyc.predict(cfg, n, psm, slow_links, 256, 1.5, heads="last")["spd_comm_s"] == pytest.approx(3e-3)
    H2 = cfg.hidden_size * 2
    # (the embedding split by rows where the devices divide the vocabulary: each choice carries its token's row)
    assert cfg.vocab_size % n == 0
    assert cyc.collectives(cyc.cycle_costs(cfg, plan, psm, 256)) == [
        ("ppermute", H2, "stage"), ("all_gather", (psm.m + 2) * H2, "stage"), ("all_gather", 2 * (8 + H2), "heads")]
    assert cyc.collectives(plain) == [("ppermute", H2, "stage"), ("all_gather", H2, "stage"),
                                      ("all_gather", 8 + H2, "heads")]
    whole = dataclasses.replace(cyc.cycle_costs(cfg, plan, psm, 256), embed_rows=False)
    assert cyc.collectives(whole)[-1] == ("all_gather", 16, "heads")
    assert "communication included" in r2["includes"]
    with pytest.raises(ValueError, match="heads must be one of"):
        cyc.predict(cfg, n, psm, _PLAIN, 256, 1.5, heads="spread")
    for hw in (cyc.H200_NVLINK, cyc.TPU_V5E_ICI):
        p = cyc.predict(cfg, 8, PSMConfig.for_target(cfg, cyc.default_plan(cfg, 8).counts), hw, 1024, S0=1.5)
        assert p["projection"] and "projection" in p["assumes"] and 0 < p["speedup_spd"] < 8


def test_device_aware_plan_counts_the_fixed_work():
    cfg = ModelConfig.named("qwen3-0.6b")
    n = 4
    plan = cyc.default_plan(cfg, n)
    psm = _psm_cfg(cfg, plan)
    for heads in cyc.HEADS:
        aware, busy = cyc.device_aware_plan(cfg, n, psm, cyc.H200_NVLINK, context=512, heads=heads)
        before = cyc.device_busy(cfg, plan, psm, cyc.H200_NVLINK, context=512, heads=heads)
        assert aware.counts[-1] < aware.counts[0] and max(busy) < max(before)
        assert cyc.imbalance(busy) < cyc.imbalance(before)
        assert busy == cyc.device_busy(cfg, aware, psm, cyc.H200_NVLINK, context=512, heads=heads)


def test_psm_placement():
    """The PSM body on any stage or on a device of its own: where the busy time and the heads go, and
    the best placement equals trying every device."""
    cfg = ModelConfig.named("qwen3-0.6b")
    n = 4
    plan = StagePlan((8, 8, 6, 6))  # the last two stages have room for the PSM
    psm = _psm_cfg(cfg, plan)
    last = cyc.device_busy(cfg, plan, psm, _PLAIN, context=512)
    for d in range(n):
        busy = cyc.device_busy(cfg, plan, psm, _PLAIN, context=512, psm_device=d)
        moved = [b - a for a, b in zip(last, busy)]  # the body left the last stage for stage d
        if d < n - 1:
            assert moved[d] > 0 and moved[-1] == pytest.approx(-moved[d]) and moved[:d] + moved[d + 1:-1] == [0] * (n - 2)
    own = cyc.device_busy(cfg, plan, psm, _PLAIN, context=512, psm_device=n)
    assert len(own) == n + 1 and own[n] < own[0]  # no layers: the body and two head shards
    cc = cyc.cycle_costs(cfg, plan, psm, 512, psm_device=n)
    assert cc.devices == n + 1 and cc.head_shard.params == -(-cfg.vocab_size // (n + 1)) * cfg.hidden_size + cfg.hidden_size
    links = dataclasses.replace(_PLAIN, link_latency_s=1e-3)
    assert cyc.comm_s(cc, links) == pytest.approx(3e-3)  # the same three collectives, over n + 1 devices
    with pytest.raises(ValueError, match="psm_device 5"):
        cyc.device_busy(cfg, plan, psm, _PLAIN, context=512, psm_device=n + 1)
    for own_ok in (False, True):
        best, busy = cyc.best_psm_device(cfg, plan, psm, cyc.H200_NVLINK, 512, own=own_ok)
        every = {d: cyc.predict(cfg, n, psm, cyc.H200_NVLINK, 512, S0=1.0, plan=plan, psm_device=d)["spd_cycle_s"]
                 for d in range(n + own_ok)}
        assert every[best] == pytest.approx(min(every.values())) and busy == cyc.device_busy(
            cfg, plan, psm, cyc.H200_NVLINK, 512, psm_device=best)
    assert cyc.best_psm_device(cfg, plan, psm, cyc.H200_NVLINK, 512)[0] in (2, 3)  # a short stage hosts it


def _profile_of(hw, cfg, plan, psm, context, ar_step=True):
    """The `profile_cycle` dict a machine `hw` would measure (float32)."""
    cc = cyc.cycle_costs(cfg, plan, psm, context, param_bytes=4)
    prof = dict(stage_ms=[1e3 * hw.part_s(s, stage=True) for s in cc.stages],
                verify_ms=1e3 * hw.part_s([cc.head_shard]), psm_ms=1e3 * hw.part_s(cc.psm_body),
                psm_head_ms=1e3 * hw.part_s([cc.psm_head_shard]), comm_ms=1e3 * cyc.comm_s(cc, hw), context=context,
                stage_layers=list(plan.counts))
    return prof | (dict(ar_step_ms=1e3 * base.ar_step_s(cfg, hw, context, 4)) if ar_step else {})


def test_fit_cpu_recovers_a_known_machine():
    """The fit recovers a machine whose stage programs run at half the bandwidth of the others (stacked
    weights on XLA:CPU), so the fitted profile predicts the AR step it measured; without an AR step
    (older profiles) one bandwidth for every part."""
    cfg = ModelConfig.named("qwen3.5-0.8b")
    plan = StagePlan((7, 6, 6, 5))
    psm = _psm_cfg(cfg, plan)
    true = cyc.Hardware("true", 1e18, 23e9, 40e-6, 23e9, 120e-6, "synthetic", False, stage_efficiency=0.5)
    prof = _profile_of(true, cfg, plan, psm, 300)
    hw = calib.fit_cpu(prof, cfg, psm, param_bytes=4)
    assert hw.mem_bytes_per_s == pytest.approx(23e9, rel=1e-6)
    assert hw.stage_efficiency == pytest.approx(0.5, rel=1e-6)
    assert hw.launch_s == pytest.approx(120e-6, rel=1e-6)
    assert hw.link_latency_s == pytest.approx(40e-6, rel=1e-6)
    assert not hw.projection and "AR step +0.00" in hw.assumes
    # the fitted profile reproduces the measured parts and the AR step (a device's busy time: its stage and the
    # heads, for this PSM on the target's head one part of both: `cycle.heads_shard_s`)
    busy = cyc.device_busy(cfg, plan, psm, hw, 300, param_bytes=4)
    cc = cyc.cycle_costs(cfg, plan, psm, 300, param_bytes=4)
    assert busy[1] == pytest.approx(prof["stage_ms"][1] / 1e3 + cyc.heads_shard_s(cc, true))
    assert base.ar_step_s(cfg, hw, 300, 4) == pytest.approx(prof["ar_step_ms"] / 1e3)
    # an older profile, no AR step: one bandwidth
    one = dataclasses.replace(true, stage_efficiency=1.0)
    hw1 = calib.fit_cpu(_profile_of(one, cfg, plan, psm, 300, ar_step=False), cfg, psm, param_bytes=4)
    assert hw1.mem_bytes_per_s == pytest.approx(23e9, rel=1e-6) and hw1.stage_efficiency == 1.0


def test_profile_cycle_times_what_the_fit_reads(tiny_ckpt):
    """`profile_cycle` on a tiny model (2 host devices): every part the fit reads, the AR step and the
    fused cycle's collectives, and a profile fitted from them."""
    model = spd_jax.load_model(tiny_ckpt("qwen3", False)[0])
    plan = StagePlan((2, 2))
    prof = profile_cycle(model, plan, psm_layers=1, context=16, iters=2)
    assert set(prof) >= {"stage_ms", "verify_ms", "psm_ms", "psm_head_ms", "ar_step_ms", "comm_ms", "device_ms"}
    assert len(prof["stage_ms"]) == 2 and min(*prof["stage_ms"], prof["ar_step_ms"], prof["comm_ms"]) > 0
    assert prof["psm_device"] == 1 and len(prof["device_ms"]) == 2 and min(prof["device_ms"]) > 0
    psm = PSMConfig.for_target(model.config, plan.counts, num_layers=1)
    hw = calib.fit_cpu(prof, model.config, psm, param_bytes=4)
    assert hw.mem_bytes_per_s > 0 and "AR step" in hw.assumes
    # the PSM on a device of its own: a third device, without a stage, and the heads' shards a third of the rows
    own = profile_cycle(model, plan, psm_layers=1, context=16, iters=2, psm_device=2)
    assert own["psm_device"] == 2 and len(own["device_ms"]) == 3 and len(own["stage_ms"]) == 2
    assert calib.fit_cpu(own, model.config, psm, param_bytes=4).mem_bytes_per_s > 0
    with pytest.raises(ValueError, match="a device of its own"):
        profile_cycle(model, plan, psm_layers=1, context=16, iters=2, psm_device=3)


def test_tp_counts_what_its_placement_splits():
    """`tp`'s step as TP_RULES places the model: a dense model whose heads n divides splits every layer
    (free links: exactly n-way) and ends each in two all-reduces of [H], plus the embedding's; SmolLM2's 9
    query heads stay whole on 2, 4 and 8 devices (one all-reduce per layer, its MLP's), split on 3."""
    cfg = ModelConfig.named("qwen3-0.6b")
    t = base.tp_step(cfg, _PLAIN, 4, 256)
    assert t["all_reduces"] == 2 * cfg.num_layers + 1
    assert base.ar_step_s(cfg, _PLAIN, 256) / t["step_s"] == pytest.approx(4, rel=1e-3)
    small = ModelConfig.named("smollm2-135m-instruct")
    assert [base.tp_step(small, _PLAIN, n, 256)["all_reduces"] for n in (2, 3, 4, 8)] == [31, 61, 31, 31]
    links = dataclasses.replace(_PLAIN, link_latency_s=1e-5)
    assert base.tp_step(cfg, links, 4, 256)["comm_s"] == pytest.approx((2 * cfg.num_layers + 2) * 1e-5)
    # gpt-fast's placement: embedding and head whole, no all-reduce for them
    assert base.tp_step(cfg, links, 4, 256, vocab_split=False)["all_reduces"] == 2 * cfg.num_layers


@pytest.mark.parametrize("tie", [False, True])
def test_psm_and_embedding_params_match_the_loaded_weights(tiny_ckpt, tie):
    m = spd_jax.load_model(tiny_ckpt("qwen3", tie)[0])
    cfg = m.config
    total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(m.params))
    counted = sum(c.params for c in layer_costs(cfg, 10)) + head_cost(cfg).params + embed_cost(cfg).params
    assert counted == total
    plan = StagePlan((2, 2))
    for draft_vocab in (0, 40):
        spec = _psm_cfg(cfg, plan, draft_vocab=draft_vocab)
        ids = np.arange(draft_vocab) * 3 if draft_vocab else None
        # shapes only (no init compiled): the PSM's weights as `init_psm` builds them, head included
        v = jax.eval_shape(lambda p, spec=spec, ids=ids: init_psm(cfg, spec, p, vocab_ids=ids), m.params)
        held = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(v["params"]))
        costs = psm_costs(cfg, spec.num_layers, spec.m, spec.draft_vocab, rows=3, context_len=10)
        assert sum(c.params for c in costs) == held, draft_vocab


def test_the_psm_projections_count_each_row_by_its_own_type():
    """A draft block's projections as `PSM.block_rows` runs them: each in-flight depth's row by its own type and
    the one completed row by the deepest, FLOPs 2 sum (a + 1) H^2 over the rows' types a; every type present read
    once, one the staircase skips not at all (SmolLM2 n = 2 has no in-flight row of type 1 or 3)."""
    cfg = ModelConfig.named("smollm2-135m-instruct")
    H, pb = cfg.hidden_size, 4
    for n, types, read in ((8, (0, 1, 1, 2, 2, 2, 3, 3, 4), 1 + 2 + 3 + 4 + 5), (2, (0, 2, 4), 1 + 3 + 5)):
        spec = _psm_cfg(cfg, cyc.default_plan(cfg, n))
        assert spec.staircase[:n] + (spec.m - 1,) == types, n
        proj = registry.PSM.cost(cfg, spec, 512, pb)[0]
        assert proj.kind == "psm_proj" and proj.params == 15 * H * H
        assert proj.flops == 2 * sum(a + 1 for a in types) * H * H, n
        assert proj.bytes == read * H * H * pb + (n + 1) * spec.m * H * pb, n  # + the anchor states read
    with pytest.raises(ValueError, match="projected row types"):
        psm_costs(cfg, 2, 5, 0, 9, 512, projected=[5])


def test_the_cost_model_counts_drafters_through_their_kinds(monkeypatch):
    """A drafter's draft is counted once, by its kind (`DrafterKind.cost`): the cycle's PSM parts and the
    chain round's drafter steps are that count, and follow it when it changes."""
    cfg = ModelConfig.named("qwen3-0.6b")
    plan = cyc.default_plan(cfg, 4)
    psm, e3 = _psm_cfg(cfg, plan, draft_vocab=1000), Eagle3Config.for_target(cfg)
    cc = cyc.cycle_costs(cfg, plan, psm, 512)
    assert [*cc.psm_body, cc.psm_head] == registry.PSM.cost(cfg, psm, 512, rows=plan.n + 1)
    layer, head = registry.EAGLE3.cost(cfg, e3, 512)
    parts = base.eagle3_round_costs(cfg, 3, 512)
    assert parts["draft"] == [[head], [layer, head], [layer, head]]
    assert parts["commit"][0][1] == registry.EAGLE3.cost(cfg, e3, 512, rows=4)[0]
    for k in (registry.PSM, registry.EAGLE3):  # a kind's count doubled: the cost model's drafter parts double
        monkeypatch.setattr(k, "cost", lambda *a, _c=k.cost, **kw: [dataclasses.replace(c, flops=2 * c.flops)
                                                                    for c in _c(*a, **kw)])
    assert [c.flops for c in cyc.cycle_costs(cfg, plan, psm, 512).psm_body] == [2 * c.flops for c in cc.psm_body]
    assert base.eagle3_round_costs(cfg, 3, 512)["draft"][1] == [dataclasses.replace(c, flops=2 * c.flops)
                                                              for c in (layer, head)]


def test_eagle3_round_projection():
    """One chain round on one device: drafts cost time, so 1 token per round is slower than `ar`, and
    every draft accepted (k + 1 per round) is faster but below k + 1; a larger k costs more per round."""
    cfg = ModelConfig.named("qwen3-0.6b")
    for hw in (cyc.H200_NVLINK, cyc.TPU_V5E_ICI):
        slow = base.predict_eagle3(cfg, 3, hw, 512, 1.0)
        fast = base.predict_eagle3(cfg, 3, hw, 512, 4.0)
        assert slow["speedup"] < 1 < fast["speedup"] < 4
        assert set(slow["parts_s"]) == {"draft", "target", "commit"}
        assert slow["round_s"] > slow["ar_step_s"]  # the k + 1 position pass reads the weights once, plus drafts
        assert base.predict_eagle3(cfg, 7, hw, 512, 1.0)["round_s"] > slow["round_s"]


def test_acceptance_carries_across_depths():
    """S0 at n = 8 read as a per-draft acceptance p (docs/SPD.md, section 3) and back; held at the
    reference's n = 8 p, n = 4 lands at 2.53 where the reference measured 2.64 (its own n = 4 PSM): within 5%,
    which is what projecting other depths at one p assumes."""
    p = fz.acceptance(3.39, 8, 4, 32)
    assert p == pytest.approx(0.806, abs=1e-3) and 8 * fz.alpha_at(p, 8) == pytest.approx(3.39)
    assert 4 * fz.alpha_at(p, 4) == pytest.approx(2.64, rel=0.05)
    assert fz.alpha_at(1.0, 8) == 1.0 and fz.alpha_at(0.0, 8) == pytest.approx(1 / 8)


def test_factorisations_of_a_device_count():
    got = {(f.stages, f.model, f.psm_own) for f in fz.factorisations(8)}
    assert got == {(8, 1, False), (4, 2, False), (2, 4, False), (1, 8, False), (7, 1, True), (3, 2, True)}
    assert all(f.devices == 8 for f in fz.factorisations(8))
    assert [f.method for f in (fz.Factorisation(1, 1), fz.Factorisation(1, 8), fz.Factorisation(4, 2))] == [
        "ar", "tp", "spd"]


def test_a_mesh_of_one_model_column_is_the_pipeline():
    """model = 1 is the engine as it runs now: the same cycle as `predict`'s, PSM on a stage or its own."""
    cfg = ModelConfig.named("qwen3.5-0.8b")
    plan = cyc.default_plan(cfg, 4)
    psm = _psm_cfg(cfg, plan)
    for d in (plan.n - 1, plan.n):
        r = cyc.predict(cfg, 4, psm, cyc.H100_NVLINK, 512, S0=2.0, plan=plan, psm_device=d)
        assert fz.mesh_cycle(cfg, plan, psm, cyc.H100_NVLINK, 512, psm_device=d)["cycle_s"] == pytest.approx(
            r["spd_cycle_s"])


def test_stages_split_over_model_as_tp_splits_them():
    """On a (stage, model) mesh each stage's layers are `tp`'s shares: with free links and launches a dense
    model whose heads the width divides runs each stage's layers in 1/model of the time, and each layer ends in
    two all-reduces of [H] along `model`, which a link latency puts on the stage's time; the PSM's layers
    split likewise, its projections whole."""
    cfg = ModelConfig.named("qwen3-0.6b")  # 16 query and 8 KV heads: split 2 and 4 ways
    plan = cyc.default_plan(cfg, 4)
    psm = _psm_cfg(cfg, plan)
    one = cyc.cycle_costs(cfg, plan, psm, 512)
    for m in (2, 4):
        cc = cyc.cycle_costs(cfg, plan, psm, 512, model=m)
        assert cc.stage_all_reduces == tuple(2 * k for k in plan.counts) and cc.psm_all_reduces == 2 * psm.num_layers
        assert [_PLAIN.part_s(s) for s in cc.stages] == pytest.approx([_PLAIN.part_s(s) / m for s in one.stages],
                                                                      rel=2e-3)
        proj = [c for c in cc.psm_body if c.kind == "psm_proj"]
        assert proj == [c for c in one.psm_body if c.kind == "psm_proj"]
        links = dataclasses.replace(_PLAIN, link_latency_s=1e-5)
        busy, free = cyc._busy_s(cc, links, "sharded"), cyc._busy_s(cc, _PLAIN, "sharded")
        assert busy[0] - free[0] == pytest.approx(cc.stage_all_reduces[0] * 1e-5)
        # the heads split over both axes: 1/(n m) of the vocabulary a device, gathered over all n m
        both = cyc.cycle_costs(cfg, plan, psm, 512, model=m, head_axes="both")
        assert both.head_devices == 4 * m and both.head_shard.params < cc.head_shard.params
    with pytest.raises(ValueError, match="head_axes"):
        cyc.cycle_costs(cfg, plan, psm, 512, model=2, head_axes="model")


def test_mesh_nodes_and_the_best_tp_stays_in_a_node():
    """Devices fill nodes `model` fastest: a 4 x 4 mesh on 8-GPU nodes keeps each model group in a node and
    spans two along `stage`; on two InfiniBand nodes the best pure tp is 8 GPUs in one node (16 across both
    pays the network on every layer), and spd may use all 16."""
    from spd_jax.costs.hardware import H100_IB as ib
    assert cyc.mesh_nodes(ib, 4, 4) == dict(model=1, stage=2, all=2, permute=2)
    assert cyc.mesh_nodes(ib, 8, 1) == dict(model=1, stage=1, all=1, permute=1)
    assert cyc.mesh_nodes(cyc.H100_NVLINK, 16, 1)["stage"] == 1
    cfg = ModelConfig.named("qwen3.5-4b")
    best = fz.best_factorisations(cfg, 16, ib, 1024, 0.8, lambda n: 3)
    tp16 = next(r for r in best["all"] if r["method"] == "tp" and r["devices"] == 16)
    assert best["tp"]["devices"] == 8 and tp16["speedup"] < best["tp"]["speedup"]
    assert best["spd"]["speedup"] == max(r["speedup"] for r in best["all"] if r["method"] == "spd")


def test_sampled_cycle_collectives():
    """A sampled cycle (`decode.vocab` as compiled): the greedy cycle's permute and packet all-gather, the
    draft's Gumbel argmax and its softmax's two scalar reductions, the verification's softmax reductions, one
    all-reduce of p(d), q(d) and the residual's mass and its draw, the two tokens' embedding rows; a filter
    adds each draw's candidates; a draft vocabulary, its q rows (sampled) or its draft's embedding lookup
    (greedy)."""
    cfg = ModelConfig.named("qwen3-0.6b")
    plan = cyc.default_plan(cfg, 4)

    def kinds(cc, **kw):
        out = {}
        for kind, _, axis in cyc.collectives(cc, **kw):
            out[kind, axis] = out.get((kind, axis), 0) + 1
        return out

    cc = cyc.cycle_costs(cfg, plan, _psm_cfg(cfg, plan), 512)
    assert cc.embed_rows
    assert kinds(cc, sampled=True) == {("ppermute", "stage"): 1, ("all_gather", "stage"): 1,
                                       ("all_gather", "heads"): 2, ("all_reduce", "heads"): 6}
    assert kinds(cc, sampled=True, filter_rows=64)[("all_gather", "heads")] == 4
    plain = cyc.cycle_costs(cfg, plan, None, 512)
    assert kinds(plain, sampled=True) == {("ppermute", "stage"): 1, ("all_gather", "stage"): 1,
                                          ("all_gather", "heads"): 1, ("all_reduce", "heads"): 4}
    dv = cyc.cycle_costs(cfg, plan, _psm_cfg(cfg, plan, draft_vocab=32000), 512)
    assert dv.draft_rows == 8000 and ("all_gather", 8000 * 4, "heads") in cyc.collectives(dv, sampled=True)
    assert cyc.collectives(dv)[-1] == ("all_reduce", cfg.hidden_size * 2, "heads")
    links = dataclasses.replace(_PLAIN, link_latency_s=1e-3)
    assert cyc.comm_s(cc, links, sampled=True) == pytest.approx(10e-3)


def test_a_layer_with_fewer_querying_rows_and_its_scores():
    """`kind_cost(query_rows=q)`: every row runs the kind's q/k/v projections (`every_row_leaves`), q rows the
    rest; the scores (float32 [Nq, q, context], four passes) grow with the querying rows; tensor parallelism
    splits the scores with the query heads and the cache with the KV heads (`baselines.tp_state_share`)."""
    from spd_jax.models.costs import kind_cost
    from spd_jax.models.kinds import FULL_ATTENTION, KINDS

    cfg = ModelConfig.named("qwen3.5-4b")
    one, nine = (kind_cost(cfg, ATTENTION, 1024, 2, 2, rows) for rows in (1, 9))
    last = kind_cost(cfg, ATTENTION, 1024, 2, 2, 9, query_rows=1)
    leaves = FULL_ATTENTION.schema(cfg)
    every = 2 * sum(int(np.prod(leaves[k].shape)) for k in ("wq", "wk", "wv"))
    assert nine.flops == 9 * one.flops and last.flops == 9 * every + (one.flops - every)
    scores = 4 * cfg.num_heads * 1024 * 4
    assert nine.state_bytes - one.state_bytes == 8 * scores and last.state_bytes == one.state_bytes
    assert last.weight_bytes == nine.weight_bytes == one.weight_bytes
    with pytest.raises(ValueError, match="query_rows"):
        kind_cost(cfg, LINEAR, 1024, 2, 2, 9, query_rows=1)  # Gated DeltaNet runs every row it is given
    with pytest.raises(ValueError, match="query_rows"):
        kind_cost(cfg, ATTENTION, 1024, 2, 2, 3, query_rows=4)
    # Qwen3.5-4B at tp 8: 16 query heads split, 4 KV heads do not (8 does not divide them)
    cache = KINDS[ATTENTION].state_bytes(cfg, 1024, 2)
    share, _ = base.tp_layer_cost(cfg, ATTENTION, 1024, 8, 2, 2)
    assert base.tp_mixer_split(cfg, ATTENTION, 8) == (True, False)
    assert share.state_bytes == cache + scores // 8
