"""Packed (varlen) attention on cuDNN's ragged graphs: forward and backward through bindings.

Conventions: q (T_q, H_q, D_qk), k (T_kv, H_k, D_qk), v (T_kv, H_v, D_v); cu_seqlens (B+1,) int32;
out ``empty_like(q)`` and dq/dk/dv ``empty_like(q/k/v)`` (FlashAttention's layouts, ``layout``);
lse (T_q, H_q) fp32 token-major. Rows of out/lse/dq past cu_seqlens_q[-1] and of dk/dv past
cu_seqlens_kv[-1] are 0.

cuDNN reads an operand in place only when it is contiguous (``layout.packed_usable``); anything
else is copied first (views of fused QKV buffers, head-dim slices, transposed storage). cuDNN sees
each operand as a nominal (B, H, S_max, D) tensor with token-major strides, each sequence located
by a ragged offset (``cu_seqlens * token stride``, in elements) and read for its own length only.

Keying: one graph serves a range of batches. A varlen training loop changes the lengths, the token
count and the number of sequences of every batch; the graphs key on none of them exactly:

* S_max is max_seqlen rounded up to a power of two (``seqlen_bucket``), for q and kv separately;
* B is the number of sequences rounded up to a power of two (``batch_bucket``); the sequences a
  bucket adds are empty (length 0, ragged offset at cu_seqlens[-1]): cuDNN reads and writes nothing
  of them, as for any empty sequence;
* the token count is never part of a forward key, nor of a backward key while cuDNN's nominal fp32
  dQ accumulator (B x H_q x S_max x D_qk x 4 bytes at the bucketed B and S) is at most
  ``ACCUMULATOR_BUDGET`` (256 MiB): ``max_total_seq_len`` is then left unset and cuDNN sizes the
  accumulator by the declared dims. Over the budget (B x S_max about 32k tokens at H_q x D_qk = 2048)
  the accumulator is sized by the packed tokens instead (``max_total``, ``token_bucket``: at most 1/16
  over), as before, so the memory stays that of the tokens and the backward builds one graph per
  token bound (16 per octave of the token count) inside the bucket;
* the backward's LSE is padded, (B, H_q, S_max, 1), while that tensor is at most
  ``PADDED_LSE_BUDGET`` (16 MiB), else ragged (``padded_lse_pays``): a function of the bucket alone.

So a configuration seen before builds at most one forward and one backward graph per (S_q bucket,
S_kv bucket, batch bucket) under the budget. One exception: a deterministic backward whose workspace
grows with B x S_q x S_kv (sm_90 with cuDNN < 9.25, ``support.deterministic_workspace_bytes``)
declares the call's own B and max_seqlen, because the route's workspace gate bounds it on those.

Every declared extent stays inside memory that exists: the batch stride is never stepped (each
sequence's base is its ragged offset, and cuDNN reads only its length's rows from it), the index
tensors (lengths, offsets) and the padded LSE are allocated at the declared batch, and the
accumulator is cuDNN's own workspace, sized from the declared dims or from a bound that is at least
the packed tokens (so at least cu_seqlens[-1]: ``max_total``).

Lengths are never read on the host. cu_seqlens that do not start at 0, decrease, run past the packed
tokens, or hold a sequence longer than its max_seqlen are detected on the device: cuDNN then gets
all-zero offsets and lengths (it reads and writes nothing) and the outputs, whose buffers start
filled with NaN instead of 0, stay NaN. So no length can make cuDNN touch memory outside the
tensors, and none is silently computed as another.
"""

from __future__ import annotations

import torch

from . import binding as bd
from ..core import layout, rows, support
from . import machine
from .binding import Binding, tensor_key
from .dense import alignment
from .folded import seqlen_bucket  # one bucket rule for the packed and the folded dense graphs
from .graphs import UID, BwdKey, Desc, FwdKey

__all__ = ["forward", "backward", "seqlen_bucket", "batch_bucket", "token_bucket", "max_total", "padded_lse_pays",
           "ACCUMULATOR_BUDGET", "PADDED_LSE_BUDGET"]

#: Bytes of cuDNN's nominal fp32 dQ accumulator (B x H_q x S_max x D_qk x 4, at the bucketed B and
#: S) up to which a ragged backward leaves ``max_total_seq_len`` unset, so that its key holds no token
#: count. A call then uses at most this much more workspace than a token-sized accumulator would.
ACCUMULATOR_BUDGET = 256 * 2**20

#: Bytes of the padded (B, H_q, S_max, 1) fp32 LSE up to which a ragged backward takes it padded.
PADDED_LSE_BUDGET = 16 * 2**20


def batch_bucket(n: int) -> int:
    """The declared batch for ``n`` sequences: the next power of two (one graph per doubling of the
    batch; the sequences it adds are empty)."""
    return seqlen_bucket(n)


def token_bucket(n: int) -> int:
    """Round a token count up to one of 16 steps per power of two (steps of at least 64): a bound
    close to ``n`` (at most 1/16 over) that lets one graph serve many batch totals."""
    n = max(int(n), 1)
    step = max(64, 1 << max(n.bit_length() - 5, 0))
    return -(-n // step) * step


def max_total(caps, tokens_q: int, tokens_kv: int, batch: int, s_q: int, s_kv: int, h_q: int, d_qk: int, d_v: int):
    """``max_total_seq_len_q/kv`` for a ragged backward of declared ``batch`` x ``s_q`` / ``s_kv``, or
    None to leave them unset.

    Unset, cuDNN sizes the fp32 dQ accumulator for the nominal B x S_max tokens; set, for the bound
    (cudnn-frontend's ``CompositeSDPABackwardNode``: the accumulator is then indexed by dQ's ragged
    offsets, so the bound must cover every token a call writes; a larger one only costs workspace).
    While the nominal accumulator is at most ``ACCUMULATOR_BUDGET`` bytes it stays unset, so the key
    holds no token count. Over it, the tokens of the packed buffers bound the real totals (host ints,
    no sync; at least cu_seqlens[-1] of any call served), rounded up by ``token_bucket`` and capped
    at the nominal size: less peak memory for a few percent of backward time (docs/performance.md),
    one graph per bound. The frontend warns of known problems with head dims not a multiple of 16 and
    with pre-Hopper kernels: there they stay unset."""
    if caps.compute_capability is None or caps.compute_capability < (9, 0) or d_qk % 16 or d_v % 16:
        return None
    nominal = (batch * s_q, batch * s_kv)
    if nominal[0] * h_q * d_qk * 4 <= ACCUMULATOR_BUDGET:
        return None
    bounds = (min(token_bucket(tokens_q), nominal[0]), min(token_bucket(tokens_kv), nominal[1]))
    return None if bounds == nominal else bounds


def padded_lse_pays(batch: int, s_max: int, h: int) -> bool:
    """Whether a ragged backward of declared ``batch`` x ``s_max`` takes its LSE padded,
    (B, H, S_max, 1), instead of ragged: while that tensor is at most ``PADDED_LSE_BUDGET`` bytes.

    With a padded LSE cuDNN 9.19 on an H200 runs its padded dO.O kernel, 2.3x faster than the
    ragged one at the bench's varlen case (docs/performance-notes.md, "Varlen"), but the padded
    tensor (and its gather) grows with B x S_max rather than with the tokens: a batch of many short
    sequences under one long one would pay more for it than it saves. The bound is on the bucket
    alone (never the token count), so the choice never splits a bucket into two graphs; under it
    the gather costs at most a few 16 MiB passes."""
    return batch * h * s_max * 4 <= PADDED_LSE_BUDGET


def _exact_backward(caps, q, v, deterministic: bool) -> bool:
    """Whether a backward declares the call's own B and max_seqlen instead of buckets: a deterministic
    one whose workspace grows with B x S_q x S_kv here, which the route's gate bounds on the call's
    dims (``support.deterministic_workspace_bytes``)."""
    if not deterministic:
        return False
    probe = support.Problem(kind="varlen", backward=True, device_type="cuda", dtypes=(q.dtype,) * 3, batch=1, h_q=1,
                            h_k=1, h_v=1, s_q=1, s_kv=1, d_qk=q.shape[2], d_v=v.shape[2], deterministic=True)
    return support.deterministic_workspace_bytes(probe, caps) > 0


def _ragged(t_shape, dtype, batch: int, s_max: int) -> Desc:
    """A contiguous (T, H, D) operand as cuDNN sees it: nominal (B, H, S_max, D) with token stride
    H*D and head stride D. The batch stride is never stepped (ragged offsets give each sequence's
    base): the extent of one full sequence."""
    ts, hs, ds = t_shape[1] * t_shape[2], t_shape[2], 1
    return Desc((batch, t_shape[1], s_max, t_shape[2]), (s_max * ts, hs, ts, ds), dtype)


def _lse_desc(h: int, batch: int, s_max: int) -> Desc:
    return Desc((batch, h, s_max, 1), (s_max * h, 1, h, 1), torch.float32)  # (T, H) token-major


def _check_cu(cu: torch.Tensor, name: str) -> None:
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor of prefix sums, got {cu.dtype} with shape {tuple(cu.shape)}")


def _token_stride(t: torch.Tensor) -> int:
    """The token stride the graph declares for a contiguous (T, H, D) buffer (``t.stride(0)`` can be
    anything when T == 1)."""
    return t.shape[1] * t.shape[2]


def _to_batch(cu: torch.Tensor, batch: int) -> torch.Tensor:
    """cu_seqlens for the declared ``batch``: its last entry repeated, so the sequences the bucket
    adds are empty and start at the last token (a device-side copy, no sync; ``cu`` itself when it
    already has ``batch + 1`` entries)."""
    extra = batch + 1 - cu.shape[0]
    if extra <= 0:
        return cu
    return torch.cat((cu, cu[-1:].expand(extra))) if cu.shape[0] else cu.new_zeros(batch + 1)


class _Lengths:
    """The per-call length terms at the declared ``batch`` (``_to_batch``): safe cu_seqlens (all 0
    when any length is out of range), the lengths cuDNN reads, ragged offsets by token stride, the
    0-dim ``bad`` flag and the value the outputs start at (NaN when bad, else 0)."""

    def __init__(self, cu_q, cu_kv, batch: int, t_q: int, t_kv: int, max_q: int, max_kv: int, whole: bool = False):
        """``whole``: the sequences must cover every packed token (cu_seqlens ending at T; FP8's rule,
        whose per-tensor scales come from the whole tensors), else the call is bad too."""
        same = cu_q is cu_kv
        if whole:
            short = (cu_q[-1] != t_q) | (cu_kv[-1] != t_kv)
        cu_q = _to_batch(cu_q, batch)
        cu_kv = cu_q if same else _to_batch(cu_kv, batch)
        diff_q = cu_q.diff()
        diff_kv = diff_q if same else cu_kv.diff()
        self.bad = rows.bad_packed_lengths(cu_q, diff_q, cu_kv, diff_kv, t_q, t_kv, max_q, max_kv)
        if whole:
            self.bad = self.bad | short
        self.cu_q = torch.where(self.bad, 0, cu_q)
        self.cu_kv = self.cu_q if same else torch.where(self.bad, 0, cu_kv)
        self.fill = torch.where(self.bad, float("nan"), 0.0)  # 0-dim: what the outputs start at
        self._words: dict = {}
        # The lengths of the safe cu_seqlens: 0 everywhere when bad, else the real ones.
        self.len_kv = torch.where(self.bad, 0, diff_kv).view(-1, 1, 1, 1)
        # Queries of a sequence with no keys attend to nothing: 0 by definition. cuDNN < 9.25 writes
        # NaN for them, so it is not asked to compute them (length 0); their rows keep the fill, 0.
        self.len_q = self.len_kv if same else torch.where(self.len_kv == 0, 0, diff_q.view(-1, 1, 1, 1))
        self._offsets: dict = {}

    def filled(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` filled with the start value (``rows.fill``)."""
        if buf.dtype not in self._words:
            self._words[buf.dtype] = rows.fill_words(self.bad, buf.dtype)
        return rows.fill(buf, self.fill, self._words[buf.dtype])

    def offsets(self, side: str, stride: int) -> torch.Tensor:
        found = self._offsets.get((side, stride))
        if found is None:
            cu = self.cu_q if side == "q" else self.cu_kv
            found = self._offsets[(side, stride)] = (cu * stride).view(-1, 1, 1, 1)
        return found


def _key(t) -> tuple | None:
    """A packed tensor's part of a signature: heads, head dim, dtype, whether cuDNN reads it in place.
    Never the token count, which changes from batch to batch while nothing about the graph does."""
    return None if t is None else (t.shape[1], t.shape[2], t.dtype, layout.packed_usable(t))


def _output(like: torch.Tensor, shape, dtype, n: _Lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output in the layout policy's strides, the contiguous buffer cuDNN writes), filled."""
    out = layout.packed_out(like, shape, dtype)
    buf = out if out.is_contiguous() else torch.empty(tuple(shape), dtype=dtype, device=like.device)
    return out, n.filled(buf)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *, scale: float,
            window=(-1, -1), bottom_right=False, sinks=None):
    """cuDNN varlen forward: (out (T_q, H_q, D_v), lse (T_q, H_q) fp32)."""
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_kv, "cu_seqlens_kv")
    bottom_right = alignment(bottom_right, (cu_seqlens_q, cu_seqlens_kv))
    nb = batch_bucket(cu_seqlens_q.shape[0] - 1)
    sq, skv = seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_kv)
    signature = ("varlen_fwd", q.device.index, _key(q), _key(k), _key(v), nb, sq, skv, tensor_key(sinks), scale,
                 window, bottom_right)
    found = bd.lookup(signature) or bd.store(signature, _bind_forward(q, k, v, nb, sq, skv, sinks, scale, window,
                                                                      bottom_right))
    n = _Lengths(cu_seqlens_q, cu_seqlens_kv, nb, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_kv)
    qr, kr, vr = (layout.packed_repaired(t) if fix else t for t, fix in zip((q, k, v), found.repair))
    t_q, h = q.shape[0], q.shape[1]
    out, out_buf = _output(q, (t_q, h, v.shape[2]), q.dtype, n)
    lse = n.filled(torch.empty((t_q, h), dtype=torch.float32, device=q.device))
    ts = _token_stride
    buffers = [qr, kr, vr, out_buf, lse, n.len_q, n.len_kv, n.offsets("q", ts(qr)), n.offsets("kv", ts(kr)),
               n.offsets("kv", ts(vr)), n.offsets("q", ts(out_buf)), n.offsets("q", h)]
    if sinks is not None:
        buffers.append(bd.small_operand(sinks, (1, h, 1, 1), torch.float32))
    bd.run(found, tuple(buffers), q.device.index)
    bd.copy_back([out], [out_buf])
    return out, lse


def _bind_forward(q, k, v, batch, sq, skv, sinks, scale, window, bottom_right) -> Binding:
    repair = tuple(not layout.packed_usable(t) for t in (q, k, v))
    shape_o = (q.shape[0], q.shape[1], v.shape[2])
    key = FwdKey(device=q.device.index, q=_ragged(q.shape, q.dtype, batch, sq), k=_ragged(k.shape, k.dtype, batch, skv),
                 v=_ragged(v.shape, v.dtype, batch, skv), o=_ragged(shape_o, q.dtype, batch, sq),
                 lse=_lse_desc(q.shape[1], batch, sq),
                 scale=float(scale), window=tuple(window), bottom_right=bool(bottom_right), sinks=sinks is not None,
                 ragged=True)
    uids = (UID.Q, UID.K, UID.V, UID.O, UID.LSE, UID.SEQ_Q, UID.SEQ_KV, UID.RAG_Q, UID.RAG_K, UID.RAG_V, UID.RAG_O,
            UID.RAG_LSE) + ((UID.SINK,) if sinks is not None else ())
    return Binding(plan=_plan(key), uids=tuple(int(u) for u in uids), repair=repair, outputs=(), direct=(),
                   extra={}, fix=any(repair))


def _plan(key):
    return bd.graphs.plan(key)


def backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *,
             scale: float, window=(-1, -1), bottom_right=False, sinks=None, deterministic=False):
    """cuDNN varlen backward; ``lse`` is (T_q, H_q) fp32. Returns (dq, dk, dv, dsinks or None)."""
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_kv, "cu_seqlens_kv")
    bottom_right = alignment(bottom_right, (cu_seqlens_q, cu_seqlens_kv))
    caps = machine.capabilities(q.device.index)
    batch = cu_seqlens_q.shape[0] - 1
    if _exact_backward(caps, q, v, deterministic):
        nb, sq, skv = max(batch, 1), max(int(max_seqlen_q), 1), max(int(max_seqlen_kv), 1)
    else:
        nb, sq, skv = batch_bucket(batch), seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_kv)
    bounds = max_total(caps, q.shape[0], k.shape[0], nb, sq, skv, q.shape[1], q.shape[2], v.shape[2])
    padded = padded_lse_pays(nb, sq, q.shape[1])
    signature = ("varlen_bwd", q.device.index, _key(grad_out), _key(q), _key(k), _key(v), _key(out), nb, sq, skv,
                 bounds, tensor_key(sinks), scale, window, bottom_right, deterministic)
    found = bd.lookup(signature) or bd.store(signature, _bind_backward(grad_out, q, k, v, out, nb, sq, skv, bounds,
                                                                       padded, sinks, scale, window, bottom_right,
                                                                       deterministic))
    n = _Lengths(cu_seqlens_q, cu_seqlens_kv, nb, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_kv)
    qr, kr, vr, outr, do = (layout.packed_repaired(t) if fix else t
                            for t, fix in zip((q, k, v, out, grad_out), found.repair))
    if padded:  # (B, H, S_max, 1): see padded_lse_pays
        stats = rows.padded_lse(lse, n.cu_q[:-1], n.len_q.view(-1), sq)
    else:  # ragged, contiguous and aligned: cuDNN < 9.26 misreads others
        stats = bd.small_operand(lse, tuple(lse.shape))
    (dq, dq_buf), (dk, dk_buf), (dv, dv_buf) = (_output(t, tuple(t.shape), t.dtype, n) for t in (q, k, v))
    h, ts = q.shape[1], _token_stride
    buffers = [qr, kr, vr, outr, do, stats, dq_buf, dk_buf, dv_buf, n.len_q, n.len_kv,
               n.offsets("q", ts(qr)), n.offsets("kv", ts(kr)), n.offsets("kv", ts(vr)), n.offsets("q", ts(outr)),
               n.offsets("q", ts(do))] + ([] if padded else [n.offsets("q", h)]) + [
               n.offsets("q", ts(dq_buf)), n.offsets("kv", ts(dk_buf)), n.offsets("kv", ts(dv_buf))]
    if sinks is not None:
        buffers += [bd.small_operand(sinks, (1, h, 1, 1), torch.float32),
                    torch.empty((1, h, 1, 1), dtype=torch.float32, device=q.device)]
    bd.run(found, tuple(buffers), q.device.index)
    bd.copy_back([dq, dk, dv], [dq_buf, dk_buf, dv_buf])
    return dq, dk, dv, (rows.sink_grad_packed(sinks, lse, outr, do) if sinks is not None else None)


def _bind_backward(grad_out, q, k, v, out, batch, sq, skv, bounds, padded, sinks, scale, window, bottom_right,
                   deterministic) -> Binding:
    shape_o = (q.shape[0], q.shape[1], v.shape[2])
    repair = tuple(not layout.packed_usable(t) for t in (q, k, v, out, grad_out))

    def ragged(shape, dtype, s):
        return _ragged(shape, dtype, batch, s)

    h = q.shape[1]
    lse = Desc((batch, h, sq, 1), (h * sq, sq, 1, 1), torch.float32) if padded else _lse_desc(h, batch, sq)
    key = BwdKey(device=q.device.index, q=ragged(q.shape, q.dtype, sq), k=ragged(k.shape, k.dtype, skv),
                 v=ragged(v.shape, v.dtype, skv), o=ragged(shape_o, q.dtype, sq), do=ragged(shape_o, q.dtype, sq),
                 lse=lse, dq=ragged(q.shape, q.dtype, sq),
                 dk=ragged(k.shape, k.dtype, skv), dv=ragged(v.shape, v.dtype, skv), scale=float(scale),
                 window=tuple(window), bottom_right=bool(bottom_right), sinks=sinks is not None, ragged=True,
                 deterministic=bool(deterministic), max_total=bounds, padded_lse=bool(padded))
    uids = (UID.Q, UID.K, UID.V, UID.O, UID.DO, UID.LSE, UID.DQ, UID.DK, UID.DV, UID.SEQ_Q, UID.SEQ_KV, UID.RAG_Q,
            UID.RAG_K, UID.RAG_V, UID.RAG_O, UID.RAG_DO) + (() if padded else (UID.RAG_LSE,)) + (
            UID.RAG_DQ, UID.RAG_DK, UID.RAG_DV)
    uids += (UID.SINK, UID.DSINK) if sinks is not None else ()
    return Binding(plan=_plan(key), uids=tuple(int(u) for u in uids), repair=repair, outputs=(), direct=(),
                   extra={}, fix=any(repair))
