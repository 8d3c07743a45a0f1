"""The cost model's projections as one markdown page: the calibration, the profiles, `spd` against `ar`
and `tp` for SmolLM2-135M-Instruct and Qwen3.5-4B at n = 2, 4, 8, the sensitivity to the per-layer cost and
the collective latency, the chain baseline (`spd_jax.reports.projections`).

    python -m bench.projections [--out docs/projections.md]

Numbers from published hardware figures, not measurements; nothing is compiled or run on a device.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from spd_jax.reports.projections import projections_markdown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.projections", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the page here (default: print it)")
    args = ap.parse_args(argv)
    text = projections_markdown()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
