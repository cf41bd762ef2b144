"""PyTorch's SDPA backend priority while the provider is enabled, and its exact restoration.

The provider needs F.scaled_dot_product_attention to pick the cuDNN backend whenever PyTorch
allows it. PyTorch already does so on the GPUs where it prefers cuDNN (sm_90 and sm_100 with cuDNN
>= 9.9 in torch 2.11: ``check_prefer_cudnn_attention`` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp); elsewhere cuDNN must be moved to the front.

Two facts of that file shape this module:

* The default order is chosen lazily, on the first CUDA SDPA selection (``priority_order_init_``).
  Before it, ``torch._C._get_sdp_priority_order()`` reports the static order (flash first). A
  snapshot taken then and restored later would leave flash first for good, so before reading the
  order we let PyTorch choose its default with one selection on tiny CUDA tensors (no kernel runs)
  when CUDA is initialized, or, when it is not, at CUDA's initialization (``torch.cuda._lazy_call``).
* The enabled flags (``sdpa_kernel([...])``, ``enable_cudnn_sdp``) are the user's restriction: the
  provider never changes them. A call PyTorch then sends elsewhere is counted ``backend_disabled``,
  and so is a varlen_attn call, which the provider then leaves to PyTorch's kernel on every torch
  (the one rule: ``route.user_excludes_cudnn``).

Only the order is changed, only when cuDNN is not already first, and restored when the last
activation ends.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch.nn.attention import SDPBackend

__all__ = ["PriorityGuard", "initialize_default_order"]

log = logging.getLogger("cudnn_sdpa_provider")

_CUDNN = int(SDPBackend.CUDNN_ATTENTION)


def _order() -> list[int]:
    return [int(b) for b in torch._C._get_sdp_priority_order()]


def initialize_default_order(initializing: bool = False) -> bool:
    """Let PyTorch pick its default priority now (it does so once, on the first CUDA selection).
    Needs an initialized CUDA context, or ``initializing=True`` from a callback of CUDA's own
    initialization; never creates a context itself. Returns whether it ran."""
    if not torch.cuda.is_available() or not (initializing or torch.cuda.is_initialized()):
        return False
    q = torch.empty((1, 1, 1, 8), dtype=torch.float16, device="cuda")
    torch._fused_sdp_choice(q, q, q)  # a selection, no kernel: initializes the default order
    return True


class PriorityGuard:
    """Puts cuDNN first in PyTorch's SDPA priority on ``apply()``; ``restore()`` puts back exactly
    the order PyTorch would have had (its lazily chosen default included). Thread-safe; the
    callback it leaves for CUDA's initialization never raises (it would break CUDA for the process)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._saved: list[int] | None = None  # the order to restore
        self._applied: list[int] | None = None  # the order set by apply(), None when unchanged
        self._waiting = False

    def apply(self) -> None:
        with self._lock:
            if initialize_default_order() or not torch.cuda.is_available():
                self._take()
                return
            # CUDA is not initialized: no selection has run yet; decide again when it initializes.
            self._take()
            wait = not self._waiting and hasattr(torch.cuda, "_lazy_call")
            self._waiting = self._waiting or wait
        if wait:  # outside the lock: _lazy_call runs the callback at once if CUDA initialized meanwhile
            torch.cuda._lazy_call(self._on_cuda_init)

    def _take(self) -> None:
        self._saved, self._applied = _order(), None
        order = self._saved
        if order and order[0] != _CUDNN:
            self._applied = [_CUDNN] + [b for b in order if b != _CUDNN]
            torch._C._set_sdp_priority_order(self._applied)

    def _on_cuda_init(self) -> None:
        """At CUDA initialization, while active: retake the snapshot with PyTorch's real default."""
        try:
            with self._lock:
                self._waiting = False
                if self._saved is None:
                    return
                if self._applied is not None:  # the static order back, so PyTorch's default choice applies to it
                    torch._C._set_sdp_priority_order(self._saved)
                initialize_default_order(initializing=True)
                self._take()
        except Exception as exc:  # pragma: no cover - never break CUDA's initialization
            log.warning("cudnn-sdpa-provider: could not read PyTorch's default SDPA priority: %r", exc)

    def restore(self) -> None:
        with self._lock:
            if self._saved is not None and self._applied is not None:
                current = _order()
                if current == self._applied:
                    torch._C._set_sdp_priority_order(self._saved)
                elif current and current[0] == _CUDNN:  # changed since (a user's priority context): keep
                    # their order, with only cuDNN back where it was
                    others = [b for b in current if b != _CUDNN]
                    others.insert(self._saved.index(_CUDNN), _CUDNN)
                    torch._C._set_sdp_priority_order(others)
            self._saved, self._applied = None, None
