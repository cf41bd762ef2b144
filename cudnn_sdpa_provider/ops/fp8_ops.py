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
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from ..engine import fp8_cudnn
from . import fp8_reference, dense_varlen as ops, route
from ..core import layout, scope, support
from ..engine.binding import tensor_key

__all__ = ["fp8_fwd", "fp8_bwd", "problem", "kernels", "register", "ATTEMPTS", "E4M3_MAX"]

E4M3_MAX = fp8_reference.FORMAT_MAX[torch.float8_e4m3fn]
ATTEMPTS = 4
UNDER = 16.0  # a recipe's scale this much smaller than this call's amax allows is re-run too
_ON_CPU = route.fixed("no_cuda", "inputs are on the CPU")
#: The recipes by id, held strongly so that a recipe only a pending backward needs (one created
#: inline in the call) is still there when the backward runs; the ``KEEP`` most recently used stay.
_RECIPES: "OrderedDict[int, object]" = OrderedDict()
_RECIPES_LOCK = threading.Lock()
_IDS = itertools.count(1)
KEEP = 4096


def register(recipe) -> int:
    """An id for ``recipe`` (anything with ``state(device) -> (5,) fp32 tensor``)."""
    with _RECIPES_LOCK:
        rid = next(_IDS)
        _RECIPES[rid] = recipe
        while len(_RECIPES) > KEEP:
            _RECIPES.popitem(last=False)
    return rid


def _state(recipe: int, device) -> Optional[Tensor]:
    if not recipe:
        return None
    with _RECIPES_LOCK:
        holder = _RECIPES.get(recipe)
        if holder is not None:
            _RECIPES.move_to_end(recipe)
    if holder is None:
        raise RuntimeError(f"cudnn_sdpa::fp8_bwd: recipe {recipe} was dropped ({KEEP} recipes used since; reuse one "
                           "csp.fp8.Recipe per model or layer rather than one per call)")
    return holder.state(device)


def problem(q, k, v, padded: bool, backward: bool, grad_dtype=None) -> support.Problem:
    dtypes = (q.dtype, k.dtype, v.dtype) + ((grad_dtype,) if grad_dtype is not None else ())
    return support.Problem(
        kind="fp8", backward=backward, device_type=q.device.type, dtypes=dtypes, batch=q.shape[0], h_q=q.shape[1],
        h_k=k.shape[1], h_v=v.shape[1], s_q=q.shape[2], s_kv=k.shape[2], d_qk=q.shape[3], d_v=v.shape[3],
        padded=padded, empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0)


def _entry(kind, q, k, v, padded, causal, grad_dtype=None) -> route.Entry:
    signature = (kind, q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), padded, causal, grad_dtype)
    return route.entry(signature, lambda: problem(q, k, v, padded, kind == "op_fp8_bwd", grad_dtype), q.device.index)


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
    found = _entry("op_fp8_fwd", q, k, v, seq_len_q is not None, is_causal)
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
    """Scales (powers of 2) that keep ``margin`` x ``amax`` within float8_e4m3fn; 1 where amax is 0."""
    return fp8_reference.pow2_scale(amax.float() * margin, E4M3_MAX)


def _bwd(found, grad_out, q, k, v, out, lse, descales, scales, recipe, seq_len_q, seq_len_kv, scale, scale_s, margin,
         is_causal, fallback):
    state = _state(recipe, q.device)

    def once(use):
        if found is not _ON_CPU and found.first is None:
            return fp8_cudnn.backward(grad_out, q, k, v, out, lse, descales, use, seq_len_q, seq_len_kv, scale=scale,
                                      scale_s=scale_s, causal=is_causal)
        return fp8_reference.backward(grad_out, q, k, v, out, descales, use, seq_len_q, seq_len_kv, scale, scale_s,
                                      is_causal, (torch.float8_e4m3fn,) * 3)

    def adaptive():
        use = _scales_from(state[:4], margin) if state is not None else scales.float().clone()  # never an alias
        # an operand with an inf or NaN (a NaN descale, fp8._current) makes every gradient NaN: no
        # scale can fix that, so no re-run, and its amax (NaN, or whatever a kernel's max made of
        # NaN) must not become the recipe's state for the next calls (issue #29)
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
    found = _entry("op_fp8_bwd", q, k, v, seq_len_q is not None, is_causal, grad_out.dtype)
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


_KERNELS = {"fwd": {"cuda": _fp8_fwd_cuda, "cpu": _fp8_fwd_cpu}, "bwd": {"cuda": _fp8_bwd_cuda, "cpu": _fp8_bwd_cpu}}


def kernels(q: Tensor):
    """(forward, backward) callables for a call on ``q``: the kernels themselves for plain eager
    tensors (no dispatcher round trip: the op's Python dispatch costs more than cuDNN's execute at
    small shapes), else the ops (compiling, tracing, fake or meta tensors)."""
    if ops.eager(q):
        return _KERNELS["fwd"][q.device.type], _KERNELS["bwd"][q.device.type]
    return torch.ops.cudnn_sdpa.fp8_fwd, torch.ops.cudnn_sdpa.fp8_bwd
