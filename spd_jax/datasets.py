"""Where the data files are and how a benchmark's prompts are read: the lookups `infer`, `train` and
`bench` share (data_path, the benchmark files and their conventions, a JSONL record's prompt field).

Reads files only; tokenizes nothing and imports no JAX. Training corpora (ShareGPT, GSM8K train, the
target's replies) are train/'s, not this module's.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

REPO_DATA = Path(__file__).resolve().parents[1] / "data"

# name -> (file under the data folder, prefix of the prompt): the SPD reference's conventions (first turn,
# HumanEval prompts prefixed "Complete the code I provided.")
BENCHMARKS = {
    "mt_bench": ("mt_bench/question.jsonl", ""),
    "gsm8k": ("gsm8k/test.jsonl", ""),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "Complete the code I provided.\n"),
}
PROMPT_FIELDS = ("prompt", "text", "question", "turns")  # a JSONL record's prompt: the first of these it has


def data_roots() -> list[Path]:
    """Where data files are looked for: $SPD_JAX_DATA alone when set (read at each call, so it can
    change at run time), else the repository's data/."""
    env = os.environ.get("SPD_JAX_DATA")
    return [Path(env)] if env else [REPO_DATA]


def data_path(relative: str | Path, roots: list[Path] | None = None) -> Path:
    """The first existing roots[i] / relative (default roots: `data_roots()`), e.g. "gsm8k/train.jsonl"."""
    tried = [Path(r) / relative for r in (data_roots() if roots is None else roots)]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"data file {str(relative)!r} not found; looked for: {', '.join(map(str, tried))}. It ships in the "
        f"repository's data/ folder ({REPO_DATA}); restore it with `git checkout -- data`, or set "
        "SPD_JAX_DATA to a folder holding it.")


def prompt_field(obj: dict) -> str | None:
    """A JSONL record's prompt text: its first field among PROMPT_FIELDS (of `turns`, the first turn)."""
    for key in PROMPT_FIELDS:
        if key in obj:
            v = obj[key]
            return v[0] if isinstance(v, list) else v
    return None


def read_benchmark(name: str, limit: int | None = None) -> list[dict]:
    """A benchmark's first-turn prompts: [{"text": str} or {"ids": [int]}], at most `limit`. `name`: one of
    BENCHMARKS, or a JSONL file whose lines hold a prompt field (PROMPT_FIELDS) or `prompt_ids`."""
    if name in BENCHMARKS:
        rel, prefix = BENCHMARKS[name]
        path = data_path(rel)
    else:
        path, prefix = Path(name), ""
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {name!r} is neither a known one ({', '.join(BENCHMARKS)}) nor a "
                                    "JSONL file")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not a JSON object: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n} is not a JSON object (a benchmark line holds one prompt's fields)")
            if "prompt_ids" in obj:
                out.append({"ids": [int(t) for t in obj["prompt_ids"]]})
            elif (text := prompt_field(obj)) is not None:
                out.append({"text": prefix + text})
            else:
                raise ValueError(f"{path}:{n} has none of the fields {', '.join(PROMPT_FIELDS)}, prompt_ids")
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"benchmark {name} ({path}) holds no prompts")
    return out
