"""Custom ops ``cudnn_sdpa::fp8_fwd`` and ``cudnn_sdpa::fp8_bwd``: FP8 attention with per-tensor scales.

Their CUDA kernels hand the call to ``route`` (paths ``fp8_fwd``, ``fp8_bwd``): served on cuDNN's
FP8 graphs (``fp8_cudnn``) or, with a reason, run on ``fp8_reference`` (aten ops that quantise
where the graph does); ``fallback=False`` (strict) refuses instead. CPU kernels always run the
reference (reason ``no_cuda``), which makes the fake kernels, ``opcheck`` and the recipe testable
on CPU. The ops have no autograd formula of their own: ``fp8.attention`` wraps them in one.

``fp8_bwd`` with a ``recipe`` (the id ``register`` gave a ``csp.fp8.Recipe``, whose per-device (5,)
fp32 state holds the last backward's amax of dQ, dK, dV, dS and a count of re-runs; 0: none)
chooses its scales from that state (largest FP8 value / (margin x amax)), checks
the amax values cuDNN returns against them (one host-device sync) and re-runs with scales from
this call's amax when an output would have saturated, or when its scale is more than ``UNDER``
times smaller than the amax allows (small values would flush to 0; a recipe's first call, with
no amax yet, starts at scale 1), at most ``ATTEMPTS`` runs in all; then it writes this call's
amax back into the state (scales are powers of 2). No saturated gradient is ever returned: a call
still off after the last attempt raises. Without a recipe the given ``scales`` are used once. The
state is the kernel's own side effect, like the counters, not an argument the op mutates: several
backwards of one compiled graph may update it, which torch.compile cannot express for an input.

A recipe with ``scaling="delayed"`` keeps an amax history (``Recipe.history``, ``fp8_quant.History``):
``fp8_quantize`` (q, k, v, dO, slots 0-3) quantises from it and updates it on the device, and
``fp8_bwd``, after the recipe's first backward on a device (the adaptive one above, which starts
the history), takes its scales from it (slots 4-7: amax per unit of the operands' descales,
``_predicted``), runs once and records this call's amax, with no host sync; a call whose scale
clipped is counted, not re-run. Those scales and books are ``_grad_scales`` / ``_grad_books`` in
aten ops, or their single-program Triton twins (``fp8_grad_triton``) where ``fp8_quant.grouped``.

A padded call (``seq_len_q`` / ``seq_len_kv``) that cuDNN would serve first reads its lengths (one
host sync, ``empty_sequence``): cuDNN faults or hangs on a zero-length sequence, so such a call runs
the reference with ``cudnn_known_issue`` (``core.known_issues``). A padded backward runs the
reference on cuDNN 9.14+ (sm_90+) anyway: the same table's padded-backward row (wrong dK/dV).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from ..engine import fp8_cudnn
from . import fp8_quant, fp8_reference, dense_varlen as ops, route
from ..core import env, layout, scope, support
from ..engine.binding import tensor_key

__all__ = ["fp8_fwd", "fp8_bwd", "fp8_quantize", "quantize", "quantize_inputs", "dequantize", "dequantize_grads",
           "grad_factors", "problem", "kernels", "register", "ATTEMPTS", "E4M3_MAX", "GRAD_SLOTS"]

E4M3_MAX = fp8_reference.FORMAT_MAX[torch.float8_e4m3fn]
ATTEMPTS = 4
UNDER = 16.0  # a recipe's scale this much smaller than this call's amax allows is re-run too
_ON_CPU = route.fixed("no_cuda", "inputs are on the CPU")
#: A delayed recipe's history slots: q, k, v, dO (0-3, ``fp8_quantize``), dQ, dK, dV, dS (4-7, ``fp8_bwd``).
SLOTS = 8
GRAD_SLOTS = (4, 8)
#: The recipes by id, held strongly so that a recipe only a pending backward needs (one created
#: inline in the call) is still there when the backward runs; the ``KEEP`` most recently used stay.
_RECIPES: "OrderedDict[int, object]" = OrderedDict()
_RECIPES_LOCK = threading.Lock()
_IDS = itertools.count(1)
KEEP = 4096


_PINNED: dict = {}  # recipes never dropped (the one ``attention`` uses when given none)


def register(recipe, pinned: bool = False) -> int:
    """An id for ``recipe`` (a ``csp.fp8.Recipe``: ``state``, ``history``, ``warm``, ``scaling``)."""
    with _RECIPES_LOCK:
        rid = next(_IDS)
        if pinned:
            _PINNED[rid] = recipe
            return rid
        _RECIPES[rid] = recipe
        while len(_RECIPES) > KEEP:
            _RECIPES.popitem(last=False)
    return rid


def _holder(recipe: int):
    if not recipe:
        return None
    with _RECIPES_LOCK:
        holder = _RECIPES.get(recipe) or _PINNED.get(recipe)
        if recipe in _RECIPES:
            _RECIPES.move_to_end(recipe)
    if holder is None:
        raise RuntimeError(f"cudnn_sdpa::fp8: recipe {recipe} was dropped ({KEEP} recipes used since; reuse one "
                           "csp.fp8.Recipe per model or layer rather than one per call)")
    return holder


def problem(q, k, v, padded: bool, backward: bool, grad_dtype=None) -> support.Problem:
    dtypes = (q.dtype, k.dtype, v.dtype) + ((grad_dtype,) if grad_dtype is not None else ())
    return support.Problem(
        kind="fp8", backward=backward, device_type=q.device.type, dtypes=dtypes, batch=q.shape[0], h_q=q.shape[1],
        h_k=k.shape[1], h_v=v.shape[1], s_q=q.shape[2], s_kv=k.shape[2], d_qk=q.shape[3], d_v=v.shape[3],
        padded=padded, empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0)


def _entry(kind, q, k, v, padded, causal, grad_dtype=None, lengths=None) -> route.Entry:
    """The call's route entry; for a padded call (``lengths`` its (seq_len_q, seq_len_kv)) that cuDNN
    would serve, the lengths are read first (``empty_sequence``)."""
    signature = (kind, q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), padded, causal, grad_dtype)
    make = lambda: problem(q, k, v, padded, kind == "op_fp8_bwd", grad_dtype)  # noqa: E731
    found = route.entry(signature, make, q.device.index)
    if lengths is not None and found.first is None:
        return with_lengths(found, signature, make, q.device.index, *lengths)
    return found


def with_lengths(found: route.Entry, signature: tuple, make, device_index, len_q: Tensor, len_kv: Tensor):
    """A served padded call's entry once its lengths are read: ``found``, or, with an empty sequence
    (``empty_sequence``), the entry of the same problem marked ``empty_sequence`` (its known-issues
    reason). The one rule for the dense ops and the packed forward."""
    if not empty_sequence(len_q, len_kv):
        return found
    return route.entry(signature + ("empty_sequence",), lambda: dataclasses.replace(make(), empty_sequence=True),
                       device_index)


def empty_sequence(len_q: Tensor, len_kv: Tensor) -> bool:
    """Whether a padded FP8 call has a sequence of no tokens (a length <= 0): cuDNN faults or hangs on
    it (``known_issues``, the zero-length row), so such a call runs the reference. One host sync:
    the lengths are data. While the lengths' device captures a CUDA graph nothing can be read: True,
    so a captured padded call never reaches cuDNN with lengths nobody checked (it runs the reference)."""
    if len_q.is_cuda:
        with torch.cuda.device(len_q.device):
            if torch.cuda.is_current_stream_capturing():
                return True
    return bool(((len_q <= 0).any() | (len_kv <= 0).any()).item())


def _describe(q, k, v, causal):
    return lambda: route.describe_call(q=q, k=k, v=v, is_causal=causal)


def _fwd(found, q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s, is_causal,
         compute_lse, fallback):
    serve = None if found is _ON_CPU else (lambda: fp8_cudnn.forward(
        q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale=scale, scale_s=scale_s,
        causal=is_causal, compute_lse=compute_lse))
    return route.call("fp8_fwd", found, serve, lambda reason: fp8_reference.forward(
        q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s, is_causal,
        compute_lse), _describe(q, k, v, is_causal), strict=not fallback or scope.strict())


def _fp8_fwd_cuda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    descale_q: Tensor,
    descale_k: Tensor,
    descale_v: Tensor,
    scale_o: Tensor,
    seq_len_q: Optional[Tensor],
    seq_len_kv: Optional[Tensor],
    scale: float,
    scale_s: float,
    is_causal: bool,
    compute_lse: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """FP8 attention forward: (out float8_e4m3fn (B, H_q, S_q, D_v), lse (B, H_q, S_q, 1) fp32 or (0,),
    amax (2,) fp32 [softmax probability, |out|])."""
    found = _entry("op_fp8_fwd", q, k, v, seq_len_q is not None, is_causal,
                   lengths=None if seq_len_q is None else (seq_len_q, seq_len_kv))
    return _fwd(found, q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s,
                is_causal, compute_lse, fallback)


fp8_fwd = torch.library.custom_op("cudnn_sdpa::fp8_fwd", _fp8_fwd_cuda, mutates_args=(), device_types="cuda")


@fp8_fwd.register_kernel("cpu")
def _fp8_fwd_cpu(q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s, is_causal,
                 compute_lse, fallback):
    return _fwd(_ON_CPU, q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s,
                is_causal, compute_lse, fallback)


@fp8_fwd.register_fake
def _fp8_fwd_fake(q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s, is_causal,
                  compute_lse, fallback):
    b, h, s_q, _ = q.shape
    out = layout.dense_out(q, (b, h, s_q, v.shape[3]), torch.float8_e4m3fn)  # as fp8_cudnn and the reference
    lse = q.new_empty((b, h, s_q, 1) if compute_lse else (0,), dtype=torch.float32)
    return out, lse, q.new_empty((2,), dtype=torch.float32)


def _scales_from(amax: Tensor, margin: float) -> Tensor:
    """Scales that keep ``margin`` x ``amax`` within float8_e4m3fn: the largest power of 2 at most
    448 / (margin x amax), exactly (``fp8_quant.pow2_below``); 1 where that is 0 or not finite."""
    b = amax.float() * margin
    return torch.where(torch.isfinite(b) & (b > 0), fp8_quant.pow2_below(b.clamp(min=1e-30), torch.float8_e4m3fn), 1.0)


#: over = amax x scale x this: an output's largest stored magnitude over the format's top (> 1: clipped).
_INV_TOP = 1.0 / E4M3_MAX


def _per_unit(descales) -> Tensor:
    """(4,) fp64: what dQ, dK, dV, dS scale with, from this call's descales (q, k, v, o, dO): the
    gradients are linear in dO, dS in dO x V, dQ in dO x V x K, dK in dO x V x Q (P is bounded)."""
    q, k, v, _, do = (d.reshape(()).double() for d in descales)
    return torch.stack([do * v * k, do * v * q, do, do * v])


def _predicted(history, unit: Tensor) -> Tensor:
    """dQ, dK, dV, dS amax expected now: the largest recorded amax per unit (``_record``) times
    this call's unit, so a jump in dO, q, k or v that their own scales saw moves the gradients'
    scales with it before the backward runs (no host sync)."""
    return (history.amax[:, GRAD_SLOTS[0]:GRAD_SLOTS[1]].amax(0).double() * unit).clamp(max=3e38).float()


def _record(history, amax: Tensor, unit: Tensor, finite: Tensor, saturated: Tensor, flushed=None) -> None:
    """This backward's dQ, dK, dV, dS amax per unit of its operands' descales (0 where not finite)
    into the next row of the history's gradient slots; one saturated call counted (``saturated[4]``
    and ``stats()``) if any scale clipped, one in ``saturated[5]`` if any was more than ``UNDER``
    times too small (small values flushed to 0): on the device."""
    rows, slots = history.amax.shape
    row = history.row[GRAD_SLOTS[0]].long()
    where = row * slots + torch.arange(GRAD_SLOTS[0], GRAD_SLOTS[1], device=amax.device)
    value = (amax.double() / unit).clamp(max=3e38).float()
    history.amax.view(-1).index_copy_(0, where, torch.where(finite & torch.isfinite(value), value, 0.0))
    history.row[GRAD_SLOTS[0]:GRAD_SLOTS[1]].add_(1).remainder_(rows)
    history.saturated[GRAD_SLOTS[0]:GRAD_SLOTS[0] + 1].add_(saturated.to(torch.int32))
    if flushed is not None:
        history.saturated[GRAD_SLOTS[0] + 1:GRAD_SLOTS[0] + 2].add_(flushed.to(torch.int32))
    fp8_quant.saturation_counter(amax.device).add_(saturated.to(torch.int32))


def _grad_scales(history, descales, margin: float) -> tuple[Tensor, Tensor]:
    """A warm delayed recipe's (scales (4,) fp32 for dQ, dK, dV, dS; unit (4,) fp64): ``_predicted``
    at this call's ``_per_unit``, x ``margin`` (aten ops; ``fp8_grad_triton.grad_scales`` is its twin)."""
    unit = _per_unit(descales)
    return _scales_from(_predicted(history, unit), margin), unit


def _grad_books(history, amax: Tensor, use: Tensor, unit: Tensor, descales, margin: float) -> None:
    """After a warm delayed backward at scales ``use`` with amax ``amax`` (dQ, dK, dV, dS): the
    history's next row (``_record``), a clipped call counted, and one whose scale was more than
    ``UNDER`` times too small (as the current recipe's re-run test) counted as flushed; nothing
    recorded for non-finite operands (aten ops; ``fp8_grad_triton.grad_books`` is its twin)."""
    finite = torch.isfinite(torch.cat([d.reshape(-1).float() for d in descales])).all()
    ok = finite & torch.isfinite(amax)
    over = amax * use * _INV_TOP
    # a clipped dS makes dQ and dK (and their amax) smaller by up to its overshoot: record them as if not
    seen = amax * torch.cat([over[3:].clamp(min=1.0).expand(2), over.new_ones(2)])
    flushed = ok & (amax > 0) & (over * margin * UNDER < 1)
    _record(history, seen, unit, ok, (ok & (over > 1)).any(), flushed.any())


def _fused(q: Tensor) -> str | None:
    """The asked implementation when a warm delayed backward on ``q`` takes ``fp8_grad_triton``
    (where ``fp8_quant.grouped``), else None."""
    asked = env.fp8_quant()
    return asked if fp8_quant.grouped(asked, q) else None


def _warm(asked: str | None, name: str, aten, *args):
    """``fp8_grad_triton.<name>(*args)`` where ``asked`` (``_fused``), else ``aten(*args)``; a kernel
    that cannot be built falls back to the aten code as ``fp8_quant`` does."""
    if asked:
        try:
            from . import fp8_grad_triton

            return getattr(fp8_grad_triton, name)(*args)
        except fp8_quant.build_errors() as exc:
            fp8_quant.triton_failed(asked, exc)
    return aten(*args)


def _bwd(found, grad_out, q, k, v, out, lse, descales, scales, recipe, seq_len_q, seq_len_kv, scale, scale_s, margin,
         is_causal, fallback):
    holder = _holder(recipe)
    state = holder.state(q.device) if holder is not None else None
    delayed = holder is not None and holder.scaling == "delayed"

    def once(use):
        if found is not _ON_CPU and found.first is None:
            return fp8_cudnn.backward(grad_out, q, k, v, out, lse, descales, use, seq_len_q, seq_len_kv, scale=scale,
                                      scale_s=scale_s, causal=is_causal)
        return fp8_reference.backward(grad_out, q, k, v, out, descales, use, seq_len_q, seq_len_kv, scale, scale_s,
                                      is_causal, (torch.float8_e4m3fn,) * 3)

    def adaptive():
        # an operand with an inf or NaN (a NaN descale, fp8._current) makes every gradient NaN: no
        # scale can fix that, so no re-run, and its amax (NaN, or whatever a kernel's max made of
        # NaN) must not become the recipe's state for the next calls (issue #29)
        if delayed and holder.warm(q.device):  # scales from the history; checked on the device only
            history = holder.history(q.device)
            asked = _fused(q)
            use, unit = _warm(asked, "grad_scales", _grad_scales, history, descales, margin)
            dq, dk, dv, amax = once(use)
            _warm(asked, "grad_books", _grad_books, history, amax, use, unit, descales, margin)
            # the op's output is contiguous, as its fake kernel says (the Triton twin's is one 16-byte row each)
            return dq, dk, dv, use.contiguous(), amax
        use = _scales_from(state[:4], margin) if state is not None else scales.float().clone()  # never an alias
        finite = torch.isfinite(torch.cat([d.reshape(-1).float() for d in descales])).all()
        for attempt in range(ATTEMPTS if state is not None else 1):
            dq, dk, dv, amax = once(use)
            if state is None:
                return dq, dk, dv, use, amax
            over = amax * use > E4M3_MAX
            # scales more than UNDER below what this call's amax allows flush small values to 0
            bad = (over | ((amax > 0) & (amax * use * margin * UNDER < E4M3_MAX))) & finite
            if not bool(bad.any()):  # the one host-device sync of a recipe's backward
                state[:4].copy_(torch.where(finite & torch.isfinite(amax), amax, state[:4]))
                state[4].add_(attempt)
                if delayed:  # the first backward of a delayed recipe: its history starts here
                    ok = finite & torch.isfinite(amax)
                    _record(holder.history(q.device), amax, _per_unit(descales), ok,
                            torch.zeros((), dtype=torch.bool, device=q.device))
                    if bool(ok.all()):
                        holder.warm(q.device, True)
                return dq, dk, dv, use, amax
            use = torch.where(bad, _scales_from(amax, margin), use)
        raise RuntimeError(f"cudnn_sdpa::fp8_bwd: FP8 gradient scales still off (saturating or underflowing) after {ATTEMPTS} runs "
                           f"(amax dq/dk/dv/ds {amax.tolist()}); nothing was returned")

    serve = None if found is _ON_CPU else adaptive
    return route.call("fp8_bwd", found, serve, lambda reason: adaptive(), _describe(q, k, v, is_causal),
                      strict=not fallback or scope.strict())


def _fp8_bwd_cuda(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    descale_q: Tensor,
    descale_k: Tensor,
    descale_v: Tensor,
    descale_o: Tensor,
    descale_do: Tensor,
    scales: Optional[Tensor],
    recipe: int,
    seq_len_q: Optional[Tensor],
    seq_len_kv: Optional[Tensor],
    scale: float,
    scale_s: float,
    margin: float,
    is_causal: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FP8 attention backward: (dq, dk, dv float8_e4m3fn, the scales used (4,) [dq, dk, dv, ds], amax (4,))."""
    found = _entry("op_fp8_bwd", q, k, v, seq_len_q is not None, is_causal, grad_out.dtype,
                   None if seq_len_q is None else (seq_len_q, seq_len_kv))
    return _bwd(found, grad_out, q, k, v, out, lse, (descale_q, descale_k, descale_v, descale_o, descale_do), scales,
                recipe, seq_len_q, seq_len_kv, scale, scale_s, margin, is_causal, fallback)


fp8_bwd = torch.library.custom_op("cudnn_sdpa::fp8_bwd", _fp8_bwd_cuda, mutates_args=(), device_types="cuda")


@fp8_bwd.register_kernel("cpu")
def _fp8_bwd_cpu(grad_out, q, k, v, out, lse, descale_q, descale_k, descale_v, descale_o, descale_do, scales, recipe,
                 seq_len_q, seq_len_kv, scale, scale_s, margin, is_causal, fallback):
    return _bwd(_ON_CPU, grad_out, q, k, v, out, lse, (descale_q, descale_k, descale_v, descale_o, descale_do), scales,
                recipe, seq_len_q, seq_len_kv, scale, scale_s, margin, is_causal, fallback)


@fp8_bwd.register_fake
def _fp8_bwd_fake(grad_out, q, k, v, out, lse, descale_q, descale_k, descale_v, descale_o, descale_do, scales, recipe,
                  seq_len_q, seq_len_kv, scale, scale_s, margin, is_causal, fallback):
    grads = tuple(layout.grad_like(t) for t in (q, k, v))  # q, k, v are float8_e4m3fn
    return grads + (q.new_empty((4,), dtype=torch.float32), q.new_empty((4,), dtype=torch.float32))


def _quantize(x: Tensor, dtype: torch.dtype, recipe: int, slot: int, margin: float) -> tuple[Tensor, Tensor, Tensor]:
    """(x in FP8 ``dtype``, descale (1,) fp32, amax () fp32): current scaling at ``margin`` without a
    recipe (0), else the recipe's delayed scaling from its history ``slot`` (``fp8_quant``), whose
    update is this kernel's side effect, as ``fp8_bwd``'s state is."""
    if not recipe:
        return fp8_quant.current(x, dtype, margin=margin)
    return fp8_quant.delayed(x, dtype, _holder(recipe).history(x.device), slot, margin=margin)


fp8_quantize = torch.library.custom_op("cudnn_sdpa::fp8_quantize", _quantize, mutates_args=(),
                                       device_types=("cuda", "cpu"))


@fp8_quantize.register_fake
def _quantize_fake(x, dtype, recipe, slot, margin):
    out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device) if fp8_quant.dense(x) else \
        torch.empty(x.shape, dtype=dtype, device=x.device)
    return out, x.new_empty((1,), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


def quantize(x: Tensor, dtype: torch.dtype, recipe: int = 0, slot: int = 0, margin: float = 1.0):
    """``fp8_quantize`` called directly on plain eager tensors (no dispatcher round trip), else
    through the op (compiling, tracing, fake tensors)."""
    if ops.eager(x):
        return _quantize(x.detach(), dtype, recipe, slot, margin)
    return torch.ops.cudnn_sdpa.fp8_quantize(x, dtype, recipe, slot, margin)


def quantize_inputs(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype, recipe: int = 0,
                    margin: float = 1.0) -> fp8_quant.Inputs:
    """q, k, v in FP8 with the forward's factors (``fp8_quant.attention_inputs``): current scaling at
    ``margin`` without a recipe (0), else the recipe's delayed scaling from its history slots 0-2.
    Plain eager tensors go to ``attention_inputs`` directly (where ``fp8_quant.grouped``, three
    tensors in two launches); others (compiling, tracing, fake tensors) through ``fp8_quantize``."""
    if ops.eager(q, k, v):
        history = _holder(recipe).history(q.device) if recipe else None
        return fp8_quant.attention_inputs(q, k, v, dtype, history, margin=margin)
    (q8, dq, _), (k8, dk, _), (v8, dv, amax_v) = (torch.ops.cudnn_sdpa.fp8_quantize(x, dtype, recipe, slot, margin)
                                                  for slot, x in enumerate((q, k, v)))
    return fp8_quant.Inputs(q8, k8, v8, dq, dk, dv, *fp8_quant.forward_factors(dq, dk, dv, amax_v))


def dequantize(x: Tensor, factor: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype) * factor.to(dtype)``: one Triton pass on plain eager tensors where
    ``fp8_quant.grouped``, aten ops otherwise (and always while compiling or tracing)."""
    return fp8_quant.dequantize(x, factor, dtype, impl=None if ops.eager(x) else "torch")


def grad_factors(use: Tensor, poison: Tensor, descale_do: Tensor) -> Tensor:
    """(4,) fp32: what dQ, dK, dV (and dS) stored at scales ``use`` are multiplied by to turn back:
    1 / scale, NaN where the forward's operands (``poison``) or dO (its descale) were not finite."""
    return 1.0 / use + poison + descale_do.reshape(1).float() * 0.0


def dequantize_grads(dq: Tensor, dk: Tensor, dv: Tensor, use: Tensor, poison: Tensor, descale_do: Tensor,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in ``dtype`` at ``grad_factors``: one Triton launch for the three on plain eager
    tensors where ``fp8_quant.grouped``, aten ops otherwise (the same bits)."""
    asked = env.fp8_quant()
    if ops.eager(dq, dk, dv) and all(fp8_quant.dense(t) for t in (dq, dk, dv)) and fp8_quant.grouped(asked, dq):
        try:
            return _quant_triton().dequantize_grads(dq, dk, dv, use, poison, descale_do, dtype)
        except fp8_quant.build_errors() as exc:
            fp8_quant.triton_failed(asked, exc)
    factor = grad_factors(use, poison, descale_do).to(dtype)
    return tuple(g.to(dtype) * factor[i] for i, g in enumerate((dq, dk, dv)))


def _quant_triton():
    from . import fp8_quant_triton

    return fp8_quant_triton


_KERNELS = {"fwd": {"cuda": _fp8_fwd_cuda, "cpu": _fp8_fwd_cpu}, "bwd": {"cuda": _fp8_bwd_cuda, "cpu": _fp8_bwd_cpu}}


def kernels(q: Tensor):
    """(forward, backward) callables for a call on ``q``: the kernels themselves for plain eager
    tensors (no dispatcher round trip: the op's Python dispatch costs more than cuDNN's execute at
    small shapes), else the ops (compiling, tracing, fake or meta tensors)."""
    if ops.eager(q):
        return _KERNELS["fwd"][q.device.type], _KERNELS["bwd"][q.device.type]
    return torch.ops.cudnn_sdpa.fp8_fwd, torch.ops.cudnn_sdpa.fp8_bwd
