"""CPU tier: the length-bucketed dense graphs (``engine/folded.py``) against the stand-in cuDNN,
which reads and writes exactly what each graph key declares, ragged offsets included, and fails a
read outside a buffer (tests/fake_cudnn.py).

What this proves without a GPU: every layout model code hands the dense path is described to cuDNN
truthfully once (batch, KV head) are folded into a ragged batch, answers and gradients match the
fp64 reference with native's strides, and a sweep of new lengths inside a bucket builds one forward
and one backward graph. What only the GPU shows (cuDNN's kernels, reads past the real length) is
tests/gpu/test_shapes.py's job.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from cudnn_sdpa_provider.core import env, layout
from cudnn_sdpa_provider.engine import dense, fold_family, fold_values, folded, graphs
from cudnn_sdpa_provider.engine.graphs import BwdKey, FwdKey
from cudnn_sdpa_provider.ops import reference
from tests import fake_cudnn
from tests.util import assert_rel_close

TOL = 1e-6


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv(env.SHAPE_BUCKETS, raising=False)
    built = fake_cudnn.install(monkeypatch)
    yield built
    graphs.clear_cache()


def _operands(kind, b, h_q, h_kv, s_q, s_kv, d, gen):
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if kind == "contiguous":  # BHSD, as a KV cache concatenated along S keeps it
        return r(b, h_q, s_q, d), r(b, h_kv, s_kv, d), r(b, h_kv, s_kv, d)
    if kind == "token_major":  # (B, S, H, D) projections seen through transpose(1, 2)
        return r(b, s_q, h_q, d).transpose(1, 2), r(b, s_kv, h_kv, d).transpose(1, 2), r(b, s_kv, h_kv, d).transpose(1, 2)
    if kind == "fused_kv":  # one projection for K and V, split by a view
        kv = r(b, s_kv, 2, h_kv, d)
        return r(b, s_q, h_q, d).transpose(1, 2), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    if kind == "head_slice":  # x[..., :d] of a wider head dim: rows are not d apart
        return (r(b, h_q, s_q, 2 * d)[..., :d], r(b, h_kv, s_kv, 2 * d)[..., :d], r(b, h_kv, s_kv, 2 * d)[..., :d])
    if kind == "mixed":  # token-major q, BHSD cache (generation's prefill in HF)
        return r(b, s_q, h_q, d).transpose(1, 2), r(b, h_kv, s_kv, d), r(b, h_kv, s_kv, d)
    raise ValueError(kind)


KINDS = ("contiguous", "token_major", "fused_kv", "head_slice", "mixed")


def _check(q, k, v, go, window=(-1, -1), bottom_right=False):
    out, lse = dense.forward(q, k, v, scale=0.3, window=window, bottom_right=bottom_right)
    want, want_lse = reference.dense(q.double(), k.double(), v.double(), scale=0.3, window=window,
                                     bottom_right=bottom_right, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    live = torch.isfinite(want_lse)
    assert torch.equal(live, torch.isfinite(lse)), "lse is -inf exactly where no key is seen"
    assert_rel_close(lse[live], want_lse[live], TOL, "lse")
    assert out.stride() == layout.dense_out(q, tuple(out.shape)).stride(), "out follows q's dimension order"
    assert lse.is_contiguous()
    dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=0.3, window=window, bottom_right=bottom_right)
    rq, rk, rv, _ = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=0.3,
                                             window=window, bottom_right=bottom_right, compute_dtype=torch.float64)
    for got, ref, name, src in ((dq, rq, "dq", q), (dk, rk, "dk", k), (dv, rv, "dv", v)):
        assert_rel_close(got, ref, TOL, name)
        assert got.stride() == torch.empty_like(src).stride(), f"{name} is empty_like its operand"


def _folded_keys(built):
    return [g.key for g in built if g.key.ragged]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("s_q,s_kv", [(1, 13), (5, 13), (13, 13), (7, 27)])
def test_folded_forward_backward_match_the_reference_on_every_layout(fake, kind, heads, s_q, s_kv):
    gen = torch.Generator().manual_seed(s_q * 100 + s_kv)
    q, k, v = _operands(kind, 2, heads[0], heads[1], s_q, s_kv, 8, gen)
    go = torch.randn(2, s_q, heads[0], 8, generator=gen).transpose(1, 2)  # a layout of its own
    _check(q, k, v, go, window=(-1, 0) if s_q == s_kv else (-1, -1), bottom_right=s_q != s_kv)
    keys = _folded_keys(fake)
    assert any(isinstance(key, FwdKey) for key in keys) and any(isinstance(key, BwdKey) for key in keys), \
        "the call ran on the folded graphs"


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 0)])
def test_folded_windows_and_dead_rows(fake, window):
    gen = torch.Generator().manual_seed(3)
    q, k, v = _operands("token_major", 1, 4, 2, 11, 11, 8, gen)
    go = torch.randn(1, 4, 11, 8, generator=gen)
    _check(q, k, v, go, window=window)
    q, k, v = _operands("contiguous", 1, 4, 2, 3, 11, 8, gen)  # bottom-right with S_q < S_kv: rows see keys
    _check(q, k, v, torch.randn(1, 4, 3, 8, generator=gen), window=(1, 0), bottom_right=True)


def test_new_lengths_inside_a_bucket_build_one_forward_and_one_backward_graph(fake):
    gen = torch.Generator().manual_seed(5)
    for s in range(17, 32):  # every length of the (16, 32] bucket; causal prefill with GQA
        q, k, v = _operands("token_major", 2, 4, 2, s, s, 8, gen)
        _check(q, k, v, torch.randn(2, 4, s, 8, generator=gen), window=(-1, 0))
    keys = [g.key for g in fake]
    assert sum(isinstance(key, FwdKey) for key in keys) == 1, keys
    assert sum(isinstance(key, BwdKey) for key in keys) == 1, keys
    assert all(key.ragged and key.q.dims[2] == 32 for key in keys)


def test_decode_over_a_growing_cache_builds_one_graph_per_doubling(fake):
    """S_q = 1 against a BHSD cache that grows by one each step, 5..64: buckets 8, 16, 32, 64; the
    powers of two themselves take the exact graph only where their bucket is not yet built."""
    gen = torch.Generator().manual_seed(6)
    for s_kv in range(5, 65):
        q, k, v = _operands("contiguous", 2, 8, 2, 1, s_kv, 8, gen)
        out, _ = dense.forward(q, k, v, scale=0.3, compute_lse=False)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at S_kv={s_kv}")
    keys = [g.key for g in fake]
    assert len(keys) <= 5, [folded.seqlen_bucket(key.k.dims[2]) for key in keys]  # 8, 16, 32, 64 (+ exact at 8)
    assert sum(key.ragged for key in keys) == 4


@pytest.mark.parametrize("kind", ["contiguous", "token_major", "head_slice"])
def test_a_new_decode_length_rebinds_from_its_family_s_template(fake, monkeypatch, kind):
    """Decode over a growing cache (GQA 8/2, window (3, 0) bottom-right): the first length of each
    bucket binds in full, every later one is derived from that binding (``fold_family.rebind_forward``:
    same graph, new lengths and offsets); a K/V layout whose strides do not follow from S (a
    head-dim slice) binds every length in full. Answers match fp64 at every length, rebinds and
    full binds alike."""
    full, real = [], folded.bind_forward
    monkeypatch.setattr(folded, "bind_forward", lambda *a, **kw: full.append(a[1].shape[2]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(18)
    for s_kv in range(17, 40):  # buckets 32 and 64; 32 itself is a power of two
        q, k, v = _operands(kind, 2, 8, 2, 1, s_kv, 8, gen)
        out, _ = dense.forward(q, k, v, scale=0.3, window=(3, 0), bottom_right=True, compute_lse=False)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, window=(3, 0), bottom_right=True,
                                  compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at S_kv={s_kv}")
    assert full == (list(range(17, 40)) if kind == "head_slice" else [17, 33]), full
    assert sum(g.key.ragged for g in fake) == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_a_new_prefill_length_binds_with_its_family_s_graph_which_is_the_one_its_key_finds(fake, monkeypatch, kind,
                                                                                           heads):
    """Causal prefill, forward and backward, at every length of the (16, 32] bucket: after the first,
    each binds with its family's graph without building its key (``fold_family.family``): derived from
    the template by arithmetic (``fold_family.rebind``) where every operand has its layout's exact
    strides, else bound with the template's graph; either way equal to what a full bind with its
    own key makes (``_lengths_checked``, or the same graph), and answers and gradients match fp64.
    Layouts whose strides do not follow from S (a fused K/V projection, a head-dim slice) bind in
    full every time; token-major K/V with one head (a size-1 head dim whose stride is not the BHSD
    one ``layout_of`` says) is derived too, its gradients keeping that stride as ``empty_like`` does."""
    seen = {"family": 0, "full": 0}
    _lengths_checked(monkeypatch, seen)
    for name in ("bind_forward", "bind_backward"):
        real = getattr(folded, name)

        def checked(*a, real=real, **kw):
            if kw.get("plan") is None:
                seen["full"] += 1
                return real(*a, **kw)
            seen["family"] += 1
            full = real(*a, **{**kw, "plan": None, "build": False})
            assert full is not None and full.plan is kw["plan"], "the family's graph is not the one its key finds"
            return real(*a, **kw)

        monkeypatch.setattr(folded, name, checked)
    gen = torch.Generator().manual_seed(20)
    for s in range(17, 32):
        q, k, v = _operands(kind, 2, heads[0], heads[1], s, s, 8, gen)
        _check(q, k, v, torch.randn(2, s, heads[0], 8, generator=gen).transpose(1, 2), window=(-1, 0))
    predictable = kind in ("contiguous", "token_major", "mixed")
    want = {"family": 0, "full": 2, "lengths": 28} if predictable else {"family": 0, "full": 30, "lengths": 0}
    assert seen == want, seen
    assert sum(g.key.ragged for g in fake) == 2, "one forward and one backward graph"


@pytest.mark.parametrize("kind", ["contiguous", "token_major", "mixed"])
@pytest.mark.parametrize("b,heads,d_v", [(1, (4, 2), 8), (2, (4, 4), 16), (2, (4, 2), 8), (1, (4, 1), 16)])
def test_bindings_derived_at_new_lengths_equal_full_binds(fake, monkeypatch, kind, b, heads, d_v):
    """Chunked prefill (S_q < S_kv, bottom-right causal) and self-attention at lengths inside one
    pair of buckets, forward and backward, V's head dim equal to Q's or not: every binding after the
    first is derived from its template by arithmetic (``fold_family.rebind``) and equals, value for value,
    the one a full bind of the same call makes (``_lengths_checked``); answers and gradients match
    fp64 with native's strides."""
    hits = {}
    _lengths_checked(monkeypatch, hits)
    gen = torch.Generator().manual_seed(26)
    pairs = [(9, 20), (12, 20), (9, 27), (15, 31), (10, 18)]  # buckets (16, 32) throughout
    for s_q, s_kv in pairs:
        q, k, _ = _operands(kind, b, heads[0], heads[1], s_q, s_kv, 8, gen)
        _, _, v = _operands(kind, b, heads[0], heads[1], s_q, s_kv, d_v, gen)
        go = torch.randn(b, s_q, heads[0], d_v, generator=gen).transpose(1, 2)
        _check(q, k, v, go, window=(-1, 0), bottom_right=True)
    assert hits["lengths"] == 2 * (len(pairs) - 1), hits
    assert sum(g.key.ragged for g in fake) == 2, "one forward and one backward graph"


def test_a_size_1_dim_s_arbitrary_stride_is_derived_with_the_strides_a_full_bind_gives(fake, monkeypatch):
    """B 1 operands whose batch stride is not their layout's (PyTorch lets a size-1 dim have any
    stride): still derived (``fold_values.follows`` ignores size-1 dims), the output and gradients
    taking that stride as ``dense_out`` and ``empty_like`` do, equal to a full bind's."""
    hits = {}
    _lengths_checked(monkeypatch, hits)
    gen = torch.Generator().manual_seed(27)
    odd = lambda t: t.as_strided(t.shape, (7,) + t.stride()[1:])  # noqa: E731
    for s in (17, 19, 23, 30):
        q, k, v = (odd(t) for t in _operands("token_major", 1, 4, 2, s, s, 8, gen))
        assert q.stride(0) == 7
        _check(q, k, v, torch.randn(1, s, 4, 8, generator=gen).transpose(1, 2), window=(-1, 0))
    assert hits["lengths"] == 6, hits


def test_families_of_other_layouts_in_one_bucket_keep_their_own_graphs(fake, monkeypatch):
    """BHSD and token-major operands alternating inside one bucket: each prefill call's family finds
    a graph whose key is its own (the families differ by layout; ``fold_family.rebind`` derives them,
    each checked against a full bind); decode calls, derived by ``rebind_forward``, are checked by
    their answers."""
    plans = []
    real = folded.bind_forward

    def checked(*a, **kw):
        if kw.get("plan") is not None:
            full = real(*a, **{**kw, "plan": None, "build": False})
            assert full is not None and full.plan is kw["plan"], "another layout's graph"
            plans.append(kw["plan"])
        return real(*a, **kw)

    monkeypatch.setattr(folded, "bind_forward", checked)
    _lengths_checked(monkeypatch, {})
    derive = fold_family.rebind

    def derived(*a, **kw):
        found = derive(*a, **kw)
        plans.extend([found.plan] if found is not None else [])
        return found

    monkeypatch.setattr(fold_family, "rebind", derived)
    gen = torch.Generator().manual_seed(21)
    for s in range(17, 27):
        for kind in ("contiguous", "token_major"):
            for s_q in (s, 1):
                q, k, v = _operands(kind, 2, 4, 2, s_q, s, 8, gen)
                out, _ = dense.forward(q, k, v, scale=0.3, window=(-1, 0), bottom_right=True)
                want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, window=(-1, 0),
                                          bottom_right=True, compute_dtype=torch.float64)
                assert_rel_close(out, want, TOL, f"{kind} S_q={s_q} S_kv={s}")
    assert len(set(map(id, plans))) == 2 and sum(g.key.ragged for g in fake) == 4, "two prefill graphs, two decode"


def _family_checked(monkeypatch) -> dict:
    """Wrap the family paths: a bind with a family's graph, or a decode rebind, must use the graph
    that the call's own key finds (a full bind without building); counts the family hits."""
    hits = {"fwd": 0, "bwd": 0, "rebind": 0}
    for name, kind in (("bind_forward", "fwd"), ("bind_backward", "bwd")):
        real = getattr(folded, name)

        def checked(*a, real=real, kind=kind, **kw):
            if kw.get("plan") is not None:
                hits[kind] += 1
                full = real(*a, **{**kw, "plan": None, "build": False})
                assert full is not None and full.plan is kw["plan"], f"{kind}: a family's graph that is not the call's"
            return real(*a, **kw)

        monkeypatch.setattr(folded, name, checked)
    real_rebind, real_bind = fold_family.rebind_forward, folded.bind_forward

    def rebind(template, q, k, v, *, window, bottom_right):
        hits["rebind"] += 1
        return real_rebind(template, q, k, v, window=window, bottom_right=bottom_right)

    monkeypatch.setattr(fold_family, "rebind_forward", rebind)
    _lengths_checked(monkeypatch, hits)
    return hits


def _lengths_checked(monkeypatch, hits: dict) -> None:
    """Wrap ``fold_family.rebind`` (a binding at new lengths derived from its template by arithmetic):
    each binding it derives must equal, field by field and value by value, the one a full bind of
    the same call makes with its own key (``_same_binding``); counts them in ``hits["lengths"]``."""
    real, fwd, bwd = fold_family.rebind, folded.bind_forward, folded.bind_backward
    hits.setdefault("lengths", 0)

    def checked(template, callers, q, k, *, window, bottom_right):
        got = real(template, callers, q, k, window=window, bottom_right=bottom_right)
        if got is None:
            return None
        hits["lengths"] += 1
        key = template.plan.graph.key
        opts = dict(scale=key.scale, window=window, bottom_right=bottom_right, build=False)
        if isinstance(key, FwdKey):
            want = fwd(*callers, compute_lse=key.lse is not None, **opts)
        else:
            want = bwd(*callers, deterministic=False, **opts)
        _same_binding(got, want, f"{type(key).__name__} at S_q={q.shape[2]} S_kv={k.shape[2]}")
        return got

    monkeypatch.setattr(fold_family, "rebind", checked)


def _same_binding(got, want, what: str) -> None:
    """Two folded bindings that run the same: one graph, uids, copies, outputs, scratch choices, and
    device tensors (lengths, offsets) and dead rows of equal values."""
    assert want is not None and got.plan is want.plan, f"{what}: not the graph the call's key finds"
    for field in ("uids", "repair", "direct", "fix"):
        assert getattr(got, field) == getattr(want, field), f"{what}: {field}"
    norm = lambda outputs: tuple((tuple(size), tuple(stride)) for size, stride in outputs)  # noqa: E731
    assert norm(got.outputs) == norm(want.outputs), f"{what}: outputs {got.outputs} != {want.outputs}"
    mine = {key: value for key, value in got.extra.items() if key not in ("made", "tensors", "dead")}
    theirs = {key: value for key, value in want.extra.items() if key not in ("made", "tensors", "dead")}
    assert mine == theirs, f"{what}: extra"
    assert len(got.extra["tensors"]) == len(want.extra["tensors"]), what
    for i, (a, b) in enumerate(zip(got.extra["tensors"], want.extra["tensors"])):
        assert a.shape == b.shape and torch.equal(a, b), f"{what}: small tensor {i}: {a.flatten()} != {b.flatten()}"
    a, b = got.extra["dead"], want.extra["dead"]
    assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{what}: dead rows"


@pytest.mark.parametrize("change", ["scale", "window", "bottom_right", "compute_lse", "bucket", "misaligned"])
@pytest.mark.parametrize("s_q", [1, None])  # decode; chunked prefill with S_q = S_kv - 3
def test_a_call_that_differs_in_one_keyed_field_never_takes_another_family_s_template(fake, monkeypatch, change,
                                                                                      s_q):
    """A template made by one call, then a call at another length that differs from it in one field
    the family keys (scale, window, alignment, LSE, bucket, ...): the second call must not run on the
    first one's graph (``_family_checked``), and its answers (and gradients, for prefill) match fp64.
    A misaligned operand must not fold at all."""
    hits = _family_checked(monkeypatch)
    gen = torch.Generator().manual_seed(23)
    base = {"scale": 0.3, "window": (-1, 0), "bottom_right": True, "compute_lse": True}
    other = dict(base, **{"scale": {"scale": 0.2}, "window": {"window": (2, 0)},
                          "bottom_right": {"bottom_right": False}, "compute_lse": {"compute_lse": False}}.get(change, {}))
    for s, opts in ((17, base), (40 if change == "bucket" else 23, other)):
        q, k, v = _operands("contiguous", 2, 4, 2, s_q or s - 3, s, 8, gen)
        if change == "misaligned" and opts is other:
            k = torch.randn(2 * 2 * s * 8 + 1, generator=gen)[1:].view(2, 2, s, 8)  # contiguous, base 4 bytes off
        n = len(fake)
        out, lse = dense.forward(q, k, v, **opts)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=opts["scale"], window=opts["window"],
                                  bottom_right=opts["bottom_right"], compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"{change}: out")
        if change == "misaligned" and opts is other:
            assert len(fake) > n and not fake[-1].key.ragged, "a misaligned operand folded"
        if s_q is None and opts["compute_lse"]:
            go = torch.randn(out.shape, generator=gen)
            dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=opts["scale"], window=opts["window"],
                                           bottom_right=opts["bottom_right"])
            ref = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=opts["scale"],
                                           window=opts["window"], bottom_right=opts["bottom_right"],
                                           compute_dtype=torch.float64)
            for got, r, name in zip((dq, dk, dv), ref, ("dq", "dk", "dv")):
                assert_rel_close(got, r, TOL, f"{change}: {name}")
    assert hits == {"fwd": 0, "bwd": 0, "rebind": 0, "lengths": 0}, hits


def test_a_decode_rebind_gives_k_and_v_their_own_offsets(fake, monkeypatch):
    """K contiguous BHSD and V token-major (their offsets differ): the derived binding gives each its
    own, at every new length (a mix-up reads V through K's strides)."""
    hits = _family_checked(monkeypatch)
    gen = torch.Generator().manual_seed(24)
    for s in range(17, 24):
        q, k, _ = _operands("contiguous", 2, 8, 2, 1, s, 8, gen)
        _, _, v = _operands("token_major", 2, 8, 2, 1, s, 8, gen)
        out, _ = dense.forward(q, k, v, scale=0.3, compute_lse=False)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at S_kv={s}")
    assert hits["rebind"] == 6, hits


def test_no_template_is_taken_while_a_cuda_graph_is_captured(fake, monkeypatch):
    """A capture must not upload or bind anything new: while one is under way, no family path runs."""
    hits = _family_checked(monkeypatch)
    gen = torch.Generator().manual_seed(25)
    dense.forward(*_operands("contiguous", 2, 8, 2, 1, 17, 8, gen), scale=0.3, compute_lse=False)
    dense.forward(*_operands("token_major", 2, 4, 2, 17, 17, 8, gen), scale=0.3, window=(-1, 0))
    monkeypatch.setattr(folded, "capturing", lambda: True)
    for s_q in (1, 18):
        dense.forward(*_operands("contiguous" if s_q == 1 else "token_major", 2, 8 if s_q == 1 else 4, 2, s_q, 18, 8,
                                 gen), scale=0.3, window=(-1, 0) if s_q > 1 else (-1, -1), compute_lse=s_q > 1)
    assert hits == {"fwd": 0, "bwd": 0, "rebind": 0, "lengths": 0}, hits


def test_a_rebind_defers_to_a_full_bind_on_another_stream_or_with_the_fold_off(fake, monkeypatch):
    """A template whose small tensors were made on another stream is not reused (its upload event
    would not cover them); with the fold turned off after the template was made, new lengths take
    their exact graphs."""
    full, real = [], folded.bind_forward
    monkeypatch.setattr(folded, "bind_forward", lambda *a, **kw: full.append(a[1].shape[2]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(19)
    calls = lambda s_kv: dense.forward(*_operands("contiguous", 2, 8, 2, 1, s_kv, 8, gen), scale=0.3,  # noqa: E731
                                       compute_lse=False)
    monkeypatch.setattr(folded, "made_at", lambda device, dead=None: (folded.fv.stream_of(device), "event"))  # CUDA
    calls(20)
    monkeypatch.setattr(folded.fv, "stream_of", lambda device: 5)
    calls(21)  # another stream: a full bind, which becomes the template
    calls(22)
    assert full == [20, 21], full
    monkeypatch.setenv(env.SHAPE_BUCKETS, "0")
    calls(23)
    assert not fake[-1].key.ragged and len(full) == 2, "the fold turned off: an exact graph, no rebind"


def test_a_power_of_two_shape_keeps_its_exact_graph(fake):
    gen = torch.Generator().manual_seed(8)
    q, k, v = _operands("contiguous", 1, 2, 2, 16, 16, 8, gen)
    dense.forward(q, k, v, scale=0.3)
    assert [g.key.ragged for g in fake] == [False]


@pytest.mark.parametrize("raw,ragged", [("0", False), ("1", True), ("auto", True)])
def test_the_variable_turns_the_buckets_off_or_always_on(fake, monkeypatch, raw, ragged):
    monkeypatch.setenv(env.SHAPE_BUCKETS, raw)
    gen = torch.Generator().manual_seed(9)
    q, k, v = _operands("contiguous", 1, 2, 2, 12, 12, 8, gen)
    dense.forward(q, k, v, scale=0.3)
    assert [g.key.ragged for g in fake] == [ragged]
    graphs.clear_cache()
    q, k, v = _operands("contiguous", 1, 2, 2, 16, 16, 8, gen)
    dense.forward(q, k, v, scale=0.3)
    assert fake[-1].key.ragged == (raw == "1")


@pytest.mark.parametrize("what", ["bias", "sinks", "int64_lengths", "dropout", "misaligned", "expand"])
def test_what_the_fold_cannot_take_runs_on_the_exact_graph(fake, what):
    gen = torch.Generator().manual_seed(10)
    q, k, v = _operands("contiguous", 2, 2, 2, 12, 12, 8, gen)
    kw = {}
    if what == "bias":
        kw["bias"] = torch.randn(2, 2, 12, 12, generator=gen)
    elif what == "sinks":
        kw["sinks"] = torch.randn(2, generator=gen)
    elif what == "int64_lengths":  # the exact path's own check names the dtype
        kw["seq_len_q"] = kw["seq_len_kv"] = torch.tensor([12, 7], dtype=torch.int64)
    elif what == "misaligned":
        k = torch.randn(2 * 2 * 12 * 8 + 1, generator=gen)[1:].view(2, 2, 12, 8)
    elif what == "expand":
        k = torch.randn(2, 1, 12, 8, generator=gen).expand(2, 2, 12, 8)
    assert not folded.applies(q, k, v, bias=kw.get("bias"), sinks=kw.get("sinks"), seq_len_q=kw.get("seq_len_q"),
                              dropout_p=0.1 if what == "dropout" else 0.0)
    if what == "int64_lengths":
        with pytest.raises(TypeError, match="int32"):
            dense.forward(q, k, v, scale=0.3, **kw)
    elif what != "dropout":
        dense.forward(q, k, v, scale=0.3, **kw)
        assert not any(g.key.ragged for g in fake)


def test_offsets_never_overflow_int32(monkeypatch):
    """Operands whose folds' offsets would not fit cuDNN's int32 ragged offsets take the exact graph
    (meta tensors: strides without storage)."""
    monkeypatch.setattr(folded, "_FAKE_DEVICES", {"meta"})
    meta = lambda shape, stride: torch.empty_strided(shape, stride, device="meta", dtype=torch.bfloat16)  # noqa: E731
    fits = meta((4, 8, 1, 128), (2**20, 128, 128, 1))
    assert folded.applies(fits, fits, fits)
    huge = meta((64, 8, 1, 128), (2**25, 128, 128, 1))  # 64 batch rows 2**25 elements apart
    assert not folded.applies(huge, huge, huge)
    assert folded._end(huge, 8, 1) > 2**31 - 1 >= folded._end(fits, 8, 1)


def test_a_family_s_graph_is_not_taken_where_k_or_v_offsets_would_overflow_int32(fake, monkeypatch):
    """The family paths skip ``applies``, so they check K's and V's ends themselves: a decode rebind
    and a bind with its family's graph decline where K's offsets would not fit int32, and the call
    takes its exact graph."""
    gen = torch.Generator().manual_seed(22)
    q, k, v = _operands("contiguous", 2, 8, 2, 1, 17, 8, gen)
    dense.forward(q, k, v, scale=0.3, compute_lse=False)  # the template; K's end 2 * 2 * 17 * 8
    monkeypatch.setattr(folded, "INT32_MAX", 700)
    q, k, v = _operands("contiguous", 2, 8, 2, 1, 30, 8, gen)  # K's end 960
    out, _ = dense.forward(q, k, v, scale=0.3, compute_lse=False)
    assert not fake[-1].key.ragged, "past int32: the exact graph"
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    monkeypatch.setattr(folded, "_FAKE_DEVICES", {"cpu", "meta"})
    meta = lambda shape, stride: torch.empty_strided(shape, stride, device="meta", dtype=torch.bfloat16)  # noqa: E731
    qm = meta((1, 4, 9, 8), (288, 8, 32, 1))  # token-major: small ends
    huge = meta((1, 2, 9, 8), (2**31, 2**30, 8, 1))  # one batch row, KV heads 2**30 elements apart
    monkeypatch.setattr(folded, "INT32_MAX", 2**31 - 1)
    assert folded.bind_forward(qm, huge, huge, scale=0.3, window=(-1, -1), bottom_right=False, compute_lse=False,
                               plan=object()) is None


def test_every_declared_stride_is_16_byte_aligned(fake):
    """cuDNN (frontend 1.32) declines a graph with a stride that is not a multiple of 16 bytes, the
    never-stepped batch stride included (a decline means an exact graph per length again)."""
    gen = torch.Generator().manual_seed(11)
    for kind in KINDS:
        for s_q, s_kv in ((1, 13), (7, 27), (13, 13)):
            q, k, v = _operands(kind, 2, 4, 2, s_q, s_kv, 8, gen)
            dense.forward(q, k, v, scale=0.3)
    for g in fake:
        for name in ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv"):
            d = getattr(g.key, name, None)
            if d is None:
                continue
            per = 16 // d.dtype.itemsize
            bad = [(i, s) for i, (n, s) in enumerate(zip(d.dims[:3], d.strides[:3])) if n > 1 and s % per]
            assert not bad or name == "lse" and all(s == 1 for _, s in bad), (name, d)  # as the packed LSE


@pytest.mark.parametrize("kind", ["contiguous", "token_major", "mixed"])
def test_padded_calls_fold_with_their_own_lengths(fake, kind):
    """Per-sequence lengths (right padding, as the HF integration passes them): rows past a length
    are 0 in out and the gradients, and a batch row with an out-of-range length is NaN."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = _operands(kind, 3, 4, 2, 11, 11, 8, gen)
    lq = torch.tensor([11, 6, 12], dtype=torch.int32)  # the last is out of range
    lk = torch.tensor([11, 6, 9], dtype=torch.int32)
    out, lse = dense.forward(q, k, v, scale=0.3, window=(-1, 0), seq_len_q=lq, seq_len_kv=lk)
    assert fake and all(g.key.ragged for g in fake), "the padded call ran on a folded graph"
    good = [0, 1]
    want, _ = reference.dense(q.double()[good], k.double()[good], v.double()[good], scale=0.3, window=(-1, 0),
                              seq_len_q=lq[good], seq_len_kv=lk[good], compute_dtype=torch.float64)
    assert_rel_close(out[good], want, TOL, "out")
    assert torch.isnan(out[2]).all(), "a batch row with an out-of-range length is NaN"
    go = torch.randn(out.shape, generator=gen)
    dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=0.3, window=(-1, 0), seq_len_q=lq, seq_len_kv=lk)
    rq, rk, rv, _ = reference.dense_backward(go.double()[good], q.double()[good], k.double()[good], v.double()[good],
                                             scale=0.3, window=(-1, 0), seq_len_q=lq[good], seq_len_kv=lk[good],
                                             compute_dtype=torch.float64)
    for got, ref, name in ((dq, rq, "dq"), (dk, rk, "dk"), (dv, rv, "dv")):
        assert_rel_close(got[good], ref, TOL, name)
        assert torch.isnan(got[2]).all(), f"{name} of the bad batch row is NaN"
    assert (dq[1, :, 6:] == 0).all() and (dk[1, :, 6:] == 0).all(), "rows past a length are 0"
    assert sum(isinstance(g.key, BwdKey) and g.key.ragged for g in fake) == 1


def test_a_padded_fold_s_lse_past_each_length_is_minus_inf_as_on_the_exact_graph(fake, monkeypatch):
    """cuDNN's ragged graph writes no LSE row past a fold's length (GPU run 59: leftover memory there,
    which torch.compile's opcheck caught as eager and traced outputs that differ); the exact graph
    writes -inf. With every fresh LSE buffer poisoned with NaN, the folded padded call returns the
    exact graph's LSE, rows past the lengths included."""
    real = folded._lse_target

    def poisoned(*args):
        lse, buf = real(*args)
        lse.fill_(float("nan"))
        buf.fill_(float("nan"))
        return lse, buf

    monkeypatch.setattr(folded, "_lse_target", poisoned)
    gen = torch.Generator().manual_seed(17)
    for kind, heads in (("contiguous", (4, 4)), ("token_major", (4, 2))):  # the LSE in place; token-major scratch
        q, k, v = _operands(kind, 2, heads[0], heads[1], 11, 11, 8, gen)
        lq, lk = torch.tensor([11, 6], dtype=torch.int32), torch.tensor([11, 4], dtype=torch.int32)
        _, lse = dense.forward(q, k, v, scale=0.3, seq_len_q=lq, seq_len_kv=lk)
        assert fake and fake[-1].key.ragged, "the padded call ran on a folded graph"
        monkeypatch.setenv(env.SHAPE_BUCKETS, "0")  # read when a signature is first bound
        graphs.clear_cache()
        _, exact = dense.forward(q, k, v, scale=0.3, seq_len_q=lq, seq_len_kv=lk)
        monkeypatch.delenv(env.SHAPE_BUCKETS)
        graphs.clear_cache()
        assert not fake[-1].key.ragged
        assert torch.equal(lse[1, :, 6:], torch.full_like(lse[1, :, 6:], float("-inf"))), lse[1, :, 6:].flatten()
        live = torch.isfinite(exact)
        assert torch.equal(live, torch.isfinite(lse)) and (lse[~live] == exact[~live]).all(), kind
        assert_rel_close(lse[live], exact[live], TOL, f"lse against the exact graph's ({kind})")


def _counted_uploads(monkeypatch) -> list:
    """How many tensors each copy of the folds' small tensors carried (``fold_values._upload``)."""
    uploads, real = [], fold_values._upload
    monkeypatch.setattr(fold_values, "_upload", lambda values, blocks, device: uploads.append(
        len(values) + sum(len(keys) for keys, _ in blocks)) or real(values, blocks, device))
    return uploads


def _values_are_their_keys() -> None:
    """Every kept small tensor holds what its key says (a look-ahead guess included)."""
    for key, t in fold_values.kept().items():
        assert t.dtype == torch.int32 and t.shape[1:] == (1, 1, 1) and t.data_ptr() % 16 == 0, key
        if key[0] == "len":
            n, s = key[3:]
            assert t.view(-1).tolist() == [s] * n, key
        else:
            n, h_kv, sb, sg = key[3:]
            assert t.view(-1).tolist() == [(i // h_kv) * sb + (i % h_kv) * sg for i in range(n + 1)], key


@pytest.mark.parametrize("kind", ["contiguous", "token_major", "head_slice"])
def test_a_growing_decode_cache_uploads_its_small_tensors_once_per_look_ahead(fake, monkeypatch, kind):
    """Decode over a cache that grows one token a step: a new length whose KV length is not kept
    uploads, in one copy, what it misses and the lengths and K/V offsets of the next ``AHEAD``
    lengths inside its bucket (for caches whose strides follow from their length: contiguous BHSD,
    token-major BSHD); the steps after it upload nothing. A layout whose strides cannot be
    predicted (a head-dim slice) uploads once per step, still one copy. Answers match fp64."""
    monkeypatch.setattr(fold_values, "AHEAD", 4)
    fold_values.clear()
    uploads = _counted_uploads(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    for s_kv in range(17, 26):  # inside the (16, 32] bucket
        q, k, v = _operands(kind, 2, 8, 2, 1, s_kv, 8, gen)
        out, _ = dense.forward(q, k, v, scale=0.3, compute_lse=False)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at S_kv={s_kv}")
    if kind == "head_slice":
        assert len(uploads) == 9, uploads
    else:  # 17 with 18-21, 22 with 23-26
        assert len(uploads) == 2, uploads
        assert uploads[1] == 5 * 2, "each new length: its KV length and K/V's offsets (K and V share strides)"
    _values_are_their_keys()


def test_a_new_prefill_length_uploads_its_chunk_in_one_copy(fake, monkeypatch):
    """A new self-attention length (GQA, so Q, O and the LSE are token-major scratch) misses its
    length and offsets: one copy carries them for every length of its chunk (``CHUNK`` lengths), so
    the backward (dO and dQ token-major like Q, dK and dV like K) and later lengths of the chunk, in
    any order, upload nothing; a length in the next chunk uploads that chunk. A chunked prefill
    (S_q != S_kv) uploads what it misses, one copy a call."""
    monkeypatch.setattr(fold_values, "CHUNK", 8)
    fold_values.clear()
    uploads = _counted_uploads(monkeypatch)
    gen = torch.Generator().manual_seed(14)
    for s in (19, 23, 17, 25):  # chunk 17..24 (bucket 32), then 25..32
        q, k, v = _operands("contiguous", 2, 8, 2, s, s, 8, gen)
        _check(q, k, v, torch.randn(2, 8, s, 8, generator=gen), window=(-1, 0))
    # per length: its lengths, Q's and O's offsets (the same strides), K's and V's, the LSE's
    assert uploads == [8 * 4, 8 * 4], uploads
    _values_are_their_keys()
    del uploads[:]
    for s_q in (5, 6):
        q, k, v = _operands("contiguous", 2, 8, 2, s_q, 21, 8, gen)
        _check(q, k, v, torch.randn(2, 8, s_q, 8, generator=gen), window=(-1, 0), bottom_right=True)
    assert len(uploads) == 2 and all(n <= 4 for n in uploads), uploads
    _values_are_their_keys()


def test_a_backward_on_another_thread_uploads_its_chunk_once(fake, monkeypatch):
    """Autograd runs a CUDA backward on its device thread, whose value cache (per thread) the
    forward's chunk did not fill: a backward that misses its length uploads, in one copy, the
    lengths and its operands' offsets for every length of the chunk, so the chunk's other lengths'
    backwards on that thread upload nothing (token-major GQA operands, as HF passes them)."""
    monkeypatch.setattr(fold_values, "CHUNK", 8)
    fold_values.clear()
    uploads = _counted_uploads(monkeypatch)
    gen = torch.Generator().manual_seed(27)
    calls = []
    for s in (19, 21, 18, 23):  # one chunk, 17..24
        q, k, v = _operands("token_major", 1, 8, 2, s, s, 8, gen)
        out, lse = dense.forward(q, k, v, scale=0.3, window=(-1, 0))
        calls.append((torch.randn(1, 8, s, 8, generator=gen), q, k, v, out, lse))
    assert len(uploads) == 1, uploads
    grads = []

    def backwards():  # another thread, as autograd's device thread
        fold_values.clear()
        for go, q, k, v, out, lse in calls:
            grads.append(dense.backward(go, q, k, v, out, lse, scale=0.3, window=(-1, 0))[:3])

    worker = threading.Thread(target=backwards)
    worker.start()
    worker.join()
    assert len(uploads) == 2, f"the backward thread uploads its chunk once: {uploads}"
    # the chunk's 8 lengths, and the offsets of Q, O, dO, dQ (one set of strides) and K, V, dK, dV (another)
    assert uploads[1] == 8 * 3, uploads
    for (go, q, k, v, _, _), got in zip(calls, grads):
        want = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=0.3, window=(-1, 0),
                                        compute_dtype=torch.float64)[:3]
        for g, w, name in zip(got, want, ("dq", "dk", "dv")):
            assert_rel_close(g, w, TOL, f"{name} at S={q.shape[2]}")
    _values_are_their_keys()


def test_a_binding_takes_the_event_of_its_threads_latest_upload(monkeypatch):
    """``folded.made_at``: a binding whose small tensors all came from the value cache takes the event
    recorded after this thread's latest upload on its stream (``fold_values.upload_mark``), which
    every kept tensor precedes; a binding holding a tensor a kernel just made (its dead rows), or a
    stream with no upload yet, records a new event."""
    recorded = []

    class _Event:
        def record(self, stream):
            recorded.append(self)

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(fold_values, "stream_of", lambda device: 7)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fold_values._tls, "marks", {}, raising=False)
    stream, first = folded.made_at(cuda)
    assert stream == 7 and recorded == [first], "no upload yet: a new event"
    mark = _Event()
    fold_values._tls.marks[(cuda, 7)] = mark
    assert folded.made_at(cuda) == (7, mark) and len(recorded) == 1, "the latest upload's event, none recorded"
    stream, fresh = folded.made_at(cuda, torch.zeros(1, 1, 4, 1, dtype=torch.bool))
    assert fresh is not mark and recorded[-1] is fresh, "a kernel-made dead-row mask: a new event after it"
    assert folded.made_at(cuda, True) == (7, mark), "a padded binding's dead entry (True) is no tensor"
    monkeypatch.setattr(fold_values, "stream_of", lambda device: 8)
    assert folded.made_at(cuda)[1] is not mark, "another stream's uploads do not cover this one"
    assert folded.made_at(torch.device("cpu")) is None


def _capture_calls(monkeypatch, fn):
    """``fn()`` as if the current stream were capturing a CUDA graph (the capture check of
    ``binding.run`` forced on for the fake's CPU tensors); the bindings it kept."""
    from cudnn_sdpa_provider.engine import binding

    binding._captured.clear()
    with monkeypatch.context() as m:
        m.setattr(binding, "_capturing", lambda device: True)
        fn()
    return binding.captured()


@pytest.mark.parametrize("s_kv", [19, 16])  # a folded binding; a power of two: the exact graph
def test_a_captured_binding_keeps_its_plan_and_device_tensors_for_good(fake, monkeypatch, s_kv):
    """A CUDA graph captured with a binding launches its plan's kernels and reads its device tensors
    (a folded binding's offsets, lengths, dead-row mask) at every replay, by address: once a call
    runs under capture, the binding, its plan included, outlives the caches that held it (an LRU
    eviction, ``clear_cache``, the value cache)."""
    gen = torch.Generator().manual_seed(15)
    q, k, v = _operands("contiguous", 1, 4, 2, 1, s_kv, 8, gen)
    dense.forward(q, k, v, scale=0.3, compute_lse=False)  # the warm-up makes the binding
    kept = _capture_calls(monkeypatch, lambda: dense.forward(q, k, v, scale=0.3, compute_lse=False))
    assert len(kept) == 1 and kept[0].extra.get("fold", False) == (s_kv == 19)
    if s_kv == 19:
        assert all(isinstance(t, torch.Tensor) for t in kept[0].extra["tensors"])
    plan, tensors = weakref.ref(kept[0].plan), [weakref.ref(t) for t in kept[0].extra.get("tensors", ())]
    del kept
    graphs.clear_cache()
    fold_values.clear()
    for g in fake:  # the fake's record of its calls holds their buffers too
        g.calls.clear()
    gc.collect()
    assert plan() is not None, "the captured plan was freed with the cache: replays would run freed kernels"
    assert all(t() is not None for t in tensors), "clearing the caches frees nothing a capture reads"


def test_a_captured_folded_binding_survives_its_promotion_and_eviction(fake, monkeypatch):
    """The folded binding a capture used is replaced by its exact graph on a later eager call
    (``dense.PROMOTE_AFTER``) and its plan is then evicted from a full LRU cache: the capture still
    holds it."""
    monkeypatch.setattr(dense, "PROMOTE_AFTER", 3)
    gen = torch.Generator().manual_seed(16)
    q, k, v = _operands("contiguous", 1, 4, 2, 13, 13, 8, gen)
    dense.forward(q, k, v, scale=0.3)
    kept = _capture_calls(monkeypatch, lambda: dense.forward(q, k, v, scale=0.3))
    assert len(kept) == 1 and kept[0].extra["fold"]
    plan = weakref.ref(kept[0].plan)
    del kept
    dense.forward(q, k, v, scale=0.3)  # the third call: promoted to the exact graph
    assert [g.key.ragged for g in fake] == [True, False]
    graphs.set_capacity(1)  # the exact graph's plan evicts the folded one
    try:
        gc.collect()
        assert graphs.cache_info()["size"] == 1 and plan() is not None
    finally:
        graphs.set_capacity(env.cache_size())


def test_a_capture_queues_no_wait_on_an_event_recorded_outside_it(monkeypatch):
    """A folded binding made on one stream and used on another while that one captures a CUDA graph
    (torch.cuda.graph captures on a side stream of its own): waiting there on the upload event,
    recorded before the capture, would end the capture (cudaErrorStreamCaptureIsolation), and is not
    needed (torch.cuda.graph synchronises the device first). Outside a capture the wait stays."""
    waits = []

    class _Stream:
        def wait_event(self, event):
            waits.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(fold_values, "stream_of", lambda device: 222)  # not the binding's stream, 111
    found = folded.Binding(plan=None, uids=(), repair=(), outputs=(), direct=(), extra={"made": (111, "event")})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    folded._order(found, torch.device("cuda", 0))
    assert waits == [], "a wait on an event recorded outside the capture was queued inside it"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    folded._order(found, torch.device("cuda", 0))
    assert waits == ["event"]


def test_no_folded_binding_is_made_during_a_capture(monkeypatch):
    monkeypatch.setattr(folded, "_FAKE_DEVICES", {"cpu"})
    q = torch.randn(1, 2, 3, 8)
    assert folded.applies(q, q, q)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not folded.applies(q, q, q)


def test_builds_are_counted_in_the_report_the_meta_and_the_doctor(fake, monkeypatch):
    """Issue: builds are visible. Each graph build is counted with its host time in ``csp.report()``,
    the report file's meta and the doctor; the plan list stays bounded however many lengths ran."""
    import cudnn_sdpa_provider as csp
    from cudnn_sdpa_provider.core import counters
    from cudnn_sdpa_provider.hooks import telemetry
    from cudnn_sdpa_provider.tools import doctor

    before = counters.stats()
    gen = torch.Generator().manual_seed(14)
    monkeypatch.setenv(env.SHAPE_BUCKETS, "0")  # an exact graph per length: many configurations
    for s in range(3, 3 + counters.PLANS_KEPT + 8):
        q, k, v = _operands("contiguous", 1, 2, 2, s, s, 8, gen)
        dense.forward(q, k, v, scale=0.3)
    after = counters.stats()
    built = (after - before).builds["built"]
    assert built == counters.PLANS_KEPT + 8 and (after - before).builds["build_ms"] >= 0
    assert len(after.plans) == counters.PLANS_KEPT, "the plan list is bounded"
    report = csp.report()
    assert f"cuDNN graphs built: {after.builds['built']}" in report
    assert report.count(" <- ") == counters.PLANS_KEPT
    assert telemetry.report_data()["meta"]["graph_builds"]["built"] == after.builds["built"]
    rows = {(r.section, r.label): r.value for r in doctor.doctor_rows(run_self_test=False)}
    assert rows[("graphs", "built")].startswith(f"{after.builds['built']} cuDNN graphs")
    assert "shape buckets: off" in rows[("graphs", "cache")]


def test_a_recurring_prefill_shape_gives_way_to_its_exact_graph(fake, monkeypatch):
    """A fixed non-power-of-two shape (a training loop) is folded first, and takes its exact graph on
    its PROMOTE_AFTER-th call, forward and backward: one build each more, then right answers on the
    exact graphs."""
    monkeypatch.setattr(dense, "PROMOTE_AFTER", 3)
    gen = torch.Generator().manual_seed(21)
    q, k, v = _operands("contiguous", 2, 4, 2, 13, 13, 8, gen)
    go = torch.randn(2, 4, 13, 8, generator=gen)
    for _ in range(2):
        _check(q, k, v, go, window=(-1, 0))
    assert [g.key.ragged for g in fake] == [True, True], "folded so far"
    for _ in range(3):
        _check(q, k, v, go, window=(-1, 0))
    keys = [g.key for g in fake]
    assert [key.ragged for key in keys] == [True, True, False, False], keys
    assert {type(key) for key in keys[2:]} == {FwdKey, BwdKey} and keys[2].q.dims[2] == 13


def test_a_binding_derived_at_a_new_length_counts_its_own_calls_toward_promotion(fake, monkeypatch):
    """A template one call short of promotion, then a new length derived from it (``fold_family.rebind``):
    the new length starts its own count (the template's count is its own shape's), so it stays
    folded until its own PROMOTE_AFTER-th call."""
    monkeypatch.setattr(dense, "PROMOTE_AFTER", 3)
    hits = {}
    _lengths_checked(monkeypatch, hits)
    gen = torch.Generator().manual_seed(22)
    go = lambda s: torch.randn(2, 4, s, 8, generator=gen)  # noqa: E731
    q, k, v = _operands("token_major", 2, 4, 2, 13, 13, 8, gen)
    for _ in range(2):
        _check(q, k, v, go(13), window=(-1, 0))
    q, k, v = _operands("token_major", 2, 4, 2, 14, 14, 8, gen)
    _check(q, k, v, go(14), window=(-1, 0))
    assert hits["lengths"] == 2 and [g.key.ragged for g in fake] == [True, True], (hits, fake)
    _check(q, k, v, go(14), window=(-1, 0))
    assert [g.key.ragged for g in fake] == [True, True], "promoted on another shape's count"
    _check(q, k, v, go(14), window=(-1, 0))
    assert [g.key.ragged for g in fake] == [True, True, False, False], "its own third call promotes"


def test_decode_and_the_forced_mode_never_leave_the_fold(fake, monkeypatch):
    monkeypatch.setattr(dense, "PROMOTE_AFTER", 2)
    gen = torch.Generator().manual_seed(22)
    q, k, v = _operands("contiguous", 2, 8, 2, 1, 21, 8, gen)
    for _ in range(5):  # decode: the fold costs microseconds a call
        dense.forward(q, k, v, scale=0.3, compute_lse=False)
    monkeypatch.setenv(env.SHAPE_BUCKETS, "1")
    q, k, v = _operands("contiguous", 2, 4, 2, 13, 13, 8, gen)
    for _ in range(5):  # forced on: always the bucketed graph
        dense.forward(q, k, v, scale=0.3)
    assert all(g.key.ragged for g in fake), [g.key for g in fake]


def test_a_refused_exact_graph_keeps_the_fold(fake, monkeypatch):
    monkeypatch.setattr(dense, "PROMOTE_AFTER", 2)
    from cudnn_sdpa_provider.core.errors import NotSupportedError

    def refuse():
        raise NotSupportedError("graph_not_supported", "the exact graph was refused")

    gen = torch.Generator().manual_seed(23)
    q, k, v = _operands("contiguous", 1, 2, 2, 11, 11, 8, gen)
    monkeypatch.setattr(dense, "_bind_forward", lambda *a: refuse())
    for _ in range(4):
        out, _ = dense.forward(q, k, v, scale=0.3)
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    assert [g.key.ragged for g in fake] == [True]


def test_a_binding_used_on_another_stream_waits_for_its_uploads(monkeypatch):
    """A folded binding's offsets and lengths are uploaded on the stream that made it: a call on
    another stream queues a wait on the binding's event (no host sync); the same stream does not."""
    waits = []

    class _Stream:
        def wait_event(self, event):
            waits.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    found = folded.Binding(plan=None, uids=(), repair=(), outputs=(), direct=(), extra={"made": (111, "event")})
    monkeypatch.setattr(fold_values, "stream_of", lambda device: 111)
    folded._order(found, torch.device("cuda", 0))
    assert waits == []
    monkeypatch.setattr(fold_values, "stream_of", lambda device: 222)
    folded._order(found, torch.device("cuda", 0))
    assert waits == ["event"]
    folded._order(folded.Binding(plan=None, uids=(), repair=(), outputs=(), direct=(), extra={"made": None}),
                  torch.device("cpu"))
    assert waits == ["event"]


def test_a_deterministic_backward_keeps_its_exact_graph(fake):
    """Its workspace (sm_90, cuDNN < 9.25) grows with S_q x S_kv and is bounded on the call's dims."""
    gen = torch.Generator().manual_seed(24)
    q, k, v = _operands("contiguous", 1, 2, 2, 11, 11, 8, gen)
    out, lse = dense.forward(q, k, v, scale=0.3)
    dense.backward(torch.randn_like(out), q, k, v, out, lse, scale=0.3, deterministic=True)
    keys = [g.key for g in fake]
    assert [(type(key).__name__, key.ragged) for key in keys] == [("FwdKey", True), ("BwdKey", False)], keys


@pytest.mark.parametrize("cc,version,folds", [((9, 0), 91900, True), ((9, 0), 92801, True), ((9, 0), 92900, False),
                                              ((10, 0), 92600, False), ((8, 0), 91900, False)])
def test_the_default_mode_folds_only_where_the_gpu_sweeps_passed(monkeypatch, cc, version, folds):
    monkeypatch.delenv(env.SHAPE_BUCKETS, raising=False)
    monkeypatch.setattr(graphs, "_device_facts", lambda device: (version, cc))
    assert folded.verified(torch.device("cuda", 0)) is folds
    assert (dense._fold_wanted(5, 13, torch.device("cuda", 0)) is not False) is folds
    monkeypatch.setenv(env.SHAPE_BUCKETS, "1")
    assert dense._fold_wanted(5, 13, torch.device("cuda", 0)) is True, "forced on: folds anywhere"


@pytest.mark.parametrize("cc,version,says", [((9, 0), 91900, "folding on"), ((10, 0), 92600, "folding off here")])
def test_the_doctor_says_whether_the_default_mode_folds_here(monkeypatch, cc, version, says):
    from cudnn_sdpa_provider.engine import machine
    from cudnn_sdpa_provider.tools import doctor

    monkeypatch.delenv(env.SHAPE_BUCKETS, raising=False)
    caps = fake_cudnn.with_caps(compute_capability=cc, cudnn_version=version)
    monkeypatch.setattr(machine, "capabilities", lambda device_index=None: caps)
    rows = {(r.section, r.label): r.value for r in doctor.doctor_rows(run_self_test=False)}
    assert says in rows[("graphs", "cache")], rows[("graphs", "cache")]


def test_the_gpu_file_s_child_runner_reports_a_hung_or_failed_child_with_its_last_start_line():
    """tests/gpu/test_folded_gpu.py runs each body in a child: one that hangs past its timeout (kept
    under the GPU tier's 600 s per device call) or exits non-zero fails the test with what it printed
    last, the configuration it was in; one that finishes returns its stdout."""
    import os

    from tests.gpu import test_folded_gpu as gpu_file

    assert gpu_file.CHILD_TIMEOUT < 600
    env_vars = dict(os.environ)
    with pytest.raises(AssertionError) as hung:
        gpu_file._run_child("hang", "import time; print('START S=1025', flush=True); time.sleep(60)", env_vars, 3)
    assert "hang: no answer in 3 s" in str(hung.value) and "START S=1025" in str(hung.value)
    with pytest.raises(AssertionError) as failed:
        gpu_file._run_child("fail", "print('START S=63', flush=True); raise SystemExit('wrong dq')", env_vars, 60)
    assert "fail: child exit 1" in str(failed.value) and "START S=63" in str(failed.value) and "wrong dq" in str(failed.value)
    with pytest.raises(AssertionError, match="quiet: child exit 0"):  # exit 0 without saying it finished
        gpu_file._run_child("quiet", "print('START S=64')", env_vars, 60)
    assert gpu_file._run_child("ok", "print('START S=65'); print('ok done')", env_vars, 60) == "START S=65\nok done\n"


def test_a_chunk_keeps_no_offsets_past_int32_and_no_block_past_its_size(monkeypatch):
    """``fold_values.chunk`` rows for longer lengths of the chunk whose offsets would pass int32 are
    left out (never stored wrapped), and a chunk whose rows would pass ``BLOCK_VALUES`` is not made
    (each length then uploads its own). A reviewer's case: B 1864134, H 1, S 9 of a 16-length chunk."""
    t = torch.empty(1864134, 1, 9, 128, dtype=torch.float16, device="meta")
    cpu = torch.device("cpu")
    assert fold_values.chunk([fold_values.spec(t, 1)], t.shape[0], 1, 9, 16, cpu, 0) == []
    monkeypatch.setattr(fold_values, "BLOCK_VALUES", 1 << 40)
    (len_keys, lens), (keys, rows) = fold_values.chunk([fold_values.spec(t, 1)], t.shape[0], 1, 9, 16, cpu, 0)
    assert len(len_keys) == 16 and 0 < len(keys) < 16 and rows.dtype == torch.int32
    for key, row in zip(keys, rows):
        n, h_kv, sb, sg = key[3:]
        assert row[-1].item() == n // h_kv * sb >= 0, key  # the end entry, unwrapped
