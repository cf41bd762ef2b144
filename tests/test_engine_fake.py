"""CPU tier: the engine (``dense``, ``packed``, ``binding``) against a stand-in cuDNN that reads and
writes exactly what each graph key declares (tests/fake_cudnn.py).

What this proves without a GPU: every operand layout the engine accepts is described to cuDNN as
it really is (or repaired first), packed operands reach the graph contiguous, outputs come back in
the layout policy's strides, a repeated signature reuses its binding, and out-of-range lengths
reach the graph as zero lengths with NaN outputs. What it cannot prove (cuDNN's own kernels) is the
GPU tier's job.
"""

from __future__ import annotations

import pytest
import torch

from cudnn_sdpa_provider.engine import dense, graphs, packed
from cudnn_sdpa_provider.core import layout
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.engine.graphs import UID
from tests import fake_cudnn
from tests.util import assert_rel_close

TOL = 1e-6  # fp64 inside the fake, fp32 operands: only rounding of the inputs' dtype remains


@pytest.fixture
def fake(monkeypatch):
    fake_cudnn.FakeGraph.builds = 0
    built = fake_cudnn.install(monkeypatch)
    yield built
    graphs.clear_cache()


def _dense_views(kind: str, b=2, h=4, s=16, d=8, gen=None):
    """q, k, v as model code builds them (float32 here: the fake computes in fp64)."""
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if kind == "contiguous":
        return r(b, h, s, d), r(b, h, s, d), r(b, h, s, d)
    if kind == "bshd":  # one linear output split by heads, seen as BHSD
        return tuple(r(b, s, h, d).transpose(1, 2) for _ in range(3))
    if kind == "fused_qkv":
        qkv = r(b, s, 3, h, d)
        return tuple(t.transpose(1, 2) for t in qkv.unbind(2))
    if kind == "head_slice":  # x[..., :d] of a wider head dim
        return tuple(r(b, h, s, 2 * d)[..., :d] for _ in range(3))
    if kind == "misaligned":  # base pointer one element in
        return tuple(r(b * h * s * d + 1)[1:].view(b, h, s, d) for _ in range(3))
    if kind == "expand_heads":  # GQA written as expand over heads (stride 0)
        q = r(b, h, s, d)
        return q, r(b, 1, s, d).expand(b, h, s, d), r(b, 1, s, d).expand(b, h, s, d)
    raise ValueError(kind)


DENSE_KINDS = ("contiguous", "bshd", "fused_qkv", "head_slice", "misaligned", "expand_heads")


@pytest.mark.parametrize("kind", DENSE_KINDS)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 2)])
def test_dense_forward_backward_on_every_layout(fake, kind, window):
    gen = torch.Generator().manual_seed(7)
    q, k, v = _dense_views(kind, gen=gen)
    go = torch.randn(2, 4, 16, 8, generator=gen).transpose(2, 3).contiguous().transpose(2, 3)  # its own layout
    out, lse = dense.forward(q, k, v, scale=0.3, window=window)
    want, want_lse = reference.dense(q.double(), k.double(), v.double(), scale=0.3, window=window,
                                     compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    assert_rel_close(lse, want_lse, TOL, "lse")
    assert out.stride() == layout.dense_out(q, tuple(out.shape)).stride(), "out follows q's dimension order"
    dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=0.3, window=window)
    rq, rk, rv, _ = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=0.3,
                                             window=window, compute_dtype=torch.float64)
    for got, ref, name, src in ((dq, rq, "dq", q), (dk, rk, "dk", k), (dv, rv, "dv", v)):
        assert_rel_close(got, ref, TOL, name)
        assert got.stride() == torch.empty_like(src).stride(), f"{name} is empty_like its operand"
    for call in (g.calls[-1] for g in fake):
        for uid in (UID.Q, UID.K, UID.V):
            assert layout.usable(call[uid]), f"{uid.name} reached the graph unusable"


def test_a_repeated_signature_reuses_its_binding(fake):
    q, k, v = _dense_views("bshd")
    for _ in range(3):
        dense.forward(q, k, v, scale=0.5)
    assert fake_cudnn.FakeGraph.builds == 1 and len(fake[0].calls) == 3
    q2, k2, v2 = _dense_views("misaligned")
    dense.forward(q2, k2, v2, scale=0.5)
    assert fake_cudnn.FakeGraph.builds == 2, "another alignment is another signature"


def test_clear_cache_reaches_the_graphs_another_thread_built(fake):
    # autograd runs backwards on threads of its own, each with its own cache: clear_cache must
    # reach those too, or a graph built before it (say, under other settings) keeps running there
    import threading

    q, k, v = _dense_views("bshd")
    run = lambda: dense.forward(q, k, v, scale=0.5)  # noqa: E731
    ready, go, errors = threading.Event(), threading.Event(), []

    def worker():
        try:
            run()
            ready.set()
            assert go.wait(30)
            run()
        except BaseException as exc:  # re-raised by the test
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert ready.wait(30) and not errors, errors
    run()
    assert fake_cudnn.FakeGraph.builds == 2, "one graph per thread"
    graphs.clear_cache()
    assert graphs.cache_info()["size"] == 0
    go.set()
    thread.join(30)
    assert not errors, errors
    assert fake_cudnn.FakeGraph.builds == 3, "the other thread rebuilt after clear_cache"
    run()
    assert fake_cudnn.FakeGraph.builds == 4, "and this one too"


def test_a_graph_built_across_a_clear_cache_serves_its_call_and_is_not_kept(fake, monkeypatch):
    real = graphs._build

    def build_while_another_thread_clears(key, handle):
        built = real(key, handle)
        graphs.clear_cache()  # what another thread's clear_cache does to this build
        return built

    q, k, v = _dense_views("bshd")
    monkeypatch.setattr(graphs, "_build", build_while_another_thread_clears)
    out, _ = dense.forward(q, k, v, scale=0.5)
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.5, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    assert graphs.cache_info()["size"] == 0
    assert not graphs._state()["fast"], "no binding of the stale graph is kept"
    monkeypatch.setattr(graphs, "_build", real)
    dense.forward(q, k, v, scale=0.5)
    assert fake_cudnn.FakeGraph.builds == 2, "the next call builds afresh"


def test_padded_dense_out_of_range_lengths_poison_their_batch_row(fake):
    q, k, v = _dense_views("contiguous")
    lq = torch.tensor([16, 5], dtype=torch.int32)
    lk = torch.tensor([17, 3], dtype=torch.int32)  # 17 > S_kv: out of range for batch row 0
    out, _ = dense.forward(q, k, v, scale=0.3, seq_len_q=lq, seq_len_kv=lk)
    assert torch.isnan(out[0]).all(), "an out-of-range length is never computed as a clamped one"
    want, _ = reference.dense(q[1:].double(), k[1:].double(), v[1:].double(), scale=0.3, seq_len_q=lq[1:],
                              seq_len_kv=lk[1:], compute_dtype=torch.float64)
    assert_rel_close(out[1:], want, TOL, "the valid batch row")
    assert (out[1, :, 5:] == 0).all(), "padded rows are 0"


def test_dropout_operands_reach_the_graph_as_single_elements(fake):
    """The Philox pair is bound at the uids the graph declares, forward and backward (values are the
    GPU tier's business: the fake computes nothing with dropout)."""
    q, k, v = _dense_views("bshd")
    philox = torch.tensor([7, 0, 11, 0], dtype=torch.int64)
    out, lse = dense.forward(q, k, v, scale=0.3, dropout_p=0.2, philox=(philox[0], philox[2]))
    dense.backward(torch.randn_like(out), q, k, v, out, lse, scale=0.3, dropout_p=0.2, philox=(philox[0], philox[2]))
    calls = [c for g in fake for c in g.calls]
    assert len(calls) == 2 and all(int(c[UID.SEED]) == 7 and int(c[UID.OFFSET]) == 11 for c in calls)


# ------------------------------------------------------------------------------------- varlen

LENS = (5, 0, 9, 3)


def _cu(lens=LENS):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def _packed_views(kind: str, t=17, h=4, d=8, gen=None):
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if kind == "contiguous":
        return r(t, h, d), r(t, h, d), r(t, h, d)
    if kind == "fused_qkv":  # qkv.view(T, 3, H, D).unbind(1): issue #14 item 1
        return r(t, 3, h, d).unbind(1)
    if kind == "fused_kv":
        kv = r(t, 2, h, d)
        return (r(t, h, d),) + kv.unbind(1)
    if kind == "head_slice_q":  # base[..., :D] of (T, H, 2D): issue #14 item 2
        return r(t, h, 2 * d)[..., :d], r(t, h, d), r(t, h, d)
    if kind == "htd":  # (H, T, D) storage seen as (T, H, D): issue #14 item 7
        return tuple(r(h, t, d).transpose(0, 1) for _ in range(3))
    if kind == "misaligned":
        return tuple(r(t * h * d + 1)[1:].view(t, h, d) for _ in range(3))
    raise ValueError(kind)


PACKED_KINDS = ("contiguous", "fused_qkv", "fused_kv", "head_slice_q", "htd", "misaligned")


@pytest.mark.parametrize("kind", PACKED_KINDS)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)])
def test_packed_forward_backward_on_every_layout(fake, kind, window):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _packed_views(kind, gen=gen)
    cu = _cu()
    go = torch.randn(4, 17, 8, generator=gen).transpose(0, 1)  # grad_out with a layout of its own
    out, lse = packed.forward(q, k, v, cu, cu, 9, 9, scale=0.4, window=window, bottom_right=True)
    want, want_lse = reference.varlen(q.double(), k.double(), v.double(), cu, cu, 9, 9, scale=0.4, window=window,
                                      bottom_right=True, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    assert_rel_close(lse, want_lse.masked_fill(torch.isinf(want_lse), 0), TOL, "lse")
    assert out.stride() == torch.empty_like(q).stride(), "out is empty_like(q), as FlashAttention's"
    dq, dk, dv, _ = packed.backward(go, q, k, v, out, lse, cu, cu, 9, 9, scale=0.4, window=window, bottom_right=True)
    rq, rk, rv, _ = reference.varlen_backward(go.double(), q.double(), k.double(), v.double(), cu, cu, 9, 9,
                                              scale=0.4, window=window, bottom_right=True,
                                              compute_dtype=torch.float64)
    for got, ref, name, src in ((dq, rq, "dq", q), (dk, rk, "dk", k), (dv, rv, "dv", v)):
        assert_rel_close(got, ref, TOL, name)
        assert got.stride() == torch.empty_like(src).stride(), f"{name} is empty_like its operand"
    for g in fake:
        for call in g.calls:
            for uid in (UID.Q, UID.K, UID.V, UID.O, UID.DO, UID.DQ, UID.DK, UID.DV):
                if uid in call:
                    assert layout.packed_usable(call[uid]), f"{uid.name} reached the ragged graph non-contiguous"
            assert len({call[u].untyped_storage().data_ptr() for u in (UID.Q, UID.K, UID.V)}) == 3, \
                "q, k, v reach the ragged graph as separate buffers"


@pytest.mark.parametrize("lse_form", ["padded", "ragged"])
def test_packed_backward_reads_each_sequences_own_lse(fake, lse_form, monkeypatch):
    """Queries and keys with their own cu_seqlens, a sequence without queries in the middle, tokens
    past the last sequence, the LSE handed over transposed (as varlen_attn's (H, T) LSE arrives):
    the backward's LSE, padded or ragged (``packed.padded_lse_pays``), is each sequence's forward's
    (the fake checks it position by position) and the gradients are the reference's."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_kv = ([7, 0, 8], [5, 3, 8]) if lse_form == "padded" else ([1, 0, 6], [5, 3, 8])
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    t_q, t_kv = sum(lens_q) + 3, sum(lens_kv) + 2  # tokens past the end on both sides
    if lse_form == "ragged":  # the padded (4, 4, 8, 1) LSE over a budget of 0 bytes
        monkeypatch.setattr(packed, "PADDED_LSE_BUDGET", 0)
    assert packed.padded_lse_pays(packed.batch_bucket(3), packed.seqlen_bucket(8), 4) is (lse_form == "padded")
    q = torch.randn(t_q, 4, 8, generator=gen)
    k, v = (torch.randn(t_kv, 4, 8, generator=gen) for _ in range(2))
    go = torch.randn(t_q, 4, 8, generator=gen)
    out, lse = packed.forward(q, k, v, cu_q, cu_kv, 8, 8, scale=0.4)
    lse_t = lse.t().contiguous().t()  # (T, H) with (1, T) strides
    dq, dk, dv, _ = packed.backward(go, q, k, v, out, lse_t, cu_q, cu_kv, 8, 8, scale=0.4)
    want = reference.varlen_backward(go.double(), q.double(), k.double(), v.double(), cu_q, cu_kv, 8, 8, scale=0.4,
                                     compute_dtype=torch.float64)
    for got, ref, name in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
        assert_rel_close(got, ref, TOL, name)
    assert (dq[sum(lens_q):] == 0).all() and (dk[sum(lens_kv):] == 0).all(), "rows past the last sequence are 0"
    bwd = [g for g in fake if isinstance(g.key, graphs.BwdKey)]
    assert [g.key.padded_lse for g in bwd] == [lse_form == "padded"]


@pytest.mark.parametrize("bad", ["past_the_end", "decreasing", "longer_than_max", "nonzero_start"])
def test_packed_out_of_range_lengths_read_nothing_and_give_nan(fake, bad):
    q, k, v = _packed_views("contiguous")
    cu = {"past_the_end": [0, 5, 9, 30], "decreasing": [0, 9, 5, 17], "longer_than_max": [0, 12, 14, 17],
          "nonzero_start": [2, 5, 9, 17]}[bad]
    cu = torch.tensor(cu, dtype=torch.int32)
    out, lse = packed.forward(q, k, v, cu, cu, 9, 9, scale=0.4)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    call = fake[-1].calls[-1]
    assert (call[UID.SEQ_Q] == 0).all() and (call[UID.RAG_Q] == 0).all(), "cuDNN is given nothing to read"
    go = torch.randn_like(out)
    dq, dk, dv, _ = packed.backward(go, q, k, v, out, lse, cu, cu, 9, 9, scale=0.4)
    assert all(torch.isnan(g).all() for g in (dq, dk, dv))


def test_packed_rows_past_the_last_sequence_are_zero(fake):
    q, k, v = _packed_views("htd")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)  # 17 tokens, 10 used
    out, _ = packed.forward(q, k, v, cu, cu, 6, 6, scale=0.4)
    assert (out[10:] == 0).all() and out.stride() == torch.empty_like(q).stride()


def test_a_new_token_count_reuses_the_packed_binding(fake):
    """Packed batches change their token count every step; nothing about the graph or the binding
    does, so a new count builds nothing."""
    for tokens in (17, 23, 40):  # max_seqlen 20..32 share the descriptor's bucket, 32
        q, k, v = (torch.randn(tokens, 4, 8) for _ in range(3))
        cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
        longest = tokens - tokens // 2
        out, lse = packed.forward(q, k, v, cu, cu, 20 + tokens % 10, 20 + tokens % 10, scale=0.4)
        want, _ = reference.varlen(q.double(), k.double(), v.double(), cu, cu, longest, longest, scale=0.4,
                                   compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at T={tokens}")
    assert fake_cudnn.FakeGraph.builds == 1 and len(graphs._state()["fast"]) == 1


@pytest.mark.parametrize("s_q,s_kv,window,bottom_right,unmasked", [
    (1, 300, (-1, 0), True, True),     # a decode step through a causal bottom-right mask (HF's DynamicCache)
    (1, 300, (299, 0), True, True),    # a sliding window that still reaches key 0
    (1, 300, (298, 0), True, False),   # ... one short of it
    (1, 300, (-1, 0), False, False),   # top-left: the one query sees key 0 only
    (1, 1, (-1, 0), False, True),      # one key
    (5, 300, (-1, 0), True, False),    # chunked prefill: the first rows do not see the last keys
    (5, 300, (-1, 2), True, False),
    (5, 9, (-1, 8), False, True),      # the right bound reaches the last key from query 0
    (5, 9, (-1, 7), False, False),     # ... one short of it
])
def test_a_window_that_hides_no_key_runs_the_unmasked_graph(fake, s_q, s_kv, window, bottom_right, unmasked):
    """``dense.unmasked``: where the window (with its alignment) lets every query see every key, the
    forward and backward build and bind the full-attention graph (one graph with unmasked calls of
    that shape), answers and gradients equal to fp64 under the window as given; elsewhere the
    window stays."""
    assert dense.unmasked(window, bottom_right, s_q, s_kv) is unmasked
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(2, 4, s_q, 8, generator=gen)
    k, v = (torch.randn(2, 2, s_kv, 8, generator=gen) for _ in range(2))
    go = torch.randn(2, 4, s_q, 8, generator=gen)
    out, lse = dense.forward(q, k, v, scale=0.3, window=window, bottom_right=bottom_right)
    dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=0.3, window=window, bottom_right=bottom_right)
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, window=window, bottom_right=bottom_right,
                              compute_dtype=torch.float64)
    grads = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=0.3, window=window,
                                     bottom_right=bottom_right, compute_dtype=torch.float64)
    assert_rel_close(out, want, TOL, "out")
    for got, ref, name in zip((dq, dk, dv), grads, ("dq", "dk", "dv")):
        assert_rel_close(got, ref, TOL, name)
    windows = {(g.key.window, g.key.bottom_right) for g in fake}
    assert windows == ({((-1, -1), False)} if unmasked else {(window, bottom_right)}), windows
    n = len(fake)
    dense.forward(q, k, v, scale=0.3)  # full attention: the same graph when the window hid nothing
    assert (len(fake) == n) is unmasked


def test_a_bias_forward_says_once_that_it_builds_a_graph_per_length(fake, monkeypatch, caplog):
    """A bias's strides follow S, so a forward with one binds an exact graph at each new length (the
    length buckets never take it); the engine says so once per configuration, at INFO, from the
    second length on, naming the integration that passes lengths instead; answers stay fp64's."""
    from cudnn_sdpa_provider.core import counters

    monkeypatch.setattr(dense, "_bias_lengths", {})
    monkeypatch.setattr(counters, "_logged", set())
    gen = torch.Generator().manual_seed(5)

    def call(s):
        q, k, v = (torch.randn(2, h, s, 8, generator=gen) for h in (4, 2, 2))
        bias = torch.randn(2, 1, s, s, generator=gen)
        out, _ = dense.forward(q, k, v, scale=0.3, bias=bias)
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=0.3, bias=bias.double(),
                                  compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, f"out at S={s}")

    with caplog.at_level("INFO", logger="cudnn_sdpa_provider"):
        call(40)
        call(40)
        assert not [r for r in caplog.records if "bias or mask" in r.getMessage()], "one length: nothing to say"
        call(41)
        call(57)
        said = [r.getMessage() for r in caplog.records if "bias or mask" in r.getMessage()]
    assert len(said) == 1 and "H=4/2, D=8" in said[0] and "integrations.transformers.register()" in said[0], said
    assert len(fake) == 3, "one exact graph per length"
