"""Drafter training: the config, the data order, the jitted step, orbax checkpoints and the quick eval.

Two methods share everything here but the loss, the drafter's variables and the quick eval
(`TrainConfig.method`): "psm", the Pipeline Speculation Module, and "eagle3", the EAGLE-3-style chain
drafter (`spd_jax.drafters.eagle3`), so both see the same data, batches, optimiser and positions.

The target is frozen and teacher-forced: one forward gives every anchor state and the teacher logits;
the PSM's drafts come from `PSM.train_hidden`, the exact training counterpart of the engine's
per-cycle draft (tests/test_psm_train.py), computed only at the positions in the loss and for the
in-flight slots their simulated fill has (`psm.deal_fills`). Loss: KL(teacher || PSM) at temperature tau, times tau^2,
averaged over positions whose next token is a response token; top-1 agreement is logged. The EAGLE-3
drafter's loss is `eagle3.eagle3_loss` (the same KL over `ttt_steps` unrolled draft steps, its
training-time test); its logged agreement is the first step's.

Batches are [B, T] with B sequences padded to one of a few length buckets (one compiled shape each),
sharded over the mesh's `data` axis; the frozen target is split over `model`, the PSM replicated.
Randomness (the simulated pipeline fill) is keyed by (seed, step), so a resumed run and an
uninterrupted one take identical steps, and the same global batch gives the same loss on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spd_jax.models import decoder, schema
from spd_jax.sharding import TRAIN_RULES, logical_spec, tree_shardings
from spd_jax.drafters import eagle3
from spd_jax.drafters.base import join_params, split_params
from spd_jax.drafters.eagle3 import Eagle3Config
from spd_jax.drafters.objective import distill_kl, top1_ce
from spd_jax.drafters.psm import PSM, PSMConfig, deal_fills, fill_weights, init_psm, psm_axes, teacher_states

log = logging.getLogger(__name__)

METHODS = ("psm", "eagle3")  # what train.main trains: `method` in the config
RESPONSES = ("dataset", "target")  # whose responses the drafter learns on: `responses` in the config
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # `compute_dtype` in the config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "smollm2-135m-instruct"
    method: str = "psm"  # "psm" or "eagle3" (the chain baseline); n .. layers_from_target are the PSM's
    n: int = 8  # pipeline depth the PSM is trained for
    stages: tuple[int, ...] | None = None  # per-stage layer counts; default: what infer.generate plans
    psm_layers: int = 2
    anchors: tuple[int, ...] | None = None  # default: depth-aware [0, l, 3l, 6l, L-1] or quarters
    layers_from_target: bool = True  # start the PSM layers as copies of the target's last ones
    # V': head over the V' most frequent response tokens of the training data (0: the whole vocabulary);
    # the loss is then the KL of the teacher restricted (renormalised) to them
    draft_vocab: int = 0
    init_from: str | None = None  # warm start from an exported drafter (PSM: same target, Ls and anchor count)
    # eagle3: the target's hidden states it fuses (default EAGLE-3's low/mid/high), the draft steps the
    # training-time test unrolls, the chain length of its quick eval
    feature_layers: tuple[int, ...] | None = None
    ttt_steps: int = 3
    eval_k: int = 3
    sources: tuple[str, ...] = ("sharegpt", "gsm8k")
    # "dataset": the conversations' own responses; "target": each first turn answered by the target
    # (self-distillation, greedy, train/distill.py), built once and cached
    responses: str = "dataset"
    distill_batch: int = 32  # prompts per on-device generation batch when building the "target" corpus
    # a `train.replies` corpus directory: its finished chunks (the target's greedy and sampled replies to
    # every turn of the sources) are the data, in place of sources/limit/responses
    replies: str | None = None
    limit: int | None = None  # conversations per source (small runs and tests)
    # conversations per source passed over before `limit` starts counting: a later slice of the corpus
    # (e.g. a new round of self-distillation on prompts an earlier round did not answer)
    skip: int = 0
    # keep only the conversations (of the skip/limit slice) whose first user turn matches this regular
    # expression (re.search): a round of data aimed at one domain, e.g. code
    prompt_pattern: str | None = None
    max_len: int = 512  # longer conversations keep only the whole turns that fit
    buckets: tuple[int, ...] = (128, 256, 512)
    batch_size: int = 8  # sequences per micro-batch (global, over the data axis)
    grad_accum: int = 1  # micro-batches per optimiser step: an update takes grad_accum x batch_size sequences
    steps: int = 2000
    lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.0
    clip: float = 1.0
    tau: float = 1.0
    # weight of a cross-entropy term on the teacher's argmax added to the KL (0: the KL alone, the
    # reference's objective); the logged loss stays the KL
    hard_weight: float = 0.0
    # The simulated pipeline fills (psm.fill_weights): None, the paper's (a full pipeline half the time);
    # p in (0, 1), the fills the greedy engine verifies when each draft is accepted with probability p
    fill_accept: float | None = None
    # Matmul precision of the teacher and the PSM (master weights, optimiser and loss stay float32):
    # float32, bfloat16, or auto = bfloat16 on TPU and GPU, float32 on CPU, where the whole step ran
    # 0.91x as fast in bfloat16 even on a Zen 4 with AVX512-BF16, whose lone bf16 matmul runs 1.8x
    # (python -m bench.train_step).
    compute_dtype: str = "auto"
    # Keep the frozen target's features of every training sequence on disk (train/features.py, under the
    # corpus cache): passes after the first, and later runs on the same data, skip the teacher's forward
    teacher_cache: bool = False
    seed: int = 0
    heldout: int = 64  # conversations kept out of training for the quick eval
    eval_every: int = 250
    eval_prompts: int = 6
    eval_tokens: int = 48
    save_every: int = 50
    keep: int = 3
    log_every: int = 10

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}; known: {sorted(names)}")
        d = dict(d)
        for k in ("stages", "anchors", "sources", "buckets", "feature_layers"):
            if d.get(k) is not None:
                v = d[k]
                if not isinstance(v, (str, list, tuple)):
                    raise ValueError(f"{k}={v!r}: {k} takes a list, [a, b] or a string a,b")
                d[k] = tuple(v.split(",") if isinstance(v, str) else v)
                if k != "sources":
                    try:
                        d[k] = tuple(_integer(x) for x in d[k])
                    except (TypeError, ValueError):
                        raise ValueError(f"{k}={v!r}: {k} takes integers, as a list [4, 4] or a string 4,4") from None
        for f in dataclasses.fields(cls):  # YAML reads "3e-4" (no dot) as a string
            if f.name in d and isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
                try:
                    d[f.name] = type(f.default)(d[f.name])
                except (TypeError, ValueError):
                    raise ValueError(f"training config {f.name}={d[f.name]!r} is not a {type(f.default).__name__}")
        if d.get("fill_accept") is not None:
            try:
                d["fill_accept"] = float(d["fill_accept"])
            except (TypeError, ValueError):
                raise ValueError(f"training config fill_accept={d['fill_accept']!r} is not a number (or null)")
            fill_weights(2, d["fill_accept"])  # refuses one outside (0, 1), naming it
        cfg = cls(**d)
        if cfg.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {cfg.method!r}")
        if cfg.responses not in RESPONSES:
            raise ValueError(f"responses must be one of {', '.join(RESPONSES)}, got {cfg.responses!r}")
        if cfg.replies is not None and cfg.responses != "dataset":
            raise ValueError(f"replies={cfg.replies!r} is a corpus of the target's replies already; drop "
                             f"responses={cfg.responses!r}")
        if cfg.ttt_steps < 1 or cfg.eval_k < 1:
            raise ValueError(f"ttt_steps ({cfg.ttt_steps}) and eval_k ({cfg.eval_k}) must be at least 1")
        if cfg.hard_weight and cfg.method != "psm":
            raise ValueError(f"hard_weight is a term of the PSM's loss; method {cfg.method!r} trains on the KL alone "
                             "(set hard_weight=0)")
        if cfg.teacher_cache and cfg.method != "psm":
            raise ValueError(f"teacher_cache holds a PSM's anchor states; method {cfg.method!r} reads other features "
                             "(set teacher_cache=false)")
        if cfg.skip < 0:
            raise ValueError(f"skip must be >= 0 (conversations per source passed over), got {cfg.skip}")
        if cfg.prompt_pattern is not None:
            if not isinstance(cfg.prompt_pattern, str):
                raise ValueError(f"prompt_pattern must be a regular expression (a string), got {cfg.prompt_pattern!r}")
            try:
                re.compile(cfg.prompt_pattern)
            except re.error as e:
                raise ValueError(f"prompt_pattern {cfg.prompt_pattern!r} is not a regular expression: {e}") from None
        if cfg.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {cfg.compute_dtype!r}")
        counts = ("psm_layers", "max_len", "batch_size", "grad_accum", "steps", "eval_every", "save_every",
                  "keep", "log_every", "distill_batch")
        bad = [f"{k}={getattr(cfg, k)}" for k in counts if getattr(cfg, k) < 1]
        bad += [f"{k}={getattr(cfg, k)}" for k in ("warmup", "heldout", "eval_prompts", "eval_tokens", "draft_vocab",
                                                   "hard_weight", "weight_decay") if not 0 <= getattr(cfg, k) < math.inf]
        bad += [f"{k}={getattr(cfg, k)}" for k in ("lr", "tau", "clip") if not 0 < getattr(cfg, k) < math.inf]
        if cfg.limit is not None and cfg.limit < 1:
            bad.append(f"limit={cfg.limit}")
        if not cfg.buckets or min(cfg.buckets) < 1:
            bad.append(f"buckets={list(cfg.buckets)}")
        if bad:
            raise ValueError(f"training config {', '.join(bad)}: {', '.join(counts)} must be at least 1; warmup, "
                             "heldout, eval_prompts, eval_tokens, draft_vocab, hard_weight and weight_decay at least "
                             "0; lr, tau and clip above 0; limit at least 1 or null; buckets one length or more, "
                             "each at least 1")
        if cfg.max_len > max(cfg.buckets):
            raise ValueError(f"max_len {cfg.max_len} exceeds the largest bucket {max(cfg.buckets)}")
        return cfg


# ---------------------------------------------------------------- data

def corpus_dir() -> Path:
    """Where tokenised (and regenerated) corpora are cached: $SPD_JAX_CACHE/corpus, else ~/.cache/spd_jax/corpus."""
    return Path(os.environ.get("SPD_JAX_CACHE") or Path.home() / ".cache" / "spd_jax") / "corpus"


def _integer(x) -> int:
    """An integer config value: 4 or "4", not 4.7 (which int() would cut to 4) or True."""
    if isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()):
        raise ValueError(f"{x!r} is not an integer")
    return int(x)


def corpus_key(model, tc: TrainConfig, *extra) -> str:
    """The cache name of tc's corpus for `model`: what its sequences depend on (`extra`: more of it)."""
    # skip and prompt_pattern join the key only when set, so the corpora cached before they existed keep
    # their names
    skip = [dict(skip=tc.skip)] if tc.skip else []
    skip += [dict(prompt_pattern=tc.prompt_pattern)] if tc.prompt_pattern is not None else []
    return hashlib.sha256(json.dumps([tc.sources, tc.limit, tc.max_len, str(model.path),
                                      model.tokenizer.chat_template, *extra, *skip]).encode()).hexdigest()[:16]


def conversations(tc: TrainConfig):
    """(source, chat messages) of the conversations tc.skip .. tc.skip + tc.limit - 1 of each of tc.sources
    (all from tc.skip on without a limit), in corpus order; with tc.prompt_pattern, those of them whose
    first user turn matches it."""
    from train import data

    keep = re.compile(tc.prompt_pattern).search if tc.prompt_pattern is not None else None
    readers = {"sharegpt": data.read_sharegpt, "gsm8k": data.gsm8k_conversations}
    for src in tc.sources:
        if src not in readers:
            raise ValueError(f"unknown data source {src!r}; known: {sorted(readers)}")
        for i, msgs in enumerate(readers[src]()):
            if tc.limit is not None and i >= tc.skip + tc.limit:
                break
            if i >= tc.skip and (keep is None or (msgs and keep(msgs[0]["content"]))):
                yield src, msgs


def save_sequences(seqs: list[tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    """[(ids [T], mask [T])] -> one npz, written atomically (processes of one job may write side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    off = np.cumsum([0] + [len(i) for i, _ in seqs])
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, ids=np.concatenate([i for i, _ in seqs] or [np.zeros(0, np.int32)]),
             mask=np.concatenate([m for _, m in seqs] or [np.zeros(0, bool)]), offsets=off)
    tmp.replace(path)


def load_sequences(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """A cached corpus (or chunk of one) -> [(ids [T], loss_mask [T])]; a file that does not read (damaged
    on disk: save_sequences replaces files whole) raises ValueError naming it and the fix."""
    import zipfile

    try:
        with np.load(path, allow_pickle=False) as z:
            ids, mask, off = z["ids"], z["mask"], z["offsets"]
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError) as e:
        raise ValueError(f"cached corpus {path} does not read ({type(e).__name__}: {e}): it is damaged; delete it "
                         "and the next run builds it again") from None
    return [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]


def encode_corpus(model, tc: TrainConfig, cache_dir: Path | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every training conversation of tc.sources -> [(ids, loss_mask)], tokenised once and cached;
    with responses "target", the first turns answered by the target instead (`train.distill`); with
    replies, that corpus's finished chunks (`train.replies`)."""
    from spd_jax.progress import progress_bar

    from train import data

    if tc.replies is not None:
        from train import replies

        return replies.training_corpus(model, Path(tc.replies), tc.max_len)
    if tc.responses == "target":
        from train import distill

        return distill.distilled_corpus(model, tc, cache_dir)
    path = cache_dir / f"corpus-{corpus_key(model, tc)}.npz" if cache_dir else None
    if path and path.is_file():
        return load_sequences(path)
    out = []
    for _, msgs in progress_bar(conversations(tc), desc="tokenising", unit="conv"):
        enc = data.encode_conversation(model.tokenizer, msgs, tc.max_len, model.eos_token_ids)
        if enc is not None:
            out.append(enc)
    if path:
        save_sequences(out, path)
    return out


def draft_vocab_ids(corpus: list, size: int, vocab_size: int, always: Sequence[int] = ()) -> np.ndarray:
    """The draft vocabulary: the `size` tokens most often predicted at response positions of the
    corpus [(ids, mask)] (ties to the lower id), with the `always` tokens (EOS: a draft must be able
    to end a reply) in place of the rarest ones. -> sorted int32 [size]."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab {size} must be in 1..{vocab_size}")
    if size < len(set(always)):
        raise ValueError(f"draft_vocab {size} cannot hold the {len(set(always))} tokens it must include (EOS)")
    counts = np.zeros(vocab_size, np.int64)
    for ids, mask in corpus:
        np.add.at(counts, ids[1:][mask[:-1]], 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    always = [int(t) for t in dict.fromkeys(always) if 0 <= t < vocab_size]
    chosen = [int(t) for t in order if t not in always][: size - len(always)] + always
    return np.sort(np.asarray(chosen, np.int32))


def split_heldout(corpus: list, tc: TrainConfig) -> tuple[list, list]:
    """A fixed, seed-independent held-out split (every k-th conversation) for the quick eval."""
    if tc.heldout <= 0:
        return corpus, []
    stride = max(len(corpus) // tc.heldout, 2)
    held = set(range(stride // 2, len(corpus), stride)[:tc.heldout])
    return [c for i, c in enumerate(corpus) if i not in held], [corpus[i] for i in sorted(held)]


def batch_order(lengths: np.ndarray, tc: TrainConfig, epoch: int) -> list[np.ndarray]:
    """One epoch's batches (index arrays of batch_size): shuffled, then sorted by length within
    windows of 32 batches so that a batch pads little, then the batches shuffled. Deterministic in
    (seed, epoch): the data position of a run is just its step."""
    rng = np.random.default_rng([tc.seed, epoch])
    perm = rng.permutation(len(lengths))
    B, win = tc.batch_size, 32 * tc.batch_size
    batches = []
    for a in range(0, len(perm) - B + 1, win):
        chunk = perm[a:a + win]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i:i + B] for i in range(0, len(chunk) - B + 1, B)]
    return [batches[i] for i in rng.permutation(len(batches))]


class Batches:
    """The batch of micro-step i (= step * grad_accum + micro), over as many epochs as needed."""

    def __init__(self, corpus: list, tc: TrainConfig):
        if len(corpus) < tc.batch_size:
            raise ValueError(f"{len(corpus)} training sequences are fewer than one batch ({tc.batch_size})")
        self.corpus, self.tc = corpus, tc
        self.lengths = np.asarray([len(i) for i, _ in corpus])
        self._epochs: dict[int, list] = {}

    def __len__(self):  # batches per epoch
        return len(self._order(0))

    def _order(self, epoch):
        if epoch not in self._epochs:
            self._epochs = {epoch: batch_order(self.lengths, self.tc, epoch)}
        return self._epochs[epoch]

    def indices(self, i: int) -> np.ndarray:
        """The corpus indices of micro-step i's sequences."""
        epoch, j = divmod(i, len(self))
        return self._order(epoch)[j]

    def get(self, i: int) -> dict[str, np.ndarray]:
        return pad_batch([self.corpus[k] for k in self.indices(i)], self.tc.buckets)


def pad_batch(seqs: list[tuple[np.ndarray, np.ndarray]], buckets: Sequence[int]) -> dict[str, np.ndarray]:
    """[(ids, mask)] -> tokens [B, T] int32, mask [B, T] bool, zero-padded to the smallest bucket T that
    holds the longest; query [B, Q] int32, the positions of each row's mask (its response positions)
    padded with 0, and query_mask [B, Q] bool, Q the smallest bucket that holds the most any row has: the
    drafter's groups and heads run only there. One compiled step per (T, Q) pair of buckets."""
    longest = max(len(ids) for ids, _ in seqs)
    T = next((b for b in buckets if b >= longest), None)
    if T is None:
        raise ValueError(f"a sequence of {longest} tokens exceeds the largest bucket {max(buckets)}")
    Q = next(b for b in buckets if b >= max(max(int(m.sum()) for _, m in seqs), 1))
    tokens = np.zeros((len(seqs), T), np.int32)
    mask = np.zeros((len(seqs), T), bool)
    query = np.zeros((len(seqs), Q), np.int32)
    query_mask = np.zeros((len(seqs), Q), bool)
    for r, (ids, m) in enumerate(seqs):
        tokens[r, :len(ids)], mask[r, :len(m)] = ids, m
        at = np.flatnonzero(m)
        query[r, :len(at)], query_mask[r, :len(at)] = at, True
    return dict(tokens=tokens, mask=mask, query=query, query_mask=query_mask)


# ---------------------------------------------------------------- the drafter and its loss

Spec = PSMConfig | Eagle3Config  # what a run trains; its type is the method


def drafter_spec(model, tc: TrainConfig) -> Spec:
    """The drafter a run trains: an EAGLE-3 drafter (feature layers, draft vocabulary), or a PSM for the
    stage plan `infer.generate` makes at n (or tc.stages) with tc's layers and anchors."""
    if tc.method == "eagle3":
        return Eagle3Config.for_target(model.config, tc.feature_layers, tc.draft_vocab)
    from spd_jax.decode import pipelined

    plan = pipelined.plan_for(model, tc.n, tc.stages)
    return PSMConfig.for_target(model.config, plan.counts, tc.psm_layers, tc.anchors, tc.draft_vocab)


def export_name(spec: Spec) -> str:
    """The run directory's subdirectory the trained drafter is exported to."""
    return "drafter" if isinstance(spec, Eagle3Config) else "psm"


def psm_loss(trainable, frozen, target, batch, keys, *, cfg, spec: PSMConfig, tau: float,
             fill_accept: float | None = None, hard_weight: float = 0.0):
    """-> (sum of the masked KL (plus hard_weight x the cross-entropy on the teacher's argmax), metrics
    sums). batch (`pad_batch`): tokens [B, T] int32; query [B, Q] int32 and query_mask [B, Q] bool, the
    positions t that predict a response token. keys [B]: one per sequence, so the simulated fills of a
    sequence do not depend on how the batch is split over devices (they do depend on Q: `psm.deal_fills`).
    The frozen target runs on all T positions (the PSM's chain reads them all); the PSM's groups, both heads
    and the KL only on the queries. A batch that carries the target's features (anchor_states [B, T, m, H],
    final_hidden [B, T, H]: `teacher_states`' outputs, from the teacher cache) skips that forward."""
    tokens = batch["tokens"]
    cd = target["embed"].dtype  # the compute dtype: the caller casts the frozen target once
    variables = jax.tree.map(lambda p: p.astype(cd) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                             join_params(trainable, frozen))
    if "anchor_states" in batch:
        h, x = batch["anchor_states"], batch["final_hidden"]
    else:
        h, x = teacher_states(target, tokens, cfg, spec.anchors)
    h, x = jax.lax.stop_gradient((h, x))
    order, blocks = deal_fills(keys, batch["query"].shape[1], spec.n, fill_accept)
    at = jnp.take_along_axis(batch["query"], order, axis=1)  # [B, Q] in the blocks' order
    w = jnp.take_along_axis(batch["query_mask"], order, axis=1).astype(jnp.float32)
    psm = PSM(cfg, spec)
    ys = psm.apply(variables, h, [(at[:, a:a + len(f)], f, K) for a, f, K in blocks], method=PSM.train_hidden)
    student = psm.apply(variables, jnp.concatenate(ys, axis=1), target["final_norm"],
                        method=PSM.head_logits)  # [B, Q, V']
    teacher = jax.lax.stop_gradient(decoder.lm_logits(target, jnp.take_along_axis(x, at[..., None], axis=1),
                                                      cfg))  # [B, Q, V]
    drafted = jnp.argmax(student, -1)
    if spec.draft_vocab:  # the teacher restricted to the draft vocabulary (renormalised by the softmax)
        ids = variables["vocab"]["ids"]
        teacher_v, drafted = teacher[..., ids], ids[drafted]
    else:
        teacher_v = teacher
    kl = distill_kl(student, teacher_v, tau)
    # against the unrestricted teacher: what greedy verification would accept
    agree = (jnp.argmax(teacher, -1) == drafted).astype(jnp.float32)
    kl_sum = (kl * w).sum()
    loss = kl_sum
    if hard_weight:
        # only where the teacher's token is in the draft vocabulary: elsewhere no draft is accepted, and
        # the restricted argmax would teach a token verification rejects
        hit = w if not spec.draft_vocab else w * (ids[jnp.argmax(teacher_v, -1)] == jnp.argmax(teacher, -1))
        loss = kl_sum + hard_weight * (top1_ce(student, teacher_v) * hit).sum()
    return loss, dict(kl_sum=kl_sum, agree_sum=(agree * w).sum(), positions=w.sum())


def compute_target(model, tc: TrainConfig) -> dict:
    """The frozen target's weights in the compute dtype (psm_loss computes in their dtype)."""
    return jax.tree.map(lambda t: t.astype(compute_dtype(tc)), model.params)


def compute_dtype(tc: TrainConfig) -> str:
    """tc.compute_dtype on this backend: "auto" is bfloat16 on TPU and GPU, float32 on CPU."""
    if tc.compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {tc.compute_dtype!r}")
    if tc.compute_dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return tc.compute_dtype


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and linear decay to zero over tc.steps updates, global-norm clipping
    (the reference's values by default). Gradient accumulation is the step's (`make_step`)."""
    sched = optax.join_schedules([optax.linear_schedule(0.0, tc.lr, max(tc.warmup, 1)),
                                  optax.linear_schedule(tc.lr, 0.0, max(tc.steps - tc.warmup, 1))], [tc.warmup])
    opt = optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(sched, weight_decay=tc.weight_decay))
    return opt


def loss_fn(cfg, spec: Spec, tc: TrainConfig):
    """The method's loss with its settings bound: (trainable, frozen, target, batch, keys) -> (loss sum,
    metric sums): `psm_loss`, or `eagle3.eagle3_loss` unrolling tc.ttt_steps draft steps."""
    if isinstance(spec, Eagle3Config):
        return functools.partial(eagle3.eagle3_loss, cfg=cfg, spec=spec, tau=tc.tau, steps=tc.ttt_steps)
    return functools.partial(psm_loss, cfg=cfg, spec=spec, tau=tc.tau, fill_accept=tc.fill_accept,
                             hard_weight=tc.hard_weight)


def frozen_axes(cfg, spec: Spec) -> dict:
    """The logical axes of the frozen variables `split_params` leaves (the shared head, vocabulary ids)."""
    axes = eagle3.eagle3_axes(cfg, spec) if isinstance(spec, Eagle3Config) else psm_axes(cfg, spec)
    return split_params(axes)[1]


def make_step(cfg, spec: Spec, tc: TrainConfig, opt, mesh, loss=None):
    """-> step(state, frozen, target, batch) -> (state, metrics): one optimiser update; state = {params,
    opt, step} with step counting updates. batch: a batch dict, or a sequence of tc.grad_accum of them
    (one update's micro-batches, in order).

    loss(trainable, frozen, target, batch, keys) -> (loss sum over the batch, sums) is the method's
    (default `loss_fn(cfg, spec, tc)`); sums: kl_sum, positions (the normaliser: the gradient and the
    logged loss are per position), agree_sum with agree_positions (its denominator; default positions),
    optionally agree_by_step / positions_by_step (per unrolled draft step). Logged `positions` are the
    update's response positions (its masks), whatever the method, so runs compare at equal data.

    One program over the `data x model` mesh, partitioned by XLA (GSPMD) from the shardings of its
    inputs under `TRAIN_RULES`: the batch is split over `data`; the frozen target is split over `model`
    as tensor-parallel decoding splits it (heads, MLP columns, vocabulary), so a device holds 1/M of
    it; the PSM's trained weights and optimizer state are replicated (a few layers: small next to the
    target). The loss is the mean over the update's response positions, so the gradient all-reduce over
    `data` and the matmul all-reduces over `model` are XLA's, and every device applies the same update.
    With grad_accum > 1 the micro-batches' gradient and metric sums are added up (two compiled programs
    per bucket pair, the first micro-batch's and the others', the accumulator donated) before one
    division and one update: the update a batch of grad_accum x batch_size sequences would take, with
    the same random fills per sequence where the micro-batches pad to that batch's bucket (`deal_fills`
    deals a sequence's fills over its query slots, whose count follows the bucket).

    Known limit: on XLA:CPU host devices, a Qwen3.5 (Gated DeltaNet) target on a mesh with both axes
    above 1 (e.g. 4x2) stalls in XLA:CPU's collectives (re-checked with this GSPMD step; the same
    program on 8x1 and 1x1, and Llama on 4x2, run); tests/test_train_loop.py keeps that case out.
    The PSM's frozen head follows the same rules (a full-vocabulary head split over `model` like the
    target's; a draft vocabulary's rows replicated)."""
    grad_fn = jax.value_and_grad(loss or loss_fn(cfg, spec, tc), has_aux=True)

    def micro_sums(params, frozen, target, batch, step, micro):
        """-> (gradient sums, metric sums) of one micro-batch of the update `step`."""
        B = batch["tokens"].shape[0]
        base = jax.random.fold_in(jax.random.key(tc.seed), step)
        # one key per sequence of the update's batch (micro-batches in order): the loss does not depend
        # on how the batch is split, over devices or into micro-batches
        keys = jax.vmap(lambda i: jax.random.fold_in(base, micro * B + i))(jnp.arange(B))
        (_, sums), grads = grad_fn(params, frozen, target, batch, keys)
        return grads, dict(sums, mask_positions=jnp.sum(batch["mask"], dtype=jnp.float32))

    def update(state, grads, sums):
        count = jnp.maximum(sums["positions"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        agree_count = jnp.maximum(sums.get("agree_positions", sums["positions"]), 1.0)
        metrics = dict(loss=sums["kl_sum"] / count, agreement=sums["agree_sum"] / agree_count,
                       positions=sums["mask_positions"], grad_norm=optax.tree.norm(grads))
        if "agree_by_step" in sums:
            metrics["agreement_by_step"] = sums["agree_by_step"] / jnp.maximum(sums["positions_by_step"], 1.0)
        return dict(params=params, opt=opt_state, step=state["step"] + 1), metrics

    rep = NamedSharding(mesh, P())
    frozen_s = tree_shardings(frozen_axes(cfg, spec), mesh, TRAIN_RULES, schema.axis_units(cfg))
    target_s, batch_s = target_shardings(cfg, mesh), batch_sharding(mesh)

    def _batches(batch) -> list:
        micro = [batch] if isinstance(batch, dict) else list(batch)
        if len(micro) != tc.grad_accum:
            raise ValueError(f"an update takes grad_accum={tc.grad_accum} micro-batches, got {len(micro)}")
        return micro

    if tc.grad_accum == 1:  # one program: gradient, update and metrics fused, the state donated
        fused = jax.jit(lambda state, frozen, target, batch: update(
            state, *micro_sums(state["params"], frozen, target, batch, state["step"], 0)),
            in_shardings=(rep, frozen_s, target_s, batch_s), out_shardings=(rep, rep), donate_argnums=(0,))
        return lambda state, frozen, target, batch: fused(state, frozen, target, *_batches(batch))

    def add(acc, params, frozen, target, batch, step, micro):
        sums = micro_sums(params, frozen, target, batch, step, micro)
        return sums if acc is None else jax.tree.map(jnp.add, acc, sums)  # None: the first micro-batch

    accumulate = jax.jit(add, in_shardings=(rep, rep, frozen_s, target_s, batch_s, rep, rep), out_shardings=rep,
                         donate_argnums=(0,))
    apply = jax.jit(lambda state, acc: update(state, *acc), in_shardings=(rep, rep), out_shardings=(rep, rep),
                    donate_argnums=(0,))

    def step(state, frozen, target, batch):
        acc = None
        for micro, b in enumerate(_batches(batch)):
            acc = accumulate(acc, state["params"], frozen, target, b, state["step"], jnp.int32(micro))
        return apply(state, acc)

    return step


def make_teacher(cfg, spec: PSMConfig, mesh):
    """-> jitted (target, tokens [B, T]) -> (anchor states [B, T, m, H], last hidden [B, T, H]): the
    teacher forward `psm_loss` runs, alone, for the teacher cache; sharded like the step's inputs."""
    return jax.jit(lambda target, tokens: teacher_states(target, tokens, cfg, spec.anchors),
                   in_shardings=(target_shardings(cfg, mesh), batch_sharding(mesh)),
                   out_shardings=batch_sharding(mesh))


def target_shardings(cfg, mesh) -> dict:
    """The frozen target's leaf shardings on the training mesh (`model`-split under TRAIN_RULES)."""
    return tree_shardings(schema.param_axes(cfg), mesh, TRAIN_RULES, schema.axis_units(cfg))


def batch_sharding(mesh) -> NamedSharding:
    """Batches [B, T]: the "batch" logical axis split over `data`."""
    return NamedSharding(mesh, logical_spec(("batch",), TRAIN_RULES))


def init_state(model, spec: Spec, tc: TrainConfig, opt, vocab_ids=None) -> tuple[dict, dict]:
    """-> (state {params, opt, step}, frozen variables) of a new run: the drafter's initial weights (or
    tc.init_from's), their optimiser state, step 0."""
    if isinstance(spec, Eagle3Config):
        variables = eagle3.init_eagle3(model.config, spec, model.params, seed=tc.seed, vocab_ids=vocab_ids)
        if tc.init_from:  # its trained weights; the head is the target's (frozen) at this run's vocabulary
            _, warm = eagle3.load_eagle3(tc.init_from, model.config, model.params, jnp.float32, spec.layers,
                                         target_weights=model.weights_fingerprint, model_name=str(model.path))
            for k, w in warm["params"].items():
                if k != "lm_head":
                    variables["params"][k] = jax.tree.map(lambda a: jnp.array(a, copy=True), w)
        trainable, frozen = split_params(variables)
        return dict(params=trainable, opt=opt.init(trainable), step=jnp.int32(0)), frozen
    variables = init_psm(model.config, spec, model.params, seed=tc.seed,
                         layers_from_target=tc.layers_from_target, vocab_ids=vocab_ids)
    if tc.init_from:  # its trained weights; the head is the target's (frozen) at this run's vocabulary
        from spd_jax.drafters.psm import load_psm, read_spec

        was = read_spec(tc.init_from)
        if was.num_layers != spec.num_layers:
            raise ValueError(f"init_from {tc.init_from} has {was.num_layers} PSM layers, this run {spec.num_layers}; "
                             f"set psm_layers={was.num_layers}")
        if was.m != spec.m:
            raise ValueError(f"init_from {tc.init_from} reads {was.m} anchors {list(was.anchors)}, this run "
                             f"{spec.m} {list(spec.anchors)}: its projections do not fit; set anchors="
                             f"{','.join(map(str, was.anchors))} or start without init_from")
        if (was.plan, was.anchors) != (spec.plan, spec.anchors):
            # A PSM for another n is still a warm start of the same shapes: the layers, the head and the
            # embedding-only projection (the drafting row's) mean the same; the staircase and what the
            # deeper anchors hold change, and training adapts them.
            log.warning("init_from %s was trained for n=%d (plan %s, anchors %s); this run is n=%d (plan %s, "
                        "anchors %s): a warm start only", tc.init_from, was.n, list(was.plan), list(was.anchors),
                        spec.n, list(spec.plan), list(spec.anchors))
        # the target (model) is still checked: another model's PSM is refused
        was, warm = load_psm(tc.init_from, model.config, was.plan, model.params, jnp.float32, was.anchors,
                             target_weights=model.weights_fingerprint, model_name=str(model.path))
        for k, w in warm["params"].items():
            if k != "lm_head":
                # copies (training donates its buffers); proj_a are {kernel} dicts
                variables["params"][k] = jax.tree.map(lambda a: jnp.array(a, copy=True), w)
    trainable, frozen = split_params(variables)
    return dict(params=trainable, opt=opt.init(trainable), step=jnp.int32(0)), frozen


def warm_start_record(init_from: str | Path) -> dict[str, Any]:
    """What init_from held when a run started from it: its path and its exported drafter's training
    facts (method, steps, positions; a PSM's plan and anchors; its own warm start, so a chain of warm
    starts stays whole). Runs and their exports keep this record rather than re-read the directory,
    which may later hold another drafter (a longer-trained PSM shipped in its place)."""
    path = Path(init_from)
    meta_file = next((path / f for f in ("psm.json", "eagle3.json") if (path / f).is_file()), None)
    if meta_file is None:
        raise FileNotFoundError(f"init_from {init_from}: no psm.json or eagle3.json there (give a directory "
                                "train.main exported, e.g. runs/NAME/psm or spd_jax/psms/...)")
    meta = json.loads(meta_file.read_text())
    trained = meta.get("trained", {})
    rec: dict[str, Any] = dict(path=str(init_from),
                               **{k: trained[k] for k in ("method", "steps", "positions") if k in trained})
    rec.update({k: meta[k] for k in ("plan", "anchors") if k in meta})
    if "warm_start" in trained:
        rec["warm_start"] = trained["warm_start"]
    return rec


def lineage_positions(warm_start: dict | None) -> int:
    """Training positions of a warm-start chain (`warm_start_record`), summed down the chain."""
    total = 0
    while warm_start:
        total += int(warm_start.get("positions", 0))
        warm_start = warm_start.get("warm_start")
    return total


# ---------------------------------------------------------------- checkpoints

class Checkpoints:
    """Periodic, atomic orbax checkpoints of the training state (params, optimiser, step) plus a JSON
    record of the run; keeps the last `keep`. A save killed midway leaves only a temporary directory,
    which orbax ignores, so a resume continues from the previous good step."""

    def __init__(self, directory: Path, tc: TrainConfig):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.mngr = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=tc.keep, save_interval_steps=1,
                                                 enable_async_checkpointing=False))

    def latest(self) -> int | None:
        return self.mngr.latest_step()

    def all_steps(self) -> list[int]:
        """The kept checkpoints' steps, ascending."""
        return sorted(self.mngr.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        a = self.ocp.args
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)), force=True)
        self.mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """The state and meta saved at step; a checkpoint that does not read (a damaged file: a run killed
        mid-save never finalises one, so this is damage after the save) raises ValueError naming it and the
        step kept before it, which a resume reaches once it is moved aside. One holding another state tree
        (another version's) is told apart: nothing to move, only the version to match."""
        from spd_jax.drafters.store import orbax_failure, quiet_abandoned_reads

        a = self.ocp.args
        quiet_abandoned_reads()
        try:
            out = self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(abstract_state),
                                                           meta=a.JsonRestore()))
        except Exception as e:  # noqa: BLE001 -- orbax raises bare Exception for a file it cannot read
            where = Path(self.mngr.directory) / str(step)
            earlier = [k for k in self.all_steps() if k < step]
            aside = (f"move it aside (mv {where} {where}.damaged) to resume from step {earlier[-1]}, the one before "
                     f"it, or --export {earlier[-1]}" if earlier else
                     "no earlier checkpoint is kept: train a new run with another --out")
            if isinstance(e, ValueError):  # orbax: a stored tree or shapes other than this state's
                raise ValueError(f"checkpoint {where} does not match the state this code builds ({orbax_failure(e)}): "
                                 "written by another version of spd-jax or optax, or its metadata is damaged. Do not "
                                 "delete it: resume it with the version that wrote it; if that is this one, "
                                 f"{aside}") from e
            raise ValueError(f"checkpoint {where} does not read ({orbax_failure(e)}): it is damaged; {aside}") from e
        return out["state"], out["meta"]


def run_identity(model, spec: Spec, tc: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed or used: the method, the drafter's spec, the target."""
    if isinstance(spec, Eagle3Config):
        return dict(method="eagle3", spec=eagle3.spec_to_json(spec), model=str(model.path))
    from spd_jax.drafters.psm import spec_to_json

    return dict(method="psm", spec=spec_to_json(spec), model=str(model.path), psm_layers=tc.psm_layers)


def check_resume(was: dict, identity: dict) -> None:
    """Refuse to resume a run (`was`: the identity its run.json holds) as another one (`identity`, as
    JSON): another method, drafter spec or target raises ValueError naming both. Runs written before
    the method switch trained a PSM; PSM specs written before a field existed have its default."""
    was = dict(was)
    was.setdefault("method", "psm")
    if was["method"] != identity["method"]:
        raise ValueError(f"it trained method {was['method']!r}; this config trains method {identity['method']!r} "
                         "(set method=... to match, or use a new --out)")
    if was["method"] == "psm":
        from spd_jax.drafters.psm import spec_from_json, spec_to_json

        was["spec"] = json.loads(json.dumps(spec_to_json(spec_from_json(was["spec"]))))
    if was != identity:
        def flat(d, pre=""):
            return {k2: v2 for k, v in d.items()
                    for k2, v2 in (flat(v, f"{pre}{k}.").items() if isinstance(v, dict) else [(pre + k, v)])}
        a, b = flat(was), flat(identity)
        diff = [f"{k}: run {a.get(k)!r}, this config {b.get(k)!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise ValueError(f"it was trained for another drafter or target ({'; '.join(diff)}); set the config to match "
                         "or use a new --out")


# What decides a run's data and its order: a resume must keep them, or "continues with the same data
# position" (and train.heldout's check that a run never saw its held-out conversations) would not hold.
DATA_KEYS = ("sources", "skip", "limit", "prompt_pattern", "max_len", "responses", "replies", "heldout", "seed",
             "batch_size", "grad_accum")


def check_same_data(was: dict, tc: TrainConfig) -> None:
    """Refuse to resume a run (`was`: the config its run.json holds) with other data keys (DATA_KEYS)."""
    old = TrainConfig.from_dict(was)
    changed = [k for k in DATA_KEYS if getattr(old, k) != getattr(tc, k)]
    if changed:
        raise ValueError("it trained with " + ", ".join(f"{k}={getattr(old, k)!r}" for k in changed) + ", this command "
                         "sets " + ", ".join(f"{k}={getattr(tc, k)!r}" for k in changed) + ": a resume keeps the run's "
                         "data and its order (drop those overrides, or train a new run with --out)")


def save_drafter(path: Path, variables: dict, spec: Spec, extra: dict) -> None:
    """Export trained variables to a new directory without the LM head (the target's, shared, which the
    loaders put back: "head": "shared"), with `extra` facts (training provenance) in its JSON: a PSM
    through `save_psm`, an EAGLE-3 drafter through `eagle3.save_eagle3`."""
    variables = {**variables, "params": {k: v for k, v in variables["params"].items() if k != "lm_head"}}
    extra = dict(extra, head="shared")
    if isinstance(spec, Eagle3Config):
        eagle3.save_eagle3(path, variables, spec, extra)
    else:
        from spd_jax.drafters.psm import save_psm

        save_psm(path, variables, spec, extra)


# ---------------------------------------------------------------- quick eval and curves

def eval_prompts(heldout: list, tc: TrainConfig, max_prompt: int = 120) -> list[np.ndarray]:
    """First-turn prompts of held-out conversations (up to the assistant header), short ones first so
    the engine compiles for few prompt buckets."""
    out = []
    for ids, mask in heldout:
        first = int(np.argmax(mask))  # mask[t]: t + 1 is the response's first token
        if mask[first] and first + 1 <= max_prompt:
            out.append(ids[:first + 1])
    return out[:tc.eval_prompts]


def eval_metric(spec: Spec) -> str:
    """The quick eval's headline figure: S0 (PSM) or tokens_per_round (EAGLE-3: tokens per target pass)."""
    return "tokens_per_round" if isinstance(spec, Eagle3Config) else "S0"


def quick_eval(model, spec: Spec, variables: dict, prompts: list[np.ndarray], tc: TrainConfig) -> dict:
    """Greedy decoding with the drafter on the held-out prompts, pooled over them as sum / sum (the
    paper's convention). PSM: alpha and S0 of SPD at its n (sum(tokens) / sum(cycles)). EAGLE-3:
    tokens_per_round of chain decoding with k = tc.eval_k on one device (sum(tokens) / sum(rounds):
    tokens per target pass, its S0)."""
    import spd_jax

    if not prompts:
        return {}
    if isinstance(spec, Eagle3Config):
        from spd_jax.distributed import to_host

        # the state is replicated over the training mesh; the chain runs on this process's default device
        local = jax.tree.map(lambda a: jnp.asarray(to_host(a)), variables)
        tokens = rounds = 0
        for ids in prompts:
            res = spd_jax.generate(model, ids, tc.eval_tokens, method="eagle3", k=tc.eval_k, drafter_spec=(spec, local),
                                   stop_at_eos=False)
            tokens += res.stats["tokens"]
            rounds += res.stats["rounds"]
        return dict(tokens_per_round=tokens / rounds if rounds else float("nan"), eval_tokens=tokens,
                    eval_rounds=rounds, eval_k=tc.eval_k)
    tokens = cycles = 0
    for ids in prompts:
        res = spd_jax.generate(model, ids, tc.eval_tokens, method="spd", n=spec.n, stage_layers=spec.plan,
                               spec=(spec, variables), stop_at_eos=False)
        tokens += res.stats["tokens"]
        cycles += res.stats["cycles"]
    alpha = tokens / cycles
    return dict(alpha=alpha, S0=alpha * sum(spec.plan) / max(spec.plan), eval_tokens=tokens, eval_cycles=cycles)


def positions_axis(ax) -> None:
    """Training positions on ax's x axis as 50k, 1.5M, 2B (full numbers overlap at the plots' widths)."""
    from matplotlib.ticker import FuncFormatter

    def short(x, _):
        scale, suffix = next(((s, u) for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "k")) if abs(x) >= s), (1, ""))
        return f"{x / scale:g}{suffix}"

    ax.xaxis.set_major_formatter(FuncFormatter(short))
    if ax.get_xscale() == "log":  # within one decade only minor ticks fall in range: label a few of them
        from matplotlib.ticker import LogLocator

        ax.xaxis.set_minor_locator(LogLocator(subs=(2, 3, 5)))
        ax.xaxis.set_minor_formatter(FuncFormatter(short))


def plot_curves(metrics_path: Path, png: Path) -> None:
    """Loss, agreement and the quick eval (S0, or an EAGLE-3 drafter's tokens per round) against
    training positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(r) for r in Path(metrics_path).read_text().splitlines() if r.strip()]
    if not rows:
        return
    pos = [r["positions"] for r in rows]
    chain = any("tokens_per_round" in r or "agreement_by_step" in r for r in rows)
    key = "tokens_per_round" if chain else "S0"
    ev = [r for r in rows if key in r]
    # a run without a quick eval (fewer devices than stages, or none fell due) gets no empty third panel
    fig, ax = plt.subplots(1, 3 if ev else 2, figsize=(13, 3.6) if ev else (9, 3.6))
    ax[0].plot(pos, [r["loss"] for r in rows])
    ax[0].set(title="KL(teacher || drafter) per unrolled step" if chain else "KL(teacher || PSM)",
              xlabel="training positions", yscale="log")
    ax[1].plot(pos, [r["agreement"] for r in rows])
    ax[1].set(title="top-1 agreement (train, 1st draft step)" if chain else "top-1 agreement (train batches)",
              xlabel="training positions")
    if ev:
        ax[2].plot([r["positions"] for r in ev], [r[key] for r in ev], "o-")
        ax[2].set(title=f"tokens/round, chain k={ev[0].get('eval_k', '?')}, held-out (greedy)" if chain
                  else "S0 on held-out prompts (greedy)", xlabel="training positions")
    for a in ax:
        a.grid(alpha=0.3)
        positions_axis(a)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
