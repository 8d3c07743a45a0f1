"""The cost model's hardware profiles reproduce the published measurements they cite
(`spd_jax.costs.calibration`: gpt-fast's Llama-2-7B tensor-parallel curve on 8 x A100, vLLM's batch-1
Qwen3-8B latency on one H100, a measured TPU v5e all-gather), through the same formulas the projections
use, within TOLERANCE; and the profiles as they were before the calibration (no per-layer cost, 100% of
peak bandwidth, 5 us per collective) miss them, so these checks can fail. Numbers only: nothing compiles.
"""

import dataclasses
from pathlib import Path

import pytest

from spd_jax.costs import calibration
from spd_jax.costs.hardware import A100_GPT_FAST, H100_NVLINK, H200_NVLINK, TPU_V5E_ICI
from spd_jax.reports.projections import projections_markdown

TOLERANCE = 0.10  # relative, on every figure


def before(hw):
    """A profile as it was before the calibration: no per-layer cost, every byte at peak, 5 us per
    collective whatever its kind and device count."""
    return dataclasses.replace(hw, layer_s=0.0, mem_efficiency=1.0, link_efficiency=1.0, link_latency_s=5e-6,
                               hop_latency_s=0.0)


@pytest.mark.parametrize("i", range(len(calibration.figures())))
def test_each_published_figure_is_reproduced(i):
    f = calibration.figures()[i]
    assert f["model"] == pytest.approx(f["published"], rel=TOLERANCE), f


def test_the_uncalibrated_profiles_miss_them():
    old = calibration.figures(before(A100_GPT_FAST), before(H100_NVLINK), before(TPU_V5E_ICI))
    missed = [f["what"] for f in old if f["model"] != pytest.approx(f["published"], rel=TOLERANCE)]
    # TP at 8 (5.2x against 3.13 measured) and vLLM's step (4.5 ms against 7.28) among them
    assert "gpt-fast Llama-2-7B, TP 8 speedup" in missed and "vLLM Qwen3-8B, 1 x H100, batch 1, ms/token" in missed


def test_collective_latencies_follow_their_sources():
    # NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc, Ring / LL over NVLink): 6.6 us + 0.6 us a step,
    # 2 (D - 1) steps per all-reduce, D - 1 per all-gather
    for D in (2, 4, 8):
        assert H100_NVLINK.latency_s("all_reduce", D) == pytest.approx(6.6e-6 + 0.6e-6 * 2 * (D - 1), rel=1e-9)
        assert H100_NVLINK.latency_s("all_gather", D) == pytest.approx(6.6e-6 + 0.6e-6 * (D - 1), rel=1e-9)
    assert H100_NVLINK.latency_s("all_reduce", 1) == 0.0
    # the H200 profile shares the H100's fixed costs and links; only its bandwidth differs
    assert dataclasses.replace(H200_NVLINK, mem_bytes_per_s=H100_NVLINK.mem_bytes_per_s, name=H100_NVLINK.name,
                               assumes=H100_NVLINK.assumes) == H100_NVLINK


def test_the_projections_page_is_current():
    """docs/projections.md is what `python -m bench.projections --out docs/projections.md` writes now: a
    changed constant or formula regenerates it (never hand-edited)."""
    page = Path(__file__).resolve().parents[1] / "docs" / "projections.md"
    assert page.read_text() == projections_markdown(), \
        "stale: regenerate it with python -m bench.projections --out docs/projections.md"


HELD_OUT_TOLERANCE = 0.10  # relative: the calibration's own tolerance, for a figure the fit never saw


def test_held_out_tp_measurement():
    """SGLang's batch-1 Llama-3-8B decode on H100 at TP 1 and TP 8 (sgl-project/sglang issue 1008), kept out
    of every fit: NCCL's latency class lands within HELD_OUT_TOLERANCE of the TP 8 step and speedup; the
    one-shot class (4.5 us a collective, fitted on gpt-fast's A100) is faster than measured, so on H100 it is
    the optimistic bound of TP, not its expected figure."""
    got = {(f["what"], f["latency"]): f for f in calibration.held_out()}
    one = got["SGLang Llama-3-8B, 1 x H100, batch 1, ms/token", "-"]
    assert one["model"] == pytest.approx(one["published"], rel=HELD_OUT_TOLERANCE)
    for what in ("SGLang Llama-3-8B, TP 8 on H100, batch 1, ms/token", "SGLang Llama-3-8B, TP 8 speedup over TP 1"):
        nccl = got[what, "nccl"]
        assert nccl["model"] == pytest.approx(nccl["published"], rel=HELD_OUT_TOLERANCE), nccl
    step = got["SGLang Llama-3-8B, TP 8 on H100, batch 1, ms/token", "one-shot"]
    assert step["model"] < step["published"] * (1 - HELD_OUT_TOLERANCE)


# The paper's ratios are of parts of one cycle, so the unknown GPU's speed cancels; what does not cancel is
# the regime: with the calibrated 50 us per layer the PSM body is 0.87 of a stage's layers, and 0.77 when a
# fixed 1 ms per layer dominates (the reference code's eager regime: 4.20 ms for 4 layers). 15% covers that
# spread around the paper's 0.83 and its single-run figures, and still fails a model that put the PSM's whole
# head on its device (1.74) or sized its block wrong.
PAPER_TOLERANCE = 0.15


def test_the_papers_cycle_ratios():
    """Qwen3.5-4B, n = 8, Ls = 3, the PSM on a device of its own, on the H100 profile: the PSM body over the
    slowest stage near the paper's 0.83 (3.49 / 4.20 ms), and the cycle over the slowest stage near its 1.29
    (5.41 / 4.20 ms). The second is partly a coincidence of kinds: in the model the excess is the head shards
    and the three collectives; in the reference code, its verification on the last stage and host-side
    synchronisation, which the on-device engine does not have (at 1 ms a layer the model gives 1.01)."""
    r = calibration.paper_ratios()
    assert r["paper_psm_over_stage"] == pytest.approx(0.83, abs=0.005)
    assert r["paper_cycle_over_stage"] == pytest.approx(1.29, abs=0.005)
    assert r["psm_over_stage"] == pytest.approx(r["paper_psm_over_stage"], rel=PAPER_TOLERANCE)
    assert r["cycle_over_stage"] == pytest.approx(r["paper_cycle_over_stage"], rel=PAPER_TOLERANCE)
    slow = calibration.paper_ratios(dataclasses.replace(H100_NVLINK, layer_s=1e-3))
    assert slow["psm_over_stage"] == pytest.approx(r["paper_psm_over_stage"], rel=PAPER_TOLERANCE)


def test_latency_classes_and_nodes():
    """One-shot: one fixed latency inside a node, up to its device limit (PCIe: 2), NCCL's model elsewhere;
    across nodes NCCL's ring with the network on the steps that cross, or its tree where lower (NVIDIA/nccl
    src/graph/tuning.cc); TPU has one class."""
    from spd_jax.costs.hardware import H100_ETH, H100_IB, L40S_PCIE, TPU_V5E_ICI

    one = H100_NVLINK.with_latency("one-shot")
    assert [one.latency_s("all_reduce", d) for d in (2, 8)] == [4.5e-6, 4.5e-6]
    assert H100_NVLINK.latency_s("all_reduce", 8) == pytest.approx(15e-6)
    pcie = L40S_PCIE.with_latency("one-shot")
    assert pcie.latency_s("all_reduce", 2) == 4.5e-6 and pcie.latency_s("all_reduce", 4) == L40S_PCIE.latency_s(
        "all_reduce", 4)
    # across two nodes: never one-shot; the tree's 6.8 + 2 (7 x 0.6 + 5.0) = 25.2 us beats the ring's 40 us
    assert H100_IB.with_latency("one-shot").latency_s("all_reduce", 16, 2) == pytest.approx(25.2e-6)
    assert H100_IB.latency_s("all_gather", 16, 2) == pytest.approx((6.6 + 14 * 1.0 + 2.7) * 1e-6)
    assert H100_ETH.latency_s("all_reduce", 16, 2) > H100_IB.latency_s("all_reduce", 16, 2)
    assert H100_IB.nodes(16) == 2 and H100_IB.nodes(8) == 1 and H100_NVLINK.nodes(16) == 1
    assert TPU_V5E_ICI.with_latency("one-shot").latency_s("all_reduce", 8) == TPU_V5E_ICI.latency_s("all_reduce", 8)
    with pytest.raises(ValueError, match="latency_class"):
        H100_NVLINK.with_latency("two-shot")
