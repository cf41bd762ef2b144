"""CPU tier: the capability table (``support.RULES``) as pure data, with fake machines."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from cudnn_sdpa_provider.engine import machine
from cudnn_sdpa_provider.core import support
from cudnn_sdpa_provider.core.reasons import CATALOG, Slug
from cudnn_sdpa_provider.core.support import Capabilities, Problem

#: A machine that serves everything the baseline problem asks: H200-like, cuDNN 9.19.
HOPPER = Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900, frontend_version="1.28.0")
AMPERE = dataclasses.replace(HOPPER, compute_capability=(8, 0))

BASE = Problem(kind="dense", backward=False, device_type="cuda", dtypes=(torch.bfloat16,) * 3, batch=2, h_q=8,
               h_k=8, h_v=8, s_q=1024, s_kv=1024, d_qk=128, d_v=128)


def problem(**overrides) -> Problem:
    return dataclasses.replace(BASE, **overrides)


def caps(**overrides) -> Capabilities:
    return dataclasses.replace(HOPPER, **overrides)


def slugs(p: Problem, c: Capabilities = HOPPER, **kw) -> list[str]:
    return [r.slug for r in support.reasons(p, c, **kw)]


def test_baseline_is_served_forward_and_backward():
    assert support.reasons(BASE, HOPPER) == []
    assert support.reasons(problem(backward=True), HOPPER) == []
    assert support.reasons(problem(kind="varlen", backward=True), HOPPER) == []


# (id, problem overrides, capability overrides, expected FIRST slug)
TRIGGERED = [
    ("cpu_inputs", dict(device_type="cpu"), {}, "no_cuda"),
    ("no_cuda_machine", {}, dict(cuda=False), "no_cuda"),
    ("cudnn_unavailable", {}, dict(unavailable="libcudnn not found"), "cudnn_unavailable"),
    ("cc_7_5", {}, dict(compute_capability=(7, 5)), "compute_capability"),
    ("cudnn_too_old", {}, dict(cudnn_version=support.MIN_CUDNN - 1), "cudnn_version"),
    ("cudnn_9_10_0_blocked", {}, dict(cudnn_version=91000), "cudnn_version"),
    ("cudnn_9_10_1_blocked", {}, dict(cudnn_version=91001), "cudnn_version"),
    ("cudnn_9_14_window_bug", dict(window=(128, 128), s_kv=1025), dict(cudnn_version=91400), "cudnn_bug"),
    ("cudnn_9_14_window_left_only", dict(window=(128, -1), s_kv=2048), dict(cudnn_version=91400), "cudnn_bug"),
    ("cudnn_9_26_bwd_crash", dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92600), "cudnn_known_issue"),
    ("cudnn_9_26_5_bwd_crash", dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92605), "cudnn_known_issue"),
    ("sinks_before_9_13", dict(sinks=True), dict(cudnn_version=91299), "cudnn_feature"),
    ("empty", dict(empty=True), {}, "empty"),
    ("dtype_fp32", dict(dtypes=(torch.float32,) * 3), {}, "dtype"),
    ("dtype_mixed", dict(dtypes=(torch.bfloat16, torch.float16, torch.bfloat16)), {}, "dtype"),
    ("dtype_v_differs", dict(dtypes=(torch.float16, torch.float16, torch.float32)), {}, "dtype"),
    ("head_dim_not_multiple_of_8", dict(d_qk=60, d_v=60), {}, "head_dim"),
    ("head_dim_v_not_multiple_of_8", dict(d_v=100), {}, "head_dim"),
    ("head_dim_over_256", dict(d_qk=264, d_v=264), {}, "head_dim"),
    ("head_dim_zero", dict(d_qk=0), {}, "head_dim"),
    ("head_dim_bwd_192_ampere", dict(backward=True, d_qk=192, d_v=128), dict(compute_capability=(8, 9)), "head_dim"),
    ("gqa_h_k", dict(h_q=8, h_k=3, h_v=8), {}, "gqa_heads"),
    ("gqa_h_v", dict(h_q=8, h_k=8, h_v=3), {}, "gqa_heads"),
    ("gqa_zero_heads", dict(h_k=0), {}, "gqa_heads"),
    ("sink_backward_ragged", dict(kind="varlen", backward=True, sinks=True), dict(cudnn_version=92599),
     "sink_backward_ragged"),
    ("sink_decode", dict(sinks=True, s_q=1), {}, "sink_decode"),
    ("seq_len_one_backward", dict(backward=True, s_q=1, s_kv=1), {}, "seq_len_one_backward"),
    ("varlen_bias", dict(kind="varlen", bias=True), {}, "attn_bias"),
    ("bias_grad", dict(bias=True, bias_grad=True), {}, "attn_bias"),
    ("varlen_dropout", dict(kind="varlen", dropout_p=0.1), {}, "dropout"),
    ("dropout_p_1", dict(dropout_p=1.0), {}, "dropout"),
    ("dropout_cudnn_9_11", dict(dropout_p=0.1), dict(cudnn_version=91100), "cudnn_bug"),
    ("dropout_cudnn_9_13_x", dict(dropout_p=0.1), dict(cudnn_version=91399), "cudnn_bug"),
    ("ragged_offset_overflow", dict(kind="varlen", ragged_extent=2**31), {}, "ragged_offset_overflow"),
    ("dropout_recompute", dict(dropout_p=0.1, recompute=True), {}, "dropout_recompute"),
    ("paged_kv", dict(kind="varlen", paged=True), {}, "paged_kv"),
    ("unsupported_argument", dict(kind="varlen", unsupported=("backend",)), {}, "unsupported_argument"),
]


@pytest.mark.parametrize("p_kw, c_kw, slug", [t[1:] for t in TRIGGERED], ids=[t[0] for t in TRIGGERED])
def test_rule_triggered(p_kw, c_kw, slug):
    found = support.reasons(problem(**p_kw), caps(**c_kw))
    assert found, f"expected {slug}"
    assert found[0].slug == slug, found
    assert found[0].message, "every reason carries a message"


# (id, problem overrides, capability overrides): near misses of the rules above, all served
NOT_TRIGGERED = [
    ("cc_8_0", {}, dict(compute_capability=(8, 0))),
    ("cc_unknown", {}, dict(compute_capability=None)),
    ("cudnn_min", {}, dict(cudnn_version=support.MIN_CUDNN)),
    ("cudnn_unknown", dict(sinks=True), dict(cudnn_version=None)),
    ("cudnn_9_10_2", {}, dict(cudnn_version=91002)),
    ("cudnn_9_14_window_s_kv_1024", dict(window=(128, 128), s_kv=1024), dict(cudnn_version=91400)),
    ("cudnn_9_14_causal_window", dict(window=(128, 0), s_kv=4096), dict(cudnn_version=91400)),
    ("cudnn_9_14_full", dict(window=(-1, -1), s_kv=4096), dict(cudnn_version=91400)),
    ("cudnn_9_14_1_window", dict(window=(128, 128), s_kv=4096), dict(cudnn_version=91401)),
    ("cudnn_9_26_forward", dict(batch=1, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92600)),
    ("cudnn_9_26_s_q_2", dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=2, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92600)),
    ("cudnn_9_27_batch_2", dict(backward=True, batch=2, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92700)),
    ("cudnn_9_25_crash_config", dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
     dict(cudnn_version=92499)),
    ("sinks_9_13", dict(sinks=True), dict(cudnn_version=91300)),
    ("sinks_dense_backward_9_13", dict(sinks=True, backward=True), dict(cudnn_version=91300)),
    ("sinks_varlen_forward_9_13", dict(kind="varlen", sinks=True), dict(cudnn_version=91300)),
    ("sinks_varlen_backward_9_26", dict(kind="varlen", backward=True, sinks=True), dict(cudnn_version=92600)),
    ("fp16", dict(dtypes=(torch.float16,) * 3), {}),
    ("head_dim_8", dict(d_qk=8, d_v=8), {}),
    ("head_dim_256", dict(d_qk=256, d_v=256, backward=True), {}),
    ("head_dim_bwd_192_hopper", dict(backward=True, d_qk=192, d_v=128), {}),
    ("head_dim_fwd_256_ampere", dict(d_qk=256, d_v=256), dict(compute_capability=(8, 0))),
    ("head_dim_bwd_128_ampere", dict(backward=True), dict(compute_capability=(8, 6))),
    ("gqa", dict(h_q=8, h_k=2, h_v=1), {}),
    ("sinks_s_q_2", dict(sinks=True, s_q=2), {}),
    ("s_q_1_forward", dict(s_q=1, s_kv=1), {}),
    ("s_q_1_backward_s_kv_2", dict(backward=True, s_q=1, s_kv=2), {}),
    ("dense_bias", dict(bias=True), {}),
    ("dropout_0", dict(dropout_p=0.0), {}),
    ("dense_dropout", dict(dropout_p=0.1, backward=True), {}),
    ("dropout_cudnn_9_10_2", dict(dropout_p=0.1), dict(cudnn_version=91002)),
    ("dropout_cudnn_9_14", dict(dropout_p=0.1), dict(cudnn_version=91400)),
    ("varlen_dropout_0", dict(kind="varlen", dropout_p=0.0), {}),
    ("ragged_at_int32_max", dict(kind="varlen", ragged_extent=2**31 - 1), {}),
    ("dense_extent_ignored", dict(kind="dense", ragged_extent=2**40), {}),
    ("recompute_without_dropout", dict(recompute=True), {}),
    ("recompute_backward", dict(dropout_p=0.1, recompute=True, backward=True), {}),
]


@pytest.mark.parametrize("p_kw, c_kw", [t[1:] for t in NOT_TRIGGERED], ids=[t[0] for t in NOT_TRIGGERED])
def test_rule_not_triggered(p_kw, c_kw):
    assert support.reasons(problem(**p_kw), caps(**c_kw)) == []


def test_no_cuda_stops_evaluation():
    bad = problem(device_type="cpu", dtypes=(torch.float32,) * 3, d_qk=7, dropout_p=1.0)
    found = support.reasons(bad, caps(cuda=False, unavailable="CUDA is not available"))
    assert [r.slug for r in found] == ["no_cuda"]
    assert "'cpu'" in found[0].message


def test_cudnn_unavailable_stops_evaluation():
    bad = problem(dtypes=(torch.float32,) * 3, d_qk=7)
    found = support.reasons(bad, caps(unavailable="nvidia-cudnn-frontend is not installed", cudnn_version=None))
    assert [r.slug for r in found] == ["cudnn_unavailable"]
    assert found[0].message == "nvidia-cudnn-frontend is not installed"


def test_reasons_are_ordered_most_important_first():
    p = problem(backward=True, dtypes=(torch.float32,) * 3, d_qk=12, h_k=3, sinks=True, s_q=1, s_kv=1, dropout_p=1.0)
    c = caps(compute_capability=(7, 0), cudnn_version=91001)
    # 9.10.1 is both blocked (global gate) and too old for sinks (feature gate): two reasons, two slugs.
    assert slugs(p, c) == ["compute_capability", "cudnn_version", "dtype", "head_dim", "gqa_heads", "cudnn_feature",
                           "sink_decode", "seq_len_one_backward", "dropout"]


def test_one_rule_per_slug_and_every_slug_catalogued():
    rule_slugs = [r.slug for r in support.RULES]
    assert len(rule_slugs) == len(set(rule_slugs)), "a slug has one meaning: one rule each"
    assert set(CATALOG) == {s.value for s in Slug}, "every Slug member has a catalog entry and no other"
    assert set(rule_slugs) <= set(CATALOG)


def test_first_reason_is_global_version_before_problem_rules():
    assert slugs(problem(dtypes=(torch.float32,) * 3), caps(cudnn_version=90000)) == ["cudnn_version", "dtype"]


def test_version_messages_name_the_versions():
    (old,) = support.reasons(BASE, caps(cudnn_version=90500))
    assert "9.5.0" in old.message and "9.6.0" in old.message
    (blocked,) = support.reasons(BASE, caps(cudnn_version=91001))
    assert "9.10.1" in blocked.message and "blocked" in blocked.message
    (sinks,) = support.reasons(problem(sinks=True), caps(cudnn_version=91200))
    assert "9.13.0" in sinks.message and "9.12.0" in sinks.message
    (ragged,) = support.reasons(problem(kind="varlen", backward=True, sinks=True), caps(cudnn_version=92000))
    assert "9.26.0" in ragged.message and "9.20.0" in ragged.message


def test_rule_slugs_are_catalogued_snake_case():
    for rule in support.RULES:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", rule.slug), rule.slug
        assert rule.slug in CATALOG, f"{rule.slug} has no CATALOG entry"
        assert rule.summary
    assert "deterministic_workspace" in CATALOG


# ------------------------------------------------------------------------ deterministic workspace

DET = problem(backward=True, deterministic=True, batch=8, h_q=32, h_k=32, h_v=32, s_q=8192, s_kv=8192)
OLD_HOPPER = caps(cudnn_version=92400)


def test_deterministic_workspace_bytes_quadratic_before_9_25_on_hopper():
    assert support.deterministic_workspace_bytes(DET, OLD_HOPPER) == 2 * 8 * 32 * 8192 * 8192  # ~34 GB at B=8, H=32, S=8k


@pytest.mark.parametrize(
    "p, c",
    [
        (DET, caps(cudnn_version=92500)),
        (DET, dataclasses.replace(OLD_HOPPER, compute_capability=(8, 0))),
        (DET, dataclasses.replace(OLD_HOPPER, compute_capability=(10, 0))),
        (dataclasses.replace(DET, deterministic=False), OLD_HOPPER),
        (dataclasses.replace(DET, backward=False), OLD_HOPPER),
    ],
    ids=["cudnn_9_25", "ampere", "blackwell", "not_deterministic", "forward"],
)
def test_deterministic_workspace_bytes_small(p, c):
    assert support.deterministic_workspace_bytes(p, c) == 0


def test_deterministic_workspace_reason_above_limit():
    need = support.deterministic_workspace_bytes(DET, OLD_HOPPER)
    found = support.reasons(DET, OLD_HOPPER, deterministic_limit_bytes=need - 1)
    assert [r.slug for r in found] == ["deterministic_workspace"]
    assert f"{need / 2**20:.0f} MiB" in found[0].message


@pytest.mark.parametrize("limit", [None, 2 * 8 * 32 * 8192 * 8192])
def test_deterministic_workspace_within_limit_or_unlimited(limit):
    assert support.reasons(DET, OLD_HOPPER, deterministic_limit_bytes=limit) == []


def test_deterministic_workspace_only_when_nothing_else_applies():
    p = dataclasses.replace(DET, bias=True, bias_grad=True)
    assert slugs(p, OLD_HOPPER, deterministic_limit_bytes=0) == ["attn_bias"]


# ----------------------------------------------------------------------------------- windows


@pytest.mark.parametrize(
    "is_causal, window, expected",
    [
        (False, (-1, -1), (-1, -1)),
        (False, None, (-1, -1)),
        (True, (-1, -1), (-1, 0)),
        (True, None, (-1, 0)),
        (True, (128, -1), (128, 0)),
        (True, (5, 0), (5, 0)),
        (False, (5, 0), (5, 0)),
        (False, [3, 7], (3, 7)),
        (False, (0, 0), (0, 0)),
    ],
)
def test_canonical_window(is_causal, window, expected):
    got = support.canonical_window(is_causal, window)
    assert got == expected and type(got) is tuple


@pytest.mark.parametrize(
    "window, match",
    [
        ((1, 2, 3), r"window must be a pair \(left, right\) of ints >= -1, got \(1, 2, 3\)"),
        (5, r"window must be a pair .* got 5"),
        ("ab", r"window must be a pair .* got 'ab'"),
        ((-2, 0), r"window left bound must be an int >= -1 \(-1 = unbounded\), got -2"),
        ((0, -5), r"window right bound must be an int >= -1 .* got -5"),
        ((1.5, 0), r"window left bound .* got 1.5"),
        ((True, 0), r"window left bound .* got True"),
    ],
)
def test_canonical_window_rejects_bad_windows(window, match):
    with pytest.raises(ValueError, match=match):
        support.canonical_window(False, window)


@pytest.mark.parametrize("is_causal", [1, 0, "yes", None])
def test_canonical_window_is_causal_must_be_bool(is_causal):
    with pytest.raises(TypeError, match=f"is_causal must be a bool, got {type(is_causal).__name__}"):
        support.canonical_window(is_causal, (-1, -1))


def test_canonical_window_causal_conflict_names_both():
    with pytest.raises(ValueError, match=r"is_causal=True conflicts with window right bound 4; use window=\(2, 0\)"):
        support.canonical_window(True, (2, 4))


@pytest.mark.parametrize(
    "window, bounds",
    [((-1, -1), (None, None)), ((-1, 0), (None, 0)), ((0, 0), (1, 0)), ((127, 0), (128, 0)), ((3, 5), (4, 5)),
     ((7, -1), (8, None))],
)
def test_cudnn_bounds(window, bounds):
    # cuDNN's left bound counts the diagonal: FlashAttention's left w is w + 1 keys.
    assert support.cudnn_bounds(window) == bounds


@given(left=st.integers(-1, 4096), right=st.integers(-1, 4096), causal=st.booleans())
def test_canonical_window_then_bounds_properties(left, right, causal):
    if causal and right > 0:
        with pytest.raises(ValueError):
            support.canonical_window(causal, (left, right))
        return
    w = support.canonical_window(causal, (left, right))
    assert w[0] == left and w[1] == (0 if causal else right)
    lb, rb = support.cudnn_bounds(w)
    assert lb == (None if left < 0 else left + 1)
    assert rb == (None if w[1] < 0 else w[1])


# ------------------------------------------------------------------------------------- misc


@pytest.mark.parametrize(
    "v, text", [(91900, "9.19.0"), (90600, "9.6.0"), (91001, "9.10.1"), (92605, "9.26.5"), (100000, "10.0.0"),
                (None, "none")]
)
def test_version_str(v, text):
    assert support.version_str(v) == text


def test_problem_path_and_describe():
    p = problem(kind="varlen", backward=True, sinks=True, dropout_p=0.25, window=(4, 0), h_k=2, h_v=2)
    assert p.path == "varlen_bwd"
    assert BASE.path == "dense_fwd"
    text = p.describe()
    for piece in ("varlen_bwd", "B=2", "H=8/2/2", "S=1024/1024", "D=128/128", "bfloat16/bfloat16/bfloat16",
                  "window=(4, 0)", "sinks", "dropout=0.25"):
        assert piece in text, (piece, text)
    assert "bias" not in text


def test_with_version_copies():
    newer = support.with_version(HOPPER, 92600)
    assert newer.cudnn_version == 92600 and HOPPER.cudnn_version == 91900
    assert newer.compute_capability == HOPPER.compute_capability


def test_capabilities_on_this_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    c = machine.capabilities()
    assert c.cuda is False and c.unavailable
    cpu = problem(device_type="cpu")
    assert slugs(cpu, c) == ["no_cuda"]


# ``length_class``: what the rules read of the lengths. ``route.entry`` shares one decision across the
# lengths of a class, so a rule that reads a length in a way the class does not capture would serve
# (or refuse) a length on another length's decision: every rule is checked here on random problems.

_LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 3, 1023, 1024, 1025]), st.integers(min_value=0, max_value=3000))
_MACHINES = [caps(), caps(cudnn_version=91400), caps(cudnn_version=92600), caps(cudnn_version=91200),
             caps(compute_capability=(10, 0)), caps(compute_capability=(8, 0), cudnn_version=90600)]


@given(kind=st.sampled_from(["dense", "paged"]), backward=st.booleans(), sinks=st.booleans(),
       left=st.sampled_from([-1, 0, 64]), right=st.sampled_from([-1, 0, 64]), batch=st.integers(1, 3),
       h_q=st.sampled_from([1, 2, 8]), dropout=st.sampled_from([0.0, 0.1]), s=st.tuples(_LENGTHS, _LENGTHS),
       other=st.tuples(_LENGTHS, _LENGTHS))
def test_lengths_of_one_class_have_the_same_reasons(kind, backward, sinks, left, right, batch, h_q, dropout, s,
                                                    other):
    assume(support.length_class(*s) == support.length_class(*other))

    def p(lengths):
        return problem(kind=kind, backward=backward, sinks=sinks, window=(left, right), batch=batch, h_q=h_q,
                       h_k=h_q, h_v=h_q, dropout_p=dropout, s_q=lengths[0], s_kv=lengths[1],
                       empty=min(lengths) == 0)

    for machine_caps in _MACHINES:
        assert slugs(p(s), machine_caps) == slugs(p(other), machine_caps), (s, other, machine_caps)


def test_length_class_tells_apart_what_the_rules_read():
    assert support.length_class(0, 5) != support.length_class(1, 5) != support.length_class(2, 5)
    assert support.length_class(700, 1024) != support.length_class(700, 1025)
    assert support.length_class(700, 731) == support.length_class(3, 1000)
