"""How a backward knows what its forward did: a record keyed by the storage of a forward output.

The aten SDPA ops hand the backward only tensors the forward returned: the provider marks the
dense forward's logsumexp and the varlen forward's ``rng_state``. Autograd saves those outputs by
storage (``SavedVariable`` keeps the StorageImpl), and PyTorch preserves a storage's Python object
while the StorageImpl lives, so
``id(t.untyped_storage())`` identifies the forward for exactly as long as its backward can run,
on any thread, whether or not the provider's scope is still open. A weak reference's callback drops
the record when the storage dies, so an id is never reused while its record exists (a plain
``weakref.ref`` kept in the record: cheaper per call than ``weakref.finalize``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

__all__ = ["Record", "mark", "lookup", "pending", "on_empty"]

_lock = threading.Lock()
_records: dict[int, tuple] = {}  # id(storage) -> (Record, weakref to the storage)
_listeners: list = []


@dataclass(frozen=True)
class Record:
    """What the forward did: served by our graph, or fell back with ``reason``; ``strict`` is the
    strictness its scope had, which its backward keeps on whatever thread it runs."""

    served: bool
    reason: str | None = None
    strict: bool = False
    padding: object = None  # the forward's bias taken as lengths (``ops.bias_lengths.Padding``): its backward's too


def _forget(key: int) -> None:
    with _lock:
        _records.pop(key, None)
        empty = not _records
    if empty:
        for fn in list(_listeners):
            try:
                fn()
            except Exception:  # a listener must never break a deallocation
                pass


def mark(t: torch.Tensor, record: Record) -> None:
    storage = t.untyped_storage()
    key = id(storage)
    entry = (record, weakref.ref(storage, lambda _dead, key=key: _forget(key)))
    with _lock:  # nothing is allocated under the lock: a GC there could run _forget, which takes it
        _records[key] = entry


def lookup(t: torch.Tensor | None) -> Record | None:
    if t is None:
        return None
    found = _records.get(id(t.untyped_storage()))
    return None if found is None else found[0]


def pending() -> int:
    """Forwards whose backward may still come."""
    with _lock:
        return len(_records)


def on_empty(fn) -> None:
    """Call ``fn()`` whenever the last record goes away (the provider unhooks its backward then)."""
    _listeners.append(fn)
