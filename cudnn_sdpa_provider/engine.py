"""The cuDNN path: check, repair operands, allocate outputs by the layout policy, run the graph.

These functions run on CUDA tensors only and never fall back: when cuDNN cannot serve a call
they raise ``NotSupportedError`` (before doing any work) with the reason slug. Callers (the
custom ops, the provider's overrides) decide what a fallback is and record it.

Conventions:
  dense   q (B, H_q, S_q, D_qk), k (B, H_k, S_kv, D_qk), v (B, H_v, S_kv, D_v), any strides;
          out (B, H_q, S_q, D_v) in q's dimension order; lse (B, H_q, S_q, 1) fp32 contiguous.
  varlen  q (T_q, H_q, D_qk), k (T_kv, H_k, D_qk), v (T_kv, H_v, D_v); cu_seqlens (B+1,) int32;
          out (T_q, H_q, D_v) packed; lse (T_q, H_q) fp32 packed (token-major, like the data).
  window  FlashAttention (left, right), -1 unbounded; bottom_right aligns the diagonal to the
          end of each sequence (per sequence when lengths are given).
  padded  seq_len_q / seq_len_kv (B,) int32 on the device. Rows of out past seq_len_q are 0;
          rows of dq past seq_len_q and of dk/dv past seq_len_kv are 0. lse there is unspecified.
  varlen  rows of out/dq past cu_seqlens_q[-1] and of dk/dv past cu_seqlens_kv[-1] are 0.
"""

from __future__ import annotations

import torch

from . import env, graphs, layout, support
from .errors import NotSupportedError
from .graphs import UID, BwdKey, Desc, FwdKey

__all__ = [
    "dense_problem",
    "varlen_problem",
    "check",
    "dense_fwd",
    "dense_bwd",
    "varlen_fwd",
    "varlen_bwd",
    "seqlen_bucket",
]


# ------------------------------------------------------------------------------------ problems


def dense_problem(q, k, v, *, backward=False, window=(-1, -1), bottom_right=False, sinks=False, bias=None,
                  dropout_p=0.0, padded=False, deterministic=False) -> support.Problem:
    return support.Problem(
        kind="dense",
        backward=backward,
        device_type=q.device.type,
        dtypes=(q.dtype, k.dtype, v.dtype),
        batch=q.shape[0],
        h_q=q.shape[1],
        h_k=k.shape[1],
        h_v=v.shape[1],
        s_q=q.shape[2],
        s_kv=k.shape[2],
        d_qk=q.shape[3],
        d_v=v.shape[3],
        window=tuple(window),
        bottom_right=bottom_right,
        sinks=bool(sinks),
        bias=bias is not None,
        bias_grad=bias is not None and bias.requires_grad and torch.is_grad_enabled(),
        dropout_p=float(dropout_p),
        padded=padded,
        deterministic=deterministic,
        empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0,
    )


def varlen_problem(q, k, v, cu_seqlens_q, max_q, max_kv, *, backward=False, window=(-1, -1), bottom_right=False,
                   sinks=False, deterministic=False) -> support.Problem:
    extent = max(t.shape[0] * max(t.stride(0), 1) for t in (q, k, v))
    return support.Problem(
        kind="varlen",
        backward=backward,
        device_type=q.device.type,
        dtypes=(q.dtype, k.dtype, v.dtype),
        batch=cu_seqlens_q.shape[0] - 1,
        h_q=q.shape[1],
        h_k=k.shape[1],
        h_v=v.shape[1],
        s_q=int(max_q),
        s_kv=int(max_kv),
        d_qk=q.shape[2],
        d_v=v.shape[2],
        window=tuple(window),
        bottom_right=bottom_right,
        sinks=bool(sinks),
        deterministic=deterministic,
        empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or cu_seqlens_q.shape[0] < 2,
        ragged_extent=extent,
    )


def _limit_bytes() -> int | None:
    mb = env.deterministic_workspace_mb()
    if mb is not None:
        return mb * 2**20
    free, _total = torch.cuda.mem_get_info()
    return free // 2


def check(problem: support.Problem, device: torch.device) -> None:
    """Raise NotSupportedError with the first reason, if any (no work done)."""
    caps = support.capabilities(device.index if device.type == "cuda" else None)
    limit = _limit_bytes() if (problem.backward and problem.deterministic and caps.cuda) else None
    found = support.reasons(problem, caps, deterministic_limit_bytes=limit)
    if found:
        raise NotSupportedError(found[0].slug, found[0].message)


# ----------------------------------------------------------------------------------- utilities


def _desc(t: torch.Tensor) -> Desc:
    """Dims and strides as cuDNN should see them: a size-1 dim gets the stride it would have if
    packed (cuDNN rejects 0 and can misread odd strides on dims that are never stepped)."""
    dims = tuple(t.shape)
    strides = list(t.stride())
    for i, size in enumerate(dims):
        if size == 1:
            inner = 1
            for s in dims[i + 1 :]:
                inner *= s
            strides[i] = max(inner, 1)
    return Desc(dims, tuple(strides), t.dtype)


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _run(key, buffers: dict) -> "graphs.Plan":
    p = graphs.plan(key)
    graphs.execute(p, buffers, key.device, _stream(key.device))
    return p


# ---------------------------------------------------------------------------------- fast path
#
# A call whose operands cuDNN can read as they are (no repair, no conversion) is remembered by a
# cheap signature (shapes, strides, dtypes, options). The next call with that signature skips the
# capability check, the graph key and the layout decisions: it checks pointer alignment (the only
# per-call property), allocates the outputs and executes. Bias and dropout calls always take the
# full path. See docs/performance-notes.md for what this saves.


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


class _Fast:
    __slots__ = ("plan", "sizes", "strides", "lse_size", "compute_lse")

    def __init__(self, plan, sizes, strides, lse_size=None, compute_lse=True):
        self.plan, self.sizes, self.strides, self.lse_size, self.compute_lse = plan, sizes, strides, lse_size, compute_lse


def _same(xs, ys) -> bool:
    """Identity, element by element (``==`` on tensors would compare values)."""
    return all(x is y for x, y in zip(xs, ys))


def _sinks_as_is(sinks) -> bool:
    return sinks is None or (sinks.dtype == torch.float32 and sinks.dim() == 1 and sinks.stride(0) == 1)


def _buffer_for(dst: torch.Tensor) -> torch.Tensor:
    """``dst`` when cuDNN can write it directly, else a contiguous stand-in copied back later."""
    return dst if layout.usable(dst) else torch.empty(tuple(dst.shape), dtype=dst.dtype, device=dst.device)


def _dead_rows(s_q: int, s_kv: int, window, bottom_right: bool, seq_len_q=None, seq_len_kv=None, device=None):
    """(B|1, 1, S_q, 1) bool of query rows whose output is 0 by definition: padded rows, and rows
    that see no key at all (a window or alignment that excludes every key, or kv length 0). cuDNN
    leaves such rows unspecified (NaN before 9.25; with sinks, a wrong contribution to dSink,
    found by the GPU fuzz). None when the shapes alone prove every row sees a key."""
    left, right = window
    if seq_len_q is None:
        off = s_kv - s_q if bottom_right else 0
        first_dead = right >= 0 and off + right < 0
        last_dead = left >= 0 and (s_q - 1) + off - left > s_kv - 1
        if not (first_dead or last_dead):
            return None
        lq = torch.full((1, 1), s_q, device=device)  # a fill kernel: torch.tensor would copy (and sync)
        lk = torch.full((1, 1), s_kv, device=device)
    else:
        lq, lk = seq_len_q.view(-1, 1).long(), seq_len_kv.view(-1, 1).long()
    i = torch.arange(s_q, device=device).view(1, -1)
    off = (lk - lq) if bottom_right else torch.zeros_like(lk)
    lo = (i + off - left).clamp(min=0) if left >= 0 else torch.zeros_like(i + off)
    hi = torch.minimum(i + off + right, lk - 1) if right >= 0 else (lk - 1).expand_as(i + off)
    live = (i < lq) & (lo <= hi)
    return (~live).view(live.shape[0], 1, s_q, 1)


def _rows_past(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """(B, 1, s, 1) bool: row index >= length (device-side, no sync)."""
    rows = torch.arange(s, device=lengths.device, dtype=lengths.dtype)
    return (rows[None, :] >= lengths[:, None]).view(lengths.shape[0], 1, s, 1)


def new_philox(device: torch.device, n: int = 2) -> torch.Tensor:
    """Random int64 words for dropout's Philox (seed, offset), drawn from torch's generator on
    ``device`` (``torch.manual_seed`` reproduces them; device-side, no sync, capturable in CUDA
    graphs). Callers take the pair they need (the provider uses elements 0 and 2, see overrides)."""
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)


def bias_operand(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """An additive bias/mask broadcastable to (B, H_q, S_q, S_kv) as cuDNN reads it: 4-D,
    (1|B, 1|H_q, S_q, S_kv), q's dtype, usable strides. Broadcast batch/head dims become size 1
    (no copy); broadcast sequence dims are materialised (cuDNN has no S broadcasting)."""
    b, h, s_q, s_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if bias.dtype == torch.bool:  # F.sdpa converts masks before the op; direct callers may not
        bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf")).expand(bias.shape)
    if bias.dim() > 4:
        raise ValueError(f"attn_bias must have at most 4 dims, got shape {tuple(bias.shape)}")
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if bias.shape[0] > 1 and bias.stride(0) == 0:
        bias = bias[:1]
    if bias.shape[1] > 1 and bias.stride(1) == 0:
        bias = bias[:, :1]
    bb, bh = bias.shape[0], bias.shape[1]
    if bb not in (1, b) or bh not in (1, h) or bias.shape[2] not in (1, s_q) or bias.shape[3] not in (1, s_kv):
        raise ValueError(f"attn_bias of shape {tuple(bias.shape)} does not broadcast to ({b}, {h}, {s_q}, {s_kv})")
    bias = bias.to(q.dtype).expand(bb, bh, s_q, s_kv)
    return layout.repaired(bias)


def seqlen_bucket(n: int) -> int:
    """Round a max sequence length up to a power of two: the descriptor's S is only a bound for
    ragged operands, so bucketing lets one graph serve many batches (PyTorch's MHA does the same)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def _index(t: torch.Tensor, shape) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise TypeError(f"sequence lengths must be int32, got {t.dtype}")
    return t.reshape(shape)


# --------------------------------------------------------------------------------------- dense


def _same_lengths(a, b) -> bool:
    """Whether two length descriptions are the same: equal ints, or one device tensor (the same
    object or the same memory, shape and strides; never read, so no sync)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is b or (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def _alignment(bottom_right: bool, *same) -> bool:
    """``bottom_right``, unless every sequence has as many keys as queries (each pair in ``same``
    is the same): then bottom-right and top-left are the same mask, and top-left is what cuDNN
    runs fastest (with bottom-right, the varlen bench's forward+backward took 7.24 ms against
    4.79 ms with top-left on the H200: runs 15 and 16 of results/gpu-runs.md; masked tiles were
    not skipped)."""
    return bottom_right and not all(_same_lengths(a, b) for a, b in same)


def dense_fwd(q, k, v, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None, bias=None,
              seq_len_q=None, seq_len_kv=None, philox=None, dropout_p=0.0, compute_lse=True, rng_dump=None,
              checked=False):
    """cuDNN forward. Returns (out, lse).

    Dropout: ``philox`` is the (seed, offset) pair of int64 device tensors the forward owns and its
    backward reuses. ``rng_dump`` (tests only): a (B, H_q, S_q, S_kv) fp32 buffer that receives
    the realised keep mask. ``checked=True``: the caller already ran ``check`` on this call."""
    padded = seq_len_q is not None
    bottom_right = _alignment(bottom_right, (q.shape[2], k.shape[2]), (seq_len_q, seq_len_kv))
    signature = None
    if bias is None and dropout_p == 0.0 and rng_dump is None:
        signature = ("dense_fwd", q.device.index, _sig(q), _sig(k), _sig(v), _sig(sinks), _sig(seq_len_q),
                     _sig(seq_len_kv), float(scale), tuple(window), bool(bottom_right), bool(compute_lse))
        hit = graphs.fast_get(signature)
        if hit is not None and _aligned(q, k, v, sinks):
            return _dense_fwd_fast(hit, q, k, v, sinks, seq_len_q, seq_len_kv, window, bottom_right)
    if not checked:
        check(dense_problem(q, k, v, window=window, bottom_right=bottom_right, sinks=sinks is not None, bias=bias,
                            dropout_p=dropout_p, padded=padded), q.device)
    b, h, s_q, _ = q.shape
    d_v = v.shape[3]
    device = q.device.index
    qr, kr, vr = layout.repaired(q), layout.repaired(k), layout.repaired(v)
    out = layout.dense_out(q, (b, h, s_q, d_v))
    out_buf = _buffer_for(out)
    lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=q.device)
    buffers = {UID.Q: qr, UID.K: kr, UID.V: vr, UID.O: out_buf}
    if compute_lse:
        buffers[UID.LSE] = lse
    bias_desc = None
    if bias is not None:
        bias = bias_operand(bias, q, k)
        bias_desc = _desc(bias)
        buffers[UID.BIAS] = bias
    if padded:
        buffers[UID.SEQ_Q] = _index(seq_len_q, (b, 1, 1, 1))
        buffers[UID.SEQ_KV] = _index(seq_len_kv, (b, 1, 1, 1))
    if sinks is not None:
        buffers[UID.SINK] = sinks.reshape(1, h, 1, 1).float().contiguous()
    if dropout_p > 0.0:
        buffers[UID.SEED] = philox[0].reshape(1, 1, 1, 1)
        buffers[UID.OFFSET] = philox[1].reshape(1, 1, 1, 1)
        if rng_dump is not None:
            buffers[UID.RNG_DUMP] = rng_dump
    key = FwdKey(
        device=device,
        q=_desc(qr),
        k=_desc(kr),
        v=_desc(vr),
        o=_desc(out_buf),
        lse=_desc(lse) if compute_lse else None,
        scale=float(scale),
        window=tuple(window),
        bottom_right=bool(bottom_right),
        sinks=sinks is not None,
        bias=bias_desc,
        padded=padded,
        dropout_p=float(dropout_p),
        rng_dump=rng_dump is not None and dropout_p > 0.0,
    )
    plan = _run(key, buffers)
    if out_buf is not out:
        out.copy_(out_buf)
    dead = _dead_rows(s_q, k.shape[2], window, bottom_right, seq_len_q, seq_len_kv, q.device)
    if dead is not None:
        out.masked_fill_(dead, 0)
    if signature is not None and _same((qr, kr, vr, out_buf), (q, k, v, out)) and _sinks_as_is(sinks):
        graphs.fast_put(signature, _Fast(plan, (tuple(out.shape),), (out.stride(),), tuple(lse.shape), compute_lse))
    return out, lse


def _dense_fwd_fast(hit: _Fast, q, k, v, sinks, seq_len_q, seq_len_kv, window, bottom_right):
    device = q.device
    out = torch.empty_strided(hit.sizes[0], hit.strides[0], dtype=q.dtype, device=device)
    lse = torch.empty(hit.lse_size, dtype=torch.float32, device=device)
    buffers = {UID.Q: q, UID.K: k, UID.V: v, UID.O: out}
    if hit.compute_lse:
        buffers[UID.LSE] = lse
    b, h = q.shape[0], q.shape[1]
    if seq_len_q is not None:
        buffers[UID.SEQ_Q] = seq_len_q.view(b, 1, 1, 1)
        buffers[UID.SEQ_KV] = seq_len_kv.view(b, 1, 1, 1)
    if sinks is not None:
        buffers[UID.SINK] = sinks.view(1, h, 1, 1)
    graphs.execute(hit.plan, buffers, device.index, _stream(device.index))
    dead = _dead_rows(q.shape[2], k.shape[2], window, bottom_right, seq_len_q, seq_len_kv, device)
    if dead is not None:
        out.masked_fill_(dead, 0)
    return out, lse


def dense_bwd(grad_out, q, k, v, out, lse, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None,
              bias=None, seq_len_q=None, seq_len_kv=None, philox=None, dropout_p=0.0, deterministic=False):
    """cuDNN backward. Returns (dq, dk, dv, dsinks or None)."""
    padded = seq_len_q is not None
    bottom_right = _alignment(bottom_right, (q.shape[2], k.shape[2]), (seq_len_q, seq_len_kv))
    signature = None
    if bias is None and dropout_p == 0.0:
        signature = ("dense_bwd", q.device.index, _sig(grad_out), _sig(q), _sig(k), _sig(v), _sig(out), _sig(lse),
                     _sig(sinks), _sig(seq_len_q), _sig(seq_len_kv), float(scale), tuple(window), bool(bottom_right),
                     bool(deterministic))
        hit = graphs.fast_get(signature)
        if hit is not None and _aligned(grad_out, q, k, v, out, lse, sinks):
            return _dense_bwd_fast(hit, grad_out, q, k, v, out, lse, sinks, seq_len_q, seq_len_kv, window,
                                   bottom_right)
    check(dense_problem(q, k, v, backward=True, window=window, bottom_right=bottom_right, sinks=sinks is not None,
                        bias=bias, dropout_p=dropout_p, padded=padded, deterministic=deterministic), q.device)
    b, h, s_q, _ = q.shape
    device = q.device.index
    qr, kr, vr, outr = (layout.repaired(t) for t in (q, k, v, out))
    do = grad_out
    if not layout.usable(do):  # match dO to the (repaired) O: same dims, same order
        do = torch.empty_like(outr).copy_(grad_out)
    lse_in = lse
    lse = lse if lse.is_contiguous() else lse.contiguous()  # cuDNN < 9.26 misreads non-packed stats
    dq, dk, dv = layout.grad_like(q), layout.grad_like(k), layout.grad_like(v)
    dq_buf, dk_buf, dv_buf = _buffer_for(dq), _buffer_for(dk), _buffer_for(dv)
    buffers = {
        UID.Q: qr, UID.K: kr, UID.V: vr, UID.O: outr, UID.DO: do, UID.LSE: lse,
        UID.DQ: dq_buf, UID.DK: dk_buf, UID.DV: dv_buf,
    }
    bias_desc = None
    if bias is not None:
        bias = bias_operand(bias, q, k)
        bias_desc = _desc(bias)
        buffers[UID.BIAS] = bias
    if padded:
        buffers[UID.SEQ_Q] = _index(seq_len_q, (b, 1, 1, 1))
        buffers[UID.SEQ_KV] = _index(seq_len_kv, (b, 1, 1, 1))
    dsinks = None
    if sinks is not None:
        buffers[UID.SINK] = sinks.reshape(1, h, 1, 1).float().contiguous()
        dsinks = torch.zeros((1, h, 1, 1), dtype=torch.float32, device=q.device)
        buffers[UID.DSINK] = dsinks
    if dropout_p > 0.0:
        buffers[UID.SEED] = philox[0].reshape(1, 1, 1, 1)
        buffers[UID.OFFSET] = philox[1].reshape(1, 1, 1, 1)
    key = BwdKey(
        device=device,
        q=_desc(qr),
        k=_desc(kr),
        v=_desc(vr),
        o=_desc(outr),
        do=_desc(do),
        lse=_desc(lse),
        dq=_desc(dq_buf),
        dk=_desc(dk_buf),
        dv=_desc(dv_buf),
        scale=float(scale),
        window=tuple(window),
        bottom_right=bool(bottom_right),
        sinks=sinks is not None,
        bias=bias_desc,
        padded=padded,
        dropout_p=float(dropout_p),
        deterministic=bool(deterministic),
    )
    plan = _run(key, buffers)
    for dst, buf in ((dq, dq_buf), (dk, dk_buf), (dv, dv_buf)):
        if buf is not dst:
            dst.copy_(buf)
    _zero_dead_grads(dq, dk, dv, window, bottom_right, seq_len_q, seq_len_kv)
    reusable = _same((qr, kr, vr, outr, do, dq_buf, dk_buf, dv_buf), (q, k, v, out, grad_out, dq, dk, dv))
    needs_workspace_check = support.deterministic_workspace_bytes(
        dense_problem(q, k, v, backward=True, deterministic=deterministic), support.capabilities(device)) > 0
    if signature is not None and reusable and lse is lse_in and _sinks_as_is(sinks) and not needs_workspace_check:
        sizes = tuple(tuple(t.shape) for t in (dq, dk, dv))
        graphs.fast_put(signature, _Fast(plan, sizes, (dq.stride(), dk.stride(), dv.stride())))
    return dq, dk, dv, (_sink_grad_dense(sinks, lse, outr, do) if sinks is not None else None)


def _sink_grad_dense(sinks, lse, out, grad_out) -> torch.Tensor:
    """dSink[h] = -sum over b, i of p_sink * rowsum(dO * O), p_sink = exp(sink[h] - lse[b, h, i]).

    Computed here instead of read from cuDNN's dSink_token: the GPU fuzz found cuDNN 9.19's dSink
    wrong (rel err 0.6) for a padded batch whose band window leaves query rows without any visible
    key (tests/gpu/test_reliability.py keeps the case). Rows whose output is 0 (padded, keyless)
    contribute exactly 0, whatever their LSE holds, as the definition says."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (B, H, S_q)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse.view(delta.shape))
    return -torch.where(delta == 0, torch.zeros_like(delta), p_sink * delta).sum(dim=(0, 2))


def _sink_grad_packed(sinks, lse, out, grad_out) -> torch.Tensor:
    """The same for packed (T, H) rows."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (T, H)
    p_sink = torch.exp(sinks.float().view(1, -1) - lse)
    return -torch.where(delta == 0, torch.zeros_like(delta), p_sink * delta).sum(dim=0)


def _zero_dead_grads(dq, dk, dv, window, bottom_right, seq_len_q, seq_len_kv) -> None:
    dead = _dead_rows(dq.shape[2], dk.shape[2], window, bottom_right, seq_len_q, seq_len_kv, dq.device)
    if dead is not None:
        dq.masked_fill_(dead, 0)
    if seq_len_kv is not None:
        past_kv = _rows_past(seq_len_kv, dk.shape[2])
        dk.masked_fill_(past_kv, 0)
        dv.masked_fill_(past_kv, 0)


def _dense_bwd_fast(hit: _Fast, grad_out, q, k, v, out, lse, sinks, seq_len_q, seq_len_kv, window, bottom_right):
    device = q.device
    dq, dk, dv = (torch.empty_strided(size, stride, dtype=q.dtype, device=device)
                  for size, stride in zip(hit.sizes, hit.strides))
    buffers = {UID.Q: q, UID.K: k, UID.V: v, UID.O: out, UID.DO: grad_out, UID.LSE: lse,
               UID.DQ: dq, UID.DK: dk, UID.DV: dv}
    b, h = q.shape[0], q.shape[1]
    if seq_len_q is not None:
        buffers[UID.SEQ_Q] = seq_len_q.view(b, 1, 1, 1)
        buffers[UID.SEQ_KV] = seq_len_kv.view(b, 1, 1, 1)
    dsinks = None
    if sinks is not None:
        buffers[UID.SINK] = sinks.view(1, h, 1, 1)
        dsinks = torch.zeros((1, h, 1, 1), dtype=torch.float32, device=device)
        buffers[UID.DSINK] = dsinks
    graphs.execute(hit.plan, buffers, device.index, _stream(device.index))
    _zero_dead_grads(dq, dk, dv, window, bottom_right, seq_len_q, seq_len_kv)
    return dq, dk, dv, (_sink_grad_dense(sinks, lse, out, grad_out) if sinks is not None else None)


# -------------------------------------------------------------------------------------- varlen


def _packed_operand(t: torch.Tensor) -> torch.Tensor:
    """A (T, H, D) operand cuDNN can read as ragged: token-major, head dim innermost, aligned."""
    if layout.usable(t) and t.stride(0) >= t.stride(1) * t.shape[1] and t.stride(1) >= t.shape[2]:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _ragged_desc(t: torch.Tensor, batch: int, s_max: int) -> Desc:
    """(T, H, D) with token stride ts, head stride hs -> nominal (B, H, S_max, D) for cuDNN.

    The batch stride is never stepped (ragged offsets give each sequence's base), so it is the
    packed extent of one full sequence, as in cuDNN's own THD samples."""
    ts, hs, ds = t.stride()
    return Desc((batch, t.shape[1], s_max, t.shape[2]), (s_max * ts, hs, ts, ds), t.dtype)


def _lse_desc(h: int, batch: int, s_max: int) -> Desc:
    # lse (T, H) fp32, token-major: element (t, h) at t * H + h.
    return Desc((batch, h, s_max, 1), (s_max * h, 1, h, 1), torch.float32)


def _offsets(cu: torch.Tensor, stride: int, cache: dict) -> torch.Tensor:
    """Ragged offset in elements: cu_seqlens * token stride (device-side; equal strides share)."""
    found = cache.get(stride)
    if found is None:
        found = cache[stride] = (cu * stride).view(-1, 1, 1, 1)
    return found


def _check_cu(cu: torch.Tensor, name: str) -> None:
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor of prefix sums, got {cu.dtype} with shape {tuple(cu.shape)}")


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *, scale: float,
               window=(-1, -1), bottom_right=False, sinks=None):
    """cuDNN varlen forward. Returns (out (T_q, H_q, D_v), lse (T_q, H_q) fp32)."""
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_kv, "cu_seqlens_kv")
    bottom_right = _alignment(bottom_right, (cu_seqlens_q, cu_seqlens_kv))
    check(varlen_problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, window=window,
                         bottom_right=bottom_right, sinks=sinks is not None), q.device)
    batch = cu_seqlens_q.shape[0] - 1
    t_q, h, _ = q.shape
    d_v = v.shape[2]
    sq, skv = seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_kv)
    qr, kr, vr = _packed_operand(q), _packed_operand(k), _packed_operand(v)
    out = torch.zeros((t_q, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.zeros((t_q, h), dtype=torch.float32, device=q.device)
    cq, ckv = {}, {}
    buffers = {
        UID.Q: qr, UID.K: kr, UID.V: vr, UID.O: out, UID.LSE: lse,
        UID.SEQ_Q: (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).view(batch, 1, 1, 1),
        UID.SEQ_KV: (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).view(batch, 1, 1, 1),
        UID.RAG_Q: _offsets(cu_seqlens_q, qr.stride(0), cq),
        UID.RAG_K: _offsets(cu_seqlens_kv, kr.stride(0), ckv),
        UID.RAG_V: _offsets(cu_seqlens_kv, vr.stride(0), ckv),
        UID.RAG_O: _offsets(cu_seqlens_q, out.stride(0), cq),
        UID.RAG_LSE: _offsets(cu_seqlens_q, h, cq),
    }
    if sinks is not None:
        buffers[UID.SINK] = sinks.reshape(1, h, 1, 1).float().contiguous()
    key = FwdKey(
        device=q.device.index,
        q=_ragged_desc(qr, batch, sq),
        k=_ragged_desc(kr, batch, skv),
        v=_ragged_desc(vr, batch, skv),
        o=_ragged_desc(out, batch, sq),
        lse=_lse_desc(h, batch, sq),
        scale=float(scale),
        window=tuple(window),
        bottom_right=bool(bottom_right),
        sinks=sinks is not None,
        ragged=True,
    )
    _run(key, buffers)
    _zero_keyless_tokens(out, cu_seqlens_q, cu_seqlens_kv)
    return out, lse


def token_bucket(n: int) -> int:
    """Round a token count up to one of 16 steps per power of two (steps of at least 64): a bound
    close to ``n`` (at most 1/16 over) that lets one graph serve many batch totals."""
    n = max(int(n), 1)
    step = max(64, 1 << max(n.bit_length() - 5, 0))
    return -(-n // step) * step


def _max_total(caps, tokens_q: int, tokens_kv: int, batch: int, s_q: int, s_kv: int, d_qk: int, d_v: int):
    """``max_total_seq_len_q/kv`` for a ragged backward, or None to leave them unset.

    Without them cuDNN sizes the dQ accumulator (fp32) for the nominal B x S_max tokens; with
    them, for the packed total. Measured on the H200 (runs 17-18 of results/gpu-runs.md) at the
    bench's varlen mix (T = 42052 tokens, bound 43008, 16 sequences of up to 4092, nominal
    16 x 4096): peak memory of forward+backward 1181 -> 1003 MiB (FlashAttention varlen: 1009),
    at the price of ~5% of forward+backward time (4.89 -> 5.15 ms, still 1.34x
    FlashAttention's). The tokens of the packed buffers bound the real totals (host ints, no sync),
    capped at the nominal size. The frontend warns of known problems with head dims not a
    multiple of 16 and with pre-Hopper (Ampere-style) kernels: there they stay unset."""
    if caps.compute_capability is None or caps.compute_capability < (9, 0) or d_qk % 16 or d_v % 16:
        return None
    bounds = (min(token_bucket(tokens_q), batch * s_q), min(token_bucket(tokens_kv), batch * s_kv))
    return None if bounds == (batch * s_q, batch * s_kv) else bounds


def _zero_keyless_tokens(x: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor) -> None:
    """cuDNN < 9.25 writes NaN for queries of a sequence with no keys (FACTS.md 3); such rows
    attend to nothing and are 0 by definition. Device-side; skipped on cuDNN >= 9.25."""
    caps = support.capabilities(x.device.index)
    if caps.cudnn_version is not None and caps.cudnn_version >= support.ZERO_LENGTH_OK:
        return
    keyless = (cu_kv[1:] - cu_kv[:-1]) == 0
    tokens = torch.arange(x.shape[0], device=x.device, dtype=cu_q.dtype)
    batch = torch.searchsorted(cu_q[1:], tokens, right=True).clamp_(max=keyless.shape[0] - 1)
    x.masked_fill_(keyless[batch].view(-1, *([1] * (x.dim() - 1))), 0)


def varlen_bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q: int, max_seqlen_kv: int, *,
               scale: float, window=(-1, -1), bottom_right=False, sinks=None, deterministic=False):
    """cuDNN varlen backward. ``lse`` is (T_q, H_q) fp32. Returns (dq, dk, dv, dsinks or None)."""
    _check_cu(cu_seqlens_q, "cu_seqlens_q")
    _check_cu(cu_seqlens_kv, "cu_seqlens_kv")
    bottom_right = _alignment(bottom_right, (cu_seqlens_q, cu_seqlens_kv))
    check(varlen_problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, backward=True, window=window,
                         bottom_right=bottom_right, sinks=sinks is not None, deterministic=deterministic), q.device)
    batch = cu_seqlens_q.shape[0] - 1
    h = q.shape[1]
    sq, skv = seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_kv)
    qr, kr, vr, outr, do = (_packed_operand(t) for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    dq, dk, dv = (torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device) for t in (q, k, v))
    cq, ckv = {}, {}
    buffers = {
        UID.Q: qr, UID.K: kr, UID.V: vr, UID.O: outr, UID.DO: do, UID.LSE: lse,
        UID.DQ: dq, UID.DK: dk, UID.DV: dv,
        UID.SEQ_Q: (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).view(batch, 1, 1, 1),
        UID.SEQ_KV: (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).view(batch, 1, 1, 1),
        UID.RAG_Q: _offsets(cu_seqlens_q, qr.stride(0), cq),
        UID.RAG_K: _offsets(cu_seqlens_kv, kr.stride(0), ckv),
        UID.RAG_V: _offsets(cu_seqlens_kv, vr.stride(0), ckv),
        UID.RAG_O: _offsets(cu_seqlens_q, outr.stride(0), cq),
        UID.RAG_DO: _offsets(cu_seqlens_q, do.stride(0), cq),
        UID.RAG_LSE: _offsets(cu_seqlens_q, h, cq),
        UID.RAG_DQ: _offsets(cu_seqlens_q, dq.stride(0), cq),
        UID.RAG_DK: _offsets(cu_seqlens_kv, dk.stride(0), ckv),
        UID.RAG_DV: _offsets(cu_seqlens_kv, dv.stride(0), ckv),
    }
    dsinks = None
    if sinks is not None:
        buffers[UID.SINK] = sinks.reshape(1, h, 1, 1).float().contiguous()
        dsinks = torch.zeros((1, h, 1, 1), dtype=torch.float32, device=q.device)
        buffers[UID.DSINK] = dsinks
    key = BwdKey(
        device=q.device.index,
        q=_ragged_desc(qr, batch, sq),
        k=_ragged_desc(kr, batch, skv),
        v=_ragged_desc(vr, batch, skv),
        o=_ragged_desc(outr, batch, sq),
        do=_ragged_desc(do, batch, sq),
        lse=_lse_desc(h, batch, sq),
        dq=_ragged_desc(dq, batch, sq),
        dk=_ragged_desc(dk, batch, skv),
        dv=_ragged_desc(dv, batch, skv),
        scale=float(scale),
        window=tuple(window),
        bottom_right=bool(bottom_right),
        sinks=sinks is not None,
        ragged=True,
        deterministic=bool(deterministic),
        max_total=_max_total(support.capabilities(q.device.index), q.shape[0], k.shape[0], batch, sq, skv,
                             q.shape[2], v.shape[2]),
    )
    _run(key, buffers)
    _zero_keyless_tokens(dq, cu_seqlens_q, cu_seqlens_kv)
    return dq, dk, dv, (_sink_grad_packed(sinks, lse, outr, do) if sinks is not None else None)
