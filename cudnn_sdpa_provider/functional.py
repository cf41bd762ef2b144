"""``attention()``: what F.scaled_dot_product_attention cannot say, on cuDNN, with autograd.

Dense (B, H, S, D) inputs of any strides, or packed (T, H, D) inputs with ``cu_seqlens``. Runs the
``cudnn_sdpa`` kernels (served calls and fallbacks are counted in the same telemetry) whether or
not the provider is enabled; inside a strict scope a call that would fall back raises
FallbackError. Eager calls on plain tensors go through ``ops.DenseFunction``/``VarlenFunction``
(cheaper on the host); torch.compile(fullgraph=True), tracing, tensor subclasses and functorch
transforms see the custom ops ``cudnn_sdpa::*`` with their fake kernels. The returned LSE carries
no gradient.
"""

from __future__ import annotations

import math

import torch

from . import activation, engine, ops, support  # noqa: F401  (ops registers cudnn_sdpa::*)
from .errors import FallbackError, NotSupportedError
from .overrides import describe_call

__all__ = ["attention"]


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _lengths(name: str, t, batch: int, device) -> torch.Tensor:
    _require_tensor(name, t)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},) (one length per batch row), got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _cu(name: str, t, device) -> torch.Tensor:
    _require_tensor(name, t)
    if t.dim() != 1 or t.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D prefix sums of shape (B+1,) with B >= 1, got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _check_common(q, k, v, sinks, dims: int):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dim() != dims:
            layout_name = "(B, H, S, D)" if dims == 4 else "(T, H, D)"
            raise ValueError(f"{name} must be {dims}-D {layout_name} here, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    h_q, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]  # heads are dim 1 in both layouts
    if h_k == 0 or h_v == 0 or h_q % h_k or h_q % h_v:
        raise ValueError(f"H_q={h_q} must be a multiple of H_k={h_k} and H_v={h_v} (GQA/MQA)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if sinks is not None:
        _require_tensor("sinks", sinks)
        if tuple(sinks.shape) != (h_q,):
            raise ValueError(f"sinks must have shape (H_q,) = ({h_q},), got {tuple(sinks.shape)}")
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be floating point, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _strict_precheck(device: torch.device, problem: support.Problem, bwd_problem: support.Problem | None,
                     inputs) -> None:
    caps = support.capabilities(device.index if device.type == "cuda" else None)
    for p in (problem, bwd_problem):
        if p is None:
            continue
        found = support.reasons(p, caps)
        if found:
            raise FallbackError(p.path, [r.slug for r in found], inputs(), [r.message for r in found])


def attention(q, k, v, *, scale=None, is_causal=False, window=(-1, -1), bottom_right=False, sinks=None,
              seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
              max_seqlen_kv=None, dropout_p=0.0, return_lse=False):
    """Scaled dot-product attention on cuDNN graphs, forward and backward.

    Args:
        q, k, v: dense (B, H, S, D) with any strides, or packed (T, H, D) with ``cu_seqlens_q``.
            H_q must be a multiple of H_k and H_v (GQA/MQA); D_qk may differ from D_v.
        scale: softmax scale, default 1/sqrt(D_qk).
        is_causal: causal mask (same as ``window=(-1, 0)``).
        window: FlashAttention ``(left, right)``; -1 is unbounded. A query at i sees keys
            i - left .. i + right (shifted to the bottom right when ``bottom_right``).
        bottom_right: align the diagonal to the end of each sequence (needed when S_q != S_kv
            in decoding); packed inputs are aligned per sequence.
        sinks: (H_q,) per-head sink logits (gpt-oss); they get a gradient.
        seq_lens_q, seq_lens_kv: (B,) int32 device lengths for padded dense batches. Outputs
            and gradients are 0 past each length.
        cu_seqlens_q, cu_seqlens_kv: (B+1,) int32 prefix sums for packed inputs
            (``cu_seqlens_kv`` defaults to ``cu_seqlens_q``); ``max_seqlen_q/kv`` are required
            host ints (no device sync is ever made to find them).
        dropout_p: attention dropout (dense inputs). The forward draws a Philox (seed, offset) pair
            from torch's generator (``torch.manual_seed`` reproduces it) and its backward reuses it.
        return_lse: also return the log-sum-exp: (B, H, S_q, 1) dense, (T, H) packed, fp32.

    Example::

        >>> import torch, cudnn_sdpa_provider as csp
        >>> q = torch.randn(1, 2, 8, 16)
        >>> out = csp.attention(q, q, q, is_causal=True)
        >>> tuple(out.shape)
        (1, 2, 8, 16)
    """
    varlen = cu_seqlens_q is not None
    _check_common(q, k, v, sinks, 3 if varlen else 4)
    window = support.canonical_window(is_causal, window)
    if not isinstance(bottom_right, bool):
        raise TypeError(f"bottom_right must be a bool, got {type(bottom_right).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    sinks32 = sinks.float() if sinks is not None else None
    fallback = not activation.strict()
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if varlen and dropout_p:
        raise ValueError("dropout_p is not supported with packed (cu_seqlens) inputs; use dense inputs")
    if varlen:
        return _varlen(q, k, v, float(scale), window, bottom_right, sinks32, seq_lens_q, seq_lens_kv, cu_seqlens_q,
                       cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse, fallback)
    if cu_seqlens_kv is not None or max_seqlen_q is not None or max_seqlen_kv is not None:
        raise ValueError("cu_seqlens_kv / max_seqlen_q / max_seqlen_kv are for packed inputs; pass cu_seqlens_q too")
    if (seq_lens_q is None) != (seq_lens_kv is None):
        raise ValueError("pass both seq_lens_q and seq_lens_kv (padded batches), or neither")
    if seq_lens_q is not None:
        seq_lens_q = _lengths("seq_lens_q", seq_lens_q, q.shape[0], q.device)
        seq_lens_kv = _lengths("seq_lens_kv", seq_lens_kv, q.shape[0], q.device)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0] or v.shape[2] != k.shape[2]:
        raise ValueError(f"batch/sequence sizes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    grad = _needs_grad(q, k, v, sinks)
    if not fallback:
        problem = engine.dense_problem(q, k, v, window=window, bottom_right=bottom_right, sinks=sinks is not None,
                                       padded=seq_lens_q is not None, dropout_p=dropout_p)
        bwd = engine.dense_problem(q, k, v, backward=True, window=window, bottom_right=bottom_right,
                                   sinks=sinks is not None, padded=seq_lens_q is not None, dropout_p=dropout_p,
                                   deterministic=torch.are_deterministic_algorithms_enabled()) if grad else None
        _strict_precheck(q.device, problem, bwd, lambda: describe_call(q=q, k=k, v=v, sinks=sinks, window=window,
                                                             bottom_right=bottom_right, seq_lens_q=seq_lens_q))
    philox = engine.new_philox(q.device) if dropout_p > 0.0 else None
    try:
        eager = ops.eager(q, k, v, sinks, seq_lens_q, seq_lens_kv)
        fwd = ops.DenseFunction.apply if eager else torch.ops.cudnn_sdpa.dense_fwd
        out, lse = fwd(q, k, v, sinks32, None, seq_lens_q, seq_lens_kv, philox, float(scale), float(dropout_p),
                       window[0], window[1], bottom_right, return_lse or grad, fallback)
    except NotSupportedError as exc:
        raise FallbackError("dense_fwd", [exc.reason], describe_call(q=q, k=k, v=v), [exc.detail]) from None
    return (out, lse) if return_lse else out


def _varlen(q, k, v, scale, window, bottom_right, sinks32, seq_lens_q, seq_lens_kv, cu_q, cu_kv, max_q, max_kv,
            return_lse, fallback):
    if seq_lens_q is not None or seq_lens_kv is not None:
        raise ValueError("seq_lens_q/seq_lens_kv are for padded dense inputs; packed inputs use cu_seqlens")
    cu_q = _cu("cu_seqlens_q", cu_q, q.device)
    cu_kv = cu_q if cu_kv is None else _cu("cu_seqlens_kv", cu_kv, q.device)
    if cu_kv.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must have the same shape, got {tuple(cu_q.shape)} and "
                         f"{tuple(cu_kv.shape)}")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (the longest sequence; it is never read from the "
                             f"device), got {value!r}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    grad = _needs_grad(q, k, v, sinks32)
    if not fallback:
        problem = engine.varlen_problem(q, k, v, cu_q, max_q, max_kv, window=window, bottom_right=bottom_right,
                                        sinks=sinks32 is not None)
        bwd = engine.varlen_problem(q, k, v, cu_q, max_q, max_kv, backward=True, window=window,
                                    bottom_right=bottom_right, sinks=sinks32 is not None,
                                    deterministic=torch.are_deterministic_algorithms_enabled()) if grad else None
        _strict_precheck(q.device, problem, bwd, lambda: describe_call(q=q, k=k, v=v, cu_seqlens_q=cu_q, window=window))
    try:
        eager = ops.eager(q, k, v, sinks32, cu_q, cu_kv)
        fwd = ops.VarlenFunction.apply if eager else torch.ops.cudnn_sdpa.varlen_fwd
        out, lse = fwd(q, k, v, cu_q, cu_kv, max_q, max_kv, sinks32, scale, window[0], window[1], bottom_right, fallback)
    except NotSupportedError as exc:
        raise FallbackError("varlen_fwd", [exc.reason], describe_call(q=q, k=k, v=v), [exc.detail]) from None
    return (out, lse) if return_lse else out
