"""Progress bars for long work, on a terminal and in a log file alike."""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_S = 60.0  # off a terminal: a bar line at most this often


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """`tqdm(iterable, **kwargs)`; when stderr is not a terminal (a log file, CI, a background job) it
    redraws at most once a minute, since every redraw there is a new line in the log."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(iterable, **kwargs)
