"""Bad arguments to `generate` and the pipelined engine fail before anything compiles, with a message that
names the problem and the fix; a PSM given in another dtype is brought to the model's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spd_jax
from spd_jax.decode import pipelined
from spd_jax.decode.sampling import Sampling
from spd_jax.decode.spd import EngineConfig
from spd_jax.drafters.base import NoDrafter, OracleDrafter
from spd_jax.drafters.ppsd import PPSDConfig, PPSDDrafter
from spd_jax.drafters.psm import PSMConfig, PSMDrafter, init_psm
from spd_jax.pipeline.stages import StageLayout
from spd_jax import methods


@pytest.fixture(scope="module")
def model(tiny_ckpt):  # 4 layers, vocabulary 160, max_position_embeddings 512
    return spd_jax.load_model(tiny_ckpt("llama", False)[0])


# ---- 1. drafters

@pytest.mark.parametrize("method", ["spd", "pipeline"])
def test_unknown_drafter_is_refused(model, method):
    unknown = r"unknown drafter 'eagle3' .*one of psm, ppsd, none, oracle.*method=\"eagle3\""
    with pytest.raises(ValueError, match=unknown):
        spd_jax.generate(model, [1, 2], 4, method=methods.get(method).taking(n=2, drafter="eagle3"))
    with pytest.raises(ValueError, match="unknown drafter 'PSM'"):
        methods.get(method).taking(n=2, drafter="PSM")  # refused when the options are made, before any loading


def test_an_option_of_another_method_is_refused():
    """A method's options are its fields: one it does not take is refused when the method is made."""
    with pytest.raises(TypeError, match="drafter"):
        methods.AR(drafter="oracle")
    with pytest.raises(TypeError, match="drafter"):
        methods.EAGLE3(drafter="random")  # its drafter checkpoint is drafter_spec
    with pytest.raises(TypeError, match="tp"):
        methods.AR(tp=2)  # tensor-parallel stages are for the pipelined methods


def test_stage_counts_must_match_n(model):
    with pytest.raises(ValueError, match=r"2 stage layer counts \[1, 3\] for n=4 stages: .*set n to 2 \(--n 2"):
        spd_jax.generate(model, [1, 2], 4, method=methods.Pipeline(n=4, stage_layers=[1, 3]))


def test_engine_config_checks_its_drafter(model):
    """The engine's drafter is an object (drafters.base.SpdDrafter): one draft per cycle or none, reading
    the anchors the stage layout gathers."""
    plan = pipelined.plan_for(model, 2)
    layout = StageLayout.of(model.config, plan, (0,))
    kw = dict(greedy=True, filtered=False, top_k_cap=0, prompt_pad=16, cache_len=64)
    with pytest.raises(ValueError, match="one token per cycle .* OracleDrafter has k = 3"):
        EngineConfig(model.config, layout, OracleDrafter(k=3, vocab_size=160), **kw)
    psm = PSMDrafter(model.config, PSMConfig.for_target(model.config, plan.counts, num_layers=1))
    with pytest.raises(ValueError, match=r"the drafter reads anchors .*, the stage layout gathers \(0,\)"):
        EngineConfig(model.config, layout, psm, **kw)
    EngineConfig(model.config, StageLayout.of(model.config, plan, psm.anchors), psm, **kw)
    other = pipelined.plan_for(model, 2, [3, 1])
    with pytest.raises(ValueError, match=r"made for the stage plan \[2, 2\], the engine runs \[3, 1\]"):
        EngineConfig(model.config, StageLayout.of(model.config, other, psm.anchors), psm, **kw)
    EngineConfig(model.config, layout, NoDrafter(160), **kw)  # the plain pipeline reads no anchors
    # a drafter that drafts after stage 0's step runs on stage 0's device, nowhere else
    ppsd = PPSDDrafter(model.config, PPSDConfig.for_target(model.config, plan.counts))
    ppsd_layout = StageLayout.of(model.config, plan, ppsd.anchors)
    EngineConfig(model.config, ppsd_layout, ppsd, psm_device=0, **kw)
    with pytest.raises(ValueError, match="PPSDDrafter drafts after stage 0's step, on that stage's device; "
                                         "psm_device is 1"):
        EngineConfig(model.config, ppsd_layout, ppsd, **kw)


# ---- 2. a given PSM in another dtype

def test_given_psm_takes_the_model_dtype(tiny_ckpt):
    bf16 = spd_jax.load_model(tiny_ckpt("llama", False)[0], dtype="bfloat16")
    plan = pipelined.plan_for(bf16, 2)
    cfg = PSMConfig.for_target(bf16.config, plan.counts, num_layers=1, draft_vocab=32)
    # a float32 PSM's tree, zeros (eager random init costs seconds of op-by-op dispatch)
    shapes = jax.eval_shape(lambda: init_psm(bf16.config, cfg, bf16.params, 0, jnp.float32,
                                             vocab_ids=np.arange(0, 160, 5)))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    variables["vocab"]["ids"] = np.arange(0, 160, 5, dtype=np.int32)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {np.dtype(np.float32), np.dtype(np.int32)}
    _, got, label = pipelined.resolve_psm(bf16, plan, (cfg, variables), psm_layers=1)
    assert label == "given"
    floats = [x for x in jax.tree.leaves(got) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    assert got["vocab"]["ids"].dtype == jnp.int32  # token ids stay integers
    np.testing.assert_array_equal(got["vocab"]["ids"], np.arange(0, 160, 5))


@pytest.mark.slow  # compiles the SPD engine (~15 s on 2 cores); the dtype itself is checked above
def test_float32_psm_runs_on_a_bfloat16_model(tiny_ckpt):
    """Before the cast the engine refused to trace: the PSM's float32 draft met bfloat16 in a `lax.cond`."""
    bf16 = spd_jax.load_model(tiny_ckpt("llama", False)[0], dtype="bfloat16")
    plan = pipelined.plan_for(bf16, 2)
    cfg = PSMConfig.for_target(bf16.config, plan.counts, num_layers=1)
    spec = (cfg, init_psm(bf16.config, cfg, bf16.params, 0, jnp.float32))
    res = spd_jax.generate(bf16, [1, 17, 42, 99], 8, method=methods.SPD(n=2, spec=spec), stop_at_eos=False)
    assert res.token_ids == spd_jax.generate(bf16, [1, 17, 42, 99], 8, stop_at_eos=False).token_ids


# ---- 3. the context limit

def test_max_len_above_the_model_limit_is_refused(model):
    for method in ("ar", "spd"):
        with pytest.raises(ValueError, match=r"max_len 1024 exceeds the model's max_position_embeddings \(512\)"):
            spd_jax.generate(model, [1, 2], 4, method=methods.get(method).taking(n=2), max_len=1024)


@pytest.mark.parametrize("method", ["ar", "pipeline", "spd"])
def test_prompt_plus_new_tokens_may_fill_the_limit(model, method):
    """P + max_new_tokens == limit is allowed for every method; one more is refused, the message's sum
    being the one checked. (An oracle drafter without its tokens stops the pipelined methods right after the check, before
    anything compiles; "ar" is only asked for the refusal.)"""
    with pytest.raises(ValueError, match=r"= 65 exceeds the cache limit of 64"):
        spd_jax.generate(model, [1] * 60, 5, method=methods.get(method).taking(n=2), max_len=64)
    if method != "ar":
        with pytest.raises(ValueError, match="the oracle drafter needs oracle_tokens"):
            spd_jax.generate(model, [1] * 60, 4, method=methods.get(method).taking(n=2, drafter="oracle"), max_len=64)


# ---- 4. sampling parameters

def test_numpy_scalars_are_sampling_parameters():
    sp = Sampling(np.float32(0.7), np.int64(50), np.float64(0.9), np.uint32(7))
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed) == (pytest.approx(0.7), 50, pytest.approx(0.9), 7)
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.seed) is int
    assert (sp.top_k - 1).bit_length() == 6  # what the SPD engine's top-k bucket computes
    Sampling(seed=2**32 - 1)


@pytest.mark.parametrize("kw,msg", [
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\)"),
    (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"),
    (dict(seed=1.5), r"seed must be an integer"),
    (dict(seed=True), r"seed must be an integer"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(temperature=np.float32("inf")), "temperature must be a finite number"),
    (dict(temperature=1.0, top_k=np.float64(5)), "top_k must be a positive integer"),
    (dict(temperature=1.0, top_k=False), "top_k must be a positive integer"),
    (dict(temperature=1.0, top_p=np.float32(1.5)), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_parameters(model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        Sampling(**kw)
    with pytest.raises(TypeError, match="sampling must be a Sampling"):
        spd_jax.generate(model, [1, 2], 4, sampling=kw)


# ---- 5. text where token ids belong

def test_text_prompt_is_refused(model):
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids \(ints\), got str 'Hello'; encode text "
                                         r"with model.encode\(text\)"):
        spd_jax.generate(model, "Hello", 4)
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids.*model.encode"):
        spd_jax.generate(model, ["Hello", "there"], 4)
    with pytest.raises(ValueError, match=r"prompt 1 must be token ids.*model.encode"):
        spd_jax.generate_batch(model, [[1, 2], "Hello"], max_len=16)


# ---- 6. PSM anchors

def test_empty_anchors_are_refused(model):
    with pytest.raises(ValueError, match=r"anchors is empty: give at least anchor 0 .*or None for the default"):
        PSMConfig.for_target(model.config, (2, 2), anchors=())
