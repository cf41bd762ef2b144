"""The one layout policy, shared by the real kernels and the fake (meta) kernels.

Outputs are a pure function of the inputs' sizes and strides, so a FakeTensor gets exactly the
strides the real kernel returns:

* dense ``O`` follows ``q``'s dimension order (the rule of aten's meta kernel for
  ``_scaled_dot_product_cudnn_attention``, so the provider's overrides match compiled code);
* dense ``dQ/dK/dV`` are ``empty_like(q/k/v)`` (aten's backward meta rule);
* packed (varlen) ``O`` is ``empty_like(q)`` (``q``'s dimension order when D_v differs) and
  ``dQ/dK/dV`` are ``empty_like(q/k/v)``: what FlashAttention's varlen kernels return, so
  ``varlen_attn`` gives native's strides with and without the provider.

cuDNN itself needs more than any layout: the innermost (head-dim) stride must be 1 and the base
pointer and every stride 16-byte aligned, otherwise it reads the wrong elements silently (seen on
sm_90). ``usable`` checks that, ``repaired`` copies an operand that fails it. Packed operands are
stricter (``packed_usable``): cuDNN reads them in place only when they are contiguous (T, H, D),
the layout of cuDNN's own ragged samples; a view of a fused QKV buffer or a head-dim slice is
copied (a fused (T, 3, H, D) view crashed cuDNN's ragged kernels with CUDA error 715, a sliced q
gave a wrong dQ: issue #14). Where the policy's output layout is not what cuDNN can write, the
kernel computes into a contiguous buffer and copies into the policy's layout; that choice again
depends only on strides.
"""

from __future__ import annotations

import torch

__all__ = ["ALIGN", "misaligned", "for_native", "dense_out", "dense_out_strides", "packed_out", "grad_like", "packed",
           "usable", "packed_usable", "repaired", "packed_repaired", "strides_usable"]

ALIGN = _ALIGN = 16


def _matching_strides(ref_strides, shape) -> list[int]:
    # aten/_meta_registrations.py alloc_with_matching_layout: order dims by the reference's
    # strides, largest first (Python's sort is stable, so ties keep dim order).
    n = len(shape)
    order = sorted(range(n), key=lambda i: ref_strides[i], reverse=True)
    strides = [0] * n
    running = 1
    for i in reversed(order):
        strides[i] = running
        running *= shape[i]
    return strides


def dense_out_strides(q: torch.Tensor, shape) -> tuple:
    """The strides ``dense_out(q, shape)`` gives, without allocating, for a ``q`` that is
    non-overlapping and dense (``empty_like`` then keeps q's strides exactly)."""
    if tuple(q.shape) == tuple(shape):
        return q.stride()
    return tuple(_matching_strides(q.stride(), shape))


def _out_like(q: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    dtype = q.dtype if dtype is None else dtype
    if tuple(q.shape) == tuple(shape):
        return torch.empty_like(q, dtype=dtype)
    return torch.empty_strided(tuple(shape), _matching_strides(q.stride(), shape), dtype=dtype, device=q.device)


def dense_out(q: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Output of shape (B, H, S_q, D_v) in ``q``'s dimension order (aten's meta rule)."""
    return _out_like(q, shape, dtype)


def packed_out(q: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    """Packed output (T, H_q, D_v): ``empty_like(q)`` when the shapes agree (FlashAttention's
    rule; a q that is not dense gives a contiguous output), else in q's dimension order."""
    return _out_like(q, shape, dtype)


def grad_like(t: torch.Tensor) -> torch.Tensor:
    """Gradient buffer for an operand: ``empty_like`` (aten's backward meta rule)."""
    return torch.empty_like(t)


def packed(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Contiguous packed buffer (varlen outputs)."""
    return torch.empty(tuple(shape), dtype=like.dtype if dtype is None else dtype, device=like.device)


def _rows_misaligned(t: torch.Tensor) -> bool:
    """Whether an outer stride of a dim with extent > 1 is not a multiple of 16 bytes (0 is)."""
    item = t.element_size()
    return any((stride * item) % _ALIGN for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)


def strides_usable(t: torch.Tensor) -> bool:
    """Innermost stride 1, every other stride of a dim with extent > 1 nonzero and 16-byte aligned."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    if any(stride == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1):
        return False
    return not _rows_misaligned(t)


def usable(t: torch.Tensor) -> bool:
    """Whether cuDNN can read ``t`` as declared by its sizes and strides."""
    return strides_usable(t) and t.data_ptr() % _ALIGN == 0


def packed_usable(t: torch.Tensor) -> bool:
    """Whether cuDNN's ragged kernels may read or write ``t`` (T, H, D) in place: contiguous and
    16-byte aligned (D is a multiple of 8 wherever the provider serves)."""
    return t.is_contiguous() and t.data_ptr() % _ALIGN == 0


def packed_repaired(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``packed_usable``, else a contiguous copy in a fresh (aligned) buffer."""
    if packed_usable(t):
        return t
    return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device).copy_(t)


def _aligned_empty(t: torch.Tensor) -> torch.Tensor:
    """Fresh buffer shaped like ``t``: ``t``'s order of the outer dims, the last dim innermost and
    padded so that every stride is 16-byte aligned (a bias with S_kv % 8 != 0 needs this)."""
    shape = tuple(t.shape)
    n = len(shape)
    per = max(_ALIGN // t.element_size(), 1)
    inner = shape[-1] if n == 1 else -(-shape[-1] // per) * per
    outer = sorted(range(n - 1), key=lambda i: t.stride(i), reverse=True)
    strides = [0] * n
    strides[-1] = 1
    running = inner
    for i in reversed(outer):
        strides[i] = running
        running *= shape[i]
    base = torch.empty(max(running, 1), dtype=t.dtype, device=t.device)
    return base.as_strided(shape, strides)


def repaired(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when usable, else a copy in the same dimension order (innermost dim last)."""
    if usable(t):
        return t
    out = _aligned_empty(t)
    out.copy_(t)
    return out


def misaligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s base, or a row (an outer stride, with the head dim innermost), is not 16-byte
    aligned. PyTorch's own attention kernels launch on such operands unchecked, and misread or
    fault on them (docs/troubleshooting.md)."""
    if t.numel() == 0:
        return False
    if t.data_ptr() % _ALIGN:
        return True
    return t.stride(-1) == 1 and _rows_misaligned(t)


def for_native(t: torch.Tensor) -> torch.Tensor:
    """What a fallback hands PyTorch's cuDNN kernel: ``t`` itself, or where ``misaligned``, a copy
    in ``t``'s dimension order with 16-byte-aligned rows (``repaired``)."""
    return repaired(t) if misaligned(t) else t
