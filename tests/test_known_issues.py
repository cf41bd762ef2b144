"""CPU tier: the known-bad cuDNN configurations table (issue #27 item 3).

Each row falls back with ``cudnn_known_issue`` on the releases and GPUs it covers and not outside
them; ``explain()`` and the doctor show it; and the table is applied to the graph actually built
(``graphs.plan``, on the key's own dims), so a graph whose dims differ from its call's never reaches
cuDNN: it is refused like cuDNN's own rejections and the call falls back with the table's reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider import diagnostics
from cudnn_sdpa_provider.core import counters, known_issues, support
from cudnn_sdpa_provider.core.errors import NotSupportedError
from cudnn_sdpa_provider.core.keys import BwdKey, Desc, FwdKey, graph_problem
from cudnn_sdpa_provider.engine import dense, graphs, machine
from cudnn_sdpa_provider.ops import route
from tests import fake_cudnn

H200 = support.Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900, device_name="H200")
B200 = dataclasses.replace(H200, compute_capability=(10, 0), device_name="B200")
FP8 = (torch.float8_e4m3fn,) * 3
BASE = support.Problem(kind="dense", backward=False, device_type="cuda", dtypes=(torch.bfloat16,) * 3, batch=2,
                       h_q=8, h_k=8, h_v=8, s_q=1024, s_kv=1024, d_qk=128, d_v=128)

#: (row, a problem it covers, GPU, first covered release, last release before it, first release after it or None)
CASES = {
    "NVIDIA/cudnn-frontend#1071": (dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=1, s_kv=128, d_qk=64, d_v=64),
                                   H200, 92600, 92599, None),
    "NVIDIA/cudnn-frontend#1072": (dict(backward=True, batch=1, h_q=2, h_k=2, h_v=2, s_q=1, s_kv=128, d_qk=64, d_v=64),
                                   H200, 92500, 92499, 92700),
    "pytorch/pytorch#194927": (dict(s_q=1, s_kv=4096), B200, 91900, 91899, None),
    "cudnn-sdpa-provider run 65 (FP8 padded backward)": (
        dict(kind="fp8", backward=True, padded=True, h_k=2, h_v=2, batch=4, s_q=2048, s_kv=2048, dtypes=FP8),
        H200, 91400, 91399, None),
    "cudnn-sdpa-provider run 65 (FP8 zero-length sequence)": (
        dict(kind="fp8", padded=True, empty_sequence=True, dtypes=FP8), H200, 91400, 91399, None),
}
FP8_ROWS = {issue for issue in CASES if issue.startswith("cudnn-sdpa-provider")}


def _first(p, caps):
    found = support.reasons(p, caps)
    return found[0] if found else None


def test_every_row_has_a_case():
    assert sorted(CASES) == sorted(row.issue for row in support.KNOWN_ISSUES)


@pytest.mark.parametrize("issue", sorted(CASES))
def test_each_row_falls_back_on_the_releases_it_covers_and_not_outside(issue):
    overrides, gpu, first, before, after = CASES[issue]
    p = dataclasses.replace(BASE, **overrides)
    for version in (first, first + 1, (after - 1) if after else 92801, (after - 1) if after else 99999):
        reason = _first(p, support.with_version(gpu, version))
        assert reason is not None and reason.slug == "cudnn_known_issue", (version, reason)
        assert issue in reason.message and support.version_str(version) in reason.message
    row = next(r for r in support.KNOWN_ISSUES if r.issue == issue)
    assert row.applies(p) and row.covers(first, gpu.compute_capability)
    assert not row.covers(before, gpu.compute_capability) and not (after and row.covers(after, gpu.compute_capability))
    below = 92499 if issue.endswith("#1071") else before  # 9.25.x: #1072 covers that backward too
    if issue in FP8_ROWS:  # the rows start where FP8 SDPA does: below it, FP8's own version rule
        assert _first(p, support.with_version(gpu, below)).slug == "cudnn_feature"
    else:
        assert _first(p, support.with_version(gpu, below)) is None, "served below the range"
    if after:
        assert _first(p, support.with_version(gpu, after)) is None, "served from the release that fixed it"
    assert support.known_issue(None, gpu.compute_capability, p) is None, "no version known: no gate"


def test_the_rows_cover_their_shape_family_and_no_more():
    v928, v926 = support.with_version(H200, 92801), support.with_version(H200, 92600)
    single = dict(backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=1)
    for s_kv, d, dtype in ((128, 64, torch.bfloat16), (4096, 128, torch.float16), (7, 256, torch.bfloat16)):
        p = dataclasses.replace(BASE, **single, s_kv=s_kv, d_qk=d, d_v=d, dtypes=(dtype,) * 3)
        assert "#1071" in _first(p, v928).message, "any S_kv, D, dtype of the single-row S_q == 1 backward"
    for served in (dict(single, s_q=2), dict(single, batch=2), dict(single, h_q=2, h_k=2, h_v=2),
                   dict(single, backward=False)):
        assert _first(dataclasses.replace(BASE, **served), v928) is None, served
    assert "#1072" in _first(dataclasses.replace(BASE, backward=True, s_q=1, s_kv=300), v926).message
    assert _first(dataclasses.replace(BASE, backward=True, s_q=2, s_kv=300), v926) is None
    decode = dataclasses.replace(BASE, s_q=1)
    assert "#194927" in _first(decode, support.with_version(B200, 92600)).message
    assert _first(decode, v928) is None, "Hopper decode is served"
    assert _first(dataclasses.replace(decode, s_q=2), support.with_version(B200, 92600)) is None
    sm120 = dataclasses.replace(B200, compute_capability=(12, 0), cudnn_version=92600)
    assert "#194927" in _first(dataclasses.replace(decode, kind="varlen"), sm120).message


def test_the_fp8_rows_cover_padded_backwards_and_empty_sequences_and_no_more():
    v919 = H200
    padded = dataclasses.replace(BASE, kind="fp8", backward=True, padded=True, h_k=2, h_v=2, dtypes=FP8)
    for bwd in (padded, dataclasses.replace(padded, h_k=8, h_v=8)):
        assert "FP8 padded backward" in _first(bwd, v919).message
    for served in (dict(padded=False), dict(backward=False)):
        assert _first(dataclasses.replace(padded, **served), v919) is None, served
    empty = dataclasses.replace(BASE, kind="fp8", padded=True, empty_sequence=True, dtypes=FP8)
    assert "zero-length" in _first(empty, v919).message
    assert "padded backward" in _first(dataclasses.replace(empty, backward=True), v919).message  # the first row
    assert _first(dataclasses.replace(empty, empty_sequence=False), v919) is None
    assert _first(dataclasses.replace(empty, kind="dense", dtypes=(torch.bfloat16,) * 3), v919) is None


def test_explain_lists_the_known_issue():
    q = torch.empty(1, 1, 1, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 1, 128, 64, device="meta", dtype=torch.bfloat16)
    found = csp.explain(q, k, k, through_sdpa=False, device={"compute_capability": (9, 0), "cudnn_version": "9.28.1"})
    assert found["dense_fwd"] == []
    assert [r.slug for r in found["dense_bwd"]] == ["cudnn_known_issue"]
    assert "cudnn-frontend#1071" in found["dense_bwd"][0].message
    old = csp.explain(q, k, k, through_sdpa=False, device={"compute_capability": (9, 0), "cudnn_version": "9.19.0"})
    assert old["dense_bwd"] == []


def test_doctor_shows_the_rows_that_apply_to_this_machine(monkeypatch):
    fp8_rows = [r.issue for r in support.KNOWN_ISSUES if r.issue in FP8_ROWS]
    rows = diagnostics.known_issue_rows(support.with_version(H200, 92600))
    assert [r.label for r in rows] == ["NVIDIA/cudnn-frontend#1071", "NVIDIA/cudnn-frontend#1072"] + fp8_rows
    assert all(r.section == "known issues" and "cudnn_known_issue" in r.value for r in rows)
    rows = diagnostics.known_issue_rows(support.with_version(B200, 92801))
    assert [r.label for r in rows] == ["NVIDIA/cudnn-frontend#1071", "pytorch/pytorch#194927"] + fp8_rows
    assert [r.label for r in diagnostics.known_issue_rows(H200)] == fp8_rows
    (none,) = diagnostics.known_issue_rows(dataclasses.replace(H200, compute_capability=(8, 0)))
    assert none.ok is True and "9.19.0" in none.value and "sm_80" in none.value
    (cpu,) = diagnostics.known_issue_rows(support.Capabilities(cuda=False))
    assert cpu.ok is None and cpu.value.startswith("skipped")

    from cudnn_sdpa_provider.tools import doctor

    monkeypatch.setattr(machine, "capabilities", lambda device_index=None: support.with_version(H200, 92801))
    monkeypatch.setattr(diagnostics, "feature_rows", lambda caps=None: [])
    labels = [(r.section, r.label) for r in doctor.doctor_rows(run_self_test=False)]
    assert ("known issues", "NVIDIA/cudnn-frontend#1071") in labels
    assert ("known issues", "NVIDIA/cudnn-frontend#1072") not in labels, "9.28 is past #1072's range"


def test_applicable_is_what_the_table_says():
    fp8_rows = sorted(FP8_ROWS)
    assert known_issues.applicable(91900, (8, 0)) == []
    assert sorted(r.issue for r in known_issues.applicable(91900, (9, 0))) == fp8_rows
    assert sorted(r.issue for r in known_issues.applicable(91900, (10, 0))) == sorted(["pytorch/pytorch#194927"] + fp8_rows)
    assert known_issues.applicable(91300, (9, 0)) == []


# ------------------------------------------------------------------------------ the graph built


def _desc(*dims, dtype=torch.bfloat16):
    strides, n = [], 1
    for size in reversed(dims):
        strides.insert(0, n)
        n *= size
    return Desc(tuple(dims), tuple(strides), dtype)


def _bwd_key(b=1, h=1, s_q=1, s_kv=128, d=64, ragged=False):
    q, kv = _desc(b, h, s_q, d), _desc(b, h, s_kv, d)
    return BwdKey(device=0, q=q, k=kv, v=kv, o=q, do=q, lse=_desc(b, h, s_q, 1, dtype=torch.float32), dq=q, dk=kv,
                  dv=kv, scale=0.125, window=(-1, -1), bottom_right=False, ragged=ragged, padded=ragged)


def test_a_bad_graph_key_is_refused_by_plan_without_reaching_cudnn(monkeypatch):
    built = fake_cudnn.install(monkeypatch, support.with_version(H200, 92801))
    before = graphs.cache_info()["rejected"]
    for _ in range(2):  # refused, and the refusal remembered (a fresh exception each time)
        with pytest.raises(NotSupportedError) as info:
            graphs.plan(_bwd_key())
        assert info.value.reason == "cudnn_known_issue" and "cudnn-frontend#1071" in info.value.detail
    assert built == [], "cuDNN never saw the graph"
    assert graphs.cache_info()["rejected"] == before + 1
    assert graphs.plan(_bwd_key(s_q=2)) is not None and len(built) == 1, "a graph outside the row is built"
    graphs.clear_cache()


def test_the_same_key_builds_on_a_release_outside_the_rows(monkeypatch):
    built = fake_cudnn.install(monkeypatch, H200)
    graphs.plan(_bwd_key())
    assert len(built) == 1
    graphs.clear_cache()


def test_the_graph_is_judged_on_its_own_dims_not_the_calls(monkeypatch):
    """A call whose own dims are fine, served through a graph whose dims are a known-bad shape (a
    bucketed or repaired graph), falls back with the table's reason; its later calls at once."""
    built = fake_cudnn.install(monkeypatch, support.with_version(H200, 92801))
    route.clear()
    call = dataclasses.replace(BASE, backward=True, batch=1, h_q=1, h_k=1, h_v=1, s_q=2, s_kv=128, d_qk=64, d_v=64)
    found = route.entry(("test-known-issue",), lambda: call, 0)
    assert found.first is None, "the call itself is not covered"
    natives = []
    before = counters.stats()
    for _ in range(2):
        route.call("dense_bwd", found, lambda: graphs.plan(_bwd_key()), lambda reason: natives.append(reason.slug),
                   lambda: "test", strict=False)
    region = counters.stats() - before
    assert dict(region.fallback["dense_bwd"]) == {"cudnn_known_issue": 2} and region.served["dense_bwd"] == 0
    assert natives == ["cudnn_known_issue"] * 2 and built == []
    route.clear()
    graphs.clear_cache()


def test_the_dense_engine_refuses_the_crashing_backward(monkeypatch):
    built = fake_cudnn.install(monkeypatch, support.with_version(H200, 92801))
    q, do, out = (torch.randn(1, 1, 1, 64) for _ in range(3))
    k, v = torch.randn(1, 1, 128, 64), torch.randn(1, 1, 128, 64)
    lse = torch.zeros(1, 1, 1, 1)
    with pytest.raises(NotSupportedError, match="cudnn_known_issue"):
        dense.backward(do, q, k, v, out, lse, scale=0.125)
    assert built == []
    graphs.clear_cache()


def test_graph_problem_reads_the_keys_own_dims():
    p = graph_problem(_bwd_key(b=3, h=4, s_q=64, s_kv=256, d=32, ragged=True))
    assert (p.kind, p.backward, p.batch, p.h_q, p.s_q, p.s_kv, p.d_qk, p.padded) == ("varlen", True, 3, 4, 64, 256,
                                                                                     32, True)
    q = _desc(2, 8, 1, 128)
    fwd = FwdKey(device=0, q=q, k=_desc(2, 8, 4096, 128), v=_desc(2, 8, 4096, 128), o=q, lse=None, scale=0.1,
                 window=(-1, 0), bottom_right=True)
    p = graph_problem(fwd)
    assert (p.kind, p.backward, p.s_q, p.s_kv, p.window, p.bottom_right) == ("dense", False, 1, 4096, (-1, 0), True)
