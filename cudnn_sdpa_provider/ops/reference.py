"""Attention in plain aten ops, with the engine's exact contract (see ``engine``'s docstring).

Used three ways: as the CPU kernels of the ``cudnn_sdpa`` ops (so fake kernels and opcheck run
in CI), as the composite fallback on CUDA for what cuDNN cannot do (it differentiates through
autograd), and as the fp32/fp64 oracle of the tests. No host-device syncs: varlen inputs are
scattered into a padded batch with device-side index math.
"""

from __future__ import annotations

import torch

__all__ = ["dense", "dense_backward", "varlen", "varlen_backward", "allowed_mask", "pad_packed", "unpad"]


def allowed_mask(s_q: int, s_kv: int, window, bottom_right: bool, seq_len_q=None, seq_len_kv=None, device=None):
    """(B|1, 1, S_q, S_kv) bool: which keys each query may see (lengths make it per batch)."""
    left, right = window
    i = torch.arange(s_q, device=device).view(1, 1, s_q, 1)
    j = torch.arange(s_kv, device=device).view(1, 1, 1, s_kv)
    if seq_len_q is not None:
        lq = seq_len_q.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
        lk = seq_len_kv.to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    else:
        lq = torch.full((1, 1, 1, 1), s_q, device=device)  # a fill kernel: torch.tensor would copy (and sync)
        lk = torch.full((1, 1, 1, 1), s_kv, device=device)
    offset = (lk - lq) if bottom_right else torch.zeros_like(lk)
    allowed = (j < lk) & (i < lq)
    if right >= 0:
        allowed = allowed & (j <= i + offset + right)
    if left >= 0:
        allowed = allowed & (j >= i + offset - left)
    return allowed


def _probs(q, k, v, scale, window, bottom_right, sinks, bias, seq_len_q, seq_len_kv, compute_dtype):
    """Shared by forward and backward: (qf, kf, vf expanded to H_q, probs, safe lse, lse)."""
    b, h_q, s_q, _ = q.shape
    s_kv = k.shape[2]
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(h_q // k.shape[1], dim=1)
    vf = vf.repeat_interleave(h_q // v.shape[1], dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(compute_dtype)
    allowed = allowed_mask(s_q, s_kv, window, bottom_right, seq_len_q, seq_len_kv, device=q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    full = scores
    if sinks is not None:
        sink_col = sinks.to(compute_dtype).view(1, h_q, 1, 1).expand(b, h_q, s_q, 1)
        full = torch.cat([scores, sink_col], dim=-1)
    lse = torch.logsumexp(full, dim=-1, keepdim=True)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return qf, kf, vf, torch.exp(scores - safe), safe, lse


def _zero_padded_rows(x, seq_len_q):
    if seq_len_q is None:
        return x
    rows = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1)
    return x.masked_fill(rows >= seq_len_q.to(x.device).view(-1, 1, 1, 1), 0.0)


def dense(q, k, v, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None, bias=None, seq_len_q=None,
          seq_len_kv=None, dropout_mask=None, dropout_p=0.0, compute_dtype=torch.float32):
    """(out, lse) in ``compute_dtype``; out (B, H_q, S_q, D_v), lse (B, H_q, S_q, 1).

    Rows with no visible key and no sink give out = 0 and lse = -inf; padded rows give out = 0.
    ``dropout_mask`` (B, H_q, S_q, S_kv) of 0/1 keeps, applied to the probabilities.
    Differentiable (the tests' oracle differentiates it with autograd)."""
    _, _, vf, probs, _, lse = _probs(q, k, v, scale, window, bottom_right, sinks, bias, seq_len_q, seq_len_kv,
                                     compute_dtype)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(compute_dtype) / (1.0 - dropout_p)
    out = torch.matmul(probs, vf)
    return _zero_padded_rows(out, seq_len_q), lse


def _sum_groups(x, heads: int):
    b, h_q, s, d = x.shape
    return x.view(b, heads, h_q // heads, s, d).sum(dim=2)


def dense_backward(grad_out, q, k, v, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None, bias=None,
                   seq_len_q=None, seq_len_kv=None, dropout_mask=None, dropout_p=0.0, compute_dtype=torch.float32):
    """(dq, dk, dv, dsinks or None) by the closed-form attention gradient, no autograd needed
    (the CPU kernels run below the autograd dispatch key)."""
    qf, kf, vf, probs, safe, _ = _probs(q, k, v, scale, window, bottom_right, sinks, bias, seq_len_q, seq_len_kv,
                                        compute_dtype)
    keep = 1.0
    if dropout_mask is not None:
        keep = dropout_mask.to(compute_dtype) / (1.0 - dropout_p)
    dropped = probs * keep
    out = torch.matmul(dropped, vf)
    do = _zero_padded_rows(grad_out.to(compute_dtype), seq_len_q)
    delta = (do * out).sum(dim=-1, keepdim=True)
    ds = probs * (torch.matmul(do, vf.transpose(-1, -2)) * keep - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = _sum_groups(torch.matmul(ds.transpose(-1, -2), qf) * scale, k.shape[1])
    dv = _sum_groups(torch.matmul(dropped.transpose(-1, -2), do), v.shape[1])
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.to(compute_dtype).view(1, -1, 1, 1) - safe)
        dsinks = -(p_sink * delta).sum(dim=(0, 2, 3))
    return dq, dk, dv, dsinks


def _token_index(cu: torch.Tensor, total: int):
    """Per packed token: (batch row, position); tokens past cu[-1] go to a trash row B."""
    batch = cu.shape[0] - 1
    cu64 = cu.to(torch.int64)
    tok = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu64[1:], tok, right=True)
    valid = row < batch
    row_c = torch.where(valid, row, torch.full_like(row, batch))
    start = cu64[torch.clamp(row, max=batch - 1)] if batch > 0 else torch.zeros_like(tok)
    pos = torch.where(valid, tok - start, torch.zeros_like(tok))
    return row_c, pos


def pad_packed(x: torch.Tensor, cu: torch.Tensor, s_max: int) -> torch.Tensor:
    """(T, H, D) packed -> (B, H, S_max, D) padded (padding is 0). Differentiable."""
    batch = cu.shape[0] - 1
    row, pos = _token_index(cu, x.shape[0])
    buf = x.new_zeros((batch + 1, s_max) + tuple(x.shape[1:]))
    buf = buf.index_put((row, pos), x)
    return buf[:batch].movedim(2, 1)


def unpad(y: torch.Tensor, cu: torch.Tensor, total: int) -> torch.Tensor:
    """(B, H, S_max, D) padded -> (T, H, D) packed; tokens past cu[-1] are 0. Differentiable."""
    row, pos = _token_index(cu, total)
    ybs = y.movedim(1, 2)  # (B, S, H, D)
    ybs = torch.cat([ybs, ybs.new_zeros((1,) + tuple(ybs.shape[1:]))], dim=0)
    return ybs[row, pos]


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *, scale: float,
           window=(-1, -1), bottom_right=False, sinks=None, compute_dtype=torch.float32):
    """(out (T_q, H_q, D_v), lse (T_q, H_q)) in ``compute_dtype``, per-sequence attention."""
    s_q, s_kv = max(int(max_seqlen_q), 1), max(int(max_seqlen_kv), 1)
    qp = pad_packed(q.to(compute_dtype), cu_seqlens_q, s_q)
    kp = pad_packed(k.to(compute_dtype), cu_seqlens_kv, s_kv)
    vp = pad_packed(v.to(compute_dtype), cu_seqlens_kv, s_kv)
    len_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    len_kv = cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]
    out, lse = dense(qp, kp, vp, scale=scale, window=window, bottom_right=bottom_right, sinks=sinks,
                     seq_len_q=len_q, seq_len_kv=len_kv, compute_dtype=compute_dtype)
    total = q.shape[0]
    out_packed = unpad(out, cu_seqlens_q, total)
    lse_packed = unpad(lse, cu_seqlens_q, total).squeeze(-1)
    return out_packed, lse_packed


def varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *,
                    scale: float, window=(-1, -1), bottom_right=False, sinks=None, compute_dtype=torch.float32):
    """(dq, dk, dv, dsinks or None), packed like the inputs; rows past cu_seqlens[-1] are 0."""
    s_q, s_kv = max(int(max_seqlen_q), 1), max(int(max_seqlen_kv), 1)
    qp = pad_packed(q.to(compute_dtype), cu_seqlens_q, s_q)
    kp = pad_packed(k.to(compute_dtype), cu_seqlens_kv, s_kv)
    vp = pad_packed(v.to(compute_dtype), cu_seqlens_kv, s_kv)
    dop = pad_packed(grad_out.to(compute_dtype), cu_seqlens_q, s_q)
    len_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    len_kv = cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]
    dq, dk, dv, dsinks = dense_backward(dop, qp, kp, vp, scale=scale, window=window, bottom_right=bottom_right,
                                        sinks=sinks, seq_len_q=len_q, seq_len_kv=len_kv, compute_dtype=compute_dtype)
    return (unpad(dq, cu_seqlens_q, q.shape[0]), unpad(dk, cu_seqlens_kv, k.shape[0]),
            unpad(dv, cu_seqlens_kv, v.shape[0]), dsinks)
