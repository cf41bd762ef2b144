"""Folded bindings at new lengths, derived from the first binding of their family.

A folded graph serves every length of its buckets (``folded``), but a binding is still made per
call signature, and a full bind costs host time on the first call at each length. Calls whose
operands agree in everything but their lengths (a *family*: batch and head counts, head dims,
dtypes, alignment and a layout whose strides follow from S, ``family``) bind the same graph with
the same uids; only the lengths' small tensors, the offsets and the outputs' strides change. So
the first binding of a family serves as the template of the others:

* decode (S_q = 1, ``decode_family``): ``rebind_forward`` takes the template's outputs as they
  are (they do not depend on the KV length) and new KV lengths and K/V offsets;
* a longer query and its backward (``rebind``): where every operand has its layout's strides
  (``folded.lengths_form``), the outputs' strides and every offset follow from the lengths and the
  call's own strides, so no tensor is made to find them. Elsewhere the caller binds in full with
  the template's graph.

The CPU tier (tests/test_folded.py) compares every binding ``rebind`` derives with the one a full
bind of the same call makes, field by field and value by value; decode's derived bindings are
checked by their answers at every length (they also keep the template's ``lengths`` form, which
decode never reads).
"""

from __future__ import annotations

from . import fold_values as fv
from . import folded
from ..core import layout
from .binding import Binding

__all__ = ["family", "decode_family", "rebind_forward", "rebind"]


def family(*tensors) -> tuple | None:
    """What a folded binding depends on in these operands besides their lengths: for each, its batch
    and head counts, head dim, dtype, 16-byte alignment and layout (``fold_values.layout_of``); None
    where a layout's strides do not follow from S. Within one pair of length buckets, calls whose
    operands and options agree in these build the same folded graph key: the strides a fold
    declares (head-in-group, token) do not depend on S in these layouts, nor in the token-major
    scratch that a copied operand, O or the LSE is written to (tests/test_folded.py compares the
    keys)."""
    parts = []
    for t in tensors:
        kind = fv.layout_of(t)
        if kind is None:
            return None
        shape = t.shape
        parts.append((shape[0], shape[1], shape[3], t.dtype, t.data_ptr() % layout.ALIGN == 0, kind))
    return tuple(parts)


def decode_family(q, k, v) -> tuple | None:
    """What a decode forward's folded binding depends on besides its KV length, beyond the query's
    own signature: the KV length bucket, and for K and V their batch and head counts, head dim,
    dtype, 16-byte alignment and layout (``fold_values.layout_of``). Two calls of one family bind
    the same graph, uids and output layout, and differ only in the KV length's small tensors
    (``rebind_forward``). None for S_q > 1 or a K/V layout whose strides do not follow from S."""
    if q.shape[2] != 1:
        return None
    kv = family(k, v)
    return None if kv is None else (folded.seqlen_bucket(k.shape[2]), kv)


def rebind_forward(template: Binding, q, k, v, *, window, bottom_right: bool) -> Binding | None:
    """The binding of a decode forward at a new KV length, from ``template``, a folded binding of
    the same family (``decode_family``) and query signature: its plan, uids and outputs, with the new
    length's KV lengths, K/V offsets and dead rows. None where a full bind must decide instead: the
    offsets would pass int32, or the template's tensors were made on another stream."""
    made = template.extra["made"]
    if made is not None and made[0] != fv.stream_of(q.device):
        return None
    h_kv, s_kv = k.shape[1], k.shape[2]
    stream = fv.stream_of(q.device)
    (e_k, r_k), (e_v, r_v) = fv.operand(k, h_kv, 1, stream), fv.operand(v, h_kv, 1, stream)
    if max(e_k, e_v) > folded.INT32_MAX:
        return None
    n = q.shape[0] * h_kv
    wanted = [fv.length_request(n, s_kv, q.device, stream), r_k, r_v]
    lengths_kv, off_k, off_v = folded.small_tensors(wanted, q.device, stream, (k, v, n, h_kv, s_kv))
    old = template.extra["tensors"]
    tensors = (old[0], lengths_kv, old[2], off_k, off_v) + old[5:]
    dead = folded.dead_rows(1, s_kv, window, bottom_right, q.device)
    extra = dict(template.extra, tensors=tensors, dead=dead, made=folded.made_at(q.device, dead))
    return Binding(plan=template.plan, uids=template.uids, repair=template.repair, outputs=template.outputs,
                   direct=template.direct, extra=extra, fix=template.fix)


#: Binding facts that belong to one signature, not to the family a template serves (``dense._promoted``).
_OWN = ("calls", "kept")


def rebind(template: Binding, callers: tuple, q, k, *, window, bottom_right: bool) -> Binding | None:
    """The binding of a folded forward (S_q > 1) or backward at new lengths from ``template``, a
    binding of the same family and buckets (``dense._fwd_family``, ``dense._bwd_family``): its
    plan, uids, copies and scratch choices, with the outputs' strides (``folded.output_layout``),
    the offsets and the lengths computed from the call's lengths and strides, no tensor made
    (``folded.lengths_form``; the folded tests compare it with a full bind). ``callers``: the
    call's operands in the template's order (q, k, v; or dO, q, k, v, O); ``q`` and ``k`` among
    them. None where a full bind must decide instead: no form, a caller whose strides are not its
    layout's (``fold_values.follows``), offsets past int32, or the template's tensors made on
    another stream."""
    form = template.extra.get("lengths")
    if form is None:
        return None
    made, stream = template.extra["made"], fv.stream_of(q.device)
    if made is not None and made[0] != stream:
        return None
    kinds, specs, rules = form
    if len(callers) != len(kinds):
        raise ValueError(f"rebind: {len(callers)} operands for a template of {len(kinds)}")
    for t, kind in zip(callers, kinds):
        if not fv.follows(t, kind):
            return None
    b, s_q, h_kv, s_kv = q.shape[0], q.shape[2], k.shape[1], k.shape[2]
    n, device = b * h_kv, q.device
    wanted = [fv.length_request(n, s_q, device, stream), fv.length_request(n, s_kv, device, stream)]
    seen: dict = {}  # Q and O (K and V) share a spec: their offsets once
    for spec_side in specs:
        op = seen.get(spec_side)
        if op is None:
            spec, side = spec_side
            op = seen[spec_side] = fv.operand_at(spec, s_q if side else s_kv, h_kv, device, stream)
            if op[0] > folded.INT32_MAX:
                return None
        wanted.append(op[1])
    chunk = ([spec for spec, _ in specs], n, h_kv, s_q) if s_q == s_kv > 1 else None
    tensors = folded.small_tensors(wanted, device, stream, chunk=chunk)
    dead = folded.dead_rows(s_q, s_kv, window, bottom_right, device)
    outputs = tuple(folded.output_layout(rule, callers) for rule in rules)
    extra = dict(template.extra)
    for key in _OWN:
        extra.pop(key, None)
    extra.update(tensors=tensors, dead=dead, made=folded.made_at(device, dead))
    return Binding(plan=template.plan, uids=template.uids, repair=template.repair, outputs=outputs,
                   direct=template.direct, extra=extra, fix=template.fix)
