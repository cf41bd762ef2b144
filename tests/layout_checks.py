"""The checks of one layout configuration's results (tests/layout_runner.py runs the calls):
accuracy by the FlashAttention rule against an fp32 reference, native's misreads, the dropout
identities, strides against native or the fake kernels, and what the counters say. Each check
appends what it found to ``problems`` (and what it noticed to ``notes``)."""

from __future__ import annotations

import math

import torch

from cudnn_sdpa_provider.core import reasons
from tests import layouts
from tests.util import rel_error

FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # as tests/gpu/test_reliability.py
#: The LSE is fp32 of the same low-precision inputs everywhere; only the accumulation order differs.
LSE_FLOOR = 1e-4
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: How many rounding-noise estimates a dropout identity may be off (both kernels are checked; native
#: alone off, the provider within, is noted as native misreading the layout).
IDENTITY_SIGMAS = 8
#: Native's error over this many times the composite's (and the floor) means native misread the layout.
MISREAD = 4


def _layout_of(strides, shape) -> tuple:
    """Strides of the dims of extent > 1 (a size-1 dim's stride means nothing)."""
    return tuple(s for s, n in zip(strides, shape) if n > 1)


def _layout(t) -> tuple:
    return _layout_of(t.stride(), t.shape)


def outcome(delta, paths) -> str:
    d = delta.to_dict()
    parts = []
    for p in paths:
        fell = d[p]["fallback"]
        parts.append(f"{p}=" + ("served" if d[p]["served"] else "fallback:" + ",".join(sorted(fell))))
    return " ".join(parts)


def check_counts(problems, delta, paths, expect) -> None:
    d = delta.to_dict()
    for p in reasons.PATHS:
        want = 1 if p in paths else 0
        if delta.total(p) != want:
            problems.append(f"counters: {p} counted {delta.total(p)} calls, want {want}: {d}")
    for p in paths:
        unknown = [r for r in d[p]["fallback"] if r not in reasons.CATALOG]
        if unknown:
            problems.append(f"counters: {p} fell back for uncatalogued reasons {unknown}")
        if expect.get(p) == "served" and d[p]["served"] != 1:
            problems.append(f"counters: {p} must be served here: {d[p]}")


def _close(problems, name, got, want, tol) -> None:
    if torch.isnan(got).any():
        problems.append(f"{name} has NaN at {tuple(torch.nonzero(torch.isnan(got))[0].tolist())}")
        return
    err, worst = rel_error(got, want)
    if err > tol:
        problems.append(f"{name}: max|err|/max|ref| = {err:.2e} > {tol:.2e} at {worst}: got "
                        f"{got[worst].item():.6g}, want {want[worst].item():.6g}")


def _per_input(ops, grads) -> list:
    """Composite gradients (dq, dk, dv) summed per distinct input (q is k gets dq + dk)."""
    return [sum(g for g, t in zip(grads, (ops.q, ops.k, ops.v)) if t is x) for x in ops.inputs]


def _oriented(x, shape):
    """An LSE as (T, H) or dense (B, H, S, 1): varlen_attn's own is (H, T)."""
    return x.t() if x.dim() == 2 and tuple(x.shape) != tuple(shape) else x


def _reference(case, ops):
    leaves = {id(t): t.detach().float().requires_grad_() for t in ops.inputs}
    ref, ref_lse = case.reference(*(leaves[id(t)] for t in (ops.q, ops.k, ops.v)))
    grads = torch.autograd.grad(ref, [leaves[id(t)] for t in ops.inputs], ops.go.float())
    return ref.detach(), ref_lse.detach(), grads


def _misread(native, ref, ref_lse, ref_grads, low, dtype) -> str | None:
    """Which tensor native got wrong beyond doubt (error over MISREAD x the composite's in the same
    dtype and over MISREAD x the floor), or None. F.sdpa's kernels read rows that are not 16-byte
    aligned wrongly without an error (GPU run 24); native's error must not become the tolerance."""
    pairs = [("out", native.out, ref, low[0], FLOOR[dtype])] + [
        (f"grad {i}", g, want, mine, FLOOR[dtype])
        for i, (g, want, mine) in enumerate(zip(native.grads, ref_grads, low[2]))]
    if native.lse is not None and low[1] is not None:
        pairs.append(("lse", _oriented(native.lse, ref_lse.shape).reshape(ref_lse.shape).float(), ref_lse,
                      _oriented(low[1], ref_lse.shape).reshape(ref_lse.shape).float(), LSE_FLOOR))
    for name, theirs, want, composite, floor in pairs:
        err = rel_error(theirs, want)[0]
        if not err <= MISREAD * max(rel_error(composite, want)[0], floor):  # NaN counts as wrong
            return name
    return None


def check_accuracy(problems, cfg, ops, got, native, case, notes) -> None:
    dtype = layouts.DTYPES[cfg["dtype"]]
    ref, ref_lse, ref_grads = _reference(case, ops)
    low = case.low()  # (out, lse, (dq, dk, dv)) of the composite in the input dtype
    if native is not None:
        wrong = _misread(native, ref, ref_lse, ref_grads, (low[0], low[1], _per_input(ops, low[2])), dtype)
        if wrong is not None:
            notes.append(f"native misread this layout ({wrong}): the composite is the base")
            native = None
    base_out, base_grads = (native.out, native.grads) if native is not None else (low[0], _per_input(ops, low[2]))
    out_tol = max(3 * rel_error(base_out, ref)[0], FLOOR[dtype])
    _close(problems, "out", got.out, ref, out_tol)
    grad_floor = max(2 * out_tol, 3 * FLOOR[dtype])
    for name, g, want, base in zip(ops.names, got.grads, ref_grads, base_grads):
        group = cfg["h_q"] // cfg["h_kv"] if name in ("dk", "dv") else 1  # GQA dK/dV sum over the group
        _close(problems, name, g, want, max(3 * rel_error(base, want)[0], grad_floor * math.sqrt(group)))
    if got.lse is not None:
        base_lse = native.lse if native is not None and native.lse is not None else low[1]
        as_ref = [_oriented(x, ref_lse.shape).reshape(ref_lse.shape).float() for x in (base_lse, got.lse)]
        _close(problems, "lse", as_ref[1], ref_lse, max(3 * rel_error(as_ref[0], ref_lse)[0], LSE_FLOOR))


def identity_gaps(ops, res, dtype) -> list[str]:
    """<dV, V> = <dO, O> and <dQ, Q> = <dK, K> hold for any dropout mask, if the backward used the
    forward's (the second: scaling Q by t and K by 1/t changes nothing). Off by more than
    IDENTITY_SIGMAS rounding-noise estimates means forward and backward disagree."""
    if len(ops.inputs) < 3:
        return []  # aliased operands: dQ and dK are not separate
    dq, dk, dv = res.grads
    gaps = []
    for name, (a, x), (b, y) in (("<dV,V> = <dO,O>", (dv, ops.v), (ops.go, res.out)),
                                 ("<dQ,Q> = <dK,K>", (dq, ops.q), (dk, ops.k))):
        ta, tb = a.double() * x.detach().double(), b.double() * y.detach().double()
        gap = (ta.sum() - tb.sum()).abs().item()
        noise = UNIT_ROUNDOFF[dtype] * (ta.square().sum().sqrt() + tb.square().sum().sqrt()).item()
        if gap > IDENTITY_SIGMAS * noise:
            gaps.append(f"{name}: off by {gap:.3e} > {IDENTITY_SIGMAS} x noise {noise:.3e}")
    return gaps


def _rms_from(out, ref) -> float:
    return ((out.double() - ref.double()).square().mean().sqrt() / ref.double().square().mean().sqrt()).item()


def check_dropout(problems, cfg, ops, got, native, case, notes) -> None:
    dtype = layouts.DTYPES[cfg["dtype"]]
    for name, t in [("out", got.out)] + list(zip(ops.names, got.grads)):
        if torch.isnan(t).any():
            problems.append(f"{name} has NaN (dropout)")
    problems += [f"provider: {gap}" for gap in identity_gaps(ops, got, dtype)]
    if native is None:
        return
    theirs = identity_gaps(ops, native, dtype)
    if theirs and not any(p.startswith("provider:") for p in problems):
        # native's kernel misread the layout (the provider's results pass the same check); the
        # dropout itself (how far the output is from the dropout-free one) is still compared
        notes.append(f"native broke a dropout identity ({theirs[0]})")
    else:
        problems += [f"native (the check itself is wrong): {gap}" for gap in theirs]
    ref = _reference(case, ops)[0]  # without dropout
    mine, theirs = _rms_from(got.out, ref), _rms_from(native.out, ref)
    if not theirs / 4 <= mine <= 4 * theirs:
        problems.append(f"dropout: rms(out - no-dropout out) is {mine:.3f} of the output, native's {theirs:.3f}")


def _compare_strides(problems, got, ops, source, want_out, want_grads) -> None:
    for name, t, want in [("out", got.out, want_out)] + list(zip(ops.names, got.grads, want_grads)):
        if _layout(t) != _layout_of(want, t.shape):
            problems.append(f"{name}: strides {t.stride()}, {source} {tuple(want)} (shape {tuple(t.shape)})")


def check_strides(problems, got, native, case, ops, relaid=frozenset()) -> None:
    """Strides of out and the gradients against the fake kernels' where native did not run or is not
    the oracle for the API, else against native's. Where native read an operand in another layout
    (``relaid``), the fake kernels are the oracle when the provider served both paths (they
    describe the provider's kernels), and nothing is compared when it fell back (then native's own
    kernel chose the strides, on the original layout)."""
    if native is None or not case.native_strides:
        _compare_strides(problems, got, ops, "fake kernels", *case.rule())
        return
    if relaid:
        if all(part.endswith("=served") for part in outcome(got.delta, case.paths).split()):
            _compare_strides(problems, got, ops, "fake kernels", *case.rule())
        return
    if got.lse is not None and native.lse is not None and (
            got.lse.shape != native.lse.shape or _layout(got.lse) != _layout(native.lse)):
        problems.append(f"lse: shape/strides {tuple(got.lse.shape)}/{got.lse.stride()}, native "
                        f"{tuple(native.lse.shape)}/{native.lse.stride()}")
    _compare_strides(problems, got, ops, "native", native.out.stride(), [g.stride() for g in native.grads])
