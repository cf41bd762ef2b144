"""CPU tier: ``csp.attention`` (runs the composite, counted as fallback no_cuda), its argument
validation, and ``csp.explain``."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider import functional
from cudnn_sdpa_provider.ops import reference
from tests.util import assert_rel_close

TOL = 1e-5  # float32 inputs against a float64 reference


def rnd(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(requires_grad)


def dense(b=2, h_q=4, h_kv=2, s_q=6, s_kv=8, d=8, d_v=8, requires_grad=True):
    return (rnd(b, h_q, s_q, d, seed=1, requires_grad=requires_grad),
            rnd(b, h_kv, s_kv, d, seed=2, requires_grad=requires_grad),
            rnd(b, h_kv, s_kv, d_v, seed=3, requires_grad=requires_grad))


def region(fn):
    before = counters.stats()
    result = fn()
    return result, {p: e["fallback"] for p, e in (counters.stats() - before).to_dict().items() if e["fallback"]}


def _ref(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


# ------------------------------------------------------------------------------------ results

DENSE_OPTIONS = {
    "defaults": dict(),
    "causal": dict(is_causal=True),
    "window_bottom_right": dict(window=(2, 1), bottom_right=True, scale=0.2),
    "sinks": dict(sinks=True),
    "padded": dict(seq_lens=True),
}


@pytest.mark.parametrize("opts", DENSE_OPTIONS.values(), ids=DENSE_OPTIONS.keys())
def test_dense_attention_matches_reference_and_counts_no_cuda(opts):
    opts = dict(opts)
    q, k, v = dense(d_v=5)
    sinks = rnd(4, seed=4, requires_grad=True) if opts.pop("sinks", False) else None
    if opts.pop("seq_lens", False):
        opts.update(seq_lens_q=torch.tensor([6, 2], dtype=torch.int64), seq_lens_kv=torch.tensor([3, 8]))
    go = rnd(2, 4, 6, 5, seed=5)

    def run():
        out, lse = csp.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
        out.backward(go)
        return out, lse

    (out, lse), counted = region(run)
    assert counted == {"dense_fwd": {"no_cuda": 1}, "dense_bwd": {"no_cuda": 1}}
    assert out.dtype == q.dtype and out.shape == (2, 4, 6, 5) and lse.shape == (2, 4, 6, 1)

    window = (-1, 0) if opts.get("is_causal") else tuple(opts.get("window", (-1, -1)))
    rq, rk, rv, rs = _ref(q, k, v, sinks)
    lens = {"seq_len_q": opts["seq_lens_q"], "seq_len_kv": opts["seq_lens_kv"]} if "seq_lens_q" in opts else {}
    want, want_lse = reference.dense(rq, rk, rv, scale=opts.get("scale", 1 / math.sqrt(8)), window=window,
                                     bottom_right=opts.get("bottom_right", False), sinks=rs, **lens,
                                     compute_dtype=torch.float64)
    want.backward(go.double())
    assert_rel_close(out, want, TOL, "out")
    finite = torch.isfinite(want_lse)
    assert_rel_close(lse[finite], want_lse[finite], TOL, "lse")
    for t, r, name in ((q, rq, "dq"), (k, rk, "dk"), (v, rv, "dv"), (sinks, rs, "dsinks")):
        if t is not None:
            assert_rel_close(t.grad, r.grad, TOL, name)


def test_dense_attention_any_strides_output_follows_q():
    q, k, v = dense(requires_grad=False)
    q_bshd = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, S, H, D) in memory
    out = csp.attention(q_bshd, k, v)
    assert out.stride() == q_bshd.stride()
    assert_rel_close(out, csp.attention(q, k, v), 1e-6, "out")


@pytest.mark.parametrize("s_q, s_kv", [(0, 4), (3, 0), (0, 0)])
def test_empty_sequences(s_q, s_kv):
    q, k, v = rnd(1, 2, s_q, 8, requires_grad=True), rnd(1, 2, s_kv, 8, requires_grad=True), \
        rnd(1, 2, s_kv, 8, requires_grad=True)
    out = csp.attention(q, k, v)
    assert out.shape == (1, 2, s_q, 8) and torch.all(out == 0), "attention over nothing is 0"
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_no_grad_call_counts_forward_only():
    q, k, v = dense(requires_grad=False)
    out, counted = region(lambda: csp.attention(q, k, v))
    assert counted == {"dense_fwd": {"no_cuda": 1}}
    assert not out.requires_grad


@pytest.mark.parametrize("cu_kv", [None, [0, 5, 5, 11]], ids=["cu_kv_default", "cu_kv"])
def test_varlen_attention_matches_reference(cu_kv):
    cu_q = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    cu_k = cu_q if cu_kv is None else torch.tensor(cu_kv, dtype=torch.int64)
    q, k, v = rnd(11, 4, 8, requires_grad=True), rnd(11, 2, 8, seed=1, requires_grad=True), \
        rnd(11, 2, 8, seed=2, requires_grad=True)
    go = rnd(11, 4, 8, seed=3)
    max_kv = 6 if cu_kv is not None else 5

    def run():
        out, lse = csp.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv if cu_kv is None else cu_k,
                                 max_seqlen_q=5, max_seqlen_kv=max_kv, is_causal=True, return_lse=True)
        out.backward(go)
        return out, lse

    (out, lse), counted = region(run)
    assert counted == {"varlen_fwd": {"no_cuda": 1}, "varlen_bwd": {"no_cuda": 1}}
    assert out.shape == (11, 4, 8) and lse.shape == (11, 4) and lse.dtype == torch.float32
    rq, rk, rv = _ref(q, k, v)
    want, _ = reference.varlen(rq, rk, rv, cu_q, cu_k.to(torch.int32), 5, max_kv, scale=1 / math.sqrt(8),
                               window=(-1, 0), compute_dtype=torch.float64)
    want.backward(go.double())
    assert_rel_close(out, want, TOL, "out")
    for t, r, name in ((q, rq, "dq"), (k, rk, "dk"), (v, rv, "dv")):
        assert_rel_close(t.grad, r.grad, TOL, name)


def test_counted_whether_or_not_enabled_and_strict_raises():
    q, k, v = dense()
    _, outside = region(lambda: csp.attention(q, k, v))
    with csp.enable():
        _, inside = region(lambda: csp.attention(q, k, v))
    assert outside == inside == {"dense_fwd": {"no_cuda": 1}}
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            csp.attention(q, k, v, window=(3, 0))
    err = info.value
    assert err.path == "dense_fwd" and err.reasons == ["no_cuda"]
    for piece in ("q=(2, 4, 6, 8)", "k=(2, 2, 8, 8)", "float32", "window=(3, 0)"):
        assert piece in str(err), (piece, str(err))


def test_strict_varlen_raises():
    q = rnd(5, 2, 8)
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            csp.attention(q, q, q, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32), max_seqlen_q=5,
                          max_seqlen_kv=5)
    assert info.value.path == "varlen_fwd" and info.value.reasons == ["no_cuda"]


def test_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    (test,) = [t for t in finder.find(functional.attention, "attention") if t.examples]
    result = runner.run(test, out=lambda _: None)
    assert result.failed == 0 and result.attempted >= 3


# --------------------------------------------------------------------------------- validation

Q4 = rnd(2, 4, 6, 8)
KV4 = rnd(2, 2, 6, 8)
P3 = rnd(6, 4, 8)
CU = torch.tensor([0, 2, 6], dtype=torch.int32)
PACKED = dict(cu_seqlens_q=CU, max_seqlen_q=4, max_seqlen_kv=4)


def _case(args=(Q4, KV4, KV4), **kw):
    return args, kw


BAD = {
    # id: ((q, k, v), kwargs, exception, message regex)
    "q_not_tensor": (_case(([1.0], KV4, KV4)), TypeError, r"q must be a torch.Tensor, got list"),
    "v_not_tensor": (_case((Q4, KV4, None)), TypeError, r"v must be a torch.Tensor, got NoneType"),
    "dense_rank": (_case((P3, P3, P3)), ValueError, r"q must be 4-D \(B, H, S, D\) here, got shape \(6, 4, 8\)"),
    "k_rank": (_case((Q4, P3, KV4)), ValueError, r"k must be 4-D"),
    "packed_rank": (_case((Q4, Q4, Q4), **PACKED), ValueError, r"q must be 3-D \(T, H, D\) here"),
    "dtype_mismatch": (_case((Q4, KV4.double(), KV4)), TypeError, r"q, k, v must share a dtype"),
    "integer_dtype": (_case((Q4.long(), KV4.long(), KV4.long())), TypeError, r"must be floating point, got torch.int64"),
    "fp8_dtype": (_case(tuple(t.to(torch.float8_e4m3fn) for t in (Q4, KV4, KV4))), TypeError,
                  r"must be float16, bfloat16 or float32 here, got torch.float8_e4m3fn; FP8 attention is "
                  r"cudnn_sdpa_provider.fp8"),
    "h_q_not_divisible": (_case((Q4, rnd(2, 3, 6, 8), rnd(2, 3, 6, 8))), ValueError,
                          r"H_q=4 must be a multiple of H_k=3 and H_v=3"),
    "h_v_not_divisible": (_case((Q4, KV4, rnd(2, 3, 6, 8))), ValueError, r"H_q=4 must be a multiple of .*H_v=3"),
    "head_dim_mismatch": (_case((Q4, rnd(2, 2, 6, 16), KV4)), ValueError, r"q and k head dims differ: 8 vs 16"),
    "batch_mismatch": (_case((Q4, rnd(1, 2, 6, 8), rnd(1, 2, 6, 8))), ValueError, r"batch/sequence sizes disagree"),
    "kv_len_mismatch": (_case((Q4, KV4, rnd(2, 2, 5, 8))), ValueError, r"batch/sequence sizes disagree"),
    "sinks_shape": (_case(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \(H_q,\) = \(4,\), got \(2,\)"),
    "sinks_dtype": (_case(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, r"sinks must be floating point"),
    "sinks_not_tensor": (_case(sinks=[0.0] * 4), TypeError, r"sinks must be a torch.Tensor"),
    "seq_lens_shape": (_case(seq_lens_q=torch.tensor([3]), seq_lens_kv=torch.tensor([3])), ValueError,
                       r"seq_lens_q must have shape \(2,\) \(one length per batch row\), got \(1,\)"),
    "seq_lens_2d": (_case(seq_lens_q=torch.tensor([[3, 3]]), seq_lens_kv=torch.tensor([3, 3])), ValueError,
                    r"seq_lens_q must have shape \(2,\)"),
    "seq_lens_dtype": (_case(seq_lens_q=torch.tensor([3.0, 3.0]), seq_lens_kv=torch.tensor([3, 3])), TypeError,
                       r"seq_lens_q must be int32 or int64, got torch.float32"),
    "seq_lens_kv_dtype": (_case(seq_lens_q=torch.tensor([3, 3]), seq_lens_kv=torch.tensor([3, 3], dtype=torch.int16)),
                          TypeError, r"seq_lens_kv must be int32 or int64"),
    "only_seq_lens_q": (_case(seq_lens_q=torch.tensor([3, 3])), ValueError,
                        r"pass both seq_lens_q and seq_lens_kv \(padded batches\), or neither"),
    "only_seq_lens_kv": (_case(seq_lens_kv=torch.tensor([3, 3])), ValueError, r"pass both seq_lens_q and seq_lens_kv"),
    "seq_lens_with_packed": (_case((P3, P3, P3), seq_lens_q=torch.tensor([2, 4]), **PACKED), ValueError,
                             r"seq_lens_q/seq_lens_kv are for padded dense inputs"),
    "cu_dtype": (_case((P3, P3, P3), cu_seqlens_q=CU.float(), max_seqlen_q=4, max_seqlen_kv=4), TypeError,
                 r"cu_seqlens_q must be int32 or int64, got torch.float32"),
    "cu_shape_2d": (_case((P3, P3, P3), cu_seqlens_q=CU.view(1, 3), max_seqlen_q=4, max_seqlen_kv=4), ValueError,
                    r"cu_seqlens_q must be 1-D prefix sums of shape \(B\+1,\) with B >= 1, got \(1, 3\)"),
    "cu_too_short": (_case((P3, P3, P3), cu_seqlens_q=CU[:1], max_seqlen_q=4, max_seqlen_kv=4), ValueError,
                     r"cu_seqlens_q must be 1-D prefix sums"),
    "cu_kv_dtype": (_case((P3, P3, P3), cu_seqlens_kv=CU.double(), **PACKED), TypeError,
                    r"cu_seqlens_kv must be int32 or int64"),
    "cu_kv_shape": (_case((P3, P3, P3), cu_seqlens_kv=torch.tensor([0, 6], dtype=torch.int32), **PACKED), ValueError,
                    r"cu_seqlens_q and cu_seqlens_kv must have the same shape \(one entry per sequence, plus one\), "
                    r"got \(3,\) and \(2,\)"),
    "cu_not_tensor": (_case((P3, P3, P3), cu_seqlens_q=[0, 2, 6], max_seqlen_q=4, max_seqlen_kv=4), TypeError,
                      r"cu_seqlens_q must be a torch.Tensor"),
    "missing_max_seqlen_q": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_kv=4), ValueError,
                             r"max_seqlen_q must be an integer >= 1 .*got None"),
    "missing_max_seqlen_kv": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_q=4), ValueError,
                              r"max_seqlen_kv must be an integer >= 1 .*got None"),
    "max_seqlen_zero": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_q=0, max_seqlen_kv=4), ValueError,
                        r"max_seqlen_q must be an integer >= 1 \(the longest sequence; .*got 0"),
    "max_seqlen_tensor": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_q=torch.tensor(4), max_seqlen_kv=4),
                          TypeError, r"max_seqlen_q must be an integer >= 1 \(the longest sequence; it is never read"),
    "packed_kv_tokens": (_case((P3, P3, rnd(5, 4, 8)), **PACKED), ValueError,
                         r"k and v must have the same number of tokens, got 6 and 5"),
    "max_seqlen_without_cu": (_case(max_seqlen_q=4), ValueError, r"max_seqlen_kv are for packed inputs; pass "
                                                                 r"cu_seqlens_q too"),
    "cu_kv_without_cu_q": (_case(cu_seqlens_kv=CU), ValueError, r"pass cu_seqlens_q too"),
    "window_not_pair": (_case(window=3), ValueError, r"window must be a pair \(left, right\) of integers >= -1, got 3"),
    "window_bound": (_case(window=(-3, 0)), ValueError, r"window left bound must be an integer >= -1 \(-1 = unbounded\), got -3"),
    "window_float": (_case(window=(1, 0.5)), TypeError, r"window right bound must be an integer >= -1 .*got float 0.5"),
    "window_causal_conflict": (_case(is_causal=True, window=(2, 2)), ValueError,
                               r"is_causal=True conflicts with window right bound 2"),
    "is_causal_not_bool": (_case(is_causal=1), TypeError, r"is_causal must be a bool, got int"),
    "scale_nan": (_case(scale=float("nan")), ValueError, r"scale must be a finite real number or None, got nan"),
    "scale_inf": (_case(scale=float("inf")), ValueError, r"scale must be a finite real number or None, got inf"),
    "scale_str": (_case(scale="0.5"), TypeError, r"scale must be a finite real number or None, got str '0.5'"),
    "scale_bool": (_case(scale=True), TypeError, r"scale must be a finite real number or None, got bool True"),
    "scale_tensor": (_case(scale=torch.tensor(0.5)), TypeError, r"scale must be a finite real number or None, got Tensor"),
    "bottom_right_not_bool": (_case(bottom_right=1), TypeError, r"bottom_right must be a bool, got int"),
    "bottom_right_none": (_case(bottom_right=None), TypeError, r"bottom_right must be a bool, got NoneType"),
    "dropout_p_range": (_case(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
    "dropout_p_negative": (_case(dropout_p=-0.1), ValueError, r"dropout_p must be a float in \[0, 1\)"),
    "dropout_p_packed": (_case((P3, P3, P3), dropout_p=0.1, **PACKED), ValueError,
                         r"dropout_p is not supported with packed \(cu_seqlens\) inputs"),
    "return_lse_not_bool": (_case(return_lse="x"), TypeError, r"return_lse must be a bool, got str"),
    "validate_not_bool": (_case(validate="yes"), TypeError, r"validate must be None \(check values where it is free"),
    # values inside tensors: checked on CPU tensors (free), and on the GPU with validate=True
    "cu_past_the_tokens": (_case((P3, P3, P3), cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32),
                                 max_seqlen_q=5, max_seqlen_kv=5), ValueError,
                           r"cu_seqlens_q\[-1\] = 7 runs past the 6 packed tokens"),
    "cu_decreasing": (_case((P3, P3, P3), cu_seqlens_q=torch.tensor([0, 4, 2], dtype=torch.int32),
                            max_seqlen_q=4, max_seqlen_kv=4), ValueError,
                      r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 4"),
    "cu_nonzero_start": (_case((P3, P3, P3), cu_seqlens_q=torch.tensor([1, 2, 6], dtype=torch.int32),
                               max_seqlen_q=4, max_seqlen_kv=4), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    "max_seqlen_too_small": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_q=3, max_seqlen_kv=4), ValueError,
                             r"sequence 1 has 4 tokens .* but max_seqlen_q = 3"),
    "max_seqlen_kv_too_small": (_case((P3, P3, P3), cu_seqlens_q=CU, max_seqlen_q=4, max_seqlen_kv=3), ValueError,
                                r"but max_seqlen_kv = 3"),
    "cu_kv_past_the_tokens": (_case((P3, P3, P3), cu_seqlens_kv=torch.tensor([0, 4, 9], dtype=torch.int32),
                                    cu_seqlens_q=CU, max_seqlen_q=4, max_seqlen_kv=5), ValueError, r"cu_seqlens_kv\[-1\] = 9 runs past the 6 packed tokens"),
    "seq_lens_negative": (_case(seq_lens_q=torch.tensor([3, -1]), seq_lens_kv=torch.tensor([3, 3])), ValueError,
                          r"seq_lens_q\[1\] = -1 is outside \[0, S_q = 6\]"),
    "seq_lens_longer_than_s": (_case(seq_lens_q=torch.tensor([3, 3]), seq_lens_kv=torch.tensor([3, 9])), ValueError,
                               r"seq_lens_kv\[1\] = 9 is outside \[0, S_kv = 6\]"),
}


@pytest.mark.parametrize("case, exc, match", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise_naming_the_argument(case, exc, match):
    (q, k, v), kw = case
    before = counters.stats()
    with pytest.raises(exc, match=match):
        csp.attention(q, k, v, **kw)
    assert (counters.stats() - before).to_dict() == counters.Stats().to_dict(), "nothing ran, nothing counted"


MIXED = {
    "k_on_meta": (dict(k=KV4.to("meta")), r"k is on meta but q is on cpu; all inputs must share a device"),
    "v_on_meta": (dict(v=KV4.to("meta")), r"v is on meta but q is on cpu"),
    "sinks_on_meta": (dict(sinks=torch.zeros(4, device="meta")), r"sinks is on meta but q is on cpu"),
    "seq_lens_on_meta": (dict(seq_lens_q=torch.tensor([3, 3], device="meta"), seq_lens_kv=torch.tensor([3, 3])),
                         r"seq_lens_q is on meta but q is on cpu"),
}


@pytest.mark.parametrize("kw, match", MIXED.values(), ids=MIXED.keys())
def test_mixed_devices_raise(kw, match):
    # A CPU-only machine has a second device after all: "meta".
    kw = dict(kw)
    k, v = kw.pop("k", KV4), kw.pop("v", KV4)
    with pytest.raises(ValueError, match=match):
        csp.attention(Q4, k, v, **kw)


def test_mixed_devices_packed():
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on meta but q is on cpu"):
        csp.attention(P3, P3, P3, cu_seqlens_q=CU.to("meta"), max_seqlen_q=4, max_seqlen_kv=4)


# ------------------------------------------------------------------------------------ explain


def test_explain_on_cpu_enabled_and_direct():
    q, k, v = dense(requires_grad=False)
    with csp.enable():
        through = csp.explain(q, k, v)
    direct = csp.explain(q, k, v, through_sdpa=False)
    for result in (through, direct):
        assert list(result) == ["dense_fwd", "dense_bwd"]
        for found in result.values():
            assert [r.slug for r in found] == ["no_cuda"]
            assert isinstance(found[0], csp.Reason) and found[0].message == "inputs are on 'cpu'"


def test_explain_not_enabled_comes_first():
    assert not csp.enabled()
    q, k, v = dense(requires_grad=False)
    result = csp.explain(q, k, v, is_causal=True, dropout_p=0.1)
    for found in result.values():
        assert [r.slug for r in found] == ["not_enabled", "no_cuda"]
        assert "csp.enable()" in found[0].message and "CUDNN_SDPA_PROVIDER=1" in found[0].message


def test_explain_packed():
    with csp.enable():
        result = csp.explain(P3, P3, P3, cu_seqlens_q=CU, max_seqlen_q=4, max_seqlen_kv=4)
    assert {p: [r.slug for r in found] for p, found in result.items()} == {"varlen_fwd": ["no_cuda"],
                                                                          "varlen_bwd": ["no_cuda"]}
    with pytest.raises(ValueError, match="needs max_seqlen_q and max_seqlen_kv"):
        csp.explain(P3, P3, P3, cu_seqlens_q=CU)


def test_explain_validates_the_window():
    with pytest.raises(ValueError, match="window"):
        csp.explain(Q4, KV4, KV4, window=(-5, 0))


def test_explain_rejects_wrong_rank_naming_the_argument():
    with pytest.raises(ValueError, match="q must be 4-D"):
        csp.explain(P3, P3, P3)


def test_explain_answers_for_a_described_gpu():
    """On a CPU machine: what would an H200 with cuDNN 9.12 / 9.19 / 9.26 do (meta tensors work)?"""
    q = torch.empty(2, 8, 512, 128, dtype=torch.bfloat16, device="meta")
    sinks = torch.zeros(8, device="meta")
    slugs = lambda result: {p: [r.slug for r in found] for p, found in result.items()}  # noqa: E731
    h200 = {"compute_capability": (9, 0), "cudnn_version": "9.19.0"}
    assert slugs(csp.explain(q, q, q, is_causal=True, device=h200, through_sdpa=False)) == {
        "dense_fwd": [], "dense_bwd": []}
    old = dict(h200, cudnn_version=91200)
    assert slugs(csp.explain(q, q, q, sinks=sinks, device=old, through_sdpa=False))["dense_fwd"] == ["cudnn_feature"]
    packed = torch.empty(100, 8, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="meta")
    result = csp.explain(packed, packed, packed, sinks=sinks, cu_seqlens_q=cu, max_seqlen_q=60, max_seqlen_kv=60,
                         device=h200, through_sdpa=False)
    assert slugs(result) == {"varlen_fwd": [], "varlen_bwd": ["sink_backward_ragged"]}
    assert slugs(csp.explain(packed, packed, packed, sinks=sinks, cu_seqlens_q=cu, max_seqlen_q=60,
                             max_seqlen_kv=60, device=dict(h200, cudnn_version="9.26.0"),
                             through_sdpa=False))["varlen_bwd"] == []
    assert slugs(csp.explain(q, q, q, device={"compute_capability": (7, 5)}, through_sdpa=False))["dense_fwd"] == [
        "compute_capability"]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dropout_p=2.0), ValueError, r"dropout_p must be a float in \[0, 1\), got 2.0"),
    (dict(scale=float("nan")), ValueError, r"scale must be a finite real number or None"),
    (dict(device="H200"), TypeError, r"device must be a support.Capabilities or a dict"),
    (dict(device={"compute_capability": 9}), ValueError, r"device\['compute_capability'\] must be a pair"),
    (dict(device={"compute_capability": (9, 0), "cudnn": 1}), ValueError, r"device has unknown keys \['cudnn'\]"),
    (dict(device={"compute_capability": (9, 0), "cudnn_version": "9.x"}), ValueError, r"cudnn_version"),
    (dict(bottom_right="no"), TypeError, r"bottom_right must be a bool"),
])
def test_explain_bad_arguments_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=match):
        csp.explain(Q4, KV4, KV4, **kw)


def test_explain_takes_attentions_keywords():
    q, k, v = dense(requires_grad=False)
    lens = torch.tensor([3, 4])
    result = csp.explain(q, k, v, scale=0.5, seq_lens_q=lens, seq_lens_kv=lens, through_sdpa=False)
    assert [r.slug for r in result["dense_fwd"]] == ["no_cuda"]


def test_explain_runs_nothing():
    q, k, v = dense(requires_grad=False)
    _, counted = region(lambda: csp.explain(q, k, v))
    assert counted == {}


# ---------------------------------------------------- eager Functions and the custom ops agree


class _Subclass(torch.Tensor):
    """A trivial tensor subclass: such inputs must see the custom ops (their fake kernels)."""


def _both_paths(monkeypatch, fn):
    """``fn()`` through the eager Functions, then again with ``ops.eager`` forced off."""
    from cudnn_sdpa_provider.ops import dense_varlen as ops

    eager = fn()
    monkeypatch.setattr(ops, "eager", lambda *tensors: False)
    return eager, fn()


def test_eager_functions_equal_the_custom_ops_dense(monkeypatch):
    q, k, v = dense()
    sinks = rnd(4, seed=9, requires_grad=True)
    go = rnd(2, 4, 6, 8, seed=4)

    def run():
        for t in (q, k, v, sinks):
            t.grad = None
        def step():
            out = csp.attention(q, k, v, sinks=sinks, window=(3, 1))
            out.backward(go)
            return out

        out, counted = region(step)
        return out.detach(), [t.grad for t in (q, k, v, sinks)], counted, type(out.grad_fn).__name__

    (out_e, grads_e, counted_e, fn_e), (out_c, grads_c, counted_c, fn_c) = _both_paths(monkeypatch, run)
    assert fn_e == "DenseFunctionBackward" and fn_c != fn_e
    assert counted_e == counted_c == {"dense_fwd": {"no_cuda": 1}, "dense_bwd": {"no_cuda": 1}}
    assert torch.equal(out_e, out_c)
    for a, b in zip(grads_e, grads_c):
        assert a is not None and torch.equal(a, b)


def test_eager_functions_equal_the_custom_ops_varlen(monkeypatch):
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    q, k, v = (rnd(11, 4, 8, seed=s, requires_grad=True) for s in (1, 2, 3))
    go = rnd(11, 4, 8, seed=4)

    def run():
        for t in (q, k, v):
            t.grad = None
        def step():
            out = csp.attention(q, k, v, cu_seqlens_q=cu, max_seqlen_q=7, max_seqlen_kv=7, is_causal=True)
            out.backward(go)
            return out

        out, counted = region(step)
        return out.detach(), [t.grad for t in (q, k, v)], counted, type(out.grad_fn).__name__

    (out_e, grads_e, counted_e, fn_e), (out_c, grads_c, counted_c, fn_c) = _both_paths(monkeypatch, run)
    assert fn_e == "VarlenFunctionBackward" and fn_c != fn_e
    assert counted_e == counted_c == {"varlen_fwd": {"no_cuda": 1}, "varlen_bwd": {"no_cuda": 1}}
    assert torch.equal(out_e, out_c)
    for a, b in zip(grads_e, grads_c):
        assert torch.equal(a, b)


def test_eager_only_for_plain_tensors_outside_tracing():
    from torch.utils._python_dispatch import TorchDispatchMode

    from cudnn_sdpa_provider.ops import dense_varlen as ops

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 4, 8)
    assert ops.eager(q, None, q, torch.nn.Parameter(torch.zeros(2)))
    assert not ops.eager(q, q.as_subclass(_Subclass))
    assert not ops.eager(q.to("meta"))
    meta = torch.empty(1, 2, 4, 8, device="meta")
    assert csp.attention(meta, meta, meta).shape == (1, 2, 4, 8)  # the fake kernel, through the custom op
    with Mode():
        assert not ops.eager(q)
    assert torch.func.vmap(lambda x: torch.tensor(ops.eager(x)))(q).all().item() is False


@pytest.mark.parametrize("custom_op", [False, True], ids=["eager", "custom_op"])
def test_lse_carries_no_gradient(monkeypatch, custom_op):
    from cudnn_sdpa_provider.ops import dense_varlen as ops

    if custom_op:
        monkeypatch.setattr(ops, "eager", lambda *tensors: False)
    q, k, v = dense()
    out, lse = csp.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad  # a loss on the LSE alone raises, never a silent 0
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()


def test_eager_backward_is_once_differentiable():
    q, k, v = dense()
    out = csp.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)  # grad_out depends on q
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_compiled_dynamic_fullgraph_takes_the_number_checks():
    # torch.compile(dynamic=True) can trace the float arguments as SymFloats; the argument checks
    # (arguments.real) must not break the graph on them (GPU run 51 on torch 2.11 found
    # math.isfinite doing so)
    torch._dynamo.reset()

    def f(q, k, v, sinks):
        return csp.attention(q, k, v, window=(31, 0), sinks=sinks).float().square().mean()

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    sinks = torch.zeros(4, requires_grad=True)
    for b in (2, 3):
        q = torch.randn(b, 4, 16, 8).requires_grad_()
        compiled(q, q, q, sinks).backward()
        assert torch.isfinite(q.grad).all()


def test_compiled_call_sees_the_custom_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    q, k, v = dense()
    compiled = torch.compile(lambda q, k, v: csp.attention(q, k, v, is_causal=True), backend=counter, fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    want = csp.attention(*(t.detach() for t in (q, k, v)), is_causal=True)
    assert torch.equal(out.detach(), want)
    assert counter.frame_count == 1
    graph_ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("cudnn_sdpa.dense_fwd" in name for name in graph_ops), graph_ops
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("how", ["plain", "no_grad", "inference_mode"])
def test_a_call_that_needs_no_gradient_runs_without_autograd(monkeypatch, packed, how):
    """Where no input needs a gradient (inputs without requires_grad, or grad mode off), the eager
    path calls the forward kernel itself (``DenseFunction.no_grad``), not ``apply``: the same
    answer and count as the custom op's, and no graph. With a gradient needed, ``apply`` runs."""
    from cudnn_sdpa_provider.ops import dense_varlen as ops

    function = ops.VarlenFunction if packed else ops.DenseFunction
    needs_grad = how != "plain"  # under no_grad / inference_mode even requires_grad inputs need none
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    if packed:
        q, k, v = (rnd(11, 4, 8, seed=s, requires_grad=needs_grad) for s in (1, 2, 3))
        opts = dict(cu_seqlens_q=cu, max_seqlen_q=7, max_seqlen_kv=7, is_causal=True)
    else:
        q, k, v = dense(requires_grad=needs_grad)
        opts = dict(window=(3, 1))
    mode = {"plain": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[how]

    def run():
        with mode():
            return region(lambda: csp.attention(q, k, v, **opts))

    def refused(*args):
        raise AssertionError("apply ran for a call that needs no gradient")

    monkeypatch.setattr(function, "apply", refused)
    with pytest.raises(AssertionError, match="apply ran"):  # a gradient needed: autograd's apply
        csp.attention(q.detach().requires_grad_(), k.detach(), v.detach(), **opts)
    (out, counted), (want, counted_op) = _both_paths(monkeypatch, run)
    path = "varlen_fwd" if packed else "dense_fwd"
    assert counted == counted_op == {path: {"no_cuda": 1}}
    assert out.grad_fn is None and not out.requires_grad and torch.equal(out, want)


def test_the_host_cost_script_serves_both_paths():
    """scripts/functional_host_cpu.py (results/cpu-functional-host.txt) runs both paths to the
    engine on the stand-in cuDNN in a child process: it fails if either falls back or errors."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "scripts" / "functional_host_cpu.py"), "--rounds", "1",
                           "--calls", "3"], capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "csp.attention (the integration)" in done.stdout and "F.sdpa override" in done.stdout, done.stdout


# torch's make_dual loads its jvp decompositions through torch.jit.script, which warns (Deprecation- or
# FutureWarning by release) inside torch itself
@pytest.mark.filterwarnings("ignore:.*torch.jit.script")
@pytest.mark.parametrize("packed", [False, True])
def test_a_dual_input_under_forward_ad_is_refused_never_dropped(packed):
    """Forward-mode AD: a dual input needs no gradient in the reverse-mode sense, but its tangent must
    not be dropped by the forward kernel alone (``no_grad``): the call goes through ``apply``, which
    has no jvp and says so (NotImplementedError), as it did before the no-gradient path."""
    import torch.autograd.forward_ad as fwAD

    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    with fwAD.dual_level():
        if packed:
            q, k, v = (rnd(11, 4, 8, seed=s) for s in (1, 2, 3))
            opts = dict(cu_seqlens_q=cu, max_seqlen_q=7, max_seqlen_kv=7)
        else:
            q, k, v = dense(requires_grad=False)
            opts = {}
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            csp.attention(dual, k, v, **opts)
