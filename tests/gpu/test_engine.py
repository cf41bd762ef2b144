"""GPU tier: the cudnn_sdpa ops against an fp32 reference (Engine issue, features 1-10)."""

from __future__ import annotations

import math

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, layout
from cudnn_sdpa_provider.engine import dense, graphs, machine
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.core.errors import NotSupportedError
from tests.util import TOL, assert_rel_close, grad_tol, make_dense, poison_allocator

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _ref_dense(q, k, v, go, **kw):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    sinks = kw.pop("sinks", None)
    sink_leaf = sinks.detach().float().requires_grad_() if sinks is not None else None
    out, lse = reference.dense(*leaves, sinks=sink_leaf, **kw)
    out.backward(go.float())
    grads = [t.grad for t in leaves] + ([sink_leaf.grad] if sink_leaf is not None else [])
    return out, lse, grads


def _check_dense(dtype, b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, *, window=(-1, -1), bottom_right=False, sinks=False,
                 order="bhsd", seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = make_dense(b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, dtype, DEV, order=order, gen=gen)
    sink_t = (torch.randn(h_q, device=DEV, generator=gen) * 2).requires_grad_() if sinks else None
    go = torch.randn(b, h_q, s_q, d_v, device=DEV, generator=gen, dtype=dtype)
    scale = 1 / math.sqrt(d_qk)
    poison_allocator(DEV)
    before = counters.stats()
    out, lse = csp.attention(q, k, v, scale=scale, window=window, bottom_right=bottom_right, sinks=sink_t,
                             return_lse=True)
    out.backward(go)
    delta = counters.stats() - before
    assert delta.served["dense_fwd"] == 1 and delta.served["dense_bwd"] == 1, delta.to_dict()
    ref_out, ref_lse, grads = _ref_dense(q, k, v, go, scale=scale, window=window, bottom_right=bottom_right,
                                         sinks=sink_t)
    tol = TOL[dtype]
    assert_rel_close(out, ref_out, tol, "out")
    finite = torch.isfinite(ref_lse)
    assert_rel_close(lse[finite], ref_lse[finite], 1e-3, "lse")
    assert_rel_close(q.grad, grads[0], grad_tol(dtype), "dq")
    assert_rel_close(k.grad, grads[1], grad_tol(dtype, h_q // h_k), "dk")
    assert_rel_close(v.grad, grads[2], grad_tol(dtype, h_q // h_v), "dv")
    if sinks:
        assert_rel_close(sink_t.grad, grads[3], grad_tol(dtype), "dsinks")
    return q, k, v, out


DENSE_CASES = [
    # dtype, b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, window, bottom_right
    (torch.bfloat16, 2, 8, 8, 8, 256, 256, 64, 64, (-1, -1), False),
    (torch.float16, 2, 8, 8, 8, 256, 256, 64, 64, (-1, 0), False),
    (torch.bfloat16, 1, 8, 2, 2, 384, 384, 128, 128, (-1, 0), False),
    (torch.float16, 2, 8, 1, 1, 128, 320, 128, 128, (-1, -1), False),
    (torch.bfloat16, 2, 8, 4, 2, 200, 200, 64, 64, (-1, 0), False),
    (torch.bfloat16, 1, 4, 4, 4, 128, 128, 256, 256, (-1, 0), False),
    (torch.float16, 1, 4, 2, 2, 128, 128, 192, 128, (-1, 0), False),
    (torch.bfloat16, 2, 4, 4, 4, 96, 300, 64, 64, (-1, 0), True),
    (torch.bfloat16, 2, 4, 4, 4, 300, 300, 64, 64, (64, 0), False),
    (torch.float16, 2, 4, 2, 2, 300, 300, 64, 64, (32, 16), False),
    (torch.bfloat16, 1, 4, 4, 4, 128, 512, 64, 64, (48, 0), True),
    (torch.bfloat16, 1, 4, 4, 4, 512, 512, 128, 128, (0, 0), False),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_dense_fwd_bwd_matches_fp32_reference(case):
    dtype, b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, window, br = case
    _check_dense(dtype, b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, window=window, bottom_right=br)


@pytest.mark.parametrize("order", ["bhsd", "bshd", "sbhd", "hbsd"])
def test_layouts_follow_inputs(order):
    q, k, v, out = _check_dense(torch.bfloat16, 2, 4, 2, 2, 128, 160, 64, 64, window=(-1, 0), order=order)
    expected_out = layout.dense_out(q, tuple(out.shape))
    assert out.stride() == expected_out.stride(), "O must follow q's dimension order"
    for t in (q, k, v):
        assert t.grad.stride() == torch.empty_like(t).stride(), "dQ/dK/dV must follow their input's layout"


@pytest.mark.parametrize("kind", ["sliced_head_dim", "offset_base"])
def test_repaired_operands_give_right_numbers(kind):
    gen = torch.Generator(device=DEV).manual_seed(3)
    b, h, s, d = 2, 4, 130, 64
    if kind == "sliced_head_dim":
        base = [torch.randn(b, h, s, 2 * d, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
        q, k, v = (t[..., ::2] for t in base)
        assert q.stride(-1) == 2
    else:
        flat = [torch.randn(b * h * s * d + 1, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(3)]
        q, k, v = (t[1:].view(b, h, s, d) for t in flat)
        assert q.data_ptr() % 16 != 0
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # detach keeps strides and offset
    assert leaves[0].stride() == q.stride() and leaves[0].data_ptr() == q.data_ptr()
    go = torch.randn(b, h, s, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    before = counters.stats()
    out = csp.attention(*leaves, is_causal=True)
    out.backward(go)
    assert (counters.stats() - before).served["dense_fwd"] == 1
    ref_out, _, grads = _ref_dense(*leaves, go, scale=1 / math.sqrt(d), window=(-1, 0))
    assert_rel_close(out, ref_out, TOL[torch.bfloat16], "out")
    for name, t, g in zip("qkv", leaves, grads):
        assert_rel_close(t.grad, g, grad_tol(torch.bfloat16), f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gqa", [(4, 4), (4, 1)])
def test_sinks_forward_and_backward(dtype, gqa):
    h_q, h_k = gqa
    _check_dense(dtype, 2, h_q, h_k, h_k, 192, 192, 64, 64, window=(-1, 0), sinks=True, seed=5)
    _check_dense(dtype, 1, h_q, h_k, h_k, 160, 160, 64, 64, window=(63, 0), sinks=True, seed=6)


@pytest.mark.parametrize("bottom_right", [False, True])
def test_padded_dense_forward_backward_and_padding_contents(bottom_right):
    gen = torch.Generator(device=DEV).manual_seed(11)
    b, h, s_q, s_kv, d = 4, 4, 96, 128, 64
    q, k, v = make_dense(b, h, 2, 2, s_q, s_kv, d, d, torch.bfloat16, DEV, gen=gen)
    len_q = torch.tensor([96, 1, 40, 77], dtype=torch.int32, device=DEV)
    len_kv = torch.tensor([128, 5, 40, 100], dtype=torch.int32, device=DEV)
    go = torch.randn(b, h, s_q, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    poison_allocator(DEV)
    before = counters.stats()
    out = csp.attention(q, k, v, is_causal=True, bottom_right=bottom_right, seq_lens_q=len_q, seq_lens_kv=len_kv)
    out.backward(go)
    delta = counters.stats() - before
    assert delta.served["dense_fwd"] == 1 and delta.served["dense_bwd"] == 1, delta.to_dict()
    ref_out, _, grads = _ref_dense(q, k, v, go, scale=1 / math.sqrt(d), window=(-1, 0), bottom_right=bottom_right,
                                   seq_len_q=len_q, seq_len_kv=len_kv)
    assert_rel_close(out, ref_out, TOL[torch.bfloat16], "out")
    for name, t, g, group in (("dq", q, grads[0], 1), ("dk", k, grads[1], 2), ("dv", v, grads[2], 2)):
        assert_rel_close(t.grad, g, grad_tol(torch.bfloat16, group), name)
    for i in range(b):
        lq, lk = int(len_q[i]), int(len_kv[i])
        assert torch.count_nonzero(out[i, :, lq:]) == 0, "padded rows of O must be 0"
        assert torch.count_nonzero(q.grad[i, :, lq:]) == 0, "padded rows of dQ must be 0"
        assert torch.count_nonzero(k.grad[i, :, lk:]) == 0, "padded rows of dK must be 0"
        assert torch.count_nonzero(v.grad[i, :, lk:]) == 0, "padded rows of dV must be 0"


def _packed(lengths, h, d, dtype, gen, tail=0):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    total = int(cu[-1]) + tail
    t = torch.randn(total, h, d, device=DEV, generator=gen, dtype=torch.float32).to(dtype)
    return t, cu.to(DEV)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0), (8, 8)])
@pytest.mark.parametrize("gqa", [(8, 8), (8, 2)])
def test_varlen_forward_backward(window, gqa):
    gen = torch.Generator(device=DEV).manual_seed(21)
    h_q, h_k = gqa
    lens_q = [1, 17, 200, 64, 3, 128]
    lens_kv = [1, 40, 200, 70, 3, 100]
    q, cu_q = _packed(lens_q, h_q, 64, torch.bfloat16, gen, tail=5)
    k, cu_kv = _packed(lens_kv, h_k, 64, torch.bfloat16, gen)
    v, _ = _packed(lens_kv, h_k, 64, torch.bfloat16, gen)
    for t in (q, k, v):
        t.requires_grad_()
    go = torch.randn(q.shape, device=DEV, generator=gen, dtype=torch.bfloat16)
    poison_allocator(DEV)
    before = counters.stats()
    out, lse = csp.attention(q, k, v, window=window, bottom_right=True, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                             max_seqlen_q=200, max_seqlen_kv=200, return_lse=True)
    out.backward(go)
    delta = counters.stats() - before
    assert delta.served["varlen_fwd"] == 1 and delta.served["varlen_bwd"] == 1, delta.to_dict()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.varlen(*leaves, cu_q, cu_kv, 200, 200, scale=1 / 8, window=window, bottom_right=True)
    ref_out.backward(go.float())
    assert_rel_close(out, ref_out, TOL[torch.bfloat16], "out")
    valid = torch.isfinite(ref_lse)
    assert_rel_close(lse[valid], ref_lse[valid], 1e-3, "lse")
    assert lse.shape == (q.shape[0], h_q) and lse.is_contiguous()
    for name, t, ref, group in (("dq", q, leaves[0], 1), ("dk", k, leaves[1], h_q // h_k), ("dv", v, leaves[2], h_q // h_k)):
        assert_rel_close(t.grad, ref.grad, grad_tol(torch.bfloat16, group), name)
    total_q = int(cu_q[-1])
    assert torch.count_nonzero(out[total_q:]) == 0 and torch.count_nonzero(q.grad[total_q:]) == 0


def test_varlen_sinks_forward_served_backward_gated():
    gen = torch.Generator(device=DEV).manual_seed(31)
    q, cu = _packed([33, 1, 90], 4, 64, torch.bfloat16, gen)
    k, _ = _packed([33, 1, 90], 4, 64, torch.bfloat16, gen)
    v, _ = _packed([33, 1, 90], 4, 64, torch.bfloat16, gen)
    sinks = torch.randn(4, device=DEV, generator=gen)
    out = torch.ops.cudnn_sdpa.varlen_fwd(q, k, v, cu, cu, 90, 90, sinks, 0.125, -1, 0, True, False)[0]
    ref, _ = reference.varlen(q.float(), k.float(), v.float(), cu, cu, 90, 90, scale=0.125, window=(-1, 0),
                              bottom_right=True, sinks=sinks)
    assert_rel_close(out, ref, TOL[torch.bfloat16], "out")
    lse = torch.ops.cudnn_sdpa.varlen_fwd(q, k, v, cu, cu, 90, 90, sinks, 0.125, -1, 0, True, False)[1]
    version = csp_caps().cudnn_version
    if version < 92600:
        with pytest.raises(csp.FallbackError) as info:  # fallback=False: strict, refused
            torch.ops.cudnn_sdpa.varlen_bwd(torch.ones_like(out), q, k, v, out, lse, cu, cu, 90, 90, sinks, 0.125, -1,
                                            0, True, False, False)
        assert info.value.reasons == ["sink_backward_ragged"]
        before = counters.stats()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        sink_leaf = sinks.clone().requires_grad_()
        o = csp.attention(*leaves, sinks=sink_leaf, is_causal=True, bottom_right=True, cu_seqlens_q=cu,
                          max_seqlen_q=90, max_seqlen_kv=90)
        o.sum().backward()
        delta = counters.stats() - before
        assert delta.served["varlen_fwd"] == 1
        assert delta.fallback["varlen_bwd"] == {"sink_backward_ragged": 1}
        assert sink_leaf.grad is not None and torch.isfinite(sink_leaf.grad).all()


def csp_caps():
    return machine.capabilities(torch.cuda.current_device())


def test_deterministic_backward_is_bit_identical():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        gen = torch.Generator(device=DEV).manual_seed(41)
        q, k, v = make_dense(2, 8, 2, 2, 512, 512, 64, 64, torch.bfloat16, DEV, gen=gen)
        go = torch.randn(2, 8, 512, 64, device=DEV, generator=gen, dtype=torch.bfloat16)
        grads = []
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            csp.attention(q, k, v, is_causal=True).backward(go)
            grads.append([t.grad.clone() for t in (q, k, v)])
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert torch.are_deterministic_algorithms_enabled() == was
    assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only


def test_causal_flag_equals_window_minus1_0_bit_for_bit():
    gen = torch.Generator(device=DEV).manual_seed(51)
    q, k, v = make_dense(2, 4, 4, 4, 256, 256, 64, 64, torch.bfloat16, DEV, requires_grad=False, gen=gen)
    a = csp.attention(q, k, v, is_causal=True)
    b = csp.attention(q, k, v, window=(-1, 0))
    assert torch.equal(a, b)
    native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_rel_close(a, native.float(), TOL[torch.bfloat16], "vs native")


def test_graph_cache_is_bounded_and_survives_eviction():
    graphs.set_capacity(2)
    try:
        gen = torch.Generator(device=DEV).manual_seed(61)
        for s in (64, 128, 192, 64):
            q, k, v = make_dense(1, 2, 2, 2, s, s, 64, 64, torch.bfloat16, DEV, gen=gen)
            out = csp.attention(q, k, v, is_causal=True)
            out.sum().backward()
            ref, _, _ = _ref_dense(q, k, v, torch.ones_like(out), scale=1 / 8, window=(-1, 0))
            assert_rel_close(out, ref, TOL[torch.bfloat16], f"out s={s}")
            assert graphs.cache_info()["size"] <= 2
    finally:
        graphs.set_capacity(256)


def test_graph_rejection_becomes_not_supported(monkeypatch):
    def boom(key, handle):
        raise graphs.cudnn.cudnnGraphNotSupportedError("synthetic rejection for the test")

    monkeypatch.setattr(graphs, "_build_fwd", boom)
    graphs.clear_cache()
    q = torch.randn(1, 2, 64, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(NotSupportedError) as info:
        dense.forward(q, q, q, scale=0.125)
    assert info.value.reason == "graph_not_supported" and "synthetic" in info.value.detail
    before = counters.stats()
    out = csp.attention(q, q, q)  # the op falls back to the composite and counts why
    assert (counters.stats() - before).fallback["dense_fwd"] == {"graph_not_supported": 1}
    assert_rel_close(out, reference.dense(q, q, q, scale=0.125)[0], TOL[torch.bfloat16], "composite")
    graphs.clear_cache()


@pytest.mark.parametrize("variant", ["plain", "sinks", "padded", "window_br"])
def test_opcheck_dense(variant):
    gen = torch.Generator(device=DEV).manual_seed(71)
    q, k, v = make_dense(2, 4, 2, 2, 64, 96, 64, 64, torch.bfloat16, DEV, gen=gen)
    sinks = torch.randn(4, device=DEV, generator=gen).requires_grad_() if variant == "sinks" else None
    lq = torch.tensor([64, 10], dtype=torch.int32, device=DEV) if variant == "padded" else None
    lk = torch.tensor([96, 20], dtype=torch.int32, device=DEV) if variant == "padded" else None
    br = variant in ("window_br", "padded")
    args = (q, k, v, sinks, None, lq, lk, None, 0.125, 0.0, 32 if variant == "window_br" else -1, 0, br, True, False)
    torch.library.opcheck(torch.ops.cudnn_sdpa.dense_fwd, args)


def test_opcheck_varlen():
    gen = torch.Generator(device=DEV).manual_seed(72)
    q, cu = _packed([5, 60, 33], 4, 64, torch.bfloat16, gen)
    k, _ = _packed([5, 60, 33], 2, 64, torch.bfloat16, gen)
    v, _ = _packed([5, 60, 33], 2, 64, torch.bfloat16, gen)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu, 60, 60, None, 0.125, -1, 0, True, False)
    torch.library.opcheck(torch.ops.cudnn_sdpa.varlen_fwd, args)


def test_compiled_consumer_sees_real_strides():
    gen = torch.Generator(device=DEV).manual_seed(81)
    q, k, v = make_dense(2, 4, 4, 4, 128, 128, 64, 64, torch.bfloat16, DEV, order="bshd", gen=gen)

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        o = csp.attention(q, k, v, is_causal=True)
        return (o.transpose(1, 2).reshape(2, 128, -1).float() ** 2).sum()

    loss = step(q, k, v)
    loss.backward()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_o, _ = reference.dense(*leaves, scale=1 / 8, window=(-1, 0))
    ref_loss = (ref_o.transpose(1, 2).reshape(2, 128, -1) ** 2).sum()
    ref_loss.backward()
    assert_rel_close(loss.detach().reshape(1), ref_loss.detach().reshape(1), 2e-2, "loss")
    for name, t, r in zip("qkv", (q, k, v), leaves):
        assert t.grad.stride() == torch.empty_like(t).stride()
        assert_rel_close(t.grad, r.grad, grad_tol(torch.bfloat16), f"d{name}")
