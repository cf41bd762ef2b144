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
  provider never changes them. A call PyTorch then sends elsewhere is counted ``backend_disabled``.

Only the order is changed, only when cuDNN is not already first, and restored when the last
activation ends.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

__all__ = ["PriorityGuard", "initialize_default_order"]

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
    the order PyTorch would have had (its lazily chosen default included)."""

    def __init__(self):
        self._saved: list[int] | None = None
        self._changed = False
        self._waiting = False

    def apply(self) -> None:
        if initialize_default_order() or not torch.cuda.is_available():
            self._take()
        else:  # CUDA not initialized yet: no selection has run; decide when it initializes
            self._saved, self._changed = _order(), False
            self._prioritise()
            if not self._waiting and hasattr(torch.cuda, "_lazy_call"):
                self._waiting = True
                torch.cuda._lazy_call(self._on_cuda_init)

    def _take(self) -> None:
        self._saved = _order()
        self._changed = False
        self._prioritise()

    def _prioritise(self) -> None:
        order = _order()
        if order and order[0] != _CUDNN:
            torch._C._set_sdp_priority_order([_CUDNN] + [b for b in order if b != _CUDNN])
            self._changed = True

    def _on_cuda_init(self) -> None:
        """At CUDA initialization, while active: retake the snapshot with PyTorch's real default."""
        self._waiting = False
        if self._saved is None:
            return
        if self._changed:  # put back the static order so PyTorch's default choice applies to it
            torch._C._set_sdp_priority_order(self._saved)
        initialize_default_order(initializing=True)
        self._take()

    def restore(self) -> None:
        if self._saved is not None and self._changed:
            torch._C._set_sdp_priority_order(self._saved)
        self._saved, self._changed = None, False
