"""Compiled executables: a small in-process LRU, and JAX's persistent cache across processes.

Compiling ahead of time lets callers report compile time apart from run time. The LRU is bounded
because every live XLA executable holds JIT code mappings: a long-lived process (a server, a test
suite) that kept them all would eventually exhaust the kernel's memory-map limit. The persistent
cache (`enable_persistent_cache`, on in the CLIs) lets a second process with the same shapes load
executables from disk instead of compiling them; `compile_source` says which happened.
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any, Callable

from jax import monitoring

_EVENTS: collections.Counter = collections.Counter()  # persistent-cache hits and misses in this process


def _listen(name: str, **_) -> None:
    if name in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
        _EVENTS[name.rsplit("/", 1)[1]] += 1


monitoring.register_event_listener(_listen)


def default_cache_dir() -> Path:
    """$SPD_JAX_CACHE/xla, else ~/.cache/spd_jax/xla."""
    return Path(os.environ.get("SPD_JAX_CACHE") or Path.home() / ".cache" / "spd_jax") / "xla"


def enable_persistent_cache(directory: str | Path | None = None, min_compile_s: float = 0.0) -> Path:
    """Turn on JAX's persistent compilation cache in `directory` (default `default_cache_dir()`) for
    every compilation that takes at least min_compile_s. Call before the first compilation."""
    import jax

    path = Path(directory) if directory is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _compile(lower: Callable[[], Any]) -> Any:
    """lower().compile(); in a job of several processes with the persistent cache on, process 0 first (it writes
    the cache entry: JAX writes from process 0 only) and the others after it, loading its binary from disk: one
    compile per job, not one per process at once (8 processes of a host each holding the compiler's memory and
    a core). (`jax_share_binary_between_hosts` would do it through the job's key-value store, but hangs the
    first cross-process device_put here.)"""
    import jax

    if jax.process_count() == 1 or not jax.config.jax_compilation_cache_dir:
        return lower().compile()
    from spd_jax import distributed

    if jax.process_index() > 0:
        distributed.barrier("compile: process 0 first")
    exe = lower().compile()
    if jax.process_index() == 0:
        distributed.barrier("compile: process 0 first")
    return exe


def cache_events() -> dict[str, int]:
    """Persistent-cache hits and misses so far in this process."""
    return dict(hits=_EVENTS["cache_hits"], misses=_EVENTS["cache_misses"])


def compile_source(before: dict[str, int], compile_s: float) -> str:
    """What compile_s measured since `before = cache_events()`: "compiled", "persistent cache" (loaded
    from disk, nothing compiled) or "in-process cache" (nothing to do)."""
    if compile_s == 0:
        return "in-process cache"
    now = cache_events()
    if now["misses"] > before["misses"]:
        return "compiled"
    if now["hits"] > before["hits"]:
        return "persistent cache"
    return "compiled"


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
        exe = _compile(lower)
        self.compiles += 1
        seconds = time.perf_counter() - t0
        self._entries[key] = exe
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return exe, seconds

    def latest(self) -> Any:
        """The executable used last (compiled or hit): what a benchmark inspects after a call."""
        if not self._entries:
            raise LookupError("nothing compiled yet")
        return next(reversed(self._entries.values()))

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries
