"""CPU tier: the aten-op reference (the composite fallback and the tests' oracle), in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cudnn_sdpa_provider.ops import reference
from tests.util import assert_rel_close

F64 = dict(compute_dtype=torch.float64)
TOL = 1e-10


def rnd(*shape, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)


def qkv(b=2, h_q=4, h_kv=4, s_q=9, s_kv=9, d_qk=8, d_v=8, seed=0):
    return rnd(b, h_q, s_q, d_qk, seed=seed), rnd(b, h_kv, s_kv, d_qk, seed=seed + 1), rnd(b, h_kv, s_kv, d_v,
                                                                                             seed=seed + 2)


def explicit_mask(s_q, s_kv, left, right, offset=0):
    """Keys i+offset-left .. i+offset+right are visible (-1: unbounded)."""
    i = torch.arange(s_q).view(-1, 1) + offset
    j = torch.arange(s_kv).view(1, -1)
    allowed = torch.ones(s_q, s_kv, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


# ------------------------------------------------------------------------------- vs F.sdpa


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_sdpa(causal):
    q, k, v = qkv(d_v=12)
    out, lse = reference.dense(q, k, v, scale=0.3, window=(-1, 0) if causal else (-1, -1), **F64)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    assert_rel_close(out, want, TOL, "out")
    scores = (q @ k.transpose(-1, -2)) * 0.3
    if causal:
        scores = scores.masked_fill(~explicit_mask(9, 9, -1, 0), float("-inf"))
    assert_rel_close(lse, torch.logsumexp(scores, -1, keepdim=True), TOL, "lse")


def test_gqa_matches_sdpa_enable_gqa():
    q, k, v = qkv(h_q=6, h_kv=2)
    out, _ = reference.dense(q, k, v, scale=1 / math.sqrt(8), window=(-1, 0), **F64)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_rel_close(out, want, TOL, "out")


@pytest.mark.parametrize("s_q, s_kv", [(4, 9), (9, 9), (1, 7)])
def test_bottom_right_causal_matches_explicit_mask(s_q, s_kv):
    q, k, v = qkv(s_q=s_q, s_kv=s_kv)
    out, _ = reference.dense(q, k, v, scale=0.5, window=(-1, 0), bottom_right=True, **F64)
    mask = explicit_mask(s_q, s_kv, -1, 0, offset=s_kv - s_q)
    assert_rel_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5), TOL, "out")
    top_left, _ = reference.dense(q, k, v, scale=0.5, window=(-1, 0), **F64)
    assert s_q == s_kv or not torch.allclose(out, top_left), "alignment matters when S_q != S_kv"


@given(s_q=st.integers(1, 10), s_kv=st.integers(1, 10), left=st.integers(-1, 10), right=st.integers(-1, 10),
       bottom_right=st.booleans())
def test_windows_match_explicit_boolean_mask(s_q, s_kv, left, right, bottom_right):
    q, k, v = qkv(b=1, h_q=2, h_kv=2, s_q=s_q, s_kv=s_kv, d_qk=4, d_v=4)
    out, lse = reference.dense(q, k, v, scale=0.5, window=(left, right), bottom_right=bottom_right, **F64)
    mask = explicit_mask(s_q, s_kv, left, right, offset=(s_kv - s_q) if bottom_right else 0)
    assert torch.equal(reference.allowed_mask(s_q, s_kv, (left, right), bottom_right)[0, 0], mask)
    empty = ~mask.any(-1)  # rows that see no key: out 0, lse -inf (F.sdpa gives NaN there)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5).masked_fill(empty.view(-1, 1), 0.0)
    assert_rel_close(out, want, TOL, "out")
    assert torch.all(lse[..., empty, :] == float("-inf"))
    assert torch.isfinite(lse[..., ~empty, :]).all()


def test_fully_masked_rows_are_zero():
    q, k, v = qkv(s_q=6, s_kv=3)
    out, lse = reference.dense(q, k, v, scale=1.0, window=(-1, 0), bottom_right=True, **F64)
    # bottom-right with S_q > S_kv: the first S_q - S_kv queries see nothing
    assert torch.all(out[:, :, :3] == 0) and torch.all(lse[:, :, :3] == float("-inf"))
    assert torch.all(out[:, :, 3:] != 0)


# ------------------------------------------------------------------------------------ sinks


def test_sinks_are_an_extra_softmax_column():
    q, k, v = qkv(h_q=4, h_kv=2, d_v=6)
    sinks = rnd(4, seed=7)
    out, lse = reference.dense(q, k, v, scale=0.4, sinks=sinks, **F64)
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ ke.transpose(-1, -2) * 0.4
    full = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 9, 1)], dim=-1)
    probs = torch.softmax(full, dim=-1)
    assert_rel_close(out, probs[..., :-1] @ ve, TOL, "out")
    assert_rel_close(lse, torch.logsumexp(full, -1, keepdim=True), TOL, "lse")


def test_a_sink_alone_gives_zero_output_and_finite_lse():
    q, k, v = qkv(s_q=4, s_kv=2)
    sinks = rnd(4, seed=3)
    out, lse = reference.dense(q, k, v, scale=1.0, window=(-1, 0), bottom_right=True, sinks=sinks, **F64)
    assert torch.all(out[:, :, :2] == 0)
    assert_rel_close(lse[:, :, :2], sinks.view(1, 4, 1, 1).expand(2, 4, 2, 1), TOL, "lse of the sink alone")


# --------------------------------------------------------------------------- closed-form backward

BACKWARD_CASES = {
    "full": dict(),
    "causal_gqa": dict(h_q=4, h_kv=2, window=(-1, 0)),
    "mqa_dv": dict(h_q=4, h_kv=1, d_v=5),
    "window_bottom_right": dict(s_q=5, s_kv=9, window=(2, 1), bottom_right=True),
    "sinks": dict(sinks=True),
    "bias": dict(bias=True),
    "padded": dict(padded=True),
    "padded_sinks_window": dict(padded=True, sinks=True, window=(3, 0)),
}


@pytest.mark.parametrize("case", BACKWARD_CASES.values(), ids=BACKWARD_CASES.keys())
def test_dense_backward_matches_autograd(case):
    case = dict(case)
    window, bottom_right = case.pop("window", (-1, -1)), case.pop("bottom_right", False)
    use_sinks, use_bias, padded = case.pop("sinks", False), case.pop("bias", False), case.pop("padded", False)
    q, k, v = (t.requires_grad_() for t in qkv(**case))
    b, h_q, s_q, _ = q.shape
    s_kv = k.shape[2]
    sinks = rnd(h_q, seed=5, requires_grad=True) if use_sinks else None
    bias = rnd(1, h_q, s_q, s_kv, seed=6) if use_bias else None
    lens = dict(seq_len_q=torch.tensor([s_q, s_q - 2], dtype=torch.int32),
                seq_len_kv=torch.tensor([s_kv - 4, s_kv], dtype=torch.int32)) if padded else {}
    kw = dict(scale=0.35, window=window, bottom_right=bottom_right, sinks=sinks, bias=bias, **lens, **F64)
    go = rnd(b, h_q, s_q, v.shape[3], seed=9)
    out, _ = reference.dense(q, k, v, **kw)
    out.backward(go)
    dq, dk, dv, dsinks = reference.dense_backward(go, q.detach(), k.detach(), v.detach(), **kw)
    for got, t, name in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv")):
        assert_rel_close(got, t.grad, 1e-9, name)
    if use_sinks:
        assert_rel_close(dsinks, sinks.grad, 1e-9, "dsinks")
    else:
        assert dsinks is None
    if padded:
        assert torch.all(out[1, :, s_q - 2:] == 0), "padded query rows are 0"
        assert torch.all(dq[1, :, s_q - 2:] == 0) and torch.all(dk[0, :, s_kv - 4:] == 0)
        assert torch.all(dv[0, :, s_kv - 4:] == 0)


def test_dense_backward_with_dropout_mask_matches_autograd():
    q, k, v = (t.requires_grad_() for t in qkv())
    keep = torch.rand(2, 4, 9, 9, generator=torch.Generator().manual_seed(3)) >= 0.3
    kw = dict(scale=0.35, dropout_mask=keep, dropout_p=0.3, **F64)
    go = rnd(2, 4, 9, 8, seed=9)
    out, _ = reference.dense(q, k, v, **kw)
    out.backward(go)
    grads = reference.dense_backward(go, q.detach(), k.detach(), v.detach(), **kw)
    for got, t, name in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        assert_rel_close(got, t.grad, 1e-9, name)


# ---------------------------------------------------------------------------------- varlen

CU = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # includes an empty sequence
CU_KV = torch.tensor([0, 4, 6, 7], dtype=torch.int32)


def test_pad_unpad_round_trip():
    x = rnd(10, 3, 4)  # 2 tokens past cu[-1] = 8
    padded = reference.pad_packed(x, CU, 5)
    assert padded.shape == (3, 3, 5, 4)
    assert torch.equal(padded[0, :, :3], x[0:3].transpose(0, 1))
    assert torch.all(padded[1] == 0), "an empty sequence pads to zeros"
    assert torch.equal(padded[2, :, :5], x[3:8].transpose(0, 1))
    assert torch.all(padded[0, :, 3:] == 0)
    back = reference.unpad(padded, CU, 10)
    assert torch.equal(back[:8], x[:8])
    assert torch.all(back[8:] == 0), "tokens past cu[-1] come back as 0"


def test_varlen_matches_per_sequence_dense():
    q, k, v = rnd(8, 4, 8), rnd(7, 2, 8, seed=1), rnd(7, 2, 6, seed=2)
    sinks = rnd(4, seed=3)
    out, lse = reference.varlen(q, k, v, CU, CU_KV, 5, 4, scale=0.5, window=(-1, 0), bottom_right=True, sinks=sinks,
                                **F64)
    assert out.shape == (8, 4, 6) and lse.shape == (8, 4)
    for i in range(3):
        a, b, c, d = CU[i].item(), CU[i + 1].item(), CU_KV[i].item(), CU_KV[i + 1].item()
        if a == b:
            continue
        one = lambda t, lo, hi: t[lo:hi].transpose(0, 1).unsqueeze(0)  # noqa: E731
        want, want_lse = reference.dense(one(q, a, b), one(k, c, d), one(v, c, d), scale=0.5, window=(-1, 0),
                                         bottom_right=True, sinks=sinks, **F64)
        assert_rel_close(out[a:b], want[0].transpose(0, 1), TOL, f"seq {i}")
        assert_rel_close(lse[a:b], want_lse[0, :, :, 0].transpose(0, 1), TOL, f"lse {i}")


@pytest.mark.parametrize("sinks", [False, True])
def test_varlen_backward_matches_autograd(sinks):
    q, k, v = rnd(10, 4, 8, requires_grad=True), rnd(9, 2, 8, seed=1, requires_grad=True), rnd(9, 2, 8, seed=2,
                                                                                                requires_grad=True)
    s = rnd(4, seed=3, requires_grad=True) if sinks else None
    kw = dict(scale=0.5, window=(2, 0), bottom_right=True, sinks=s, **F64)
    go = rnd(10, 4, 8, seed=4)
    out, _ = reference.varlen(q, k, v, CU, CU_KV, 5, 4, **kw)
    out.backward(go)
    dq, dk, dv, ds = reference.varlen_backward(go, q.detach(), k.detach(), v.detach(), CU, CU_KV, 5, 4, **kw)
    for got, t, name in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv")):
        assert_rel_close(got, t.grad, 1e-9, name)
    assert torch.all(dq[8:] == 0) and torch.all(dk[7:] == 0) and torch.all(out[8:] == 0)
    if sinks:
        assert_rel_close(ds, s.grad, 1e-9, "dsinks")
