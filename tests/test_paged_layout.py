"""CPU tier: ``kv_layout``, the paged cache's dim order, required with ``block_table`` (issue #29).

FlashAttention, vLLM and torch's varlen_attn store a paged cache (N, block_size, H_kv, D)
("NHD"); ``csp.attention`` read (N, H_kv, block_size, D) ("HND") only, so such a cache passed
as it is (H_q 8, H_kv 2, block_size 4: it fits as H_kv 4, block_size 2) gave no error and wrong
numbers. Now the caller names the layout: both give the reference's answer on the same logical
cache, a call without it raises naming both, and a cache whose shape does not fit the named
layout raises naming ``kv_layout``. (Where both readings fit, the keyword decides: a shape cannot
tell them apart, which is why there is no default.)
"""

from __future__ import annotations

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from tests.paged_support import make_paged, paged_reference
from tests.util import assert_rel_close, region


def _case(h_q=8, h_k=2, block_size=4, s_q=3, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return make_paged(3, h_q, h_k, s_q, 16, block_size, 3, dtype=torch.float32, gen=g, lens_q=[3, 1, 2], **kw)


def _nhd(cache):
    """The same logical cache stored (N, block_size, H_kv, D), as FlashAttention and vLLM keep it."""
    return cache.transpose(1, 2).contiguous()


def _reference(case, **kw):
    q, k, v, table, lens_q, lens_kv = case
    return paged_reference(q, k, v, table, lens_q, lens_kv, **kw)


KW = dict(is_causal=True, bottom_right=True)
REF_KW = dict(window=(-1, 0), bottom_right=True)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_both_layouts_give_the_reference_answer_on_the_same_logical_cache(layout):
    case = _case()
    q, k, v, table, lens_q, lens_kv = case
    caches = (k, v) if layout == "HND" else (_nhd(k), _nhd(v))
    out, counted = region(lambda: csp.attention(q, *caches, block_table=table, seq_lens_q=lens_q,
                                                seq_lens_kv=lens_kv, kv_layout=layout, **KW))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    assert_rel_close(out, _reference(case, **REF_KW), 1e-5, f"{layout} out")


def test_the_issues_case_nhd_equals_hnd_bit_for_bit_with_packed_queries_and_lse():
    case = _case()
    q, k, v, table, _, lens_kv = case
    packed = q[:, :, :2].transpose(1, 2).reshape(6, 8, 16)  # 2 queries per sequence, packed
    cu = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    common = dict(block_table=table, seq_lens_kv=lens_kv, cu_seqlens_q=cu, max_seqlen_q=2, return_lse=True, **KW)
    hnd = csp.attention(packed, k, v, kv_layout="HND", **common)
    nhd = csp.attention(packed, _nhd(k), _nhd(v), kv_layout="NHD", **common)
    assert torch.equal(hnd[0], nhd[0]) and torch.equal(hnd[1], nhd[1])


def test_nhd_gradients_reach_the_nhd_cache():
    case = _case(seed=1)
    q, k, v, table, lens_q, lens_kv = case
    leaves = [t.detach().double().requires_grad_() for t in (q, _nhd(k), _nhd(v))]
    out = csp.attention(*leaves, block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv, kv_layout="NHD", **KW)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = paged_reference(*ref_leaves, table, lens_q, lens_kv, **REF_KW)
    go = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out.backward(go)
    want.backward(go)
    assert leaves[1].grad.shape == leaves[1].shape  # (N, block_size, H_kv, D)
    for got, ref, label in zip(leaves, ref_leaves, ("dq", "dk", "dv")):
        g = got.grad if label == "dq" else got.grad.transpose(1, 2)
        assert_rel_close(g, ref.grad, 1e-10, label)


@pytest.mark.parametrize("cache", ["HND", "NHD"])
def test_a_paged_call_without_kv_layout_raises_naming_both(cache):
    case = _case()
    q, k, v, table, lens_q, lens_kv = case
    caches = (k, v) if cache == "HND" else (_nhd(k), _nhd(v))
    before = counters.stats()
    with pytest.raises(TypeError, match=r"block_table needs kv_layout: .*'NHD' \(N, block_size, H_kv, D\).* or "
                                        r"'HND' \(N, H_kv, block_size, D\)"):
        csp.attention(q, *caches, block_table=table, seq_lens_kv=lens_kv)
    assert (counters.stats() - before).to_dict() == counters.Stats().to_dict()


@pytest.mark.parametrize("value, exc, match", [
    ("nhd", ValueError, r"kv_layout must be 'NHD' .* or 'HND' .*, got 'nhd'"),
    ("BHSD", ValueError, r"kv_layout must be 'NHD' .* or 'HND' .*, got 'BHSD'"),
    (1, TypeError, r"kv_layout must be a str, 'NHD' .* or 'HND' .*, got int 1"),
    (True, TypeError, r"kv_layout must be a str"),
], ids=["lowercase", "unknown", "int", "bool"])
def test_a_bad_kv_layout_raises(value, exc, match):
    q, k, v, table, lens_q, lens_kv = _case()
    with pytest.raises(exc, match=match):
        csp.attention(q, k, v, block_table=table, seq_lens_kv=lens_kv, kv_layout=value)


def test_kv_layout_without_block_table_raises():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"kv_layout='NHD' is for a paged KV cache; pass block_table too"):
        csp.attention(q, q, q, kv_layout="NHD")


def test_an_nhd_cache_named_hnd_that_does_not_fit_raises_naming_kv_layout():
    """H_q 8, H_kv 2, block_size 16 stored NHD: read as HND its 'heads' would be 16."""
    case = _case(block_size=16)
    q, k, v, table, lens_q, lens_kv = case
    with pytest.raises(ValueError, match=r"H_q=8 must be a multiple of the cache's H_kv=16, read from dim 1 of k "
                                         r"\(12, 16, 2, 16\), kv_layout='HND' being \(N, H_kv, block_size, D\); "
                                         r"is the cache in the other layout\?"):
        csp.attention(q, _nhd(k), _nhd(v), block_table=table, seq_lens_kv=lens_kv, kv_layout="HND")
    with pytest.raises(ValueError, match=r"H_kv=16, read from dim 2 of k \(12, 2, 16, 16\), kv_layout='NHD' being "
                                         r"\(N, block_size, H_kv, D\)"):
        csp.attention(q, k, v, block_table=table, seq_lens_kv=lens_kv, kv_layout="NHD")  # an HND cache named NHD
    out = csp.attention(q, _nhd(k), _nhd(v), block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                        kv_layout="NHD", **KW)
    assert_rel_close(out, _reference(case, **REF_KW), 1e-5, "named right, computed right")


def test_a_cache_that_fits_both_readings_is_read_as_named():
    """The issue's shapes (H_q 8, H_kv 2, block_size 4) fit either reading: the keyword decides,
    and each reading gives the reference's answer for the cache it describes."""
    case = _case()
    q, k, v, table, lens_q, lens_kv = case
    stored_k, stored_v = _nhd(k), _nhd(v)  # (9, 4, 2, 16)
    as_nhd = csp.attention(q, stored_k, stored_v, block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                           kv_layout="NHD", **KW)
    assert_rel_close(as_nhd, _reference(case, **REF_KW), 1e-5, "NHD")
    lens_kv_small = lens_kv.clamp(max=3 * 2)  # read as HND, the blocks hold 2 tokens each
    as_hnd = csp.attention(q, stored_k, stored_v, block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv_small,
                           kv_layout="HND", **KW)
    other = (q, stored_k, stored_v, table, lens_q, lens_kv_small)
    assert_rel_close(as_hnd, _reference(other, **REF_KW), 1e-5, "HND reading of the same storage")
