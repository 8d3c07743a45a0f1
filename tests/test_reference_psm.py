"""The SPD authors' PSM checkpoints (their reference code's v11 `.pt`) convert to a PSM that drafts what theirs does.

`ReferencePSM` below is a clean-room oracle of the reference PSM's forward for one draft, written here from the
behaviour of the authors' code (which has no licence: read, not copied): rows typed as its engine types them,
each projected by its own nn.Linear over the anchors' concatenation, its decoder layers (transformers' own
layer classes, as the reference's are: Qwen3.5's for a Qwen3.5 base, Qwen3's otherwise), the base's final norm
and the checkpoint's own head over its draft vocabulary. A random PSM at a scale where every row moves the
draft is saved in the reference's format ({"state_dict", "config"} as its v11 trainer writes them) for a tiny
random Qwen3.5 of 8 layers, converted with `python -m spd_jax.convert.reference_psm`, loaded as the engine
loads a PSM, and its draft (the engine's `draft_step`, over its cache as the engine runs it) is compared with
the oracle's at every position and pipeline fill at n = 4 and n = 8, both fed the same anchor states (the
target's, from transformers). Every converter component is then broken in turn and the comparison must fail.
"""

import copy
import dataclasses
import functools
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import spd_jax
from spd_jax.convert import reference_psm as ref
from spd_jax.drafters.psm import PSM, load_psm
from spd_jax.models.attention import init_kv_cache
from spd_jax import methods
from tolerances import VS_TRANSFORMERS, bound

T = 12  # positions drafted from, at every fill
PROMPT = [5, 17, 33, 2, 91, 64, 8, 120, 45]


# ------------------------------------------------------------------ the reference, from its behaviour


def reference_anchors(L: int, n: int) -> list[int]:
    """The reference's automatic aggr_feature_bound: [0, l, 3l, 6l, L-1] with l = L / n, clipped to L."""
    lps = L // n
    return sorted({max(0, min(L, x)) for x in (0, lps, 3 * lps, 6 * lps, L - 1)})


def psm_layer(text_cfg, i: int, Ls: int) -> torch.nn.Module:
    """One PSM decoder layer as the reference builds it: Qwen3.5's own layer typed full attention for a Qwen3.5
    base, else Qwen3's (for a Llama base too: q/k norms over Llama's shapes)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    c = copy.deepcopy(text_cfg)
    c._attn_implementation = "eager"
    if c.model_type.startswith("qwen3_5"):
        c.layer_types = ["full_attention"] * max(Ls, len(c.layer_types))
        return Qwen3_5DecoderLayer(c, layer_idx=i)
    return Qwen3DecoderLayer(c, layer_idx=i)


class ReferencePSM:
    """The reference's PSM drafting the token after t with `fill` tokens in flight (t the newest, at depth 0;
    t - j at depth j for j < fill; the rest verified), from the anchor states of positions 0..t."""

    def __init__(self, target, ckpt: dict):
        c, sd = ckpt["config"], ckpt["state_dict"]
        self.target, self.n, self.bounds = target, c["num_stages"], list(c["aggr_feature_bound"])
        self.L = target.config.num_hidden_layers
        sl = c.get("stage_layers")  # layers per stage: "a;b;..." or a list; else even
        plan = [int(x) for x in (sl.split(";") if isinstance(sl, str) else sl)] if sl else [self.L // self.n] * self.n
        self.big, self.passed = max(plan), [sum(plan[:k]) for k in range(self.n + 1)]
        self.projs = [sd[f"aggr_projs.{a}.weight"].float() for a in range(len(self.bounds))]
        self.layers = []
        for i in range(c["num_spec_layers"]):
            layer = psm_layer(target.config, i, c["num_spec_layers"])
            mine = {k.split(".", 2)[2]: v.float() for k, v in sd.items() if k.startswith(f"spec_layers.{i}.")}
            layer.load_state_dict(mine, strict=True)
            self.layers.append(layer.eval())
        self.head = sd["lm_head.weight"].float()
        V = target.config.vocab_size
        self.ids = sorted(set(c["draft_token_ids"])) if c.get("draft_token_ids") else list(range(V))

    def depth_type(self, d: int) -> int:
        """Its type for a row at depth d: the deepest anchor a token that passed d of the largest stages would have."""
        return max(a for a, b in enumerate(self.bounds) if b <= min(self.L, d * self.big))

    def row_type(self, depth: int | None, hi: int) -> int:
        """A verified token (depth None) has every anchor: the deepest depth n. One in flight at depth k has the
        states of k stages: the deepest depth <= hi whose type's anchors it holds."""
        if depth is None:
            return self.depth_type(self.n)
        have = self.passed[depth]  # the states it has: up to the output of its last layer so far
        return self.depth_type(max(d for d in range(hi + 1) if self.bounds[self.depth_type(d)] <= have))

    @torch.no_grad()
    def draft(self, states: dict, t: int, fill: int) -> np.ndarray:
        """states {HF hidden-state index: [T, H]} -> the draft logits [V] (-inf off the draft vocabulary)."""
        hi = self.n - 1 if fill == self.n else self.n  # a full pipeline has a verified row pending
        rows = []
        for p in range(t + 1):
            if p == t:  # the newest token: its embedding through the first projection
                rows.append(states[0][p] @ self.projs[0].T)
                continue
            a = self.row_type(t - p if t - p < fill else None, hi)
            rows.append(torch.cat([states[b][p] for b in self.bounds[:a + 1]]) @ self.projs[a].T)
        x = torch.stack(rows)[None]
        pos = torch.arange(t + 1)[None]
        cos_sin = self.target.model.rotary_emb(x, pos)
        mask = torch.full((t + 1, t + 1), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        logits = self.head @ self.target.model.norm(x[0, -1])
        out = np.full(self.target.config.vocab_size, -np.inf)
        out[self.ids] = logits.double().numpy()
        return out


def reference_states(target, tokens: list[int]) -> dict:
    """{HF hidden-state index: [T, H] float32}: index L is the last layer's output before the final norm, as
    the reference's training hooks read it (transformers' hidden_states[L] is after it)."""
    L, got = target.config.num_hidden_layers, {}
    hook = target.model.layers[L - 1].register_forward_hook(lambda m, i, o: got.update(last=o))
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    hook.remove()
    return {k: (got["last"] if k == L else hs[k])[0].float() for k in range(L + 1)}


def write_reference_pt(path, target, base: str, n: int, Ls: int, draft_ids=None, seed: int = 0,
                       dtype=torch.float32, edit=None, stage_layers=None) -> dict:
    """A random reference PSM saved as the v11 trainer saves one; weights scaled so attention is peaked and
    every row's type moves the draft. edit(state_dict, config) may change it first. -> what was saved."""
    cfg, g = target.config, torch.Generator().manual_seed(seed)
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    bounds = reference_anchors(L, n)
    sd = {f"aggr_projs.{a}.weight": torch.randn(H, (a + 1) * H, generator=g) * 1.5 / math.sqrt((a + 1) * H)
          for a in range(len(bounds))}
    rows = len(draft_ids) if draft_ids else V
    sd["lm_head.weight"] = torch.randn(rows, H, generator=g) * 2 / math.sqrt(H)
    for i in range(Ls):
        for k, w in psm_layer(cfg, i, Ls).state_dict().items():
            sd[f"spec_layers.{i}.{k}"] = (w + 0.3 * torch.randn(w.shape, generator=g) if w.ndim == 1 else
                                          torch.randn(w.shape, generator=g) * 1.5 / math.sqrt(w.shape[-1]))
    config = dict(hidden_size=H, vocab_size=V, model_type=cfg.model_type, base_model_path=base, draft_vocab_size=rows,
                  num_stages=n, num_spec_layers=Ls, version=11, trained_with_use_deepest=True,
                  aggr_feature_bound=bounds, num_aggr_types=len(bounds),
                  **({"draft_token_ids": list(draft_ids)} if draft_ids else {}), spec_intermediate_size_fallback=9216,
                  **({"stage_layers": stage_layers} if stage_layers else {}))
    sd = {k: v.to(dtype) for k, v in sd.items()}
    if edit:
        edit(sd, config)
    torch.save({"state_dict": sd, "config": config}, path)
    return {"state_dict": sd, "config": config}


# ------------------------------------------------------------------ the comparison


@functools.lru_cache(maxsize=None)
def _drafter(cfg, spec):
    """The engine's drafts (`PSM.draft_step` over its cache) as one compiled function of one PSM config:
    (variables, anchor states [T + n + 1, m, H], final norm, block starts, newest tokens, verified prefixes)."""
    module, n = PSM(cfg, spec), spec.n

    def drafts(variables, hpad, final_norm, pcs, ts, comps):
        cache0 = init_kv_cache(cfg, spec.num_layers, 1, T + n + 2, jnp.float32)
        chain = module.apply(variables, hpad[:T], cache0, method=PSM.prefill)  # every row verified, deepest type

        def one(pc, t, completed):
            block = jax.lax.dynamic_slice_in_dim(hpad, pc, n + 1)
            return module.apply(variables, block, chain, pc, t, completed, final_norm, method=PSM.draft_step)[0]

        return jax.vmap(one)(pcs, ts, comps)

    return jax.jit(drafts)


def engine_drafts(model, spec, variables, h: np.ndarray, fill: int) -> np.ndarray:
    """The engine's drafts after each t < T at this fill -> [T, 2, V]: the block starting at the verified prefix
    and one before it (the engine's cache lags a cycle)."""
    hpad = jnp.concatenate([jnp.asarray(h), jnp.zeros((spec.n + 1, *h.shape[1:]))])  # rows past T: never read
    cases = [(pc, t, max(t - fill + 1, 0)) for t in range(T) for pc in (max(t - fill + 1, 0), max(t - fill, 0))]
    args = (jnp.asarray(c, jnp.int32) for c in zip(*cases))
    out = _drafter(model.config, spec)(variables, hpad, model.params["final_norm"], *args)
    return np.asarray(out).reshape(T, 2, -1)


def worst_ratio(model, oracle: ReferencePSM, states: dict, spec, variables, fills, stop_above=math.inf) -> float:
    """max over t, fills and the engine's two block starts of |ours - oracle| / bound (VS_TRANSFORMERS over the
    PSM's Ls layers); inf where the draft vocabulary's support differs. <= 1: equal. Stops once above stop_above."""
    h = np.stack([states[b].numpy() for b in spec.anchors], 1)  # [T, m, H]: the same states for both
    variables = jax.tree.map(jnp.asarray, variables)
    worst = 0.0
    for k in fills:
        ours = engine_drafts(model, spec, variables, h, k)
        for t in range(T):
            want = oracle.draft(states, t, k)
            for got in ours[t]:
                if not np.array_equal(np.isneginf(got), np.isneginf(want)):
                    return math.inf
                on = np.isfinite(want)
                err = np.abs(got[on] - want[on]).max()
                worst = max(worst, err / bound(want[on], VS_TRANSFORMERS, spec.num_layers))
            if worst > stop_above:
                return worst
    return worst


CASES = {
    "n8": dict(kind="qwen3_5", n=8, Ls=3, draft=100),  # the authors' s8_l3, with a draft vocabulary as theirs have
    "n4": dict(kind="qwen3_5", n=4, Ls=4, draft=0),  # their s4_l4; anchors [0, 2, 6, 7, 8]: h_L among them
    "n4-uneven": dict(kind="qwen3_5", n=4, Ls=2, draft=0, stage_layers="3;2;1;2"),  # its typing is ours there
    "llama-n4": dict(kind="llama", n=4, Ls=2, draft=0),  # Qwen3 layers over a Llama base: the PSM's qk_norm
    "qwen3-n2": dict(kind="qwen3", n=2, Ls=2, draft=0),  # a Qwen3 base: its own layer kind
}


@pytest.fixture(scope="module")
def bases(tiny_ckpt):
    """kind -> (HF directory, transformers model, our model, the reference's anchor states of positions 0..T-1)."""
    made = {}

    def get(kind):
        if kind not in made:
            path, target = tiny_ckpt(kind, False, num_hidden_layers=8)
            made[kind] = (path, target, spd_jax.load_model(path), reference_states(target, list(range(3, 3 + T))))
        return made[kind]

    return get


@pytest.fixture(scope="module")
def converted(bases, tmp_path_factory):
    """case -> (the saved checkpoint, what it holds, its oracle, the PSM directory the CLI wrote from it)."""
    made = {}

    def get(case):
        if case not in made:
            c = CASES[case]
            path, target, _, _ = bases(c["kind"])
            d = tmp_path_factory.mktemp(f"reference_{case}")
            V = target.config.vocab_size
            ids = sorted(np.random.default_rng(1).choice(V, c["draft"], False).tolist()) if c["draft"] else None
            pt = d / f"tiny_s{c['n']}_l{c['Ls']}.pt"
            ckpt = write_reference_pt(pt, target, str(path), c["n"], c["Ls"], ids, stage_layers=c.get("stage_layers"))
            assert ref.main([str(pt), str(d / "psm"), "--base", str(path)]) == 0
            made[case] = (pt, ckpt, ReferencePSM(target, ckpt), d / "psm")
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_converted_psm_drafts_what_the_reference_drafts(bases, converted, case):
    """fp32: every position t < 12 and every fill 1..n, both block starts of the engine, within VS_TRANSFORMERS
    (2e-5 x sqrt(Ls) x max(1, max|logit|): two implementations of one function) of the oracle."""
    c = CASES[case]
    _, _, model, states = bases(c["kind"])
    pt, ckpt, oracle, out = converted(case)
    spec, variables = load_psm(out, model.config, ref.plan_of(ckpt["config"], model.config), model.params,
                               target_weights=model.weights_fingerprint)
    assert spec.n == c["n"] and spec.own_head and spec.anchors == tuple(reference_anchors(8, spec.n))
    assert spec.draft_vocab == c["draft"] and spec.qk_norm == (c["kind"] == "llama")
    want = tuple(map(int, c["stage_layers"].split(";"))) if "stage_layers" in c else (8 // c["n"],) * c["n"]
    assert spec.plan == want
    r = worst_ratio(model, oracle, states, spec, variables, range(1, spec.n + 1))
    print(f"{case}: worst |converted - oracle| / bound = {r:.3f}")
    assert r <= 1, r


def test_the_directory_records_its_source(bases, converted, capsys):
    """psm.json names the source file by sha256 and the base's weights; reference.json and CARD.md hold the
    checkpoint's config verbatim; --help documents the format."""
    import hashlib

    path, _, model, _ = bases("qwen3_5")
    pt, ckpt, _, out = converted("n8")
    meta = json.loads((out / "psm.json").read_text())
    digest = hashlib.sha256(pt.read_bytes()).hexdigest()
    assert meta["converted_from"]["sha256"] == digest and meta["target_weights"] == model.weights_fingerprint
    assert json.loads((out / "reference.json").read_text())["config"] == ckpt["config"]
    card = (out / "CARD.md").read_text()
    assert digest in card and '"aggr_feature_bound": [' in card and "100 ids" in card
    assert '"num_spec_layers": 3' in card and "## Evaluation" in card
    with pytest.raises(SystemExit):
        ref.main(["--help"])
    doc = capsys.readouterr().out
    for name in ("aggr_projs.{a}.weight", "[H, (a+1) H]", "spec_layers.{i}.self_attn.q_proj.weight", "lm_head.weight",
                 "aggr_feature_bound", "draft_token_ids", "num_stages", "stage_layers", "weights_only=True"):
        assert name in doc, name


def test_the_base_is_found_by_path_or_name(bases, caplog):
    """Without --base the config's base_model_path is tried as a directory (the weights' fingerprint recorded),
    then by its name among configs/models (none recorded, said); neither: a one-line refusal."""
    path, _, model, _ = bases("qwen3_5")
    cfg, fingerprint, label = ref.resolve_base(None, {"base_model_path": str(path)})
    assert cfg == model.config and fingerprint == model.weights_fingerprint and label == str(path)
    with caplog.at_level(logging.WARNING):
        cfg, fingerprint, label = ref.resolve_base(None, {"base_model_path": "Someone/Tiny-Qwen3_5"})
    assert label == "tiny-qwen3_5" and fingerprint is None and "no target-weights fingerprint" in caplog.text
    with pytest.raises(ref.ReferenceCheckpointError, match="no base model found for 'Qwen/Qwen9-1T': give --base"):
        ref.resolve_base(None, {"base_model_path": "Qwen/Qwen9-1T"})


def test_bfloat16_weights_convert_bit_for_bit(bases, converted, tmp_path):
    """The authors' files hold bfloat16 tensors: they convert unrounded, stored in bfloat16, every value the same
    as the float32 conversion of the same values."""
    path, target, model, _ = bases("qwen3_5")
    ids = converted("n8")[1]["config"]["draft_token_ids"]
    for dtype in (torch.bfloat16, torch.float32):
        write_reference_pt(tmp_path / f"{dtype}.pt", target, str(path), 8, 3, ids, dtype=torch.bfloat16,
                           edit=lambda sd, c: sd.update({k: v.to(dtype) for k, v in sd.items()}))
    state16, config, _ = ref.read_checkpoint(tmp_path / f"{torch.bfloat16}.pt")
    state32, _, _ = ref.read_checkpoint(tmp_path / f"{torch.float32}.pt")
    (_, v16), (_, v32) = (ref.convert(s, config, model.config) for s in (state16, state32))
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(v16["params"]), jax.tree.leaves(v32["params"])):
        assert a.dtype == jnp.bfloat16 and b.dtype == np.float32, where
        np.testing.assert_array_equal(np.asarray(a, np.float32), b, err_msg=str(where))


def test_spd_with_the_converted_psm_equals_ar(bases, converted):
    """Greedy SPD with the converted PSM (its own head over a draft vocabulary, n = 8) commits AR's tokens."""
    _, _, model, _ = bases("qwen3_5")
    spec_dir = converted("n8")[3]
    ar = spd_jax.generate(model, PROMPT, 16, method="ar", stop_at_eos=False).token_ids
    res = spd_jax.generate(model, PROMPT, 16, method=methods.SPD(n=8, spec=str(spec_dir)), stop_at_eos=False)
    assert res.token_ids == ar and res.stats["psm"] == str(spec_dir)


# ------------------------------------------------------------------ mutation check: a broken converter fails


def _retable(monkeypatch, change):
    """Patch the converter's tensor table: change(name, Tensor, cfg, spec) -> the Tensor to use."""
    table = ref.tensor_table
    monkeypatch.setattr(ref, "tensor_table", lambda cfg, spec, rows: {
        name: change(name, t, cfg, spec) for name, t in table(cfg, spec, rows).items()})


def _puts(t, f):
    return ref.Tensor(t.shape, tuple(f(*p) for p in t.puts))


def _reverse_blocks(name, t, cfg, spec):  # concat(h_{b_a}, ..., h_{b_0}) instead of concat(h_{b_0}, ..., h_{b_a})
    H = cfg.hidden_size
    return _puts(t, lambda path, i, f: (path, i, lambda w: f(w).reshape(-1, H, H)[::-1].reshape(-1, H))
                 if name.startswith("aggr_projs.") else (path, i, f))


def _untransposed(name, t, cfg, spec):  # W_0 [H, H] stored as it is, not transposed
    return _puts(t, lambda path, i, f: (path, i, (lambda w: w) if name == "aggr_projs.0.weight" else f))


def _skip_q_norm(name, t, cfg, spec):  # q_norm left at its identity (not read from the file)
    return _puts(t, lambda path, i, f: (path, i, (lambda w: np.full_like(w, 1 - cfg.norm_offset))
                                        if name.endswith("q_norm.weight") else f))


def _swap_gate(name, t, cfg, spec):  # Qwen3.5's q_proj halves: query and gate exchanged
    if not name.endswith("q_proj.weight"):
        return t
    (p0, i0, f0), (p1, i1, f1) = t.puts
    return ref.Tensor(t.shape, ((p0, i0, f1), (p1, i1, f0)))


def _reverse_layers(name, t, cfg, spec):  # spec_layers.{i} into slot Ls - 1 - i
    return _puts(t, lambda path, i, f: (path, None if i is None else spec.num_layers - 1 - i, f))


def _swap_norms(name, t, cfg, spec):  # input_layernorm <-> post_attention_layernorm
    swap = {("layer_attn_norm",): ("layer_mlp_norm",), ("layer_mlp_norm",): ("layer_attn_norm",)}
    return _puts(t, lambda path, i, f: (swap.get(path, path), i, f))


def _swap_gate_up(name, t, cfg, spec):  # mlp.gate_proj <-> mlp.up_proj
    swap = {("layer_w_gate",): ("layer_w_up",), ("layer_w_up",): ("layer_w_gate",)}
    return _puts(t, lambda path, i, f: (swap.get(path, path), i, f))


def _patched(monkeypatch, fn, change):
    orig = getattr(ref, fn)
    monkeypatch.setattr(ref, fn, lambda *a, **k: change(orig(*a, **k)))


MUTATIONS = {  # name: (case, how)
    "projection concat order reversed": ("n4", lambda mp: _retable(mp, _reverse_blocks)),
    "first projection not transposed": ("n4", lambda mp: _retable(mp, _untransposed)),
    "q_norm skipped": ("n4", lambda mp: _retable(mp, _skip_q_norm)),
    "attention gate and query swapped": ("n4", lambda mp: _retable(mp, _swap_gate)),
    "spec layers in reverse order": ("n4", lambda mp: _retable(mp, _reverse_layers)),
    "layer norms swapped": ("n4", lambda mp: _retable(mp, _swap_norms)),
    "mlp gate and up swapped": ("n4", lambda mp: _retable(mp, _swap_gate_up)),
    "draft-vocabulary map dropped": ("n8", lambda mp: _patched(mp, "vocab_ids_of", lambda ids: np.arange(ids.size))),
    "anchors read one layer deeper": ("n8", lambda mp: _patched(mp, "spec_of", lambda s: dataclasses.replace(
        s, anchors=(0, *(b + 1 for b in s.anchors[1:]))))),
    "stage plan uneven": ("n4", lambda mp: _patched(mp, "plan_of", lambda plan: (1, 3, 1, 3))),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_broken_converter_fails_the_comparison(bases, converted, monkeypatch, mutation):
    """Each converter component broken in turn (the file and the oracle unchanged): the drafts at fills 1 and n
    leave the bound."""
    case, how = MUTATIONS[mutation]
    _, _, model, states = bases(CASES[case]["kind"])
    pt, ckpt, oracle, _ = converted(case)
    state, config, _ = ref.read_checkpoint(pt)
    how(monkeypatch)
    spec, variables = ref.convert(state, config, model.config)
    r = worst_ratio(model, oracle, states, spec, variables, (1, spec.n), stop_above=10)
    print(f"{mutation}: worst |converted - oracle| / bound = {r:.3g}")
    assert r > 10, f"the comparison misses a broken converter ({mutation}): {r}"


# ------------------------------------------------------------------ refusals: one line naming the problem and the fix


class NotATensor:
    """A custom object in a checkpoint: loading it needs a free unpickle."""


def _set(**kw):
    return lambda sd, config: config.update(kw)


def _drop(name):
    return lambda sd, config: sd.pop(name)


def _add(name, like):
    return lambda sd, config: sd.update({name: sd[like].clone()})


REFUSALS = {  # name: (edit of the n = 8 checkpoint, convert_file keywords, the message)
    "another base: hidden size": (_set(hidden_size=128), {}, r"made for a base with hidden_size=128, the base given "
                                  r"has 64: give --base the model it was trained for"),
    "another base: vocabulary": (_set(vocab_size=161), {}, r"vocab_size=161, the base given has 160"),
    "another base: model type": (_set(model_type="qwen3"), {},
                                 r"model_type='qwen3', the base given has 'qwen3_5_text'"),
    "another base: layers": (_set(aggr_feature_bound=[0, 1, 3, 6, 9]), {}, r"reads hidden state 9, beyond the base's "
                             r"8 layers: the checkpoint was made for another base model; give --base"),
    "another n than asked for": (None, dict(n=4), r"drafts for n=8 pipeline stages, not the n=4 asked for.*--n 8"),
    "an n the base cannot take": (_set(num_stages=3), {}, r"n=3 stages cannot split the base's 8 layers evenly"),
    "a missing tensor": (_drop("spec_layers.2.mlp.up_proj.weight"), {},
                         r"lacks tensor 'spec_layers.2.mlp.up_proj.weight' for a v11 PSM of its config \(Ls=3"),
    "an unexpected tensor": (_add("spec_layers.3.input_layernorm.weight", "spec_layers.0.input_layernorm.weight"), {},
                             r"has unexpected tensor 'spec_layers.3.input_layernorm.weight'"),
    "a shape mismatch": (lambda sd, c: sd.update({"spec_layers.0.mlp.gate_proj.weight": torch.zeros(120, 64)}), {},
                         r"tensor 'spec_layers.0.mlp.gate_proj.weight' has shape \(120, 64\), expected \(112, 64\)"),
    "version 10": (_set(version=10), {}, r"is version 10, not 11: this converter reads v11 checkpoints"),
    "no version": (lambda sd, c: c.pop("version"), {}, r"config lacks version: not a reference v11 PSM checkpoint"),
    "a draft vocabulary of another size": (_set(draft_token_ids=list(range(99))), {},
                                           r"gives 99 distinct ids in \[0, 98\] for a head of 100 rows"),
    "a head without its ids": (lambda sd, c: c.pop("draft_token_ids"), {},
                               r"lm_head.weight has 100 rows.*give --draft-vocab the draft_vocab/\*.json"),
    "a stage plan whose typing differs": (_set(num_stages=4, stage_layers="3;1;3;1", aggr_feature_bound=[0, 2, 6, 7, 8],
                                               num_aggr_types=5), {},
                                          r"for stage plan \[3, 1, 3, 1\] the reference types in-flight rows"),
    "not loadable weights-only": (lambda sd, c: c.update(extra=NotATensor()), {},
                                  r"does not load with torch.load\(weights_only=True\).*never unpickles freely"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_bad_checkpoint_is_refused_in_one_line(bases, converted, tmp_path, refusal):
    edit, kw, message = REFUSALS[refusal]
    path, target, _, _ = bases("qwen3_5")
    pt, ckpt, _, _ = converted("n8")
    if edit is not None:
        pt = tmp_path / "edited.pt"
        write_reference_pt(pt, target, str(path), 8, 3, ckpt["config"]["draft_token_ids"], edit=edit)
    with pytest.raises(ref.ReferenceCheckpointError, match=message) as e:
        ref.convert_file(pt, tmp_path / "psm", base=str(path), **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "psm").exists()


def test_a_draft_vocabulary_file_stands_in_for_the_configs_ids(bases, converted, tmp_path, capsys):
    """A config without draft_token_ids takes the reference's draft_vocab/*.json (--draft-vocab); one that has
    them must agree with the file; a file that is not a weights-only checkpoint fails the CLI in one line."""
    path, target, _, _ = bases("qwen3_5")
    _, ckpt, _, _ = converted("n8")
    ids = ckpt["config"]["draft_token_ids"]
    vocab = tmp_path / "top_100.json"
    vocab.write_text(json.dumps({"vocab_size": 160, "draft_vocab_size": 100, "token_ids": ids}))
    pt = tmp_path / "no_ids.pt"
    write_reference_pt(pt, target, str(path), 8, 3, ids, edit=lambda sd, c: c.pop("draft_token_ids"))
    spec = ref.convert_file(pt, tmp_path / "psm", base=str(path), draft_vocab=vocab)
    assert spec.draft_vocab == 100
    vocab.write_text(json.dumps({"token_ids": ids[1:] + [ids[0] - 1 if ids[0] else 159]}))
    with pytest.raises(ref.ReferenceCheckpointError, match="differ: give --draft-vocab the vocabulary"):
        ref.convert_file(converted("n8")[0], tmp_path / "psm2", base=str(path), draft_vocab=vocab)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert ref.main([str(tmp_path / "junk.pt"), str(tmp_path / "psm3"), "--base", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m spd_jax.convert.reference_psm: error: ") and "\n" not in err
