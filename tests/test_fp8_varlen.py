"""CPU tier: FP8 attention on packed (varlen) inputs, ``csp.fp8.attention(q, k, v, cu_seqlens_q=...)``.

Two ways it runs here. On CPU tensors the kernels run the FP8 reference on the padded form (reason
``no_cuda``), as on any machine cuDNN cannot serve. With the stand-in cuDNN (tests/fake_cudnn.py,
which reads and writes exactly what each graph key declares, ragged offsets included, and computes
with the FP8 reference sequence by sequence), the same calls take the served route: the packed
forward graph (``engine.fp8_packed``) and the dense FP8 backward graph on the padded form
(``ops.fp8_varlen``), so the graph keys, buckets, offsets, the placement of tokens, O, dO and the LSE
in the padded form and back, and the counters are checked without a GPU. Answers are checked
against float64 attention computed sequence by sequence, at the dense FP8 tests' bounds
(tests/test_fp8.py: ATTN_FWD_TOL, ATTN_GRAD_TOL, relative to each tensor's largest magnitude).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, known_issues, support
from cudnn_sdpa_provider.core.errors import NotSupportedError
from cudnn_sdpa_provider.engine import fp8_packed, graphs
from cudnn_sdpa_provider.ops import fp8_ops, fp8_reference, fp8_varlen, route
from tests import fake_cudnn
from tests.test_fp8 import ATTN_FWD_TOL, ATTN_GRAD_TOL
from tests.util import rel_error

fp8 = csp.fp8
E4M3 = torch.float8_e4m3fn
NAN_BYTE = 0x7F


def cu(lens) -> torch.Tensor:
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


def inputs(lens_q, lens_kv=None, h_q=4, h_k=2, d=32, dtype=torch.float32, seed=0):
    lens_kv = lens_q if lens_kv is None else lens_kv
    g = torch.Generator().manual_seed(seed)
    t_q, t_kv = sum(lens_q), sum(lens_kv)
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((t_q, h_q, d), (t_kv, h_k, d), (t_kv, h_k, d)))
    go = torch.randn(t_q, h_q, d, generator=g).to(dtype)
    return q, k, v, go


def reference64(q, k, v, go, lens_q, lens_kv, causal):
    """float64 attention sequence by sequence (top-left causal; a query without keys gives 0), with grads."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, sq, skv = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for n_q, n_kv in zip(lens_q, lens_kv):
        qs = qd[sq:sq + n_q].transpose(0, 1)[None]
        ks, vs = (t[skv:skv + n_kv].transpose(0, 1)[None].repeat_interleave(group, 1) for t in (kd, vd))
        if n_kv == 0 or n_q == 0:
            outs.append(qs.new_zeros(n_q, q.shape[1], v.shape[2]) + 0 * qs.sum())
        else:
            mask = torch.ones(n_q, n_kv, dtype=torch.bool).tril() if causal else None
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0].transpose(0, 1))
        sq, skv = sq + n_q, skv + n_kv
    out = torch.cat(outs)
    out.backward(go.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def run(q, k, v, go, lens_q, lens_kv=None, *, causal=False, recipe=None, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    lens_kv = lens_q if lens_kv is None else lens_kv
    extra = {} if lens_kv is lens_q else {"cu_seqlens_kv": cu(lens_kv)}
    out = fp8.attention(q, k, v, cu_seqlens_q=cu(lens_q), max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv),
                        is_causal=causal, recipe=recipe or fp8.Recipe(), **extra, **kw)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def assert_matches(got, q, k, v, go, lens_q, lens_kv, causal):
    want = reference64(q, k, v, go, lens_q, lens_kv, causal)
    out = got[0]
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
    err, worst = rel_error(out, want[0])
    assert 1e-3 < err <= ATTN_FWD_TOL, f"out: {err:.4f} at {worst}"
    for name, g, ref, like in zip(("dq", "dk", "dv"), got[1:], want[1:], (q, k, v)):
        assert g is not None and g.shape == like.shape and g.dtype == like.dtype, name
        err, worst = rel_error(g, ref)
        assert err <= ATTN_GRAD_TOL, f"{name}: {err:.4f} at {worst}"


def delta(before) -> dict:
    d = (counters.stats() - before).to_dict()
    return {p: e for p, e in d.items() if e["served"] or e["fallback"]}


@pytest.fixture
def served(monkeypatch):
    """CPU tensors decided as on a Hopper GPU with cuDNN 9.19 (the no_cuda rule left out), the
    kernels' CUDA halves called on them, the graphs run by the stand-in cuDNN."""
    fake_cudnn.FakeGraph.builds = 0
    built = fake_cudnn.install(monkeypatch)
    monkeypatch.setattr(support, "RULES", tuple(r for r in support.RULES if r.slug != "no_cuda"))
    monkeypatch.setitem(fp8_varlen._KERNELS, "cpu", fp8_varlen._fp8_varlen_fwd_cuda)
    monkeypatch.setitem(fp8_ops._KERNELS["bwd"], "cpu", fp8_ops._fp8_bwd_cuda)
    route.clear()
    yield built
    route.clear()
    graphs.clear_cache()


@pytest.fixture
def padded_backward_row_lifted(served, monkeypatch):
    """``served`` without the known-issues row that keeps every padded FP8 backward off cuDNN 9.19+
    (wrong dK/dV on sm_90, run 65): the served backward route, as on a release that fixes it."""
    monkeypatch.setattr(known_issues, "KNOWN_ISSUES", tuple(
        r for r in known_issues.KNOWN_ISSUES if r.applies is not known_issues._fp8_padded_backward))
    return served


LENS = {
    "self": ([7, 3, 12, 1], None),
    "cross": ([5, 9, 2], [11, 4, 8]),
    "keyless": ([4, 6, 3], [5, 0, 7]),  # the second sequence's queries see no key: 0, no gradient
}


# ----------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("case", list(LENS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_route_matches_fp64_per_sequence(case, causal, heads, dtype):
    lens_q, lens_kv = LENS[case]
    q, k, v, go = inputs(lens_q, lens_kv, *heads, dtype=dtype, seed=1)
    before = counters.stats()
    got = run(q, k, v, go, lens_q, lens_kv, causal=causal)
    assert delta(before) == {"fp8_fwd": {"served": 0, "fallback": {"no_cuda": 1}},
                             "fp8_bwd": {"served": 0, "fallback": {"no_cuda": 1}}}
    assert_matches(got, q, k, v, go, lens_q, lens_kv or lens_q, causal)


@pytest.mark.parametrize("case", list(LENS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_served_route_matches_fp64_per_sequence(padded_backward_row_lifted, case, causal, heads):
    served = padded_backward_row_lifted
    lens_q, lens_kv = LENS[case]
    q, k, v, go = inputs(lens_q, lens_kv, *heads, d=128, dtype=torch.bfloat16, seed=2)
    before = counters.stats()
    got = run(q, k, v, go, lens_q, lens_kv, causal=causal)
    assert_matches(got, q, k, v, go, lens_q, lens_kv or lens_q, causal)
    if case == "keyless":  # a zero-length sequence: the known-issues row, both passes on the reference
        assert delta(before) == {"fp8_fwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}},
                                 "fp8_bwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}}}
        assert not served
        return
    assert delta(before) == {"fp8_fwd": {"served": 1, "fallback": {}}, "fp8_bwd": {"served": 1, "fallback": {}}}
    fwd, bwd = (g.key for g in served)
    assert not fwd.backward and fwd.ragged and not fwd.padded, "the forward is the packed graph"
    assert bwd.backward and bwd.padded and not bwd.ragged, "the backward is the dense graph on the padded form"
    nb, sq, skv = fp8_packed.buckets(len(lens_q), max(lens_q), max(lens_kv or lens_q))
    assert (fwd.q.dims, fwd.k.dims[2]) == ((len(lens_q), 4, sq, 128), skv), "B as given, S_max bucketed"
    assert nb == len(lens_q)
    assert (bwd.q.dims, bwd.k.dims) == (fwd.q.dims, fwd.k.dims), "the backward at the forward's buckets"


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_the_padded_backward_runs_the_reference_with_the_known_issue(served, heads):
    """cuDNN 9.19's FP8 backward with a padding mask gave wrong dK/dV on sm_90 (run 65): the packed
    backward, a padded dense one, runs the FP8 reference with ``cudnn_known_issue``; the forward stays
    on cuDNN."""
    lens = [7, 3, 12, 1]
    q, k, v, go = inputs(lens, None, *heads, d=128, dtype=torch.bfloat16, seed=12)
    before = counters.stats()
    got = run(q, k, v, go, lens, causal=True)
    assert delta(before) == {"fp8_fwd": {"served": 1, "fallback": {}},
                             "fp8_bwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}}}
    assert_matches(got, q, k, v, go, lens, lens, True)
    assert [g.key.backward for g in served] == [False], "no backward graph built"


def test_a_zero_length_sequence_never_reaches_the_graphs(served):
    """cuDNN 9.19's FP8 graphs fault (illegal instruction) or hang on a zero-length sequence (run 65):
    the lengths are read first (one host sync) and such a call runs the reference, a user's own empty
    sequence as well as the zero lengths bad cu_seqlens become."""
    lens = [6, 0, 9]
    q, k, v, go = inputs(lens, d=128, seed=13)
    before = counters.stats()
    got = run(q, k, v, go, lens, causal=True)
    assert delta(before) == {"fp8_fwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}},
                             "fp8_bwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}}}
    assert_matches(got, q, k, v, go, lens, lens, True)
    assert not served, "no graph ran"


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_both_recipes_over_several_steps(served, scaling):
    recipe = fp8.Recipe(scaling=scaling)
    for step, lens in enumerate(([7, 3, 12, 1], [16, 2], [9, 9, 9])):
        q, k, v, go = inputs(lens, d=128, seed=10 + step)
        assert_matches(run(q, k, v, go, lens, causal=True, recipe=recipe), q, k, v, go, lens, lens, True)
    assert recipe.warm("cpu") == (scaling == "delayed")


def test_inference_forward_asks_no_lse(served):
    q, k, v, _ = inputs([7, 3, 12], d=128, seed=3)
    with torch.no_grad():
        out = fp8.attention(q, k, v, cu_seqlens_q=cu([7, 3, 12]), max_seqlen_q=12, max_seqlen_kv=12)
    assert served[0].key.lse is None
    assert rel_error(out, reference64(q, k, v, torch.zeros_like(q), [7, 3, 12], [7, 3, 12], False)[0])[0] \
        <= ATTN_FWD_TOL


# ------------------------------------------------------------------------------ graph reuse


def test_new_lengths_inside_a_bucket_build_no_graph(padded_backward_row_lifted):
    """S_max rounded up to a power of 2: batches of 4 sequences of up to 16 tokens share one forward
    and one backward graph; the token count is never part of a key. B is not rounded up (a bucket's
    extra sequences would be empty, which cuDNN's FP8 graphs fault on): a new batch size builds."""
    served = padded_backward_row_lifted
    for lens in ([7, 3, 12, 2], [16, 1, 5, 9], [9, 10, 11, 12]):
        q, k, v, go = inputs(lens, d=128, seed=sum(lens))
        assert_matches(run(q, k, v, go, lens, causal=True), q, k, v, go, lens, lens, True)
    assert fake_cudnn.FakeGraph.builds == 2, [g.key for g in served]
    for lens, builds in (([2, 15], 4), ([20, 3], 6), ([1, 16], 6), ([4, 5, 6], 8)):  # B 2, S 16; S 32; B 3
        q, k, v, go = inputs(lens, d=128, seed=sum(lens))
        run(q, k, v, go, lens, causal=True)
        assert fake_cudnn.FakeGraph.builds == builds, lens
    assert {g.key.q.dims[:3] for g in served} == {(4, 4, 16), (2, 4, 16), (2, 4, 32), (3, 4, 8)}


# --------------------------------------------------------------------------- fallbacks, strict


def test_a_head_dim_the_sm90_backward_lacks_serves_the_forward_and_falls_back_backward(served):
    lens = [7, 3, 12]
    q, k, v, go = inputs(lens, d=64, seed=5)
    before = counters.stats()
    got = run(q, k, v, go, lens, causal=True)
    assert delta(before) == {"fp8_fwd": {"served": 1, "fallback": {}},
                             "fp8_bwd": {"served": 0, "fallback": {"head_dim": 1}}}
    assert_matches(got, q, k, v, go, lens, lens, True)
    assert "head_dim=1" in csp.report()


def test_strict_mode_refuses_the_backward_the_sm90_engine_lacks(served):
    lens = [7, 3, 12]
    q, k, v, go = inputs(lens, d=64, seed=6)
    q.requires_grad_()
    with csp.enable(strict=True):
        out = fp8.attention(q, k, v, cu_seqlens_q=cu(lens), max_seqlen_q=12, max_seqlen_kv=12)
        with pytest.raises(csp.FallbackError) as info:
            out.backward(go)
    assert info.value.path == "fp8_bwd" and info.value.reasons == ["head_dim"]


def test_before_hopper_both_passes_fall_back_with_compute_capability(served, monkeypatch):
    monkeypatch.setattr(fp8_ops.route.machine, "capabilities",
                        lambda device_index=None: fake_cudnn.with_caps(compute_capability=(8, 0)))
    lens = [7, 3, 12]
    q, k, v, go = inputs(lens, d=128, seed=7)
    before = counters.stats()
    got = run(q, k, v, go, lens)
    assert delta(before) == {"fp8_fwd": {"served": 0, "fallback": {"compute_capability": 1}},
                             "fp8_bwd": {"served": 0, "fallback": {"compute_capability": 1}}}
    assert_matches(got, q, k, v, go, lens, lens, False)
    assert not served


def test_a_graph_cudnn_refuses_falls_back_with_graph_not_supported(padded_backward_row_lifted, monkeypatch):
    real = graphs._build

    def build(key, handle):
        if getattr(key, "ragged", False) and isinstance(key, graphs.Fp8Key):
            raise NotSupportedError("graph_not_supported", "fake: no engine for this graph")
        return real(key, handle)

    monkeypatch.setattr(graphs, "_build", build)
    lens = [7, 3, 12]
    q, k, v, go = inputs(lens, d=128, seed=8)
    before = counters.stats()
    got = run(q, k, v, go, lens, causal=True)
    assert delta(before) == {"fp8_fwd": {"served": 0, "fallback": {"graph_not_supported": 1}},
                             "fp8_bwd": {"served": 1, "fallback": {}}}
    assert_matches(got, q, k, v, go, lens, lens, True)


def test_strict_mode_refuses_on_cpu_and_counts_the_refusal():
    lens = [7, 3]
    q, k, v, _ = inputs(lens, seed=9)
    before = counters.stats()
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            fp8.attention(q, k, v, cu_seqlens_q=cu(lens), max_seqlen_q=7, max_seqlen_kv=7)
    assert info.value.path == "fp8_fwd" and info.value.reasons == ["no_cuda"]
    assert (counters.stats() - before).refused_dict() == {"fp8_fwd": {"no_cuda": 1}}


@pytest.mark.parametrize("route_", ["reference", "served"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_non_finite_input_makes_the_output_and_every_gradient_nan(request, route_, which):
    if route_ == "served":
        request.getfixturevalue("served")
    lens = [7, 3, 12]
    t = dict(zip("qkv", inputs(lens, d=128, seed=11)[:3]))
    t[which][9, 1, 5] = float("inf")
    q, k, v = (t[n].requires_grad_() for n in "qkv")
    out = fp8.attention(q, k, v, cu_seqlens_q=cu(lens), max_seqlen_q=12, max_seqlen_kv=12, recipe=fp8.Recipe())
    assert torch.isnan(out).all()
    out.backward(torch.ones_like(out))
    assert all(torch.isnan(g).all() for g in (q.grad, k.grad, v.grad))


# ---------------------------------------------------------------------------------- engine


def test_engine_writes_nothing_past_the_last_sequence(served):
    """The packed graph's offsets and lengths cover the sequences only: rows past cu_seqlens_q[-1]
    of a caller's buffers keep their NaN canaries (the GPU tier checks the same on cuDNN)."""
    lens, tail = [7, 3, 12], 5
    g = torch.Generator().manual_seed(12)
    q8, k8, v8 = (fp8.quantize(torch.randn(sum(lens) + tail, 4, 128, generator=g))[0] for _ in range(3))
    one = torch.ones(1)
    out = torch.full((q8.shape[0], 4, 128), NAN_BYTE, dtype=torch.uint8).view(E4M3)
    lse = torch.full((q8.shape[0], 4), float("nan"))
    got, got_lse, amax = fp8_packed.forward(q8, k8, v8, one, one, one, one, cu(lens), cu(lens), 12, 12,
                                            scale=128 ** -0.5, scale_s=256.0, causal=True, compute_lse=True,
                                            out=out, lse=lse)
    assert got is out and got_lse is lse
    assert (out[sum(lens):].view(torch.uint8) == NAN_BYTE).all() and torch.isnan(lse[sum(lens):]).all()
    assert torch.isfinite(out[:sum(lens)].float()).all() and torch.isfinite(lse[:sum(lens)]).all()
    assert torch.isfinite(amax).all()


def test_engine_out_of_range_cu_seqlens_read_nothing_and_give_nan(served):
    """Unchecked cu_seqlens (the GPU reads none on the host) reach cuDNN as zero lengths."""
    q8 = fp8.quantize(torch.randn(10, 4, 128))[0]
    one = torch.ones(1)
    bad = torch.tensor([0, 6, 4, 10], dtype=torch.int32)  # decreasing
    out, lse, amax = fp8_packed.forward(q8, q8, q8, one, one, one, one, bad, bad, 6, 6, scale=0.1, scale_s=256.0,
                                        causal=False, compute_lse=True)
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all() and torch.isnan(amax).all()
    call = served[0].calls[-1]
    assert not call[graphs.UID.SEQ_Q].any() and not call[graphs.UID.SEQ_KV].any()


@pytest.mark.parametrize("route_", ["reference", "served"])
@pytest.mark.parametrize("big", [0.0, 1e6])
def test_cu_seqlens_ending_short_of_the_tokens_give_nan_on_the_op(request, route_, big):
    """The op (what a CUDA call reaches: the host never reads its cu_seqlens) with sequences that end
    before the packed tokens: every output and gradient is NaN, whatever the rows past them hold
    (stale rows of a large value would otherwise set the per-tensor scales and zero every sequence
    silently: a reviewer's reproducer)."""
    if route_ == "served":
        request.getfixturevalue("served")
    lens = [7, 3, 12]
    q, k, v, _ = inputs(lens, d=128, seed=17)
    q, k, v = (torch.cat((t, torch.full((5,) + tuple(t.shape[1:]), big))).requires_grad_() for t in (q, k, v))
    out = fp8_varlen.attention(q, k, v, cu(lens), cu(lens), 12, 12, fp8.Recipe(), 128 ** -0.5, False, True)
    assert torch.isnan(out).all()
    out.backward(torch.ones_like(out))
    assert all(torch.isnan(g).all() for g in (q.grad, k.grad, v.grad))


def test_the_padded_form_round_trips_every_token():
    lens = [7, 0, 3, 12]
    place = fp8_varlen.Placement(cu(lens), cu(lens), 12, 12, 22, 22)
    x = torch.randn(22, 3, 8)
    padded = place.pad(x, "q")
    assert padded.shape == (4, 3, 16, 8)
    assert torch.equal(padded[3, :, :12], x[10:22].transpose(0, 1)) and not padded[3, :, 12:].any()
    assert not padded[1].any()
    assert torch.equal(place.unpad(padded, "q"), x)
    x8 = fp8.quantize(x)[0]
    assert torch.equal(place.unpad(place.pad(x8, "q"), "q").view(torch.uint8), x8.view(torch.uint8))


def test_opcheck_fp8_varlen_fwd():
    lens = [7, 3, 12]
    q8, k8, v8 = (fp8.quantize(torch.randn(22, h, 32))[0] for h in (4, 2, 2))
    one = torch.ones(1)
    for compute_lse in (True, False):
        args = (q8, k8, v8, one, one, one, one, cu(lens), cu(lens), 12, 12, 32 ** -0.5, 256.0, True, compute_lse, True)
        torch.library.opcheck(torch.ops.cudnn_sdpa.fp8_varlen_fwd, args,
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))


@pytest.mark.parametrize("cross", [False, True], ids=["cu_kv_default", "cu_kv_given"])
def test_compiled_fullgraph_forward_and_backward_equal_eager(cross):
    torch._dynamo.reset()
    lens_q, lens_kv = ([7, 3, 12], [5, 9, 4]) if cross else ([7, 3, 12], None)
    q, k, v, go = inputs(lens_q, lens_kv, seed=15)
    kw = dict(cu_seqlens_q=cu(lens_q), max_seqlen_q=12, max_seqlen_kv=12, is_causal=True)
    if cross:
        kw["cu_seqlens_kv"] = cu(lens_kv)
    recipe = fp8.Recipe()
    compiled = torch.compile(lambda q, k, v: fp8.attention(q, k, v, recipe=recipe, **kw), backend="eager",
                             fullgraph=True)
    results = []
    for fn in (compiled, lambda q, k, v: fp8.attention(q, k, v, recipe=fp8.Recipe(), **kw)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(go)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


# -------------------------------------------------------------------------------- arguments

LENS_OK = [7, 3, 12]


def _bad_calls():
    q, k, v, _ = inputs(LENS_OK, seed=13)
    c = cu(LENS_OK)
    ok = dict(cu_seqlens_q=c, max_seqlen_q=12, max_seqlen_kv=12)
    dense = q.view(1, 22, 4, 32).transpose(1, 2)
    return {
        "dense_q_with_cu": ((dense, dense, dense), ok, ValueError, "q must be 3-D .T, H, D. with cu_seqlens_q"),
        "packed_q_without_cu": ((q, k, v), {}, ValueError, "q must be 4-D"),
        "max_seqlen_without_cu": ((dense, dense, dense), dict(max_seqlen_q=12), ValueError,
                                  "are for packed .T, H, D. inputs; pass cu_seqlens_q too"),
        "cu_kv_without_cu_q": ((dense, dense, dense), dict(cu_seqlens_kv=c), ValueError, "pass cu_seqlens_q too"),
        "seq_lens_with_cu": ((q, k, v), dict(ok, seq_lens_q=torch.tensor([7])), ValueError,
                             "seq_lens_q / seq_lens_kv are for padded"),
        "cu_float": ((q, k, v), dict(ok, cu_seqlens_q=c.float()), TypeError, "cu_seqlens_q must be int32 or int64"),
        "cu_list": ((q, k, v), dict(ok, cu_seqlens_q=[0, 7, 10, 22]), TypeError,
                    "cu_seqlens_q must be a torch.Tensor"),
        "cu_2d": ((q, k, v), dict(ok, cu_seqlens_q=c.view(1, -1)), ValueError, "cu_seqlens_q must be 1-D prefix sums"),
        "cu_not_from_0": ((q, k, v), dict(ok, cu_seqlens_q=c + 1), ValueError, r"cu_seqlens_q\[0\] must be 0"),
        "cu_decreasing": ((q, k, v), dict(ok, cu_seqlens_q=torch.tensor([0, 7, 5, 22], dtype=torch.int32)),
                          ValueError, "cu_seqlens_q must be non-decreasing"),
        "cu_short_of_t": ((q, k, v), dict(ok, cu_seqlens_q=cu([7, 3, 11])), ValueError,
                          r"cu_seqlens_q\[-1\] = 21 must equal the 22 packed tokens of q"),
        "cu_past_t": ((q, k, v), dict(ok, cu_seqlens_q=cu([7, 3, 13]), max_seqlen_q=13, max_seqlen_kv=13),
                      ValueError, "runs past the 22 packed tokens"),
        "cu_kv_other_batch": ((q, k, v), dict(ok, cu_seqlens_kv=cu([10, 12])), ValueError,
                              "cu_seqlens_q and cu_seqlens_kv must have the same shape"),
        "cu_as_kv_short_of_t_kv": ((q, k[:20], v[:20]), ok, ValueError,
                                   r"sequence 2 has 12 tokens|cu_seqlens_q \(as cu_seqlens_kv\)"),
        "max_seqlen_too_small": ((q, k, v), dict(ok, max_seqlen_q=10), ValueError,
                                 "sequence 2 has 12 tokens .* but max_seqlen_q = 10"),
        "max_seqlen_kv_too_small": ((q, k, v), dict(ok, max_seqlen_kv=8), ValueError, "but max_seqlen_kv = 8"),
        "max_seqlen_missing": ((q, k, v), dict(cu_seqlens_q=c, max_seqlen_kv=12), ValueError,
                               "max_seqlen_q must be an integer >= 1"),
        "max_seqlen_past_t": ((q, k, v), dict(ok, max_seqlen_q=23), ValueError, "more than the 22 packed tokens"),
        "max_seqlen_tensor": ((q, k, v), dict(ok, max_seqlen_q=torch.tensor(12)), TypeError,
                              "max_seqlen_q must be an integer"),
        "kv_tokens_differ": ((q, k, v[:21]), ok, ValueError, "k and v must have the same number of tokens"),
        "heads": ((q, k[:, :1].expand(22, 3, 32), v[:, :1].expand(22, 3, 32)), ok, ValueError, "GQA/MQA"),
        "fp8_operands": (tuple(fp8.quantize(t)[0] for t in (q, k, v)), ok, TypeError, "must share one of"),
        "is_causal_int": ((q, k, v), dict(ok, is_causal=1), TypeError, "is_causal must be a bool"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_raise_naming_the_argument(name):
    args, kwargs, error, match = _bad_calls()[name]
    with pytest.raises(error, match=match):
        fp8.attention(*args, **kwargs)


def test_int64_cu_seqlens_are_taken_as_csp_attention_takes_them():
    q, k, v, go = inputs(LENS_OK, seed=14)
    out = fp8.attention(q, k, v, cu_seqlens_q=cu(LENS_OK).long(), max_seqlen_q=12, max_seqlen_kv=12)
    assert out.shape == q.shape


# --------------------------------------------------------------- dense padded calls, same rows


@pytest.mark.parametrize("lens", [([5, 16], [5, 16]), ([5, 0], [5, 7]), ([5, 16], [0, 16])],
                         ids=["no_empty", "empty_q", "empty_kv"])
def test_a_dense_padded_forward_reads_its_lengths_and_sends_an_empty_one_to_the_reference(served, monkeypatch,
                                                                                         lens):
    from tests.test_fp8 import fp8_case

    monkeypatch.setitem(fp8_ops._KERNELS["fwd"], "cpu", fp8_ops._fp8_fwd_cuda)
    a = fp8_case(4, 2, 16, 16, d=128, seed=60, lens=lens)
    before = counters.stats()
    res = fp8.forward(**a, is_causal=True, return_lse=True)
    empty = 0 in lens[0] or 0 in lens[1]
    want = {"served": 0, "fallback": {"cudnn_known_issue": 1}} if empty else {"served": 1, "fallback": {}}
    assert delta(before) == {"fp8_fwd": want}
    assert [g.key.padded for g in served] == ([] if empty else [True])
    assert torch.isfinite(res.out.float()).all()


def test_the_dense_padded_backward_runs_the_reference_with_the_known_issue(served, monkeypatch):
    from tests.test_fp8 import fp8_case

    monkeypatch.setitem(fp8_ops._KERNELS["fwd"], "cpu", fp8_ops._fp8_fwd_cuda)
    a = fp8_case(4, 4, 16, 16, d=128, seed=61, lens=([9, 16], [9, 16]))
    res = fp8.forward(**a, is_causal=True, return_lse=True)
    g8, ddo = fp8.quantize(torch.randn(2, 4, 16, 128, generator=torch.Generator().manual_seed(62)))
    one = torch.ones(1)
    before = counters.stats()
    grads = fp8.backward(g8, a["q"], a["k"], a["v"], res.out, res.lse, descale_q=a["descale_q"],
                         descale_k=a["descale_k"], descale_v=a["descale_v"], descale_o=1 / a["scale_o"],
                         descale_do=ddo, scale_dq=one, scale_dk=one, scale_dv=one, scale_dp=one * 256,
                         is_causal=True, seq_lens_q=a["seq_lens_q"], seq_lens_kv=a["seq_lens_kv"])
    assert delta(before) == {"fp8_bwd": {"served": 0, "fallback": {"cudnn_known_issue": 1}}}
    assert [g.key.backward for g in served] == [False], "no backward graph built"
    assert all(torch.isfinite(t.float()).all() for t in (grads.dq, grads.dk, grads.dv))


def test_the_engine_amax_outputs_start_at_zero_on_16_byte_rows():
    """cuDNN's FP8 graphs fold into their amax buffers (stale memory gave wrong amax on the GPU, run 65):
    they are rows of one zeroed tensor, each 16-byte aligned, whatever the memory held before."""
    from cudnn_sdpa_provider.engine import fp8_cudnn

    for _ in range(3):
        junk = [torch.full((16,), float("nan")) for _ in range(64)]
        del junk
        bufs = fp8_cudnn._amax_buffers(4, torch.device("cpu"))
        base = bufs[0].untyped_storage().data_ptr()
        assert all(b.untyped_storage().data_ptr() == base for b in bufs), "one zeroed tensor"
        assert [b.data_ptr() - base for b in bufs] == [0, 16, 32, 48]
        assert all(b.shape == (1, 1, 1, 1) and b.item() == 0 for b in bufs)


def test_fp8_graphs_get_a_zeroed_workspace_and_bf16_graphs_do_not(served):
    """Plan.zero_workspace, set by ``graphs.plan`` for FP8 keys (``graphs.execute`` then allocates the
    workspace with zeros); the bf16 graphs keep an uninitialised one."""
    from tests.test_known_issues import _bwd_key

    lens = [7, 3, 12]
    q, k, v, go = inputs(lens, d=128, seed=14)
    run(q, k, v, go, lens, causal=True)
    assert served and graphs.plan(served[0].key).zero_workspace is True
    assert graphs.plan(_bwd_key(s_q=2)).zero_workspace is False


def test_under_capture_a_padded_call_counts_as_having_an_empty_sequence(monkeypatch):
    """Lengths cannot be read while a CUDA graph is captured: the check answers True without reading."""
    class Lengths:
        is_cuda, device = True, "cuda:0"

        def __le__(self, other):
            raise AssertionError("read during a capture")

    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fp8_ops.empty_sequence(Lengths(), Lengths()) is True
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fp8_ops.empty_sequence(torch.tensor([3, 1]), torch.tensor([3, 2])) is False
    assert fp8_ops.empty_sequence(torch.tensor([3, 0]), torch.tensor([3, 2])) is True
    assert fp8_ops.empty_sequence(torch.tensor([3, 1]), torch.tensor([-1, 2])) is True


@pytest.mark.parametrize("kernel", ["cuda", "cpu"])
def test_the_op_refuses_cu_seqlens_without_a_sequence(served, kernel):
    """cu_seqlens of one entry (no sequence) on the op itself, past the public checks: a ValueError
    naming the argument, never a graph (an empty batch has no lengths to read)."""
    q, _, _, _ = inputs([4], d=128, seed=15)
    q8, dq = fp8.quantize(q)
    fn = fp8_varlen._fp8_varlen_fwd_cuda if kernel == "cuda" else fp8_varlen._fp8_varlen_fwd_cpu
    none = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fn(q8, q8, q8, dq, dq, dq, torch.ones(1), none, none, 4, 4, 128 ** -0.5, 256.0, False, False, True)
    assert not served


@pytest.mark.parametrize("token_major", [False, True])
def test_a_causal_engine_backward_runs_one_batch_row_at_a_time(served, monkeypatch, token_major):
    """``fp8_cudnn.backward`` with the causal mask and B > 1 executes B graphs of one batch row (run
    70: cuDNN's whole-batch causal FP8 backward gave wrong dK at B = 4, and was slower). On the
    stand-in, which computes every row right, the gradients are the whole-batch call's bits, in q,
    k and v's layouts, and the amax the largest of the rows'. Without the mask one whole-batch
    graph runs."""
    from cudnn_sdpa_provider.engine import fp8_cudnn

    gen = torch.Generator().manual_seed(3)
    b, h, hk, s, d = 3, 4, 2, 9, 32

    def operand(heads):
        t = torch.randn(b, s, heads, d, generator=gen) if token_major else torch.randn(b, heads, s, d, generator=gen)
        t = t.transpose(1, 2) if token_major else t
        return (t * 3).to(torch.float8_e4m3fn)

    q, k, v, out, go = operand(h), operand(hk), operand(hk), operand(h), operand(h)
    factors = [torch.full((1,), x) for x in (0.5, 0.25, 0.75, 1.0)]
    lse = {causal: fp8_reference.forward(q, k, v, *factors[:3], torch.ones(1), None, None, 0.2, 8.0, causal, True)[1]
           for causal in (True, False)}  # the graph checks that it reads its forward's LSE
    descales = tuple(factors) + (torch.full((1,), 0.5),)
    scales = torch.tensor([64.0, 32.0, 16.0, 8.0])

    def call(causal):
        """(the result, {declared batch: executes} of the backward graphs this call ran)"""
        before = {id(g): len(g.calls) for g in served}
        res = fp8_cudnn.backward(go, q, k, v, out, lse[causal], descales, scales, None, None, scale=0.2, scale_s=8.0,
                                 causal=causal)
        ran = {g.key.q.dims[0]: len(g.calls) - before.get(id(g), 0) for g in served if g.key.backward}
        return res, {n: c for n, c in ran.items() if c}

    monkeypatch.setattr(fp8_cudnn, "ROW_SPLIT_CAUSAL", False)
    whole, ran = call(True)
    assert ran == {b: 1}, ran
    monkeypatch.setattr(fp8_cudnn, "ROW_SPLIT_CAUSAL", True)
    split, ran = call(True)
    assert ran == {1: b}, ran
    for name, got, want, like in zip(("dq", "dk", "dv"), split[:3], whole[:3], (q, k, v)):
        assert got.stride() == like.stride() and got.dtype == torch.float8_e4m3fn, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert torch.equal(split[3], whole[3]) and bool((split[3] > 0).all())
    assert call(False)[1] == {b: 1}


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_causal_dense_fp8_attention_over_three_rows_runs_its_backward_by_rows(served, scaling):
    """From bf16-like fp32 activations through ``csp.fp8.attention`` (the recipe's path, served on the
    stand-in): a causal GQA call with B = 3 runs its backward as graphs of one batch row, and its
    gradients stay within FP8's bounds of fp64 attention."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(3, 4, 24, 128, generator=gen)  # D 128: the sm_90 FP8 backward's head dim
    k, v = (torch.randn(3, 2, 24, 128, generator=gen) for _ in range(2))
    go = torch.randn(3, 4, 24, 128, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    recipe = fp8.Recipe(scaling=scaling)
    for _ in range(2):  # the delayed recipe's second backward is its warm one
        for t in leaves:
            t.grad = None
        before = {id(g): len(g.calls) for g in served}
        out = fp8.attention(*leaves, is_causal=True, recipe=recipe)
        out.backward(go)
    ran = {g.key.q.dims[0] for g in served if g.key.backward and len(g.calls) > before.get(id(g), 0)}
    assert ran == {1}, ran
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(want_out, ref, go.double())
    assert rel_error(out.detach(), want_out.detach())[0] <= ATTN_FWD_TOL
    for name, got, ref_grad in zip(("dq", "dk", "dv"), (t.grad for t in leaves), want):
        err, worst = rel_error(got, ref_grad)
        assert err <= ATTN_GRAD_TOL, f"{name}: {err:.4f} at {worst}"
