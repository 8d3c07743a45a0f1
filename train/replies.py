"""The target's own replies at scale: a drafter-training corpus that its manifest regenerates exactly.

    python -m train.replies --out DIR [--sources gsm8k,sharegpt] [--samples 2] [--max-len 512]
                            [--batch 32] [--limit N] [--weights-dtype float32] [--chunks K]
                            [--start-chunk C] [--minutes M] [--group G]
    python -m train.replies --out DIR --verify I        # regenerate chunk I and compare its digest

A drafter is judged on the target's own continuations, and the one lever measured to help on the CPU is
training on them (docs/train/smollm2-n8-ablations). Prompts: every user turn of the training sources with
the context before it (earlier turns as the dataset has them), through the chat template with the
generation prompt, keeping those that leave at least MIN_ROOM tokens of max_len; duplicates are dropped,
and so is every conversation of the held-out range (`--heldout`, default conversations 400 .. 499 of
each source, the range `train.heldout` scores on) with any prompt repeating one of its first turns.
MT-Bench, GSM8K test and HumanEval are never sources. Prompts are taken in one seeded random order, so
any prefix of the work is a sample of all of it.

Each prompt gets the greedy reply (sample 0) and --samples replies at T = 1, top-k 50, top-p 0.95, each
seeded by (seed, prompt index, sample) so a reply does not depend on the batch it ran in; a reply ends
after EOS or at max_len tokens in all. Work goes in chunks of --chunk prompts, each written atomically
when done (`chunk-NNNNN.npz`), so a killed run resumes at the first missing chunk: run it under `nice` in
the background and start it again until done. --group chunks run together, their prompts sorted by length
into batches of --batch (every row of a batch reads its cache from slot 0 up to the batch's longest prompt
plus the reply so far, so mixing lengths costs decode time; docs/train/replies.md). manifest.json holds what
regenerates the corpus: the settings, the model (weights fingerprint, chat-template digest), the prompt
list's digest, and per chunk its sequences, response positions, the code identity that made it (digest of
the modules that compute a token, jax version, backend), the group it was made with and a digest of its
tokens, which `--verify` checks by regenerating the group. Greedy and sampled tokens can differ between
machines after a near tie: the digests hold for the machine kind (and batch) that wrote them.

Chunks are small (compressed, uint16 token ids where the vocabulary fits: about 1.3 bytes a token), so a
corpus made on CPUs over many sessions can live in git: `prompts.npz` (tens of MB) may be left out, and a
resume re-derives the prompt list from the sources and checks it against the manifest's digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import jax
import numpy as np

import spd_jax
from spd_jax.progress import progress_bar
from train import data

log = logging.getLogger("train.replies")

MIN_ROOM = 16  # a prompt is answered only if it leaves at least this many tokens of max_len
TOP_K, TOP_P = 50, 0.95  # the sampled replies' filter (T = 1)
READERS = {"gsm8k": data.gsm8k_conversations, "sharegpt": data.read_sharegpt}
# Corpora kept in git (manifest and chunks): CPU sessions add chunks to them, one resume at a time.
REPO_REPLIES = Path(__file__).resolve().parents[1] / "data" / "replies"
# The modules whose code decides a token: their digest is each chunk's code identity.
CODE = ("spd_jax/api.py", "spd_jax/decode/ar.py", "spd_jax/decode/sampling.py", "spd_jax/models/decoder.py",
        "spd_jax/models/attention.py", "spd_jax/models/layers.py", "spd_jax/models/deltanet.py",
        "spd_jax/models/kinds.py", "train/replies.py")
SETTINGS = ("sources", "samples", "max_len", "batch", "chunk", "seed", "weights_dtype", "heldout", "limit")


def chat_ids(model, msgs: list[dict]) -> np.ndarray:
    """Chat messages ending with a user turn -> the template's ids with the generation prompt [T] int32."""
    out = model.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return np.asarray(out["input_ids"] if hasattr(out, "keys") else out, np.int32)


def turn_prompts(model, msgs: list[dict], max_len: int) -> list[np.ndarray]:
    """A conversation -> the prompt of each user turn, its context before it (earlier turns as the dataset
    has them) through the chat template [T_t] int32, up to the first that leaves under MIN_ROOM tokens of
    max_len (later ones only grow)."""
    out = []
    for t in range(0, len(msgs), 2):
        ids = chat_ids(model, msgs[:t + 1])
        if len(ids) > max_len - MIN_ROOM:
            break
        out.append(ids)
    return out


def enumerate_prompts(model, sources: list[str], max_len: int, heldout: tuple[int, int],
                      limit: int | None = None) -> tuple[list[str], list[np.ndarray]]:
    """-> (names "source:conversation:turn", prompts [T_i] int32): every user turn of each source's
    conversations (the first `limit` of each, all without) with its context, in source order; a
    conversation stops at its first turn past max_len - MIN_ROOM (later ones only grow)."""
    names, prompts, seen, held = [], [], set(), set()
    for src in sources:
        if src not in READERS:
            raise ValueError(f"unknown source {src!r}; known: {sorted(READERS)}")
        for c, msgs in enumerate(READERS[src]()):
            if limit is not None and c >= limit:
                break
            if heldout[0] <= c < heldout[1]:
                held.add(chat_ids(model, msgs[:1]).tobytes())
                continue
            for t, ids in enumerate(turn_prompts(model, msgs, max_len)):
                if ids.tobytes() not in seen:
                    seen.add(ids.tobytes())
                    names.append(f"{src}:{c}:{t}")
                    prompts.append(ids)
    keep = [i for i, p in enumerate(prompts) if p.tobytes() not in held]
    return [names[i] for i in keep], [prompts[i] for i in keep]


def code_identity() -> dict:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in CODE:
        h.update((root / rel).read_bytes())
    return dict(code=h.hexdigest()[:16], jax=jax.__version__, backend=jax.default_backend())


def tokens_digest(seqs: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(np.asarray(s, np.int32).tobytes() + b"|")
    return h.hexdigest()[:16]


def unit_seed(seed: int, prompt: int, sample: int, samples: int) -> int:
    return (seed + prompt * (samples + 1) + sample) % 2**32


def generate_chunks(model, prompts: list[np.ndarray], indices: list[np.ndarray], s: dict) -> list[dict]:
    """The replies of prompts[index] for each index (a chunk's prompts; greedy, then s["samples"] sampled
    each) -> each chunk's arrays: ids (sequences concatenated), offsets, prompt_len, prompt (index into the
    prompt list), sample. The chunks' prompts run together, sorted by length into batches of s["batch"]:
    every row of a batch reads the cache up to its longest prompt's end, so prompts of one length share batches."""
    units = [(int(p), k) for k in range(s["samples"] + 1) for index in indices for p in index]
    seqs: dict[tuple[int, int], np.ndarray] = {}
    for greedy in (True, False):
        todo = sorted((u for u in units if (u[1] == 0) == greedy), key=lambda u: (len(prompts[u[0]]), u))
        for a in range(0, len(todo), s["batch"]):
            batch = todo[a:a + s["batch"]]
            sample = {} if greedy else dict(temperature=1.0, top_k=TOP_K, top_p=TOP_P,
                                            seed=[unit_seed(s["seed"], p, k, s["samples"]) for p, k in batch])
            out = spd_jax.generate_batch(model, [prompts[p] for p, _ in batch], s["max_len"],
                                         weights_dtype=s["weights_dtype"], **sample)
            for (p, k), g in zip(batch, out):
                seqs[(p, k)] = np.concatenate([prompts[p], np.asarray(g, np.int32)])
    chunks = []
    for index in indices:
        mine = set(index.tolist())
        order = sorted(u for u in seqs if u[0] in mine)
        full = [seqs[u] for u in order]
        chunks.append(dict(ids=np.concatenate(full), offsets=np.cumsum([0] + [len(x) for x in full]),
                           prompt_len=np.asarray([len(prompts[p]) for p, _ in order], np.int32),
                           prompt=np.asarray([p for p, _ in order], np.int64),
                           sample=np.asarray([k for _, k in order], np.int32)))
    return chunks


def chunk_record(arrays: dict) -> dict:
    off, plen = arrays["offsets"], arrays["prompt_len"]
    seqs = [arrays["ids"][a:b] for a, b in zip(off[:-1], off[1:])]
    replies = {(int(p), arrays["ids"][a + n:b].tobytes()): b - a - n
               for p, n, a, b in zip(arrays["prompt"], plen, off[:-1], off[1:])}
    return dict(sequences=len(seqs), positions=int(sum(len(x) for x in seqs) - plen.sum()),
                unique_positions=int(sum(replies.values())), digest=tokens_digest(seqs))


def load_chunk(source) -> dict:
    """A chunk file (a path or file object) -> its arrays, ids as int32 whatever they were stored as."""
    with np.load(source, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["ids"] = arrays["ids"].astype(np.int32)
    return arrays


def check_chunk(arrays: dict, record: dict) -> bool:
    """Whether a chunk's arrays hold what its manifest record says (counts and token digest)."""
    got = chunk_record(arrays)
    return {k: record.get(k) for k in got} == got


def read_corpus(out: Path, chunks: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every chunk the manifest records of a replies corpus (or chunks 0 .. chunks-1, each of which must be
    recorded) -> [(ids [T], loss_mask [T])], loss_mask[t] where t + 1 is a reply token (the training
    corpus's form). A chunk file without a record (a run killed between the two writes) is not read: the
    next run writes it again."""
    out = Path(out)
    done = sorted(map(int, json.loads((out / "manifest.json").read_text())["chunks"]))
    if chunks is not None:
        missing = sorted(set(range(chunks)) - set(done))
        if missing:
            raise ValueError(f"replies_chunks={chunks}: chunks {missing[:5]}{'...' if len(missing) > 5 else ''} of "
                             f"{out} are not finished ({len(missing)} of {chunks}); let `python -m train.replies --out "
                             f"{out}` run, or ask for fewer")
        done = list(range(chunks))
    seqs = []
    for c in done:
        arrays = load_chunk(out / f"chunk-{c:05d}.npz")
        ids, off, plen = arrays["ids"], arrays["offsets"], arrays["prompt_len"]
        for a, b, n in zip(off[:-1], off[1:], plen):
            mask = np.zeros(b - a, bool)
            mask[n - 1:b - a - 1] = True
            seqs.append((ids[a:b], mask))
    return seqs


def training_corpus(model, out: Path, max_len: int, chunks: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The finished chunks of the corpus at out (or chunks 0 .. chunks-1) for training `model` at max_len ->
    `read_corpus`'s sequences; refused if the corpus is of another model or longer sequences, or holds no
    chunk yet. Without `chunks`, chunks finished later make a larger corpus: a run resumed after them would
    see other data."""
    out = Path(out).expanduser()
    path = out / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"replies={out}: no train.replies corpus there (no manifest.json); make one with "
                                f"`python -m train.replies --out {out}`")
    manifest = json.loads(path.read_text())
    if manifest["model"]["weights"] != model.weights_fingerprint:
        raise ValueError(f"replies={out} holds replies of {manifest['model']['model']} (weights "
                         f"{manifest['model']['weights']}), not of the model trained for ({model.path.name}, "
                         f"{model.weights_fingerprint})")
    if manifest["settings"]["max_len"] > max_len:
        raise ValueError(f"replies={out} holds sequences of up to {manifest['settings']['max_len']} tokens, over "
                         f"this run's max_len {max_len}: raise max_len or make a corpus with --max-len {max_len}")
    seqs = read_corpus(out, chunks)
    if not seqs:
        raise ValueError(f"replies={out} has no finished chunk yet: let `python -m train.replies --out {out}` run")
    return seqs


def save_manifest(out: Path, manifest: dict) -> None:
    data.write_atomic(out / "manifest.json", lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))


def open_corpus(model, out: Path, s: dict) -> tuple[dict, list[str], list[np.ndarray]]:
    """The manifest and prompt list of the corpus at out: read (refused if its settings or model differ
    from these) or made."""
    ident = dict(model=model.path.name, weights=model.weights_fingerprint,
                 chat_template=hashlib.sha256(str(getattr(model.tokenizer, "chat_template", None)).encode()).hexdigest()[:16])
    path = out / "manifest.json"
    if path.is_file():
        manifest = json.loads(path.read_text())
        was = {k: manifest["settings"].get(k) for k in SETTINGS}
        now = {k: s[k] for k in SETTINGS}
        diff = sorted(k for k in SETTINGS if json.dumps(was[k]) != json.dumps(now[k]))
        diff += sorted(k for k in ident if manifest["model"].get(k) != ident[k])
        if diff:
            then = {**manifest["model"], **manifest["settings"]}
            raise ValueError(f"{out} holds a corpus made with other {', '.join(diff)} ("
                             + ", ".join(f"{k}={then.get(k)!r}" for k in diff)
                             + "): give the same settings to resume it, or another --out")
        if not (out / "prompts.npz").is_file():  # a kept corpus (manifest and chunks): derive the list again
            names, prompts = enumerate_prompts(model, s["sources"], s["max_len"], tuple(s["heldout"]), s["limit"])
            if tokens_digest(prompts) != manifest["prompts"]["digest"]:
                raise ValueError(f"the prompts of {s['sources']} now differ from those {out} was made with "
                                 "(another dataset or chat template): resume it where it was made, or use another --out")
            write_prompts(out, names, prompts)
            return manifest, names, prompts
        with np.load(out / "prompts.npz", allow_pickle=False) as z:
            ids, off, names = z["ids"], z["offsets"], z["names"]
        prompts = [ids[a:b] for a, b in zip(off[:-1], off[1:])]
        if tokens_digest(prompts) != manifest["prompts"]["digest"]:
            raise ValueError(f"{out / 'prompts.npz'} does not match its manifest: delete it (the prompt list is "
                             "derived again) or start the corpus again")
        return manifest, [str(n) for n in names], prompts
    names, prompts = enumerate_prompts(model, s["sources"], s["max_len"], tuple(s["heldout"]), s["limit"])
    if not prompts:
        raise ValueError(f"no prompt of {s['sources']} fits max_len {s['max_len']}")
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(out, names, prompts)
    order = np.random.default_rng(s["seed"]).permutation(len(prompts))
    manifest = dict(settings=s, model=ident, prompts=dict(count=len(prompts), digest=tokens_digest(prompts),
                                                          order_seed=s["seed"]),
                    chunks={}, order=order.tolist())
    save_manifest(out, manifest)
    return manifest, names, prompts


def write_prompts(out: Path, names: list[str], prompts: list[np.ndarray]) -> None:
    data.write_atomic(out / "prompts.npz", lambda f: np.savez(
        f, ids=np.concatenate(prompts), offsets=np.cumsum([0] + [len(x) for x in prompts]),
        names=np.asarray(names)))


def compact(arrays: dict) -> dict:
    """A chunk's arrays as stored: token ids as uint16 where every id fits (read back as int32)."""
    ids = arrays["ids"]
    return dict(arrays, ids=ids.astype(np.uint16)) if ids.size and ids.max() < 2**16 and ids.min() >= 0 else arrays


def totals(manifest: dict) -> dict:
    c = manifest["chunks"].values()
    return dict(chunks_done=len(c), chunks_total=-(-manifest["prompts"]["count"] // manifest["settings"]["chunk"]),
                sequences=sum(x["sequences"] for x in c), positions=sum(x["positions"] for x in c),
                unique_positions=sum(x["unique_positions"] for x in c))


def run(model, out: Path, s: dict, chunks: int | None = None, show_progress: bool = True, start: int = 0,
        deadline: float | None = None, group: int = 1) -> dict:
    """Generate the missing chunks (at most `chunks` of them), from chunk `start` on (then wrapping round
    to the first: two machines filling one corpus start far apart), `group` chunks at a time (their
    prompts batched together by length, `generate_chunks`; a killed run loses the group), starting no
    group after `deadline` (a `time.time()`) -> the totals. Each chunk's record names its group, which
    `verify` regenerates: a reply depends on its batch only through the matmuls' summation order."""
    manifest, _, prompts = open_corpus(model, out, s)
    order = np.asarray(manifest["order"])
    total = totals(manifest)["chunks_total"]
    todo = [c % total for c in range(start, start + total) if str(c % total) not in manifest["chunks"]]
    todo = todo[:chunks] if chunks is not None else todo
    code = code_identity()
    bar = progress_bar(total=len(todo), desc="reply chunks", unit="chunk", disable=not show_progress)
    for g in range(0, len(todo), max(1, group)):
        if deadline is not None and time.time() > deadline:
            break
        cs = todo[g:g + max(1, group)]
        for c, arrays in zip(cs, generate_chunks(model, prompts, [chunk_prompts(order, s, c) for c in cs], s)):
            data.write_atomic(out / f"chunk-{c:05d}.npz", lambda f: np.savez_compressed(f, **compact(arrays)))
            manifest["chunks"][str(c)] = dict(chunk_record(arrays), **code, group=cs)
        save_manifest(out, manifest)
        bar.update(len(cs))
        bar.set_postfix(positions=totals(manifest)["positions"], refresh=False)
    bar.close()
    return totals(manifest)


def chunk_prompts(order: np.ndarray, s: dict, c: int) -> np.ndarray:
    """Chunk c's prompts: its slice of the corpus's seeded order."""
    return order[c * s["chunk"]:(c + 1) * s["chunk"]]


def verify(model, out: Path, s: dict, c: int) -> dict:
    """Regenerate chunk c, with the chunks it was made with (its record's group), and compare it with the
    manifest's record -> {recorded, regenerated, equal}."""
    manifest, _, prompts = open_corpus(model, out, s)
    if str(c) not in manifest["chunks"]:
        raise ValueError(f"chunk {c} of {out} is not done yet; done: {sorted(map(int, manifest['chunks']))[:10]}...")
    order = np.asarray(manifest["order"])
    was = manifest["chunks"][str(c)]
    cs = was.get("group", [c])
    if c not in cs:
        raise ValueError(f"chunk {c}'s record names the group {cs}, which does not hold it: the manifest is damaged")
    made = generate_chunks(model, prompts, [chunk_prompts(order, s, x) for x in cs], s)
    rec = chunk_record(made[cs.index(c)])
    return dict(chunk=c, recorded=was["digest"], regenerated=rec["digest"], equal=was["digest"] == rec["digest"],
                code_then=was["code"], code_now=code_identity()["code"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.replies", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=lambda p: Path(p).expanduser(),
                    help="the corpus directory (made, or resumed)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sources", default="gsm8k,sharegpt", help=f"comma-separated, of {sorted(READERS)}")
    ap.add_argument("--samples", type=int, default=2, help="T = 1 replies per prompt besides the greedy one")
    ap.add_argument("--max-len", type=int, default=512, help="tokens in all, prompt and reply")
    ap.add_argument("--batch", type=int, default=32, help="sequences per generated batch")
    ap.add_argument("--chunk", type=int, default=32, help="prompts per chunk file: what a killed run loses at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--heldout", default="400:500", help="conversations start:stop of each source kept out")
    ap.add_argument("--limit", type=int, help="only the first LIMIT conversations of each source")
    ap.add_argument("--chunks", type=int, help="stop after this many new chunks")
    ap.add_argument("--start-chunk", type=int, default=0, metavar="C",
                    help="begin at chunk C (then wrap round): another machine filling the same corpus starts far away")
    ap.add_argument("--minutes", type=float, help="start no new group of chunks after this many minutes")
    ap.add_argument("--group", type=int, default=4, metavar="G",
                    help="chunks generated together, their prompts batched by length (a killed run loses the group)")
    ap.add_argument("--verify", type=int, metavar="I", help="regenerate chunk I and compare it with the manifest")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        a, b = (int(x) for x in args.heldout.split(":"))
    except ValueError:
        ap.error(f"--heldout must be START:STOP (two integers), got {args.heldout!r}")
    for name in ("samples", "max_len", "batch", "chunk", "limit", "chunks", "group"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "samples" else 1):
            ap.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'samples' else 1}, got {v}")
    s = dict(sources=[x for x in args.sources.split(",") if x], samples=args.samples, max_len=args.max_len,
             batch=args.batch, chunk=args.chunk, seed=args.seed, weights_dtype=args.weights_dtype,
             heldout=[a, b], limit=args.limit)
    try:
        model = spd_jax.load_model(args.model)
        if args.verify is not None:
            print(json.dumps(verify(model, args.out, s, args.verify)))
            return 0
        deadline = None if args.minutes is None else time.time() + 60 * args.minutes
        print(json.dumps(dict(out=str(args.out), **run(model, args.out, s, args.chunks, start=args.start_chunk,
                                                       deadline=deadline, group=args.group))))
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
