"""GPU tier: changing sequence lengths on the length-bucketed graphs (engine/folded.py).

A sweep of 200 lengths through F.scaled_dot_product_attention under the provider: decode (one query
against a cache that grows), chunked prefill (a chunk of queries, bottom-right causal), causal
prefill with its backward. Every operand sits in a buffer whose memory just past the real length is
NaN (a canary): a kernel that read past a length would turn the answer NaN. Each length is checked
against the fp32 reference and native PyTorch on the same inputs, strides and counters included, and
the sweep must build at most one forward and one backward graph per doubling of S.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, layout
from cudnn_sdpa_provider.engine import graphs
from cudnn_sdpa_provider.ops import reference
from tests.util import TOL, assert_rel_close, grad_tol

pytestmark = pytest.mark.gpu
DEV = "cuda"
DT = torch.bfloat16


def _lengths(lo: int, hi: int, n: int, seed: int) -> list[int]:
    """``n`` lengths in [lo, hi]: every 2^k - 1, 2^k, 2^k + 1 inside, the rest drawn at random."""
    edges = sorted({e for k in range(1, 16) for e in (2**k - 1, 2**k, 2**k + 1) if lo <= e <= hi})
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randperm(hi - lo + 1, generator=gen).add(lo).tolist()
    out = list(edges)
    for s in rest:
        if len(out) >= n:
            break
        if s not in out:
            out.append(s)
    return sorted(out)


def _canary_bhsd(b, h, s, d, pad=8):
    """(B, H, S, D) view of a (B, H, S + pad, D) buffer whose rows past S are NaN."""
    buf = torch.full((b, h, s + pad, d), float("nan"), device=DEV, dtype=DT)
    buf[:, :, :s].normal_()
    return buf[:, :, :s]


def _canary_token_major(b, s, h, d, pad=8):
    """(B, H, S, D) view (transpose(1, 2)) of a (B, S + pad, H, D) buffer whose tokens past S are NaN."""
    buf = torch.full((b, s + pad, h, d), float("nan"), device=DEV, dtype=DT)
    buf[:, :s].normal_()
    return buf[:, :s].transpose(1, 2)


def _ref(q, k, v, **kw):
    g = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    return reference.dense(q.float(), kf, vf, scale=q.shape[-1] ** -0.5, **kw)[0]


def _builds():
    return graphs.cache_info()["built"]


def test_decode_sweep_over_a_growing_cache():
    b, h_q, h_kv, d = 4, 16, 4, 128
    lengths = _lengths(33, 2100, 70, 1)
    built = _builds()
    before = counters.stats()
    with csp.enable():
        for s in lengths:
            q = torch.randn(b, 1, h_q, d, device=DEV, dtype=DT).transpose(1, 2)  # (B, 1, H, D) projection
            k, v = _canary_bhsd(b, h_kv, s, d), _canary_bhsd(b, h_kv, s, d)
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            assert_rel_close(out, _ref(q, k, v).to(out.dtype), TOL[DT], f"decode out at S_kv={s}")
    delta = (counters.stats() - before).to_dict()["dense_fwd"]
    assert delta == {"served": len(lengths), "fallback": {}}, delta
    buckets = {1 << (s - 1).bit_length() for s in lengths}
    assert _builds() - built <= 2 * len(buckets), (_builds() - built, sorted(buckets))


def test_chunked_prefill_sweep_bottom_right():
    b, h_q, h_kv, d, chunk = 2, 8, 2, 128, 16
    lengths = _lengths(chunk + 1, 3000, 65, 2)
    built = _builds()
    with csp.enable():
        for s in lengths:
            q = _canary_token_major(b, chunk, h_q, d)
            k, v = _canary_bhsd(b, h_kv, s, d), _canary_bhsd(b, h_kv, s, d)
            out, _ = csp.attention(q, k, v, is_causal=True, bottom_right=True, return_lse=True)
            want = _ref(q, k, v, window=(-1, 0), bottom_right=True)
            assert_rel_close(out, want.to(out.dtype), TOL[DT], f"chunk out at S_kv={s}")
    buckets = {1 << (s - 1).bit_length() for s in lengths}
    assert _builds() - built <= 2 * len(buckets), (_builds() - built, sorted(buckets))


def test_causal_prefill_forward_backward_sweep():
    b, h_q, h_kv, d = 2, 8, 2, 128
    lengths = _lengths(9, 1100, 65, 3)
    built = _builds()
    before = counters.stats()
    with csp.enable():
        for s in lengths:
            q = _canary_token_major(b, s, h_q, d).detach().requires_grad_()
            k = _canary_token_major(b, s, h_kv, d).detach().requires_grad_()
            v = _canary_token_major(b, s, h_kv, d).detach().requires_grad_()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            go = torch.randn_like(out)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            want = _ref(qf, kf, vf, window=(-1, 0))
            rq, rk, rv = torch.autograd.grad(want, (qf, kf, vf), go.float())
            assert_rel_close(out, want.detach().to(out.dtype), TOL[DT], f"out at S={s}")
            assert_rel_close(dq, rq.to(DT), grad_tol(DT), f"dq at S={s}")
            assert_rel_close(dk, rk.to(DT), grad_tol(DT, h_q // h_kv), f"dk at S={s}")
            assert_rel_close(dv, rv.to(DT), grad_tol(DT, h_q // h_kv), f"dv at S={s}")
            assert out.stride() == layout.dense_out(q, tuple(out.shape)).stride(), "out in q's order, as native"
            assert dq.stride() == torch.empty_like(q).stride() and dk.stride() == torch.empty_like(k).stride()
    delta = (counters.stats() - before).to_dict()
    assert delta["dense_fwd"]["served"] == len(lengths) and delta["dense_bwd"]["served"] == len(lengths), delta
    buckets = {1 << (s - 1).bit_length() for s in lengths}
    assert _builds() - built <= 3 * len(buckets), (_builds() - built, sorted(buckets))


def test_padded_batches_of_changing_lengths_forward_backward():
    """Right-padded batches (per-sequence lengths, as the HF integration passes them) at 40 batch
    lengths: rows past each length are 0, answers and gradients as the fp32 reference, and the
    builds bounded by the length buckets."""
    b, h_q, h_kv, d = 3, 8, 2, 64
    lengths = _lengths(20, 1500, 40, 4)
    built = _builds()
    for s in lengths:
        q = _canary_token_major(b, s, h_q, d).detach().requires_grad_()
        k = _canary_token_major(b, s, h_kv, d).detach().requires_grad_()
        v = _canary_token_major(b, s, h_kv, d).detach().requires_grad_()
        lens = torch.tensor([s, max(s - 5, 1), max(s // 2, 1)], dtype=torch.int32, device=DEV)
        out = csp.attention(q, k, v, is_causal=True, seq_lens_q=lens, seq_lens_kv=lens)
        go = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        g = h_q // h_kv
        want = reference.dense(qf, kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1), scale=d ** -0.5,
                               window=(-1, 0), seq_len_q=lens, seq_len_kv=lens)[0]
        rq, rk, rv = torch.autograd.grad(want, (qf, kf, vf), go.float())
        assert_rel_close(out, want.detach().to(DT), TOL[DT], f"padded out at S={s}")
        assert_rel_close(dq, rq.to(DT), grad_tol(DT), f"padded dq at S={s}")
        assert_rel_close(dk, rk.to(DT), grad_tol(DT, g), f"padded dk at S={s}")
        assert_rel_close(dv, rv.to(DT), grad_tol(DT, g), f"padded dv at S={s}")
        assert (out[2, :, int(lens[2]):] == 0).all() and (dk[2, :, int(lens[2]):] == 0).all()
    buckets = {1 << (s - 1).bit_length() for s in lengths}
    assert _builds() - built <= 3 * len(buckets), (_builds() - built, sorted(buckets))


def test_a_padding_mask_through_f_sdpa_runs_as_lengths_forward_backward():
    """HF's plain sdpa path: right padding as a (B, 1, S, S) boolean mask, causal, at 30 batch
    lengths under ``enable()``. Served as per-sequence lengths (``ops.bias_lengths``): answers and
    gradients as the fp32 reference with the mask and as native PyTorch on the same inputs, every
    call served, and the builds bounded by the length buckets (as a bias: one graph per length)."""
    b, h_q, h_kv, d = 3, 8, 2, 64
    lengths = _lengths(20, 1500, 30, 5)
    built = _builds()
    before = counters.stats()
    for s in lengths:
        ops = [_canary_token_major(b, s, h, d).detach().requires_grad_() for h in (h_q, h_kv, h_kv)]
        real = torch.tensor([s, max(s - 5, 1), max(s // 2, 1)], device=DEV)
        j = torch.arange(s, device=DEV)
        mask = ((j[None, :] < real[:, None])[:, None, None, :] & (j[None, :] <= j[:, None]))  # (B, 1, S, S)
        with csp.enable():
            out = F.scaled_dot_product_attention(*ops, attn_mask=mask, enable_gqa=True)
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, ops, go)
        native = F.scaled_dot_product_attention(*ops, attn_mask=mask, enable_gqa=True)
        native_grads = torch.autograd.grad(native, ops, go)
        g = h_q // h_kv
        qf, kf, vf = (t.detach().float().requires_grad_() for t in ops)
        bias = torch.zeros(mask.shape, device=DEV).masked_fill(~mask, float("-inf"))
        want = reference.dense(qf, kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1), scale=d ** -0.5,
                               bias=bias)[0]
        wants = torch.autograd.grad(want, (qf, kf, vf), go.float())
        assert_rel_close(out, want.detach().to(DT), TOL[DT], f"mask out at S={s}")
        assert_rel_close(out, native, TOL[DT], f"mask out at S={s} vs native")
        for name, got, ref, nat, tol in zip(("dq", "dk", "dv"), grads, wants, native_grads,
                                            (grad_tol(DT), grad_tol(DT, g), grad_tol(DT, g))):
            assert_rel_close(got, ref.to(DT), tol, f"mask {name} at S={s}")
            assert_rel_close(got, nat, tol, f"mask {name} at S={s} vs native")
        assert out.stride() == layout.dense_out(ops[0], tuple(out.shape)).stride(), "out in q's order, as native"
        assert all(x.stride() == torch.empty_like(t).stride() for x, t in zip(grads, ops))
    delta = (counters.stats() - before).to_dict()
    assert delta["dense_fwd"]["served"] == len(lengths) and delta["dense_bwd"]["served"] == len(lengths), delta
    buckets = {1 << (s - 1).bit_length() for s in lengths}
    assert _builds() - built <= 3 * len(buckets), (_builds() - built, sorted(buckets))
