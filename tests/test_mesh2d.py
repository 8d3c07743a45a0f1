"""SPD and the plain pipeline on a (stage, model) mesh of 8 CPU devices (`generate(..., tp=)`): each stage
tensor-parallel over `model`. Greedy commits the `ar` tokens, sampling keeps the target's distribution, the
weights are split over both axes, and the only data the compiled program moves between devices outside the
all-reduces is the pipeline's own hand-over between stages."""

import re

import pytest

import spd_jax
from spd_jax import methods
from spd_jax.decode import pipelined
from spd_jax.decode.sampling import Sampling
from spd_jax.sharding import MODEL, STAGE
from two_tokens import TwoTokens

PROMPT = [1, 17, 42, 99, 5, 63, 7]


@pytest.fixture(scope="module")
def deep(tiny_ckpt):
    """model type -> (an 8-layer tiny model, its `ar` tokens); Qwen3.5's pattern gives LLLA LLLA (2 key / 4 value
    heads in its Gated DeltaNets, so tp = 2 splits them and tp = 4 keeps them whole)."""
    made = {}

    def get(model_type):
        if model_type not in made:
            model = spd_jax.load_model(tiny_ckpt(model_type, False, num_hidden_layers=8)[0])
            made[model_type] = model, spd_jax.generate(model, PROMPT, 24, stop_at_eos=False).token_ids
        return made[model_type]

    return get


def _permutes(hlo: str) -> list[str]:
    """The source-target pairs of every collective-permute in a compiled program's text."""
    return re.findall(r"collective-permute(?:-start)?\(.*?source_target_pairs=(\{[^ ]*\}),", hlo)


# (model, method, stages, tp); the default run covers SPD on llama and the plain pipeline on Qwen3.5 (its
# mixed stages under the same placement), the rest are slow
_SLOW = pytest.mark.slow
_CASES = [("llama", "spd", 4, 2), ("qwen3_5", "pipeline", 4, 2)] + [
    pytest.param(*c, marks=_SLOW) for c in [("llama", "pipeline", 4, 2), ("llama", "spd", 2, 4),
                                            ("llama", "pipeline", 2, 4), ("qwen3_5", "spd", 4, 2),
                                            ("qwen3_5", "spd", 2, 4), ("qwen3_5", "pipeline", 2, 4)]]


@pytest.mark.parametrize("model_type,method,n,tp", _CASES)
def test_greedy_equals_autoregressive_on_a_stage_model_mesh(deep, model_type, method, n, tp):
    model, reference = deep(model_type)
    res = spd_jax.generate(model, PROMPT, 24, method=methods.get(method).taking(n=n, tp=tp, psm_layers=1),
                           stop_at_eos=False)
    assert res.token_ids == reference
    s = res.stats
    assert s["devices"] == n * tp and s["tp"] == tp and s["n"] == n and s["tokens"] == 24
    if method == "spd":
        assert s["rejected"] > 0  # a random PSM: rollbacks are exercised
    else:
        assert s["cycles"] == 23 * n
    # the stage weights are split over both axes: layers by stage, heads / MLP columns by model
    assert model.placements.placement(pipelined.STAGE_SLOT)[1] == tp
    placed = model.placements.entries(pipelined.STAGE_SLOT)["weights"][0]
    specs = [w.sharding.spec for per in placed.values() for leaves in per for w in leaves.values()]
    assert all(sp[0] == STAGE for sp in specs) and any(MODEL in sp for sp in specs)
    # the program's collective-permutes are the pipeline's hand-overs between stages (prefill, decode) alone:
    # XLA moving slices within a stage inside its `lax.cond` deadlocks the CPU mesh (`pipelined.stage_units`)
    pairs = _permutes(methods.METHODS[method].compiled.latest().as_text())
    stride = tp  # device d = stage * tp + model position: a hand-over goes tp device ids on
    assert len(pairs) == 2 and all(b - a == stride for p in pairs for a, b in
                                   (map(int, q.split(",")) for q in re.findall(r"\{(\d+,\d+)\}", p)))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
@pytest.mark.parametrize("method", ["spd", "pipeline"])
def test_eight_stages_of_one_device(deep, model_type, method):
    """(8, 1): tp = 1 given explicitly is the one-axis engine."""
    model, reference = deep(model_type)
    res = spd_jax.generate(model, PROMPT, 24, method=methods.get(method).taking(n=8, tp=1, psm_layers=1),
                           stop_at_eos=False)
    assert res.token_ids == reference and res.stats["devices"] == 8


def test_bad_tp(deep):
    model, _ = deep("llama")
    # 4 query / 2 key-value heads, MLP width 112: tp = 3 splits nothing
    with pytest.raises(ValueError, match=r"tp=3 divides none of the model's head counts \(4 query, 2 key/value"):
        spd_jax.generate(model, PROMPT, 4, method=methods.SPD(n=2, tp=3, psm_layers=1))
    with pytest.raises(ValueError, match="need 16 devices, but JAX sees 8"):
        spd_jax.generate(model, PROMPT, 4, method=methods.Pipeline(n=8, tp=2))
    with pytest.raises(ValueError, match="positive integer"):
        spd_jax.generate(model, PROMPT, 4, method=methods.Pipeline(n=2, tp=0))
    for method in (methods.AR, methods.TP):  # tensor-parallel stages are an option of the pipelined methods only
        with pytest.raises(TypeError, match="tp"):
            method(tp=2)


SAMPLING_PROMPT = [5, 9, 11]


@pytest.mark.slow  # 20 s; the engine's sampling rule is the one tests/test_spd.py checks by default on 1D
def test_sampling_matches_the_target_distribution_on_a_stage_model_mesh(tiny_ckpt, monkeypatch):
    """Seeded SPD runs on 2 stages x 2 devices (random PSM, its draft for the 2nd token verified by speculative
    sampling) give the target's joint distribution of the first two tokens (chi-square), and the same test
    rejects the engine's deliberately wrong rule (accept every draft), as tests/test_spd.py does on 1D."""
    from spd_jax.decode import spd as engine
    from spd_jax.decode.compile_cache import CompileCache

    model = spd_jax.load_model(tiny_ckpt("llama", False, num_hidden_layers=2)[0])
    spd = methods.SPD(n=2, tp=2, psm_layers=1)

    target = TwoTokens(model, SAMPLING_PROMPT)

    def pvalue(runs):
        counts = {}
        for i in range(runs):
            pair = tuple(spd_jax.generate(model, SAMPLING_PROMPT, 2, sampling=Sampling(temperature=1.0, top_k=4, seed=i),
                                          method=spd, stop_at_eos=False).token_ids)
            counts[pair] = counts.get(pair, 0) + 1
        return target.pvalue(counts)

    outside, p_ok = pvalue(400)
    print(f"correct rule: p={p_ok:.3g}")
    assert outside == 0 and p_ok > 1e-3
    monkeypatch.setattr(engine, "_TEST_ACCEPT_EVERY_DRAFT", True)
    monkeypatch.setattr(methods.SPD, "compiled", CompileCache())
    outside, p_bad = pvalue(200)  # the wrong rule fails by far
    print(f"wrong rule: {outside} outside the support, p={p_bad:.3g}")
    assert outside > 0 or p_bad < 1e-6
