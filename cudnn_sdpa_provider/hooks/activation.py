"""Turning the provider on and off: process-wide, nestable, exception-safe, restored exactly.

``enable()`` activates at once and returns an ``Activation`` (``scope``); used as a context manager
it is removed on exit, used as a plain call it stays until ``disable()`` (or its ``remove()``).
While any activation is live the provider's kernels are registered (``overrides.Hooks``) and cuDNN
is first in PyTorch's SDPA priority (``backends``; the user's enabled/disabled backend flags are
never touched). When the last one goes, the forward hooks are removed and the priority order is
restored to exactly what PyTorch would have had. The backward hooks stay while a forward served
inside the scope can still be differentiated (``markers``). Strictness is per thread/task
(``scope``).
"""

from __future__ import annotations

import logging
import sys

import torch

from . import REGISTRY_NAME, backends
from ..core import markers, scope
from ..core.scope import Activation

log = logging.getLogger("cudnn_sdpa_provider")

__all__ = ["Activation", "enable", "disable", "enabled", "strict", "coexistence"]

_hooks = None  # overrides.Hooks, created on first enable
_priority = backends.PriorityGuard()
_reported: set = set()


def enable(strict: bool = False, *, process_wide: bool = False) -> Activation:
    """Route attention to cuDNN graphs until the returned activation is removed.

    ``strict=True`` raises ``FallbackError`` wherever a call made in this thread/task would fall
    back (other threads keep their own strictness). ``process_wide=True`` (the environment variable
    and the CLI use it) makes the strictness the default of every thread without its own scope.
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool (True or False), got {type(strict).__name__}")
    if not isinstance(process_wide, bool):
        raise TypeError(f"process_wide must be a bool (True or False), got {type(process_wide).__name__}")
    activation = Activation(strict, process_wide, on_remove=_sync)
    with scope.lock:
        scope.push(activation)
        try:
            _sync()
        except BaseException:
            scope.remove(activation)
            _sync()  # undo what the failed sync applied (hooks, priority) if nothing else is live
            raise
    return activation


def disable() -> bool:
    """Undo the most recent live ``enable()``; returns False when nothing was enabled."""
    with scope.lock:
        live = scope.live()
        if not live:
            return False
        live[-1].remove()
        return True


def enabled() -> bool:
    return scope.enabled()


def strict() -> bool:
    """Strictness of a call made now in this thread/task (``scope.strict``)."""
    return scope.strict()


def _sync() -> None:
    global _hooks
    with scope.lock:
        if scope.enabled():
            if _hooks is None:
                from .overrides import Hooks

                _hooks = Hooks()
            if not _hooks.forward_active:
                _priority.apply()
                _hooks.install_forward()
                _hooks.install_backward()
                _report_coexistence()
        elif _hooks is not None and _hooks.forward_active:
            _hooks.remove_forward()
            _priority.restore()
            _maybe_remove_backward()


def _maybe_remove_backward() -> None:
    with scope.lock:
        if not scope.enabled() and _hooks is not None and _hooks.backward_active and markers.pending() == 0:
            _hooks.remove_backward()


markers.on_empty(_maybe_remove_backward)


def coexistence() -> list[tuple[str, str]]:
    """Problems that keep the provider from seeing or serving attention, as (slug, message)."""
    found = []
    if not torch.backends.cuda.cudnn_sdp_enabled():
        found.append(("cudnn_sdp_disabled", "cuDNN SDPA is disabled (torch.backends.cuda.enable_cudnn_sdp(False) or "
                      "sdpa_kernel without CUDNN_ATTENTION); F.sdpa calls then run elsewhere, counted "
                      "backend_disabled"))
    try:
        impl = torch.nn.attention.current_flash_attention_impl()
    except Exception:
        impl = None
    if impl is not None and impl != REGISTRY_NAME:  # our own entry is enable() itself
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
