"""CPU tier: the cudnn_sdpa custom ops through their CPU kernels: schemas, fake kernels (shapes AND
strides), opcheck, autograd against the reference, strict (fallback=False) errors, layout policy."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cudnn_sdpa_provider.core import counters, layout
from cudnn_sdpa_provider.ops import dense_varlen as ops, reference  # noqa: F401  (ops defines cudnn_sdpa::*)
from cudnn_sdpa_provider.core.errors import FallbackError
from tests.util import assert_rel_close, make_dense, opcheck

OPS = torch.ops.cudnn_sdpa
ORDERS = ("bhsd", "bshd", "sbhd", "hbsd")

SCHEMAS = {
    "dense_fwd": "cudnn_sdpa::dense_fwd(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? bias, "
                 "Tensor? seq_len_q, Tensor? seq_len_kv, Tensor? philox, float scale, float dropout_p, "
                 "SymInt window_left, SymInt window_right, bool bottom_right, bool compute_lse, bool fallback) "
                 "-> (Tensor, Tensor)",
    "dense_bwd": "cudnn_sdpa::dense_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                 "Tensor? sinks, Tensor? bias, Tensor? seq_len_q, Tensor? seq_len_kv, Tensor? philox, float scale, "
                 "float dropout_p, SymInt window_left, SymInt window_right, bool bottom_right, bool deterministic, "
                 "bool fallback) -> (Tensor, Tensor, Tensor, Tensor)",
    "varlen_fwd": "cudnn_sdpa::varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, "
                  "SymInt max_seqlen_q, SymInt max_seqlen_kv, Tensor? sinks, float scale, SymInt window_left, "
                  "SymInt window_right, bool bottom_right, bool fallback) -> (Tensor, Tensor)",
    "varlen_bwd": "cudnn_sdpa::varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                  "Tensor cu_seqlens_q, Tensor cu_seqlens_kv, SymInt max_seqlen_q, SymInt max_seqlen_kv, "
                  "Tensor? sinks, float scale, SymInt window_left, SymInt window_right, bool bottom_right, "
                  "bool deterministic, bool fallback) -> (Tensor, Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    assert str(getattr(OPS, name).default._schema) == SCHEMAS[name]


# ------------------------------------------------------------------------------------ cases


def _offset_by_one(t: torch.Tensor) -> torch.Tensor:
    """The same values in a fresh storage, one element in (a misaligned base pointer)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t).detach().requires_grad_(t.requires_grad)


def dense_case(order="bhsd", b=2, h_q=4, h_k=4, h_v=4, s_q=8, s_kv=12, d_qk=16, d_v=16, *, dtype=torch.float32,
               slice_d=False, offset=False, sinks=False, padded=False, dropout=0.0, window=(-1, -1),
               bottom_right=False, seed=0):
    """Positional args of dense_fwd (inputs requiring grad) and its grad_out."""
    gen = torch.Generator().manual_seed(seed)
    if slice_d:  # q is a [..., ::2] view: innermost stride 2
        q2, k, v = make_dense(b, h_q, h_k, h_v, s_q, s_kv, 2 * d_qk, d_v, dtype, "cpu", order=order, gen=gen)
        q = q2.detach()[..., ::2].requires_grad_()
        k = k.detach()[..., :d_qk].requires_grad_()
    else:
        q, k, v = make_dense(b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, dtype, "cpu", order=order, gen=gen)
    if offset:
        q = _offset_by_one(q)
    sink_t = torch.randn(h_q, generator=gen).requires_grad_() if sinks else None
    lens_q = torch.tensor([s_q, s_q - 3], dtype=torch.int32)[:b] if padded else None
    lens_kv = torch.tensor([s_kv - 5, s_kv], dtype=torch.int32)[:b] if padded else None
    philox = torch.tensor([1234, 8], dtype=torch.int64) if dropout else None
    args = (q, k, v, sink_t, None, lens_q, lens_kv, philox, 1 / math.sqrt(d_qk), dropout, window[0], window[1],
            bottom_right, True, True)
    grad_out = torch.randn(b, h_q, s_q, d_v, generator=gen, dtype=dtype)
    return args, grad_out


DENSE = {
    **{order: dict(order=order) for order in ORDERS},
    **{f"{order}_dv8": dict(order=order, d_v=8) for order in ORDERS},
    "slice_d": dict(slice_d=True),
    "slice_d_bshd": dict(order="bshd", slice_d=True),
    "storage_offset": dict(offset=True),
    "gqa": dict(h_q=4, h_k=2, h_v=1),
    "sinks": dict(sinks=True),
    "padded": dict(padded=True),
    "causal_window": dict(window=(3, 0)),
    "bottom_right": dict(window=(-1, 0), bottom_right=True),
    "dropout": dict(dropout=0.25),
}


def varlen_case(h_q=4, h_k=4, h_v=4, d_qk=16, d_v=16, *, sinks=False, cu_q=(0, 3, 3, 10), cu_kv=(0, 5, 6, 9),
                extra_tokens=0, window=(-1, -1), bottom_right=False, dtype=torch.float32, seed=0):
    """Positional args of varlen_fwd; ``extra_tokens`` packs tokens past cu_seqlens[-1]."""
    gen = torch.Generator().manual_seed(seed)
    cu_q_t, cu_kv_t = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv, dtype=torch.int32)
    t_q, t_kv = cu_q[-1] + extra_tokens, cu_kv[-1] + extra_tokens
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_kv = max(b - a for a, b in zip(cu_kv, cu_kv[1:]))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()

    q, k, v = rnd(t_q, h_q, d_qk), rnd(t_kv, h_k, d_qk), rnd(t_kv, h_v, d_v)
    sink_t = rnd(h_q) if sinks else None
    args = (q, k, v, cu_q_t, cu_kv_t, max_q, max_kv, sink_t, 1 / math.sqrt(d_qk), window[0], window[1], bottom_right,
            True)
    return args, torch.randn(t_q, h_q, d_v, generator=gen, dtype=dtype)


VARLEN = {
    "plain": dict(),
    "gqa_dv8": dict(h_q=4, h_k=2, h_v=1, d_v=8),
    "sinks": dict(sinks=True),
    "extra_tokens": dict(extra_tokens=3),
    "causal_bottom_right": dict(window=(-1, 0), bottom_right=True),
}


def dense_bwd_args(fwd_args, grad_out):
    """dense_bwd's positional args for a forward (runs the forward on the CPU kernel)."""
    q, k, v, sinks, bias, lq, lkv, philox, scale, p, wl, wr, br, _, fb = fwd_args
    with torch.no_grad():
        out, lse = OPS.dense_fwd(*fwd_args)
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v, sinks)]
    return (grad_out, *plain[:3], out, lse, plain[3], bias, lq, lkv, philox, scale, p, wl, wr, br, False, fb)


def varlen_bwd_args(fwd_args, grad_out):
    q, k, v, cu_q, cu_kv, max_q, max_kv, sinks, scale, wl, wr, br, fb = fwd_args
    with torch.no_grad():
        out, lse = OPS.varlen_fwd(*fwd_args)
    plain = [t.detach() if t is not None else None for t in (q, k, v, sinks)]
    return (grad_out, *plain[:3], out, lse, cu_q, cu_kv, max_q, max_kv, plain[3], scale, wl, wr, br, False, fb)


def fake_vs_real(op, args):
    real = op(*args)
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = op(*fake_args)
    assert len(fake) == len(real)
    for i, (f, r) in enumerate(zip(fake, real)):
        assert (tuple(f.shape), f.stride(), f.dtype) == (tuple(r.shape), r.stride(), r.dtype), f"output {i}"
    return real


# --------------------------------------------------------------------------- fake == real


@pytest.mark.parametrize("kw", DENSE.values(), ids=DENSE.keys())
def test_dense_fake_matches_real(kw):
    args, grad_out = dense_case(**kw)
    out, lse = fake_vs_real(OPS.dense_fwd, args)
    q, _, v = args[:3]
    assert tuple(out.shape) == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    assert tuple(lse.shape) == (q.shape[0], q.shape[1], q.shape[2], 1) and lse.is_contiguous()
    dq, dk, dv, dsinks = fake_vs_real(OPS.dense_bwd, dense_bwd_args(args, grad_out))
    for grad, t in ((dq, q), (dk, args[1]), (dv, args[2])):
        assert grad.shape == t.shape
    assert tuple(dsinks.shape) == ((q.shape[1],) if kw.get("sinks") else (0,))


@pytest.mark.parametrize("order", ORDERS)
def test_dense_output_follows_q_dim_order(order):
    args, _ = dense_case(order=order, d_v=8)
    out, _ = OPS.dense_fwd(*args)
    q = args[0]
    by_stride = lambda t: sorted(range(4), key=lambda i: -t.stride(i))  # noqa: E731
    assert by_stride(out) == by_stride(q)
    assert out.is_contiguous() == (order == "bhsd")


@pytest.mark.parametrize("kw", VARLEN.values(), ids=VARLEN.keys())
def test_varlen_fake_matches_real(kw):
    args, grad_out = varlen_case(**kw)
    out, lse = fake_vs_real(OPS.varlen_fwd, args)
    q, _, v = args[:3]
    assert tuple(out.shape) == (q.shape[0], q.shape[1], v.shape[2]) and out.is_contiguous()
    assert tuple(lse.shape) == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32
    dq, dk, dv, _ = fake_vs_real(OPS.varlen_bwd, varlen_bwd_args(args, grad_out))
    assert dq.shape == q.shape and dk.shape == args[1].shape and dv.shape == v.shape


# --------------------------------------------------------------------------------- opcheck

@pytest.mark.parametrize("kw", DENSE.values(), ids=DENSE.keys())
def test_opcheck_dense(kw):
    args, grad_out = dense_case(**kw)
    opcheck(OPS.dense_fwd.default, args)
    opcheck(OPS.dense_bwd.default, dense_bwd_args(args, grad_out))


@pytest.mark.parametrize("kw", VARLEN.values(), ids=VARLEN.keys())
def test_opcheck_varlen(kw):
    args, grad_out = varlen_case(**kw)
    opcheck(OPS.varlen_fwd.default, args)
    opcheck(OPS.varlen_bwd.default, varlen_bwd_args(args, grad_out))


def test_opcheck_clone_grad_workaround_is_still_needed():
    """tests/util.opcheck ignores one torch-internal warning on torch >= 2.14. This fails when the
    installed torch no longer raises it for a plain leaf input, i.e. when the workaround can go."""
    x = torch.randn(3, requires_grad=True)
    version = tuple(int(p) for p in torch.__version__.split(".")[:2])
    if version < (2, 14):
        torch.library.opcheck(torch.ops.aten.sin.default, (x,))  # no workaround before 2.14
        return
    with pytest.raises(Exception, match="The .grad attribute of a Tensor that is not a leaf"):
        torch.library.opcheck(torch.ops.aten.sin.default, (x,))


# ------------------------------------------------------------------------- autograd vs reference

#: The composite computes in fp32 (reference's compute_dtype), so float64 inputs agree to ~1e-6.
TOL64 = 1e-5


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


AUTOGRAD_DENSE = ["bshd", "sbhd_dv8", "gqa", "sinks", "padded", "causal_window", "bottom_right"]


@pytest.mark.parametrize("name", AUTOGRAD_DENSE)
def test_dense_autograd_matches_reference(name):
    args, grad_out = dense_case(**DENSE[name], dtype=torch.float64)
    q, k, v, sinks, _, lq, lkv, _, scale, _, wl, wr, br, _, _ = args
    out, lse = OPS.dense_fwd(*args)
    out.backward(grad_out)
    rq, rk, rv, rs = _leaves(q, k, v, sinks)
    ref_out, ref_lse = reference.dense(rq, rk, rv, scale=scale, window=(wl, wr), bottom_right=br, sinks=rs,
                                       seq_len_q=lq, seq_len_kv=lkv, compute_dtype=torch.float64)
    ref_out.backward(grad_out)
    assert_rel_close(out, ref_out, TOL64, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_rel_close(lse[finite], ref_lse[finite].float(), TOL64, "lse")
    for got, want, label in ((q.grad, rq.grad, "dq"), (k.grad, rk.grad, "dk"), (v.grad, rv.grad, "dv")):
        assert got.dtype == torch.float64 and got.shape == want.shape
        assert_rel_close(got, want, TOL64, label)
    if sinks is not None:
        assert_rel_close(sinks.grad, rs.grad, TOL64, "dsinks")


@pytest.mark.parametrize("name", ["plain", "gqa_dv8", "sinks", "extra_tokens", "causal_bottom_right"])
def test_varlen_autograd_matches_reference(name):
    args, grad_out = varlen_case(**VARLEN[name], dtype=torch.float64)
    q, k, v, cu_q, cu_kv, max_q, max_kv, sinks, scale, wl, wr, br, _ = args
    out, lse = OPS.varlen_fwd(*args)
    out.backward(grad_out)
    rq, rk, rv, rs = _leaves(q, k, v, sinks)
    ref_out, _ = reference.varlen(rq, rk, rv, cu_q, cu_kv, max_q, max_kv, scale=scale, window=(wl, wr),
                                  bottom_right=br, sinks=rs, compute_dtype=torch.float64)
    ref_out.backward(grad_out)
    assert_rel_close(out, ref_out, TOL64, "out")
    for got, want, label in ((q.grad, rq.grad, "dq"), (k.grad, rk.grad, "dk"), (v.grad, rv.grad, "dv")):
        assert_rel_close(got, want, TOL64, label)
    if sinks is not None:
        assert_rel_close(sinks.grad, rs.grad, TOL64, "dsinks")
    tail = cu_q[-1].item()
    assert torch.all(out[tail:] == 0) and torch.all(q.grad[tail:] == 0), "tokens past cu_seqlens_q[-1] are 0"


def test_backward_without_lse_raises():
    args, grad_out = dense_case()
    args = args[:13] + (False,) + args[14:]  # compute_lse=False
    out, _ = OPS.dense_fwd(*args)
    with pytest.raises(RuntimeError, match="compute_lse=False; its backward needs the LSE"):
        out.backward(grad_out)


def test_dropout_composite_is_a_pure_function_of_philox():
    args, grad_out = dense_case(dropout=0.5)
    with torch.no_grad():
        a, _ = OPS.dense_fwd(*args)
        b, _ = OPS.dense_fwd(*args)
        other = args[:7] + (torch.tensor([99, 0]),) + args[8:]
        c, _ = OPS.dense_fwd(*other)
        none, _ = OPS.dense_fwd(*(args[:9] + (0.0,) + args[10:]))
    assert torch.equal(a, b), "same philox pair, same mask"
    assert not torch.equal(a, c), "another pair, another mask"
    assert not torch.equal(a, none)


# ------------------------------------------------------------------------------ counting/strict


def test_cpu_kernels_count_no_cuda():
    dense_args, dense_go = dense_case()
    varlen_args, varlen_go = varlen_case()
    before = counters.stats()
    OPS.dense_fwd(*dense_args)[0].backward(dense_go)
    OPS.varlen_fwd(*varlen_args)[0].backward(varlen_go)
    assert (counters.stats() - before).to_dict() == {
        **{p: {"served": 0, "fallback": {"no_cuda": 1}} for p in ("dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd")},
        **{p: {"served": 0, "fallback": {}} for p in ("paged_fwd", "fp8_fwd", "fp8_bwd")},
    }


def _strict(args):
    return args[:-1] + (False,)


@pytest.mark.parametrize("path", ["dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd"])
def test_fallback_false_refuses_no_cuda(path):
    if path.startswith("dense"):
        args, go = dense_case()
        args = args if path == "dense_fwd" else dense_bwd_args(args, go)
    else:
        args, go = varlen_case()
        args = args if path == "varlen_fwd" else varlen_bwd_args(args, go)
    before = counters.stats()
    with pytest.raises(FallbackError) as info:
        getattr(OPS, path)(*_strict(args))
    assert info.value.path == path and info.value.reasons == ["no_cuda"]
    region = counters.stats() - before
    assert region.to_dict()[path] == {"served": 0, "fallback": {"no_cuda": 1}}, "a refusal is in the audit"
    assert region.refused_dict() == {path: {"no_cuda": 1}}


# ---------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("d_v", [16, 8], ids=["dv_eq", "dv_ne"])
@pytest.mark.parametrize("order", ORDERS)
def test_dense_out_matches_aten_meta(order, d_v):
    q, k, v = make_dense(2, 3, 3, 3, 5, 7, 16, d_v, torch.float16, "meta", order=order, requires_grad=False)
    aten_out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)[0]
    ours = layout.dense_out(q, (2, 3, 5, d_v))
    assert (tuple(ours.shape), ours.stride(), ours.dtype) == (tuple(aten_out.shape), aten_out.stride(), aten_out.dtype)


def test_grad_like_and_packed():
    q, _, _ = make_dense(2, 3, 3, 3, 5, 7, 16, 16, torch.float32, "cpu", order="sbhd", requires_grad=False)
    g = layout.grad_like(q)
    assert g.shape == q.shape and g.stride() == q.stride()
    p = layout.packed((7, 3, 8), q, dtype=torch.float32)
    assert p.shape == (7, 3, 8) and p.is_contiguous()


def _odd_bias():
    return torch.randn(2, 1, 5, 7, dtype=torch.float16)  # S_kv = 7: row stride 14 bytes


REPAIR_CASES = {
    "slice_d": lambda: torch.randn(2, 3, 5, 32)[..., ::2],
    "storage_offset": lambda: _offset_by_one(torch.randn(2, 3, 5, 16)),
    "odd_s_kv_bias": _odd_bias,
    "odd_s_kv_bias_transposed": lambda: _odd_bias().transpose(2, 3),
    "bshd_slice": lambda: torch.randn(2, 5, 3, 32).transpose(1, 2)[..., 1::2],
}


@pytest.mark.parametrize("make", REPAIR_CASES.values(), ids=REPAIR_CASES.keys())
def test_repaired_is_usable_and_equal(make):
    t = make()
    assert not layout.usable(t)
    fixed = layout.repaired(t)
    assert layout.usable(fixed) and fixed.stride(-1) == 1
    assert fixed.shape == t.shape and fixed.dtype == t.dtype
    assert torch.equal(fixed, t)
    outer = lambda x: sorted(range(x.dim() - 1), key=lambda i: -x.stride(i))  # noqa: E731
    if t.stride(-1) == 1:
        assert outer(fixed) == outer(t), "the dimension order is kept"


def test_repaired_returns_usable_tensors_unchanged():
    for order in ORDERS:
        q, _, _ = make_dense(2, 3, 3, 3, 5, 7, 16, 16, torch.float16, "cpu", order=order, requires_grad=False)
        assert layout.usable(q) and layout.repaired(q) is q


def test_strides_usable_rules():
    assert layout.strides_usable(torch.empty(2, 3, 4, 8))
    assert not layout.strides_usable(torch.empty(2, 3, 4, 16)[..., ::2]), "innermost stride must be 1"
    assert not layout.strides_usable(torch.empty(2, 3, 4, 6, dtype=torch.float16)), "12-byte row stride"
    assert layout.strides_usable(torch.empty(1, 1, 1, 6, dtype=torch.float16)), "size-1 dims are never stepped"
    odd_size_one = torch.empty(64).as_strided((2, 1, 4, 8), (32, 3, 8, 1))
    assert layout.strides_usable(odd_size_one), "the stride of a size-1 dim does not matter"
    assert not layout.strides_usable(torch.empty(8).as_strided((2, 8), (0, 1))), "a stepped zero stride"
