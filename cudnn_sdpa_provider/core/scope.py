"""Who has the provider on, and who wants it strict: the scope state, without side effects.

Enabling is process-wide: while any activation is live, every thread's attention calls are routed
(autograd runs backward passes on threads of its own, and the environment-variable opt-in and the
CLI enable a whole program). Strictness is per thread and per asyncio task: it lives in a
``contextvars.ContextVar`` (the pattern of Hugging Face ``kernels``), so ``enable(strict=True)`` in
one thread does not make another thread's calls raise. A thread or task without an activation of
its own takes the strictness of the process-wide activations (the env var ``=strict``,
``cudnn-sdpa run --strict``). A backward takes the strictness its forward recorded, whichever thread
autograd runs it on. This module imports nothing heavy; ``activation`` does the registrations.
"""

from __future__ import annotations

import contextvars
import threading

__all__ = ["Activation", "push", "remove", "enabled", "strict", "live", "lock"]

lock = threading.RLock()
_live: list["Activation"] = []  # process-wide, in the order they were enabled
_context: contextvars.ContextVar[tuple] = contextvars.ContextVar("cudnn_sdpa_provider_scope", default=())


class Activation:
    """One ``enable()``; ``remove()`` (or leaving the ``with`` block) undoes exactly this one.

    ``process_wide=True`` (the env var, the CLI) makes its strictness the default of every thread
    and task that has no activation of its own."""

    __slots__ = ("strict", "process_wide", "_live", "_on_remove")

    def __init__(self, strict: bool, process_wide: bool = False, on_remove=None):
        self.strict = strict
        self.process_wide = process_wide
        self._live = True
        self._on_remove = on_remove

    def __enter__(self) -> "Activation":
        return self

    def __exit__(self, *exc) -> bool:
        self.remove()
        return False

    @property
    def active(self) -> bool:
        return self._live

    def remove(self) -> None:
        if remove(self) and self._on_remove is not None:
            self._on_remove()

    def __repr__(self) -> str:
        return f"Activation(strict={self.strict}, active={self._live})"


def push(activation: Activation) -> None:
    """Make ``activation`` live: process-wide, and the innermost one of the calling context."""
    with lock:
        _live.append(activation)
    if not activation.process_wide:
        _context.set(tuple(a for a in _context.get() if a._live) + (activation,))


def remove(activation: Activation) -> bool:
    """Take ``activation`` out (from any thread); False when it was not live."""
    with lock:
        if not activation._live:
            return False
        activation._live = False
        _live.remove(activation)
    stack = _context.get()
    if activation in stack:
        _context.set(tuple(a for a in stack if a is not activation))
    return True


def enabled() -> bool:
    return bool(_live)


def live() -> list[Activation]:
    with lock:
        return list(_live)


def strict() -> bool:
    """Strictness for a call made now in this thread/task: its own innermost live activation's, or
    else the innermost live process-wide activation's (False when there is none)."""
    for activation in reversed(_context.get()):
        if activation._live:
            return activation.strict
    for activation in reversed(tuple(_live)):  # a copy: another thread may be changing the list
        if activation.process_wide:
            return activation.strict
    return False
