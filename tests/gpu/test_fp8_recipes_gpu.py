"""GPU tier: issue #30's quantisation and recipes on the device (Hopper or newer, cuDNN's FP8 graphs).

* both recipes against fp32 attention on bf16 randn activations over three calls on one recipe
  (the delayed one's first call is current scaling; the next two take the history), nothing
  saturated, the delayed recipe's error within 1.25x (+0.005) of current scaling's on the same
  inputs: at run 44's configuration ((2, 8/H_k, 2048, 128) causal, H_k 8 and 2; both within
  tests/gpu/test_fp8.py's end-to-end bounds) and at the bench's 4k shapes ((1, 32, 4096, 128),
  (4, 32/8, 4096, 128), causal and not). The issue's 7% / 11% summary of run 44 is not a bound
  over seeds: run 56 measured dQ 12.6% of max at H_k 2 on a third seed, identical under both
  scalings, and 15.9% on the output of the non-causal (1, 32, 4096, 128) call;
* the Triton kernels (the GPU's own FP8 cast and the integer one the CPU tests check), those that
  quantise q, k, v together with the forward's factors and turn the output back, and the
  torch.compile'd path give the torch path's bits on the device, inputs near the format's top,
  subnormals, signed zeros, +-inf and NaN included, for both scalings; ``csp.fp8.attention`` with
  the Triton kernels forced gives the torch path's output and gradients bit for bit;
* a warm delayed recipe's forward and backward make no host-device sync; a jump in amax is
  redone (q) and counted in ``csp.stats().fp8_saturated``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.ops import fp8_quant
from tests.test_fp8_recipes import hard_inputs, same_bits, same_value
from tests.util import no_host_syncs

pytestmark = pytest.mark.gpu
DEV = "cuda"
E2E_VS_FP32, E2E_GRAD_VS_FP32 = 0.08, 0.15  # tests/gpu/test_fp8.py's end-to-end bounds (run 44)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

#: (B, H_q, H_kv, S, D): the configurations of run 44, where the issue's bars were measured
BARS = {"run44_hk8": (2, 8, 8, 2048, 128), "run44_hk2": (2, 8, 2, 2048, 128)}
#: the bench's fp8 shapes at 4k
SHAPES = {"mha_1x32": (1, 32, 32, 4096, 128), "gqa_4x32_8": (4, 32, 8, 4096, 128)}
#: delayed against current scaling at the bench's shapes: the history's scale (margin 2) costs at
#: most one bit of range at the bottom of e4m3, so its error is current scaling's, give or take
DELAYED_VS_CURRENT = 1.25
DELAYED_SLACK = 0.005


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _bf16(b, h, hk, s, d, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, h, s, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, s, d, device=DEV, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    go = torch.randn(b, h, s, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    return q, k, v, go


def _fp32(q, k, v, go, causal):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(go.float())
    return out.detach(), [t.grad for t in leaves]


def _errors(shape, scaling, causal):
    """[(output error, [dq, dk, dv errors])] against fp32 over three calls on one recipe; the
    counters say each call was served and nothing saturated."""
    b, h, hk, s, d = shape
    recipe = csp.fp8.Recipe(scaling=scaling)
    before = counters.stats()
    errors = []
    for step in range(3):
        q, k, v, go = _bf16(b, h, hk, s, d, seed=10 * step + hk)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = csp.fp8.attention(*leaves, is_causal=causal, recipe=recipe)
        out.backward(go)
        ref, grads = _fp32(q, k, v, go, causal)
        errors.append((_rel(out, ref), [_rel(t.grad, g) for t, g in zip(leaves, grads)]))
        del ref, grads, leaves, out
    delta = counters.stats() - before
    print(f"{shape} {scaling} causal={causal}: out, dq/dk/dv errors per call "
          f"{[(round(o, 4), [round(e, 4) for e in g]) for o, g in errors]}; retries {recipe.retries}")
    assert delta.to_dict()["fp8_fwd"] == {"served": 3, "fallback": {}}
    assert delta.to_dict()["fp8_bwd"] == {"served": 3, "fallback": {}}
    assert recipe.saturated == 0 and delta.fp8_saturated == 0
    return errors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [*BARS, *SHAPES])
def test_delayed_scaling_is_as_accurate_as_current_scaling(shape, causal):
    """Both recipes on the same inputs, three calls each: the delayed recipe's error within 1.25x
    (+0.005) of current scaling's, tensor by tensor; at run 44's configuration (causal), both within
    the FP8 end-to-end bounds of tests/gpu/test_fp8.py. (Both scalings are powers of 2, so they
    differ only in what falls to e4m3's subnormals: runs 53 and 56 measured identical errors to 4 digits.)"""
    if shape in BARS and not causal:
        pytest.skip("run 44 measured the causal call")
    dims = BARS.get(shape) or SHAPES[shape]
    current = _errors(dims, "current", causal)
    delayed = _errors(dims, "delayed", causal)
    for step, ((c_out, c_grads), (d_out, d_grads)) in enumerate(zip(current, delayed)):
        for name, c, d in zip(("out", "dq", "dk", "dv"), (c_out, *c_grads), (d_out, *d_grads)):
            assert d <= DELAYED_VS_CURRENT * c + DELAYED_SLACK, f"step {step} {name}: delayed {d:.4f}, current {c:.4f}"
        if shape in BARS:
            for scaling, (e_out, e_grads) in (("current", current[step]), ("delayed", delayed[step])):
                assert e_out <= E2E_VS_FP32 and max(e_grads) <= E2E_GRAD_VS_FP32, \
                    f"{scaling} step {step}: {e_out}, {e_grads}"


def _cuda_inputs(seed, dtype, fmt):
    return [x.to(DEV) for x in hard_inputs(seed, dtype, fmt)]


@pytest.mark.parametrize("soft", [False, True], ids=["gpu_cast", "integer_cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_triton_kernels_give_the_torch_path_s_bits_on_the_device(fmt, dtype, soft):
    from cudnn_sdpa_provider.ops import fp8_quant_triton as tri

    big = torch.randn(1, 32, 4096, 128, device=DEV, dtype=torch.bfloat16).to(dtype)  # many blocks, one amax
    for i, x in enumerate(_cuda_inputs(20, dtype, fmt) + [big]):
        dense = x if fp8_quant.dense(x) else x.contiguous()
        for margin in (1.0, 2.0):
            want = fp8_quant.current(x, fmt, margin=margin, impl="torch")
            got = tri.current(dense, fmt, margin, soft_cast=soft)
            same_bits(got[0], want[0], f"current input {i} margin {margin}")
            same_value(got[1], want[1], "descale")
            assert got[0].stride() == want[0].stride()
    histories = [fp8_quant.History.zeros(4, 8, DEV) for _ in range(2)]
    total = torch.zeros(1, dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(21)
    for step, mag in enumerate([1.0, 1.0, 40.0, 1e-4, 1.0, float("nan"), 0.0, 3.0, 1.0]):
        x = (torch.randn(8, 4096, 33, device=DEV, generator=gen) * mag).to(dtype)
        want = fp8_quant.delayed(x, fmt, histories[0], 3, margin=2.0, impl="torch")
        got = tri.delayed(x, fmt, histories[1], 3, 2.0, total, fp8_quant.UNDER, soft_cast=soft)
        same_bits(got[0], want[0], f"delayed step {step}")
        same_value(got[1], want[1], f"delayed step {step} descale")
        for field in ("amax", "row", "saturated"):
            assert torch.equal(getattr(histories[0], field), getattr(histories[1], field)), f"step {step}: {field}"
    # the 40x jump saturates, and so may the 3x step after a history of ~5 (margin 2 leaves 2-4x of
    # headroom; a million randn values reach ~5.1): the kernels count what the torch path counts
    assert total.item() == histories[0].saturated[3].item() >= 1


@pytest.mark.parametrize("soft", [False, True], ids=["gpu_cast", "integer_cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_grouped_kernels_give_the_torch_path_s_bits_on_the_device(dtype, soft):
    """q, k, v quantised together (two launches, the factors written by the second) against one
    tensor at a time on the torch path with ``forward_factors``, current and delayed (history and
    counters included), and ``dequantize`` on every e4m3fn bit pattern; what must pass before
    ``fp8_quant.GROUPED_VERIFIED`` lists this GPU."""
    from cudnn_sdpa_provider.ops import fp8_quant_triton as tri

    def compare(got, want, what):
        for i, name in enumerate(("q8", "k8", "v8")):
            same_bits(got[i], getattr(want, name), f"{what} {name}")
        for i, name in enumerate(fp8_quant.FACTORS):
            same_value(got[3][i, :1], getattr(want, name).reshape(1).float(), f"{what} {name}")

    inputs = _cuda_inputs(23, dtype, E4M3)
    big = [torch.randn(1, 32, 4096, 128, device=DEV, dtype=torch.bfloat16).to(dtype) * m for m in (1.0, 5.0, 0.1)]
    for i in range(len(inputs) - 2):
        triple = [x if fp8_quant.dense(x) else x.contiguous() for x in inputs[i:i + 3]]
        want = fp8_quant.attention_inputs(*triple, E4M3, impl="torch")
        compare(tri.inputs(*triple, E4M3, 1.0, soft_cast=soft), want, f"current {i}")
    compare(tri.inputs(*big, E4M3, 1.0, soft_cast=soft), fp8_quant.attention_inputs(*big, E4M3, impl="torch"),
            "current (1, 32, 4096, 128)")
    histories = [fp8_quant.History.zeros(4, 8, DEV) for _ in range(2)]
    total = torch.zeros(1, dtype=torch.int32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(24)
    steps = [(1, 1, 1), (1, 1, 1), (40, 1, 1), (1, 1e-4, 1), (1, 1, 1), (1, float("nan"), 1), (1, 1, 0), (3, 3, 3)]
    for step, mags in enumerate(steps):
        q, k, v = ((torch.randn(8, 4096, 33 + j, device=DEV, generator=gen) * m).to(dtype) for j, m in enumerate(mags))
        want = fp8_quant.attention_inputs(q, k, v, E4M3, histories[0], margin=2.0, impl="torch")
        compare(tri.inputs(q, k, v, E4M3, 2.0, histories[1], 0, total, fp8_quant.UNDER, soft_cast=soft), want,
                f"delayed step {step}")
        for field in ("amax", "row", "saturated"):
            assert torch.equal(getattr(histories[0], field), getattr(histories[1], field)), f"step {step}: {field}"
    assert total.item() == histories[0].saturated[:3].sum().item() >= 1
    every = torch.arange(256, dtype=torch.uint8, device=DEV).view(E4M3).repeat(3000)
    for factor in (1.0, 2.0**-9, 2.0**-20, 2.0**-26, float("nan")):
        f = torch.tensor([factor], device=DEV)
        got, want = tri.dequantize(every, f, dtype, soft_cast=soft), every.to(dtype) * f.to(dtype)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"dequantize x {factor}"
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite]) and torch.equal(torch.signbit(got[finite]),
                                                                      torch.signbit(want[finite])), f"x {factor}"


@pytest.mark.parametrize("soft", [False, True], ids=["gpu_cast", "integer_cast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_backward_s_triton_twins_give_the_aten_code_s_bits_on_the_device(dtype, soft):
    """tests/test_fp8_recipes.py's ``check_grad_twins`` on the device: the warm delayed backward's
    gradient scales and books, and dq, dk, dv turned back in one launch, as the aten code."""
    from tests.test_fp8_recipes import check_grad_twins

    check_grad_twins(dtype, device=DEV, soft_cast=soft)


def test_forced_triton_attention_matches_the_torch_path(monkeypatch):
    """``csp.fp8.attention`` with ``CUDNN_SDPA_PROVIDER_FP8_QUANT=triton`` (q, k, v together, the
    output turned back in one pass) gives the torch path's output bit for bit under both recipes
    over three calls, and its gradients within 2% of max of the torch path's (the backward's own
    run-to-run rounding: dQ is accumulated in any order)."""
    q, k, v, go = _bf16(2, 8, 2, 2048, 128, seed=5)
    results = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("CUDNN_SDPA_PROVIDER_FP8_QUANT", impl)
        for scaling in ("delayed", "current"):
            recipe = csp.fp8.Recipe(scaling=scaling)
            for step in range(3):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = csp.fp8.attention(*leaves, is_causal=True, recipe=recipe)
                out.backward(go)
                results[impl, scaling, step] = [out.detach()] + [t.grad for t in leaves]
    for (impl, scaling, step), got in results.items():
        if impl == "triton":
            want = results["torch", scaling, step]
            assert torch.equal(got[0], want[0]), f"{scaling} step {step}: the outputs differ"
            for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
                assert _rel(a, b) <= 0.02, f"{scaling} step {step} {name}: {_rel(a, b)}"


def test_the_compiled_path_gives_the_torch_path_s_bits_on_the_device():
    torch._dynamo.reset()
    for i, x in enumerate(_cuda_inputs(22, torch.bfloat16, E4M3)):
        want = fp8_quant.current(x, E4M3, impl="torch")
        got = fp8_quant.current(x, E4M3, impl="compiled")
        same_bits(got[0], want[0], f"compiled current {i}")
        same_value(got[1], want[1])
    h = [fp8_quant.History.zeros(4, 8, DEV) for _ in range(2)]
    for step, mag in enumerate([1.0, 1.0, 40.0, 1.0]):
        x = torch.randn(4, 1000, device=DEV, dtype=torch.bfloat16) * mag
        same_bits(fp8_quant.delayed(x, E4M3, h[1], 0, margin=2.0, impl="compiled")[0],
                  fp8_quant.delayed(x, E4M3, h[0], 0, margin=2.0, impl="torch")[0], f"compiled delayed {step}")
    assert torch.equal(h[0].amax, h[1].amax) and torch.equal(h[0].saturated, h[1].saturated)


def test_auto_picks_triton_on_a_verified_gpu():
    """``auto`` takes the kernels only where ``VERIFIED`` lists this GPU (add it once this file passes)."""
    x = torch.zeros(1, device=DEV)
    verified = torch.cuda.get_device_capability(DEV) in fp8_quant.VERIFIED
    assert fp8_quant.choose("auto", x) == ("triton" if verified else "torch")
    assert fp8_quant.choose("triton", x) == "triton"


def test_a_warm_delayed_recipe_makes_no_host_sync():
    q, k, v, go = _bf16(1, 32, 8, 4096, 128, seed=3)
    recipe = csp.fp8.Recipe(scaling="delayed")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    csp.fp8.attention(*leaves, is_causal=True, recipe=recipe).backward(go)  # the first backward syncs
    torch.cuda.synchronize()
    with no_host_syncs():
        for _ in range(2):
            out = csp.fp8.attention(*leaves, is_causal=True, recipe=recipe)
            out.backward(go)
    torch.cuda.synchronize()
    assert recipe.saturated == 0


def test_a_jump_in_amax_is_redone_and_counted_on_the_device():
    """q x 4 after a call at q: the history's scale would clip q, so q is quantised again at its own
    scale (current scaling's bits exactly), the call is counted, and the output is as close to fp32
    as an all-current call's. (Run 53 compared the output with an all-current call instead: 1.39% of max apart,
    k and v being stored a factor 2 apart, so that comparison cannot tell a clipped q apart.)"""
    q, k, v, go = _bf16(1, 32, 8, 4096, 128, seed=4)
    recipe = csp.fp8.Recipe(scaling="delayed")
    csp.fp8.attention(q, k, v, is_causal=True, recipe=recipe)
    held = recipe.history(DEV)
    before_call = fp8_quant.History(held.amax.clone(), held.row.clone(), held.saturated.clone())
    before = counters.stats()
    out = csp.fp8.attention(q * 4, k, v, is_causal=True, recipe=recipe)
    assert (counters.stats() - before).fp8_saturated == 1 and recipe.history(DEV).saturated[0].item() == 1
    ref, _ = _fp32(q * 4, k, v, go, True)
    fresh = csp.fp8.attention(q * 4, k, v, is_causal=True, recipe=csp.fp8.Recipe(scaling="current"))
    assert _rel(out, ref) <= DELAYED_VS_CURRENT * _rel(fresh, ref) + DELAYED_SLACK
    # the quantisation the call made of q, replayed on the history as it was before the call
    stored, descale, _ = fp8_quant.delayed(q * 4, E4M3, before_call, 0, margin=recipe.margin)
    want, want_descale, _ = fp8_quant.current(q * 4, E4M3, margin=1.0)
    same_bits(stored, want, "the redone q")
    same_value(descale, want_descale, "the redone q's descale")
    assert before_call.saturated[0].item() == 1
    fp8_quant.saturated_total(discard=True)  # the replay's count is not a call's
