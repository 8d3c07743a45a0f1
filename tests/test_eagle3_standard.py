"""Standard EAGLE-3 checkpoints (the SpecForge / SGLang `LlamaForCausalLMEagle3` layout) converted by
`spd_jax.convert.eagle3` and run by the `eagle3` method, against a clean-room PyTorch oracle of the standard
draft forward, on tiny random targets (Llama; the Qwen3.5 hybrid, whose own attention differs from the
draft layer's) with random drafters written here in the standard layout (config.json + safetensors, a draft
vocabulary with d2t / t2d, draft layer sizes and RoPE base other than the target's):

- the converted drafter's draft logits over a chain of k = 4 steps, after a prefill and again after a commit,
  equal the oracle's (fp32, `VS_TRANSFORMERS`: the oracle reads its features from transformers);
- `eagle3` decoding with it equals `ar` greedily;
- sharded safetensors and a weights-only pytorch_model.bin read as the single file does; a .bin that needs a
  free unpickle, another target, other sizes, missing, unexpected or mis-shaped tensors and bad d2t / t2d are
  refused with one line naming them;
- mutation check: the converter or the architecture with one component dropped or altered (fc's feature
  order, hidden_norm, input_layernorm, post_attention_layernorm, the final norm, the d2t offsets, the
  embedding/feature concatenation order, the feature layers' index convention, the draft layer's RoPE base,
  the fed-back state) fails the oracle comparison.

The oracle follows the behaviour of SpecForge's `LlamaForCausalLMEagle3` and SGLang's `llama_eagle3.py` (read
for behaviour, written here from scratch): features are the target's hidden states captured at the input of
layers id + 1 for eagle_aux_hidden_state_layer_ids, concatenated in layer order and fused by fc; the row at
position t reads the embedding (the target's) of token t + 1; the layer's attention reads
[input_layernorm(embedding), hidden_norm(feature)], the feature is the residual; logits are
lm_head(norm(output)) over the draft vocabulary, row i being target token i + d2t[i]; a later draft step feeds
the previous step's output before the norm, without fc, with the previous draft's embedding, one position on.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import spd_jax
from spd_jax.config import ModelConfig
from spd_jax.convert import eagle3 as conv
from spd_jax.drafters import eagle3, store
from spd_jax.drafters.base import features, teacher_forward
from spd_jax.models.layers import rms_norm
from spd_jax import methods

from tolerances import VS_TRANSFORMERS, assert_close, bound

# the draft layer's own sizes and RoPE base, unlike any tiny target's
DRAFT = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=24, intermediate_size=96, rms_norm_eps=1e-5,
             rope_theta=5000.0)
P, K, COMMIT = 9, 4, 2  # prompt rows, chain length, drafts the first round commits
# target -> (tiny_ckpt overrides, eagle_aux_hidden_state_layer_ids, "model." prefix and a stored embed_tokens)
TARGETS = {"llama": ({}, [0, 1, 2], False), "qwen3_5": ({}, [4, 0, 2], True)}


def standard_tensors(cfg: ModelConfig, ids: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
    """A random standard EAGLE-3 state dict for the target cfg, draft vocabulary ids [V'] (sorted), norms
    away from 1 so that dropping one changes the output."""
    H, V = cfg.hidden_size, cfg.vocab_size
    N, NKV, D, inter = (DRAFT[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                           "intermediate_size"))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + 0.3 * torch.randn(H, generator=g)

    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.as_tensor(ids)] = True
    return {"fc.weight": rnd(H, 3 * H, std=0.1),
            "midlayer.hidden_norm.weight": norm(), "midlayer.input_layernorm.weight": norm(),
            "midlayer.self_attn.q_proj.weight": rnd(N * D, 2 * H),
            "midlayer.self_attn.k_proj.weight": rnd(NKV * D, 2 * H),
            "midlayer.self_attn.v_proj.weight": rnd(NKV * D, 2 * H), "midlayer.self_attn.o_proj.weight": rnd(H, N * D),
            "midlayer.post_attention_layernorm.weight": norm(),
            "midlayer.mlp.gate_proj.weight": rnd(inter, H), "midlayer.mlp.up_proj.weight": rnd(inter, H),
            "midlayer.mlp.down_proj.weight": rnd(H, inter),
            "norm.weight": norm(), "lm_head.weight": rnd(len(ids), H, std=0.5),
            "d2t": torch.as_tensor(ids - np.arange(len(ids)), dtype=torch.int64), "t2d": t2d}


def standard_config(cfg: ModelConfig, n_draft: int, layer_ids=None, **over) -> dict:
    d = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=cfg.hidden_size,
             num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False, vocab_size=cfg.vocab_size,
             draft_vocab_size=n_draft, max_position_embeddings=512, rope_scaling=None, **DRAFT)
    if layer_ids is not None:
        d["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=layer_ids, use_aux_hidden_state=True)
    return {**d, **over}


def write_standard(path, config: dict, tensors: dict, prefix: bool = False):
    """config.json + model.safetensors; prefix: every name but lm_head's under "model." (SGLang reads both)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    named = {(f"model.{k}" if prefix and k != "lm_head.weight" else k): v.contiguous() for k, v in tensors.items()}
    save_file(named, path / "model.safetensors")
    return path


# ---------------------------------------------------------------- the oracle


class Oracle:
    """The standard EAGLE-3 draft forward, float32, from a state dict and its config.json."""

    def __init__(self, sd: dict, conf: dict, embed: torch.Tensor):
        self.w = {k.removeprefix("model."): v.float() for k, v in sd.items()}
        self.c, self.embed = conf, embed.float()
        self.heads, self.kv, self.d = conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]
        self.hot = torch.arange(len(self.w["d2t"])) + self.w["d2t"].long()  # draft row -> target id

    def _norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]))

    def _rope(self, x, pos):  # x [T, n, D]: rotate-half over the whole head
        half = self.d // 2
        inv = 1.0 / self.c["rope_theta"] ** (torch.arange(half, dtype=torch.float64) * 2 / self.d)
        ang = pos[:, None].double() * inv[None]
        cos, sin = (torch.cat([f(ang), f(ang)], -1).float()[:, None] for f in (torch.cos, torch.sin))
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def layer(self, emb, hid, pos, cache):
        """emb, hid [T, H] at positions pos [T]; cache (k, v, positions) of earlier rows -> (out [T, H], cache)."""
        w, T = self.w, emb.shape[0]
        x = torch.cat([self._norm(emb, "midlayer.input_layernorm.weight"),
                       self._norm(hid, "midlayer.hidden_norm.weight")], -1)
        q = self._rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, self.heads, self.d), pos)
        k = self._rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, self.kv, self.d), pos)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, self.kv, self.d)
        ks, vs, ps = (torch.cat([a, b]) for a, b in zip(cache, (k, v, pos)))
        rep = self.heads // self.kv
        s = torch.einsum("tnd,snd->nts", q, ks.repeat_interleave(rep, 1)) / self.d ** 0.5
        s = s.masked_fill(ps[None, None, :] > pos[None, :, None], float("-inf"))
        o = torch.einsum("nts,snd->tnd", s.softmax(-1), vs.repeat_interleave(rep, 1)).reshape(T, -1)
        h = hid + o @ w["midlayer.self_attn.o_proj.weight"].T
        m = self._norm(h, "midlayer.post_attention_layernorm.weight")
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        m = torch.nn.functional.silu(gate) * up
        return h + m @ w["midlayer.mlp.down_proj.weight"].T, (ks, vs, ps)

    def draft(self, hidden_states, tokens, n_rows: int, k: int):
        """hidden_states: transformers' per-layer hidden states (entry i = the input of layer i) [T, H] each;
        tokens: the verified sequence; rows 0..n_rows-1 verified -> (logits [k, V'], target ids [k])."""
        ids = (self.c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        L = len(hidden_states) - 1
        capture = sorted(i + 1 for i in ids) if ids is not None else sorted({2, L // 2, L - 3})
        hid = torch.cat([hidden_states[i][:n_rows] for i in capture], -1) @ self.w["fc.weight"].T
        empty = (torch.zeros(0, self.kv, self.d),) * 2 + (torch.zeros(0, dtype=torch.long),)
        out, cache = self.layer(self.embed[tokens[1:n_rows + 1]], hid, torch.arange(n_rows), empty)
        x, logits, drafts = out[-1], [], []
        for i in range(k):
            if i:  # the previous output before the norm, no fc; the previous draft's embedding; one position on
                out, cache = self.layer(self.embed[drafts[-1]][None], x[None], torch.tensor([n_rows - 1 + i]), cache)
                x = out[0]
            logits.append(self._norm(x, "norm.weight") @ self.w["lm_head.weight"].T)
            drafts.append(int(self.hot[int(logits[-1].argmax())]))
        return torch.stack(logits).numpy(), drafts


def ours(model, spec, variables, tokens):
    """The converted drafter, as the chain loop runs it: prefill P rows, propose K, commit COMMIT of the round's
    K + 1 verified positions, propose K -> [(drafts [K], logits [K, V] over the target's vocabulary)] x 2."""
    cfg = model.config
    drafter, dp = eagle3.Eagle3Drafter(cfg, spec, K), eagle3.drafter_params(variables, model.params)
    seq = jnp.asarray([tokens], jnp.int32)
    emb, hidden, _ = teacher_forward(model.params, seq, cfg)
    feats = features(emb, hidden, spec.layers)[0]
    nxt = jnp.concatenate([seq[0, 1:], jnp.zeros((1,), jnp.int32)])
    state = drafter.prefill(dp, drafter.init(dp, 64, jnp.float32), feats[:P], nxt[:P], jnp.int32(P))

    def choose(logits, i):  # greedy, keeping the logits as "q"
        return jnp.argmax(logits).astype(jnp.int32), logits

    d1, q1, state = drafter.propose(dp, state, jnp.int32(P), choose)
    state = drafter.commit(dp, state, feats[P:P + K + 1], nxt[P:P + K + 1], jnp.int32(P), jnp.int32(COMMIT))
    d2, q2, _ = drafter.propose(dp, state, jnp.int32(P + COMMIT), choose)
    return [(np.asarray(d1), np.asarray(q1)), (np.asarray(d2), np.asarray(q2))]


def compare(got, want, depth: int, what: str) -> float:
    """Our rounds against the oracle's: the same drafts, the draft logits at the oracle's target ids within the
    bound (the rest of our vocabulary -inf) -> the largest error."""
    err = 0.0
    for r, ((d, q), (w_logits, w_ids, w_drafts)) in enumerate(zip(got, want)):
        assert np.isinf(np.delete(q, w_ids, axis=1)).all(), f"{what}: round {r} drafts outside its draft vocabulary"
        err = max(err, assert_close(q[:, w_ids], w_logits, VS_TRANSFORMERS, depth, f"{what}, round {r}"))
        assert d.tolist() == w_drafts, f"{what}: round {r} drafts {d.tolist()}, the oracle {w_drafts}"
    return err


@pytest.fixture(scope="module")
def cases(tiny_ckpt, tmp_path_factory):
    """Target name -> a tiny target, a random standard drafter for it, converted, and the oracle's two rounds
    (made once per module)."""
    made = {}

    def make(name):
        if name not in made:
            made[name] = _make_case(name, tiny_ckpt, tmp_path_factory)
        return made[name]

    return make


@pytest.fixture(scope="module", params=list(TARGETS))
def case(request, cases):
    return cases(request.param)


@pytest.fixture(scope="module")
def llama(cases):  # one target is enough where the drafter's every draft is not the point
    return cases("llama")


def _make_case(name, tiny_ckpt, tmp_path_factory):
    overrides, layer_ids, prefix = TARGETS[name]
    ckpt, hf = tiny_ckpt(name, False, **overrides)
    model = spd_jax.load_model(ckpt)
    cfg = model.config
    rng = np.random.default_rng(7)
    ids = np.sort(rng.choice(cfg.vocab_size, 48, replace=False))
    sd = standard_tensors(cfg, ids, seed=11)
    if prefix:  # an embedding stored with the drafter is not used: SGLang replaces it with the target's
        sd["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    conf = standard_config(cfg, len(ids), layer_ids)
    root = tmp_path_factory.mktemp(f"e3std_{name}")
    src = write_standard(root / "standard", conf, sd, prefix)
    out = conv.convert(src, root / "drafter", model)
    spec, variables = store.load(eagle3.KIND, out, cfg, model.params, jnp.float32, weights=model.weights_fingerprint)
    tokens = rng.integers(3, cfg.vocab_size, P + K + 2).tolist()
    with torch.no_grad():
        hs = [h[0] for h in hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states]
    oracle = Oracle(sd, conf, hf.get_input_embeddings().weight.detach())
    want = []
    for n_rows in (P, P + COMMIT):
        logits, drafts = oracle.draft(hs, tokens, n_rows, K)
        want.append((logits, oracle.hot.numpy(), drafts))
    return dict(name=name, model=model, spec=spec, variables=variables, tokens=tokens, want=want, out=out,
                depth=cfg.num_layers + K, src=src, conf=conf)


def test_converted_drafter_equals_the_oracle(case):
    spec, cfg = case["spec"], case["model"].config
    assert spec.layer == eagle3.DraftLayer(2, 1, 24, 96, 1e-5, dataclasses.replace(cfg.rope, theta=5000.0))
    assert spec.layers == tuple(sorted(i + 1 for i in TARGETS[case["name"]][1])) and spec.draft_vocab == 48
    compare(ours(case["model"], spec, case["variables"], case["tokens"]), case["want"], case["depth"], case["name"])
    meta = json.loads((case["out"] / "eagle3.json").read_text())
    lineage = json.loads((case["out"] / "lineage.json").read_text())
    assert meta["target_weights"] == case["model"].weights_fingerprint and meta["format"] == eagle3.FORMAT
    assert meta["converted"]["source_digest"] == lineage[0]["source_digest"] == conv.source_digest(case["src"])[0]
    assert lineage[0]["config"] == case["conf"] and "model.safetensors" in lineage[0]["files"]


def test_eagle3_decoding_with_it_equals_ar(llama):
    case = llama
    model, prompt = case["model"], case["tokens"][:P]
    ref = spd_jax.generate(model, prompt, 16, stop_at_eos=False).token_ids
    res = spd_jax.generate(model, prompt, 16, method=methods.EAGLE3(k=3, drafter_spec=str(case["out"])),
                           stop_at_eos=False)
    assert res.token_ids == ref and res.stats["drafter_spec"] == str(case["out"])


# ---------------------------------------------------------------- mutation check


def _fc_features_reversed(spec, v):
    k = np.asarray(v["params"]["fc"]["kernel"])
    H = k.shape[1]
    v["params"]["fc"]["kernel"] = np.concatenate([k[2 * H:], k[H:2 * H], k[:H]])
    return spec, v


def _ones(name):
    def mutate(spec, v):
        v["params"][name] = np.ones_like(v["params"][name])
        return spec, v
    return mutate


def _no_d2t_offsets(spec, v):
    v["vocab"]["ids"] = np.arange(spec.draft_vocab, dtype=np.int32)
    return spec, v


def _layer_ids_unshifted(spec, v):  # eagle_aux_hidden_state_layer_ids taken as hidden-state indices
    return dataclasses.replace(spec, layers=tuple(i - 1 for i in spec.layers)), v


def _target_rope(spec, v):
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, rope=dataclasses.replace(
        spec.layer.rope, theta=10000.0))), v


MUTATIONS = {"fc feature order": _fc_features_reversed, "hidden_norm dropped": _ones("layer_hidden_norm"),
             "input_layernorm dropped": _ones("layer_attn_norm"),
             "post_attention_layernorm dropped": _ones("layer_mlp_norm"), "final norm dropped": _ones("final_norm"),
             "d2t offsets dropped": _no_d2t_offsets, "feature layer ids not + 1": _layer_ids_unshifted,
             "the target's RoPE base": _target_rope, "[feature, embedding] concatenated": None,
             "the normed output fed back": None}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_component_is_checked_by_the_oracle(llama, mutation, monkeypatch):
    """The converter or the architecture with one component dropped or altered fails the oracle comparison."""
    case = llama
    spec, variables = case["spec"], jax.tree.map(np.asarray, case["variables"])
    if mutation == "[feature, embedding] concatenated":
        def inputs(self, feat, emb):
            lp, c = self.layer, self.lcfg
            return jnp.concatenate([rms_norm(feat, lp["hidden_norm"], c.rms_norm_eps, c.norm_offset),
                                    rms_norm(emb, lp["attn_norm"], c.rms_norm_eps, c.norm_offset)], axis=-1)
        monkeypatch.setattr(eagle3.Eagle3, "_inputs", inputs)
    elif mutation == "the normed output fed back":
        step = eagle3.Eagle3.step

        def fed_back_normed(self, feat, emb, cache, pos):  # a chain step's own output: normed first
            if feat.shape[1] == 1:
                feat = rms_norm(feat, self.final_norm, self.lcfg.rms_norm_eps, self.lcfg.norm_offset)
            return step(self, feat, emb, cache, pos)
        monkeypatch.setattr(eagle3.Eagle3, "step", fed_back_normed)
    else:
        spec, variables = MUTATIONS[mutation](spec, variables)
    got = ours(case["model"], spec, jax.tree.map(jnp.asarray, variables), case["tokens"])
    errs = []
    for (d, q), (w_logits, w_ids, w_drafts) in zip(got, case["want"]):
        diff = np.abs(q[:, w_ids] - w_logits)
        errs.append(float(np.max(np.where(np.isnan(diff), np.inf, diff))))
    assert max(errs) > 10 * bound(case["want"][0][0], VS_TRANSFORMERS, case["depth"]), (mutation, errs)
    with pytest.raises(AssertionError):
        compare(got, case["want"], case["depth"], mutation)


# ---------------------------------------------------------------- reading and refusing


TINY = ModelConfig.named("tiny-llama")  # 4 layers, hidden 64, vocabulary 160: a target's config, no weights
IDS = np.arange(0, 160, 10)[:14] + 3  # a draft vocabulary of 14 tokens


def _standard(**over):
    return standard_config(TINY, len(IDS), [0, 1, 2], **over), standard_tensors(TINY, IDS, seed=1)


def _edit(conf=None, add=None, drop=None):
    def edit(c, sd):
        c.update(conf or {})
        for k in drop or ():
            sd.pop(k)
        sd.update(add or {})
    return edit


def _d2t_unsorted(c, sd):
    sd["d2t"] = sd["d2t"].flip(0)


def _t2d_off(c, sd):
    sd["t2d"] = sd["t2d"].clone()
    sd["t2d"][0] = ~sd["t2d"][0]


REFUSALS = {
    "architectures": (_edit({"architectures": ["LlamaForCausalLM"]}), "architectures \\['LlamaForCausalLM'\\]"),
    "hidden size": (_edit({"hidden_size": 32}), "hidden_size = 32 but the target has 64"),
    "vocabulary": (_edit({"vocab_size": 200}), "vocab_size = 200 but the target has 160"),
    "target hidden size": (_edit({"target_hidden_size": 96}), "target_hidden_size = 96 but the target has 64"),
    "two layers": (_edit({"num_hidden_layers": 2}), "num_hidden_layers = 2 is not supported"),
    "fc_norm": (_edit({"fc_norm": True}), "fc_norm = True is not supported"),
    "layer ids": (_edit({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}),
                  "hidden-state indices \\[1, 2, 4\\]; .* in \\[1, 3\\]"),
    "default layers": (lambda c, sd: c.pop("eagle_config"), "SGLang's default .* indices \\[2, 2, 1\\]"),
    "draft vocabulary size": (_edit({"draft_vocab_size": 0}), "draft_vocab_size must be an int in \\[1, 160\\]"),
    "rope type": (_edit({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), "rope_type 'yarn' is not supported"),
    "partial rope": (_edit({"partial_rotary_factor": 0.5}), "partial_rotary_factor = 0.5 is ambiguous"),
    "partial rope parameters": (_edit({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.25}}),
                                "partial_rotary_factor = 0.25 is ambiguous"),
    "activation": (_edit({"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    "missing tensor": (_edit(drop=["midlayer.hidden_norm.weight"]), "missing tensor 'midlayer.hidden_norm.weight'"),
    "unexpected tensor": (_edit(add={"midlayer.self_attn.q_proj.bias": torch.zeros(48)}),
                          "unexpected tensor 'midlayer.self_attn.q_proj.bias'"),
    "fc shape": (_edit(add={"fc.weight": torch.zeros(64, 128)}), "tensor 'fc.weight' has shape \\(64, 128\\)"),
    "head rows": (_edit(add={"lm_head.weight": torch.zeros(13, 64)}),
                  "tensor 'lm_head.weight' has shape \\(13, 64\\) .* expected \\(14, 64\\)"),
    "q shape": (_edit(add={"midlayer.self_attn.q_proj.weight": torch.zeros(48, 64)}),
                "tensor 'midlayer.self_attn.q_proj.weight' has shape \\(48, 64\\) .* expected \\(48, 128\\)"),
    "embedding shape": (_edit(add={"embed_tokens.weight": torch.zeros(10, 64)}), "tensor 'embed_tokens.weight'"),
    "d2t missing": (_edit(drop=["d2t"]), "missing tensor 'd2t'"),
    "d2t unsorted": (_d2t_unsorted, "d2t maps the draft rows to target ids that are not sorted"),
    "d2t floats": (_edit(add={"d2t": torch.zeros(14)}), "tensor 'd2t' has shape \\(14,\\) torch.float32"),
    "t2d": (_t2d_off, "tensor 't2d' .* does not mark exactly"),
    "twice": (lambda c, sd: sd.update({"model.fc.weight": sd["fc.weight"].clone()}),
              "tensor 'fc.weight' appears twice"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_bad_checkpoints_are_refused_in_one_line(what, tmp_path):
    edit, match = REFUSALS[what]
    conf, sd = _standard()
    edit(conf, sd)
    src = write_standard(tmp_path / "s", conf, sd)
    with pytest.raises(conv.Eagle3FormatError, match=match) as e:
        conv.read_checkpoint(src, TINY)
    assert "\n" not in str(e.value) and str(src) in str(e.value)


class _Payload:  # a pickle that runs code when loaded: torch.load(weights_only=True) must refuse it unrun
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_sharded_and_weights_only_bin_read_alike_and_a_free_unpickle_is_refused(tmp_path):
    conf, sd = _standard()
    _, want, _, dtype = conv.read_checkpoint(write_standard(tmp_path / "one", conf, sd), TINY)
    assert dtype == jnp.float32
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(conf))
    names = sorted(sd)
    index = {}
    for i, part in enumerate((names[:5], names[5:])):
        f = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: sd[n] for n in part}, shards / f)
        index |= {n: f for n in part}
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text(json.dumps(conf))
    torch.save({f"model.{k}": v for k, v in sd.items()}, binary / "pytorch_model.bin")
    for src in (shards, binary):
        got = conv.read_checkpoint(src, TINY)[1]
        jax.tree.map(np.testing.assert_array_equal, got, want)

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps(conf))
    marker = tmp_path / "ran"
    torch.save({**sd, "fc.weight": _Payload(marker)}, evil / "pytorch_model.bin")
    with pytest.raises(conv.Eagle3FormatError, match="does not load with torch.load\\(weights_only=True\\)") as e:
        conv.read_checkpoint(evil, TINY)
    assert "\n" not in str(e.value) and not marker.exists()


def test_the_cli_and_a_raw_standard_directory_given_as_a_drafter(llama, tmp_path, capsys):
    """`python -m spd_jax.convert.eagle3` converts (0) or says why not in one line (2); a standard directory
    given to --drafter as it is names the conversion."""
    case = llama
    model, src = case["model"], case["src"]
    assert conv.main([str(src), str(tmp_path / "d"), "--model", str(model.path)]) == 0
    assert store.read_spec(eagle3.KIND, tmp_path / "d") == case["spec"]
    assert conv.main([str(src), str(tmp_path / "d"), "--model", str(model.path)]) == 2  # it exists
    assert conv.main([str(src), str(tmp_path / "e"), "--model", "tiny-qwen3_5-nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    with pytest.raises(FileNotFoundError, match="python -m spd_jax.convert.eagle3 DIR OUT --model MODEL"):
        spd_jax.generate(model, case["tokens"][:P], 4, method=methods.EAGLE3(drafter_spec=str(src)))


def test_bfloat16_weights_are_written_exactly(llama, tmp_path):
    """A bf16 checkpoint (as SpecForge saves) is written in bf16 and loads back to the same values; one mixing
    dtypes is written in float32."""
    import orbax.checkpoint as ocp

    model = llama["model"]
    cfg, sd = model.config, standard_tensors(model.config, np.arange(48) * 3, seed=5)
    bf = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in sd.items()}
    src = write_standard(tmp_path / "bf16", standard_config(cfg, 48, [0, 1, 2]), bf)
    _, want, _, dtype = conv.read_checkpoint(src, cfg)
    assert dtype == jnp.bfloat16
    conv.convert(src, tmp_path / "d", model)
    meta = ocp.StandardCheckpointer().metadata(tmp_path / "d" / "params").item_metadata
    assert {a.dtype for a in jax.tree.leaves(meta.tree)} == {np.dtype(jnp.bfloat16), np.dtype(np.int32)}
    got = store.load(eagle3.KIND, tmp_path / "d", cfg, model.params, jnp.float32)[1]
    jax.tree.map(np.testing.assert_array_equal, got, want)
    mixed = write_standard(tmp_path / "mixed", standard_config(cfg, 48, [0, 1, 2]),
                           dict(bf, **{"norm.weight": sd["norm.weight"]}))  # float32 norm, bf16 rest
    assert conv.read_checkpoint(mixed, cfg)[3] == jnp.float32
