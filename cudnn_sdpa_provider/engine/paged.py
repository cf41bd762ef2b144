"""Attention of a dense query over a paged KV cache on a cuDNN graph (forward only).

Like ``dense``, these functions run on CUDA tensors and never decide a fallback (``route`` has),
and cuDNN's rejection at build time surfaces as ``NotSupportedError``.

Conventions:
  q (B, H_q, S_q, D_qk), any strides; k_cache (N, H_k, block_size, D_qk) and v_cache
  (N, H_v, block_size, D_v), any strides (a FlashAttention/vLLM cache (N, block_size, H, D) is its
  ``.transpose(1, 2)``); table (B, M) int32: row b lists the cache blocks of sequence b in order, so
  its key j is ``k_cache[table[b, j // block_size], :, j % block_size]``; seq_len_q / seq_len_kv
  (B,) int32: the sequence's queries (the first seq_len_q rows of q) and its keys (at most
  M x block_size). out (B, H_q, S_q, D_v) in q's dimension order, 0 past seq_len_q and in rows that
  see no key; lse (B, H_q, S_q, 1) fp32. A batch row with an out-of-range length or a used table
  entry outside [0, N) is NaN (``rows.paged_guard``): never read outside the cache.
"""

from __future__ import annotations

import torch

from . import binding as bd
from ..core import layout, rows
from .binding import Binding, tensor_key
from .graphs import UID, FwdKey

__all__ = ["forward"]


def forward(q, k_cache, v_cache, table, seq_len_q, seq_len_kv, *, scale: float, window=(-1, -1), bottom_right=False,
            sinks=None, compute_lse=True):
    """cuDNN paged forward: (out, lse)."""
    b, _, s_q, _ = q.shape
    blocks, _, block_size, _ = k_cache.shape
    signature = ("paged_fwd", q.device.index, tensor_key(q), tensor_key(k_cache), tensor_key(v_cache),
                 tensor_key(table), tensor_key(sinks), scale, window, bottom_right, compute_lse)
    found = bd.lookup(signature)
    if found is None:
        found = bd.store(signature, _bind(q, k_cache, v_cache, table, sinks, scale, window, bottom_right, compute_lse))
    if found.fix:
        q, k_cache, v_cache = (layout.repaired(t) if fix else t
                               for t, fix in zip((q, k_cache, v_cache), found.repair))
    safe_table, safe_q, safe_kv, bad = rows.paged_guard(table, seq_len_q, seq_len_kv, blocks, block_size, s_q)
    (size, stride), (lse_size, _) = found.outputs
    out = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
    out_buf = out if found.direct[0] else torch.empty(size, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_size, dtype=torch.float32, device=q.device)
    pages = bd.small_operand(safe_table, (b, 1, table.shape[1], 1))  # as the graph declares it (a copy if strided)
    buffers = (q, k_cache, v_cache, out_buf) + ((lse,) if compute_lse else ())
    buffers += (bd.small_operand(safe_q, (b, 1, 1, 1)), bd.small_operand(safe_kv, (b, 1, 1, 1)))
    buffers += (bd.small_operand(sinks, (1, q.shape[1], 1, 1), torch.float32),) if sinks is not None else ()
    bd.run(found, buffers + (pages, pages), q.device.index)
    if out_buf is not out:
        out.copy_(out_buf)
    out.masked_fill_(rows.paged_dead_rows(s_q, window, bottom_right, safe_q, safe_kv), 0)
    return out.masked_fill_(bad, float("nan")), lse


def _bind(q, k_cache, v_cache, table, sinks, scale, window, bottom_right, compute_lse) -> Binding:
    b, h, s_q, _ = q.shape
    repair = tuple(not layout.usable(t) for t in (q, k_cache, v_cache))
    qr, kr, vr = (layout.repaired(t) if fix else t for t, fix in zip((q, k_cache, v_cache), repair))
    out = layout.dense_out(q, (b, h, s_q, v_cache.shape[3]))
    out_direct = layout.strides_usable(out)
    out_buf = out if out_direct else torch.empty(tuple(out.shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=q.device)
    m = table.shape[1]
    pages = bd.desc(torch.empty((b, 1, m, 1), dtype=torch.int32, device=q.device))
    key = FwdKey(device=q.device.index, q=bd.desc(qr), k=bd.desc(kr), v=bd.desc(vr), o=bd.desc(out_buf),
                 lse=bd.desc(lse) if compute_lse else None, scale=float(scale), window=tuple(window),
                 bottom_right=bool(bottom_right), sinks=sinks is not None, padded=True,
                 pages=(pages, m * k_cache.shape[2]))
    uids = (UID.Q, UID.K, UID.V, UID.O) + ((UID.LSE,) if compute_lse else ()) + (UID.SEQ_Q, UID.SEQ_KV)
    uids += ((UID.SINK,) if sinks is not None else ()) + (UID.PAGE_K, UID.PAGE_V)
    return Binding(plan=bd.graphs.plan(key), uids=tuple(int(u) for u in uids), repair=repair,
                   outputs=((tuple(out.shape), out.stride()), ((b, h, s_q, 1), lse.stride())),
                   direct=(out_direct, True), extra={}, fix=any(repair))
