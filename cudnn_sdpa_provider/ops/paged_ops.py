"""Custom op ``cudnn_sdpa::paged_fwd``: a dense query over a paged KV cache (``paged``), forward only.

Its CUDA kernel hands the call to ``route`` (path ``paged_fwd``): served on a cuDNN graph
(``paged.forward``), or, with a reason, run on the composite (``composite.paged_fwd``: a gather and
the dense composite); ``fallback=False`` (strict) refuses instead. The CPU kernel always runs the
composite (reason ``no_cuda``), which makes the fake kernel and ``opcheck`` testable on CPU. The op
has no autograd formula: a call whose inputs require grad never reaches it (``functional`` runs the
differentiable composite, reason ``paged_backward``). Like ``ops``, imported lazily.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import composite, route
from ..core import layout, rows, scope, support
from ..engine import paged
from ..engine.binding import tensor_key

__all__ = ["paged_fwd", "entry", "problem", "run_eager", "pack_query", "unpack"]


def problem(q, k_cache, v_cache, table, sinks, window, bottom_right, grad: bool, unsupported: tuple = ()):
    """The call as ``support`` sees it: S_kv is the table's capacity, backward that it needs grad."""
    return support.Problem(unsupported=tuple(unsupported),
        kind="paged", backward=grad, device_type=q.device.type, dtypes=(q.dtype, k_cache.dtype, v_cache.dtype),
        batch=q.shape[0], h_q=q.shape[1], h_k=k_cache.shape[1], h_v=v_cache.shape[1], s_q=q.shape[2],
        s_kv=table.shape[1] * k_cache.shape[2], d_qk=q.shape[3], d_v=v_cache.shape[3], window=tuple(window),
        bottom_right=bottom_right, sinks=sinks is not None, padded=True,
        empty=q.numel() == 0 or k_cache.numel() == 0 or v_cache.numel() == 0 or table.numel() == 0,
        block_size=k_cache.shape[2])


def entry(q, k_cache, v_cache, table, sinks, window, bottom_right, grad: bool = False) -> route.Entry:
    signature = ("op_paged_fwd", q.device.index, tensor_key(q), tensor_key(k_cache), tensor_key(v_cache),
                 table.shape, sinks is not None, window, bottom_right, grad)
    return route.entry(signature, lambda: problem(q, k_cache, v_cache, table, sinks, window, bottom_right, grad),
                       q.device.index)


def _describe(q, k_cache, table, window, bottom_right):
    return lambda: route.describe_call(q=q, k_cache=k_cache, block_table=table, window=window,
                                       bottom_right=bottom_right)


def _paged_fwd_cuda(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_len_q: Tensor,
    seq_len_kv: Tensor,
    sinks: Optional[Tensor],
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    compute_lse: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor]:
    """Paged-KV attention forward on a cuDNN graph: (out (B, H_q, S_q, D_v), lse (B, H_q, S_q, 1) fp32)."""
    window = (window_left, window_right)
    found = entry(q, k_cache, v_cache, block_table, sinks, window, bottom_right)

    def serve():
        return paged.forward(q, k_cache, v_cache, block_table, seq_len_q, seq_len_kv, scale=scale, window=window,
                             bottom_right=bottom_right, sinks=sinks, compute_lse=compute_lse)

    return route.call("paged_fwd", found, serve, lambda reason: composite.paged_fwd(
        q, k_cache, v_cache, block_table, seq_len_q, seq_len_kv, sinks, scale, window, bottom_right),
        _describe(q, k_cache, block_table, window, bottom_right), strict=not fallback or scope.strict())


paged_fwd = torch.library.custom_op("cudnn_sdpa::paged_fwd", _paged_fwd_cuda, mutates_args=(), device_types="cuda")


@paged_fwd.register_kernel("cpu")
def _paged_fwd_cpu(q, k_cache, v_cache, block_table, seq_len_q, seq_len_kv, sinks, scale, window_left, window_right,
                   bottom_right, compute_lse, fallback):
    window = (window_left, window_right)
    return route.call("paged_fwd", route.fixed("no_cuda", "inputs are on the CPU"), None, lambda reason:
                      composite.paged_fwd(q, k_cache, v_cache, block_table, seq_len_q, seq_len_kv, sinks, scale,
                                          window, bottom_right),
                      _describe(q, k_cache, block_table, window, bottom_right), strict=not fallback or scope.strict())


@paged_fwd.register_fake
def _paged_fwd_fake(q, k_cache, v_cache, block_table, seq_len_q, seq_len_kv, sinks, scale, window_left, window_right,
                    bottom_right, compute_lse, fallback):
    out = layout.dense_out(q, tuple(q.shape[:3]) + (v_cache.shape[3],))
    return out, q.new_empty(tuple(q.shape[:3]) + (1,), dtype=torch.float32)


#: The op's kernels by device type, for eager calls on plain tensors (no dispatcher round trip).
run_eager = {"cuda": _paged_fwd_cuda, "cpu": _paged_fwd_cpu}


def pack_query(q: Tensor, cu_q: Tensor, max_q: int):
    """Packed (T, H, D) queries as a padded (B, H, max_q, D) batch (a view of (B, max_q, H, D)
    storage, padding 0): (padded q, seq_lens_q (B,) int32, the token index, bad). Bad prefix sums
    (``rows.token_rows``) give lengths 0, and ``unpack`` makes every output NaN. Differentiable."""
    t, h, d = q.shape
    batch = cu_q.shape[0] - 1
    row, pos, lengths, bad = rows.token_rows(cu_q, t, max_q)
    padded = q.new_zeros((batch + 1, max_q, h, d)).index_put((row, pos), q)
    return padded[:batch].transpose(1, 2), lengths, (row, pos), bad


def unpack(out: Tensor, lse: Optional[Tensor], index, bad: Tensor, q: Tensor):
    """The padded (B, H, S, D_v) output and (B, H, S, 1) LSE back as packed (T, H, D_v) (in
    ``layout.packed_out``'s strides, FlashAttention's) and (T, H): 0 past cu_seqlens_q[-1], NaN
    everywhere when the prefix sums were bad."""
    row, pos = index

    def gather(x):  # (B, S, ...) -> (T, ...), the spare row B reading 0
        return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])[row, pos].masked_fill(bad, float("nan"))

    packed = gather(out.transpose(1, 2))
    target = layout.packed_out(q, tuple(packed.shape))
    if target.stride() != packed.stride():
        packed = target.copy_(packed)
    return packed, (gather(lse.squeeze(-1).transpose(1, 2)) if lse is not None else None)
