"""CPU tier: number arguments (issue #29, items 7 and 8) and ``explain``'s keywords (item 5).

Every integer argument takes any integral number (``operator.index``: numpy integers too), every
real one any real number (``numbers.Real``: numpy floats, ``Fraction``), every flag a bool or a
numpy bool; bool where a number is wanted, a float where an integer is, a string or a tensor is a
TypeError naming the argument, and a value out of range a ValueError. ``max_seqlen_q/kv`` are
checked against the packed tokens before anything is allocated, and int64 values in index tensors
are reported as given (not clamped to int32).
"""

from __future__ import annotations

import fractions
import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import arguments, counters
from tests.paged_support import make_paged

G = torch.Generator().manual_seed(0)
Q4 = torch.randn(2, 4, 6, 8, generator=G)
KV4 = torch.randn(2, 2, 6, 8, generator=G)
P3 = torch.randn(6, 4, 8, generator=G)
CU = torch.tensor([0, 2, 6], dtype=torch.int32)
NP_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
NP_REALS = [np.float16, np.float32, np.float64, np.int64]


def _packed(**kw):
    kw = {"cu_seqlens_q": CU, "max_seqlen_q": 4, "max_seqlen_kv": 4, **kw}
    return csp.attention(P3, P3, P3, **kw)


# --------------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("kind", NP_INTS, ids=lambda t: t.__name__)
def test_numpy_integers_are_integers(kind):
    want = _packed(is_causal=True, window=(2, 0))
    assert torch.equal(_packed(max_seqlen_q=kind(4), max_seqlen_kv=kind(4), is_causal=True, window=(kind(2), 0)),
                       want)
    assert torch.equal(csp.attention(Q4, KV4, KV4, window=(kind(2), kind(1))), csp.attention(Q4, KV4, KV4,
                                                                                              window=(2, 1)))


@pytest.mark.parametrize("kind", NP_REALS, ids=lambda t: t.__name__)
def test_numpy_reals_are_reals(kind):
    value = kind(0.25) if kind is not np.int64 else kind(1)
    want = csp.attention(Q4, KV4, KV4, scale=float(value))
    assert torch.equal(csp.attention(Q4, KV4, KV4, scale=value), want)
    assert torch.equal(_packed(scale=value), _packed(scale=float(value)))
    torch.manual_seed(3)
    a = csp.attention(Q4, KV4, KV4, dropout_p=kind(0.0) if kind is np.int64 else kind(0.125))
    torch.manual_seed(3)
    b = csp.attention(Q4, KV4, KV4, dropout_p=0.0 if kind is np.int64 else float(kind(0.125)))
    assert torch.equal(a, b)


def test_fractions_and_numpy_bools():
    assert torch.equal(csp.attention(Q4, KV4, KV4, scale=fractions.Fraction(1, 4)),
                       csp.attention(Q4, KV4, KV4, scale=0.25))
    assert torch.equal(csp.attention(Q4, KV4, KV4, is_causal=np.bool_(True), bottom_right=np.bool_(False),
                                     return_lse=np.bool_(False), validate=np.bool_(True)),
                       csp.attention(Q4, KV4, KV4, is_causal=True))


def test_fp8_takes_numpy_numbers():
    q = torch.randn(1, 2, 4, 16, generator=G)
    assert torch.equal(csp.fp8.attention(q, q, q, scale=np.float32(0.25), is_causal=np.bool_(True)),
                       csp.fp8.attention(q, q, q, scale=0.25, is_causal=True))
    recipe = csp.fp8.Recipe(margin=np.float64(4.0), scale_s=np.int64(128))
    assert recipe.margin == 4.0 and recipe.scale_s == 128.0 and type(recipe.margin) is float


@given(st.integers(min_value=1, max_value=2**40), st.sampled_from(NP_INTS + [int]))
def test_integer_helper_takes_any_integral_value(value, kind):
    if kind is not int:
        value = min(value, int(np.iinfo(kind).max))
    assert arguments.integer("n", kind(value), minimum=1) == value
    assert type(arguments.integer("n", kind(value))) is int


# --------------------------------------------------------------------------------- refused

WRONG_TYPE = {
    # id: (attention kwargs, message)
    "max_seqlen_q_float": (dict(max_seqlen_q=4.0), r"max_seqlen_q must be an integer >= 1 .*got float 4.0"),
    "max_seqlen_q_np_float": (dict(max_seqlen_q=np.float64(4)), r"max_seqlen_q must be an integer >= 1"),
    "max_seqlen_kv_bool": (dict(max_seqlen_kv=True), r"max_seqlen_kv must be an integer >= 1 .*got bool True"),
    "max_seqlen_kv_np_bool": (dict(max_seqlen_kv=np.bool_(True)), r"max_seqlen_kv must be an integer >= 1"),
    "max_seqlen_q_str": (dict(max_seqlen_q="4"), r"max_seqlen_q must be an integer >= 1 .*got str '4'"),
    "max_seqlen_q_tensor": (dict(max_seqlen_q=torch.tensor(4)), r"max_seqlen_q must be an integer >= 1 .*Tensor"),
    "scale_bool": (dict(scale=False), r"scale must be a finite real number or None, got bool False"),
    "scale_np_bool": (dict(scale=np.bool_(True)), r"scale must be a finite real number or None, got bool"),
    "scale_str": (dict(scale="0.1"), r"scale must be a finite real number or None, got str '0.1'"),
    "scale_complex": (dict(scale=1j), r"scale must be a finite real number or None, got complex 1j"),
    "scale_tensor": (dict(scale=torch.tensor(0.1)), r"scale must be a finite real number or None, got Tensor"),
    "dropout_bool": (dict(dropout_p=True), r"dropout_p must be a float in \[0, 1\), got bool True"),
    "dropout_str": (dict(dropout_p="0.1"), r"dropout_p must be a float in \[0, 1\), got str"),
    "window_float": (dict(window=(2.0, 0)), r"window left bound must be an integer >= -1 .*got float 2.0"),
    "window_bool": (dict(window=(True, 0)), r"window left bound must be an integer >= -1 .*got bool True"),
    "window_str": (dict(window=(1, "0")), r"window right bound must be an integer >= -1 .*got str '0'"),
    "window_np_float": (dict(window=(np.float32(1), 0)), r"window left bound must be an integer"),
    "is_causal_int": (dict(is_causal=1), r"is_causal must be a bool, got int"),
    "is_causal_np_int": (dict(is_causal=np.int64(1)), r"is_causal must be a bool, got int64"),
}

WRONG_VALUE = {
    "max_seqlen_q_zero": (dict(max_seqlen_q=np.int64(0)), r"max_seqlen_q must be an integer >= 1 .*got 0"),
    "max_seqlen_kv_negative": (dict(max_seqlen_kv=-3), r"max_seqlen_kv must be an integer >= 1 .*got -3"),
    "scale_nan": (dict(scale=np.float32("nan")), r"scale must be a finite real number or None, got"),
    "scale_inf": (dict(scale=float("inf")), r"scale must be a finite real number or None, got inf"),
    "dropout_one": (dict(dropout_p=np.float64(1.0)), r"dropout_p must be a float in \[0, 1\), got"),
    "dropout_negative": (dict(dropout_p=-0.5), r"dropout_p must be a float in \[0, 1\), got -0.5"),
    "window_below_minus_one": (dict(window=(np.int64(-2), 0)), r"window left bound must be an integer >= -1 "
                                                               r"\(-1 = unbounded\), got -2"),
}


def _call(kw):
    if "max_seqlen_q" in kw or "max_seqlen_kv" in kw:
        return _packed(**kw)
    return csp.attention(Q4, KV4, KV4, **kw)


@pytest.mark.parametrize("kw, match", WRONG_TYPE.values(), ids=WRONG_TYPE.keys())
def test_a_wrong_type_is_a_type_error_naming_the_argument(kw, match):
    before = counters.stats()
    with pytest.raises(TypeError, match=match):
        _call(kw)
    assert (counters.stats() - before).to_dict() == counters.Stats().to_dict()


@pytest.mark.parametrize("kw, match", WRONG_VALUE.values(), ids=WRONG_VALUE.keys())
def test_a_wrong_value_is_a_value_error_naming_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _call(kw)


@given(st.one_of(st.booleans(), st.text(max_size=3), st.floats(allow_nan=False), st.none(), st.lists(st.integers(),
                                                                                                      max_size=2)))
def test_integer_helper_refuses_every_non_integral_type(value):
    for minimum in (None, 1):
        with pytest.raises(TypeError, match=r"^n must be an integer"):
            arguments.integer("n", value, minimum=minimum)


@given(st.one_of(st.floats(), st.booleans(), st.text(max_size=3), st.complex_numbers()))
def test_real_helper_takes_finite_reals_only(value):
    if isinstance(value, float) and not isinstance(value, bool):
        if value == value and abs(value) != float("inf"):
            assert arguments.real("x", value, valid="a real") == value
        else:
            with pytest.raises(ValueError, match=r"^x must be a real, got"):
                arguments.real("x", value, valid="a real")
    else:
        with pytest.raises(TypeError, match=r"^x must be a real, got"):
            arguments.real("x", value, valid="a real")


def test_fp8_numbers_are_checked_by_the_same_helpers():
    q = torch.randn(1, 2, 4, 16, generator=G)
    with pytest.raises(TypeError, match=r"scale must be a finite real number or None, got str"):
        csp.fp8.attention(q, q, q, scale="0.1")
    with pytest.raises(TypeError, match=r"margin must be a finite real number >= 1.0, got bool True"):
        csp.fp8.Recipe(margin=True)
    with pytest.raises(ValueError, match=r"margin must be a finite real number >= 1.0, got np.float32\(0.5\)"):
        csp.fp8.Recipe(margin=np.float32(0.5))


# --------------------------------------------------------------- item 8: sizes before allocations


@pytest.mark.parametrize("name, kw, tokens, tensor", [
    ("max_seqlen_q", dict(max_seqlen_q=10**6), 6, "q"),
    ("max_seqlen_kv", dict(max_seqlen_kv=10**6), 6, "k"),
    ("max_seqlen_q", dict(max_seqlen_q=np.int64(7)), 6, "q"),
])
def test_max_seqlen_is_checked_against_the_packed_tokens_first(name, kw, tokens, tensor):
    with pytest.raises(ValueError, match=rf"{name} = \d+ is more than the {tokens} packed tokens of {tensor}: no "
                                         r"sequence is that long"):
        _packed(**kw)


def test_max_seqlen_q_is_checked_for_packed_queries_over_a_paged_cache():
    q, k, v, table, _, lens_kv = make_paged(2, 4, 2, 1, 16, 4, 3, dtype=torch.float32, gen=G)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 1000000 is more than the 6 packed tokens of q"):
        csp.attention(torch.randn(6, 4, 16), k, v, block_table=table, seq_lens_kv=lens_kv, kv_layout="HND",
                      cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=10**6)


def test_max_seqlen_equal_to_the_tokens_is_fine():
    out = _packed(max_seqlen_q=6, max_seqlen_kv=6)
    assert torch.equal(out, _packed())


@pytest.mark.parametrize("value", [2**33, 2**31, -(2**33)], ids=["2**33", "2**31", "-2**33"])
def test_an_int64_block_table_entry_is_reported_as_given(value):
    q, k, v, table, lens_q, lens_kv = make_paged(2, 4, 2, 1, 16, 4, 3, dtype=torch.float32, gen=G,
                                                 lens_kv=[5, 12])
    table = table.long()
    table[1, 2] = value
    with pytest.raises(ValueError, match=rf"block_table\[1, 2\] = {value} is outside \[0, N = 9\)"):
        csp.attention(q, k, v, block_table=table, seq_lens_kv=lens_kv, kv_layout="HND")


def test_int64_lengths_and_prefix_sums_are_reported_as_given():
    big = 2**32 + 5
    with pytest.raises(ValueError, match=rf"seq_lens_kv\[0\] = {big} is outside \[0, S_kv = 6\]"):
        csp.attention(Q4, KV4, KV4, seq_lens_q=torch.tensor([3, 3]), seq_lens_kv=torch.tensor([big, 3]))
    with pytest.raises(ValueError, match=rf"sequence 1 has {2**33 - 2} tokens \(cu_seqlens_q\[2\] - cu_seqlens_q\[1\]\)"):
        _packed(cu_seqlens_q=torch.tensor([0, 2, 2**33]), max_seqlen_q=6, max_seqlen_kv=6)


# ------------------------------------------------------------------- item 5: explain's keywords


def test_explain_takes_every_attention_keyword():
    """docs/bad-input.md: ``explain`` takes any ``csp.attention`` keyword, plus its own four."""
    attention = set(inspect.signature(csp.attention).parameters)
    explain = set(inspect.signature(csp.explain).parameters)
    assert attention <= explain, f"explain lacks {sorted(attention - explain)}"
    assert explain - attention == {"attn_mask", "deterministic", "through_sdpa", "device"}
    for name in attention - {"q", "k", "v"}:
        assert inspect.signature(csp.explain).parameters[name].default == \
            inspect.signature(csp.attention).parameters[name].default, name


H200 = {"compute_capability": (9, 0), "cudnn_version": "9.19.0"}


def _paged_meta(fa=False, **kw):
    q = torch.empty(4, 8, 1, 128, dtype=torch.bfloat16, device="meta", **kw)
    cache = torch.empty(64, 16, 2, 128, dtype=torch.bfloat16, device="meta")  # (N, block_size, H_kv, D)
    table = torch.zeros(4, 8, dtype=torch.int32, device="meta")
    lens = torch.zeros(4, dtype=torch.int32, device="meta")
    return q, cache if fa else cache.transpose(1, 2), table, lens


def _slugs(result):
    return {path: [r.slug for r in reasons] for path, reasons in result.items()}


def test_explain_a_paged_call():
    q, cache, table, lens = _paged_meta(fa=True)
    nhd = csp.explain(q, cache, cache, block_table=table, seq_lens_kv=lens, kv_layout="NHD", device=H200)
    assert _slugs(nhd) == {"paged_fwd": []}
    q2, hnd_cache, _, _ = _paged_meta()
    hnd = csp.explain(q2, hnd_cache, hnd_cache, block_table=table, seq_lens_kv=lens, kv_layout="HND", device=H200,
                      return_lse=True, validate=False, is_causal=True, bottom_right=True)
    assert _slugs(hnd) == {"paged_fwd": []}
    cpu = make_paged(2, 4, 2, 1, 16, 4, 3, dtype=torch.float32, gen=G)
    assert _slugs(csp.explain(*cpu[:3], block_table=cpu[3], seq_lens_kv=cpu[5], kv_layout="HND")) == {
        "paged_fwd": ["no_cuda"]}


def test_explain_a_paged_call_that_needs_grad_or_has_packed_queries():
    q, cache, table, lens = _paged_meta(fa=True, requires_grad=True)
    found = _slugs(csp.explain(q, cache, cache, block_table=table, seq_lens_kv=lens, kv_layout="NHD", device=H200))
    assert found == {"paged_fwd": ["paged_backward"]}
    packed = torch.empty(10, 8, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.zeros(5, dtype=torch.int32, device="meta")
    found = _slugs(csp.explain(packed, cache, cache, block_table=table, seq_lens_kv=lens, kv_layout="NHD",
                               cu_seqlens_q=cu, max_seqlen_q=4, device=H200))
    assert found == {"paged_fwd": []}
    odd = torch.empty(64, 2, 12, 128, dtype=torch.bfloat16, device="meta")  # block size 12: not a power of 2
    assert _slugs(csp.explain(q.detach(), odd, odd, block_table=table, seq_lens_kv=lens, kv_layout="HND",
                              device=H200))["paged_fwd"] != []


@pytest.mark.parametrize("kw, exc, match", [
    (dict(), TypeError, r"block_table needs kv_layout"),
    (dict(kv_layout="bhsd"), ValueError, r"kv_layout must be 'NHD'"),
    (dict(kv_layout="HND", validate="yes"), TypeError, r"validate must be None"),
    (dict(kv_layout="HND", return_lse=1), TypeError, r"return_lse must be a bool"),
    (dict(kv_layout="HND", dropout_p=0.1), ValueError, r"dropout_p is not supported with block_table"),
])
def test_explain_checks_paged_arguments_like_attention(kw, exc, match):
    q, cache, table, lens = _paged_meta()
    with pytest.raises(exc, match=match):
        csp.explain(q, cache, cache, block_table=table, seq_lens_kv=lens, device=H200, **kw)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_window_s_quick_form_agrees_with_the_full_checks(is_causal):
    """``arguments.window`` answers plain (int, int) tuples without the full checks: the same pair
    and type as ``support.canonical_window`` for every bound from -2 to 3, the same errors for the
    invalid ones (below -1; a right bound with ``is_causal``), and bools never take the quick form."""
    from cudnn_sdpa_provider.core import arguments, support

    for left in range(-2, 4):
        for right in range(-2, 4):
            try:
                want = support.canonical_window(is_causal, (left, right))
            except ValueError:
                with pytest.raises(ValueError):
                    arguments.window(is_causal, (left, right))
                continue
            got = arguments.window(is_causal, (left, right))
            assert got == want and type(got) is tuple and all(type(x) is int for x in got), (left, right)
    for bad in ((True, 0), (0, False)):
        with pytest.raises(TypeError, match="bool"):
            arguments.window(is_causal, bad)
