"""Triton kernels for ``fp8_quant``: the same bits as its torch path, at memory speed.

Imported only by ``fp8_quant`` when a CUDA tensor takes the ``triton`` implementation (triton ships
with torch's CUDA builds; this module is never imported at package import). ``TRITON_INTERPRET=1``
runs the kernels on CPU tensors (the CPU tests do, with ``soft_cast=True``).

* amax: the largest |x| as the largest fp32 bit pattern with the sign cleared (for non-negative
  floats integer order is float order, and every NaN pattern is above inf, so a NaN anywhere gives
  a NaN amax, as ``torch.linalg.vector_norm(x, inf)`` does), one ``atomic_max`` per block.
* the scale: exponent bits of max(amax x margin, 1e-30) against those of the format's top
  (``fp8_quant.pow2_below``), 1 for amax 0, NaN for a non-finite amax.
* the cast: x x scale rounded to nearest even; with ``soft_cast`` in integer arithmetic (the
  algorithm of c10's ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value``, so the
  interpreter, whose own FP8 conversion rounds differently, gives the hardware's bits), else by
  the GPU's ``cvt.rn.satfinite`` (the same bits for every value a kept scale produces: |x x scale|
  <= top).

``current`` is two launches over x (amax, then cast) after a 4-byte memset; ``delayed`` is one
pass (scale from the history, cast, amax) and a second launch that, unless the call must be redone
(``fp8_quant``'s rules), only writes the descale, the history row and the saturation counts.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .fp8_reference import FORMAT_MAX

__all__ = ["current", "delayed", "BLOCK"]

BLOCK = 8192
_WARPS = 8
_TINY = 1e-30


@triton.jit
def _scale_from(b, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr):
    """The largest power of 2 at most top / b (b fp32, >= 1e-30)."""
    bits = b.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    over = ((bits & 0x7FFFFF) > TOP_MANT).to(tl.int32)
    return ((TOP_EXP - exp + 127 - over) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _current_scale(amax, margin, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr):
    scale = _scale_from(tl.maximum(amax * margin, 1e-30), TOP_EXP, TOP_MANT)
    scale = tl.where(amax > 0, scale, 1.0)
    return tl.where(amax < float("inf"), scale, float("nan"))  # NaN < inf is false


@triton.jit
def _fp8_bits(v, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """v (fp32) in FP8, rounded to nearest even, as uint8 bits."""
    if SOFT:
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        if E5M2:
            small = mag < (113 << 23)  # below e5m2's smallest normal, 2^-14
            denorm = ((mag.to(tl.float32, bitcast=True) + 2.0 ** 7).to(tl.int32, bitcast=True) - (134 << 23))
            odd = (mag >> 21) & 1
            normal = (mag + ((15 - 127) << 23) + 0xFFFFF + odd) >> 21
            big = tl.where(mag > 0x7F800000, 0x7F, 0x7C)
            out = tl.where(mag >= (143 << 23), big, tl.where(small, denorm, normal))
        else:
            small = mag < (121 << 23)  # below e4m3's smallest normal, 2^-6
            denorm = ((mag.to(tl.float32, bitcast=True) + 2.0 ** 14).to(tl.int32, bitcast=True) - (141 << 23))
            odd = (mag >> 20) & 1
            normal = (mag + ((7 - 127) << 23) + 0x7FFFF + odd) >> 20
            out = tl.where(mag >= (1087 << 20), 0x7F, tl.where(small, denorm, normal))
        return ((out & 0x7F) | sign).to(tl.uint8)
    else:
        if E5M2:
            return v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _amax_kernel(x_ptr, n, amax_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))


@triton.jit
def _delayed_kernel(x_ptr, out_ptr, n, hist_ptr, rows, hist_stride, margin, scale_ptr, amax_ptr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr,
                    E5M2: tl.constexpr, SOFT: tl.constexpr):
    """One pass: x x (the history's scale) cast and stored, and max |x| into amax_ptr. The
    scale used is written to scale_ptr, 0 when the history is empty (the cast then used 1)."""
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    hmax = tl.max(tl.load(hist_ptr + r * hist_stride, mask=r < rows, other=0.0), 0)
    scale = tl.where(hmax > 0, _scale_from(tl.maximum(hmax * margin, 1e-30), TOP_EXP, TOP_MANT), 1.0)
    if pid == 0:
        tl.store(scale_ptr, tl.where(hmax > 0, scale, 0.0))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
    tl.store(out_ptr + offs, _fp8_bits(x * scale, E5M2, SOFT), mask=mask)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, amax_ptr, margin, descale_ptr, scale_ptr, hist_ptr, rows, hist_stride, row_ptr,
                 sat_ptr, total_ptr, under, top, BLOCK: tl.constexpr, DELAYED: tl.constexpr,
                 TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """Current scaling's cast; with DELAYED, the check after ``_delayed_kernel``: the cast runs
    only when the delayed scale was unusable, and program 0 does the bookkeeping."""
    pid = tl.program_id(0)
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    now = _current_scale(amax, 1.0 if DELAYED else margin, TOP_EXP, TOP_MANT)
    redo = True
    scale = now
    if DELAYED:
        used = tl.load(scale_ptr)
        held = used > 0  # 0: the history was empty
        finite = amax < float("inf")
        saturated = held & finite & (amax * used > top)
        small = held & finite & (amax > 0) & (used * under < now)
        redo = (used == 0) | (amax != amax) | (amax == float("inf")) | saturated | small
        scale = tl.where(redo, now, used)
        if pid == 0:
            row = tl.load(row_ptr)
            tl.store(hist_ptr + row * hist_stride, tl.where(finite, amax, 0.0))
            tl.store(row_ptr, (row + 1) % rows)
            tl.atomic_add(sat_ptr, saturated.to(tl.int32))
            tl.atomic_add(total_ptr, saturated.to(tl.int32))
    if pid == 0:
        recip = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 1/2^k, exact
        tl.store(descale_ptr, tl.where(scale == scale, recip, scale))
    if redo:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _fp8_bits(x * scale, E5M2, SOFT), mask=mask)


def _top(dtype) -> tuple[int, int]:
    """(biased exponent, mantissa) of the format's largest value as fp32 (``fp8_quant.TOP_BITS``)."""
    bits = struct.unpack("<I", struct.pack("<f", FORMAT_MAX[dtype]))[0]
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _operands(x: torch.Tensor, dtype):
    """x (dense: ``fp8_quant.dense``) and the output with its strides, and both as flat spans."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device)
    n = x.numel()
    return x, out, x.as_strided((n,), (1,)), out.view(torch.uint8).as_strided((n,), (1,)), n


def current(x: torch.Tensor, dtype, margin: float, soft_cast: bool = False):
    """``fp8_quant.current`` in two passes (module doc)."""
    x, out, flat_x, flat_out, n = _operands(x, dtype)
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    descale = torch.empty(1, dtype=torch.float32, device=x.device)
    grid = (max(triton.cdiv(n, BLOCK), 1),)
    top_exp, top_mant = _top(dtype)
    if n:
        _amax_kernel[grid](flat_x, n, bits, BLOCK=BLOCK, num_warps=_WARPS)
    _cast_kernel[grid](flat_x, flat_out, n, bits, float(margin), descale, descale, descale, 1, 1, bits, bits, bits,
                       1.0, 1.0, BLOCK=BLOCK, DELAYED=False, TOP_EXP=top_exp, TOP_MANT=top_mant,
                       E5M2=dtype == torch.float8_e5m2, SOFT=soft_cast, num_warps=_WARPS)
    return out, descale, bits.view(torch.float32).reshape(())


def delayed(x: torch.Tensor, dtype, history, slot: int, margin: float, total: torch.Tensor, under: float,
            soft_cast: bool = False):
    """``fp8_quant.delayed``: one pass, then the check (module doc); ``total`` (1,) int32 counts
    saturated calls for ``stats()``, ``under`` is ``fp8_quant.UNDER``."""
    x, out, flat_x, flat_out, n = _operands(x, dtype)
    work = torch.zeros(2, dtype=torch.int32, device=x.device)  # [amax bits, the delayed scale]
    bits, used = work[:1], work[1:].view(torch.float32)
    descale = torch.empty(1, dtype=torch.float32, device=x.device)
    rows, slots = history.amax.shape
    column = history.amax[:, slot]
    grid = (max(triton.cdiv(n, BLOCK), 1),)
    top_exp, top_mant = _top(dtype)
    e5m2 = dtype == torch.float8_e5m2
    _delayed_kernel[grid](flat_x, flat_out, n, column, rows, slots, float(margin), used, bits, BLOCK=BLOCK,
                          ROWS=triton.next_power_of_2(rows), TOP_EXP=top_exp, TOP_MANT=top_mant, E5M2=e5m2,
                          SOFT=soft_cast, num_warps=_WARPS)
    _cast_kernel[grid](flat_x, flat_out, n, bits, float(margin), descale, used, column, rows, slots,
                       history.row[slot:], history.saturated[slot:], total, float(under), FORMAT_MAX[dtype],
                       BLOCK=BLOCK, DELAYED=True, TOP_EXP=top_exp, TOP_MANT=top_mant, E5M2=e5m2, SOFT=soft_cast,
                       num_warps=_WARPS)
    return out, descale, bits.view(torch.float32).reshape(())
