"""The aten composite: attention in plain aten ops (``reference``) in the layout policy's strides.

What a call falls back to where no PyTorch kernel can serve it (the ``cudnn_sdpa`` ops behind
``csp.attention``): on CUDA for a call cuDNN cannot serve, always on CPU. Outputs have exactly the
strides the cuDNN kernels and the fake kernels give (``layout``).
"""

from __future__ import annotations

import torch

from ..core import layout, rows
from . import reference

__all__ = ["dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd", "gather_pages", "paged_fwd"]


def _compute_dtype(q) -> torch.dtype:
    """The composite computes in fp32, or fp64 for fp64 inputs (so gradcheck can run on it)."""
    return torch.promote_types(q.dtype, torch.float32)


def _composite_dropout_mask(philox, dropout_p, q, k):
    """The composite's own keep-mask, a pure function of the forward's philox pair so forward and
    backward agree. It cannot reproduce cuDNN's Philox stream, and reading the pair is a host sync:
    this runs only on the fallback path."""
    if dropout_p <= 0.0:
        return None
    seed, offset = (int(x) for x in philox.tolist())
    gen = torch.Generator(device=q.device).manual_seed((seed * 1000003 + offset) % (2**63))
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.rand(shape, generator=gen, device=q.device) >= dropout_p


def dense_fwd(q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, window, bottom_right, philox=None,
                         dropout_p=0.0):
    if q.shape[2] == 0 or k.shape[2] == 0:
        ref_out = q.new_zeros(q.shape[:3] + (v.shape[3],), dtype=torch.float32)
        ref_lse = q.new_full(q.shape[:3] + (1,), float("-inf"), dtype=torch.float32)
    else:
        ref_out, ref_lse = reference.dense(q, k, v, scale=scale, window=window, bottom_right=bottom_right, sinks=sinks,
                                           bias=bias, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, dropout_p=dropout_p,
                                           dropout_mask=_composite_dropout_mask(philox, dropout_p, q, k),
                                           compute_dtype=_compute_dtype(q))
    out = layout.dense_out(q, tuple(q.shape[:3]) + (v.shape[3],))
    out.copy_(ref_out)
    lse = torch.empty(tuple(q.shape[:3]) + (1,), dtype=torch.float32, device=q.device)
    lse.copy_(ref_lse)
    return out, lse


def dense_bwd(grad_out, q, k, v, sinks, bias, seq_len_q, seq_len_kv, scale, window, bottom_right,
                         philox=None, dropout_p=0.0):
    grads = reference.dense_backward(grad_out, q, k, v, scale=scale, window=window, bottom_right=bottom_right,
                                     sinks=sinks, bias=bias, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                                     dropout_p=dropout_p, dropout_mask=_composite_dropout_mask(philox, dropout_p, q, k),
                                     compute_dtype=_compute_dtype(q))
    dq, dk, dv = layout.grad_like(q), layout.grad_like(k), layout.grad_like(v)
    for dst, g in zip((dq, dk, dv), grads[:3]):
        dst.copy_(g)
    dsinks = grads[3].to(torch.float32) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsinks


def varlen_fwd(q, k, v, cu_q, cu_kv, max_q, max_kv, sinks, scale, window, bottom_right):
    ref_out, ref_lse = reference.varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, scale=scale, window=window,
                                        bottom_right=bottom_right, sinks=sinks, compute_dtype=_compute_dtype(q))
    out = layout.packed_out(q, (q.shape[0], q.shape[1], v.shape[2]))
    out.copy_(ref_out)
    lse = layout.packed((q.shape[0], q.shape[1]), q, dtype=torch.float32)
    lse.copy_(ref_lse)
    return out, lse


def varlen_bwd(grad_out, q, k, v, cu_q, cu_kv, max_q, max_kv, sinks, scale, window, bottom_right):
    grads = reference.varlen_backward(grad_out, q, k, v, cu_q, cu_kv, max_q, max_kv, scale=scale, window=window,
                                      bottom_right=bottom_right, sinks=sinks, compute_dtype=_compute_dtype(q))
    outs = []
    for src, g in zip((q, k, v), grads[:3]):
        dst = layout.grad_like(src)
        dst.copy_(g)
        outs.append(dst)
    dsinks = grads[3].to(torch.float32) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return outs[0], outs[1], outs[2], dsinks


def gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(B, H, M x block_size, D): each sequence's blocks of a (N, H, block_size, D) cache in the
    order of its row of the (B, M) table, as one dense copy (entries must be in [0, N))."""
    _, h, block_size, d = cache.shape
    b, m = table.shape
    return cache[table.long()].permute(0, 2, 1, 3, 4).reshape(b, h, m * block_size, d)


def paged_fwd(q, k_cache, v_cache, table, seq_len_q, seq_len_kv, sinks, scale, window, bottom_right):
    """The paged forward as a gather and the dense composite, with the cuDNN path's guard
    (``rows.paged_guard``): bad rows are NaN. Differentiable (q, the caches and sinks get
    gradients through autograd), which is how a paged call that needs grad is computed."""
    safe_table, safe_q, safe_kv, bad = rows.paged_guard(table, seq_len_q, seq_len_kv, k_cache.shape[0],
                                                        k_cache.shape[2], q.shape[2])
    k, v = gather_pages(k_cache, safe_table), gather_pages(v_cache, safe_table)
    out, lse = dense_fwd(q, k, v, sinks, None, safe_q, safe_kv, scale, window, bottom_right)
    return out.masked_fill_(bad, float("nan")), lse  # in place: out keeps q's dimension order
