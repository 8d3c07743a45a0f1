"""Progress bars for long work, on a terminal and in a log file alike."""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_S = 60.0  # off a terminal: a bar line at most this often


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """`tqdm(iterable, **kwargs)`; when stderr is not a terminal (a log file, CI, a background job) it
    redraws at most once a minute, since every redraw there is a new line in the log (callers that set a
    postfix each step pass refresh=False)."""
    if not sys.stderr.isatty():  # tqdm's monitor thread also forces a redraw every maxinterval
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("maxinterval", LOG_INTERVAL_S)
    return tqdm(iterable, **kwargs)
