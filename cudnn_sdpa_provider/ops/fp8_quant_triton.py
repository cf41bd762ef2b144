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

__all__ = ["current", "delayed", "inputs", "dequantize", "dequantize_grads", "BLOCK"]

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
def _amax_block(x_ptr, n, block, amax_ptr, BLOCK: tl.constexpr):
    """max |x| over one block of x into amax_ptr (int32 bits, ``atomic_max``)."""
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))


@triton.jit
def _amax_kernel(x_ptr, n, amax_ptr, BLOCK: tl.constexpr):
    _amax_block(x_ptr, n, tl.program_id(0), amax_ptr, BLOCK)


@triton.jit
def _delayed_kernel(x_ptr, out_ptr, n, hist_ptr, rows, hist_stride, margin, scale_ptr, amax_ptr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr,
                    E5M2: tl.constexpr, SOFT: tl.constexpr):
    """One pass: x x (the history's scale) cast and stored, and max |x| into amax_ptr. The
    scale used is written to scale_ptr, 0 when the history is empty (the cast then used 1)."""
    _delayed_block(x_ptr, out_ptr, n, tl.program_id(0), hist_ptr, rows, hist_stride, margin, scale_ptr, amax_ptr,
                   BLOCK, ROWS, TOP_EXP, TOP_MANT, E5M2, SOFT)


@triton.jit
def _delayed_block(x_ptr, out_ptr, n, block, hist_ptr, rows, hist_stride, margin, scale_ptr, amax_ptr,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr,
                   E5M2: tl.constexpr, SOFT: tl.constexpr):
    """``_delayed_kernel``'s work on one block of x (block 0 also writes the scale used)."""
    r = tl.arange(0, ROWS)
    hmax = tl.max(tl.load(hist_ptr + r * hist_stride, mask=r < rows, other=0.0), 0)
    scale = tl.where(hmax > 0, _scale_from(tl.maximum(hmax * margin, 1e-30), TOP_EXP, TOP_MANT), 1.0)
    if block == 0:
        tl.store(scale_ptr, tl.where(hmax > 0, scale, 0.0))
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
    tl.store(out_ptr + offs, _fp8_bits(x * scale, E5M2, SOFT), mask=mask)


@triton.jit
def _decide(amax_ptr, used_ptr, margin, under, top, DELAYED: tl.constexpr, TOP_EXP: tl.constexpr,
            TOP_MANT: tl.constexpr):
    """(amax, the scale this call keeps, whether x must be cast again at it, saturated): current
    scaling at ``margin``; with DELAYED, the delayed scale at ``used_ptr`` unless unusable
    (``fp8_quant``'s rules: empty history, non-finite x, clipping, or ``under`` times too small)."""
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    now = _current_scale(amax, 1.0 if DELAYED else margin, TOP_EXP, TOP_MANT)
    redo = True
    scale = now
    saturated = False
    if DELAYED:
        used = tl.load(used_ptr)
        held = used > 0  # 0: the history was empty
        finite = amax < float("inf")
        saturated = held & finite & (amax * used > top)
        small = held & finite & (amax > 0) & (used * under < now)
        redo = (used == 0) | (amax != amax) | (amax == float("inf")) | saturated | small
        scale = tl.where(redo, now, used)
    return amax, scale, redo, saturated


@triton.jit
def _recip(scale):
    """1 / scale for a power of 2 (exact, from the exponent bits); NaN stays NaN."""
    recip = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return tl.where(scale == scale, recip, scale)


@triton.jit
def _book(amax, saturated, hist_ptr, rows, hist_stride, row_ptr, sat_ptr, total_ptr):
    """A delayed call's bookkeeping: its amax (0 if not finite) into the history's next row, the
    row advanced, a saturated call counted."""
    row = tl.load(row_ptr)
    tl.store(hist_ptr + row * hist_stride, tl.where(amax < float("inf"), amax, 0.0))
    tl.store(row_ptr, (row + 1) % rows)
    tl.atomic_add(sat_ptr, saturated.to(tl.int32))
    tl.atomic_add(total_ptr, saturated.to(tl.int32))


@triton.jit
def _cast_block(x_ptr, out_ptr, n, block, scale, BLOCK: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _fp8_bits(x * scale, E5M2, SOFT), mask=mask)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, amax_ptr, margin, descale_ptr, scale_ptr, hist_ptr, rows, hist_stride, row_ptr,
                 sat_ptr, total_ptr, under, top, BLOCK: tl.constexpr, DELAYED: tl.constexpr,
                 TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """Current scaling's cast; with DELAYED, the check after ``_delayed_kernel``: the cast runs
    only when the delayed scale was unusable, and program 0 does the bookkeeping."""
    pid = tl.program_id(0)
    amax, scale, redo, saturated = _decide(amax_ptr, scale_ptr, margin, under, top, DELAYED, TOP_EXP, TOP_MANT)
    if pid == 0:
        if DELAYED:
            _book(amax, saturated, hist_ptr, rows, hist_stride, row_ptr, sat_ptr, total_ptr)
        tl.store(descale_ptr, _recip(scale))
    if redo:
        _cast_block(x_ptr, out_ptr, n, pid, scale, BLOCK, E5M2, SOFT)


# ------------------------------------------------- q, k, v in two launches (``fp8_quant.attention_inputs``)
# Programs [0, bq) work on q, [bq, bq + bk) on k, the rest on v; each tensor exactly as the
# one-tensor kernels above treat it (slots ``first``, ``first`` + 1, ``first`` + 2 of the history).
# Program 0 of the second launch also writes the forward's factors (``fp8_quant.FACTORS``).

@triton.jit
def _which(pid, bq, bk):
    """(tensor 0, 1 or 2, block within it) of program ``pid``."""
    t = tl.where(pid < bq, 0, tl.where(pid < bq + bk, 1, 2))
    return t, pid - tl.where(t == 0, 0, tl.where(t == 1, bq, bq + bk))


@triton.jit
def _amax3_kernel(q_ptr, k_ptr, v_ptr, nq, nk, nv, bq, bk, amax_ptr, BLOCK: tl.constexpr):
    t, block = _which(tl.program_id(0), bq, bk)
    if t == 0:
        _amax_block(q_ptr, nq, block, amax_ptr, BLOCK)
    elif t == 1:
        _amax_block(k_ptr, nk, block, amax_ptr + 1, BLOCK)
    else:
        _amax_block(v_ptr, nv, block, amax_ptr + 2, BLOCK)


@triton.jit
def _delayed3_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, nq, nk, nv, bq, bk, hist_ptr, rows, hist_stride,
                     margin, used_ptr, amax_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr, TOP_EXP: tl.constexpr,
                     TOP_MANT: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    t, block = _which(tl.program_id(0), bq, bk)
    if t == 0:
        _delayed_block(q_ptr, q8_ptr, nq, block, hist_ptr, rows, hist_stride, margin, used_ptr, amax_ptr,
                       BLOCK, ROWS, TOP_EXP, TOP_MANT, E5M2, SOFT)
    elif t == 1:
        _delayed_block(k_ptr, k8_ptr, nk, block, hist_ptr + 1, rows, hist_stride, margin, used_ptr + 1,
                       amax_ptr + 1, BLOCK, ROWS, TOP_EXP, TOP_MANT, E5M2, SOFT)
    else:
        _delayed_block(v_ptr, v8_ptr, nv, block, hist_ptr + 2, rows, hist_stride, margin, used_ptr + 2,
                       amax_ptr + 2, BLOCK, ROWS, TOP_EXP, TOP_MANT, E5M2, SOFT)


@triton.jit
def _close(i: tl.constexpr, amax_ptr, used_ptr, margin, factors_ptr, hist_ptr, rows, hist_stride, row_ptr, sat_ptr,
           total_ptr, under, top, DELAYED: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr):
    """Tensor i's books (delayed) and descale (factor i); whether its scale is NaN (x not finite)."""
    amax, scale, _, saturated = _decide(amax_ptr + i, used_ptr + i, margin, under, top, DELAYED, TOP_EXP, TOP_MANT)
    if DELAYED:
        _book(amax, saturated, hist_ptr + i, rows, hist_stride, row_ptr + i, sat_ptr + i, total_ptr)
    tl.store(factors_ptr + 4 * i, _recip(scale))
    return scale != scale


@triton.jit
def _finish3_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, v8_ptr, nq, nk, nv, bq, bk, amax_ptr, used_ptr, margin,
                    factors_ptr, hist_ptr, rows, hist_stride, row_ptr, sat_ptr, total_ptr, under, top,
                    BLOCK: tl.constexpr, DELAYED: tl.constexpr, TOP_EXP: tl.constexpr, TOP_MANT: tl.constexpr,
                    O_EXP: tl.constexpr, O_MANT: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """Each tensor's cast (current scaling, or a delayed scale found unusable); program 0 keeps the
    books of all three and writes the factors."""
    pid = tl.program_id(0)
    t, block = _which(pid, bq, bk)
    amax, scale, redo, saturated = _decide(amax_ptr + t, used_ptr + t, margin, under, top, DELAYED, TOP_EXP,
                                           TOP_MANT)
    if redo:
        if t == 0:
            _cast_block(q_ptr, q8_ptr, nq, block, scale, BLOCK, E5M2, SOFT)
        elif t == 1:
            _cast_block(k_ptr, k8_ptr, nk, block, scale, BLOCK, E5M2, SOFT)
        else:
            _cast_block(v_ptr, v8_ptr, nv, block, scale, BLOCK, E5M2, SOFT)
    if pid == 0:
        bad = _close(0, amax_ptr, used_ptr, margin, factors_ptr, hist_ptr, rows, hist_stride, row_ptr, sat_ptr,
                     total_ptr, under, top, DELAYED, TOP_EXP, TOP_MANT)
        bad |= _close(1, amax_ptr, used_ptr, margin, factors_ptr, hist_ptr, rows, hist_stride, row_ptr, sat_ptr,
                      total_ptr, under, top, DELAYED, TOP_EXP, TOP_MANT)
        bad |= _close(2, amax_ptr, used_ptr, margin, factors_ptr, hist_ptr, rows, hist_stride, row_ptr, sat_ptr,
                      total_ptr, under, top, DELAYED, TOP_EXP, TOP_MANT)
        # O's scale: the largest power of 2 at most (top x O_HEADROOM) / max |V|; 1 for 0 or non-finite
        amax_v = tl.load(amax_ptr + 2).to(tl.float32, bitcast=True)
        scale_o = _scale_from(tl.maximum(amax_v, 1e-30), O_EXP, O_MANT)
        scale_o = tl.where((amax_v > 0) & (amax_v < float("inf")), scale_o, 1.0)
        descale_o = _recip(scale_o)
        poison = tl.where(bad, float("nan"), 0.0)
        tl.store(factors_ptr + 4 * 3, scale_o)
        tl.store(factors_ptr + 4 * 4, descale_o)
        tl.store(factors_ptr + 4 * 5, poison)
        tl.store(factors_ptr + 4 * 6, descale_o + poison)


@triton.jit
def _fp8_value(bits, SOFT: tl.constexpr):
    """float8_e4m3fn bits (uint8) as fp32, exactly."""
    if SOFT:
        b = bits.to(tl.int32)
        sign = (b & 0x80) << 24
        exp = (b >> 3) & 0xF
        mant = b & 0x7
        normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        tiny = mant.to(tl.float32) * (1.0 / 512.0)  # exp 0: mant x 2^-9
        # the sign as a bit, not a negation: compiled for the GPU, -x of +0.0 gave +0.0 (run 57)
        tiny = (tiny.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        value = tl.where(exp == 0, tiny, normal)
        return tl.where((exp == 15) & (mant == 7), float("nan"), value)
    else:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_block(x_ptr, out_ptr, n, block, factor, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    """One block of out = x (float8_e4m3fn bits) x factor (fp32) in out's dtype: the bits of
    ``x.to(dtype) * factor.to(dtype)`` (an FP8 value is exact in bf16, fp16 and fp32; the product of
    two exact values rounded once)."""
    f = factor.to(out_ptr.dtype.element_ty).to(tl.float32)
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _fp8_value(tl.load(x_ptr + offs, mask=mask, other=0), SOFT)
    tl.store(out_ptr + offs, (x * f).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(x_ptr, out_ptr, n, factor_ptr, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    _dequant_block(x_ptr, out_ptr, n, tl.program_id(0), tl.load(factor_ptr), BLOCK, SOFT)


@triton.jit
def _dequant3_kernel(q_ptr, k_ptr, v_ptr, oq_ptr, ok_ptr, ov_ptr, nq, nk, nv, bq, bk, use_ptr, use_stride, poison_ptr,
                     ddo_ptr, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    """dq, dk, dv (e4m3fn bits) turned back in one launch: each x (1 / its scale + poison + descale_dO
    x 0) in the output's dtype, the bits of ``fp8_ops.grad_factors`` then ``x.to(dtype) * factor``."""
    t, block = _which(tl.program_id(0), bq, bk)
    factor = tl.div_rn(1.0, tl.load(use_ptr + t * use_stride)) + tl.load(poison_ptr) + tl.load(ddo_ptr) * 0.0
    if t == 0:
        _dequant_block(q_ptr, oq_ptr, nq, block, factor, BLOCK, SOFT)
    elif t == 1:
        _dequant_block(k_ptr, ok_ptr, nk, block, factor, BLOCK, SOFT)
    else:
        _dequant_block(v_ptr, ov_ptr, nv, block, factor, BLOCK, SOFT)


def _bits(value: float) -> tuple[int, int]:
    """(biased exponent, mantissa) of ``value`` as fp32."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _top(dtype) -> tuple[int, int]:
    """(biased exponent, mantissa) of the format's largest value as fp32 (``fp8_quant.TOP_BITS``)."""
    return _bits(FORMAT_MAX[dtype])


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


def inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype, margin: float, history=None, first: int = 0,
           total=None, under: float = 16.0, o_top: float = 392.0, soft_cast: bool = False):
    """``fp8_quant.attention_inputs`` in two launches after a memset: (q8, k8, v8, factors (8, 4) fp32,
    amax (3,) fp32). Each tensor as ``current`` (``history`` None) or ``delayed`` from the history's
    slots ``first``..``first`` + 2 treat it; ``factors[i, 0]`` is ``fp8_quant.FACTORS[i]``."""
    (q, q8, fq, f8q, nq), (k, k8, fk, f8k, nk), (v, v8, fv, f8v, nv) = (_operands(t, dtype) for t in (q, k, v))
    work = torch.zeros(6, dtype=torch.int32, device=q.device)  # amax bits of q, k, v; their delayed scales
    bits, used = work[:3], work[3:].view(torch.float32)
    factors = torch.empty((8, 4), dtype=torch.float32, device=q.device)  # one 16-byte row per factor
    bq, bk, bv = (max(triton.cdiv(n, BLOCK), 1) for n in (nq, nk, nv))  # an empty tensor's block 0 keeps its books
    grid = (bq + bk + bv,)
    top_exp, top_mant = _top(dtype)
    o_exp, o_mant = _bits(o_top)
    e5m2 = dtype == torch.float8_e5m2
    delayed = history is not None
    if delayed:
        rows, slots = history.amax.shape
        hist, row, sat = history.amax.view(-1)[first:], history.row[first:], history.saturated[first:]
        _delayed3_kernel[grid](fq, fk, fv, f8q, f8k, f8v, nq, nk, nv, bq, bk, hist, rows, slots, float(margin), used,
                               bits, BLOCK=BLOCK, ROWS=triton.next_power_of_2(rows), TOP_EXP=top_exp,
                               TOP_MANT=top_mant, E5M2=e5m2, SOFT=soft_cast, num_warps=_WARPS)
    else:
        rows, slots, hist, row, sat, total = 1, 1, used, bits, bits, bits  # unread without DELAYED
        _amax3_kernel[grid](fq, fk, fv, nq, nk, nv, bq, bk, bits, BLOCK=BLOCK, num_warps=_WARPS)
    _finish3_kernel[grid](fq, fk, fv, f8q, f8k, f8v, nq, nk, nv, bq, bk, bits, used, float(margin), factors, hist,
                          rows, slots, row, sat, total, float(under), FORMAT_MAX[dtype], BLOCK=BLOCK, DELAYED=delayed,
                          TOP_EXP=top_exp, TOP_MANT=top_mant, O_EXP=o_exp, O_MANT=o_mant, E5M2=e5m2,
                          SOFT=soft_cast, num_warps=_WARPS)
    return q8, k8, v8, factors, bits.view(torch.float32)


def dequantize(x: torch.Tensor, factor: torch.Tensor, dtype, soft_cast: bool = False) -> torch.Tensor:
    """float8_e4m3fn ``x`` (dense) x ``factor`` (one fp32 element) in ``dtype``, x's strides: the bits
    of ``x.to(dtype) * factor.to(dtype)`` in one pass."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device)
    n = x.numel()
    if n:
        _dequant_kernel[(triton.cdiv(n, BLOCK),)](x.view(torch.uint8).as_strided((n,), (1,)),
                                                   out.as_strided((n,), (1,)), n, factor, BLOCK=BLOCK,
                                                   SOFT=soft_cast, num_warps=_WARPS)
    return out


def dequantize_grads(dq, dk, dv, use, poison, descale_do, dtype, soft_cast: bool = False):
    """dq, dk, dv (float8_e4m3fn, dense) turned back into ``dtype`` in one launch, each x its factor
    from ``use`` (its scale, one of the first three elements), ``poison`` and ``descale_do``
    (``fp8_ops.grad_factors``); the outputs keep the inputs' strides."""
    outs, flats, ns = [], [], []
    for x in (dq, dk, dv):
        out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device)
        n = x.numel()
        outs.append(out)
        flats += [x.view(torch.uint8).as_strided((n,), (1,)), out.as_strided((n,), (1,))]
        ns.append(n)
    bq, bk, bv = (max(triton.cdiv(n, BLOCK), 1) for n in ns)
    _dequant3_kernel[(bq + bk + bv,)](flats[0], flats[2], flats[4], flats[1], flats[3], flats[5], *ns, bq, bk, use,
                                      use.stride(0), poison, descale_do, BLOCK=BLOCK, SOFT=soft_cast,
                                      num_warps=_WARPS)
    return tuple(outs)
