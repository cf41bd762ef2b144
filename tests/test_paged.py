"""CPU tier: ``csp.attention(block_table=...)``, a dense query over a paged KV cache (path
``paged_fwd``): values against the independent loop reference (``tests/paged_support``), argument
and value checks, the device-side guard, autograd through the composite, counting and strict mode,
the custom op ``cudnn_sdpa::paged_fwd`` (fake kernel, opcheck, torch.compile) and the support rules."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, layout, support
from cudnn_sdpa_provider.ops import paged_ops  # paged_ops defines cudnn_sdpa::paged_fwd
from cudnn_sdpa_provider.core.support import Capabilities, Problem
from tests.paged_support import make_paged, paged_reference
from tests.util import TOL, assert_rel_close, opcheck, region

OPS = torch.ops.cudnn_sdpa


def gen(seed=0):
    return torch.Generator().manual_seed(seed)



NOTHING = {p: {"served": 0, "fallback": {}} for p in csp.PATHS}


def call(case, **kw):
    """csp.attention on a make_paged tuple (seq_lens_q passed explicitly unless kw overrides it)."""
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    kw.setdefault("seq_lens_q", lens_q)
    kw.setdefault("seq_lens_kv", lens_kv)
    kw.setdefault("block_table", table)
    kw.setdefault("kv_layout", "HND")
    return csp.attention(q, k_cache, v_cache, **kw)


def reference(case, **kw):
    """paged_reference, with rows of sequences without keys (seq_lens_kv = 0) left at 0 by definition
    (the helper's loop cannot reduce over zero keys: it skips them as rows of seq_lens_q = 0)."""
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    return paged_reference(q, k_cache, v_cache, table, lens_q.masked_fill(lens_kv == 0, 0), lens_kv, **kw)


# ------------------------------------------------------------------------------------ values

# id: (make_paged kwargs, attention kwargs (window/causal/...), reference kwargs)
VALUES = {
    "decode": (dict(b=3, h_q=2, h_k=2, s_q=1, block_size=4, max_blocks=3), {}, {}),
    "decode_causal_bottom_right": (dict(b=3, h_q=2, h_k=2, s_q=1, block_size=4, max_blocks=3),
                                   dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "decode_block_1": (dict(b=2, h_q=2, h_k=2, s_q=1, block_size=1, max_blocks=7), {}, {}),
    "decode_kv_len_0": (dict(b=3, h_q=2, h_k=2, s_q=1, block_size=4, max_blocks=2, lens_kv=[5, 0, 8]), {}, {}),
    "prefill_ragged": (dict(b=4, h_q=2, h_k=2, s_q=5, block_size=4, max_blocks=4, lens_q=[5, 0, 3, 1],
                            lens_kv=[9, 6, 16, 1]),
                       dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "prefill_q_longer_than_kv": (dict(b=2, h_q=2, h_k=2, s_q=4, block_size=4, max_blocks=2, lens_q=[4, 3],
                                      lens_kv=[2, 8]),
                                 dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "gqa": (dict(b=2, h_q=4, h_k=2, s_q=3, block_size=8, max_blocks=2, lens_q=[3, 2]),
            dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "mqa": (dict(b=2, h_q=4, h_k=1, s_q=3, block_size=4, max_blocks=3, lens_q=[1, 3]),
            dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "fa_layout": (dict(b=2, h_q=4, h_k=2, s_q=3, block_size=4, max_blocks=3, fa_layout=True, lens_q=[3, 2]),
                  dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "fa_layout_decode_block_1": (dict(b=2, h_q=2, h_k=1, s_q=1, block_size=1, max_blocks=6, fa_layout=True), {}, {}),
    "sinks_prefill": (dict(b=2, h_q=4, h_k=2, s_q=4, block_size=4, max_blocks=3, lens_q=[4, 2]),
                      dict(is_causal=True, bottom_right=True, sinks=True), dict(window=(-1, 0), bottom_right=True,
                                                                                sinks=True)),
    "sliding_window": (dict(b=2, h_q=2, h_k=2, s_q=4, block_size=4, max_blocks=4, lens_q=[4, 3],
                            lens_kv=[13, 7]),
                       dict(window=(3, 0), bottom_right=True), dict(window=(3, 0), bottom_right=True)),
    "window_both_sides_top_left": (dict(b=2, h_q=2, h_k=2, s_q=6, block_size=8, max_blocks=1, lens_q=[6, 4],
                                        lens_kv=[8, 5]),
                                   dict(window=(2, 1), scale=0.3), dict(window=(2, 1), scale=0.3)),
    "block_8_scale": (dict(b=2, h_q=2, h_k=2, s_q=2, block_size=8, max_blocks=3), dict(scale=0.5),
                      dict(scale=0.5)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VALUES))
def test_values_match_the_paged_reference(name, dtype):
    make_kw, kw, ref_kw = (dict(x) for x in VALUES[name])
    g = gen(1)
    case = make_paged(**make_kw, d=16, dtype=dtype, gen=g)
    q = case[0]
    sinks = torch.randn(q.shape[1], generator=g) if kw.pop("sinks", False) else None
    if ref_kw.pop("sinks", False):
        ref_kw["sinks"] = sinks
    out, counted = region(lambda: call(case, sinks=sinks, **kw))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    assert out.dtype == dtype and out.shape == q.shape[:3] + (case[2].shape[3],)
    want = reference(case, **ref_kw)
    assert_rel_close(out, want, TOL[dtype] if dtype != torch.float32 else 1e-5, f"{name} out")
    for b, lq in enumerate(case[4].tolist()):
        assert torch.all(out[b, :, lq:] == 0), f"rows of batch {b} past seq_lens_q = {lq} must be exactly 0"
    assert not torch.isnan(out).any()


def test_zero_length_rows_are_exactly_zero_and_finite_in_bf16():
    case = make_paged(3, 2, 2, 4, 16, 4, 3, gen=gen(2), lens_q=[0, 2, 4], lens_kv=[0, 5, 12])
    out = call(case, is_causal=True, bottom_right=True)
    assert torch.all(out[0] == 0) and torch.all(out[1, :, 2:] == 0)
    assert torch.all(out[1, :, :2] != 0) and torch.all(out[2] != 0)


def test_return_lse_shape_dtype_and_values():
    case = make_paged(3, 4, 2, 1, 16, 4, 3, dtype=torch.float32, gen=gen(3), lens_kv=[1, 7, 12])
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    out, lse = call(case, return_lse=True)
    assert lse.shape == (3, 4, 1, 1) and lse.dtype == torch.float32
    assert_rel_close(out, reference(case), 1e-5, "out")
    scale = 1 / math.sqrt(16)
    for b, lk in enumerate(lens_kv.tolist()):
        idx = torch.arange(lk)
        keys = k_cache[table[b].long()[idx // 4], :, idx % 4].double().transpose(0, 1)  # (H_k, lk, D)
        keys = keys.repeat_interleave(2, 0)
        scores = q[b].double() @ keys.transpose(-1, -2) * scale  # (H_q, 1, lk)
        want = torch.logsumexp(scores, dim=-1, keepdim=True)
        assert_rel_close(lse[b], want, 1e-5, f"lse[{b}]")


def test_return_lse_prefill_shape():
    case = make_paged(2, 2, 2, 5, 16, 4, 2, dtype=torch.float32, gen=gen(4), lens_q=[5, 2])
    out, lse = call(case, is_causal=True, bottom_right=True, return_lse=True)
    assert out.shape == (2, 2, 5, 16) and lse.shape == (2, 2, 5, 1) and lse.dtype == torch.float32
    assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[1, :, :2]).all()


def test_int64_block_table_and_int64_lengths_are_accepted():
    case = make_paged(2, 2, 2, 3, 16, 4, 3, dtype=torch.float32, gen=gen(5), lens_q=[3, 1])
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    want = call(case, is_causal=True, bottom_right=True)
    got = csp.attention(q, k_cache, v_cache, kv_layout="HND", block_table=table.long(), seq_lens_q=lens_q.long(),
                        seq_lens_kv=lens_kv.long(), is_causal=True, bottom_right=True)
    assert torch.equal(got, want)
    assert_rel_close(got, reference(case, window=(-1, 0), bottom_right=True), 1e-5, "out")


def test_seq_lens_q_defaults_to_s_q():
    case = make_paged(3, 2, 2, 4, 16, 4, 3, dtype=torch.float32, gen=gen(6))
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    assert lens_q.tolist() == [4, 4, 4]
    got = csp.attention(q, k_cache, v_cache, kv_layout="HND", block_table=table, seq_lens_kv=lens_kv, is_causal=True,
                        bottom_right=True)
    assert torch.equal(got, call(case, is_causal=True, bottom_right=True))
    assert_rel_close(got, reference(case, window=(-1, 0), bottom_right=True), 1e-5, "out")


@pytest.mark.parametrize("d_v", [16, 8], ids=["dv_eq", "dv_ne"])
@pytest.mark.parametrize("order", ["bshd", "sbhd", "hbsd"])
def test_output_strides_follow_q_dim_order(order, d_v):
    b, h, s, d = 2, 4, 3, 16
    sizes = dict(b=b, h=h, s=s, d=d)
    g = gen(7)
    q = torch.randn([sizes[c] for c in order], generator=g).permute([order.index(c) for c in "bhsd"])
    _, k_cache, _, table, lens_q, lens_kv = make_paged(b, h, 2, s, d, 4, 3, dtype=torch.float32, gen=g,
                                                       lens_q=[3, 2])
    v_cache = torch.randn(k_cache.shape[0], 2, 4, d_v, generator=g)
    out = csp.attention(q, k_cache, v_cache, kv_layout="HND", block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                        is_causal=True, bottom_right=True)
    want_layout = layout.dense_out(q, (b, h, s, d_v))
    assert out.shape == (b, h, s, d_v) and out.stride() == want_layout.stride()
    by_stride = lambda t: sorted(range(4), key=lambda i: -t.stride(i))  # noqa: E731
    assert by_stride(out) == by_stride(q)
    assert not out.is_contiguous()
    case = (q, k_cache, v_cache, table, lens_q, lens_kv)
    assert_rel_close(out, reference(case, window=(-1, 0), bottom_right=True), 1e-5, "out")


# ------------------------------------------------------------------------------- bad arguments

B, M, BS, N = 2, 3, 4, 9


def base(dtype=torch.float32):
    """Two sequences, 3 blocks of 4 each, N = 9 blocks; lengths [5, 12]: sequence 0 uses 2 blocks."""
    return make_paged(B, 4, 2, 2, 16, BS, M, dtype=dtype, gen=gen(8), lens_kv=[5, 12], lens_q=[2, 1])


def _table_with(value, b=0, j=1, dtype=torch.int32):
    table = base()[3].to(dtype).clone()
    table[b, j] = value
    return table


BAD = {
    # id: (attention kwargs overriding call()'s defaults, other overrides, exception, message regex)
    "table_float": (dict(block_table=base()[3].float()), {}, TypeError,
                    r"block_table must be int32 or int64, got torch.float32"),
    "table_int16": (dict(block_table=base()[3].to(torch.int16)), {}, TypeError, r"block_table must be int32 or int64"),
    "table_not_tensor": (dict(block_table=[[0, 1, 2], [3, 4, 5]]), {}, TypeError,
                         r"block_table must be a torch.Tensor"),
    "table_1d": (dict(block_table=base()[3].view(-1)), {}, ValueError, r"block_table must have shape \(2, M\)"),
    "table_wrong_b": (dict(block_table=base()[3][:1]), {}, ValueError,
                      r"block_table must have shape \(2, M\) with M >= 1.*got \(1, 3\)"),
    "table_no_columns": (dict(block_table=base()[3][:, :0]), {}, ValueError, r"block_table must have shape \(2, M\)"),
    "missing_seq_lens_kv": (dict(seq_lens_kv=None), {}, ValueError, r"block_table needs seq_lens_kv"),
    "seq_lens_kv_shape": (dict(seq_lens_kv=torch.tensor([5], dtype=torch.int32)), {}, ValueError,
                          r"seq_lens_kv must have shape \(2,\)"),
    "seq_lens_kv_float": (dict(seq_lens_kv=torch.tensor([5.0, 12.0])), {}, TypeError,
                          r"seq_lens_kv must be int32 or int64"),
    "seq_lens_q_shape": (dict(seq_lens_q=torch.tensor([2, 1, 1], dtype=torch.int32)), {}, ValueError,
                         r"seq_lens_q must have shape \(2,\)"),
    "seq_lens_q_2d": (dict(seq_lens_q=torch.tensor([[2, 1]], dtype=torch.int32)), {}, ValueError,
                      r"seq_lens_q must have shape \(2,\)"),
    "cu_seqlens_q_with_a_dense_q": (dict(cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32), max_seqlen_q=2),
                                    {}, ValueError, r"q must be 3-D \(T, H, D\)"),
    "cu_seqlens_kv": (dict(cu_seqlens_kv=torch.tensor([0, 5, 17], dtype=torch.int32)), {}, ValueError,
                      r"cu_seqlens_kv / max_seqlen_kv are not used with block_table"),
    "max_seqlen_kv": (dict(max_seqlen_kv=12), {}, ValueError,
                      r"cu_seqlens_kv / max_seqlen_kv are not used with block_table"),
    "max_seqlen_q_with_a_dense_q": (dict(max_seqlen_q=2), {}, ValueError, r"max_seqlen_q is for packed queries"),
    "dropout": (dict(dropout_p=0.1), {}, ValueError, r"dropout_p is not supported with block_table"),
    "kv_block_counts_differ": ({}, dict(v=lambda v: v[:-1]), ValueError,
                               r"k and v caches must have the same blocks.*\(9, 2, 4, 16\) and \(8, 2, 4, 16\)"),
    "kv_block_sizes_differ": ({}, dict(v=lambda v: v[:, :, :2]), ValueError,
                              r"k and v caches must have the same blocks"),
    "q_rank": ({}, dict(q=lambda q: q[0]), ValueError, r"q must be 4-D"),
    "cache_rank": ({}, dict(k=lambda k: k[0]), ValueError, r"k must be 4-D"),
    # values (checked on CPU by default)
    "entry_negative": (dict(block_table=_table_with(-1)), {}, ValueError,
                       r"block_table\[0, 1\] = -1 is outside \[0, N = 9\).*seq_lens_kv\[0\] = 5"),
    "entry_n": (dict(block_table=_table_with(N, b=1, j=2)), {}, ValueError,
                r"block_table\[1, 2\] = 9 is outside \[0, N = 9\)"),
    "entry_2_pow_32_int64": (dict(block_table=_table_with(2**32, b=1, j=0, dtype=torch.int64)), {}, ValueError,
                             r"block_table\[1, 0\] = .* is outside \[0, N = 9\)"),
    "entry_minus_2_pow_32_int64": (dict(block_table=_table_with(-(2**32), b=1, j=0, dtype=torch.int64)), {},
                                   ValueError, r"block_table\[1, 0\] = .* is outside \[0, N = 9\)"),
    "seq_lens_kv_past_capacity": (dict(seq_lens_kv=torch.tensor([5, 13], dtype=torch.int32)), {}, ValueError,
                                  r"seq_lens_kv\[1\] = 13 is outside \[0, M x block_size = 12\]"),
    "seq_lens_kv_negative": (dict(seq_lens_kv=torch.tensor([-1, 12], dtype=torch.int32)), {}, ValueError,
                             r"seq_lens_kv\[0\] = -1 is outside"),
    "seq_lens_kv_int64_wraps": (dict(seq_lens_kv=torch.tensor([2**32 + 5, 12])), {}, ValueError,
                                r"seq_lens_kv\[0\] = .* is outside \[0, M x block_size = 12\]"),
    "seq_lens_q_past_s_q": (dict(seq_lens_q=torch.tensor([3, 1], dtype=torch.int32)), {}, ValueError,
                            r"seq_lens_q\[0\] = 3 is outside \[0, S_q = 2\]"),
    "validate_true_same_checks": (dict(block_table=_table_with(-1), validate=True), {}, ValueError,
                                  r"block_table\[0, 1\] = -1 is outside"),
}


@pytest.mark.parametrize("kw, overrides, exc, match", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise_naming_the_argument(kw, overrides, exc, match):
    q, k_cache, v_cache, table, lens_q, lens_kv = base()
    q = overrides.get("q", lambda t: t)(q)
    k_cache = overrides.get("k", lambda t: t)(k_cache)
    v_cache = overrides.get("v", lambda t: t)(v_cache)
    args = dict(kv_layout="HND", block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv)
    args.update(kw)
    before = counters.stats()
    with pytest.raises(exc, match=match):
        csp.attention(q, k_cache, v_cache, **args)
    assert (counters.stats() - before).to_dict() == NOTHING, "nothing ran, nothing counted"


def test_table_on_another_device_raises():
    # A CPU machine has a second device after all: "meta".
    q, k_cache, v_cache, table, lens_q, lens_kv = base()
    with pytest.raises(ValueError, match=r"block_table is on meta but q is on cpu"):
        csp.attention(q, k_cache, v_cache, kv_layout="HND", block_table=table.to("meta"), seq_lens_kv=lens_kv)


@pytest.mark.parametrize("value", [-1, N, 2**31 - 1], ids=["negative", "n", "int32_max"])
def test_unused_entries_out_of_range_are_accepted(value):
    """Sequence 0 has 5 keys: it uses entries 0 and 1 only, entry 2 may hold anything."""
    case = base()
    table = case[3].clone()
    table[0, 2] = value
    case = case[:3] + (table,) + case[4:]
    out, counted = region(lambda: call(case, is_causal=True, bottom_right=True))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    assert_rel_close(out, reference(case, window=(-1, 0), bottom_right=True), 1e-5, "out")


def test_a_full_table_row_is_used_exactly():
    """seq_lens_kv = M x block_size uses every entry of the row: the last one is checked too."""
    case = base()
    table = case[3].clone()
    table[1, 2] = -5
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -5"):
        call(case, block_table=table)
    lens_kv = torch.tensor([5, 8], dtype=torch.int32)  # now sequence 1 uses 2 blocks: entry 2 is free
    fixed = case[:3] + (table, case[4], lens_kv)
    assert_rel_close(call(fixed), reference(fixed), 1e-5, "out")


# ------------------------------------------------------------------------- the device-side guard

GUARD = {
    # id: (bad row, attention kwargs for the bad case)
    "entry_negative": (1, lambda t, lq, lk: dict(block_table=_set(t, 1, 0, -3))),
    "entry_n": (0, lambda t, lq, lk: dict(block_table=_set(t, 0, 1, N))),
    "entry_2_pow_32_int64": (1, lambda t, lq, lk: dict(block_table=_set(t.long(), 1, 2, 2**32))),
    "seq_lens_kv_past_capacity": (1, lambda t, lq, lk: dict(seq_lens_kv=_set(lk, 1, None, 13))),
    "seq_lens_kv_negative": (0, lambda t, lq, lk: dict(seq_lens_kv=_set(lk, 0, None, -2))),
    "seq_lens_q_past_s_q": (0, lambda t, lq, lk: dict(seq_lens_q=_set(lq, 0, None, 3))),
    "seq_lens_q_negative": (1, lambda t, lq, lk: dict(seq_lens_q=_set(lq, 1, None, -1))),
}


def _set(t, i, j, value):
    t = t.clone()
    if j is None:
        t[i] = value
    else:
        t[i, j] = value
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad_row, make_kw", GUARD.values(), ids=GUARD.keys())
def test_validate_false_poisons_exactly_the_bad_row(bad_row, make_kw, dtype):
    case = base(dtype)
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    kw = make_kw(table, lens_q, lens_kv)
    with pytest.raises(ValueError):  # checked by default on CPU
        call(case, **kw)
    out, counted = region(lambda: call(case, validate=False, **kw))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    assert torch.isnan(out[bad_row]).all(), "every element of the bad row is NaN"
    good = 1 - bad_row
    assert not torch.isnan(out[good]).any()
    sl = slice(good, good + 1)
    want = paged_reference(q[sl], k_cache, v_cache, table[sl], lens_q[sl], lens_kv[sl])
    assert_rel_close(out[sl], want, TOL[dtype] if dtype != torch.float32 else 1e-5, "good row")


def test_validate_false_with_valid_inputs_equals_default():
    case = base()
    assert torch.equal(call(case, validate=False, is_causal=True, bottom_right=True),
                       call(case, is_causal=True, bottom_right=True))


# -------------------------------------------------------------------------------------- autograd


def _leaves(*tensors):
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


GRAD = {
    "decode": (dict(b=3, h_q=4, h_k=2, s_q=1, block_size=4, max_blocks=3), {}, {}),
    "prefill_ragged_causal": (dict(b=3, h_q=4, h_k=2, s_q=4, block_size=4, max_blocks=3, lens_q=[4, 0, 2]),
                              dict(is_causal=True, bottom_right=True), dict(window=(-1, 0), bottom_right=True)),
    "fa_layout_block_1_window": (dict(b=2, h_q=2, h_k=1, s_q=3, block_size=1, max_blocks=8, fa_layout=True),
                                 dict(window=(2, 0), bottom_right=True), dict(window=(2, 0), bottom_right=True)),
    "sinks": (dict(b=2, h_q=4, h_k=2, s_q=3, block_size=8, max_blocks=2, lens_q=[3, 2]),
              dict(is_causal=True, bottom_right=True, sinks=True), dict(window=(-1, 0), bottom_right=True,
                                                                        sinks=True)),
}

GRAD_TOL = 1e-4


@pytest.mark.parametrize("name", list(GRAD))
def test_grad_matches_autograd_through_the_reference(name):
    make_kw, kw, ref_kw = (dict(x) for x in GRAD[name])
    g = gen(9)
    case = make_paged(**make_kw, d=16, dtype=torch.float32, gen=g)
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    for t in (q, k_cache, v_cache):
        t.requires_grad_()
    sinks = torch.randn(q.shape[1], generator=g).requires_grad_() if kw.pop("sinks", False) else None
    ref_kw.pop("sinks", None)
    go = torch.randn(q.shape[:3] + (v_cache.shape[3],), generator=g)

    def run():
        out = csp.attention(q, k_cache, v_cache, block_table=table, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                            sinks=sinks, kv_layout="HND", **kw)
        out.backward(go)
        return out

    out, counted = region(run)
    assert counted == {"paged_fwd": {"no_cuda": 1}}, "one fallback on paged_fwd, nothing on the dense paths"
    assert out.requires_grad
    rq, rk, rv, rs = _leaves(q, k_cache, v_cache, sinks)
    want = paged_reference(rq, rk, rv, table, lens_q, lens_kv, sinks=rs, **ref_kw)
    want.backward(go.double())
    assert_rel_close(out.detach(), want.detach(), GRAD_TOL, "out")
    for got, ref, label in ((q.grad, rq.grad, "dq"), (k_cache.grad, rk.grad, "dk_cache"),
                            (v_cache.grad, rv.grad, "dv_cache")):
        assert got is not None and got.shape == ref.shape, label
        assert_rel_close(got, ref, GRAD_TOL, label)
    if sinks is not None:
        assert_rel_close(sinks.grad, rs.grad, GRAD_TOL, "dsinks")
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[table.view(-1).long()] = False
    assert torch.all(k_cache.grad[unused] == 0) and torch.all(v_cache.grad[unused] == 0), "spare blocks get 0"
    for b, lq in enumerate(lens_q.tolist()):
        assert torch.all(q.grad[b, :, lq:] == 0)


def test_grad_only_on_q_counts_once():
    case = base()
    q = case[0].requires_grad_()
    out, counted = region(lambda: call(case))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_no_grad_counts_once_per_call():
    case = base()
    for t in case[:3]:
        t.requires_grad_()
    with torch.no_grad():
        _, counted = region(lambda: [call(case) for _ in range(3)])
        out = call(case)
    assert counted == {"paged_fwd": {"no_cuda": 3}}
    assert not out.requires_grad


def test_stats_to_dict_has_the_paged_path():
    d = csp.stats().to_dict()
    assert "paged_fwd" in d and set(d["paged_fwd"]) == {"served", "fallback"}
    before = d["paged_fwd"]["fallback"].get("no_cuda", 0)
    call(base())
    after = csp.stats().to_dict()["paged_fwd"]
    assert after["fallback"].get("no_cuda", 0) == before + 1
    assert "paged_fwd" in csp.report()


# ---------------------------------------------------------------------------------------- strict


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_strict_refuses_and_counts_the_refusal(grad):
    case = base()
    if grad:
        case[0].requires_grad_()
    before = counters.stats()
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            call(case, is_causal=True, bottom_right=True)
    err = info.value
    assert err.path == "paged_fwd" and err.reasons == ["no_cuda"]
    assert "block_table=(2, 3)" in str(err) and "k_cache=(9, 2, 4, 16)" in str(err), str(err)
    delta = counters.stats() - before
    assert delta.to_dict()["paged_fwd"] == {"served": 0, "fallback": {"no_cuda": 1}}
    assert delta.refused_dict() == {"paged_fwd": {"no_cuda": 1}}
    with csp.enable():  # not strict: the same call falls back
        _, counted = region(lambda: call(case, is_causal=True, bottom_right=True))
    assert counted == {"paged_fwd": {"no_cuda": 1}}


def test_op_fallback_false_refuses():
    args = op_args()
    before = counters.stats()
    with pytest.raises(csp.FallbackError) as info:
        OPS.paged_fwd(*args[:-1], False)
    assert info.value.path == "paged_fwd" and info.value.reasons == ["no_cuda"]
    assert (counters.stats() - before).refused_dict() == {"paged_fwd": {"no_cuda": 1}}


# ------------------------------------------------------------------------- the op: fake, opcheck

SCHEMA = ("cudnn_sdpa::paged_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_len_q, "
          "Tensor seq_len_kv, Tensor? sinks, float scale, SymInt window_left, SymInt window_right, bool bottom_right, "
          "bool compute_lse, bool fallback) -> (Tensor, Tensor)")


def op_args(s_q=1, sinks=False, fa_layout=False, q_order="bhsd", d_v=16, window=(-1, -1), bottom_right=False,
            lens_q=None, seed=10):
    g = gen(seed)
    q, k_cache, v_cache, table, lq, lk = make_paged(2, 4, 2, s_q, 16, 4, 3, dtype=torch.float32, gen=g,
                                                    fa_layout=fa_layout, lens_q=lens_q)
    if q_order == "bshd":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    if d_v != 16:
        v_cache = torch.randn(v_cache.shape[0], 2, 4, d_v, generator=g)
    sink_t = torch.randn(4, generator=g) if sinks else None
    return (q, k_cache, v_cache, table, lq, lk, sink_t, 0.25, window[0], window[1], bottom_right, True, True)


OP_CASES = {
    "decode": dict(),
    "decode_sinks": dict(sinks=True),
    "prefill_causal": dict(s_q=3, window=(-1, 0), bottom_right=True, lens_q=[3, 1]),
    "prefill_sinks_window": dict(s_q=3, sinks=True, window=(2, 0), bottom_right=True),
    "fa_layout_dv8": dict(s_q=2, fa_layout=True, d_v=8),
    "q_bshd": dict(s_q=2, q_order="bshd"),
    "q_bshd_dv8": dict(s_q=2, q_order="bshd", d_v=8),
}


def test_schema():
    assert str(OPS.paged_fwd.default._schema) == SCHEMA


@pytest.mark.parametrize("kw", OP_CASES.values(), ids=OP_CASES.keys())
def test_op_matches_reference(kw):
    args = op_args(**kw)
    (out, lse), counted = region(lambda: OPS.paged_fwd(*args))
    assert counted == {"paged_fwd": {"no_cuda": 1}}
    q, k, v, table, lq, lk, sinks, scale, wl, wr, br = args[:11]
    want = paged_reference(q, k, v, table, lq, lk, scale=scale, window=(wl, wr), bottom_right=br, sinks=sinks)
    assert_rel_close(out, want, 1e-5, "out")
    assert lse.shape == q.shape[:3] + (1,) and lse.dtype == torch.float32


@pytest.mark.parametrize("kw", OP_CASES.values(), ids=OP_CASES.keys())
def test_fake_matches_real(kw):
    args = op_args(**kw)
    real = OPS.paged_fwd(*args)
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = OPS.paged_fwd(*fake_args)
    meta = OPS.paged_fwd(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    for i, r in enumerate(real):
        for other, label in ((fake[i], "fake"), (meta[i], "meta")):
            assert (tuple(other.shape), other.stride(), other.dtype) == (tuple(r.shape), r.stride(), r.dtype), \
                (label, i)
    q, v = args[0], args[2]
    assert real[0].stride() == layout.dense_out(q, q.shape[:3] + (v.shape[3],)).stride()
    assert real[1].shape == q.shape[:3] + (1,) and real[1].is_contiguous()


@pytest.mark.parametrize("kw", OP_CASES.values(), ids=OP_CASES.keys())
def test_opcheck(kw):
    opcheck(OPS.paged_fwd.default, op_args(**kw))


def test_attention_on_meta_tensors_runs_the_fake_kernel():
    case = tuple(t.to("meta") for t in base())
    before = counters.stats()
    out, lse = call(case, is_causal=True, bottom_right=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 2, 16) and lse.shape == (2, 4, 2, 1)
    assert (counters.stats() - before).to_dict() == NOTHING, "a fake kernel runs nothing"


# --------------------------------------------------------------------------------- torch.compile


def test_compiled_no_grad_equals_eager_and_counts_each_call():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    case = make_paged(2, 4, 2, 3, 16, 4, 3, dtype=torch.float32, gen=gen(11), lens_q=[3, 1])

    def fn(q, k_cache, v_cache, table, lens_kv):
        return csp.attention(q, k_cache, v_cache, block_table=table, seq_lens_kv=lens_kv, is_causal=True,
                             bottom_right=True, kv_layout="HND") * 2

    q, k_cache, v_cache, table, _, lens_kv = case
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    with torch.no_grad():
        want = fn(q, k_cache, v_cache, table, lens_kv)
        _, counted = region(lambda: [compiled(q, k_cache, v_cache, table, lens_kv) for _ in range(3)])
        got = compiled(q, k_cache, v_cache, table, lens_kv)
    assert counted == {"paged_fwd": {"no_cuda": 3}}
    assert torch.equal(got, want)
    assert counter.frame_count == 1
    graph_ops = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("cudnn_sdpa.paged_fwd" in name for name in graph_ops), graph_ops


def test_compiled_strict_refuses_at_run_time():
    case = base()
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    compiled = torch.compile(lambda q: csp.attention(q, k_cache, v_cache, block_table=table, seq_lens_q=lens_q,
                                                     seq_lens_kv=lens_kv, kv_layout="HND"), backend="eager",
                             fullgraph=True)
    with torch.no_grad():
        compiled(q)
        with csp.enable(strict=True):
            with pytest.raises(csp.FallbackError):
                compiled(q)


def _compiled_with_grad(fullgraph: bool):
    torch._dynamo.reset()  # the lambda's code object is shared: no cache from the other test
    case = base()
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    q = q.clone().requires_grad_()
    compiled = torch.compile(lambda q: csp.attention(q, k_cache, v_cache, block_table=table, seq_lens_q=lens_q,
                                                     seq_lens_kv=lens_kv, kv_layout="HND"), backend="eager",
                             fullgraph=fullgraph)
    return compiled, q, case


# Dynamo reads .grad of the broken graph's output (a non-leaf) when it wraps it for the resumed frame
# (torch 2.13/2.14); the warning is torch's own, and our filterwarnings=error would turn it into an error.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor")
def test_compiled_with_grad_breaks_the_graph_and_counts_every_call():
    """With grad the call is the composite, run eagerly inside compiled code (a graph break), so
    each call is counted when it runs and its gradient is autograd's through the composite."""
    compiled, q, case = _compiled_with_grad(fullgraph=False)
    before = csp.stats()
    for _ in range(3):
        q.grad = None
        out = compiled(q)
        out.float().square().sum().backward()
    delta = (csp.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 0, "fallback": {"no_cuda": 3}}, delta
    ref_q = case[0].detach().double().requires_grad_()
    ref = paged_reference(ref_q, *case[1:])
    ref.square().sum().backward()
    assert_rel_close(out.detach().double(), ref.detach(), 1e-4, "compiled out")
    assert_rel_close(q.grad.double(), ref_q.grad, 1e-4, "compiled dq")


def test_compiled_fullgraph_with_grad_is_refused_by_dynamo():
    """fullgraph=True cannot break the graph: dynamo refuses the eager-only grad path at once."""
    compiled, q, _ = _compiled_with_grad(fullgraph=True)
    with pytest.raises(Exception, match=r"(?i)disable|skip"):
        compiled(q)


# ------------------------------------------------------------------------------- support rules

H200 = Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900, frontend_version="1.32.0")
PAGED = Problem(kind="paged", backward=False, device_type="cuda", dtypes=(torch.bfloat16,) * 3, batch=4, h_q=8,
                h_k=2, h_v=2, s_q=1, s_kv=1024, d_qk=128, d_v=128, padded=True, block_size=64)


def slugs(p: Problem, c: Capabilities = H200) -> list[str]:
    return [r.slug for r in support.reasons(p, c)]


def paged(**kw) -> Problem:
    return dataclasses.replace(PAGED, **kw)


def test_paged_baseline_is_served():
    assert slugs(PAGED) == []
    assert slugs(paged(s_q=128, window=(-1, 0), bottom_right=True)) == []


@pytest.mark.parametrize("block_size", [2**i for i in range(9)])
def test_power_of_2_block_sizes_are_served(block_size):
    assert slugs(paged(block_size=block_size, s_kv=16 * block_size)) == []


@pytest.mark.parametrize("block_size", [48, 3, 0, -4])
def test_other_block_sizes_are_not(block_size):
    found = support.reasons(paged(block_size=block_size), H200)
    assert [r.slug for r in found][:1] == ["paged_block_size"]
    assert str(block_size) in found[0].message


def test_paged_backward():
    assert slugs(paged(backward=True))[:1] == ["paged_backward"]
    assert slugs(paged(backward=True, s_q=64, window=(-1, 0), bottom_right=True)) == ["paged_backward"]
    assert slugs(dataclasses.replace(PAGED, kind="dense", backward=True)) == [], "only kind paged"


OLD = dataclasses.replace(H200, cudnn_version=90900)


@pytest.mark.parametrize("overrides, on_9_9", [
    (dict(d_qk=256, d_v=256), ["cudnn_feature"]),
    (dict(d_qk=128, d_v=192), ["cudnn_feature"]),
    (dict(s_q=1, window=(-1, 0), bottom_right=True), ["cudnn_feature"]),
    (dict(s_q=1, window=(4, 0), bottom_right=True), ["cudnn_feature"]),
    (dict(s_q=1), []),
    (dict(s_q=1, window=(4, -1)), []),
    (dict(s_q=16, window=(-1, 0), bottom_right=True), []),
    (dict(d_qk=128, d_v=128), []),
], ids=["d256", "dv192", "decode_causal", "decode_window", "decode_unmasked", "decode_left_only",
        "prefill_causal", "d128"])
def test_cudnn_feature_gates(overrides, on_9_9):
    p = paged(**overrides)
    assert slugs(p, OLD) == on_9_9
    assert slugs(p, H200) == []
    assert slugs(p, dataclasses.replace(H200, cudnn_version=support.PAGED_WIDE_MIN + 2)) == [], "9.10.2"
    assert slugs(dataclasses.replace(p, kind="dense", block_size=0), OLD) == [], "the gates are paged-only"


def test_varlen_with_paged_is_still_paged_kv():
    p = dataclasses.replace(PAGED, kind="varlen", paged=True, block_size=0)
    assert slugs(p)[:1] == ["paged_kv"]
    assert slugs(dataclasses.replace(PAGED, kind="paged", paged=True)) == [], "paged_kv is for varlen only"


def test_problem_from_tensors():
    q = torch.empty(3, 8, 2, 128, dtype=torch.bfloat16, device="meta")
    k_cache = torch.empty(40, 16, 2, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)  # FA layout
    v_cache = torch.empty(40, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    table = torch.empty(3, 5, dtype=torch.int32, device="meta")
    p = paged_ops.problem(q, k_cache, v_cache, table, None, (-1, 0), True, grad=False)
    assert (p.kind, p.path, p.batch, p.h_q, p.h_k, p.h_v, p.s_q, p.s_kv, p.d_qk, p.d_v, p.block_size) == (
        "paged", "paged_fwd", 3, 8, 2, 2, 2, 80, 128, 64, 16)
    assert p.padded and not p.sinks and not p.empty and p.window == (-1, 0) and p.bottom_right
    assert slugs(dataclasses.replace(p, device_type="cuda")) == []
    assert slugs(p)[:1] == ["no_cuda"]
    grad = paged_ops.problem(q, k_cache, v_cache, table, torch.empty(8, device="meta"), (-1, -1), False, grad=True)
    assert grad.sinks and grad.backward and slugs(dataclasses.replace(grad, device_type="cuda")) == ["paged_backward"]
    odd = torch.empty(40, 2, 48, 128, dtype=torch.bfloat16, device="meta")
    p48 = paged_ops.problem(q, odd, odd, table, None, (-1, -1), False, grad=False)
    assert p48.s_kv == 240 and slugs(dataclasses.replace(p48, device_type="cuda")) == ["paged_block_size"]
    empty = paged_ops.problem(q, k_cache, v_cache, table[:, :0], None, (-1, -1), False, grad=False)
    assert empty.empty


def test_paged_slugs_are_cataloged():
    from cudnn_sdpa_provider.core.reasons import CATALOG, PATHS, Slug

    assert "paged_fwd" in PATHS
    for slug in ("paged_block_size", "paged_backward"):
        assert Slug(slug).value == slug and slug in CATALOG


# -------------------------------------------------- the served path on the stand-in cuDNN (CPU)


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU float32 tensors decided as if on a CUDA machine (the no_cuda and dtype rules left out),
    executed by tests/fake_cudnn.py's graph, which reads the caches through the table as declared
    and fails the call if a used entry is outside the cache."""
    from cudnn_sdpa_provider.engine import graphs
    from cudnn_sdpa_provider.ops import route
    from tests import fake_cudnn

    built = fake_cudnn.install(monkeypatch)
    monkeypatch.setattr(support, "RULES", tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype")))
    route.clear()
    yield built
    route.clear()
    graphs.clear_cache()


def served(case, *, window=(-1, -1), bottom_right=False, sinks=None, table=None, lens_kv=None):
    q, k_cache, v_cache, t, lens_q, lk = case
    before = counters.stats()
    out, lse = paged_ops._paged_fwd_cuda(q, k_cache, v_cache, t if table is None else table, lens_q,
                                         lk if lens_kv is None else lens_kv, sinks, q.shape[-1] ** -0.5, window[0],
                                         window[1], bottom_right, True, True)
    return out, (counters.stats() - before).to_dict()["paged_fwd"]


SERVED_CASES = {
    "decode_gqa": (dict(b=3, h_q=4, h_k=2, s_q=1, block_size=4, max_blocks=5), {}),
    "prefill_causal_br_ragged": (dict(b=3, h_q=4, h_k=2, s_q=6, block_size=4, max_blocks=5, lens_q=[6, 2, 0],
                                      lens_kv=[17, 2, 5]), dict(window=(-1, 0), bottom_right=True)),
    "fa_layout_window": (dict(b=2, h_q=4, h_k=1, s_q=4, block_size=2, max_blocks=8, fa_layout=True),
                         dict(window=(3, 0), bottom_right=True)),
    "sinks": (dict(b=2, h_q=4, h_k=2, s_q=3, block_size=8, max_blocks=2), dict(sinks=True)),
    # kv_layout="NHD" is served as this view (issue #29's shapes: H_q 8, H_kv 2, block size 4)
    "fa_layout_issue_29": (dict(b=3, h_q=8, h_k=2, s_q=3, block_size=4, max_blocks=4, fa_layout=True),
                           dict(window=(-1, 0), bottom_right=True)),
}


@pytest.mark.parametrize("name", sorted(SERVED_CASES))
def test_served_path_reads_the_cache_through_the_table(cuda_like, name):
    shape, kw = SERVED_CASES[name]
    case = make_paged(**shape, d=16, dtype=torch.float32, gen=gen(40))
    kw = dict(kw)
    sinks = torch.randn(case[0].shape[1], generator=gen(41)) if kw.pop("sinks", False) else None
    out, count = served(case, sinks=sinks, **kw)
    assert count == {"served": 1, "fallback": {}}, count
    want = reference(case, sinks=sinks, **kw)
    assert_rel_close(out.double(), want, 1e-5, f"{name}: the served path on the stand-in graph")
    assert out.stride() == layout.dense_out(case[0], tuple(out.shape)).stride()


def test_served_guard_replaces_bad_entries_before_the_graph_reads_them(cuda_like):
    case = make_paged(3, 4, 2, 1, 16, 4, 5, dtype=torch.float32, gen=gen(42), lens_kv=[17, 9, 20])
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    bad = table.clone()
    bad[0, 2] = 10**6  # used by row 0 (17 keys use 5 blocks)
    bad[1, 4] = -3  # unused by row 1 (9 keys use 3 blocks)
    lens = lens_kv.clone()
    lens[2] = 21  # past the table's capacity (5 x 4)
    out, count = served(case, table=bad, lens_kv=lens)
    assert count == {"served": 1, "fallback": {}}, count
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all(), "rows with a bad entry or length are NaN"
    assert_rel_close(out[1].double(), reference(case)[1], 1e-5, "the good row (its unused bad entry never read)")


def test_served_path_reads_strided_tables_and_lengths(cuda_like):
    case = make_paged(3, 4, 2, 1, 16, 4, 5, dtype=torch.float32, gen=gen(43))
    q, k_cache, v_cache, table, lens_q, lens_kv = case
    column_major = table.t().contiguous().t()
    pairs = torch.stack([lens_kv, lens_kv], dim=1)
    out, _ = served(case, table=column_major, lens_kv=pairs[:, 0])
    assert_rel_close(out.double(), reference(case), 1e-5, "strided table and lengths")


def test_block_size_not_a_power_of_two_is_decided_before_any_graph(cuda_like):
    case = make_paged(2, 4, 2, 1, 16, 6, 3, dtype=torch.float32, gen=gen(44))
    out, count = served(case)
    assert count == {"served": 0, "fallback": {"paged_block_size": 1}}, count
    assert not cuda_like, "no graph was built"
    assert_rel_close(out.double(), reference(case), 1e-5, "the composite")


# ------------------------------------------------- packed queries (varlen_attn's form) over a cache


def packed_case(lens_q=(5, 0, 3, 1), lens_kv=(9, 4, 20, 1), seed=50, fa_layout=True):
    """(packed q (T, H, D), the same queries as a padded case for the reference, cu_seqlens_q)."""
    case = make_paged(len(lens_q), 4, 2, max(lens_q), 16, 4, 5, dtype=torch.float32, gen=gen(seed),
                      fa_layout=fa_layout, lens_q=list(lens_q), lens_kv=list(lens_kv))
    q = case[0]
    packed = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_q)])
    cu = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32)
    return packed, case, cu


def pack_rows(padded, lens_q):
    return torch.cat([padded[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_q)])


@pytest.mark.parametrize("causal", [False, True])
def test_packed_queries_over_a_cache_equal_the_reference(causal):
    lens_q = (5, 0, 3, 1)
    q, case, cu = packed_case(lens_q)
    kw = dict(is_causal=True, bottom_right=True) if causal else {}
    (out, lse), moved = region(lambda: csp.attention(q, case[1], case[2], block_table=case[3], cu_seqlens_q=cu,
                                                     max_seqlen_q=5, seq_lens_kv=case[5], return_lse=True,
                                                     kv_layout="HND", **kw))
    assert moved == {"paged_fwd": {"no_cuda": 1}}, moved
    want = reference(case, window=(-1, 0) if causal else (-1, -1), bottom_right=causal)
    assert out.shape == (9, 4, 16) and lse.shape == (9, 4) and lse.dtype == torch.float32
    assert_rel_close(out.double(), pack_rows(want, lens_q), 1e-5, "packed out")


def test_packed_queries_keep_native_layout_and_zero_rows_past_the_last_sequence():
    lens_q = (2, 3)
    _, case, cu = packed_case(lens_q, lens_kv=(6, 7), seed=51)
    storage = torch.randn(4, 7, 16, generator=gen(52))  # (H, T, D) storage: 2 tokens past cu[-1]
    q = storage.transpose(0, 1)
    padded = case[0].clone()
    for b, n in enumerate(lens_q):
        start = int(cu[b])
        padded[b, :, :n] = q[start:start + n].transpose(0, 1)
    out = csp.attention(q, case[1], case[2], kv_layout="HND", block_table=case[3], cu_seqlens_q=cu, max_seqlen_q=3,
                        seq_lens_kv=case[5])
    assert out.stride() == torch.empty_like(q).stride(), "FlashAttention's layout: empty_like(q)"
    assert torch.all(out[5:] == 0), "tokens past cu_seqlens_q[-1] are 0"
    want = reference((padded,) + case[1:])
    assert_rel_close(out[:5].double(), pack_rows(want, lens_q), 1e-5, "packed out")


def test_packed_queries_with_bad_prefix_sums_are_all_nan_unvalidated_and_an_error_validated():
    q, case, _ = packed_case()
    bad = torch.tensor([0, 7, 6, 9, 9], dtype=torch.int32)  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        csp.attention(q, case[1], case[2], kv_layout="HND", block_table=case[3], cu_seqlens_q=bad, max_seqlen_q=5,
                      seq_lens_kv=case[5])
    out = csp.attention(q, case[1], case[2], kv_layout="HND", block_table=case[3], cu_seqlens_q=bad, max_seqlen_q=5,
                        seq_lens_kv=case[5], validate=False)
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="seq_lens_q is for a dense q"):
        csp.attention(q, case[1], case[2], kv_layout="HND", block_table=case[3], cu_seqlens_q=bad, max_seqlen_q=5,
                      seq_lens_kv=case[5], seq_lens_q=case[4])


def test_packed_queries_with_grad_get_the_composites_gradients():
    lens_q = (5, 0, 3, 1)
    q, case, cu = packed_case(lens_q, seed=53)
    q = q.double().requires_grad_()
    k_cache = case[1].double().requires_grad_()
    out = csp.attention(q, k_cache, case[2].double(), block_table=case[3], cu_seqlens_q=cu, max_seqlen_q=5,
                        seq_lens_kv=case[5], is_causal=True, bottom_right=True, kv_layout="HND")
    go = torch.randn_like(out)
    out.backward(go)
    padded = case[0].double().requires_grad_()
    ref_k = case[1].double().requires_grad_()
    want = pack_rows(paged_reference(padded, ref_k, case[2].double(), case[3], case[4], case[5], window=(-1, 0),
                                     bottom_right=True), lens_q)
    want.backward(go)
    assert_rel_close(out.detach(), want.detach(), 1e-10, "out")
    assert_rel_close(q.grad, pack_rows(padded.grad, lens_q), 1e-10, "dq")
    assert_rel_close(k_cache.grad, ref_k.grad, 1e-10, "dk_cache")


class _Native:
    """PyTorch's varlen kernel as a fallback reaches it: records that it ran."""

    def __init__(self):
        self.calls = 0

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls += 1
        return "native", None, torch.zeros(2)  # (out, lse, rng_state): the forward marks rng_state


def _varlen_has_block_table() -> bool:
    from cudnn_sdpa_provider.hooks import overrides

    ops = overrides._varlen_ops()
    return bool(ops) and any(a.name == "block_table" for a in ops["_varlen_attn"]._schema.arguments)


@pytest.mark.skipif(not _varlen_has_block_table(), reason="this torch's varlen_attn has no block_table (torch < 2.12)")
def test_varlen_attn_with_a_paged_cache_is_served_on_the_paged_graph(cuda_like):
    from cudnn_sdpa_provider.core import markers
    from cudnn_sdpa_provider.hooks import overrides

    lens_q = (5, 0, 3, 1)
    q, case, cu = packed_case(lens_q, seed=54)
    pool_k, pool_v = case[1].transpose(1, 2), case[2].transpose(1, 2)  # (pages, page_size, H_k, D)
    ops = overrides._varlen_ops()
    native = _Native()
    kernels = overrides._Varlen(ops["_varlen_attn"], native, ops["_varlen_attn_backward"], _Native())
    before = counters.stats()
    out, lse, rng = kernels.forward(None, q, pool_k, pool_v, cu, None, 5, 20, True, None, [-1, 0], True, case[5],
                                    case[3], None)
    delta = (counters.stats() - before).to_dict()
    assert delta["varlen_fwd"] == {"served": 1, "fallback": {}} and native.calls == 0, delta
    want = pack_rows(reference(case, window=(-1, 0), bottom_right=True), lens_q)
    assert_rel_close(out.double(), want, 1e-5, "varlen_attn over a paged cache")
    assert lse.shape == (4, 9), "torch_attn's (H, T) LSE"
    assert markers.lookup(rng).served
    # seqused_k without a block table: still PyTorch's kernel, with its reason
    packed_k = torch.randn(26, 2, 16)
    cu_k = torch.tensor([0, 9, 13, 25, 26], dtype=torch.int32)
    before = counters.stats()
    assert kernels.forward(None, q, packed_k, packed_k, cu, cu_k, 5, 12, True, None, [-1, 0], True, case[5],
                           None, None)[0] == "native"
    assert (counters.stats() - before).to_dict()["varlen_fwd"] == {"served": 0, "fallback": {"paged_kv": 1}}
