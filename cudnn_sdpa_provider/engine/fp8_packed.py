"""FP8 attention forward on packed (varlen, (T, H, D)) operands: cuDNN's ``sdpa_fp8`` with ragged offsets.

Declared as ``packed`` declares the bf16 ragged graphs: each operand a nominal (B, H, S_max, D)
tensor with token-major strides, each sequence found by a ragged offset (cu_seqlens x token stride,
in elements) and read for its own length only (the lengths are the padding mask); S_max is
max_seqlen rounded up to a power of two (``packed.seqlen_bucket``), so a new max_seqlen inside a
bucket runs the graph already built. B is the number of sequences itself, not rounded up as the
bf16 graphs' is: a bucket's extra sequences would be empty, and cuDNN 9.19's FP8 graphs fault on a
zero-length sequence (``core.known_issues``). The graph keys on heads, head dims, B, the S buckets,
whether the LSE is asked for, the scale and the causal flag, never on the token count.

cuDNN 9.19 serves this forward on sm_90 (results/gpu-run57-fp8-varlen-probe.json: within the dense
FP8 bounds causal, non-causal, GQA, d64, and nothing written past the last sequence) but refuses
the THD FP8 backward there ("sdpa fp8 backward with THD is not supported on Hopper architecture"):
``ops.fp8_varlen`` runs the backward on the padded form instead (on the FP8 reference: cuDNN's
padded FP8 backward is a known issue, ``core.known_issues``).

Like ``fp8_cudnn``, this runs on CUDA tensors and never decides a fallback. Operands must be
contiguous float8_e4m3fn (T, H, D) (others are copied first); out (T_q, H_q, D_v) float8_e4m3fn,
lse (T_q, H_q) fp32 token-major, amax (2,) [s, o]. Lengths are not read on the host here: the
caller must send no zero-length sequence (``ops.fp8_varlen`` reads them first and runs the
reference on such a call). cu_seqlens that do not start at 0, decrease, run past the tokens or hold
a sequence longer than its max_seqlen (with ``whole``, also: end anywhere but at the packed tokens,
as ``csp.fp8.attention`` requires, its scales coming from the whole tensors) become zero lengths
(``packed._Lengths``), so the op sends those to the reference too, whose outputs are then NaN.
Rows past cu_seqlens_q[-1] are never written by cuDNN: they keep the fill (0), or a caller's
``out`` / ``lse`` buffer's contents.
"""

from __future__ import annotations

import torch

from . import binding as bd
from ..core import layout
from .binding import Binding
from .fp8_cudnn import _constant  # one cache of the graphs' constant factors
from .graphs import UID, Fp8Key
from .packed import _Lengths, _key, _lse_desc, _ragged, _token_stride, seqlen_bucket

__all__ = ["forward", "buckets"]

_FACTORS = (UID.DESCALE_Q, UID.DESCALE_K, UID.DESCALE_V, UID.DESCALE_S, UID.SCALE_S, UID.SCALE_O)
_NAN = 0x7F  # float8_e4m3fn NaN


def buckets(batch: int, max_q: int, max_kv: int) -> tuple[int, int, int]:
    """(declared B, S_q, S_kv): the graph's dims for ``batch`` sequences of at most ``max_q`` /
    ``max_kv`` tokens (``ops.fp8_varlen`` pads the backward to the same dims): B as given, S bucketed."""
    return batch, seqlen_bucket(max_q), seqlen_bucket(max_kv)


def _factor(t: torch.Tensor) -> torch.Tensor:
    return bd.small_operand(t, (1, 1, 1, 1), torch.float32)


def _filled(n: _Lengths, buf: torch.Tensor | None, shape, dtype, device) -> torch.Tensor:
    """A new buffer filled with 0 (NaN when a length is bad); a caller's buffer only poisoned when bad."""
    if buf is None:
        buf = torch.empty(shape, dtype=dtype, device=device)
        if dtype == torch.float8_e4m3fn:
            buf.view(torch.uint8).fill_(torch.where(n.bad, _NAN, 0))
            return buf
        return n.filled(buf)
    if buf.dtype == torch.float8_e4m3fn:
        buf.view(torch.uint8).masked_fill_(n.bad, _NAN)
    else:
        buf.masked_fill_(n.bad, float("nan"))
    return buf


def forward(q, k, v, descale_q, descale_k, descale_v, scale_o, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int,
            max_seqlen_kv: int, *, scale: float, scale_s: float, causal: bool, compute_lse: bool, out=None,
            lse=None, whole: bool = False, lengths=None):
    """cuDNN FP8 varlen forward: (out (T_q, H_q, D_v) FP8, lse (T_q, H_q) fp32 or an empty tensor,
    amax (2,) [s, o]). ``out`` / ``lse``: contiguous buffers of those shapes to write into (rows
    outside the sequences keep their contents: the GPU tier's canaries). ``lengths``: the call's
    ``packed._Lengths`` when the caller made them already (at this batch, with this ``whole``)."""
    nb, sq, skv = buckets(cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_kv)
    signature = ("fp8_varlen_fwd", q.device.index, _key(q), _key(k), _key(v), nb, sq, skv, float(scale),
                 bool(causal), bool(compute_lse))
    found = bd.lookup(signature) or bd.store(signature, _bind(q, k, v, nb, sq, skv, scale, causal, compute_lse))
    n = lengths if lengths is not None else \
        _Lengths(cu_seqlens_q, cu_seqlens_kv, nb, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_kv, whole=whole)
    qr, kr, vr = (layout.packed_repaired(t) if fix else t for t, fix in zip((q, k, v), found.repair))
    t_q, h = q.shape[0], q.shape[1]
    o = _filled(n, out, (t_q, h, v.shape[2]), torch.float8_e4m3fn, q.device)
    stats = _filled(n, lse, (t_q, h), torch.float32, q.device) if compute_lse else \
        torch.empty((0,), dtype=torch.float32, device=q.device)
    amax = [torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=q.device) for _ in range(2)]
    factors = (_factor(descale_q), _factor(descale_k), _factor(descale_v), _constant(1.0 / scale_s, q.device),
               _constant(scale_s, q.device), _factor(scale_o))
    ts = _token_stride
    buffers = [qr, kr, vr, o] + ([stats] if compute_lse else []) + amax + list(factors) + [
        n.len_q, n.len_kv, n.offsets("q", ts(qr)), n.offsets("kv", ts(kr)), n.offsets("kv", ts(vr)),
        n.offsets("q", ts(o))] + ([n.offsets("q", h)] if compute_lse else [])
    bd.run(found, tuple(buffers), q.device.index)
    amax = torch.cat([a.view(1) for a in amax])
    return o, stats, torch.where(n.bad, float("nan"), amax)


def _bind(q, k, v, batch, sq, skv, scale, causal, compute_lse) -> Binding:
    repair = tuple(not layout.packed_usable(t) for t in (q, k, v))
    shape_o = (q.shape[0], q.shape[1], v.shape[2])
    key = Fp8Key(device=q.device.index, backward=False, q=_ragged(q.shape, q.dtype, batch, sq),
                 k=_ragged(k.shape, k.dtype, batch, skv), v=_ragged(v.shape, v.dtype, batch, skv),
                 o=_ragged(shape_o, torch.float8_e4m3fn, batch, sq),
                 lse=_lse_desc(q.shape[1], batch, sq) if compute_lse else None, scale=float(scale),
                 causal=bool(causal), ragged=True)
    uids = (UID.Q, UID.K, UID.V, UID.O) + ((UID.LSE,) if compute_lse else ()) + (UID.AMAX_S, UID.AMAX_O)
    uids += _FACTORS + (UID.SEQ_Q, UID.SEQ_KV, UID.RAG_Q, UID.RAG_K, UID.RAG_V, UID.RAG_O)
    uids += (UID.RAG_LSE,) if compute_lse else ()
    return Binding(plan=bd.graphs.plan(key), uids=tuple(int(u) for u in uids), repair=repair, outputs=(), direct=(),
                   extra={}, fix=any(repair))
