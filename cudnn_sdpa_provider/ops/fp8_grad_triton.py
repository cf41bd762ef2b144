"""Triton twins of ``fp8_ops``' warm delayed backward: its gradient scales before the backward and
its books after, one single-program launch each instead of about 45 aten ops on one-element tensors.

Imported only by ``fp8_ops`` where ``fp8_quant.grouped`` (never at package import);
``TRITON_INTERPRET=1`` runs them on CPU tensors (tests/test_fp8_recipes.py compares them with the
aten code bit for bit, history and counters included).

* ``grad_scales``: unit = (dO x V x K, dO x V x Q, dO, dO x V) from the descales in fp64, the
  history's largest dQ, dK, dV, dS amax per unit (slots 4-7) x unit, clamped to 3e38, in fp32, and
  the largest power of 2 at most 448 / (margin x that) (1 where that is 0 or not finite): what
  ``fp8_ops._grad_scales`` computes, in the same order of operations.
* ``grad_books``: ``fp8_ops._grad_books``: the history's next row of slots 4-7, the rows advanced,
  clipped and flushed calls counted.

The scales are written one per 16-byte row, so that cuDNN takes each as it is (no aligned copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_quant_triton import _bits
from .fp8_reference import FORMAT_MAX

__all__ = ["grad_scales", "grad_books"]

_TOP_EXP, _TOP_MANT = _bits(FORMAT_MAX[torch.float8_e4m3fn])
_INV_TOP = 1.0 / FORMAT_MAX[torch.float8_e4m3fn]  # fp8_ops._INV_TOP
_FIRST = 4  # fp8_ops.GRAD_SLOTS[0]


@triton.jit
def _pick(j, a, b, c, d):
    """(a, b, c, d)[j] for j in 0..3, elementwise."""
    return tl.where(j == 0, a, tl.where(j == 1, b, tl.where(j == 2, c, d)))


@triton.jit
def _grad_scales_kernel(hist_ptr, rows, hist_stride, dq_ptr, dk_ptr, dv_ptr, ddo_ptr, margin, use_ptr, unit_ptr,
                        ROWS: tl.constexpr, FIRST: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr):
    j = tl.arange(0, 4)
    q = tl.load(dq_ptr).to(tl.float64)
    k = tl.load(dk_ptr).to(tl.float64)
    v = tl.load(dv_ptr).to(tl.float64)
    do = tl.load(ddo_ptr).to(tl.float64)
    unit = _pick(j, do * v * k, do * v * q, do, do * v)
    r = tl.arange(0, ROWS)
    held = tl.load(hist_ptr + r[:, None] * hist_stride + FIRST + j[None, :], mask=r[:, None] < rows, other=0.0)
    predicted = tl.max(held, 0).to(tl.float64) * unit
    predicted = tl.where(predicted > 3e38, 3e38, predicted).to(tl.float32)  # NaN stays NaN, as clamp
    b = predicted * margin
    ok = (b > 0) & (b < float("inf"))
    bits = tl.maximum(b, 1e-30).to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    over = ((bits & 0x7FFFFF) > TOP_MANT).to(tl.int32)
    scale = ((TOP_EXP - exp + 127 - over) << 23).to(tl.float32, bitcast=True)
    tl.store(use_ptr + 4 * j, tl.where(ok, scale, 1.0))
    tl.store(unit_ptr + j, unit)


@triton.jit
def _finite(ptr):
    x = tl.load(ptr)
    return tl.abs(x) < float("inf")  # False for NaN


@triton.jit
def _grad_books_kernel(amax_ptr, use_ptr, use_stride, unit_ptr, dq_ptr, dk_ptr, dv_ptr, do_ptr, ddo_ptr, margin,
                       under, inv_top, hist_ptr, rows, hist_stride, row_ptr, sat_ptr, total_ptr,
                       FIRST: tl.constexpr):
    j = tl.arange(0, 4)
    finite = _finite(dq_ptr) & _finite(dk_ptr) & _finite(dv_ptr) & _finite(do_ptr) & _finite(ddo_ptr)
    amax = tl.load(amax_ptr + j)
    use = tl.load(use_ptr + j * use_stride)
    ok = (tl.abs(amax) < float("inf")) & (tl.zeros([4], tl.int32) + finite.to(tl.int32) > 0)  # finite, per lane
    over = amax * use * inv_top
    over_ds = tl.sum(tl.where(j == 3, over, 0.0), 0)
    lift = tl.where(over_ds < 1.0, 1.0, over_ds)  # clamp(min=1), NaN kept
    seen = amax * tl.where(j < 2, lift, 1.0)
    flushed = ok & (amax > 0) & (over * margin * under < 1)
    saturated = tl.max((ok & (over > 1)).to(tl.int32), 0)
    value = seen.to(tl.float64) / tl.load(unit_ptr + j)
    value = tl.where(value > 3e38, 3e38, value).to(tl.float32)
    row = tl.load(row_ptr + FIRST)
    tl.store(hist_ptr + row * hist_stride + FIRST + j, tl.where(ok & (tl.abs(value) < float("inf")), value, 0.0))
    tl.store(row_ptr + FIRST + j, (tl.load(row_ptr + FIRST + j) + 1) % rows)
    sat = tl.load(sat_ptr + FIRST + j)
    tl.store(sat_ptr + FIRST + j, sat + tl.where(j == 0, saturated, tl.where(j == 1, tl.max(flushed.to(tl.int32), 0),
                                                                                     0)))
    tl.atomic_add(total_ptr, saturated)  # the counter every kernel adds to


def grad_scales(history, descales, margin: float):
    """``fp8_ops._grad_scales``: (scales (4,) fp32, a view with one 16-byte row each; unit (4,) fp64)."""
    dq, dk, dv, _, ddo = descales
    device = dq.device
    rows, slots = history.amax.shape
    use = torch.empty((4, 4), dtype=torch.float32, device=device)
    unit = torch.empty(4, dtype=torch.float64, device=device)
    _grad_scales_kernel[(1,)](history.amax, rows, slots, dq, dk, dv, ddo, float(margin), use, unit,
                              ROWS=triton.next_power_of_2(rows), FIRST=_FIRST, TOP_EXP=_TOP_EXP, TOP_MANT=_TOP_MANT)
    return use[:, 0], unit


def grad_books(history, amax, use, unit, descales, margin: float) -> None:
    """``fp8_ops._grad_books`` (the history, its rows and saturation counts, ``stats()``'s count)."""
    from .fp8_quant import UNDER, saturation_counter

    rows, slots = history.amax.shape
    _grad_books_kernel[(1,)](amax, use, use.stride(0), unit, *descales, float(margin), UNDER, _INV_TOP,
                             history.amax, rows, slots, history.row, history.saturated,
                             saturation_counter(amax.device), FIRST=_FIRST)
