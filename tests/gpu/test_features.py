"""GPU tier: masks/bias, dropout and large head dims through F.sdpa and csp.attention (Real-model issue 1-3)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.tools import bench
from cudnn_sdpa_provider.core import counters, rows
from cudnn_sdpa_provider.engine import dense
from cudnn_sdpa_provider.ops import reference
from tests.util import TOL, assert_rel_close, grad_tol, make_dense

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _fwd_bwd(fn, q, k, v, go):
    for t in (q, k, v):
        t.grad = None
    out = fn()
    out.backward(go)
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def _masks(b, h, s_q, s_kv, gen):
    keep = torch.rand(b, h, s_q, s_kv, device=DEV, generator=gen) > 0.3
    keep[:, :, 3] = False  # a fully masked row
    lengths = torch.tensor([s_kv, s_kv // 3], device=DEV)
    key_pad = torch.arange(s_kv, device=DEV)[None, :] < lengths[:, None]
    additive = torch.randn(1, h, s_q, s_kv, device=DEV, generator=gen, dtype=torch.bfloat16)
    return {
        "bool_2d": keep[0, 0],
        "bool_b1ss": keep[:, :1],
        "bool_bhss": keep,
        "bool_key_padding_b11s": key_pad[:, None, None, :],
        "additive_1hss": additive,
        "additive_broadcast_h": additive[:, :1].expand(1, h, s_q, s_kv),
    }


@pytest.mark.parametrize("name", ["bool_2d", "bool_b1ss", "bool_bhss", "bool_key_padding_b11s", "additive_1hss",
                                  "additive_broadcast_h"])
def test_masks_served_and_equal_to_native(name):
    gen = torch.Generator(device=DEV).manual_seed(7)
    b, h, s_q, s_kv, d = 2, 4, 136, 200, 64
    q, k, v = make_dense(b, h, h, h, s_q, s_kv, d, d, torch.bfloat16, DEV, gen=gen)
    go = torch.randn(b, h, s_q, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    mask = _masks(b, h, s_q, s_kv, gen)[name]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        native, native_grads = _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v, go)
    before = counters.stats()
    with csp.enable():
        out, grads = _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v, go)
    delta = (counters.stats() - before).to_dict()
    assert delta["dense_fwd"] == {"served": 1, "fallback": {}}, delta
    assert delta["dense_bwd"] == {"served": 1, "fallback": {}}, delta
    assert_rel_close(out, native, TOL[torch.bfloat16], "out vs native (fully masked rows included)")
    for n, g, ng in zip("qkv", grads, native_grads):
        assert_rel_close(g, ng, grad_tol(torch.bfloat16), f"d{n} vs native")


def test_padding_as_lengths_equals_the_padding_mask_on_real_positions():
    """Issue 1 / Performance 4(a): a right-padded causal batch served through per-sequence lengths
    gives what the S x S padding mask gives on real tokens (fp32 reference); padded query rows are 0.
    dO is 0 on padded rows, as a loss that ignores padding makes it."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    b, h_q, h_kv, s, d = 4, 8, 2, 256, 128
    lens = torch.tensor([256, 200, 129, 64], dtype=torch.int32, device=DEV)
    q, k, v = make_dense(b, h_q, h_kv, h_kv, s, s, d, d, torch.bfloat16, DEV, gen=gen)
    real = (torch.arange(s, device=DEV)[None, :] < lens[:, None])[:, None, :, None]  # (B, 1, S, 1)
    go = torch.randn(b, h_q, s, d, device=DEV, generator=gen, dtype=torch.bfloat16) * real
    mask = bench._padding_mask(lens, s, causal=True)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_grads = _fwd_bwd(lambda: F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True),
                              qf, kf, vf, go.float())
    before = counters.stats()
    out, grads = _fwd_bwd(lambda: csp.attention(q, k, v, is_causal=True, seq_lens_q=lens, seq_lens_kv=lens),
                          q, k, v, go)
    delta = (counters.stats() - before).to_dict()
    assert delta["dense_fwd"] == {"served": 1, "fallback": {}}, delta
    assert delta["dense_bwd"] == {"served": 1, "fallback": {}}, delta
    assert_rel_close(out * real, ref * real, TOL[torch.bfloat16], "out on real rows")
    assert torch.count_nonzero(out * ~real) == 0, "padded query rows must be 0"
    group = h_q // h_kv
    for n, g, rg in zip("qkv", grads, ref_grads):
        assert_rel_close(g, rg, grad_tol(torch.bfloat16, 1 if n == "q" else group), f"d{n}")


@pytest.mark.parametrize("p", [0.25, 0.1])
def test_dropout_keep_rate_mask_consistency_and_gradients(p):
    gen = torch.Generator(device=DEV).manual_seed(8)
    b, h, s, d = 2, 4, 256, 64
    q, k, v = make_dense(b, h, h, h, s, s, d, d, torch.bfloat16, DEV, requires_grad=False, gen=gen)
    philox = rows.new_philox(torch.device(DEV))
    dump = torch.full((b, h, s, s), float("nan"), device=DEV)
    out, lse = dense.forward(q, k, v, scale=1 / 8, window=(-1, 0), dropout_p=p, philox=(philox[0], philox[1]),
                                rng_dump=dump)
    allowed = reference.allowed_mask(s, s, (-1, 0), False, device=DEV).expand(b, h, s, s)
    # cuDNN skips fully masked tiles, so only the visible region of the dump is written.
    assert torch.isfinite(dump[allowed]).all(), "rng_dump must cover every visible score"
    keep_rate = (dump[allowed] != 0).float().mean().item()
    n = allowed.sum().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep_rate - (1 - p)) < 6 * sigma + 1e-3, f"keep rate {keep_rate:.4f} vs {1 - p} (sigma {sigma:.1e})"
    mask = (dump != 0) & allowed
    ref, _ = reference.dense(q, k, v, scale=1 / 8, window=(-1, 0), dropout_mask=mask, dropout_p=p)
    assert_rel_close(out, ref, TOL[torch.bfloat16], "out with the realised mask")
    go = torch.randn(b, h, s, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=1 / 8, window=(-1, 0), dropout_p=p,
                                     philox=(philox[0], philox[1]))
    ref_grads = reference.dense_backward(go, q, k, v, scale=1 / 8, window=(-1, 0), dropout_mask=mask, dropout_p=p)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_rel_close(got, want, grad_tol(torch.bfloat16), f"{name} with the realised mask")


def test_dropout_preserves_the_mean():
    gen = torch.Generator(device=DEV).manual_seed(9)
    b, h, s, d = 4, 8, 256, 64
    q, k, _ = make_dense(b, h, h, h, s, s, d, d, torch.bfloat16, DEV, requires_grad=False, gen=gen)
    v = torch.ones(b, h, s, d, device=DEV, dtype=torch.bfloat16)
    out = csp.attention(q, k, v, dropout_p=0.25)
    # Each output row is sum_j p_ij * keep_ij / (1 - p): 1 in expectation.
    assert abs(out.float().mean().item() - 1.0) < 0.02


def test_dropout_through_sdpa_served_and_reproducible():
    gen = torch.Generator(device=DEV).manual_seed(10)
    q, k, v = make_dense(2, 4, 4, 4, 128, 128, 64, 64, torch.bfloat16, DEV, gen=gen)
    with csp.enable():
        torch.manual_seed(3)
        before = counters.stats()
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        a.sum().backward()
        delta = (counters.stats() - before).to_dict()
        torch.manual_seed(3)
        b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        torch.manual_seed(4)
        c = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert delta["dense_fwd"]["served"] == 1 and delta["dense_bwd"]["served"] == 1, delta
    assert torch.equal(a, b), "same torch.manual_seed, same dropout"
    assert not torch.equal(a, c), "another seed, another mask"
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dims", [(256, 256), (192, 128)])
def test_large_head_dims_through_sdpa(dims):
    d_qk, d_v = dims
    gen = torch.Generator(device=DEV).manual_seed(12)
    q, k, v = make_dense(2, 4, 4, 4, 256, 256, d_qk, d_v, torch.bfloat16, DEV, gen=gen)
    go = torch.randn(2, 4, 256, d_v, device=DEV, generator=gen, dtype=torch.bfloat16)
    before = counters.stats()
    with csp.enable():
        out, grads = _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, go)
    delta = (counters.stats() - before).to_dict()
    assert delta["dense_fwd"]["served"] == 1 and delta["dense_bwd"]["served"] == 1, delta
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.dense(*leaves, scale=1 / math.sqrt(d_qk), window=(-1, 0))
    ref.backward(go.float())
    assert_rel_close(out, ref, TOL[torch.bfloat16], "out")
    for n, g, r in zip("qkv", grads, leaves):
        assert_rel_close(g, r.grad, grad_tol(torch.bfloat16), f"d{n}")
