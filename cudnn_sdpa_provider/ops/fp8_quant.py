"""Per-tensor FP8 quantisation of bf16/fp16/fp32 tensors: (stored FP8, descale (1,) fp32, amax () fp32).

Two scalings, one definition each, implemented three ways that agree bit for bit:

* ``current(x, dtype, margin)``: scale = the largest power of 2 at most top / (margin x max |x|)
  (top: the format's largest value, 448 for e4m3fn), 1 for an all-zero ``x``, NaN when ``x`` holds
  an inf or NaN (then every stored value and the descale are NaN: no per-tensor scale exists).
* ``delayed(x, dtype, history, slot, margin)``: the scale comes from the history before the data is
  read: the largest power of 2 at most top / (margin x the largest amax in ``history.amax[:, slot]``),
  so one pass reads ``x`` once, casts it and takes its amax. It is kept unless it was unusable, and
  then this call gets ``current``'s result at margin 1 instead (decided and redone on the device,
  no host sync): the history holds no amax yet (a first call), ``x`` is not finite, the scale
  would clip (amax x scale > top: *saturated*, counted in ``history.saturated[slot]`` and in
  ``csp.stats().fp8_saturated``), or it is more than ``UNDER`` times below the current scale
  (small values would flush to 0). Then this call's amax (0 if not finite) is written into the
  history's next row of ``slot`` (a ring of ``len(history.amax)`` rows). Stored values are never
  clipped: a kept scale has amax x scale <= top.

The scale is built from exponent bits (no log2, no division), so every implementation gets the
same power of 2; x x scale is exact and the cast rounds to nearest even, as ``Tensor.to`` does.

Implementations (``CUDNN_SDPA_PROVIDER_FP8_QUANT``, ``core.env``): ``triton`` (``fp8_quant_triton``,
CUDA tensors, imported only when used and only if ``triton`` imports: current is two passes
over ``x``, amax then cast; delayed one pass plus a launch that returns at once unless the call
needs redoing), ``compiled`` (the torch code under ``torch.compile``), ``torch`` (plain aten ops:
CPU, and the fallback everywhere). ``auto`` (default) is ``triton`` on CUDA where triton imports
and the device's compute capability is in ``VERIFIED`` (where the GPU tests of the Triton kernels
passed: bit-equality with ``torch`` on the device, the same saturation counts; sm_90), else
``torch``; ``triton`` forces the kernels anywhere. Under ``auto``, kernels that fail to build
(triton compiles a launcher with the machine's C compiler at first use) leave a warning and the
torch path for the rest of the process; asked for by name, the error is raised.

``attention_inputs`` quantises q, k and v for ``csp.fp8.attention`` with the forward's factors
(``Inputs``: O's scale from max |V| and ``O_HEADROOM``, the descales, a NaN poison for non-finite
input). Where ``grouped`` (Triton, and under ``auto`` a ``GROUPED_VERIFIED`` device) the three
tensors take two launches in all, the second writing the factors, and ``dequantize`` turns the
output back in one; elsewhere each tensor is quantised alone and ``forward_factors`` computes the
factors with aten ops. Both give the same bits (tests/test_fp8_recipes.py).
"""

from __future__ import annotations

import functools
import logging
import struct
import sys
import threading
from dataclasses import dataclass
from subprocess import SubprocessError
from typing import NamedTuple

import torch

from ..core import counters, env
from .fp8_reference import FORMAT_MAX

__all__ = ["IMPLS", "VERIFIED", "GROUPED_VERIFIED", "UNDER", "O_HEADROOM", "FACTORS", "History", "Inputs", "current",
           "delayed", "attention_inputs", "forward_factors", "dequantize", "choose", "grouped", "dense",
           "triton_available", "saturated_total", "saturation_counter", "pow2_below", "TOP_BITS", "triton_failure",
           "triton_failed", "TRITON_ERRORS", "build_errors"]

IMPLS = ("auto", "triton", "compiled", "torch")
#: Compute capabilities where ``auto`` picks the Triton kernels: the bit-equality and saturation-count
#: tests of tests/gpu/test_fp8_recipes_gpu.py passed there (sm_90: runs 53 and 56, results/gpu-runs.md).
VERIFIED: tuple = ((9, 0),)
#: Compute capabilities where ``auto`` also takes the kernels that quantise q, k and v together and
#: turn the output back (``attention_inputs``, ``dequantize``: 4 launches instead of about 35, the
#: forward's host cost): their device tests (bits and counts against the torch path, the backward's
#: twins, the FP8 tests with them forced) passed there (sm_90: GPU runs 57 and 60, results/gpu-runs.md).
GROUPED_VERIFIED: tuple = ((9, 0),)
#: A delayed scale this many times below the current one is redone (values would flush to 0).
UNDER = 16.0
#: O is stored with scale = the largest power of 2 at most (largest FP8 value x this) / max |V|
#: (P's rounding can push a row of O a little past max |V|: |O| <= max |V| otherwise).
O_HEADROOM = 0.875
#: The forward's factors (``Inputs``), in the order the grouped kernel writes them.
FACTORS = ("descale_q", "descale_k", "descale_v", "scale_o", "descale_o", "poison", "out_factor")
_TINY = 1e-30  # amax x margin below this is taken as this (the scale stays a normal fp32 number)


@dataclass(frozen=True)
class History:
    """A recipe's delayed-scaling state on one device: ``amax`` (rows, slots) fp32, the last
    ``rows`` amax values of each slot (0: none); ``row`` (slots,) int32, each slot's next row;
    ``saturated`` (slots,) int32, the calls whose delayed scale would have clipped."""

    amax: torch.Tensor
    row: torch.Tensor
    saturated: torch.Tensor

    @staticmethod
    def zeros(rows: int, slots: int, device) -> "History":
        return History(torch.zeros(rows, slots, dtype=torch.float32, device=device),
                       torch.zeros(slots, dtype=torch.int32, device=device),
                       torch.zeros(slots, dtype=torch.int32, device=device))


# ------------------------------------------------------------------- saturation count for stats()
_GLOBAL: dict = {}  # device -> (1,) int32: saturated calls not yet drained into counters
_GLOBAL_LOCK = threading.Lock()


def saturation_counter(device) -> torch.Tensor:
    """This device's (1,) int32 count of saturated calls not yet drained into ``counters``."""
    with _GLOBAL_LOCK:
        found = _GLOBAL.get(device)
        if found is None:
            found = _GLOBAL[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return found


def saturated_total(discard: bool = False) -> int:
    """Saturated calls counted on the devices since the last drain, moved to the host (a sync per
    device that has any counter; skipped while a CUDA graph is being captured). ``counters``
    calls this from ``stats()`` and ``reset_stats()``."""
    with _GLOBAL_LOCK:
        found = list(_GLOBAL.values())
    total = 0
    for t in found:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            continue
        n = int(t.item())
        if n:
            t.sub_(n)  # the increments still in flight are kept; only what was read is taken
            total += n
    return total


counters.register_drain("fp8_saturated", saturated_total)


# ---------------------------------------------------------------------------- the definition
def _bits(value: float) -> tuple[int, int]:
    """(biased exponent, mantissa) of ``value`` as fp32."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


#: The biased fp32 exponent and the mantissa bits of each format's largest value.
TOP_BITS = {dtype: _bits(top) for dtype, top in FORMAT_MAX.items()}


def pow2_below(b: torch.Tensor, dtype, top: float | None = None) -> torch.Tensor:
    """The largest power of 2 at most top / ``b`` (fp32 ``b`` >= 1e-30, finite), exactly: from the
    exponent and mantissa bits of ``b`` and top (``dtype``'s largest value unless ``top`` is given),
    so no rounding of log2 or of a division moves it."""
    top_exp, top_mant = TOP_BITS[dtype] if top is None else _bits(top)
    bits = b.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    over = ((bits & 0x7FFFFF) > top_mant).to(torch.int32)
    return ((top_exp - exp + 127 - over) << 23).view(torch.float32)


def _current_scale(amax: torch.Tensor, dtype, margin: float) -> torch.Tensor:
    scale = pow2_below((amax * margin).clamp(min=_TINY), dtype)
    return torch.where(amax > 0, scale, 1.0).where(torch.isfinite(amax), float("nan"))


def _amax(x: torch.Tensor) -> torch.Tensor:
    if not x.numel():
        return x.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(x, float("inf")).float()  # NaN if any NaN, inf if any inf


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of its storage exactly (a permutation of a contiguous
    layout). The stored result has the strides of a dense ``x``; any other ``x`` is made contiguous
    first (every implementation, and the op's fake kernel, agree on that)."""
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    work = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()  # a power of 2 is exact in bf16
    stored = (work * scale.to(work.dtype)).to(dtype)
    if stored.stride() != x.stride():  # size-1 dims: keep x's strides exactly, as the other paths do
        stored = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device).copy_(stored)
    return stored


def _current_torch(x, dtype, margin):
    amax = _amax(x)
    scale = _current_scale(amax, dtype, margin)
    return _cast(x, scale, dtype), (1.0 / scale).reshape(1), amax


def _delayed_torch(x, dtype, hist_amax, hist_row, hist_sat, total, slot: int, margin: float):
    rows = hist_amax.shape[0]
    top = FORMAT_MAX[dtype]
    hmax = hist_amax[:, slot].amax()
    fresh = hmax == 0
    delayed = torch.where(fresh, 1.0, pow2_below((hmax * margin).clamp(min=_TINY), dtype))
    amax = _amax(x)
    now = _current_scale(amax, dtype, 1.0)
    finite = torch.isfinite(amax)
    saturated = ~fresh & finite & (amax * delayed > top)
    under = ~fresh & finite & (amax > 0) & (delayed * UNDER < now)
    scale = torch.where(fresh | ~finite | saturated | under, now, delayed)
    stored = _cast(x, scale, dtype)
    row = hist_row[slot].long()
    hist_amax.view(-1).index_copy_(0, (row * hist_amax.shape[1] + slot).view(1),
                                   torch.where(finite, amax, 0.0).view(1))
    hist_row[slot:slot + 1].add_(1).remainder_(rows)
    hist_sat[slot:slot + 1].add_(saturated.to(torch.int32))
    total.add_(saturated.to(torch.int32))
    return stored, (1.0 / scale).reshape(1), amax


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"current": _current_torch, "delayed": _delayed_torch}[name]
    return torch.compile(fn, dynamic=True)


_TRITON: list = []  # [whether triton imports], once known


def triton_available() -> bool:
    """Whether ``triton`` imports here (it ships with torch's CUDA builds, not with its CPU ones);
    found once. A plain memo, not ``functools.lru_cache``: torch.compile refuses to trace through
    that wrapper under ``fullgraph=True`` (GPU run 57)."""
    if not _TRITON:
        try:
            import triton  # noqa: F401
        except Exception:  # an ImportError, or a broken install: the torch path serves
            _TRITON.append(False)
        else:
            _TRITON.append(True)
    return _TRITON[0]


def choose(impl: str, x: torch.Tensor) -> str:
    """The implementation that runs for ``impl`` (one of ``IMPLS``) on ``x``: ``triton`` and
    ``compiled`` need a CUDA tensor and triton; ``auto`` is ``triton`` only on a ``VERIFIED``
    device; otherwise ``torch``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    fast = x.device.type == "cuda" and triton_available()
    if impl == "auto":
        usable = fast and not _BROKEN and torch.cuda.get_device_capability(x.device) in VERIFIED
        return "triton" if usable else "torch"
    return impl if fast else "torch"


#: Set when the Triton kernels failed to compile or launch here (a machine without a C compiler,
#: which triton needs for its launcher, or a triton too old for the kernels): ``auto`` then stays
#: on the torch path for the rest of the process; ``triton`` asked for by name raises.
_BROKEN: list = []
#: What a kernel that cannot be built raises besides triton's own errors (``build_errors``): its C
#: compiler's and loader's errors are RuntimeError / subprocess / OS errors. A CUDA error
#: (``torch.AcceleratorError``, an earlier kernel's fault surfacing here) and running out of memory
#: are raised as they are.
TRITON_ERRORS = (ImportError, RuntimeError, OSError, SubprocessError)
_RAISED_AS_IS = tuple(t for t in (getattr(torch, "AcceleratorError", None), torch.cuda.OutOfMemoryError) if t)


def build_errors() -> tuple:
    """``TRITON_ERRORS`` and, once triton is imported, ``triton.errors.TritonError`` (its
    CompilationError, PTXASError and OutOfResources derive from it, not from RuntimeError): what an
    ``except`` around a Triton launch catches as a kernel that cannot be built here."""
    errors = sys.modules.get("triton.errors")
    found = getattr(errors, "TritonError", None) if errors is not None else None
    return TRITON_ERRORS + ((found,) if isinstance(found, type) else ())


def triton_failure() -> str | None:
    """Why the Triton kernels were given up in this process (``auto``), or None."""
    return _BROKEN[0] if _BROKEN else None


def _triton():
    from . import fp8_quant_triton

    return fp8_quant_triton


def triton_failed(asked: str, exc: BaseException) -> None:
    """After the Triton kernels failed (a build fails before a launch writes anything the torch path reads):
    raise for ``triton`` asked for by name, else (``auto``) fall back to the torch path for good,
    logged once."""
    if asked != "auto" or isinstance(exc, _RAISED_AS_IS):
        raise exc
    _BROKEN.append(f"{type(exc).__name__}: {exc}")
    counters.log_once(("fp8_quant", "triton_broken"), logging.WARNING,
                      "FP8 quantisation: the Triton kernels failed here (%s: %s); quantising with aten ops "
                      "from now on (CUDNN_SDPA_PROVIDER_FP8_QUANT=torch skips the attempt)", type(exc).__name__,
                      str(exc).splitlines()[0] if str(exc) else "")


def _check(x, dtype, margin):
    if dtype not in FORMAT_MAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not (margin >= 1.0):
        raise ValueError(f"margin must be >= 1, got {margin!r}")


def current(x: torch.Tensor, dtype=torch.float8_e4m3fn, *, margin: float = 1.0, impl: str | None = None):
    """(stored ``dtype``, descale (1,) fp32, amax () fp32) of ``x`` with current scaling (module doc).
    ``impl``: one of ``IMPLS``; None reads ``CUDNN_SDPA_PROVIDER_FP8_QUANT``."""
    _check(x, dtype, margin)
    x = x.detach()
    if not dense(x):
        x = x.contiguous()
    asked = impl or env.fp8_quant()
    which = choose(asked, x)
    if which == "triton":
        try:
            return _triton().current(x, dtype, margin)
        except build_errors() as exc:
            triton_failed(asked, exc)
    if which == "compiled":
        return _compiled("current")(x, dtype, margin)
    return _current_torch(x, dtype, margin)


def delayed(x: torch.Tensor, dtype, history: History, slot: int, *, margin: float = 1.0, impl: str | None = None):
    """(stored, descale (1,), amax ()) of ``x`` with delayed scaling from ``history``'s ``slot``,
    which it updates on the device (module doc); no host sync."""
    _check(x, dtype, margin)
    x = x.detach()
    if not dense(x):
        x = x.contiguous()
    total = saturation_counter(x.device)
    asked = impl or env.fp8_quant()
    which = choose(asked, x)
    if which == "triton":
        try:
            return _triton().delayed(x, dtype, history, slot, margin, total, UNDER)
        except build_errors() as exc:
            triton_failed(asked, exc)
    fn = _compiled("delayed") if which == "compiled" else _delayed_torch
    return fn(x, dtype, history.amax, history.row, history.saturated, total, slot, margin)


# ------------------------------------------------------------------ the forward's inputs together
class Inputs(NamedTuple):
    """What ``csp.fp8.attention``'s forward needs from bf16 q, k, v: q8, k8, v8 in FP8, their
    descales, O's scale (``O_HEADROOM``) and descale, ``poison`` (0, or NaN when q, k or v held an inf
    or NaN: added to the factors that turn results back, it makes them NaN whatever a kernel does with
    NaN operands) and ``out_factor`` = descale_o + poison; each factor a (1,) fp32 tensor."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor
    scale_o: torch.Tensor
    descale_o: torch.Tensor
    poison: torch.Tensor
    out_factor: torch.Tensor


def forward_factors(descale_q, descale_k, descale_v, amax_v) -> tuple:
    """(scale_o, descale_o, poison, out_factor), (1,) fp32 each, from the descales and max |V| (aten ops)."""
    amax_v = amax_v.float().reshape(1)
    top = FORMAT_MAX[torch.float8_e4m3fn] * O_HEADROOM
    scale_o = pow2_below(amax_v.clamp(min=_TINY), torch.float8_e4m3fn, top)
    scale_o = torch.where((amax_v > 0) & torch.isfinite(amax_v), scale_o, 1.0)
    descale_o = 1.0 / scale_o
    bad = torch.isnan(torch.cat([d.reshape(1).float() for d in (descale_q, descale_k, descale_v)])).any()
    poison = torch.where(bad, float("nan"), 0.0).reshape(1)
    return scale_o, descale_o, poison, descale_o + poison


def grouped(impl: str, x: torch.Tensor) -> bool:
    """Whether ``impl`` takes the grouped kernels (``attention_inputs``, ``dequantize``) for ``x``:
    the Triton implementation, and under ``auto`` only on a ``GROUPED_VERIFIED`` device."""
    if choose(impl, x) != "triton":
        return False
    return impl == "triton" or torch.cuda.get_device_capability(x.device) in GROUPED_VERIFIED


def attention_inputs(q, k, v, dtype=torch.float8_e4m3fn, history: History | None = None, *, first: int = 0,
                     margin: float = 1.0, impl: str | None = None) -> Inputs:
    """q, k, v in FP8 with the forward's factors (``Inputs``): each as ``current`` at ``margin``
    (``history`` None) or ``delayed`` from ``history``'s slots ``first``, ``first`` + 1, ``first`` + 2,
    with the bits, descales and history updates those give one tensor at a time. Where ``grouped``,
    in two Triton launches for the three tensors with the factors written by the second; else one
    tensor at a time and ``forward_factors``."""
    for x in (q, k, v):
        _check(x, dtype, margin)
    if history is not None and not 0 <= first <= history.amax.shape[1] - 3:
        raise ValueError(f"first must leave three history slots (0 to {history.amax.shape[1] - 3}), got {first}")
    q, k, v = (x.detach() if dense(x) else x.detach().contiguous() for x in (q, k, v))
    asked = impl or env.fp8_quant()
    if grouped(asked, q):
        try:
            total = saturation_counter(q.device) if history is not None else None
            q8, k8, v8, factors, _ = _triton().inputs(q, k, v, dtype, margin, history, first, total, UNDER,
                                                      FORMAT_MAX[torch.float8_e4m3fn] * O_HEADROOM)
            return Inputs(q8, k8, v8, *(factors[i, :1] for i in range(len(FACTORS))))
        except build_errors() as exc:
            triton_failed(asked, exc)
    if history is None:
        done = [current(x, dtype, margin=margin, impl=asked) for x in (q, k, v)]
    else:
        done = [delayed(x, dtype, history, first + i, margin=margin, impl=asked) for i, x in enumerate((q, k, v))]
    (q8, dq, _), (k8, dk, _), (v8, dv, amax_v) = done
    return Inputs(q8, k8, v8, dq, dk, dv, *forward_factors(dq, dk, dv, amax_v))


def dequantize(x: torch.Tensor, factor: torch.Tensor, dtype, *, impl: str | None = None) -> torch.Tensor:
    """float8_e4m3fn ``x`` x ``factor`` ((1,) fp32) in ``dtype``: the bits of
    ``x.to(dtype) * factor.to(dtype)``, in one Triton pass where ``grouped``."""
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x must be float8_e4m3fn, got {x.dtype}")
    asked = impl or env.fp8_quant()
    if dense(x) and grouped(asked, x):
        try:
            return _triton().dequantize(x, factor, dtype)
        except build_errors() as exc:
            triton_failed(asked, exc)
    return x.to(dtype) * factor.to(dtype)
