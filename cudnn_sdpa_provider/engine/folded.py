"""Dense attention on length-bucketed graphs: (batch, KV head) folded into a ragged batch.

A dense graph declares every dim and stride, and the batch and head strides of a (B, H, S, D)
tensor change with S, so each new sequence length would be a new cuDNN graph (about 40 ms to
build on an H200). Folding removes S from everything the graph declares:

* the batch becomes ``n = B * H_kv`` ragged "sequences", one per (batch row, KV head); each
  operand's start is a ragged offset ``b * stride_b + g * stride_g`` in elements (a device tensor
  computed once per call signature), so no batch or KV-head stride is declared;
* inside a fold, Q/O/dO/dQ keep the group's ``G = H_q / H_kv`` query heads as the head dim, K/V one
  head (cuDNN's GQA); the declared S is the length bucket (``seqlen_bucket``: the next power of
  two) and the padding mask gives the real lengths (``seq_len_q/kv`` = S_q, S_kv for every fold,
  or each batch row's own lengths, repeated for its KV heads, in a padded call);
* what stays declared is the head-in-group stride and the token stride of each operand. For K/V
  and for query-side operands with G == 1 or S_q == 1 these do not depend on S in the layouts
  models use (contiguous BHSD, token-major BSHD seen through ``transpose(1, 2)``, fused-projection
  views); a query-side operand whose head stride is larger than its token stride (BHSD with G > 1
  and S_q > 1) is copied to token-major order first, its output written token-major and copied.

So one forward and one backward graph per (configuration, S_q bucket, S_kv bucket) serve every
length in the bucket. A decode call at a new KV length whose K and V are contiguous BHSD or
token-major (a growing cache) is bound from the first binding of its bucket (``fold_family``):
the same graph, uids and outputs; only the KV length's small tensors are new. A longer query
(prefill, training) and its backward at a new length inside its buckets are derived from their
family's first binding too when every operand has its layout's strides (``lengths_form``): the
outputs' strides and the offsets follow from the lengths, so no tensor is made to find them.
The LSE is (B, H, S_q, 1) contiguous as on the exact path: written in place where its strides do
not depend on S (G == 1 or S_q == 1), else token-major and copied; the backward reads it padded
to the bucket, (B, H, S_b, 1) (cuDNN < 9.26 misreads non-packed stats).

A padded call (per-sequence lengths) folds too: its lengths are the call's own (the caller makes
out-of-range ones 0 and fixes the rows that are 0 or NaN by definition, as on the exact path). The
ragged graph writes no LSE row past a length: those start at -inf, the exact graph's value there.

Not folded (the exact graph serves them, as before): bias (its strides follow S), sinks (one
logit per query head, which a fold cannot index), dropout (its random stream is indexed by the
graph's batch and head), lengths that are not int32, the dropout mask dump, operands that are not
16-byte aligned or whose offsets would overflow int32, and calls made while a CUDA graph is being
captured (the offsets this module computes on the device must exist before a capture; see
``applies``). A folded binding made before a capture (by the warm-up) serves the calls captured:
they queue no wait on its upload event (``_order``), and ``binding.run`` keeps the binding, its
plan and its device tensors, for as long as the process lives (a replay reads them by address).
"""

from __future__ import annotations

import torch

from . import binding as bd
from . import fold_values as fv
from ..core import env, layout, rows
from .binding import Binding
from .graphs import UID, BwdKey, Desc, FwdKey

__all__ = ["seqlen_bucket", "mode", "buckets_on", "VERIFIED", "INT32_MAX", "verified", "verified_on", "capturing",
           "applies", "made_at", "dead_rows", "lengths_form", "output_layout", "small_tensors", "bind_forward",
           "run_forward", "bind_backward", "run_backward"]

INT32_MAX = 2**31 - 1


def seqlen_bucket(n: int) -> int:
    """The declared S for a length: the next power of two, so one graph serves every length up to it
    (one graph per doubling of S; the packed graphs bucket max_seqlen the same way)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def mode() -> str:
    """``"auto"``, ``"on"`` or ``"off"`` (``CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS``), read when a call
    signature is first bound, never per call."""
    return env.shape_buckets()


def buckets_on(device) -> bool:
    """Whether calls on ``device`` take the length buckets: mode ``on``, or ``auto`` where the folded
    graphs were verified (``verified``)."""
    m = mode()
    return m == "on" or m == "auto" and verified(device)


def _q_like_ok(t: torch.Tensor, groups: int) -> bool:
    """Whether a query-side operand's declared head-in-group stride is free of S: one query head
    per fold, one query row, or heads interleaved inside a token (head stride <= token stride)."""
    return groups == 1 or t.shape[2] == 1 or t.stride(1) <= t.stride(2)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and outer strides, innermost stride 1, no negative stride."""
    return (t.stride(3) == 1 or t.shape[3] == 1) and layout.usable(t) and min(t.stride()) >= 0


def _fold_strides(t: torch.Tensor, h_kv: int, groups: int) -> tuple[int, int]:
    """(batch stride, KV-group stride) of an operand, in elements (``fold_values.fold_strides``)."""
    return fv.fold_strides(t.shape, t.stride(), t.element_size(), h_kv, groups)


def _end(t: torch.Tensor, h_kv: int, groups: int) -> int:
    sb, _ = _fold_strides(t, h_kv, groups)
    return t.shape[0] * sb + sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) + 1


def applies(q, k, v, *, bias=None, sinks=None, seq_len_q=None, seq_len_kv=None, dropout_p=0.0,
            rng_dump=None) -> bool:
    """Whether a dense call can run on the folded, length-bucketed graphs (pure shape/stride checks;
    see the module docstring for what is left to the exact graphs)."""
    if bias is not None or sinks is not None or dropout_p > 0.0 or rng_dump is not None:
        return False
    if seq_len_q is not None and any(t is None or t.dtype != torch.int32 or t.shape != (q.shape[0],)
                                     for t in (seq_len_q, seq_len_kv)):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        return False
    if min(q.shape[2], k.shape[2]) < 1 or q.device.type != "cuda" and not _FAKE_DEVICES:
        return False
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    if not all(_aligned(t) for t in (k, v)) or not _aligned(q):
        return False
    groups = q.shape[1] // k.shape[1]
    return max(_end(q, k.shape[1], groups), _end(k, k.shape[1], 1), _end(v, v.shape[1], 1)) <= INT32_MAX


#: (compute capability, lowest cuDNN, highest cuDNN) where the folded graphs passed the GPU sweeps
#: (tests/gpu/test_shapes.py: every length against fp32 with NaN canaries past it): H200 with cuDNN
#: 9.19 (runs 48-51) and 9.28.1 (run 52), the releases between them taken as the range. Elsewhere the default mode keeps exact graphs (a read past
#: the real length would be a silent wrong answer); ``CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS=1`` folds
#: anyway.
VERIFIED = (((9, 0), 91900, 92801),)


def verified(device) -> bool:
    """Whether ``device``'s GPU and cuDNN are among ``VERIFIED`` (the fake cuDNN's devices count)."""
    if device.type != "cuda":
        return device.type in _FAKE_DEVICES
    version, cc = bd.graphs.device_facts(device.index)
    return verified_on(cc, version)


def verified_on(compute_capability, cudnn_version) -> bool:
    """Whether a GPU of this compute capability with this cuDNN is among ``VERIFIED``."""
    return any(tuple(compute_capability or ()) == arch and low <= (cudnn_version or 0) <= high
               for arch, low, high in VERIFIED)


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph (no build may run)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


#: Device types other than CUDA that the fold runs on: the CPU tier's fake cuDNN adds "cpu".
_FAKE_DEVICES: set = set()


# ------------------------------------------------------------------------------------ descriptors


def _extent(dims, strides) -> int:
    return max(max((n - 1) * s for n, s in zip(dims[1:], strides[1:])) + 1, 1)


def _desc(dims, strides, dtype) -> Desc:
    """A fold's declared tensor: ``dims`` (n, heads, S_b, D); size-1 dims get packed strides (as
    ``binding.desc``); the batch stride, never stepped (ragged offsets), is one fold's extent."""
    strides = list(strides)
    for i in range(1, 4):
        if dims[i] == 1:
            inner = 1
            for s in dims[i + 1:]:
                inner *= s
            strides[i] = max(inner, 1)
    per = max(layout.ALIGN // dtype.itemsize, 1)  # cuDNN checks every stride's 16-byte alignment
    strides[0] = -(-_extent(dims, strides) // per) * per
    return Desc(tuple(dims), tuple(strides), dtype)


def _q_desc(t: torch.Tensor, n: int, groups: int, s_b: int) -> Desc:
    return _desc((n, groups, s_b, t.shape[3]), (0, t.stride(1), t.stride(2), 1), t.dtype)


def _kv_desc(t: torch.Tensor, n: int, s_b: int) -> Desc:
    return _desc((n, 1, s_b, t.shape[3]), (0, 0, t.stride(2), 1), t.dtype)


def made_at(device, dead=None):
    """(stream, event) marking where a new binding's device tensors were uploaded (``_order``); None
    off CUDA. Every tensor a binding holds from the value cache was uploaded on its stream by this
    thread (the cache is kept per thread and per stream), at or before this thread's latest upload
    there: that upload's event (``fold_values.upload_mark``) covers them, so a binding that uploaded
    nothing records no event of its own. ``dead``: the binding's dead-row entry; a mask tensor was
    just made by a kernel, so a new event is recorded after it."""
    if device.type != "cuda":
        return None
    stream = fv.stream_of(device)
    event = None if isinstance(dead, torch.Tensor) else fv.upload_mark(device, stream)
    if event is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return stream, event


def _order(found: Binding, device) -> None:
    """A binding used on a stream other than the one that made it: that stream waits for the uploads
    of its offsets and lengths (an event wait, queued on the device; no host sync).

    Not while the stream is capturing a CUDA graph: the event was recorded outside the capture, and
    waiting on it there is refused (cudaErrorStreamCaptureIsolation) or invalidates the capture. No
    wait is needed there: a folded binding is never made during a capture (``applies``), and
    ``torch.cuda.graph`` (and ``make_graphed_callables``, which uses it) synchronises the device
    before it begins capturing (torch/cuda/graphs.py, ``graph.__enter__``), so the uploads are done.
    A bare ``CUDAGraph.capture_begin`` must follow the same rule: synchronise after the warm-up, or
    warm up on the capturing stream (then no wait is needed). The capture check runs only when the
    streams differ, so a call on the binding's own stream pays nothing for it."""
    made = found.extra.get("made")
    if made is not None and made[0] != fv.stream_of(device) and not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).wait_event(made[1])


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, S, D) tensor stored token-major, (B, S, H, D)."""
    b, h, s, d = t.shape
    return torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)


def _q_target(out: torch.Tensor, groups: int) -> torch.Tensor:
    """The buffer cuDNN writes for a query-side output: ``out`` itself, or a token-major scratch."""
    return out if _q_like_ok(out, groups) and layout.usable(out) else _token_major(out)


def dead_rows(s_q: int, s_kv: int, window, bottom_right: bool, device):
    """The (1, 1, S_q, 1) mask of query rows that see no key (``rows.dead_rows``), or None."""
    return rows.dead_rows(s_q, s_kv, window, bottom_right, device=device)


def _lse_target(b: int, h: int, s_q: int, groups: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the (B, H, S_q, 1) contiguous LSE returned, the buffer cuDNN writes: itself, or a token-major
    scratch where the contiguous head stride would follow S)."""
    lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=device)
    if groups == 1 or s_q == 1:
        return lse, lse
    return lse, torch.empty((b, s_q, h, 1), dtype=torch.float32, device=device).transpose(1, 2)


# ---------------------------------------------------------------------------------------- forward


def small_tensors(wanted: list, device, stream, decode=None, chunk=None) -> tuple:
    """The binding's small device tensors in ``wanted``'s order, in one upload for those not kept
    (``fold_values``). ``decode``, (k, v, n, H_kv, S_kv): a decode forward's; when its KV length is
    not kept, the next lengths' are uploaded too (``fold_values.ahead``). ``chunk``, (specs, n,
    H_kv, S): a self-attention forward's or backward's (S_q = S_kv = S, its operands'
    ``fold_values.spec``); when its length is not kept, every length of its chunk is uploaded too
    (``fold_values.chunk``)."""
    blocks = ()
    if decode is not None:
        k, v, n, h_kv, s_kv = decode
        if fv.length_key(n, s_kv, device, stream) not in fv.kept():
            blocks = fv.ahead((k, v), n, h_kv, s_kv, seqlen_bucket(s_kv), device, stream)
    elif chunk is not None:
        specs, n, h_kv, s = chunk
        if fv.length_key(n, s, device, stream) not in fv.kept():
            blocks = fv.chunk(specs, n, h_kv, s, seqlen_bucket(s), device, stream)
    if not blocks:  # every tensor kept (a length seen before, or uploaded with its chunk): no upload
        cache, kept = fv.kept(), []
        for key, _ in wanted:
            t = cache.get(key)
            if t is None:
                break
            cache.move_to_end(key)
            kept.append(t)
        else:
            return tuple(kept)
    found = fv.resolve(wanted, device, blocks)
    return tuple(found[key] for key, _ in wanted)


def bind_forward(q, k, v, *, scale: float, window, bottom_right: bool, compute_lse: bool, padded: bool = False,
                 build: bool = True, plan=None) -> Binding | None:
    """The binding of a folded forward; its graph is found in the cache or, with ``build``, built
    (``graphs.plan``); None when it is not cached and ``build`` is False. ``plan``: the graph of
    this call's family (``fold_family.family``), taken without building or looking up the key."""
    b, h_q, s_q, _ = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    groups, n = h_q // h_kv, b * h_kv
    sq_b, skv_b = seqlen_bucket(s_q), seqlen_bucket(s_kv)
    copy_q = not _q_like_ok(q, groups)
    qr = _token_major(q) if copy_q else q
    out = layout.dense_out(q, (b, h_q, s_q, v.shape[3]))
    out_buf = _q_target(out, groups)
    lse, lse_buf = _lse_target(b, h_q, s_q, groups, q.device)
    uids = (UID.Q, UID.K, UID.V, UID.O) + ((UID.LSE,) if compute_lse else ()) + (
        UID.SEQ_Q, UID.SEQ_KV, UID.RAG_Q, UID.RAG_K, UID.RAG_V, UID.RAG_O) + ((UID.RAG_LSE,) if compute_lse else ())
    stream = fv.stream_of(q.device)
    operands = [(qr, groups), (k, 1), (v, 1), (out_buf, groups)] + ([(lse_buf, groups)] if compute_lse else [])
    ops = [fv.operand(t, h_kv, g, stream) for t, g in operands]
    (e_q, r_q), (e_k, r_k), (e_v, r_v), (e_o, r_o) = ops[:4]
    e_l = ops[4][0] if compute_lse else 0
    if max(e_q, e_o, e_l) > INT32_MAX or plan is not None and max(e_k, e_v) > INT32_MAX:
        return None  # int32 ragged offsets: the exact graph (``applies`` checked K and V for a full bind)
    if plan is None:
        key = FwdKey(device=q.device.index, q=_q_desc(qr, n, groups, sq_b), k=_kv_desc(k, n, skv_b),
                     v=_kv_desc(v, n, skv_b), o=_q_desc(out_buf, n, groups, sq_b),
                     lse=_q_desc(lse_buf, n, groups, sq_b) if compute_lse else None, scale=float(scale),
                     window=tuple(window), bottom_right=bool(bottom_right), ragged=True)
        plan = bd.graphs.plan(key) if build else bd.graphs.cached(key)
        if plan is None:
            return None
    wanted = [fv.length_request(n, s_q, q.device, stream), fv.length_request(n, s_kv, q.device, stream)]
    wanted += [request for _, request in ops]
    decode = (k, v, n, h_kv, s_kv) if s_q == 1 else None
    chunk = ([fv.spec(t, g) for t, g in operands], n, h_kv, s_q) if s_q == s_kv > 1 else None
    tensors = small_tensors(wanted, q.device, stream, decode, chunk)
    dead = True if padded else dead_rows(s_q, s_kv, window, bottom_right, q.device)
    return Binding(plan=plan, uids=tuple(int(u) for u in uids), repair=(copy_q,),
                   outputs=((tuple(out.shape), out.stride()),), direct=(out_buf is out,),
                   extra={"fold": True, "groups": groups, "tensors": tensors, "h_kv": h_kv, "padded": padded,
                          "dead": dead, "made": made_at(q.device, dead),
                          "lengths": None if padded else lengths_form(
                              (q, k, v), operands, (True, False, False, True, True)[:len(operands)],
                              ((out, ("out", 0, v.shape[3])),))},
                   fix=copy_q)


def output_layout(rule: tuple, callers) -> tuple:
    """(size, stride) of an output by its rule (``lengths_form``), from the call's operands alone:
    ``("like", i, None)``, ``empty_like(callers[i])`` (a gradient, ``layout.grad_like``);
    ``("out", i, d_v)``, ``layout.dense_out(callers[i], (B, H, S_q, d_v))``."""
    what, i, d = rule
    t = callers[i]
    if what == "like":
        return tuple(t.shape), t.stride()
    size = (t.shape[0], t.shape[1], t.shape[2], d)
    return size, layout.dense_out_strides(t, size)


def lengths_form(callers, operands, sides, outputs) -> tuple | None:
    """What ``fold_family.rebind`` derives this binding at other lengths of its buckets from, or
    None: the layouts of the caller's tensors (``callers``: the family's operands), each fold
    operand's ``fold_values.spec`` and side (True: its S is S_q, else S_kv), and each output's
    rule (``output_layout``; ``outputs``: (tensor, rule) pairs, each checked here against the
    tensor the bind made). Only where every caller and operand has its layout's strides
    (``fold_values.follows``) and the callers' head-dim rows are 16-byte aligned: then the
    binding a full bind would make at another length (the scratch choices, the copies, the outputs'
    strides, the offsets) follows from the lengths and the call's own strides alone."""
    if len(sides) != len(operands):
        raise ValueError(f"lengths_form: {len(operands)} operands but {len(sides)} sides")
    kinds = tuple(fv.layout_of(t) for t in callers)
    if None in kinds or any(t.shape[3] * t.element_size() % layout.ALIGN for t in callers):
        return None
    if any(fv.layout_of(t) is None for t, _ in operands):
        return None
    if any(output_layout(rule, callers) != (tuple(t.shape), t.stride()) for t, rule in outputs):
        return None
    rules = tuple(rule for _, rule in outputs)
    return kinds, tuple(zip((fv.spec(t, g) for t, g in operands), sides)), rules


def _with_lengths(found: Binding, lengths) -> tuple:
    """The binding's device tensors, with a padded call's own lengths (B,) int32 in place of the
    fixed ones: repeated for each batch row's KV heads, as the folds are ordered."""
    if lengths is None:
        return found.extra["tensors"]
    h_kv = found.extra["h_kv"]
    per_fold = tuple(t.repeat_interleave(h_kv).view(-1, 1, 1, 1) for t in lengths)
    return per_fold + found.extra["tensors"][2:]


def run_forward(found: Binding, q, k, v, compute_lse: bool, lengths=None):
    """(out, lse) of a folded forward through its binding; ``lengths`` (a padded call's safe
    (seq_len_q, seq_len_kv)): then the caller fixes the rows past them."""
    ex = found.extra
    groups = ex["groups"]
    _order(found, q.device)
    qr = _token_major(q).copy_(q) if found.fix else q
    (size, stride), = found.outputs
    out = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
    out_buf = out if found.direct[0] else _token_major(out)
    lse, lse_buf = _lse_target(q.shape[0], q.shape[1], q.shape[2], groups, q.device)
    if compute_lse and lengths is not None:
        # A ragged graph leaves the LSE rows past each fold's length unwritten (GPU run 59 read
        # leftover memory there); the exact graph writes -inf, which these rows are (no key seen).
        lse_buf.fill_(float("-inf"))
    buffers = (qr, k, v, out_buf) + ((lse_buf,) if compute_lse else ()) + _with_lengths(found, lengths)
    bd.run(found, buffers, q.device.index)
    if out_buf is not out:
        out.copy_(out_buf)
    if compute_lse and lse_buf is not lse:
        lse.copy_(lse_buf)
    if not ex["padded"] and ex["dead"] is not None:
        out.masked_fill_(ex["dead"], 0)
    return out, lse


# --------------------------------------------------------------------------------------- backward


def _kv_target(grad: torch.Tensor) -> torch.Tensor:
    return grad if layout.usable(grad) else torch.empty(tuple(grad.shape), dtype=grad.dtype, device=grad.device)


def bind_backward(grad_out, q, k, v, out, *, scale: float, window, bottom_right: bool, deterministic: bool,
                  padded: bool = False, build: bool = True, plan=None) -> Binding | None:
    """The binding of a folded backward (None and ``plan`` as for ``bind_forward``). Query-side
    operands whose head stride follows S are copied token-major; the LSE is read padded to the
    bucket, (B, H, S_b, 1)."""
    b, h_q, s_q, _ = q.shape
    h_kv, s_kv = k.shape[1], k.shape[2]
    groups, n = h_q // h_kv, b * h_kv
    sq_b, skv_b = seqlen_bucket(s_q), seqlen_bucket(s_kv)
    reads = [(t, not _q_like_ok(t, groups)) for t in (q, out, grad_out)]
    qr, outr, do = (_token_major(t) if copy else t for t, copy in reads)
    grads = [layout.grad_like(t) for t in (q, k, v)]
    bufs = [_q_target(grads[0], groups), _kv_target(grads[1]), _kv_target(grads[2])]
    lse = Desc((n, groups, sq_b, 1), (groups * sq_b, sq_b, 1, 1), torch.float32)  # padded: no offsets
    qd = lambda t: _q_desc(t, n, groups, sq_b)  # noqa: E731
    kd = lambda t: _kv_desc(t, n, skv_b)  # noqa: E731
    uids = (UID.Q, UID.K, UID.V, UID.O, UID.DO, UID.LSE, UID.DQ, UID.DK, UID.DV, UID.SEQ_Q, UID.SEQ_KV,
            UID.RAG_Q, UID.RAG_K, UID.RAG_V, UID.RAG_O, UID.RAG_DO, UID.RAG_DQ, UID.RAG_DK, UID.RAG_DV)
    stream = fv.stream_of(q.device)
    operands = [(qr, groups), (k, 1), (v, 1), (outr, groups), (do, groups), (bufs[0], groups), (bufs[1], 1),
                (bufs[2], 1)]
    ops = [fv.operand(t, h_kv, g, stream) for t, g in operands]
    if max(end for end, _ in ops) > INT32_MAX:
        return None  # int32 ragged offsets: the exact graph
    if plan is None:
        key = BwdKey(device=q.device.index, q=qd(qr), k=kd(k), v=kd(v), o=qd(outr), do=qd(do), lse=lse,
                     dq=qd(bufs[0]), dk=kd(bufs[1]), dv=kd(bufs[2]), scale=float(scale), window=tuple(window),
                     bottom_right=bool(bottom_right), ragged=True, deterministic=bool(deterministic),
                     padded_lse=True)
        plan = bd.graphs.plan(key) if build else bd.graphs.cached(key)
        if plan is None:
            return None
    wanted = [fv.length_request(n, s_q, q.device, stream), fv.length_request(n, s_kv, q.device, stream)]
    wanted += [request for _, request in ops]
    # autograd runs a backward on its device thread, whose value cache the forward's chunk did not fill
    chunk = ([fv.spec(t, g) for t, g in operands], n, h_kv, s_q) if s_q == s_kv > 1 else None
    tensors = small_tensors(wanted, q.device, stream, chunk=chunk)
    dead = True if padded else dead_rows(s_q, s_kv, window, bottom_right, q.device)
    sides = (True, False, False, True, True, True, False, False)
    return Binding(plan=plan, uids=tuple(int(u) for u in uids), repair=tuple(c for _, c in reads),
                   outputs=tuple((tuple(g.shape), g.stride()) for g in grads),
                   direct=tuple(g is buf for g, buf in zip(grads, bufs)),
                   extra={"fold": True, "groups": groups, "tensors": tensors, "s_b": sq_b, "h_kv": h_kv,
                          "padded": padded, "dead": dead, "made": made_at(q.device, dead),
                          "lengths": None if padded else lengths_form(
                              (grad_out, q, k, v, out), operands, sides,
                              [(g, ("like", i, None)) for g, i in zip(grads, (1, 2, 3))])},
                   fix=any(c for _, c in reads))


def run_backward(found: Binding, grad_out, q, k, v, out, lse, lengths=None):
    """(dq, dk, dv) of a folded backward through its binding (``lengths`` as for ``run_forward``)."""
    ex = found.extra
    _order(found, q.device)
    copy_q, copy_o, copy_do = found.repair
    qr = _token_major(q).copy_(q) if copy_q else q
    outr = _token_major(out).copy_(out) if copy_o else out
    do = _token_major(grad_out).copy_(grad_out) if copy_do else grad_out
    b, h, s_q = q.shape[0], q.shape[1], q.shape[2]
    stats = torch.zeros((b, h, ex["s_b"], 1), dtype=torch.float32, device=q.device)
    stats[:, :, :s_q].copy_(lse)
    grads, bufs = [], []
    for (size, stride), direct, t, i in zip(found.outputs, found.direct, (q, k, v), range(3)):
        g = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
        grads.append(g)
        bufs.append(g if direct else _token_major(g) if i == 0 else torch.empty(size, dtype=t.dtype, device=t.device))
    buffers = (qr, k, v, outr, do, stats, bufs[0], bufs[1], bufs[2]) + _with_lengths(found, lengths)
    bd.run(found, buffers, q.device.index)
    bd.copy_back(grads, bufs)
    if not ex["padded"] and ex["dead"] is not None:
        grads[0].masked_fill_(ex["dead"], 0)
    return tuple(grads)
