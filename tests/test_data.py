"""The data the project reads ships in the repository, byte for byte what data/README.md lists."""

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from spd_jax.datasets import REPO_DATA, data_path

ROWS = re.compile(r"^\| `([^`]+)` \|.*\| (\d+) \|.*\| `([0-9a-f]{64})` \|$", re.M)


def listed() -> list[tuple[str, int, str]]:
    rows = [(f, int(n), h) for f, n, h in ROWS.findall((REPO_DATA / "README.md").read_text())]
    assert len(rows) == 4, rows
    return rows


@pytest.mark.parametrize("name,rows,sha256", listed())
def test_data_files_match_their_checksums(name, rows, sha256):
    path = REPO_DATA / name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256, f"{path} differs from data/README.md"
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        assert sum(1 for line in f if json.loads(line)) == rows


def test_every_data_file_is_listed():
    # data/replies holds generated corpora, each checked against its own manifest (tests/test_replies.py)
    files = {p.relative_to(REPO_DATA).as_posix() for p in REPO_DATA.rglob("*")
             if p.is_file() and p.relative_to(REPO_DATA).parts[0] != "replies"} - {"README.md"}
    assert files == {name for name, _, _ in listed()}


def test_the_repository_copy_is_found_first(monkeypatch):
    monkeypatch.delenv("SPD_JAX_DATA", raising=False)
    assert data_path("gsm8k/train.jsonl") == REPO_DATA / "gsm8k" / "train.jsonl"
    assert Path(REPO_DATA).parent == Path(__file__).resolve().parents[1]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from train.data import write_atomic
    path = tmp_path / "f.json"
    write_atomic(path, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, broken)
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]
