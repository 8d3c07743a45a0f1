"""A small LRU of ahead-of-time compiled executables.

Compiling ahead of time lets callers report compile time apart from run time. The cache is bounded
because every live XLA executable holds JIT code mappings: a long-lived process (a server, a test
suite) that kept them all would eventually exhaust the kernel's memory-map limit.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable


class CompileCache:
    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.compiles = 0  # how many compilations this cache has run

    def get(self, key: tuple, lower: Callable[[], Any]) -> tuple[Any, float]:
        """-> (executable, seconds spent compiling it now: 0.0 on a hit). lower() returns a Lowered."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], 0.0
        t0 = time.perf_counter()
        exe = lower().compile()
        self.compiles += 1
        seconds = time.perf_counter() - t0
        self._entries[key] = exe
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return exe, seconds

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries
