"""Shared fixtures: tiny random Hugging Face checkpoints written to disk, and the transformers reference.

Every reference runs in PyTorch float32 with eager attention and the hub switched off.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# Pipeline tests need 8 devices; on the CPU they are host devices, set before JAX initialises.
jax.config.update("jax_num_cpu_devices", 8)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def tiny_config(model_type: str) -> dict:  # qwen3_5 -> tiny-qwen3_5.yaml
    return yaml.safe_load((CONFIGS / f"tiny-{model_type}.yaml").read_text())


def tiny_hf_model(model_type: str, tie: bool, seed: int = 0, **overrides):
    """A random transformers model of `model_type` with norm weights perturbed away from 1 and
    non-zero biases, so a mistake in any of them changes the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(tiny_config(model_type), tie_word_embeddings=tie, **overrides)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint dir src to dst and apply edit(weights: dict name -> np.ndarray) to its tensors."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    edit(w)
    save_file(w, dst / "model.safetensors")
    return dst


def cache_free_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt, each from a full forward from position 0 (no cache). Every
    forward has the final length (padded with token 0), so it compiles once: causal logits at t do not
    depend on the tokens after t."""
    import numpy as np

    seq = np.zeros((1, len(prompt) + n), np.int64)
    seq[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        seq[0, t] = int(model.logits(seq)[0, t - 1].argmax())
    return seq[0, len(prompt):].tolist()


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


# The tiny-model suite is compile bound (hundreds of small programs): XLA:CPU's backend optimisation is
# most of each compile and buys nothing at these sizes (tests/test_spd.py on 2 cores: 424 s -> 296 s).
# Paths compared for exact equality are compiled with the same flags; comparisons against transformers
# keep their tolerances (tests/tolerances.py), which cover reassociation. Runs that select the real
# model keep full optimisation: there execution, not compilation, is the cost.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# `_release_executables` drops every compiled program after each module, so a later module that runs
# the same programs (same tiny checkpoint, n and shapes) would compile them again. A persistent
# compilation cache private to each pytest process (each xdist worker) turns those recompiles into disk
# loads; it starts empty, so nothing from an earlier run or another checkout is reused. A disk load
# still counts as a compilation where tests count them: `CompileCache.compiles`, and JAX's
# backend_compile event, which JAX 0.10 emits around its cache lookup too (were it ever emitted only
# on a real compile, tests/test_spd.py's no-recompilation test would count less, never pass wrongly).
# Tests of the cache itself run CLIs in subprocesses, with a directory of their own.


def _xdist_controller(config) -> bool:  # runs no tests: workers do
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_configure(config):
    import re
    import tempfile

    # before any test initialises the backend, which reads XLA_FLAGS once (subprocesses, xdist workers
    # too, inherit it: add the flags once)
    flags = os.environ.get("XLA_FLAGS", "")
    if not re.search(r"(?<!not )real_model", config.getoption("markexpr") or "") and FAST_COMPILE not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()
    if _xdist_controller(config):
        return
    from spd_jax.decode.compile_cache import cache_events, enable_persistent_cache

    config._spd_xla_cache = tempfile.TemporaryDirectory(prefix="spd-jax-test-xla-")
    enable_persistent_cache(config._spd_xla_cache.name)
    config._spd_cache_events = cache_events


def pytest_unconfigure(config):
    cache = getattr(config, "_spd_xla_cache", None)
    if cache is not None:
        cache.cleanup()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: report to the controller
        session.config.workeroutput["spd_cache_events"] = session.config._spd_cache_events()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller, as each worker finishes
    e = getattr(node, "workeroutput", {}).get("spd_cache_events")
    if e:
        node.config._spd_worker_events = [*getattr(node.config, "_spd_worker_events", []), e]


def pytest_terminal_summary(terminalreporter, config):
    if _xdist_controller(config):
        runs = getattr(config, "_spd_worker_events", [])
    else:
        runs = [config._spd_cache_events()]
    hits, stored = sum(e["hits"] for e in runs), sum(e["misses"] for e in runs)
    if hits or stored:  # JAX counts a miss when it stores a new program (not ones it cannot cache)
        terminalreporter.write_line(f"persistent compilation cache (this run only): {hits} programs loaded, "
                                    f"{stored} compiled and stored"
                                    + (f" over {len(runs)} workers" if len(runs) > 1 else ""))


# Tiny-model cases whose paths the default run already covers through another model kind, mesh or n:
# marked `slow`, deselected from the default run (which must stay inside 10 minutes on 2 cores) and run
# by CI as a step of its own (`pytest -n 2 --dist loadfile -m slow`). One list, so what leaves the
# default run is visible.
SLOW = {
    "test_replay.py::test_psm_drafts_by_fill_replay_the_engines_run[8-False]": "the n=4 cases (with and without "
    "h_L); the replay itself at n=8: test_replay_equals_the_engine_for_any_pattern_of_right_drafts",
    "test_sharding.py::test_tp_greedy_equals_ar[qwen3]": "tp on llama; Qwen3 differs by q/k norms only",
    "test_sharding.py::test_tp_greedy_equals_ar[qwen3_5]": "tp on llama; Gated DeltaNet tp in test_tp_sharded_load",
    "test_sharding.py::test_stage_rules_put_each_stage_on_its_own_device[qwen3_5]": "llama case",
    "test_psm_train.py::test_train_forward_equals_engine_draft_with_anchor_norm[qwen3_5]": "the llama case; the "
    "gain's identity at norm_offset 1: test_anchor_norm_normalises_each_anchor_with_its_gain",
    "test_spd.py::test_sampling_matches_the_target_distribution[4-True-psm]": "the n=2 case; draft vocabulary: psm_train",
    "test_spd.py::test_sampling_matches_the_target_distribution[2-False-oracle]": "the PSM's q ring at n=2",
    "test_spd.py::test_greedy_equals_autoregressive_qwen3[3-stage_layers0-spd]": "llama and Qwen3.5 SPD cases",
    "test_spd.py::test_greedy_equals_autoregressive[llama-spd-4-None]": "placement tests run n=4 on this plan",
    "test_spd.py::test_greedy_equals_autoregressive[qwen3_5-spd-4-None]": "Qwen3.5 SPD at n=3 (mixed stages)",
    "test_spd.py::test_greedy_equals_autoregressive[llama-spd-4-stage_layers5]": "uneven plans: [1, 4, 3] on Qwen3.5",
    "test_spd.py::test_greedy_equals_autoregressive[llama-spd-3-stage_layers4]": "the uneven plan [1, 4, 3] on Qwen3.5",
    "test_spd.py::test_greedy_equals_autoregressive[llama-spd-1-None]": "n=1: the stage logic at n >= 2 covers it",
    "test_spd.py::test_greedy_equals_autoregressive[qwen3_5-pipeline-8-None]": "llama pipeline at n=8",
    "test_spd.py::test_greedy_equals_autoregressive[llama-spd-2-None]": "SPD at n=2 in the sampling test",
    "test_spd.py::test_greedy_equals_autoregressive[llama-pipeline-2-None]": "pipeline at n=8 and [3, 1, 1, 3]",
    "test_spd.py::test_psm_placement_is_lossless[llama-0]": "the own-device case moves the PSM further",
    "test_spd.py::test_psm_placement_is_lossless[qwen3_5-own]": "llama case (placement ignores layer kinds)",
    "test_spd.py::test_oracle_drafter_reaches_the_ideal_alpha[qwen3_5-2]": "llama at n=2, 4, 8 (the schedule is the engine's)",
    "test_spd.py::test_oracle_drafter_reaches_the_ideal_alpha[qwen3_5-4]": "llama at n=2, 4, 8 (the schedule is the engine's)",
    "test_spd.py::test_oracle_drafter_reaches_the_ideal_alpha[qwen3_5-8]": "llama at n=2, 4, 8 (the schedule is the engine's)",
    "test_spd.py::test_no_recompilation_per_cycle_or_length[qwen3_5]": "llama case: the shape buckets are the engine's",
    "test_spd.py::test_eos_stops_spd[qwen3_5]": "llama case",
    "test_chain.py::test_greedy_chain_equals_autoregressive[qwen3_5-7]": "llama at k=7; Qwen3.5's rewind: test_deltanet_rewinds_mid_chain",
    "test_chain.py::test_greedy_chain_equals_autoregressive[qwen3_5-3]": "llama at k=7; Qwen3.5's rewind: test_deltanet_rewinds_mid_chain",
    "test_cli.py::test_eagle3_mode_equals_ar": "test_chain's greedy chains equal ar; CLI plumbing: test_json_output_with_prompt_ids",
    "test_chain.py::test_greedy_chain_equals_autoregressive[llama-3]": "llama at k=7",
    "test_chain.py::test_sampling_matches_the_target_distribution": "SPD's chi-square test: one verify_sampled",
    "test_psm_train.py::test_train_forward_equals_engine_draft[llama-4]": "the target's kind only feeds the anchors: llama n=2, Qwen3.5 n=8",
    "test_psm_train.py::test_train_forward_equals_engine_draft[llama-8]": "the target's kind only feeds the anchors: llama n=2, Qwen3.5 n=8",
    "test_psm_train.py::test_train_forward_equals_engine_draft[qwen3_5-2]": "the target's kind only feeds the anchors: llama n=2, Qwen3.5 n=8",
    "test_psm_train.py::test_train_forward_equals_engine_draft[qwen3_5-4]": "the target's kind only feeds the anchors: llama n=2, Qwen3.5 n=8",
    "test_train_loop.py::test_loss_decreases": "steps on 8x1 in test_checkpoint_roundtrip_and_resume",
    "test_compile_cache.py::test_second_process_reuses_the_persistent_cache": "a subprocess pair",
    "test_train_loop.py::test_meshes_give_the_same_losses": "8x1 steps in test_checkpoint_roundtrip_and_resume",
    "test_train_loop.py::test_draft_vocabulary_trains_saves_and_decodes_exactly": "psm_train draft-vocabulary case",
    "test_train_loop.py::test_eagle3_trains_through_the_same_step": "test_chain's EAGLE-3 loss and identity tests",
    "test_train_loop.py::test_checkpoint_roundtrip_and_resume[2]": "resume at grad_accum 1; accumulation: test_gradient_accumulation_takes_the_whole_batch_step",
    "test_spd.py::test_a_greedy_cycle_runs_three_collectives[spd-own]": "the row-split placement counts the same "
    "three; the own device's tokens: test_psm_placement_is_lossless[llama-own]",
    "test_spd.py::test_bad_input[qwen3_5]": "llama case: the errors do not depend on the layer kinds",
    "test_spd.py::test_a_sampled_cycle_runs_what_the_cost_model_counts[spd-None]": "the top-k case counts the "
    "same draws and reductions, and its filter's candidates",
    "test_spd.py::test_a_sampled_cycle_runs_what_the_cost_model_counts[pipeline-None]": "the spd cases: the "
    "drafter's draw is what a pipeline cycle lacks",
    "test_psm_train.py::test_plain_loss_and_gradient_equal_the_fast_ones": "bench.scale's gradient check (two "
    "compiled gradients, 25 s); the forward's exactness: test_train_forward_equals_engine_draft",
    "test_reference_psm.py::test_spd_with_the_converted_psm_equals_ar": "SPD at n = 8 on Qwen3.5 (24 s); the "
    "converted PSM's drafts against the oracle at every fill: test_converted_psm_equals_the_oracle",
    "test_eagle3_standard.py::test_eagle3_decoding_with_it_equals_ar": "a chain loop's compile; the drafts against "
    "the oracle: test_converted_drafter_equals_the_oracle",
    **{f"test_eagle3_standard.py::test_each_component_is_checked_by_the_oracle[{m}]": "the other mutations (fc "
       "order, hidden_norm, input_layernorm, d2t) stay in the default run" for m in (
        "post_attention_layernorm dropped", "final norm dropped", "feature layer ids not + 1", "the target's RoPE base",
        "[feature, embedding] concatenated", "the normed output fed back")},
    "test_ppsd.py::test_greedy_equals_autoregressive[qwen3_5-4-stage_layers1]": "the qwen3_5 n = 2 case and the "
    "llama ones: the after-stage hook does not depend on the plan",
    "test_ppsd.py::test_greedy_equals_autoregressive[qwen3_5-3-stage_layers2]": "as the n = 4 case",
    "test_ppsd.py::test_a_head_that_is_the_rest_of_the_target_drafts_every_token_right[qwen3_5-plan1]": "plan0 "
    "checks the timing on Qwen3.5",
    "test_ppsd.py::test_teacher_forced_drafts_replay_the_engines_run[qwen3_5-4]": "the n = 2 case",
    "test_ppsd.py::test_checkpoints_load_for_their_target_and_plan[qwen3_5]": "the llama case: the checks do not "
    "depend on the layer kinds",
    "test_sixteen.py::test_tiny_qwen3_5_at_n16_equals_ar": "n = 16 in a process of 16 host devices (75 s); the "
    "engine's greedy path at n = 8: test_spd.py",
    "test_sixteen.py::test_sampling_at_n16_matches_the_target_distribution[spd]": "450 runs at n = 16 in a process "
    "of their own (110 s); the rule at n = 2 and 4: test_spd.py's chi-square test",
    "test_sixteen.py::test_sampling_at_n16_matches_the_target_distribution[ppsd]": "450 runs at n = 16 in a process "
    "of their own (80 s); PPSD's draws at n = 2: test_spd.py's chi-square test",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Drop compiled programs after each test module: every live XLA CPU executable holds memory
    mappings, and a whole suite's worth exceeds the kernel's map limit (vm.max_map_count)."""
    yield
    import gc

    from spd_jax import methods
    from spd_jax.decode import chain, pipelined

    methods.clear_compiled()
    pipelined._compiled.clear()
    chain._compiled.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: (model_type, tie, **overrides) -> (checkpoint dir, torch model); cached per arguments."""
    made = {}

    def make(model_type: str = "llama", tie: bool = False, **overrides):
        key = (model_type, tie, repr(sorted(overrides.items())))
        if key not in made:
            m = tiny_hf_model(model_type, tie, **overrides)
            d = tmp_path_factory.mktemp(f"{model_type}_{'tied' if tie else 'untied'}")
            made[key] = (save_hf(m, d), m)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default model (converted from its packaged GGUF on first use)."""
    import spd_jax

    return spd_jax.load_model("smollm2")
