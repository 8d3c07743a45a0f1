"""What a loaded model keeps beside its params: copies derived from them (the per-layer decode weights, a
tensor-parallel placement, the pipeline's stage weights, loaded and placed drafters), built on first use and
held in one `Placements` per model (`api.Model.placements`) under one eviction rule.

It knows nothing of what the copies are: the methods, the pipeline and the drafter registry name their own
slots and entries. It imports nothing of the project.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable


class Placements:
    """Kept values by slot and name. A slot holds entries for one placement at a time (where its values live:
    a mesh size, a stage layout): asking a slot for another placement first drops everything the slot held,
    the one eviction rule (copies of the weights on a placement no later call reads are memory, a model's
    layers again per placement). A slot whose placement is None (copies on the default device or the host:
    the decode layers, loaded drafters, the weights' fingerprint) keeps every entry."""

    def __init__(self):
        self._slots: dict[str, tuple[Hashable, dict]] = {}

    def get(self, slot: str, name: Hashable, build: Callable[[], Any], placement: Hashable = None) -> Any:
        """The entry `name` of slot at placement, built (build()) on first use; a slot held at another
        placement is emptied before anything is built."""
        held = self._slots.get(slot)
        if held is None or held[0] != placement:
            self._slots[slot] = held = (placement, {})  # the old placement's entries dropped, then the new built
        entries = held[1]
        if name not in entries:
            entries[name] = build()
        return entries[name]

    def entries(self, slot: str) -> dict:
        """The slot's entries, name -> value (live: a caller replacing a value in place keeps the slot's
        placement)."""
        return self._slots.setdefault(slot, (None, {}))[1]

    def placement(self, slot: str) -> Hashable:
        """The placement a slot holds its entries at (None: none, or a slot kept at no placement)."""
        return self._slots.get(slot, (None, {}))[0]
