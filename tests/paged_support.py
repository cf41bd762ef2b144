"""Paged KV caches for the tests: random caches and tables, and an independent reference (a loop
over sequences that reads each key through the table, in fp64/fp32; nothing of the package)."""

from __future__ import annotations

import math

import torch


def make_paged(b, h_q, h_k, s_q, d, block_size, max_blocks, *, dtype=torch.bfloat16, device="cpu", gen=None,
               spare=3, fa_layout=False, lens_kv=None, lens_q=None):
    """(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv): N = B x M + ``spare`` blocks, a random
    permutation of them in the table (every entry valid), lengths random in range unless given.
    ``fa_layout``: the caches are stored (N, block_size, H, D) and returned as (N, H, block_size, D) views."""
    n = b * max_blocks + spare

    def cache():
        if fa_layout:
            return torch.randn(n, block_size, h_k, d, generator=gen, device=device).to(dtype).transpose(1, 2)
        return torch.randn(n, h_k, block_size, d, generator=gen, device=device).to(dtype)

    q = torch.randn(b, h_q, s_q, d, generator=gen, device=device).to(dtype)
    k_cache, v_cache = cache(), cache()
    table = torch.randperm(n, generator=gen, device=device)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    cap = max_blocks * block_size
    if lens_kv is None:
        lens_kv = torch.randint(max(s_q, 1), cap + 1, (b,), generator=gen, device=device)
    if lens_q is None:
        lens_q = torch.full((b,), s_q, device=device)
    return (q, k_cache, v_cache, table, torch.as_tensor(lens_q, device=device).to(torch.int32),
            torch.as_tensor(lens_kv, device=device).to(torch.int32))


def paged_reference(q, k_cache, v_cache, table, lens_q, lens_kv, *, scale=None, window=(-1, -1),
                    bottom_right=False, sinks=None, dtype=torch.float64):
    """(B, H_q, S_q, D_v) in ``dtype``: rows past seq_lens_q and rows that see no key are 0."""
    b, h_q, s_q, d = q.shape
    _, h_k, block_size, _ = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, h_q, s_q, v_cache.shape[3], dtype=dtype, device=q.device)
    left, right = window
    for i in range(b):
        lq, lk = int(lens_q[i]), int(lens_kv[i])
        if lq == 0 or lk == 0:  # nothing to attend: the rows stay 0
            continue
        idx = torch.arange(lk, device=q.device)
        blocks = table[i].long()[idx // block_size]
        kk = k_cache[blocks, :, idx % block_size].to(dtype).transpose(0, 1)  # (H_k, lk, D)
        vv = v_cache[blocks, :, idx % block_size].to(dtype).transpose(0, 1)
        kk = kk.repeat_interleave(h_q // h_k, 0)
        vv = vv.repeat_interleave(h_q // v_cache.shape[1], 0)
        s = q[i, :, :lq].to(dtype) @ kk.transpose(-1, -2) * scale  # (H, lq, lk)
        qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq if bottom_right else 0)
        kj = torch.arange(lk, device=q.device)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            allowed &= kj <= qi + right
        if left >= 0:
            allowed &= kj >= qi - left
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.to(dtype).view(h_q, 1, 1).expand(h_q, lq, 1)], dim=-1)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))  # a row without keys: all 0
        p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
        if sinks is not None:
            p = p[..., :-1]
        row_out = p @ vv
        live = allowed.any(-1).view(1, lq, 1)
        out[i, :, :lq] = torch.where(live, row_out, torch.zeros_like(row_out))
    return out
