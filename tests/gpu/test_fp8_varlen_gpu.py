"""GPU tier: FP8 attention on packed (varlen) inputs (Hopper and newer).

The forward is cuDNN's packed FP8 graph (``engine.fp8_packed``); the backward the dense FP8 op on
the padded form (``ops.fp8_varlen``: cuDNN 9.19 refuses the THD FP8 backward on Hopper), which runs
the FP8 reference there (the known-issues row: cuDNN's padded FP8 backward gave wrong dK/dV, run 65).
A zero-length sequence must never reach cuDNN (it faulted the context, run 65). Errors are max |got - ref| / max |ref| of each tensor,
against fp32 attention computed sequence by sequence, at tests/gpu/test_fp8.py's bounds: on the
dequantised FP8 operands for the engine (FWD_VS_FP32), from bf16 activations for
``csp.fp8.attention`` (E2E_VS_FP32, E2E_GRAD_VS_FP32). Rows past the last sequence carry NaN
canaries that cuDNN must leave alone. Nothing here is faked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.engine import fp8_packed
from tests.gpu.test_fp8 import E2E_GRAD_VS_FP32, E2E_VS_FP32, FWD_VS_FP32

pytestmark = pytest.mark.gpu
DEV = "cuda"
LENS = (1000, 517, 2048, 77)
TAIL = 64  # canary rows past the last sequence
# Non-causal output from bf16 activations: dense csp.fp8.attention on (1, 8, S, 128) randn measured
# 0.0919 (S 1024) and 0.0815 (S 2048) against fp32 (run 65); E2E_VS_FP32 is the causal bound
E2E_NON_CAUSAL_VS_FP32 = 0.11
NAN_BYTE = 0x7F
CASES = {
    "causal": dict(h=8, hk=8, causal=True),
    "non_causal": dict(h=8, hk=8, causal=False),
    "gqa_8_2": dict(h=8, hk=2, causal=True),
}


def _cu(lens):
    return torch.tensor([0] + list(lens), device=DEV).cumsum(0).to(torch.int32)


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _fp32_per_sequence(q, k, v, lens, causal):
    """fp32 attention on packed (T, H, D) q, k, v, one sequence at a time (top-left causal)."""
    group, outs, start = q.shape[1] // k.shape[1], [], 0
    for n in lens:
        qs = q[start:start + n].transpose(0, 1)[None]
        ks, vs = (t[start:start + n].transpose(0, 1)[None].repeat_interleave(group, 1) for t in (k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("name", list(CASES))
def test_the_packed_fp8_forward_runs_on_cudnn_within_fp8_bounds_and_writes_no_canary(name):
    c, t = CASES[name], sum(LENS)
    gen = torch.Generator(device=DEV).manual_seed(0)
    quantised = [csp.fp8.quantize(torch.randn(t + TAIL, h, 128, device=DEV, generator=gen))
                 for h in (c["h"], c["hk"], c["hk"])]
    (q8, dq), (k8, dk), (v8, dv) = quantised
    real = [x[:t].float() * d for x, d in quantised]
    scale_o = torch.tensor([2.0 ** int(torch.log2(448 * 0.875 / real[2].abs().max()).floor())], device=DEV)
    out = torch.full((t + TAIL, c["h"], 128), NAN_BYTE, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    lse = torch.full((t + TAIL, c["h"]), float("nan"), device=DEV)
    cu = _cu(LENS)
    fp8_packed.forward(q8, k8, v8, dq, dk, dv, scale_o, cu, cu, max(LENS), max(LENS), scale=128 ** -0.5,
                       scale_s=256.0, causal=c["causal"], compute_lse=True, out=out, lse=lse)
    torch.cuda.synchronize()
    assert (out[t:].view(torch.uint8) == NAN_BYTE).all(), "cuDNN wrote past the last sequence (O)"
    assert torch.isnan(lse[t:]).all(), "cuDNN wrote past the last sequence (LSE)"
    want = _fp32_per_sequence(*real, LENS, c["causal"])
    err = _rel(out[:t].float() / scale_o, want)
    assert err <= FWD_VS_FP32, f"{name}: out {err:.4f}"


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lens", [LENS, (1000, 517, 77)], ids=["b4", "b3"])
def test_attention_from_bf16_forward_served_backward_on_the_reference(name, lens, scaling):
    c, t = CASES[name], sum(lens)
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(t, h, 128, device=DEV, generator=gen, dtype=torch.bfloat16).requires_grad_()
               for h in (c["h"], c["hk"], c["hk"]))
    go = torch.randn(t, c["h"], 128, device=DEV, generator=gen, dtype=torch.bfloat16)
    recipe = csp.fp8.Recipe(scaling=scaling)
    before = counters.stats()
    for _ in range(2):  # the second call: a warm recipe (delayed: scales from the history)
        for x in (q, k, v):
            x.grad = None
        _stale_small_pool()  # run 64-65: stale small blocks made dK/dV wrong
        out = csp.fp8.attention(q, k, v, cu_seqlens_q=_cu(lens), max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                                is_causal=c["causal"], recipe=recipe)
        out.backward(go)
    delta = (counters.stats() - before).to_dict()
    assert delta["fp8_fwd"] == {"served": 2, "fallback": {}}
    # the padded backward: the known-issues row (wrong dK/dV on cuDNN 9.19, sm_90) sends it to the reference
    assert delta["fp8_bwd"] == {"served": 0, "fallback": {"cudnn_known_issue": 2}}
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = _fp32_per_sequence(*leaves, lens, c["causal"])
    want.backward(go.float())
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    e_out = _rel(out, want)
    e_grads = [_rel(x.grad, r.grad) for x, r in zip((q, k, v), leaves)]
    bound = E2E_VS_FP32 if c["causal"] else E2E_NON_CAUSAL_VS_FP32
    assert e_out <= bound and max(e_grads) <= E2E_GRAD_VS_FP32, (e_out, e_grads)
    if scaling == "delayed":
        assert recipe.saturated == 0, "a delayed scale clipped"


def _stale_small_pool():
    """Leave the caching allocator's small-block pool holding 1e30: a small output or workspace a
    kernel reads before writing (amax, counters) then shows it instead of a fresh process's zeros."""
    junk = [torch.full((128,), 1e30, device=DEV) for _ in range(4096)]
    del junk


@pytest.mark.parametrize("where", ["user_empty_sequence", "bad_cu_seqlens"])
def test_a_zero_length_sequence_runs_the_reference_never_cudnn(where):
    """cuDNN 9.19's FP8 graphs fault (illegal instruction) or hang on a zero-length sequence: such a
    call must run the reference, with the known-issues reason, and the process must go on."""
    lens = (1000, 0, 517, 77)
    t = sum(lens)
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v = (torch.randn(t, 8, 128, device=DEV, generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    cu = _cu(lens)
    if where == "bad_cu_seqlens":
        cu = torch.tensor([0, 1000, 900, 1517, t], device=DEV, dtype=torch.int32)  # decreasing
    before = counters.stats()
    out = csp.fp8.attention(q, k, v, cu_seqlens_q=cu, max_seqlen_q=1000, max_seqlen_kv=1000, is_causal=True)
    out.sum().backward()
    torch.cuda.synchronize()
    delta = (counters.stats() - before).to_dict()
    assert delta["fp8_fwd"] == {"served": 0, "fallback": {"cudnn_known_issue": 1}}
    if where == "bad_cu_seqlens":
        assert torch.isnan(out).all() and torch.isnan(q.grad).all()
    else:
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
        want = _fp32_per_sequence(*(x.detach().float() for x in (q, k, v)), lens, True)
        assert _rel(out, want) <= E2E_VS_FP32


def test_a_new_max_seqlen_inside_the_bucket_builds_no_graph():
    from cudnn_sdpa_provider.engine import graphs

    def step(lens, seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        q = torch.randn(sum(lens), 8, 128, device=DEV, generator=gen, dtype=torch.bfloat16).requires_grad_()
        out = csp.fp8.attention(q, q, q, cu_seqlens_q=_cu(lens), max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                                is_causal=True)
        out.sum().backward()

    step((1000, 517, 2048, 77), 2)
    built = graphs.cache_info()
    step((1500, 1900, 33, 700), 3)  # 4 sequences again (B is not bucketed), longest 1900 (bucket 2048)
    assert graphs.cache_info() == built


def test_a_head_dim_the_sm90_backward_lacks_is_served_forward_and_falls_back_backward():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the head-dim rule is sm_90's")
    lens = (300, 77)
    q = torch.randn(sum(lens), 8, 64, device=DEV, dtype=torch.bfloat16).requires_grad_()
    before = counters.stats()
    out = csp.fp8.attention(q, q, q, cu_seqlens_q=_cu(lens), max_seqlen_q=300, max_seqlen_kv=300)
    out.sum().backward()
    delta = (counters.stats() - before).to_dict()
    assert delta["fp8_fwd"] == {"served": 1, "fallback": {}}
    assert delta["fp8_bwd"] == {"served": 0, "fallback": {"head_dim": 1}}
    assert torch.isfinite(q.grad).all()
