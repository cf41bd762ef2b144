"""Custom ops ``cudnn_sdpa::{dense,varlen}_{fwd,bwd}``: autograd, fake kernels, CPU kernels.

Every kernel hands its call to ``route``: CUDA kernels serve it on our cuDNN graphs (``dense``,
``packed``) or, with a reason, run the aten composite (``composite``); ``fallback=False`` (strict)
refuses instead with ``FallbackError``. A forward marks its LSE (``markers``) with what it did, so
its backward keeps its strictness and, with dropout, runs where the forward ran (cuDNN's mask and
the composite's differ). CPU kernels always run the composite (reason ``no_cuda``);
they make the fake kernels, ``opcheck`` and the autograd wiring testable on a CPU-only machine.

Defining these ops registers the ``cudnn_sdpa`` namespace only; it overrides nothing of torch's.
The package imports this module lazily (on first use), never at package import.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..core import arguments, layout, markers, scope
from . import composite, route
from ..engine import dense, packed
from ..engine.binding import tensor_key
from ..core.errors import NotSupportedError

__all__ = ["dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd", "DenseFunction", "VarlenFunction", "eager"]


_ON_CPU = route.fixed("no_cuda", "inputs are on the CPU")


def _strict_forward(fallback: bool) -> bool:
    """A forward refuses when its caller asked (``fallback=False``) or its scope is strict now (a
    compiled caller cannot read the scope while tracing, so the kernel reads it when it runs)."""
    return not fallback or scope.strict()


def _needs_grad(*tensors) -> bool:
    """Whether a backward will follow (inputs that require grad are visible below autograd too)."""
    return any(t is not None and t.requires_grad for t in tensors)


def _describe(**items):
    return lambda: route.describe_call(**items)


# --------------------------------------------------------------------------------------- dense


def _pair(philox):
    return None if philox is None else (philox[0], philox[1])


def _dense_fwd_cuda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Optional[Tensor],
    bias: Optional[Tensor],
    seq_len_q: Optional[Tensor],
    seq_len_kv: Optional[Tensor],
    philox: Optional[Tensor],
    scale: float,
    dropout_p: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    compute_lse: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor]:
    """Dense attention forward on a cuDNN graph: (out, lse)."""
    window = (window_left, window_right)
    found = _dense_entry("fwd", q, k, v, sinks, bias, seq_len_q, dropout_p, window, bottom_right, False)
    strict = _strict_forward(fallback)
    grad = _needs_grad(q, k, v, sinks)
    backward = None
    if grad and (strict or dropout_p > 0.0):
        backward = _dense_entry("bwd", q, k, v, sinks, bias, seq_len_q, dropout_p, window, bottom_right,
                                torch.are_deterministic_algorithms_enabled())
    if dropout_p > 0.0 and backward is not None and backward.first is not None and found.first is None:
        # cuDNN's dropout mask and the composite's differ: a pair whose backward cannot be served
        # runs its forward on the composite too.
        found = route.fixed(backward.first.slug, f"its backward falls back ({backward.first.message}), and "
                                                 "forward and backward must draw the same dropout mask")

    def serve():
        out, lse = dense.forward(q, k, v, scale=scale, window=window, bottom_right=bottom_right, sinks=sinks, bias=bias,
                                 seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, philox=_pair(philox),
                                 dropout_p=dropout_p, compute_lse=compute_lse)
        if grad:
            markers.mark(lse, markers.Record(served=True, strict=strict))
        return out, lse

    def native(reason):
        out, lse = composite.dense_fwd(q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, window, bottom_right,
                                        philox, dropout_p)
        if grad:
            markers.mark(lse, markers.Record(served=False, reason=reason.slug, strict=strict))
        return out, lse

    return route.call("dense_fwd", found, serve, native,
                      _describe(q=q, k=k, v=v, sinks=sinks, window=window, bottom_right=bottom_right,
                                seq_lens_q=seq_len_q),
                      strict=strict, then=("dense_bwd", backward) if strict and backward is not None else None)


def _dense_entry(kind, q, k, v, sinks, bias, seq_len_q, dropout_p, window, bottom_right, deterministic):
    bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    signature = ("op_dense_" + kind, q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), sinks is not None,
                 tensor_key(bias), bias_grad, seq_len_q is not None, dropout_p, window, bottom_right, deterministic)
    return route.entry(signature, lambda: route.dense_problem(
        q, k, v, backward=kind == "bwd", window=window, bottom_right=bottom_right, sinks=sinks is not None, bias=bias,
        dropout_p=dropout_p, padded=seq_len_q is not None, deterministic=deterministic), q.device.index)


dense_fwd = torch.library.custom_op("cudnn_sdpa::dense_fwd", _dense_fwd_cuda, mutates_args=(), device_types="cuda")


@dense_fwd.register_kernel("cpu")
def _dense_fwd_cpu(q, k, v, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p, window_left, window_right,
                   bottom_right, compute_lse, fallback):
    return route.call("dense_fwd", _ON_CPU, None, lambda reason: composite.dense_fwd(
        q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, (window_left, window_right), bottom_right, philox,
        dropout_p), _describe(q=q, k=k, v=v, sinks=sinks, window=(window_left, window_right), bottom_right=bottom_right,
                              seq_lens_q=seq_len_q), strict=_strict_forward(fallback))


@dense_fwd.register_fake
def _dense_fwd_fake(q, k, v, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p, window_left, window_right,
                    bottom_right, compute_lse, fallback):
    out = layout.dense_out(q, tuple(q.shape[:3]) + (v.shape[3],))
    lse = q.new_empty(tuple(q.shape[:3]) + (1,), dtype=torch.float32)
    return out, lse


def _dense_bwd_cuda(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    sinks: Optional[Tensor],
    bias: Optional[Tensor],
    seq_len_q: Optional[Tensor],
    seq_len_kv: Optional[Tensor],
    philox: Optional[Tensor],
    scale: float,
    dropout_p: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    deterministic: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dense attention backward: (dq, dk, dv, dsinks); dsinks is (H_q,) fp32, or (0,) without sinks."""
    window = (window_left, window_right)
    found = _dense_entry("bwd", q, k, v, sinks, bias, seq_len_q, dropout_p, window, bottom_right, deterministic)
    record = markers.lookup(lse)  # what the forward did (and its strictness), when it ran here
    strict = record.strict if record is not None else not fallback
    if dropout_p > 0.0 and record is not None:
        found = _dropout_pair(found, record)

    def serve():
        try:
            dq, dk, dv, dsinks = dense.backward(grad_out, q, k, v, out, lse, scale=scale, window=window,
                                                bottom_right=bottom_right, sinks=sinks, bias=bias,
                                                seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, philox=_pair(philox),
                                                dropout_p=dropout_p, deterministic=deterministic)
        except NotSupportedError as exc:
            if dropout_p > 0.0 and record is not None and record.served:
                raise _mask_mismatch(exc.reason, exc.detail) from None
            raise
        return dq, dk, dv, (dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32))

    return route.call("dense_bwd", found, serve, lambda reason: composite.dense_bwd(
        grad_out, q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, window, bottom_right, philox, dropout_p),
        _describe(q=q, k=k, v=v, grad_out=grad_out, window=window), strict=strict)


def _dropout_pair(found: route.Entry, record: markers.Record) -> route.Entry:
    """A dropout backward runs where its forward ran: cuDNN's mask and the composite's differ."""
    if not record.served:
        return route.fixed(record.reason, "its forward ran on the composite; the backward must use the same mask")
    if found.first is not None:  # decided otherwise since the forward (e.g. deterministic mode): no right answer
        raise _mask_mismatch(found.first.slug, found.first.message)
    return found


def _mask_mismatch(slug: str, detail: str) -> RuntimeError:
    return RuntimeError(f"cudnn-sdpa-provider: the backward of a dropout forward served on cuDNN cannot run on cuDNN "
                        f"({slug}: {detail}), and any other kernel would draw another dropout mask, giving wrong "
                        "gradients; run the forward without dropout or under the conditions of its backward")


dense_bwd = torch.library.custom_op("cudnn_sdpa::dense_bwd", _dense_bwd_cuda, mutates_args=(), device_types="cuda")


@dense_bwd.register_kernel("cpu")
def _dense_bwd_cpu(grad_out, q, k, v, out, lse, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p,
                   window_left, window_right, bottom_right, deterministic, fallback):
    return route.call("dense_bwd", _ON_CPU, None, lambda reason: composite.dense_bwd(
        grad_out, q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, (window_left, window_right), bottom_right,
        philox, dropout_p), _describe(q=q, k=k, v=v), strict=not fallback)


@dense_bwd.register_fake
def _dense_bwd_fake(grad_out, q, k, v, out, lse, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p,
                    window_left, window_right, bottom_right, deterministic, fallback):
    dsinks = q.new_empty((q.shape[1],) if sinks is not None else (0,), dtype=torch.float32)
    return layout.grad_like(q), layout.grad_like(k), layout.grad_like(v), dsinks


def _dense_setup_context(ctx, inputs, output):
    (q, k, v, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p, window_left, window_right, bottom_right,
     compute_lse, fallback) = inputs
    out, lse = output
    if not compute_lse:
        ctx.lse_missing = True
    # The backward takes no gradient for the LSE (cuDNN's has no such input): mark it, so that a
    # loss on the LSE raises instead of silently getting a zero contribution.
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, sinks, bias, seq_len_q, seq_len_kv, philox)
    ctx.options = (scale, dropout_p, window_left, window_right, bottom_right, fallback)


def _dense_grads(ctx, grad_out, bwd):
    if getattr(ctx, "lse_missing", False):
        raise RuntimeError("cudnn_sdpa::dense_fwd ran with compute_lse=False; its backward needs the LSE")
    q, k, v, out, lse, sinks, bias, seq_len_q, seq_len_kv, philox = ctx.saved_tensors
    scale, dropout_p, window_left, window_right, bottom_right, fallback = ctx.options
    dq, dk, dv, dsinks = bwd(grad_out, q, k, v, out, lse, sinks, bias, seq_len_q, seq_len_kv, philox, scale, dropout_p,
                             window_left, window_right, bottom_right, torch.are_deterministic_algorithms_enabled(),
                             fallback)
    # inputs: q k v sinks bias seq_len_q seq_len_kv philox scale dropout_p wl wr bottom_right compute_lse fallback
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * 11


def _dense_backward(ctx, grad_out, grad_lse):
    return _dense_grads(ctx, grad_out, torch.ops.cudnn_sdpa.dense_bwd)


dense_fwd.register_autograd(_dense_backward, setup_context=_dense_setup_context)


# -------------------------------------------------------------------------------------- varlen


def _varlen_fwd_cuda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    sinks: Optional[Tensor],
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor]:
    """Packed varlen attention forward on a cuDNN graph: (out (T_q, H_q, D_v), lse (T_q, H_q) fp32)."""
    window = (window_left, window_right)
    found = _varlen_entry("fwd", q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, sinks, window, bottom_right,
                          False)
    strict = _strict_forward(fallback)
    grad = _needs_grad(q, k, v, sinks)
    then = None
    if strict and grad:
        then = ("varlen_bwd", _varlen_entry("bwd", q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, sinks, window,
                                            bottom_right, torch.are_deterministic_algorithms_enabled()))

    def serve():
        out, lse = packed.forward(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale=scale,
                                  window=window, bottom_right=bottom_right, sinks=sinks)
        if grad:  # the backward keeps this call's strictness, wherever autograd runs it
            markers.mark(lse, markers.Record(served=True, strict=strict))
        return out, lse

    return route.call("varlen_fwd", found, serve, lambda reason: composite.varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, window, bottom_right),
        _describe(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, window=window), strict=strict, then=then)


def _varlen_entry(kind, q, k, v, cu_q, max_q, max_kv, sinks, window, bottom_right, deterministic):
    signature = ("op_varlen_" + kind, q.device.index, route.varlen_key(q, k, v), cu_q.shape, max_q, max_kv,
                 sinks is not None, window, bottom_right, deterministic)
    return route.entry(signature, lambda: route.varlen_problem(
        q, k, v, cu_q, max_q, max_kv, backward=kind == "bwd", window=window, bottom_right=bottom_right,
        sinks=sinks is not None, deterministic=deterministic), q.device.index)


varlen_fwd = torch.library.custom_op("cudnn_sdpa::varlen_fwd", _varlen_fwd_cuda, mutates_args=(), device_types="cuda")


@varlen_fwd.register_kernel("cpu")
def _varlen_fwd_cpu(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, window_left,
                    window_right, bottom_right, fallback):
    return route.call("varlen_fwd", _ON_CPU, None, lambda reason: composite.varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, (window_left, window_right),
        bottom_right), _describe(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, window=(window_left, window_right)),
        strict=_strict_forward(fallback))


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, window_left,
                     window_right, bottom_right, fallback):
    out = layout.packed_out(q, (q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


def _varlen_bwd_cuda(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    sinks: Optional[Tensor],
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    deterministic: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed varlen attention backward: (dq, dk, dv, dsinks)."""
    window = (window_left, window_right)
    found = _varlen_entry("bwd", q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, sinks, window, bottom_right,
                          deterministic)

    def serve():
        dq, dk, dv, dsinks = packed.backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                             max_seqlen_kv, scale=scale, window=window, bottom_right=bottom_right,
                                             sinks=sinks, deterministic=deterministic)
        return dq, dk, dv, (dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32))

    return route.call("varlen_bwd", found, serve, lambda reason: composite.varlen_bwd(
        grad_out, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, window,
        bottom_right), _describe(q=q, k=k, v=v, grad_out=grad_out), strict=_backward_strict(lse, fallback))


def _backward_strict(lse, fallback: bool) -> bool:
    """A backward's strictness: what its forward recorded on the LSE, else its caller's."""
    record = markers.lookup(lse)
    return record.strict if record is not None else not fallback


varlen_bwd = torch.library.custom_op("cudnn_sdpa::varlen_bwd", _varlen_bwd_cuda, mutates_args=(), device_types="cuda")


@varlen_bwd.register_kernel("cpu")
def _varlen_bwd_cpu(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks,
                    scale, window_left, window_right, bottom_right, deterministic, fallback):
    return route.call("varlen_bwd", _ON_CPU, None, lambda reason: composite.varlen_bwd(
        grad_out, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale,
        (window_left, window_right), bottom_right), _describe(q=q, k=k, v=v), strict=not fallback)


@varlen_bwd.register_fake
def _varlen_bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks,
                     scale, window_left, window_right, bottom_right, deterministic, fallback):
    dsinks = q.new_empty((q.shape[1],) if sinks is not None else (0,), dtype=torch.float32)
    return layout.grad_like(q), layout.grad_like(k), layout.grad_like(v), dsinks


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, sinks, scale, window_left, window_right,
     bottom_right, fallback) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # as for dense: no gradient flows through the LSE
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, sinks)
    ctx.options = (max_seqlen_q, max_seqlen_kv, scale, window_left, window_right, bottom_right, fallback)


def _varlen_grads(ctx, grad_out, bwd):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, sinks = ctx.saved_tensors
    max_seqlen_q, max_seqlen_kv, scale, window_left, window_right, bottom_right, fallback = ctx.options
    dq, dk, dv, dsinks = bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                             sinks, scale, window_left, window_right, bottom_right,
                             torch.are_deterministic_algorithms_enabled(), fallback)
    # inputs: q k v cu_q cu_kv max_q max_kv sinks scale wl wr bottom_right fallback
    return (dq, dk, dv, None, None, None, None, dsinks if sinks is not None else None) + (None,) * 5


def _varlen_backward(ctx, grad_out, grad_lse):
    return _varlen_grads(ctx, grad_out, torch.ops.cudnn_sdpa.varlen_bwd)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ------------------------------------------------------------------------------- eager autograd


def _eager_function(name: str, fwd: dict, setup_context, grads, bwd: dict, doc: str):
    """An autograd.Function over one op pair's kernels ({device type: kernel}), with the custom
    op's own setup_context and backward, so both ways in compute and count the same."""

    def forward(ctx, *inputs):
        output = fwd[inputs[0].device.type](*inputs)
        setup_context(ctx, inputs, output)
        return output

    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        return grads(ctx, grad_out, bwd[grad_out.device.type])

    def no_grad(*inputs):
        """The forward kernel alone, for a call that needs no gradient: what ``apply`` computes there,
        without autograd's wrapping (about 8 us of host per call on the CPU tier's decode shape)."""
        return fwd[inputs[0].device.type](*inputs)

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "__module__": __name__,
                                                    "forward": staticmethod(forward),
                                                    "backward": staticmethod(backward),
                                                    "no_grad": staticmethod(no_grad)})


DenseFunction = _eager_function(
    "DenseFunction", {"cuda": _dense_fwd_cuda, "cpu": _dense_fwd_cpu}, _dense_setup_context, _dense_grads,
    {"cuda": _dense_bwd_cuda, "cpu": _dense_bwd_cpu},
    """The dense op pair without the custom-op machinery, for eager calls on plain tensors: the
    same kernels, contexts and counters, at a fraction of the host cost (the custom op's Python
    autograd wrapper and two redispatches: docs/performance-notes.md). ``functional.attention``
    picks it when nothing traces the call (``eager``).""")
VarlenFunction = _eager_function(
    "VarlenFunction", {"cuda": _varlen_fwd_cuda, "cpu": _varlen_fwd_cpu}, _varlen_setup_context, _varlen_grads,
    {"cuda": _varlen_bwd_cuda, "cpu": _varlen_bwd_cpu},
    """``DenseFunction``'s packed counterpart (``cudnn_sdpa::varlen_fwd`` / ``varlen_bwd``).""")


def grad_needed(*tensors) -> bool:
    """Whether autograd records a call on these inputs (None allowed): grad mode is on and one needs a
    gradient (``_needs_grad``, the kernels' own test, which runs with grad mode off under ``apply``)."""
    return torch.is_grad_enabled() and _needs_grad(*tensors)


def autograd_needed(grad: bool) -> bool:
    """Whether a call must go through autograd (``apply``) rather than the forward kernel alone
    (``no_grad``): ``grad`` (``grad_needed`` of its inputs), or a forward-mode AD level is open (a
    dual input's tangent must reach ``apply``, which refuses it loudly, never be dropped)."""
    return grad or getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0


def eager(*tensors) -> bool:
    """Whether a call on these tensors (the first one is q) may take the eager Functions: plain
    CUDA or CPU tensors, nothing compiling, tracing, or transforming it (those, and meta tensors,
    see the custom ops, with their fake kernels)."""
    return (tensors[0].device.type in ("cuda", "cpu") and arguments.readable(tensors[0])
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in arguments.PLAIN for t in tensors))
