"""FP8 attention in plain aten ops, quantising where cuDNN's ``sdpa_fp8`` graphs quantise.

The fallback of the ``cudnn_sdpa::fp8_{fwd,bwd}`` ops (on CUDA for a call cuDNN cannot serve,
always on CPU) and the reference the tests hold the graphs to. Values are real = stored x descale;
a value stored in FP8 is ``quantize(x * scale)``, which saturates at the format's largest finite
value as cuDNN does (results/gpu-run40-fp8-bwd-probe.txt: an FP8 gradient whose scale was 128x too
large came back clipped at 448, not NaN). Computed in fp32:

  forward:  S = Q K^T scale (masked: causal top-left, keys past seq_len_kv, rows past seq_len_q);
            P~ = exp(S - rowmax S), l = rowsum P~; P8 = quantize(P~ scale_s);
            O = (P8 / scale_s) V / l; out = quantize(O scale_o); lse = rowmax S + log l;
            amax_s = max P~ / l (the softmax's largest probability), amax_o = max |O|.
  backward: P = softmax(S); dV = quantize(P scale_s)/scale_s ^T dO; dP = dO V^T; D = rowsum(O dO);
            dS = P (dP - D) scale, quantised with scale_dp (cuDNN's "dP" factors scale dS; its
            amax_dP is max |dS|, run 40); dQ = dS8 K, dK = dS8^T Q, each quantised with its scale.

Rows that see no key have O = 0, lse = +inf and zero gradients. Non-finite scores (an operand or
a descale that is inf or NaN) are not rows without keys: they stay NaN through O, lse and the
gradients. cuDNN computes the softmax in
tiles with an online maximum, so its P8 (and what follows) differs from this one by rounding; the
tests bound that difference (docs/fp8.md says by how much).
"""

from __future__ import annotations

import torch

from ..core import layout

__all__ = ["FORMAT_MAX", "quantize_to", "pow2_scale", "forward", "backward"]

#: The largest finite value of each FP8 format.
FORMAT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (already scaled) in FP8 ``dtype``, saturating at the format's largest finite value."""
    top = FORMAT_MAX[dtype]
    return x.clamp(-top, top).to(dtype)


def pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """``top / amax`` rounded down to a power of 2 (so its reciprocal is exact), fp32; 1 where
    ``amax`` is 0 or not finite."""
    amax = amax.float()
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, torch.exp2(torch.floor(torch.log2(top / amax.clamp(min=1e-30)))), torch.ones_like(amax))


def _real(t: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return t.float() * descale.float().reshape(())


def _mask(b, s_q, s_kv, causal, seq_len_q, seq_len_kv, device) -> torch.Tensor:
    """(B, 1, S_q, S_kv) True where a score is masked."""
    i = torch.arange(s_q, device=device).view(1, 1, s_q, 1)
    j = torch.arange(s_kv, device=device).view(1, 1, 1, s_kv)
    mask = torch.zeros(b, 1, s_q, s_kv, dtype=torch.bool, device=device)
    if causal:
        mask = mask | (j > i)
    if seq_len_q is not None:
        mask = mask | (i >= seq_len_q.view(b, 1, 1, 1)) | (j >= seq_len_kv.view(b, 1, 1, 1))
    return mask


def _scores(q, k, descale_q, descale_k, scale, causal, seq_len_q, seq_len_kv):
    b, h, s_q, _ = q.shape
    qf = _real(q, descale_q)
    kf = _real(k, descale_k).repeat_interleave(h // k.shape[1], 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    mask = _mask(b, s_q, k.shape[2], causal, seq_len_q, seq_len_kv, q.device)
    return s.masked_fill(mask, float("-inf")), mask, qf, kf


def _group_sum(t: torch.Tensor, h_k: int) -> torch.Tensor:
    b, h, s, d = t.shape
    return t.view(b, h_k, h // h_k, s, d).sum(2)


def forward(q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, scale, scale_s, causal,
            compute_lse):
    """(out FP8 (B, H_q, S_q, D_v) in q's dimension order, lse (B, H_q, S_q, 1) fp32 or empty, amax (2,) [s, o])."""
    s, mask, _, _ = _scores(q, k, descale_q, descale_k, scale, causal, seq_len_q, seq_len_kv)
    vf = _real(v, descale_v).repeat_interleave(q.shape[1] // v.shape[1], 1)
    top = s.amax(-1, keepdim=True)
    live = ~torch.isneginf(top)  # a row that sees a key; a NaN score stays NaN (issue #29: not a dead row)
    p = torch.exp(s - torch.where(live, top, torch.zeros_like(top))).masked_fill(mask, 0.0)
    total = p.sum(-1, keepdim=True)
    safe = torch.where(live, total, torch.ones_like(total))
    p8 = quantize_to(p * scale_s, torch.float8_e4m3fn).float() / scale_s
    o = torch.where(live, (p8 @ vf) / safe, torch.zeros((), device=q.device))
    amax = torch.stack([(p / safe).amax() if p.numel() else p.new_zeros(()),
                        o.abs().amax() if o.numel() else o.new_zeros(())])
    out = quantize_to(o * scale_o.float().reshape(()), q.dtype)
    lse = torch.where(live, top + torch.log(safe), torch.full_like(top, float("inf"))) if compute_lse else \
        q.new_empty((0,), dtype=torch.float32)
    target = layout.dense_out(q, tuple(out.shape), out.dtype)  # q's dimension order, as cuDNN writes it
    return target.copy_(out), lse.contiguous(), amax


#: The most bytes one (rows, heads, S_q, S_kv) fp32 score tensor of ``backward`` may take; a larger
#: call runs in slices of batch rows and KV heads (it keeps about six such tensors at once).
SCORE_BYTES = 256 << 20


def backward(grad_out, q, k, v, out, descales, scales, seq_len_q, seq_len_kv, scale, scale_s, causal, dtypes):
    """One FP8 backward at fixed scales: (dq, dk, dv in ``dtypes``, amax (4,) [dq, dk, dv, ds]).

    ``descales`` = (q, k, v, o, do), ``scales`` = (4,) [dq, dk, dv, ds] fp32. Every batch row and KV
    head is independent (a KV head with its group of query heads), so a call whose scores would pass
    ``SCORE_BYTES`` runs slice by slice, each slice's scores at most that size (or one row and KV
    head, when that alone is larger): the same values, a bounded peak (about six score tensors)."""
    b, h_k, group = q.shape[0], k.shape[1], q.shape[1] // k.shape[1]
    per_head = group * q.shape[2] * k.shape[2] * 4
    heads = max(1, min(h_k, SCORE_BYTES // max(per_head, 1)))
    rows = max(1, min(b, SCORE_BYTES // max(per_head * h_k, 1))) if heads == h_k else 1
    if rows >= b and heads >= h_k:
        return _backward(grad_out, q, k, v, out, descales, scales, seq_len_q, seq_len_kv, scale, scale_s, causal,
                         dtypes)
    grads = tuple(torch.empty_like(t, dtype=dt) for t, dt in zip((q, k, v), dtypes))
    amax = []
    for b0 in range(0, b, rows):
        rs = slice(b0, b0 + rows)
        lens = [None if n is None else n[rs] for n in (seq_len_q, seq_len_kv)]
        for h0 in range(0, h_k, heads):
            qh, kh = slice(h0 * group, (h0 + heads) * group), slice(h0, h0 + heads)
            *part, a = _backward(grad_out[rs, qh], q[rs, qh], k[rs, kh], v[rs, kh], out[rs, qh], descales, scales,
                                 *lens, scale, scale_s, causal, dtypes)
            for dst, src, hs in zip(grads, part, (qh, kh, kh)):
                dst[rs, hs].copy_(src)
            amax.append(a)
    return grads + (torch.stack(amax).amax(0),)


def _backward(grad_out, q, k, v, out, descales, scales, seq_len_q, seq_len_kv, scale, scale_s, causal, dtypes):
    descale_q, descale_k, descale_v, descale_o, descale_do = descales
    h_k = k.shape[1]
    s, mask, qf, kf = _scores(q, k, descale_q, descale_k, scale, causal, seq_len_q, seq_len_kv)
    group = q.shape[1] // h_k
    vf = _real(v, descale_v).repeat_interleave(group, 1)
    # rows without keys (all masked) are 0; a NaN score stays NaN (nan_to_num would hide it, issue #29)
    p = torch.softmax(s, -1).masked_fill(mask | mask.all(-1, keepdim=True), 0.0)
    dof = _real(grad_out, descale_do)
    of = _real(out, descale_o)
    if seq_len_q is not None:  # rows past seq_len_q carry no gradient
        rows = torch.arange(q.shape[2], device=q.device).view(1, 1, -1, 1) < seq_len_q.view(-1, 1, 1, 1)
        dof = dof * rows
    p8 = quantize_to(p * scale_s, torch.float8_e4m3fn).float() / scale_s
    dv = _group_sum(p8.transpose(-1, -2) @ dof, h_k)
    dp = dof @ vf.transpose(-1, -2)
    delta = (of * dof).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    scale_dq, scale_dk, scale_dv, scale_ds = scales.float().unbind()
    ds8 = quantize_to(ds * scale_ds, torch.float8_e4m3fn).float() / scale_ds
    dq = ds8 @ kf
    dk = _group_sum(ds8.transpose(-1, -2) @ qf, h_k)
    amax = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in (dq, dk, dv, ds)])
    grads = tuple(torch.empty_like(t, dtype=dt).copy_(quantize_to(g * sc, dt)) for t, g, sc, dt in  # t's layout
                  zip((q, k, v), (dq, dk, dv), (scale_dq, scale_dk, scale_dv), dtypes))
    return grads + (amax,)
