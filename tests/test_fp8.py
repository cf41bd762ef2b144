"""CPU tier: FP8 attention (``csp.fp8``) on its aten reference, which the CPU kernels of
``cudnn_sdpa::fp8_fwd`` / ``fp8_bwd`` always run (reason ``no_cuda``).

What is tested: ``quantize`` (power-of-2 current scaling, round trip within half an FP8 step);
``forward`` / ``backward`` against independent float64 attention on the dequantised operands
(causal, cross lengths, GQA, padding by lengths, lse and the amax outputs), with error bounds
derived from FP8 rounding; ``attention`` (bf16 and fp32 in, autograd) against float64 F.sdpa; the
``Recipe`` (re-run on saturation and underflow, state, argument checks); argument checks of the
public functions; the custom ops under ``torch.library.opcheck`` and ``torch.compile``; counters
and strict mode; and the support rules of kind "fp8".

Error bounds. float8_e4m3fn has 3 mantissa bits: rounding a value in its normal range (>= 2^-6)
moves it by at most half a step, 2^-4 of its magnitude; below that by at most 2^-10 (half the
subnormal step 2^-9). float8_e5m2: 2^-3 relative, normal from 2^-14, absolute 2^-17 below.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, support
from cudnn_sdpa_provider.ops import fp8_ops  # fp8_ops registers cudnn_sdpa::fp8_fwd / fp8_bwd
from cudnn_sdpa_provider.core.support import Capabilities
from tests.util import region, rel_error

fp8 = csp.fp8
OPS = torch.ops.cudnn_sdpa
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOP = {E4M3: 448.0, E5M2: 57344.0}
#: (half-step relative error in the normal range, smallest normal, half the subnormal step)
ROUNDING = {E4M3: (2.0**-4, 2.0**-6, 2.0**-10), E5M2: (2.0**-3, 2.0**-14, 2.0**-17)}
U = 2.0**-4  # e4m3's relative rounding error

#: Reference (csp.fp8.forward) against float64 attention on the same dequantised operands: O is
#: rounded to e4m3 (<= 2^-4 of |O|) and so is P (<= 2^-4 of each weight, adding at most
#: 2^-4 * sum_j p_j |v_j|; random signs make it a few times smaller). Measured <= 0.053 over 30
#: seeds of these shapes; 0.07 leaves room and still fails for any missed scale factor.
FWD_REF_TOL = 0.07
#: csp.fp8.backward against float64 autograd on the dequantised operands and dO: P and dS rounded
#: to e4m3 (2^-4 each), dQ/dK/dV rounded again on output, D computed from the FP8-stored O.
#: Measured <= 0.08 over 20 seeds (GQA, causal); 0.1 of each gradient's max.
BWD_REF_TOL = 0.1
#: csp.fp8.attention against float64 F.sdpa on the ORIGINAL (unquantised) inputs: the rounding of
#: q, k (2^-4 each: score errors of 2^-4 |q||k| scale) and v comes on top of the above. Measured
#: median 0.075 (forward) / 0.09 (gradients), worst 0.156 / 0.198 over 30 seeds x 16 variants at
#: these tiny shapes (S = 32: a few large rows decide the maximum); the bounds are above the worst.
ATTN_FWD_TOL = 0.2
ATTN_GRAD_TOL = 0.2


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's raw bytes (torch.equal has no float8 kernel on CPU)."""
    return t.view(torch.uint8)


def deq(stored: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return stored.double() * descale.double()


def pow2_below(x: float) -> float:
    """The largest power of 2 <= x (test-side, independent of the package's pow2_scale)."""
    return 2.0 ** math.floor(math.log2(x))



# ------------------------------------------------------------------------------------ quantize


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_scale_is_a_power_of_2_that_fills_the_range(dtype, magnitude):
    t = randn(2, 3, 16, 8, g=gen(1), scale=magnitude)
    stored, descale = fp8.quantize(t, dtype)
    assert stored.dtype == dtype and stored.shape == t.shape
    assert descale.shape == (1,) and descale.dtype == torch.float32
    exponent = math.log2(descale.item())
    assert exponent == round(exponent), f"descale {descale.item()} is not a power of 2"
    amax, scale = t.abs().max().item(), 1.0 / descale.item()
    assert TOP[dtype] / 2 < amax * scale <= TOP[dtype], "the scale must put amax in the top binade"
    assert TOP[dtype] / 2 < stored.float().abs().max().item() <= TOP[dtype]


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_round_trip_is_within_half_a_step(dtype, source):
    t = (randn(4, 8, 32, g=gen(2)) * torch.logspace(-3, 1, 32)).to(source)  # spans 4 decades
    stored, descale = fp8.quantize(t, dtype)
    rel, smallest_normal, half_subnormal = ROUNDING[dtype]
    ref = t.double()
    back = deq(stored, descale)
    err = (back - ref).abs()
    normal = ref.abs() / descale.double() >= smallest_normal
    assert normal.sum() > t.numel() // 2
    assert torch.all(err[normal] <= rel * ref.abs()[normal]), (err[normal] / ref.abs()[normal]).max()
    assert torch.all(err[~normal] <= half_subnormal * descale.double())
    assert err.max() > 0, "nothing was rounded: the values did not go through FP8"


def test_quantize_margin_divides_the_scale():
    t = randn(2, 4, 16, 16, g=gen(3))
    _, d1 = fp8.quantize(t)
    s4, d4 = fp8.quantize(t, margin=4.0)
    assert d4.item() == 4 * d1.item()
    assert TOP[E4M3] / 8 < s4.float().abs().max().item() <= TOP[E4M3] / 4
    _, d3 = fp8.quantize(t, margin=3.0)  # not a power of 2: the scale still is
    assert d3.item() == 4 * d1.item() or d3.item() == 2 * d1.item()
    assert t.abs().max().item() * 3.0 / d3.item() <= TOP[E4M3]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_all_zero_input_gets_descale_1(dtype):
    stored, descale = fp8.quantize(torch.zeros(2, 3, 4, 8), dtype)
    assert descale.item() == 1.0 and descale.shape == (1,)
    assert torch.all(stored.float() == 0)


def test_quantize_does_not_touch_its_input_or_its_autograd_graph():
    t = randn(2, 3, 8, g=gen(4)).requires_grad_()
    before = t.detach().clone()
    stored, descale = fp8.quantize(t)
    assert not stored.requires_grad and not descale.requires_grad
    assert torch.equal(t.detach(), before)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype=torch.float16), ValueError, "dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
    (dict(dtype=torch.int8), ValueError, "dtype must be"),
    (dict(margin=0.5), ValueError, "margin"),
    (dict(margin=0.0), ValueError, "margin"),
    (dict(margin=float("nan")), ValueError, "margin"),
    (dict(margin=True), TypeError, "margin must be a finite real number >= 1.0, got bool True"),
], ids=["fp16_target", "int8_target", "margin_half", "margin_0", "margin_nan", "margin_bool"])
def test_quantize_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8.quantize(randn(2, 4, g=gen(5)), **kwargs)


def test_quantize_non_tensor_and_integer_tensor_are_type_errors():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        fp8.quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="floating point"):
        fp8.quantize(torch.arange(8))


# ------------------------------------------------------------------- forward: reference semantics

#: id: (h_q, h_k, s_q, s_kv, causal, seq_lens_q, seq_lens_kv)
FWD_CASES = {
    "plain": (4, 4, 32, 32, False, None, None),
    "causal": (4, 4, 32, 32, True, None, None),
    "cross_lengths": (4, 4, 24, 40, False, None, None),
    "causal_top_left_cross": (4, 4, 24, 40, True, None, None),
    "gqa": (8, 2, 32, 32, False, None, None),
    "gqa_causal": (8, 2, 32, 32, True, None, None),
    "padded": (4, 4, 32, 32, False, [20, 32], [24, 9]),
    "padded_causal_gqa": (8, 2, 32, 32, True, [32, 13], [17, 32]),
}


def fp8_case(h_q, h_k, s_q, s_kv, d=32, b=2, seed=0, lens=None):
    """Random q, k, v quantised to e4m3 with their descales, scale_o chosen as attention does
    (a power of 2 with max|V| / 0.875 at the top of e4m3), lengths as int32 tensors or None."""
    g = gen(seed)
    q, k, v = randn(b, h_q, s_q, d, g=g), randn(b, h_k, s_kv, d, g=g), randn(b, h_k, s_kv, d, g=g)
    (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize(t) for t in (q, k, v))
    scale_o = torch.tensor([pow2_below(TOP[E4M3] * 0.875 / deq(v8, dv).abs().max().item())])
    lq, lk = (None, None) if lens is None else (torch.tensor(lens[0], dtype=torch.int32),
                                               torch.tensor(lens[1], dtype=torch.int32))
    return dict(q=q8, k=k8, v=v8, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=scale_o, seq_lens_q=lq,
                seq_lens_kv=lk)


def allowed(b, s_q, s_kv, causal, lens_q, lens_kv):
    """(B, 1, S_q, S_kv) True where a query attends a key, and (B, 1, S_q, 1) True for live rows."""
    i = torch.arange(s_q).view(1, 1, -1, 1)
    j = torch.arange(s_kv).view(1, 1, 1, -1)
    ok = torch.ones(b, 1, s_q, s_kv, dtype=torch.bool)
    if causal:
        ok = ok & (j <= i)
    if lens_q is not None:
        ok = ok & (i < lens_q.view(-1, 1, 1, 1)) & (j < lens_kv.view(-1, 1, 1, 1))
    return ok, ok.any(-1, keepdim=True)


def ref64(qd, kd, vd, causal, lens_q=None, lens_kv=None, scale=None):
    """float64 attention of (dequantised) operands with F.sdpa; rows without keys are 0."""
    ok, live = allowed(qd.shape[0], qd.shape[2], kd.shape[2], causal, lens_q, lens_kv)
    mask = ok | ~live  # a row with no key attends everything; its output is zeroed below
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True, scale=scale) * live


def scores64(qd, kd, causal, lens_q=None, lens_kv=None, scale=None):
    group = qd.shape[1] // kd.shape[1]
    scale = 1 / math.sqrt(qd.shape[-1]) if scale is None else scale
    s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * scale
    ok, live = allowed(qd.shape[0], qd.shape[2], kd.shape[2], causal, lens_q, lens_kv)
    return s.masked_fill(~ok, float("-inf")), live


@pytest.mark.parametrize("name", list(FWD_CASES))
def test_forward_matches_fp64_on_the_dequantised_operands(name):
    h_q, h_k, s_q, s_kv, causal, lq, lk = FWD_CASES[name]
    c = fp8_case(h_q, h_k, s_q, s_kv, seed=11, lens=None if lq is None else (lq, lk))
    res, counted = region(lambda: fp8.forward(**c, is_causal=causal, return_lse=True))
    assert counted == {"fp8_fwd": {"no_cuda": 1}}
    assert res.out.dtype == E4M3 and res.out.shape == (2, h_q, s_q, 32)
    assert res.lse.dtype == torch.float32 and res.lse.shape == (2, h_q, s_q, 1)
    qd, kd, vd = deq(c["q"], c["descale_q"]), deq(c["k"], c["descale_k"]), deq(c["v"], c["descale_v"])
    so = c["scale_o"].double()
    got = res.out.double() / so
    want = ref64(qd, kd, vd, causal, c["seq_lens_q"], c["seq_lens_kv"])
    err, _ = rel_error(got, want)
    assert err <= FWD_REF_TOL, f"{name}: max|err|/max|ref| = {err:.4f} > {FWD_REF_TOL}"
    assert err > 1e-3, f"{name}: error {err:.2e}: the output cannot have been rounded to FP8"
    # Per element: P rounding adds <= 2^-4 sum_j p_j |v_j| (+ flushed subnormal weights, < S_kv 2^-18
    # max|v|), then O's own rounding <= 2^-4 |O| (+ 2^-10 / scale_o below e4m3's normal range).
    weights_abs = ref64(qd, kd, vd.abs(), causal, c["seq_lens_q"], c["seq_lens_kv"])
    e_p = U * weights_abs + s_kv * 2.0**-18 * vd.abs().max()
    bound = (1 + U) * e_p + U * want.abs() + 2.0**-10 / so + 1e-5 * vd.abs().max()
    over = (got - want).abs() - bound
    assert over.max() <= 0, f"{name}: an element is off by {over.max().item():.3g} more than FP8 rounding allows"
    # ... and P itself was rounded: O's rounding alone does not explain every element's error
    o_only = U * (1 + 1e-6) * want.abs() + 2.0**-10 / so + 1e-5 * vd.abs().max()
    assert ((got - want).abs() > o_only).any(), f"{name}: P was not quantised (errors are O's rounding alone)"


@pytest.mark.parametrize("name", ["plain", "causal_top_left_cross", "gqa_causal", "padded_causal_gqa"])
def test_forward_lse_and_amax_outputs(name):
    h_q, h_k, s_q, s_kv, causal, lq, lk = FWD_CASES[name]
    c = fp8_case(h_q, h_k, s_q, s_kv, seed=12, lens=None if lq is None else (lq, lk))
    res = fp8.forward(**c, is_causal=causal, return_lse=True)
    qd, kd, vd = deq(c["q"], c["descale_q"]), deq(c["k"], c["descale_k"]), deq(c["v"], c["descale_v"])
    s, live = scores64(qd, kd, causal, c["seq_lens_q"], c["seq_lens_kv"])
    lse = torch.logsumexp(s, -1, keepdim=True)
    live = live.expand_as(lse)
    torch.testing.assert_close(res.lse.double()[live], lse[live], rtol=1e-5, atol=1e-5)
    assert torch.all(res.lse[~live] == float("inf")), "rows without keys have lse = +inf"
    p = torch.softmax(s, -1).nan_to_num(0.0)
    assert res.amax_s.shape == () and res.amax_s.dtype == torch.float32
    assert res.amax_s.item() == pytest.approx(p.max().item(), rel=1e-5)
    # amax_o is max|O| before O is stored: the stored maximum is it rounded to e4m3
    stored_max = (res.out.double() / c["scale_o"].double()).abs().max().item()
    assert res.amax_o.shape == () and res.amax_o.dtype == torch.float32
    assert abs(res.amax_o.item() - stored_max) <= U * res.amax_o.item()
    exact_max = ref64(qd, kd, vd, causal, c["seq_lens_q"], c["seq_lens_kv"]).abs().max().item()
    assert res.amax_o.item() == pytest.approx(exact_max, rel=FWD_REF_TOL)


def test_forward_without_lse_and_with_an_explicit_scale():
    c = fp8_case(4, 4, 16, 16, seed=13)
    res = fp8.forward(**c, scale=0.5)
    assert res.lse is None
    qd, kd, vd = deq(c["q"], c["descale_q"]), deq(c["k"], c["descale_k"]), deq(c["v"], c["descale_v"])
    got = res.out.double() / c["scale_o"].double()
    assert rel_error(got, ref64(qd, kd, vd, False, scale=0.5))[0] <= FWD_REF_TOL
    assert rel_error(got, ref64(qd, kd, vd, False))[0] > 0.2, "scale=0.5 must change the result"


def test_padding_rows_are_exactly_zero_and_padded_keys_have_no_influence():
    c = fp8_case(8, 2, 32, 32, seed=14, lens=([20, 32], [24, 9]))
    res = fp8.forward(**c, is_causal=True, return_lse=True)
    assert torch.all(res.out[0, :, 20:].float() == 0), "rows past seq_lens_q must be exactly 0"
    assert torch.any(res.out[0, :, :20].float() != 0) and torch.any(res.out[1].float() != 0)
    g = gen(15)
    k2, v2, q2 = c["k"].clone(), c["v"].clone(), c["q"].clone()
    k2[0, :, 24:] = fp8.quantize(randn(2, 8, 32, g=g, scale=5.0))[0]  # other values past the lengths,
    v2[0, :, 24:] = fp8.quantize(randn(2, 8, 32, g=g, scale=5.0))[0]  # stored with the same descales
    k2[1, :, 9:] = fp8.quantize(randn(2, 23, 32, g=g, scale=5.0))[0]
    v2[1, :, 9:] = fp8.quantize(randn(2, 23, 32, g=g, scale=5.0))[0]
    q2[0, :, 20:] = fp8.quantize(randn(8, 12, 32, g=g, scale=5.0))[0]
    assert not torch.equal(bits(k2), bits(c["k"])) and not torch.equal(bits(q2), bits(c["q"]))
    other = fp8.forward(**dict(c, q=q2, k=k2, v=v2), is_causal=True, return_lse=True)
    assert torch.equal(bits(other.out), bits(res.out)), "values past the lengths changed the output"
    assert torch.equal(other.lse, res.lse)
    assert other.amax_s.item() == res.amax_s.item() and other.amax_o.item() == res.amax_o.item()


# ---------------------------------------------------------------- backward: reference semantics


def bwd_case(h_q, h_k, s, causal, lens=None, seed=20, grad_dtype=E4M3, margin=2.0):
    """A forward's outputs and everything backward needs, the fp64 gradients of the dequantised
    problem, and scales for dQ, dK, dV, dS chosen from those gradients' maxima x margin."""
    c = fp8_case(h_q, h_k, s, s, seed=seed, lens=lens)
    fwd = fp8.forward(**c, is_causal=causal, return_lse=True)
    g8, dg = fp8.quantize(randn(2, h_q, s, 32, g=gen(seed + 1)), grad_dtype)
    lq, lk = c["seq_lens_q"], c["seq_lens_kv"]
    qd, kd, vd = (deq(c[n], c["descale_" + n]).requires_grad_() for n in "qkv")
    dod = deq(g8, dg)
    o = ref64(qd, kd, vd, causal, lq, lk)
    o.backward(dod)
    with torch.no_grad():
        s64, _ = scores64(qd, kd, causal, lq, lk)
        p = torch.softmax(s64, -1).nan_to_num(0.0)
        live_rows = allowed(2, s, s, causal, lq, lk)[1]
        dp = (dod * live_rows) @ vd.repeat_interleave(h_q // h_k, 1).transpose(-1, -2)
        ds = p * (dp - (o * dod).sum(-1, keepdim=True)) / math.sqrt(32)
    maxima = [qd.grad.abs().max().item(), kd.grad.abs().max().item(), vd.grad.abs().max().item(),
              ds.abs().max().item()]
    scales = [torch.tensor([pow2_below(TOP[E4M3] / (margin * m))]) for m in maxima]
    args = dict(descale_q=c["descale_q"], descale_k=c["descale_k"], descale_v=c["descale_v"],
                descale_o=1.0 / c["scale_o"], descale_do=dg, scale_dq=scales[0], scale_dk=scales[1],
                scale_dv=scales[2], scale_dp=scales[3], is_causal=causal, seq_lens_q=lq, seq_lens_kv=lk)
    return dict(c=c, fwd=fwd, g8=g8, args=args, grads=(qd.grad, kd.grad, vd.grad), maxima=maxima, scales=scales)


BWD_CASES = {
    "plain": (4, 4, 32, False, None),
    "causal": (4, 4, 32, True, None),
    "gqa_causal": (8, 2, 32, True, None),
    "padded_gqa": (8, 2, 32, False, ([20, 32], [24, 9])),
}


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["do_e4m3", "do_e5m2"])
@pytest.mark.parametrize("name", list(BWD_CASES))
def test_backward_matches_fp64_on_the_dequantised_operands(name, grad_dtype):
    h_q, h_k, s, causal, lens = BWD_CASES[name]
    case = bwd_case(h_q, h_k, s, causal, lens, grad_dtype=grad_dtype)
    c, fwd = case["c"], case["fwd"]
    res, counted = region(lambda: fp8.backward(case["g8"], c["q"], c["k"], c["v"], fwd.out, fwd.lse, **case["args"]))
    assert counted == {"fp8_bwd": {"no_cuda": 1}}
    for name_, stored, like, sc, want, amax, m in zip(
            ("dq", "dk", "dv"), (res.dq, res.dk, res.dv), (c["q"], c["k"], c["v"]), case["scales"], case["grads"],
            (res.amax_dq, res.amax_dk, res.amax_dv), case["maxima"]):
        assert stored.dtype == E4M3 and stored.shape == like.shape
        got = stored.double() / sc.double()
        err, _ = rel_error(got, want)
        assert 1e-3 < err <= BWD_REF_TOL, f"{name} {name_}: max|err|/max|ref| = {err:.4f}"
        assert amax.shape == () and amax.item() == pytest.approx(m, rel=0.1), name_
        # at scales from max x 2 nothing saturates: the stored max is amax x scale, rounded
        assert stored.float().abs().max().item() <= TOP[E4M3] / 2 * (1 + U)
    assert res.amax_dp.item() == pytest.approx(case["maxima"][3], rel=0.1)
    if lens is not None:
        assert torch.all(res.dq[0, :, 20:].float() == 0), "query rows past seq_lens_q get no gradient"
        assert torch.all(res.dk[0, :, 24:].float() == 0) and torch.all(res.dv[1, :, 9:].float() == 0)


def test_backward_scale_too_large_saturates_at_448_and_amax_says_so():
    case = bwd_case(4, 4, 32, True)
    c, fwd = case["c"], case["fwd"]
    args = dict(case["args"], scale_dq=case["scales"][0] * 128)
    res = fp8.backward(case["g8"], c["q"], c["k"], c["v"], fwd.out, fwd.lse, **args)
    assert res.dq.float().abs().max().item() == TOP[E4M3], "a saturated FP8 gradient is clipped at 448, not NaN"
    assert res.amax_dq.item() * args["scale_dq"].item() > TOP[E4M3]
    assert not torch.isnan(res.dq.float()).any()
    fine = fp8.backward(case["g8"], c["q"], c["k"], c["v"], fwd.out, fwd.lse, **case["args"])
    assert res.amax_dq.item() == fine.amax_dq.item(), "amax is measured before the output is stored"


# --------------------------------------------------------------------------------- attention


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def attn_inputs(h_q, h_k, s, dtype, seed, d=32):
    g = gen(seed)
    q, k, v = randn(2, h_q, s, d, g=g), randn(2, h_k, s, d, g=g), randn(2, h_k, s, d, g=g)
    go = randn(2, h_q, s, d, g=g)
    return [t.to(dtype) for t in (q, k, v, go)]


def sdpa64_grads(q, k, v, go, causal, lens=None):
    qd, kd, vd = leaves(q.double(), k.double(), v.double())
    lq, lk = (None, None) if lens is None else lens
    out = ref64(qd, kd, vd, causal, lq, lk)
    out.backward(go.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def run_attention(q, k, v, go, recipe, **kw):
    q, k, v = leaves(q, k, v)
    out = fp8.attention(q, k, v, recipe=recipe, **kw)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_forward_and_backward_match_fp64_sdpa(dtype, heads, causal):
    q, k, v, go = attn_inputs(*heads, 32, dtype, seed=30)
    (out, gq, gk, gv), counted = region(lambda: run_attention(q, k, v, go, fp8.Recipe(), is_causal=causal))
    assert counted == {"fp8_fwd": {"no_cuda": 1}, "fp8_bwd": {"no_cuda": 1}}
    want = sdpa64_grads(q, k, v, go, causal)
    assert out.dtype == dtype and out.shape == q.shape
    err, _ = rel_error(out, want[0])
    assert 1e-3 < err <= ATTN_FWD_TOL, f"out: {err:.4f}"
    for name, got, ref, like in zip(("dq", "dk", "dv"), (gq, gk, gv), want[1:], (q, k, v)):
        assert got is not None, f"{name} is missing"
        assert got.dtype == dtype and got.shape == like.shape, name  # GQA: dK, dV in H_k heads
        err, _ = rel_error(got, ref)
        assert 1e-3 < err <= ATTN_GRAD_TOL, f"{name}: {err:.4f}"


def test_attention_equals_forward_and_backward_on_quantised_inputs():
    """The composite is exactly quantize + forward + backward at the recipe's scales."""
    q, k, v, go = attn_inputs(8, 2, 32, torch.float32, seed=31)
    recipe = fp8.Recipe()
    out, gq, gk, gv = run_attention(q, k, v, go, recipe, is_causal=True)
    (q8, dq), (k8, dk), (v8, dv) = (fp8.quantize(t) for t in (q, k, v))
    scale_o = torch.tensor([pow2_below(TOP[E4M3] * 0.875 / v.abs().max().item())])
    fwd = fp8.forward(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=scale_o, is_causal=True,
                      return_lse=True)
    assert torch.equal(out, fwd.out.float() / scale_o)
    g8, dg = fp8.quantize(go)
    state = recipe.state("cpu")
    scales = [torch.tensor([pow2_below(TOP[E4M3] / (2.0 * a))]) for a in state[:4].tolist()]
    res = fp8.backward(g8, q8, k8, v8, fwd.out, fwd.lse, descale_q=dq, descale_k=dk, descale_v=dv,
                       descale_o=1 / scale_o, descale_do=dg, scale_dq=scales[0], scale_dk=scales[1],
                       scale_dv=scales[2], scale_dp=scales[3], is_causal=True)
    for got, stored, sc in zip((gq, gk, gv), (res.dq, res.dk, res.dv), scales):
        assert torch.equal(got, stored.float() / sc)
    assert torch.equal(state[:4], torch.stack([res.amax_dq, res.amax_dk, res.amax_dv, res.amax_dp]))


def test_attention_against_its_own_dequantised_inputs_is_within_the_reference_bounds():
    """Without the inputs' own rounding, attention's error is the reference's (FWD/BWD_REF_TOL)."""
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=32)
    out, gq, gk, gv = run_attention(q, k, v, go, fp8.Recipe())
    qd, kd, vd, god = (deq(*fp8.quantize(t)) for t in (q, k, v, go))
    want = sdpa64_grads(qd, kd, vd, god, False)
    assert rel_error(out, want[0])[0] <= FWD_REF_TOL
    for got, ref in zip((gq, gk, gv), want[1:]):
        assert rel_error(got, ref)[0] <= BWD_REF_TOL


def test_attention_padded_by_lengths():
    q, k, v, go = attn_inputs(8, 2, 32, torch.bfloat16, seed=33)
    lens = (torch.tensor([20, 32]), torch.tensor([24, 9]))
    out, gq, gk, gv = run_attention(q, k, v, go, fp8.Recipe(), is_causal=True, seq_lens_q=lens[0],
                                    seq_lens_kv=lens[1])
    assert torch.all(out[0, :, 20:] == 0) and torch.all(gq[0, :, 20:] == 0)
    assert torch.all(gk[0, :, 24:] == 0) and torch.all(gv[1, :, 9:] == 0)
    want = sdpa64_grads(q, k, v, go, True, lens)
    assert rel_error(out, want[0])[0] <= ATTN_FWD_TOL
    for got, ref in zip((gq, gk, gv), want[1:]):
        assert rel_error(got, ref)[0] <= ATTN_GRAD_TOL


def test_attention_argument_checks():
    q, k, v, _ = attn_inputs(4, 4, 8, torch.float32, seed=34)
    with pytest.raises(TypeError, match="recipe must be a csp.fp8.Recipe or None, got str"):
        fp8.attention(q, k, v, recipe="x")
    with pytest.raises(TypeError, match="FP8 operands go to csp.fp8.forward"):
        fp8.attention(*(fp8.quantize(t)[0] for t in (q, k, v)))
    with pytest.raises(TypeError, match="share one of"):
        fp8.attention(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fp8.attention(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match="pass both seq_lens_q and seq_lens_kv"):
        fp8.attention(q, k, v, seq_lens_kv=torch.tensor([8, 8]))


# ------------------------------------------------------------------------------------ Recipe


def test_recipe_first_call_with_tiny_gradients_reruns_without_flushing_them():
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=40)
    go = go * 1e-5  # far below the first call's scale 1: stored at it, every gradient would be 0
    recipe = fp8.Recipe(scaling="current")  # its re-runs (a delayed recipe's: tests/test_fp8_recipes.py)
    assert recipe.retries == 0
    (out, gq, gk, gv), counted = region(lambda: run_attention(q, k, v, go, recipe, is_causal=True))
    assert recipe.retries >= 1, "tiny gradients at scale 1 flush to zero: the backward must re-run"
    assert counted == {"fp8_fwd": {"no_cuda": 1}, "fp8_bwd": {"no_cuda": 1}}, "a re-run is one call"
    want = sdpa64_grads(q, k, v, go, True)
    for name, got, ref in zip(("dq", "dk", "dv"), (gq, gk, gv), want[1:]):
        assert (got != 0).float().mean() >= (ref != 0).double().mean() - 0.02, f"{name} was flushed to 0"
        assert rel_error(got, ref)[0] <= ATTN_GRAD_TOL, name
    # the state holds this call's amax: the returned maxima are them rounded to e4m3
    state = recipe.state("cpu")
    for i, got in enumerate((gq, gk, gv)):
        assert abs(got.abs().max().item() - state[i].item()) <= U * state[i].item()
    qd, kd, vd = (t.double() for t in (q, k, v))
    s64, _ = scores64(qd, kd, True)
    p = torch.softmax(s64, -1)
    ds = p * (go.double() @ vd.transpose(-1, -2) - (want[0] * go.double()).sum(-1, keepdim=True)) / math.sqrt(32)
    assert state[3].item() == pytest.approx(ds.abs().max().item(), rel=0.15)
    assert state[4].item() == recipe.retries

    retries = recipe.retries
    again = run_attention(q, k, v, go, recipe, is_causal=True)
    assert recipe.retries == retries, "the second identical call starts at the right scales"
    for a, b in zip(again, (out, gq, gk, gv)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("factor", [1e-3, 1e3], ids=["amax_too_small_saturates", "amax_too_large_underflows"])
def test_recipe_with_a_stale_state_reruns_to_the_fresh_result(factor):
    q, k, v, go = attn_inputs(8, 2, 32, torch.float32, seed=41)
    fresh = fp8.Recipe()
    want = run_attention(q, k, v, go, fresh)
    amax = fresh.state("cpu")[:4].clone()
    stale = fp8.Recipe()
    stale.state("cpu")[:4] = amax * factor
    got = run_attention(q, k, v, go, stale)
    assert stale.retries >= 1
    for a, b in zip(got, want):
        # the final scales may differ from the fresh run's, which moves only e4m3-subnormal values
        assert rel_error(a, b)[0] <= 2.0**-8
    assert torch.allclose(stale.state("cpu")[:4], amax, rtol=1e-6)


def test_a_recipe_passed_inline_lives_until_the_backward():
    q, k, v, go = attn_inputs(4, 4, 16, torch.float32, seed=44)
    q, k, v = leaves(q, k, v)
    out = fp8.attention(q, k, v, recipe=fp8.Recipe())  # nothing else holds this Recipe
    gc.collect()
    out.backward(go)
    want = sdpa64_grads(q.detach(), k.detach(), v.detach(), go, False)
    for got, ref in zip((q.grad, k.grad, v.grad), want[1:]):
        assert got is not None and rel_error(got, ref)[0] <= ATTN_GRAD_TOL


def test_recipe_with_e5m2_gradients():
    q, k, v, go = attn_inputs(4, 4, 32, torch.bfloat16, seed=42)
    recipe = fp8.Recipe(grad_dtype=E5M2)
    got = run_attention(q, k, v, go, recipe, is_causal=True)
    want = sdpa64_grads(q, k, v, go, True)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == torch.bfloat16 and rel_error(a, b)[0] <= ATTN_GRAD_TOL


def test_recipe_defaults_and_per_device_state():
    recipe = fp8.Recipe()
    assert recipe.margin == 2.0 and recipe.scale_s == fp8.DEFAULT_SCALE_S and recipe.grad_dtype == E4M3
    state = recipe.state("cpu")
    assert state.shape == (5,) and state.dtype == torch.float32 and torch.all(state == 0)
    assert recipe.state(torch.device("cpu")) is state
    assert "margin=2.0" in repr(recipe)


@pytest.mark.parametrize("kwargs, match", [
    (dict(margin=0.5), "margin"),
    (dict(margin=float("inf")), "margin"),
    (dict(grad_dtype=torch.bfloat16), "grad_dtype"),
    (dict(scale_s=-1.0), "scale_s"),
    (dict(scale_s=0), "scale_s"),
])
def test_recipe_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8.Recipe(**kwargs)


def test_a_scale_s_that_would_saturate_p_is_refused():
    # P~ reaches 1 in every row: scale_s above 448 would store it saturated
    for make in (lambda: fp8.Recipe(scale_s=1024.0),
                 lambda: fp8.forward(**fp8_case(4, 4, 16, 16, seed=44), scale_s=449.0)):
        with pytest.raises(ValueError, match="scale_s must be at most 448"):
            make()
    assert fp8.Recipe(scale_s=448.0).scale_s == 448.0


# ---------------------------------------------------------------------- bad input: forward/backward


@pytest.fixture
def fwd_args():
    return fp8_case(4, 4, 16, 16, seed=50)


def test_forward_fp8_operands_only(fwd_args):
    for name in "qkv":
        bad = dict(fwd_args, **{name: fwd_args[name].float().bfloat16()})
        with pytest.raises(TypeError, match=f"{name} must be torch.float8_e4m3fn"):
            fp8.forward(**bad)


@pytest.mark.parametrize("name", ["descale_q", "descale_k", "descale_v", "scale_o"])
def test_forward_factor_checks(fwd_args, name):
    with pytest.raises(ValueError, match=f"{name} must be a one-element float32 tensor"):
        fp8.forward(**dict(fwd_args, **{name: torch.ones(2)}))
    with pytest.raises(ValueError, match=name):
        fp8.forward(**dict(fwd_args, **{name: torch.ones(1, dtype=torch.float64)}))
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        fp8.forward(**dict(fwd_args, **{name: None}))


def test_forward_shape_checks(fwd_args):
    a = fwd_args
    with pytest.raises(ValueError, match="batch/sequence sizes disagree"):
        fp8.forward(**dict(a, k=a["k"][:1], v=a["v"][:1]))
    six = fp8.quantize(randn(2, 6, 16, 32, g=gen(51)))[0]
    with pytest.raises(ValueError, match="H_q=6 must be a multiple of H_k=4"):
        fp8.forward(**dict(a, q=six))
    with pytest.raises(ValueError, match="must be 4-D"):
        fp8.forward(**dict(a, q=a["q"][0]))
    with pytest.raises(ValueError, match="head dims differ"):
        fp8.forward(**dict(a, k=a["k"][..., :16]))
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        fp8.forward(**a, is_causal="yes")
    with pytest.raises(ValueError, match="scale_s"):
        fp8.forward(**a, scale_s=0.0)


def test_forward_length_checks(fwd_args):
    a = fwd_args
    with pytest.raises(ValueError, match="pass both seq_lens_q and seq_lens_kv"):
        fp8.forward(**dict(a, seq_lens_q=torch.tensor([4, 4])))
    with pytest.raises(ValueError, match=r"seq_lens_q\[0\] = 17 is outside \[0, S_q = 16\]"):
        fp8.forward(**dict(a, seq_lens_q=torch.tensor([17, 4]), seq_lens_kv=torch.tensor([4, 4])))
    with pytest.raises(ValueError, match=r"seq_lens_kv\[1\] = -1"):
        fp8.forward(**dict(a, seq_lens_q=torch.tensor([4, 4]), seq_lens_kv=torch.tensor([4, -1])))
    with pytest.raises(ValueError, match=r"seq_lens_q must have shape \(2,\)"):
        fp8.forward(**dict(a, seq_lens_q=torch.tensor([4]), seq_lens_kv=torch.tensor([4, 4])))


@pytest.fixture
def bwd_args():
    case = bwd_case(4, 4, 16, False, seed=52)
    c, fwd = case["c"], case["fwd"]
    return (case["g8"], c["q"], c["k"], c["v"], fwd.out, fwd.lse), case["args"]


def test_backward_checks(bwd_args):
    (g8, q, k, v, out, lse), kw = bwd_args
    fp8.backward(g8, q, k, v, out, lse, **kw)  # the unchanged call is fine
    with pytest.raises(TypeError, match="grad_out must be float8_e4m3fn or float8_e5m2"):
        fp8.backward(g8.float().bfloat16(), q, k, v, out, lse, **kw)
    with pytest.raises(TypeError, match="out float8_e4m3fn"):
        fp8.backward(g8, q, k, v, out.float().bfloat16(), lse, **kw)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 16, 1\)"):
        fp8.backward(g8, q, k, v, out, lse[..., 0], **kw)
    with pytest.raises(TypeError, match="lse must be a torch.Tensor"):
        fp8.backward(g8, q, k, v, out, None, **kw)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        fp8.backward(g8[:, :, :8], q, k, v, out, lse, **kw)
    with pytest.raises(TypeError, match="k must be torch.float8_e4m3fn"):
        fp8.backward(g8, q, k.float(), v, out, lse, **kw)
    for name in ("descale_o", "descale_do", "scale_dq", "scale_dp"):
        with pytest.raises(ValueError, match=name):
            fp8.backward(g8, q, k, v, out, lse, **dict(kw, **{name: torch.ones(2)}))
    with pytest.raises(ValueError, match="descale_do"):
        fp8.backward(g8, q, k, v, out, lse, **dict(kw, descale_do=torch.ones(1, dtype=torch.float64)))


def test_backward_out_none_is_a_type_error_naming_out(bwd_args):
    (g8, q, k, v, out, lse), kw = bwd_args
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        fp8.backward(g8, q, k, v, None, lse, **kw)


# --------------------------------------------------------------------------------- ops: opcheck

# test_schema is left out: it compares the op's outputs with torch's own ops, and CPU has no
# float8 arithmetic kernels ('"mul_cpu_reduced_float" not implemented for Float8_e4m3fn').
OPCHECK = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")

#: id: (h_q, h_k, causal, lens)
OP_CASES = {
    "plain": (4, 4, False, None),
    "causal": (4, 4, True, None),
    "padded": (4, 4, False, ([12, 16], [16, 5])),
    "gqa_causal_padded": (8, 2, True, ([16, 9], [10, 16])),
}


def op_fwd_args(h_q, h_k, causal, lens, compute_lse=True):
    c = fp8_case(h_q, h_k, 16, 16, d=32, seed=60, lens=lens)
    return (c["q"], c["k"], c["v"], c["descale_q"], c["descale_k"], c["descale_v"], c["scale_o"], c["seq_lens_q"],
            c["seq_lens_kv"], 32**-0.5, 256.0, causal, compute_lse, True)


#: recipe id -> Recipe, for the op-level tests (the op finds a recipe by id while it lives)
LIVE_RECIPES: dict = {}


def op_bwd_args(h_q, h_k, causal, lens, with_state):
    """fp8_bwd's arguments; ``with_state``: through a Recipe (by id) whose state is seeded, else fixed scales."""
    fargs = op_fwd_args(h_q, h_k, causal, lens)
    out, lse, _ = OPS.fp8_fwd(*fargs)
    g8, dg = fp8.quantize(randn(*out.shape, g=gen(61)), E5M2)
    q, k, v, dq, dk, dv, so, lq, lk = fargs[:9]
    scales = None if with_state else torch.tensor([64.0, 32.0, 128.0, 256.0])
    recipe_id = 0
    if with_state:
        recipe = fp8.Recipe()
        recipe.state("cpu").copy_(torch.tensor([2.0, 1.5, 3.0, 0.5, 0.0]))
        recipe_id = recipe.id
        LIVE_RECIPES[recipe_id] = recipe
    return (g8, q, k, v, out, lse, dq, dk, dv, 1 / so, dg, scales, recipe_id, lq, lk, 32**-0.5, 256.0, 2.0, causal,
            True)


@pytest.mark.parametrize("compute_lse", [True, False], ids=["lse", "no_lse"])
@pytest.mark.parametrize("name", list(OP_CASES))
def test_opcheck_fp8_fwd(name, compute_lse):
    torch.library.opcheck(OPS.fp8_fwd, op_fwd_args(*OP_CASES[name], compute_lse=compute_lse), test_utils=OPCHECK)


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "scales"])
@pytest.mark.parametrize("name", list(OP_CASES))
def test_opcheck_fp8_bwd(name, with_state):
    torch.library.opcheck(OPS.fp8_bwd, op_bwd_args(*OP_CASES[name], with_state), test_utils=OPCHECK)


def transposed_fp8(b, h, s, d, seed):
    """An e4m3 (B, H, S, D) view of (B, S, H, D) storage: the layout of q/k/v projections."""
    return fp8.quantize(randn(b, s, h, d, g=gen(seed)).transpose(1, 2))


def test_opcheck_fp8_fwd_on_transposed_operands():
    (q, dq), (k, dk), (v, dv) = (transposed_fp8(2, 4, 16, 32, s) for s in (62, 63, 64))
    assert not q.is_contiguous()
    torch.library.opcheck(OPS.fp8_fwd, (q, k, v, dq, dk, dv, torch.tensor([32.0]), None, None, 32**-0.5, 256.0,
                                        True, True, True), test_utils=OPCHECK)


def test_opcheck_fp8_bwd_on_transposed_operands():
    (q, dq), (k, dk), (v, dv) = (transposed_fp8(2, 4, 16, 32, s) for s in (65, 66, 67))
    so = torch.tensor([32.0])
    out, lse, _ = OPS.fp8_fwd(q, k, v, dq, dk, dv, so, None, None, 32**-0.5, 256.0, False, True, True)
    g8, dg = fp8.quantize(randn(*out.shape, g=gen(68)))
    args = (g8, q, k, v, out, lse, dq, dk, dv, 1 / so, dg, torch.tensor([64.0] * 4), 0, None, None, 32**-0.5,
            256.0, 2.0, False, True)
    torch.library.opcheck(OPS.fp8_bwd, args, test_utils=("test_faketensor",))


def test_fp8_bwd_with_a_recipe_updates_its_state_and_returns_the_scales_it_used():
    args = list(op_bwd_args(8, 2, True, None, with_state=True))
    state = LIVE_RECIPES[args[12]].state("cpu")
    state[:4] = 0.0  # a fresh recipe: every scale starts at 1 and is re-run from this call's amax
    dq, dk, dv, used, amax = OPS.fp8_bwd(*args)
    assert torch.equal(state[:4], amax) and state[4].item() >= 1
    want = torch.tensor([pow2_below(TOP[E4M3] / (2.0 * a)) for a in amax.tolist()])
    assert torch.equal(used, want), "scales are largest e4m3 / (margin x amax), as powers of 2"
    for t in (dq, dk, dv):
        assert t.dtype == E4M3 and t.float().abs().max().item() <= TOP[E4M3] / 2 * (1 + U)


def test_fp8_bwd_with_scales_returns_a_copy_of_them():
    args = op_bwd_args(4, 4, False, None, with_state=False)
    scales = args[11]
    kept = scales.clone()
    *_, used, _ = OPS.fp8_bwd(*args)
    assert torch.equal(used, kept)
    used.mul_(2)
    assert torch.equal(scales, kept), "the returned scales must not alias the input"


def test_fake_kernels_give_shapes_and_dtypes_and_run_nothing():
    fargs = op_fwd_args(8, 2, True, ([16, 9], [10, 16]))
    bargs = op_bwd_args(8, 2, True, ([16, 9], [10, 16]), with_state=True)
    before = counters.stats()
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse, amax = OPS.fp8_fwd(*fargs)
        none_lse = OPS.fp8_fwd(*fargs[:12], False, True)[1]
        dq, dk, dv, used, bamax = OPS.fp8_bwd(*bargs)
    assert out.shape == (2, 8, 16, 32) and out.dtype == E4M3
    assert lse.shape == (2, 8, 16, 1) and lse.dtype == torch.float32 and none_lse.shape == (0,)
    assert amax.shape == (2,) and amax.dtype == torch.float32
    assert dq.shape == (2, 8, 16, 32) and dk.shape == dv.shape == (2, 2, 16, 32)
    assert all(t.dtype == E4M3 for t in (dq, dk, dv))
    assert used.shape == bamax.shape == (4,)
    assert (counters.stats() - before).to_dict() == {p: {"served": 0, "fallback": {}} for p in csp.PATHS}


# ------------------------------------------------------------------------------- torch.compile


def _compile_run(fn, q, k, v, go, recipe):
    q, k, v = leaves(q, k, v)
    out = fn(q, k, v, recipe)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def test_compiled_forward_and_backward_equal_eager():
    torch._dynamo.reset()
    q, k, v, go = attn_inputs(8, 2, 32, torch.float32, seed=70)

    def fn(q, k, v, recipe):
        return fp8.attention(q, k, v, is_causal=True, recipe=recipe) * 2.0

    start = torch.tensor([1.0, 0.5, 2.0, 0.25, 0.0])  # the same state for both runs
    # current scaling: its state alone decides (delayed: tests/test_fp8_recipes.py)
    eager_recipe, compiled_recipe = fp8.Recipe(scaling="current"), fp8.Recipe(scaling="current")
    eager_recipe.state("cpu").copy_(start)
    compiled_recipe.state("cpu").copy_(start)
    want = _compile_run(fn, q, k, v, go, eager_recipe)
    compiled = torch.compile(fn, fullgraph=True)
    (got), counted = region(lambda: _compile_run(compiled, q, k, v, go, compiled_recipe))
    assert counted == {"fp8_fwd": {"no_cuda": 1}, "fp8_bwd": {"no_cuda": 1}}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-6 * b.abs().max().item(), name
    assert torch.equal(compiled_recipe.state("cpu"), eager_recipe.state("cpu")), "the state moves the same way"
    again = _compile_run(compiled, q, k, v, go, compiled_recipe)  # the state as left by the first call
    for a, b in zip(again, got):
        assert torch.equal(a, b)


def test_compiled_with_a_fresh_recipe():
    torch._dynamo.reset()
    q, k, v, go = attn_inputs(4, 4, 16, torch.float32, seed=71)

    def fn(q, k, v, recipe):
        return fp8.attention(q, k, v, recipe=recipe)

    want = _compile_run(fn, q, k, v, go, fp8.Recipe())
    got = _compile_run(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, go, fp8.Recipe())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_compiled_with_transposed_inputs():
    torch._dynamo.reset()
    g = gen(72)
    q, k, v = (randn(2, 16, 4, 32, g=g).transpose(1, 2) for _ in range(3))
    go = randn(2, 4, 16, 32, g=g)

    def fn(q, k, v, recipe):
        return fp8.attention(q, k, v, recipe=recipe)

    recipes = [fp8.Recipe(), fp8.Recipe()]
    for r in recipes:
        r.state("cpu")
    want = _compile_run(fn, q, k, v, go, recipes[0])
    got = _compile_run(torch.compile(fn, fullgraph=True), q, k, v, go, recipes[1])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- counters, strict


def test_counters_record_no_cuda_on_both_paths():
    q, k, v, go = attn_inputs(4, 4, 16, torch.bfloat16, seed=80)
    csp.reset_stats()
    run_attention(q, k, v, go, fp8.Recipe(), is_causal=True)
    stats = csp.stats().to_dict()
    assert stats["fp8_fwd"] == {"served": 0, "fallback": {"no_cuda": 1}}
    assert stats["fp8_bwd"] == {"served": 0, "fallback": {"no_cuda": 1}}
    assert all(stats[p] == {"served": 0, "fallback": {}} for p in csp.PATHS if not p.startswith("fp8_"))
    c = fp8_case(4, 4, 16, 16, seed=81)
    fp8.forward(**c)
    fp8.forward(**c)
    assert csp.stats().to_dict()["fp8_fwd"]["fallback"] == {"no_cuda": 3}


def test_strict_mode_refuses_fp8_calls():
    q, k, v, _ = attn_inputs(4, 4, 16, torch.float32, seed=82)
    c = fp8_case(4, 4, 16, 16, seed=83)
    before = counters.stats()
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            fp8.attention(q, k, v, recipe=fp8.Recipe())
        assert info.value.path == "fp8_fwd" and info.value.reasons == ["no_cuda"]
        with pytest.raises(csp.FallbackError) as info:
            fp8.forward(**c)
        assert info.value.path == "fp8_fwd"
    assert (counters.stats() - before).refused_dict() == {"fp8_fwd": {"no_cuda": 2}}
    with csp.enable():  # not strict: the same calls fall back
        fp8.forward(**c)


def test_strict_mode_refuses_the_backward():
    case = bwd_case(4, 4, 16, False, seed=84)
    c, fwd = case["c"], case["fwd"]
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            fp8.backward(case["g8"], c["q"], c["k"], c["v"], fwd.out, fwd.lse, **case["args"])
    assert info.value.path == "fp8_bwd" and info.value.reasons == ["no_cuda"]


def test_compiled_strict_refuses_at_run_time():
    torch._dynamo.reset()
    q, k, v, _ = attn_inputs(4, 4, 16, torch.float32, seed=85)
    recipe = fp8.Recipe()
    compiled = torch.compile(lambda q: fp8.attention(q, k, v, recipe=recipe), backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(q)
        with csp.enable(strict=True):
            with pytest.raises(csp.FallbackError):
                compiled(q)


# --------------------------------------------------------------------------------- support rules

HOPPER = Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900)


def fp8_problem(d=128, backward=False, grad_dtype=E4M3, padded=False, device="meta"):
    def t(h):
        return torch.empty(2, h, 64, d, dtype=E4M3, device=device)

    p = fp8_ops.problem(t(8), t(2), t(2), padded, backward, grad_dtype if backward else None)
    return dataclasses.replace(p, device_type="cuda") if device == "meta" else p


def slugs(p, c=HOPPER):
    return [r.slug for r in support.reasons(p, c)]


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_fp8_served_on_hopper_with_cudnn_9_19_at_d_128(backward):
    p = fp8_problem(backward=backward)
    assert p.kind == "fp8" and p.path == ("fp8_bwd" if backward else "fp8_fwd")
    assert len(p.dtypes) == (4 if backward else 3)
    assert support.reasons(p, HOPPER) == []
    padded = support.reasons(dataclasses.replace(p, padded=True), HOPPER)
    # a padded backward: the known-issues row (wrong dK/dV on cuDNN 9.19, sm_90, run 65); the forward is served
    assert [r.slug for r in padded] == (["cudnn_known_issue"] if backward else [])
    assert support.reasons(p, dataclasses.replace(HOPPER, cudnn_version=support.FP8_MIN)) == []


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_fp8_needs_hopper_and_cudnn_9_14(backward):
    p = fp8_problem(backward=backward)
    assert slugs(p, dataclasses.replace(HOPPER, compute_capability=(8, 9))) == ["compute_capability"]
    assert slugs(p, dataclasses.replace(HOPPER, compute_capability=(8, 0))) == ["compute_capability"]
    assert slugs(p, dataclasses.replace(HOPPER, cudnn_version=91300)) == ["cudnn_feature"]
    assert slugs(p, dataclasses.replace(HOPPER, compute_capability=(10, 0))) == []
    # the dense rules are unchanged: cc 8.9 serves bf16 dense attention
    dense = dataclasses.replace(p, kind="dense", dtypes=(torch.bfloat16,) * 3)
    assert slugs(dense, dataclasses.replace(HOPPER, compute_capability=(8, 9))) == []


def test_fp8_backward_head_dim_on_sm90():
    assert slugs(fp8_problem(d=64, backward=True)) == ["head_dim"]
    assert slugs(fp8_problem(d=64, backward=False)) == []
    assert slugs(dataclasses.replace(fp8_problem(backward=True), d_v=64)) == ["head_dim"]
    assert slugs(fp8_problem(d=64, backward=True), dataclasses.replace(HOPPER, compute_capability=(10, 0))) == []
    assert slugs(fp8_problem(d=60, backward=False)) == ["head_dim"]  # the generic rule still holds


def test_fp8_dtype_rules():
    assert slugs(fp8_problem(backward=True, grad_dtype=E5M2)) == []
    assert slugs(fp8_problem(backward=True, grad_dtype=torch.bfloat16)) == ["dtype"]
    assert slugs(dataclasses.replace(fp8_problem(), dtypes=(torch.bfloat16,) * 3)) == ["dtype"]
    assert slugs(dataclasses.replace(fp8_problem(), dtypes=(E4M3, E5M2, E4M3))) == ["dtype"]
    message = support.reasons(fp8_problem(backward=True, grad_dtype=torch.bfloat16), HOPPER)[0].message
    assert "bfloat16" in message and "float8_e4m3fn" in message


def test_fp8_problem_of_cpu_tensors_is_no_cuda():
    p = fp8_problem(device="cpu")
    assert p.device_type == "cpu" and slugs(p) == ["no_cuda"]


def test_a_recipe_dropped_from_the_registry_raises_naming_the_fix(monkeypatch):
    q, k, v, go = attn_inputs(4, 4, 16, torch.float32, seed=45)
    q, k, v = leaves(q, k, v)
    monkeypatch.setattr(fp8_ops, "KEEP", 2)
    out = fp8.attention(q, k, v, recipe=fp8.Recipe())
    fp8.Recipe(), fp8.Recipe()  # two newer recipes push the call's out of a registry of 2
    with pytest.raises(RuntimeError, match="reuse one csp.fp8.Recipe per model or layer"):
        out.backward(go)


@pytest.mark.parametrize("score_bytes", [1, 4 * 2 * 16 * 16 * 4, 2 * 8 * 16 * 16 * 4], ids=["one_head", "two_heads", "two_rows"])
def test_the_reference_backward_in_slices_equals_the_whole(monkeypatch, score_bytes):
    """A padded FP8 backward runs the reference (the known-issues row): sliced over batch rows and
    KV heads to bound its score tensors, it must give the whole call's values (GQA 8/2, padded)."""
    from cudnn_sdpa_provider.ops import fp8_reference

    c = fp8_case(8, 2, 16, 16, d=32, b=3, seed=70, lens=([16, 9, 3], [16, 12, 3]))
    g8, ddo = fp8.quantize(randn(3, 8, 16, 32, g=gen(71)))
    out8, _, _ = fp8_reference.forward(c["q"], c["k"], c["v"], c["descale_q"], c["descale_k"], c["descale_v"],
                                       c["scale_o"], c["seq_lens_q"], c["seq_lens_kv"], 32 ** -0.5, 256.0, True,
                                       False)
    args = (g8, c["q"], c["k"], c["v"], out8, (c["descale_q"], c["descale_k"], c["descale_v"], 1 / c["scale_o"], ddo),
            torch.tensor([4.0, 4.0, 4.0, 256.0]), c["seq_lens_q"], c["seq_lens_kv"], 32 ** -0.5, 256.0, True,
            (torch.float8_e4m3fn,) * 3)
    whole = fp8_reference.backward(*args)
    calls = []
    real = fp8_reference._backward
    monkeypatch.setattr(fp8_reference, "_backward", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(fp8_reference, "SCORE_BYTES", score_bytes)
    sliced = fp8_reference.backward(*args)
    assert len(calls) > 1 and all(s[0] * s[1] * s[2] * s[2] * 4 <= max(score_bytes, 4 * 16 * 16 * 4) for s in calls)
    for a, b in zip(whole, sliced):
        bits = (lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t)  # noqa: E731
        assert torch.equal(bits(a), bits(b))
