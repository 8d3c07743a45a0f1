"""Chain speculative decoding (spd_jax.decode.chain) and the EAGLE-3-style drafter on one device:
greedy tokens equal `ar`'s for every drafter and k in {3, 7} on Llama and the Qwen3.5 hybrid; the oracle
drafter has every draft accepted; sampling gives the target's exact distribution (chi-square) and a
wrong rule is caught; Gated DeltaNet rewinds into the middle of a multi-token call; the drafter's
training forward equals its inference, its loss decreases, and its checkpoints refuse another target;
`spd_jax.generate(method="eagle3")` commits `ar`'s tokens."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats as sstats

import spd_jax
from spd_jax.decode import chain, vocab
from spd_jax.decode.sampling import Sampling
from spd_jax.drafters import eagle3
from spd_jax.drafters.base import NoDrafter, OracleDrafter, features, split_params
from spd_jax.models import decoder
from spd_jax import methods

from tolerances import CACHED_VS_FULL, assert_close

PROMPT = [1, 17, 42, 99, 5, 63, 7]
N = 16  # new tokens

# 2-layer models: Llama, and Qwen3.5 with one Gated DeltaNet and one attention layer (both kinds)
_MODELS = {"llama": dict(num_hidden_layers=2),
           "qwen3_5": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])}


@pytest.fixture(scope="module", params=list(_MODELS))
def tiny(request, tiny_ckpt):
    model = spd_jax.load_model(tiny_ckpt(request.param, False, **_MODELS[request.param])[0])
    return model, spd_jax.generate(model, PROMPT, N, stop_at_eos=False).token_ids


def _random_eagle3(model, seed=1):
    spec = eagle3.Eagle3Config.for_target(model.config)
    return spec, eagle3.drafter_params(eagle3.init_eagle3(model.config, spec, model.params, seed=seed), model.params)


@pytest.mark.parametrize("k", [3, 7])
def test_greedy_chain_equals_autoregressive(tiny, k):
    """Oracle (every draft right; an EOS inside an accepted chain stops there), a corrupted oracle
    (rejections in the middle of the chain: on Qwen3.5 a mid-chain rewind of the DeltaNet state) and a
    random EAGLE-3 drafter (nearly every draft wrong) all commit exactly `ar`'s tokens."""
    model, ref = tiny
    V = model.config.vocab_size
    oracle = OracleDrafter(k, V)
    toks, s = chain.generate_chain(model, PROMPT, N, oracle, oracle.reference(len(PROMPT), ref), stop_at_eos=False)
    assert toks == ref
    # the first token comes from prefill; each round then commits k + 1 tokens: k drafts and the bonus
    # token (the last round cut to the budget)
    rounds = -(-(N - 1) // (k + 1))
    bonus = rounds - 1 + ((N - 1) % (k + 1) == 0)
    assert s["rounds"] == rounds and s["rejected"] == 0 and s["accepted"] == N - 1 - bonus

    eos = ref[6]  # an EOS token in the middle of an accepted chain (depth 1 at k = 3, 5 at k = 7) stops it
    stopper = dataclasses.replace(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,)))
    toks, _ = chain.generate_chain(stopper, PROMPT, N, oracle, oracle.reference(len(PROMPT), ref))
    assert toks == ref[:ref.index(eos) + 1]

    wrong = list(ref)
    for i in range(2, N, 3):  # a wrong draft every third position: rejected after 1 or 2 accepted drafts
        wrong[i] = (wrong[i] + 1) % V
    toks, s = chain.generate_chain(model, PROMPT, N, oracle, oracle.reference(len(PROMPT), wrong), stop_at_eos=False)
    assert toks == ref
    assert s["rejected"] > 0 and s["accepted"] > 0

    spec, dp = _random_eagle3(model)
    toks, s = chain.generate_chain(model, PROMPT, N, eagle3.Eagle3Drafter(model.config, spec, k), dp,
                                   stop_at_eos=False)
    assert toks == ref


def test_generate_api_eagle3(tiny):
    """spd_jax.generate(method="eagle3"): greedy tokens equal `ar`'s; without a drafter checkpoint (none
    ships for a tiny model) a random drafter; the stats a chain round reports."""
    model, ref = tiny
    res = spd_jax.generate(model, PROMPT, N, method=methods.EAGLE3(k=3), stop_at_eos=False)
    s = res.stats
    assert res.token_ids == ref and s["method"] == "eagle3" and s["drafter_spec"] == "random" and s["k"] == 3
    assert s["tokens"] == N and s["tokens_per_round"] == N / s["rounds"] and s["devices"] == 1
    assert s["accepted"] >= 0 and s["rejected"] <= s["rounds"] and s["tokens_per_s"] > 0 and s["compile_s"] >= 0
    assert "excludes compilation" in s["timing_includes"] and s["wall_s"] > 0
    with pytest.raises(ValueError, match="positive chain length k"):
        spd_jax.generate(model, PROMPT, N, method=methods.EAGLE3(k=0))
    with pytest.raises(ValueError, match="streaming"):
        spd_jax.generate(model, PROMPT, N, method="eagle3", stream=print)


def test_no_drafter_is_autoregressive_sampling(tiny_ckpt):
    """k = 0: every round commits the target's own draw with the position's key, which is `ar`'s draw."""
    model = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0])
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)
    ref = spd_jax.generate(model, PROMPT, N, sampling=Sampling(**kw), stop_at_eos=False).token_ids
    toks, s = chain.generate_chain(model, PROMPT, N, NoDrafter(model.config.vocab_size), None,
                                   Sampling(**kw), stop_at_eos=False)
    assert toks == ref and s["rounds"] == N - 1


SAMPLING_PROMPT = [5, 9, 11]


def test_sampling_matches_the_target_distribution(tiny_ckpt, monkeypatch):
    """Seeded runs of the chain (k = 3, an EAGLE-3 drafter) give the target's exact joint distribution
    of the first three tokens (chi-square): the second is a verified draft or a residual draw, the
    third a draft accepted after it, the bonus token, or a position after a rejection (rewound).
    Accepting every draft instead is caught. The drafter is untrained but fuses only the target's top
    hidden state, so its q resembles p and drafts are accepted often enough to matter."""
    model = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0])
    cfg, H, top_k, k = model.config, model.config.hidden_size, 3, 3
    spec = eagle3.Eagle3Config.for_target(cfg)
    assert spec.layers == (0, 1, 2)
    variables = eagle3.init_eagle3(cfg, spec, model.params, seed=1)
    variables["params"]["fc"]["kernel"] = jnp.zeros((3 * H, H)).at[2 * H:].set(jnp.eye(H))
    drafter, dp = eagle3.Eagle3Drafter(cfg, spec, k), eagle3.drafter_params(variables, model.params)
    sp = Sampling(1.0, top_k).runtime()
    P = len(SAMPLING_PROMPT)
    cc = chain.ChainConfig(cfg, greedy=False, filtered=True, prompt_pad=P, cache_len=P + 3 + k + 1)

    def runs(count):
        def one(seed):
            return chain.decode(model.params, dp, jnp.asarray([SAMPLING_PROMPT], jnp.int32), jnp.int32(P),
                                jnp.int32(3), jnp.asarray([-1], jnp.int32), dict(sp, seed=seed), cc=cc,
                                drafter=drafter)
        res = jax.jit(jax.vmap(one))(jnp.arange(count, dtype=jnp.uint32))  # one program, every run
        seqs = np.asarray(res.seq)[:, P:P + 3]
        return seqs, np.asarray(res.accepted), np.asarray(res.rounds)

    def warped(contexts):
        """The warped target distribution after each context, from one forward shape: [9, P + 2]
        (logits at a position do not depend on the padding after it)."""
        seqs = np.zeros((top_k ** 2, P + 2), np.int64)
        for i, c in enumerate(contexts):
            seqs[i, :len(c)] = c
        lg = model.logits(seqs)
        out = []
        for i, c in enumerate(contexts):
            row = lg[i, len(c) - 1]
            keep = np.argsort(row)[::-1][:top_k]
            p = np.exp(row[keep] - row[keep].max())
            out.append(dict(zip(keep.tolist(), (p / p.sum()).tolist())))
        return out

    (first,) = warped([SAMPLING_PROMPT])
    second = dict(zip(first, warped([SAMPLING_PROMPT + [a] for a in first])))
    third = dict(zip([(a, b) for a in first for b in second[a]],
                     warped([SAMPLING_PROMPT + [a, b] for a in first for b in second[a]])))
    joint = {(a, b, c): first[a] * second[a][b] * pc for (a, b), d in third.items() for c, pc in d.items()}
    cells = sorted(joint)
    expected = np.array([joint[c] for c in cells])

    def pvalue(seqs):
        counts = {}
        for row in map(tuple, seqs.tolist()):
            counts[row] = counts.get(row, 0) + 1
        obs = np.array([counts.get(c, 0) for c in cells])
        return len(seqs) - obs.sum(), sstats.chisquare(obs, expected / expected.sum() * obs.sum()).pvalue

    seqs, accepted, rounds = runs(6000)
    outside, p_ok = pvalue(seqs)
    print(f"correct rule: p={p_ok:.3g}, accepted per run {accepted.mean():.2f}, "
          f"one-round runs {np.mean(rounds == 1):.2f}")
    assert (accepted == 0).any() and (accepted == 2).any() and (rounds == 2).any()  # every path taken
    assert outside == 0 and p_ok > 1e-3

    with monkeypatch.context() as m:
        m.setattr(vocab, "accept", lambda p_draft, q_draft, u: u >= 0)  # accept every draft
        jax.clear_caches()  # retrace the loop with it
        outside, p_bad = pvalue(runs(3000)[0])
    jax.clear_caches()  # no later test may reuse the wrong program
    print(f"wrong rule: {outside} outside the support, p={p_bad:.3g}")
    assert outside > 0 or p_bad < 1e-6


def test_deltanet_rewinds_mid_chain(tiny_ckpt):
    """A multi-token call that keeps every token's state, then the next call started after its j-th
    token, equals a fresh run of the same tokens, for every j of a k = 3 chain (the attention layer's
    cache is overwritten by position alike)."""
    model = spd_jax.load_model(tiny_ckpt("qwen3_5", False, **_MODELS["qwen3_5"])[0])
    cfg, params, k = model.config, model.params, 3
    chain_toks = jnp.asarray([[23, 4, 150, 77]], jnp.int32)  # a round: the newest token and k drafts
    nxt = jnp.asarray([[9, 31]], jnp.int32)  # the next round's first tokens, after a rejection
    P = len(PROMPT)
    prompt = jnp.asarray([PROMPT], jnp.int32)

    @jax.jit
    def both(j):
        """-> (the next call's logits after the rewind, after a fresh run of the kept tokens)."""
        cache = decoder.init_cache(cfg, 1, 32, ring=k + 1)
        _, cache = decoder.forward(params, prompt, cache, jnp.int32(0), cfg)
        x, cache, _ = decoder.run_layers(params["layers"], decoder.embed(params, chain_toks), cache, jnp.int32(P), cfg,
                                         every_state=True)
        rewound = decoder.forward(params, nxt, cache, P + j + 1, cfg)[0]
        # fresh: prompt and tokens 0..j in one call (padded to one shape; the state stops at its length)
        fresh = decoder.init_cache(cfg, 1, 32)
        emb = decoder.embed(params, jnp.concatenate([prompt, chain_toks], 1))
        _, fresh, _ = decoder.run_layers(params["layers"], emb, fresh, jnp.int32(0), cfg, length=P + j + 1)
        return rewound, decoder.forward(params, nxt, fresh, P + j + 1, cfg)[0]

    for j in range(k + 1):  # tokens 0..j of the round kept
        rewound, fresh = both(j)
        assert_close(rewound, fresh, CACHED_VS_FULL, depth=cfg.num_layers, what=f"rewind to chain token {j}")


def test_eagle3_training_forward_is_its_inference(tiny_ckpt):
    """`Eagle3.train_logits` step i at index t equals the i-th draft's logits `propose` makes after the
    verified position t + 1 when its earlier drafts were the sequence's tokens."""
    model = spd_jax.load_model(tiny_ckpt("qwen3_5", False, **_MODELS["qwen3_5"])[0])
    cfg, params, k = model.config, model.params, 3
    spec, dp = _random_eagle3(model, seed=4)
    drafter = eagle3.Eagle3Drafter(cfg, spec, k)
    seq = jnp.asarray([PROMPT + [23, 4, 150, 77, 8, 12]], jnp.int32)
    T = seq.shape[1]

    @jax.jit
    def both(pos):
        """-> (training logits [k, V] of the steps after position pos, `propose`'s logits [k, V])."""
        emb = decoder.embed(params, seq)
        _, _, hidden = decoder.run_layers(params["layers"], emb, decoder.init_cache(cfg, 1, T), jnp.int32(0), cfg,
                                          collect_hidden=True)
        feats = features(emb, hidden, spec.layers)
        train = eagle3.Eagle3(cfg, spec).apply(dp["vars"], feats, emb, k, method=eagle3.Eagle3.train_logits)
        # the drafter's cache holds the verified rows [0, pos)
        state = drafter.prefill(dp, drafter.init(dp, 32, jnp.float32), feats[0, :T - 1], seq[0, 1:], pos)

        def teacher_forced(logits, i):  # the sequence's token as the draft; the logits as "q"
            return seq[0, pos + 1 + i], logits

        return train[:, 0, pos - 1], drafter.propose(dp, state, pos, teacher_forced)[1]

    for pos in (3, 7):  # the newest verified token
        train, got = both(pos)
        for i in range(k):
            assert_close(got[i], train[i], CACHED_VS_FULL, what=f"draft step {i} after position {pos}")


def test_eagle3_loss_decreases(tiny_ckpt):
    """The training-time-test loss (3 unrolled steps, response positions only) falls under Adam."""
    model = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0])
    cfg = model.config
    spec = eagle3.Eagle3Config.for_target(cfg)
    trainable, frozen = split_params(eagle3.init_eagle3(cfg, spec, model.params, seed=0))
    rng = np.random.default_rng(0)
    batch = dict(tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 16)), jnp.int32),
                 mask=jnp.asarray(np.arange(16) >= 4)[None].repeat(2, 0))  # the "prompt" carries no loss
    opt = optax.adam(3e-3)

    def mean_kl(tr):
        kl_sum, metrics = eagle3.eagle3_loss(tr, frozen, model.params, batch, cfg=cfg, spec=spec, steps=3)
        return kl_sum / metrics["positions"]

    @jax.jit
    def step(tr, opt_state):
        loss, grads = jax.value_and_grad(mean_kl)(tr)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, loss

    opt_state = opt.init(trainable)
    losses = []
    for _ in range(20):
        trainable, opt_state, loss = step(trainable, opt_state)
        losses.append(float(loss))
    print("losses", losses[0], losses[-1])
    assert losses[-1] < 0.7 * losses[0]


def test_eagle3_checkpoint_identity(tiny_ckpt, tmp_path):
    """Save and load round-trip (draft vocabulary included); another target or other feature layers are
    refused by name."""
    model = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0])
    cfg = model.config
    spec = eagle3.Eagle3Config.for_target(cfg, draft_vocab=40)
    ids = np.arange(0, 160, 4)
    variables = eagle3.init_eagle3(cfg, spec, model.params, seed=2, vocab_ids=ids)
    eagle3.save_eagle3(tmp_path / "d", variables, spec)
    got_spec, got = eagle3.load_eagle3(tmp_path / "d", cfg, model.params)
    assert got_spec == spec
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, variables)
    with pytest.raises(eagle3.Eagle3CheckpointError, match="reads feature layers \\[0, 1, 2\\], not \\[1, 1, 2\\]"):
        eagle3.load_eagle3(tmp_path / "d", cfg, model.params, layers=(1, 1, 2))
    other = spd_jax.load_model(tiny_ckpt("qwen3_5", False, **_MODELS["qwen3_5"])[0])
    with pytest.raises(eagle3.Eagle3CheckpointError, match="trained for another model .*model_type: checkpoint llama"):
        eagle3.load_eagle3(tmp_path / "d", other.config, other.params)
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 checkpoint"):
        eagle3.load_eagle3(tmp_path, cfg, model.params)
    with pytest.raises(FileExistsError):
        eagle3.save_eagle3(tmp_path / "d", variables, spec)


def test_eagle3_layer_is_standard_and_the_older_layout_still_reads(tiny_ckpt):
    """The layer's sizes round-trip through eagle3.json; an eagle3.json of format 1 (before the field: the
    target's own attention layer, as the shipped drafter's) reads as that layout, which for a Llama target
    computes exactly what the standard layer does; for Qwen3.5 the standard layer has no output gate, q/k
    norm or partial RoPE, and its norms scale by w where the target's scale by 1 + w."""
    cfg = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0]).config
    spec = eagle3.Eagle3Config.for_target(cfg)
    assert spec.layer == eagle3.DraftLayer.of_target(cfg)
    assert eagle3.spec_from_json(json.loads(json.dumps(eagle3.spec_to_json(spec)))) == spec
    older = {k: v for k, v in eagle3.spec_to_json(spec).items() if k != "layer"} | {"format": 1}
    legacy = eagle3.spec_from_json(older)
    assert legacy == dataclasses.replace(spec, layer=None) and legacy.layer_config(cfg) is cfg
    model = spd_jax.load_model(tiny_ckpt("llama", False, **_MODELS["llama"])[0])
    variables = eagle3.init_eagle3(cfg, spec, model.params, seed=3)
    feats = jax.random.normal(jax.random.key(0), (1, 5, 3 * cfg.hidden_size))
    emb = decoder.embed(model.params, jnp.asarray([[3, 9, 27, 81, 4]]))
    cache = eagle3.Eagle3Drafter(cfg, spec, 3).init(None, 8, jnp.float32)[0]  # k/v [1, Nkv, S, D]
    both = [eagle3.Eagle3(cfg, s).apply(variables, feats, emb, cache, jnp.int32(0))[0] for s in (spec, legacy)]
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(both[1]))

    q35 = spd_jax.load_model(tiny_ckpt("qwen3_5", False, **_MODELS["qwen3_5"])[0]).config
    std, own = eagle3.Eagle3Config.for_target(q35), dataclasses.replace(eagle3.Eagle3Config.for_target(q35), layer=None)
    lcfg = std.layer_config(q35)
    assert (lcfg.attn_gate, lcfg.qk_norm, lcfg.norm_offset, lcfg.rotary_dim) == (False, False, 0.0, q35.head_dim)
    assert q35.rotary_dim < q35.head_dim and q35.norm_offset == 1.0
    assert {"wq_gate", "q_norm", "k_norm"} & set(eagle3.layer_schema(lcfg)) == set()
    assert {"wq_gate", "q_norm", "k_norm"} <= set(eagle3.layer_schema(own.layer_config(q35)))


def test_an_eagle3_drafter_for_other_weights_of_the_same_shape_is_refused(tiny_ckpt, tmp_path):
    """Same architecture, other weights (another init seed, as a base model and its fine-tune): the
    drafter records its target's weights fingerprint and the other model refuses it by name."""
    import re

    a, b = (spd_jax.load_model(tiny_ckpt("llama", False, seed=s, **_MODELS["llama"])[0]) for s in (0, 1))
    spec = eagle3.Eagle3Config.for_target(a.config)
    eagle3.save_eagle3(tmp_path / "d", eagle3.init_eagle3(a.config, spec, a.params, seed=2), spec,
                       target_weights=a.weights_fingerprint)
    eagle3.load_eagle3(tmp_path / "d", a.config, a.params)
    msg = (rf"EAGLE-3 checkpoint {re.escape(str(tmp_path / 'd'))} was trained for another model of the same "
           rf"architecture: its target weights have fingerprint {a.weights_fingerprint}, those of "
           rf"{re.escape(str(b.path))} {b.weights_fingerprint} .*train an EAGLE-3 drafter for "
           rf"{re.escape(str(b.path))} .* or use one trained for it")
    with pytest.raises(eagle3.Eagle3CheckpointError, match=msg):
        spd_jax.generate(b, PROMPT, 4, method=methods.EAGLE3(drafter_spec=str(tmp_path / "d")))
