"""Turning the provider on and off: process-wide, nestable, exception-safe, restored exactly.

``enable()`` activates at once and returns an ``Activation``; used as a context manager it is
removed on exit, used as a plain call it stays until ``disable()`` (or its ``remove()``). While
any activation is live the provider's kernels are registered (``overrides.Hooks``), cuDNN SDPA
is enabled and first in PyTorch's SDPA priority; when the last one goes, the forward hooks are
removed and the SDPA flags and priority are restored to what they were. The backward hooks stay
while a forward served inside the scope can still be differentiated (``markers``).
"""

from __future__ import annotations

import logging
import sys
import threading

import torch

from . import markers

log = logging.getLogger("cudnn_sdpa_provider")

__all__ = ["Activation", "enable", "disable", "enabled", "strict", "coexistence"]

_lock = threading.RLock()
_stack: list["Activation"] = []
_hooks = None  # overrides.Hooks, created on first enable
_saved_sdp: tuple | None = None
_reported: set = set()

_CUDNN = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)


class Activation:
    """One ``enable()``; ``remove()`` (or leaving the ``with`` block) undoes exactly this one."""

    __slots__ = ("strict", "_live")

    def __init__(self, strict: bool):
        self.strict = strict
        self._live = True

    def __enter__(self) -> "Activation":
        return self

    def __exit__(self, *exc) -> bool:
        self.remove()
        return False

    @property
    def active(self) -> bool:
        return self._live

    def remove(self) -> None:
        with _lock:
            if self._live:
                self._live = False
                _stack.remove(self)
                _sync()

    def __repr__(self) -> str:
        return f"Activation(strict={self.strict}, active={self._live})"


def enable(strict: bool = False) -> Activation:
    """Route attention to cuDNN graphs until the returned activation is removed.

    ``strict=True`` raises ``FallbackError`` wherever a call would fall back.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool (True or False), got {type(strict).__name__}")
    activation = Activation(strict)
    with _lock:
        _stack.append(activation)
        try:
            _sync()
        except BaseException:
            activation._live = False
            _stack.remove(activation)
            raise
    return activation


def disable() -> bool:
    """Undo the most recent live ``enable()``; returns False when nothing was enabled."""
    with _lock:
        if not _stack:
            return False
        _stack[-1].remove()
        return True


def enabled() -> bool:
    return bool(_stack)


def strict() -> bool:
    """Strictness of the innermost live activation (False when disabled)."""
    stack = _stack
    return bool(stack) and stack[-1].strict


def _sync() -> None:
    global _hooks
    if _stack:
        if _hooks is None:
            from .overrides import Hooks

            _hooks = Hooks()
        if not _hooks.forward_active:
            _save_and_prioritise_cudnn()
            _hooks.install_forward()
            _hooks.install_backward()
            _report_coexistence()
    elif _hooks is not None and _hooks.forward_active:
        _hooks.remove_forward()
        _restore_sdp()
        _maybe_remove_backward()


def _maybe_remove_backward() -> None:
    with _lock:
        if not _stack and _hooks is not None and _hooks.backward_active and markers.pending() == 0:
            _hooks.remove_backward()


markers.on_empty(_maybe_remove_backward)


def _save_and_prioritise_cudnn() -> None:
    global _saved_sdp
    _saved_sdp = (torch.backends.cuda.cudnn_sdp_enabled(), list(torch._C._get_sdp_priority_order()))
    torch.backends.cuda.enable_cudnn_sdp(True)
    order = [_CUDNN] + [b for b in _saved_sdp[1] if b != _CUDNN]
    torch._C._set_sdp_priority_order(order)


def _restore_sdp() -> None:
    global _saved_sdp
    if _saved_sdp is not None:
        enabled_before, order = _saved_sdp
        torch.backends.cuda.enable_cudnn_sdp(enabled_before)
        torch._C._set_sdp_priority_order(order)
        _saved_sdp = None


def coexistence() -> list[tuple[str, str]]:
    """Problems that keep the provider from seeing or serving attention, as (slug, message)."""
    found = []
    saved = _saved_sdp[0] if _saved_sdp is not None else torch.backends.cuda.cudnn_sdp_enabled()
    if not saved:
        found.append(("cudnn_sdp_disabled", "cuDNN SDPA is disabled process-wide "
                      "(torch.backends.cuda.enable_cudnn_sdp(False)); the provider enables it while active"))
    try:
        impl = torch.nn.attention.current_flash_attention_impl()
    except Exception:
        impl = None
    if impl is not None:
        found.append(("flash_impl_active", f"flash attention implementation {impl!r} is activated; "
                      "varlen calls may be routed by it"))
    if "cudnn.torch" in sys.modules:
        found.append(("nvidia_cudnn_torch", "nvidia's cudnn.torch is imported; it overrides the same aten ops "
                      "when activated (last registration wins)"))
    if _hooks is not None:
        found += _hooks.problems
    return found


def _report_coexistence() -> None:
    for slug, message in coexistence():
        if slug not in _reported:
            _reported.add(slug)
            log.warning("cudnn-sdpa-provider: %s: %s", slug, message)
