"""Dense (B, H, S, D) attention on cuDNN graphs: forward and backward through per-signature bindings.

These functions run on CUDA tensors and never decide a fallback: ``route`` has checked the call's
reasons before they run, and cuDNN's own rejection at build time surfaces as ``NotSupportedError``
(``graph_not_supported``) before any work is done.

Conventions:
  q (B, H_q, S_q, D_qk), k (B, H_k, S_kv, D_qk), v (B, H_v, S_kv, D_v), any strides;
  out (B, H_q, S_q, D_v) in q's dimension order; lse (B, H_q, S_q, 1) fp32 contiguous;
  dq/dk/dv ``empty_like`` q/k/v (``layout``).
  window: FlashAttention (left, right), -1 unbounded; bottom_right aligns the diagonal to the end
  of each sequence (per sequence when lengths are given).
  padded: seq_len_q / seq_len_kv (B,) int32 on the device. Rows of out past seq_len_q are 0; rows of
  dq past seq_len_q and of dk/dv past seq_len_kv are 0. A batch row whose lengths are outside
  [0, S] is given lengths 0 (cuDNN computes nothing for it) and its output is NaN: never clamped,
  never read past the tensors.
"""

from __future__ import annotations

import logging

import torch

from . import binding as bd
from . import fold_family, folded
from ..core import counters, layout, length_terms, rows
from ..core.errors import NotSupportedError
from .binding import Binding, tensor_key
from .graphs import UID, BwdKey, FwdKey

__all__ = ["forward", "backward", "bias_operand", "alignment", "unmasked", "same_lengths"]


def same_lengths(a, b) -> bool:
    """Whether two length descriptions are the same: equal ints, or one device tensor (the same
    object or the same memory, shape and strides; never read, so no sync)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is b or (a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def alignment(bottom_right: bool, *same) -> bool:
    """``bottom_right``, unless every sequence has as many keys as queries (each pair in ``same``
    is the same): then bottom-right and top-left are the same mask, and top-left is what cuDNN
    runs fastest (its ragged bottom-right kernels do not skip masked tiles; docs/performance.md)."""
    return bottom_right and not all(same_lengths(a, b) for a, b in same)


def unmasked(window, bottom_right: bool, s_q: int, s_kv: int) -> bool:
    """Whether ``window`` (with its alignment) lets every query of an S_q x S_kv call see every key:
    then it is full attention, and ``forward``/``backward`` run the unmasked graph. A decode step
    through a causal bottom-right mask (the Hugging Face integration's, a DynamicCache's last
    token) is one: a masked graph there is another graph for the same numbers, and cuDNN's
    bottom-right ragged kernels do not skip tiles as its top-left ones do."""
    left, right = window
    if left < 0 and right < 0:
        return False  # already unmasked
    off = s_kv - s_q if bottom_right else 0  # query i sits at key i + off
    return (left < 0 or left >= s_q - 1 + off) and (right < 0 or off + right >= s_kv - 1)


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


def _lengths(t: torch.Tensor, b: int) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise TypeError(f"sequence lengths must be int32, got {t.dtype}")
    return bd.small_operand(t, (b, 1, 1, 1))


def _options_pairs(q, bias, seq_len_q, seq_len_kv, sinks, philox, dropout_p):
    """(uid, tensor) pairs of the options, in the order every binding uses."""
    b, h = q.shape[0], q.shape[1]
    pairs = []
    if bias is not None:
        pairs.append((UID.BIAS, bias))
    if seq_len_q is not None:
        pairs += [(UID.SEQ_Q, _lengths(seq_len_q, b)), (UID.SEQ_KV, _lengths(seq_len_kv, b))]
    if sinks is not None:
        pairs.append((UID.SINK, bd.small_operand(sinks, (1, h, 1, 1), torch.float32)))
    if dropout_p > 0.0:
        pairs += [(UID.SEED, philox[0].reshape(1, 1, 1, 1)), (UID.OFFSET, philox[1].reshape(1, 1, 1, 1))]
    return pairs


def _fix_rows(out, b: Binding, window, bottom_right, seq_len_q, seq_len_kv, s_kv, bad) -> None:
    """Zero the rows that are 0 by definition and, in one pass, make NaN the batch rows whose
    lengths are out of range."""
    if not b.extra["dead"]:
        return
    if seq_len_q is None:
        out.masked_fill_(rows.dead_rows(out.shape[2], s_kv, window, bottom_right, device=out.device), 0)
        return
    if rows.none_dead(out.shape[2], s_kv, window, bottom_right, seq_len_q, seq_len_kv):
        return

    def make():
        dead = rows.padded_dead_rows(out.shape[2], s_kv, window, bottom_right, seq_len_q, seq_len_kv, out.device)
        return dead | bad, torch.where(bad, float("nan"), 0.0).to(out.dtype)  # value: (B, 1, 1, 1)

    fixed, value = length_terms.get(seq_len_q, seq_len_kv, ("fix", out.shape[2], s_kv, window, bottom_right,
                                                            out.dtype), make)
    torch.where(fixed, value, out, out=out)


def _extras(q, bias, seq_len_q, seq_len_kv, sinks, philox, dropout_p) -> tuple:
    if bias is None and seq_len_q is None and sinks is None and dropout_p == 0.0:
        return ()
    return tuple(t for _, t in _options_pairs(q, bias, seq_len_q, seq_len_kv, sinks, philox, dropout_p))


def forward(q, k, v, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None, bias=None, seq_len_q=None,
            seq_len_kv=None, philox=None, dropout_p=0.0, compute_lse=True, rng_dump=None, signature=None):
    """cuDNN forward: (out, lse). ``philox`` is the (seed, offset) pair of int64 device tensors for
    dropout (its backward reuses it); ``rng_dump`` (tests only) a (B, H_q, S_q, S_kv) fp32 buffer that
    receives the realised keep mask. ``signature``: a caller's own signature of this call, covering
    everything the one built here would (then ``window`` and ``bottom_right`` are taken as given:
    ``bottom_right`` must already be ``alignment``'s, and an ``unmasked`` window keeps its mask)."""
    if signature is None:
        if seq_len_q is None and unmasked(window, bottom_right, q.shape[2], k.shape[2]):
            window, bottom_right = (-1, -1), False
        bottom_right = alignment(bottom_right, (q.shape[2], k.shape[2]), (seq_len_q, seq_len_kv))
        signature = ("dense_fwd", q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(sinks),
                     tensor_key(bias), tensor_key(seq_len_q), tensor_key(seq_len_kv), scale, window, bottom_right,
                     dropout_p, compute_lse, rng_dump is not None)
    if bias is not None:
        bias = bias_operand(bias, q, k)
    found = bd.lookup(signature)
    if found is None:
        family = _fwd_family(q, k, v, bias, sinks, seq_len_q, dropout_p, rng_dump, scale, window, bottom_right,
                             compute_lse)
        found = _rebound(family, q, k, v, scale, window, bottom_right, compute_lse)
        if found is None:
            found = _fold_forward(q, k, v, bias, sinks, seq_len_q, seq_len_kv, dropout_p, rng_dump, scale, window,
                                  bottom_right, compute_lse)
            if found is not None and family is not None:
                bd.store(family, found)  # the template of its family's next lengths
        found = bd.store(signature, found or _bind_forward(q, k, v, bias, sinks, seq_len_q, philox, scale, window,
                                                           bottom_right, dropout_p, compute_lse, rng_dump))
    if found.extra.get("fold"):
        found = _promoted(signature, found, q.shape[2], lambda: _bind_forward(
            q, k, v, bias, sinks, seq_len_q, philox, scale, window, bottom_right, dropout_p, compute_lse, rng_dump))
    if found.extra.get("fold"):
        return _run_folded_forward(found, q, k, v, compute_lse, window, bottom_right, seq_len_q, seq_len_kv)
    if found.fix:
        q, k, v = (layout.repaired(t) if fix else t for t, fix in zip((q, k, v), found.repair))
    (size, stride), (lse_size, _) = found.outputs
    out = torch.empty_strided(size, stride, dtype=q.dtype, device=q.device)
    out_buf = out if found.direct[0] else torch.empty(size, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_size, dtype=torch.float32, device=q.device)
    safe_q, safe_kv, bad = rows.safe_lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
    buffers = (q, k, v, out_buf, lse) if compute_lse else (q, k, v, out_buf)
    buffers += _extras(q, bias, safe_q, safe_kv, sinks, philox, dropout_p)
    if rng_dump is not None and dropout_p > 0.0:
        buffers += (rng_dump,)
    bd.run(found, buffers, q.device.index)
    if out_buf is not out:
        out.copy_(out_buf)
    _fix_rows(out, found, window, bottom_right, seq_len_q, seq_len_kv, k.shape[2], bad)
    return out, lse


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _fold_wanted(s_q: int, s_kv: int, device) -> bool | None:
    """Whether a foldable call takes the length-bucketed graphs: True (build them if needed), None
    (only if already built), False (never). Lengths that are powers of two are bucket boundaries,
    where the exact graph has no padded tiles: those take the exact graph unless the bucket's graph
    is already built (so a growing decode builds one graph per doubling, and a fixed power-of-two
    shape keeps today's exact graph). In the default mode only where the folded graphs were verified
    on the GPU (``folded.verified``)."""
    if not folded.buckets_on(device):
        return False
    return True if not (_pow2(s_q) and _pow2(s_kv)) or folded.mode() == "on" else None


#: Calls of one exact shape after which a folded binding with S_q > 1 gives way to the exact graph.
#: A folded prefill or training call pays for the fold (ragged kernels, token-major copies of GQA
#: query-side operands): GPU run 51 measured causal prefill at S 700-731 (B 1, H 32/8, D 128) at
#: 0.092 ms forward and 1.00 ms forward+backward against native's exact 0.039 / 0.377 ms. A shape
#: that keeps coming back (a fixed-shape training or serving loop) is worth its exact graph (one
#: build, about 40 ms); one that does not (dynamic padding: a new longest length per batch) never
#: gets there. 256 calls is 16 steps of a 16-layer model; by then the fold has cost about as much as
#: the build (rent, then buy). Decode (S_q == 1) stays folded: its fold costs microseconds a call.
PROMOTE_AFTER = 256


def _promoted(signature, found: Binding, s_q: int, bind_exact) -> Binding:
    """``found`` (a folded binding), or, on its ``PROMOTE_AFTER``-th call with S_q > 1 in the default
    mode, the exact graph's binding, stored for the signature in its place. Never while a CUDA graph
    is being captured (no build there: the next eager call promotes); a refused exact graph keeps
    the fold for good."""
    extra = found.extra
    if s_q == 1 or extra.get("kept"):
        return found
    calls = extra["calls"] = extra.get("calls", 0) + 1
    if calls < PROMOTE_AFTER or folded.mode() != "auto" or folded.capturing():
        return found
    try:
        exact = bind_exact()
    except NotSupportedError:
        extra["kept"] = True
        return found
    return bd.store(signature, exact)


def _run_folded_forward(found, q, k, v, compute_lse, window, bottom_right, seq_len_q, seq_len_kv):
    if seq_len_q is None:
        return folded.run_forward(found, q, k, v, compute_lse)
    safe_q, safe_kv, bad = rows.safe_lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
    out, lse = folded.run_forward(found, q, k, v, compute_lse, (safe_q, safe_kv))
    _fix_rows(out, found, window, bottom_right, seq_len_q, seq_len_kv, k.shape[2], bad)
    return out, lse


def _try_fold(foldable: bool, s_q: int, s_kv: int, device, bind):
    """A folded binding (``folded``) made by ``bind(build)``, or None: not foldable, not wanted, or
    refused by cuDNN (the exact graph is then tried: a rejection of the folded form is no reason to
    fall back)."""
    wanted = _fold_wanted(s_q, s_kv, device) if foldable else False
    if wanted is False:
        return None
    try:
        return bind(bool(wanted))
    except NotSupportedError:
        return None


def _fwd_family(q, k, v, bias, sinks, seq_len_q, dropout_p, rng_dump, scale, window, bottom_right, compute_lse):
    """The key under which a folded forward binding serves as the template of the same call at other
    lengths of its buckets, or None: options the fold does not take, or a layout whose strides do
    not follow from S. Decode keys the query exactly (``fold_family.decode_family``: only the KV length
    changes); a longer query by its family and bucket (``fold_family.family``)."""
    if bias is not None or sinks is not None or seq_len_q is not None or dropout_p > 0.0 or rng_dump is not None \
            or min(q.shape[2], k.shape[2]) == 0:  # empty: ``folded.applies`` refuses it
        return None
    if q.shape[2] == 1:
        family, query = fold_family.decode_family(q, k, v), tensor_key(q)
    else:
        family = fold_family.family(q, k, v)
        query = (folded.seqlen_bucket(q.shape[2]), folded.seqlen_bucket(k.shape[2]))
    if family is None:
        return None
    return ("dense_fwd_family", q.device.index, query, scale, window, bottom_right, compute_lse, family)


def _template(family, s_q: int, s_kv: int, device):
    """The binding stored under ``family``, when the fold may take this call now (not turned off,
    no capture), else None."""
    template = bd.lookup(family) if family is not None else None
    if template is None or _fold_wanted(s_q, s_kv, device) is False or folded.capturing():
        return None
    return template


def _rebound(family, q, k, v, scale, window, bottom_right, compute_lse):
    """A forward's binding at new lengths from its family's template, or None (no template, or the
    fold declines: a full bind decides). Decode derives it (``fold_family.rebind_forward``: new KV
    lengths and offsets); a longer query too where its operands have their layout's strides
    (``fold_family.rebind``), else it binds with the template's graph, without building or looking up
    its key. (GPU run 58: a first call at a new decode length took 0.32 ms against the repeated
    call's 0.125 ms; on the CPU tier, most of that difference was the Python of a full bind.)"""
    template = _template(family, q.shape[2], k.shape[2], q.device)
    if template is None:
        return None
    if q.shape[2] == 1:
        return fold_family.rebind_forward(template, q, k, v, window=window, bottom_right=bottom_right)
    derived = fold_family.rebind(template, (q, k, v), q, k, window=window, bottom_right=bottom_right)
    if derived is not None:
        return derived
    return folded.bind_forward(q, k, v, scale=scale, window=window, bottom_right=bottom_right,
                               compute_lse=compute_lse, plan=template.plan)


def _fold_forward(q, k, v, bias, sinks, seq_len_q, seq_len_kv, dropout_p, rng_dump, scale, window, bottom_right,
                  compute_lse):
    foldable = folded.applies(q, k, v, bias=bias, sinks=sinks, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                              dropout_p=dropout_p, rng_dump=rng_dump)
    return _try_fold(foldable, q.shape[2], k.shape[2], q.device, lambda build: folded.bind_forward(
        q, k, v, scale=scale, window=window, bottom_right=bottom_right, compute_lse=compute_lse,
        padded=seq_len_q is not None, build=build))


def _fold_backward(grad_out, q, k, v, out, bias, sinks, seq_len_q, seq_len_kv, dropout_p, scale, window, bottom_right,
                   deterministic):
    """As ``_fold_forward``; grad_out and out must be usable in place too. A deterministic backward
    is not folded: on sm_90 before cuDNN 9.25 its workspace grows with B x H x S_q x S_kv, which the
    ``deterministic_workspace`` rule bounds on the call's dims, and a bucket's can be 4x those."""
    foldable = (not deterministic and folded.applies(q, k, v, bias=bias, sinks=sinks, seq_len_q=seq_len_q,
                                                     seq_len_kv=seq_len_kv, dropout_p=dropout_p)
                and layout.usable(out) and layout.usable(grad_out))
    return _try_fold(foldable, q.shape[2], k.shape[2], q.device, lambda build: folded.bind_backward(
        grad_out, q, k, v, out, scale=scale, window=window, bottom_right=bottom_right, deterministic=deterministic,
        padded=seq_len_q is not None, build=build))


def _bwd_family(grad_out, q, k, v, out, bias, sinks, seq_len_q, dropout_p, scale, window, bottom_right,
                deterministic):
    """As ``_fwd_family`` for a backward (not deterministic: ``_fold_backward`` keeps those exact),
    keyed by the families of dO, Q, K, V and O and the length buckets."""
    if deterministic or bias is not None or sinks is not None or seq_len_q is not None or dropout_p > 0.0 \
            or min(q.shape[2], k.shape[2]) == 0:
        return None
    family = fold_family.family(grad_out, q, k, v, out)
    if family is None:
        return None
    buckets = (folded.seqlen_bucket(q.shape[2]), folded.seqlen_bucket(k.shape[2]))
    return ("dense_bwd_family", q.device.index, buckets, scale, window, bottom_right, family)


#: (dtype, H_q, H_k, D) of forwards with a bias -> the first (S_q, S_kv) bound (``_note_bias_length``).
_bias_lengths: dict = {}


def _note_bias_length(q, k) -> None:
    """Say once per configuration (INFO) that a forward with a bias binds an exact graph per length.
    A bias's declared strides follow S, so the length buckets never take it (``_fwd_family``); a
    padding mask that Hugging Face models hand F.sdpa is such a bias (GPU run 63: 94 builds in 50
    dynamic-padding steps, against 2 through the transformers integration, which passes lengths)."""
    family = (q.dtype, q.shape[1], k.shape[1], q.shape[3])
    lengths = (q.shape[2], k.shape[2])
    if _bias_lengths.setdefault(family, lengths) != lengths:
        counters.log_once(("dense", "bias_per_length") + family, logging.INFO,
                          "attention with a bias or mask tensor (%s, H=%d/%d, D=%d) builds a cuDNN graph for each "
                          "new sequence length: its strides follow the length, so the length buckets cannot serve "
                          "it (builds are in csp.report()); Hugging Face models avoid this for padding masks "
                          "with csp.integrations.transformers.register() and attn_implementation=\"cudnn\", "
                          "which pass per-sequence lengths", *family)


def _bind_forward(q, k, v, bias, sinks, seq_len_q, philox, scale, window, bottom_right, dropout_p, compute_lse,
                  rng_dump):
    b, h, s_q, _ = q.shape
    if bias is not None:
        _note_bias_length(q, k)
    repair = tuple(not layout.usable(t) for t in (q, k, v))
    qr, kr, vr = (layout.repaired(t) if fix else t for t, fix in zip((q, k, v), repair))
    out = layout.dense_out(q, (b, h, s_q, v.shape[3]))
    out_direct = layout.strides_usable(out)
    out_buf = out if out_direct else torch.empty(tuple(out.shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s_q, 1), dtype=torch.float32, device=q.device)
    key = FwdKey(device=q.device.index, q=bd.desc(qr), k=bd.desc(kr), v=bd.desc(vr), o=bd.desc(out_buf),
                 lse=bd.desc(lse) if compute_lse else None, scale=float(scale), window=tuple(window),
                 bottom_right=bool(bottom_right), sinks=sinks is not None,
                 bias=bd.desc(bias) if bias is not None else None, padded=seq_len_q is not None,
                 dropout_p=float(dropout_p), rng_dump=rng_dump is not None and dropout_p > 0.0)
    uids = (UID.Q, UID.K, UID.V, UID.O) + ((UID.LSE,) if compute_lse else ())
    uids += tuple(u for u, _ in _options_pairs(q, bias, seq_len_q, seq_len_q, sinks, philox, dropout_p))
    uids += (UID.RNG_DUMP,) if rng_dump is not None and dropout_p > 0.0 else ()
    dead = seq_len_q is not None or rows.dead_rows(s_q, k.shape[2], window, bottom_right) is not None
    return Binding(plan=_plan(key), uids=tuple(int(u) for u in uids), repair=repair,
                   outputs=((tuple(out.shape), out.stride()), ((b, h, s_q, 1), lse.stride())),
                   direct=(out_direct, True), extra={"dead": dead}, fix=any(repair))


def _plan(key):
    return bd.graphs.plan(key)


def backward(grad_out, q, k, v, out, lse, *, scale: float, window=(-1, -1), bottom_right=False, sinks=None,
             bias=None, seq_len_q=None, seq_len_kv=None, philox=None, dropout_p=0.0, deterministic=False,
             signature=None):
    """cuDNN backward: (dq, dk, dv, dsinks or None). ``signature`` as for ``forward``."""
    if signature is None:
        if seq_len_q is None and unmasked(window, bottom_right, q.shape[2], k.shape[2]):
            window, bottom_right = (-1, -1), False
        bottom_right = alignment(bottom_right, (q.shape[2], k.shape[2]), (seq_len_q, seq_len_kv))
        signature = ("dense_bwd", q.device.index, tensor_key(grad_out), tensor_key(q), tensor_key(k),
                     tensor_key(v), tensor_key(out), tensor_key(lse), tensor_key(sinks), tensor_key(bias),
                     tensor_key(seq_len_q), tensor_key(seq_len_kv), scale, window, bottom_right, dropout_p,
                     deterministic)
    if bias is not None:
        bias = bias_operand(bias, q, k)
    found = bd.lookup(signature)
    if found is None:
        family = _bwd_family(grad_out, q, k, v, out, bias, sinks, seq_len_q, dropout_p, scale, window, bottom_right,
                             deterministic)
        template = _template(family, q.shape[2], k.shape[2], q.device)
        if template is not None:
            found = fold_family.rebind(template, (grad_out, q, k, v, out), q, k, window=window,
                                       bottom_right=bottom_right)
            if found is None:
                found = folded.bind_backward(grad_out, q, k, v, out, scale=scale, window=window,
                                             bottom_right=bottom_right, deterministic=False, plan=template.plan)
        if found is None:
            found = _fold_backward(grad_out, q, k, v, out, bias, sinks, seq_len_q, seq_len_kv, dropout_p, scale,
                                   window, bottom_right, deterministic)
            if found is not None and family is not None:
                bd.store(family, found)
        found = bd.store(signature, found or _bind_backward(grad_out, q, k, v, out, lse, bias, sinks, seq_len_q,
                                                            philox, scale, window, bottom_right, dropout_p,
                                                            deterministic))
    if found.extra.get("fold"):
        found = _promoted(signature, found, q.shape[2], lambda: _bind_backward(
            grad_out, q, k, v, out, lse, bias, sinks, seq_len_q, philox, scale, window, bottom_right, dropout_p,
            deterministic))
    if found.extra.get("fold"):
        safe_q, safe_kv, bad = rows.safe_lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
        dq, dk, dv = folded.run_backward(found, grad_out, q, k, v, out, lse,
                                         None if seq_len_q is None else (safe_q, safe_kv))
        if seq_len_q is not None:  # rows past the lengths are 0; a batch row with bad lengths is NaN
            none_dead = rows.none_dead(q.shape[2], k.shape[2], window, bottom_right, seq_len_q, seq_len_kv)
            _zero_dead_grads(dq, dk, dv, found, window, bottom_right, seq_len_q, seq_len_kv, none_dead)
            if not none_dead:
                for g in (dq, dk, dv):  # (its folds were given length 0: cuDNN wrote nothing there)
                    g.masked_fill_(bad, float("nan"))
        return dq, dk, dv, None
    qr, kr, vr, outr, do, lse_in = q, k, v, out, grad_out, lse
    if found.fix:
        fix_q, fix_k, fix_v, fix_o, fix_do, fix_lse = found.repair
        qr, kr, vr, outr = (layout.repaired(t) if f else t for t, f in zip((q, k, v, out), (fix_q, fix_k, fix_v, fix_o)))
        do = torch.empty_like(outr).copy_(grad_out) if fix_do else grad_out  # dO matched to the (repaired) O
        lse_in = lse.contiguous() if fix_lse else lse  # cuDNN < 9.26 misreads non-packed stats
    (dq, dk, dv), bufs = bd.outputs(found, (q.dtype, k.dtype, v.dtype), q.device)
    safe_q, safe_kv, _ = rows.safe_lengths(seq_len_q, seq_len_kv, q.shape[2], k.shape[2])
    buffers = (qr, kr, vr, outr, do, lse_in, bufs[0], bufs[1], bufs[2])
    buffers += _extras(q, bias, safe_q, safe_kv, sinks, philox, dropout_p)
    if sinks is not None:  # cuDNN writes dSink_token; the gradient itself is computed below
        buffers += (torch.empty((1, q.shape[1], 1, 1), dtype=torch.float32, device=q.device),)
    bd.run(found, buffers, q.device.index)
    bd.copy_back([dq, dk, dv], bufs)
    _zero_dead_grads(dq, dk, dv, found, window, bottom_right, seq_len_q, seq_len_kv)
    dsinks = rows.sink_grad_dense(sinks, lse_in, outr, do) if sinks is not None else None
    return dq, dk, dv, dsinks


def _bind_backward(grad_out, q, k, v, out, lse, bias, sinks, seq_len_q, philox, scale, window, bottom_right,
                   dropout_p, deterministic):
    repair = tuple(not layout.usable(t) for t in (q, k, v, out))
    qr, kr, vr, outr = (layout.repaired(t) if fix else t for t, fix in zip((q, k, v, out), repair))
    fix_do = not layout.usable(grad_out)
    do = torch.empty_like(outr) if fix_do else grad_out
    fix_lse = not lse.is_contiguous()
    grads = [layout.grad_like(t) for t in (q, k, v)]
    direct = tuple(layout.strides_usable(g) for g in grads)
    bufs = [g if d else torch.empty(tuple(g.shape), dtype=g.dtype, device=g.device) for g, d in zip(grads, direct)]
    key = BwdKey(device=q.device.index, q=bd.desc(qr), k=bd.desc(kr), v=bd.desc(vr), o=bd.desc(outr),
                 do=bd.desc(do), lse=bd.desc(lse.contiguous() if fix_lse else lse), dq=bd.desc(bufs[0]),
                 dk=bd.desc(bufs[1]), dv=bd.desc(bufs[2]), scale=float(scale), window=tuple(window),
                 bottom_right=bool(bottom_right), sinks=sinks is not None,
                 bias=bd.desc(bias) if bias is not None else None, padded=seq_len_q is not None,
                 dropout_p=float(dropout_p), deterministic=bool(deterministic))
    uids = (UID.Q, UID.K, UID.V, UID.O, UID.DO, UID.LSE, UID.DQ, UID.DK, UID.DV)
    uids += tuple(u for u, _ in _options_pairs(q, bias, seq_len_q, seq_len_q, sinks, philox, dropout_p))
    uids += (UID.DSINK,) if sinks is not None else ()
    dead = rows.dead_rows(q.shape[2], k.shape[2], window, bottom_right) is not None
    repair += (fix_do, fix_lse)
    return Binding(plan=_plan(key), uids=tuple(int(u) for u in uids), repair=repair,
                   outputs=tuple((tuple(g.shape), g.stride()) for g in grads), direct=direct, extra={"dead": dead},
                   fix=any(repair))


def _zero_dead_grads(dq, dk, dv, b: Binding, window, bottom_right, seq_len_q, seq_len_kv, none_dead=None) -> None:
    """Zero dQ's dead query rows and dK/dV past each key length. ``none_dead``: the caller's answer of
    ``rows.none_dead`` for these lengths, where it has one (asked here otherwise)."""
    s_q, s_kv = dq.shape[2], dk.shape[2]
    if seq_len_q is None:
        if b.extra["dead"]:
            dead = rows.dead_rows(s_q, s_kv, window, bottom_right, device=dq.device)
            if dead is not None:
                dq.masked_fill_(dead, 0)
        return
    if none_dead is None:
        none_dead = rows.none_dead(s_q, s_kv, window, bottom_right, seq_len_q, seq_len_kv)
    if not none_dead:
        dq.masked_fill_(rows.padded_dead_rows(s_q, s_kv, window, bottom_right, seq_len_q, seq_len_kv, dq.device), 0)
    past_kv = length_terms.get(seq_len_q, seq_len_kv, ("past", s_kv), lambda: rows.rows_past(seq_len_kv, s_kv))
    dk.masked_fill_(past_kv, 0)
    dv.masked_fill_(past_kv, 0)
    # Out-of-range lengths need no poisoning here: the forward's rows of that batch row are NaN.
