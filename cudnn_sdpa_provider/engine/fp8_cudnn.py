"""FP8 attention (per-tensor scales) on cuDNN graphs: ``sdpa_fp8`` forward, ``sdpa_fp8_backward``.

Like ``dense``, these run on CUDA tensors and never decide a fallback (``route`` has); cuDNN's
rejection at build time surfaces as ``NotSupportedError``. Operands: q (B, H_q, S_q, D), k, v
(B, H_k, S_kv, D), any strides cuDNN can read (others are repaired), float8_e4m3fn (dO may be
float8_e5m2); factors are one-element fp32 tensors (real value = stored value x descale). Outputs:
out and dq, dk, dv are float8_e4m3fn in their operand's dimension order (on Hopper cuDNN writes
FP8 only), lse fp32 (B, H_q, S_q, 1), amax values fp32. Rows past seq_len_q (and, for dk/dv, keys
past seq_len_kv) are 0; lengths are clamped to [0, S] on the device (never read outside a tensor).
"""

from __future__ import annotations

import torch

from . import binding as bd
from ..core import layout
from .binding import Binding, tensor_key
from .graphs import UID, Fp8Key

__all__ = ["forward", "backward"]

_FWD_FACTORS = (UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_S, UID.SCALE_S, UID.SCALE_O)
_BWD_FACTORS = (UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_O, UID.DESCALE_DO, UID.DESCALE_S,
                UID.DESCALE_DP, UID.SCALE_S, UID.SCALE_DQ, UID.SCALE_DK, UID.SCALE_DV, UID.SCALE_DP)
_constants: dict = {}
#: Causal backwards without a padding mask run one batch row at a time when B > 1. With cuDNN 9.19
#: on sm_90 the whole-batch causal FP8 backward at (4, 32/8, 4096, 128) gave dK that changed from
#: call to call and was 0.76 of max off fp32 on batch row 0 (B = 1 calls: the same bits every
#: time, 0.082), and at 8192 it took 22.6 ms against 13.6 ms by rows (results/gpu-run70-*). The
#: rows are views; attention never mixes batch rows, so each row's call gives that row's gradients.
ROW_SPLIT_CAUSAL = True


def _constant(value: float, device) -> torch.Tensor:
    """A (1, 1, 1, 1) fp32 device tensor holding ``value``, made once per (value, device), never written."""
    key = (float(value), device)
    found = _constants.get(key)
    if found is None:
        found = _constants[key] = torch.full((1, 1, 1, 1), float(value), dtype=torch.float32, device=device)
    return found


def _factor(t: torch.Tensor) -> torch.Tensor:
    return bd.small_operand(t, (1, 1, 1, 1), torch.float32)


def _amax_buffers(n: int, device) -> list:
    """``n`` amax outputs starting at 0, one 16-byte row each of one zeroed tensor: cuDNN's FP8
    graphs fold into these buffers rather than overwrite them (stale values in the allocator's
    small-block pool gave wrong amax and, through the recipe's re-runs, wrong gradients on sm_90,
    cuDNN 9.19: results/gpu-run65-fp8-diag.jsonl)."""
    rows = torch.zeros((n, 4), dtype=torch.float32, device=device)
    return [rows[i, :1].view(1, 1, 1, 1) for i in range(n)]


def _lengths(seq_len_q, seq_len_kv, s_q, s_kv):
    """Lengths clamped to the tensors' extents, as the graph declares them."""
    b = seq_len_q.shape[0]
    return (bd.small_operand(seq_len_q.clamp(0, s_q), (b, 1, 1, 1)),
            bd.small_operand(seq_len_kv.clamp(0, s_kv), (b, 1, 1, 1)))


def _zero_past(t: torch.Tensor, lengths: torch.Tensor) -> None:
    """Zero the rows (dim 2) of FP8 ``t`` at or past each batch row's length (0x00 is +0 in FP8)."""
    rows = torch.arange(t.shape[2], device=t.device).view(1, 1, -1, 1) >= lengths.view(-1, 1, 1, 1)
    t.view(torch.uint8).masked_fill_(rows, 0)


def _operands(found: Binding, tensors):
    if not found.fix:
        return tensors
    return tuple(layout.repaired(t) if fix else t for t, fix in zip(tensors, found.repair))


def forward(q, k, v, descale_q, descale_k, descale_v, scale_o, seq_len_q, seq_len_kv, *, scale: float,
            scale_s: float, causal: bool, compute_lse: bool):
    """cuDNN FP8 forward: (out FP8, lse fp32 or an empty tensor, amax (2,) [s, o])."""
    padded = seq_len_q is not None
    signature = ("fp8_fwd", q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), padded, scale, causal,
                 compute_lse)
    found = bd.lookup(signature)
    if found is None:
        found = bd.store(signature, _bind_fwd(q, k, v, padded, scale, causal, compute_lse))
    q, k, v = _operands(found, (q, k, v))
    (size, stride), (lse_size, _) = found.outputs
    out = torch.empty_strided(size, stride, dtype=torch.float8_e4m3fn, device=q.device)
    out_buf = out if found.direct[0] else torch.empty(size, dtype=torch.float8_e4m3fn, device=q.device)
    lse = torch.empty(lse_size, dtype=torch.float32, device=q.device) if compute_lse else \
        torch.empty((0,), dtype=torch.float32, device=q.device)
    amax = _amax_buffers(2, q.device)
    factors = (_factor(descale_q), _factor(descale_k), _factor(descale_v), _constant(1.0 / scale_s, q.device),
               _constant(scale_s, q.device), _factor(scale_o))
    buffers = (q, k, v, out_buf) + ((lse,) if compute_lse else ()) + tuple(amax) + factors
    if padded:
        seq_len_q, seq_len_kv = _lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
        buffers += (seq_len_q, seq_len_kv)
    bd.run(found, buffers, q.device.index)
    if out_buf is not out:
        out.copy_(out_buf)
    if padded:
        _zero_past(out, seq_len_q.view(-1))
    return out, lse, torch.cat([a.view(1) for a in amax])


def _bind_fwd(q, k, v, padded, scale, causal, compute_lse) -> Binding:
    b, h, s_q, _ = q.shape
    repair = tuple(not layout.usable(t) for t in (q, k, v))
    qr, kr, vr = (layout.repaired(t) if fix else t for t, fix in zip((q, k, v), repair))
    out = layout.dense_out(q, (b, h, s_q, v.shape[3]), torch.float8_e4m3fn)
    direct = layout.strides_usable(out)
    out_desc = bd.desc(out if direct else torch.empty(tuple(out.shape), dtype=out.dtype, device=q.device))
    lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=q.device)
    key = Fp8Key(device=q.device.index, backward=False, q=bd.desc(qr), k=bd.desc(kr), v=bd.desc(vr), o=out_desc,
                 lse=bd.desc(lse) if compute_lse else None, scale=float(scale), causal=bool(causal), padded=padded)
    uids = (UID.Q, UID.K, UID.V, UID.O) + ((UID.LSE,) if compute_lse else ()) + (UID.AMAX_S, UID.AMAX_O)
    uids += _FWD_FACTORS + ((UID.SEQ_Q, UID.SEQ_KV) if padded else ())
    return Binding(plan=bd.graphs.plan(key), uids=tuple(int(u) for u in uids), repair=repair,
                   outputs=((tuple(out.shape), out.stride()), ((b, h, s_q, 1), lse.stride())),
                   direct=(direct, True), extra={}, fix=any(repair))


def backward(grad_out, q, k, v, out, lse, descales, scales, seq_len_q, seq_len_kv, *, scale: float,
             scale_s: float, causal: bool):
    """cuDNN FP8 backward at fixed scales: (dq, dk, dv FP8, amax (4,) [dq, dk, dv, ds]).

    ``descales`` = (q, k, v, o, do) one-element fp32 tensors; ``scales`` (4,) fp32 [dq, dk, dv, ds]."""
    padded = seq_len_q is not None
    if causal and not padded and q.shape[0] > 1 and ROW_SPLIT_CAUSAL:
        return _by_rows(grad_out, q, k, v, out, lse, descales, scales, scale=scale, scale_s=scale_s)
    signature = ("fp8_bwd", q.device.index, tensor_key(grad_out), tensor_key(q), tensor_key(k), tensor_key(v),
                 tensor_key(out), tensor_key(lse), padded, scale, causal)
    found = bd.lookup(signature)
    if found is None:
        found = bd.store(signature, _bind_bwd(grad_out, q, k, v, out, lse, padded, scale, causal))
    grad_out, q, k, v, out, lse = _operands(found, (grad_out, q, k, v, out, lse))
    results, targets = bd.outputs(found, (torch.float8_e4m3fn,) * 3, q.device)
    amax = _amax_buffers(4, q.device)
    scale_each = [_factor(s) for s in scales.float().unbind()]  # small_operand copies the misaligned ones
    descale_dp = torch.reciprocal(scale_each[3])
    factors = tuple(_factor(t) for t in descales) + (_constant(1.0 / scale_s, q.device), descale_dp,
                                                     _constant(scale_s, q.device)) + tuple(scale_each)
    buffers = (q, k, v, out, grad_out, lse) + tuple(targets) + tuple(amax) + factors
    if padded:
        seq_len_q, seq_len_kv = _lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
        buffers += (seq_len_q, seq_len_kv)
    bd.run(found, buffers, q.device.index)
    bd.copy_back(results, targets)
    if padded:
        for t, n in zip(results, (seq_len_q, seq_len_kv, seq_len_kv)):
            _zero_past(t, n.view(-1))
    return tuple(results) + (torch.cat([a.view(1) for a in amax]),)


def _by_rows(grad_out, q, k, v, out, lse, descales, scales, *, scale: float, scale_s: float):
    """``backward`` (causal, no padding mask) as one call per batch row, on views: each row's
    gradients copied into buffers laid out as ``backward``'s own, amax the largest over the rows."""
    grads = [layout.grad_like(t) for t in (q, k, v)]
    amax = []
    for i in range(q.shape[0]):
        row = slice(i, i + 1)
        *parts, row_amax = backward(grad_out[row], q[row], k[row], v[row], out[row], lse[row], descales, scales,
                                    None, None, scale=scale, scale_s=scale_s, causal=True)
        for g, part in zip(grads, parts):
            g[row].view(torch.uint8).copy_(part.view(torch.uint8))
        amax.append(row_amax)
    return tuple(grads) + (torch.stack(amax).amax(dim=0),)


def _bind_bwd(grad_out, q, k, v, out, lse, padded, scale, causal) -> Binding:
    operands = (grad_out, q, k, v, out, lse)
    repair = tuple(not layout.usable(t) for t in operands)
    dor, qr, kr, vr, outr, lser = (layout.repaired(t) if fix else t for t, fix in zip(operands, repair))
    grads = [layout.grad_like(t) for t in (q, k, v)]  # q, k, v are float8_e4m3fn: so are their gradients
    direct = tuple(layout.strides_usable(g) for g in grads)
    descs = [bd.desc(g if ok else torch.empty(tuple(g.shape), dtype=g.dtype, device=q.device))
             for g, ok in zip(grads, direct)]
    key = Fp8Key(device=q.device.index, backward=True, q=bd.desc(qr), k=bd.desc(kr), v=bd.desc(vr),
                 o=bd.desc(outr), lse=bd.desc(lser), scale=float(scale), causal=bool(causal), padded=padded,
                 do=bd.desc(dor), dq=descs[0], dk=descs[1], dv=descs[2])
    uids = (UID.Q, UID.K, UID.V, UID.O, UID.DO, UID.LSE, UID.DQ, UID.DK, UID.DV, UID.AMAX_DQ, UID.AMAX_DK,
            UID.AMAX_DV, UID.AMAX_DP) + _BWD_FACTORS + ((UID.SEQ_Q, UID.SEQ_KV) if padded else ())
    # _operands repairs in the order (grad_out, q, k, v, out, lse); the buffers go in uid order
    return Binding(plan=bd.graphs.plan(key), uids=tuple(int(u) for u in uids), repair=repair,
                   outputs=tuple((tuple(g.shape), g.stride()) for g in grads), direct=direct, extra={},
                   fix=any(repair))
