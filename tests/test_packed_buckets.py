"""CPU tier: the packed (varlen) graphs are not rebuilt inside a length bucket (issue #28, item 1).

A varlen training loop changes the lengths, the token count and the number of sequences of every
batch. What the packed graph keys hold of those is the batch bucket and the S_q / S_kv buckets
(``packed.batch_bucket``, ``packed.seqlen_bucket``), and, for a backward whose nominal fp32 dQ
accumulator is over ``packed.ACCUMULATOR_BUDGET``, the token bound that sizes it. These tests drive
many calls of one configuration through the engine on the stand-in cuDNN (tests/fake_cudnn.py,
which reads and writes exactly what each key declares and checks the declared batch of every index
tensor and the accumulator bound against the tokens the call uses) and count the graphs built.
"""

from __future__ import annotations

import random

import pytest
import torch

from cudnn_sdpa_provider.engine import graphs, packed
from cudnn_sdpa_provider.engine.graphs import UID, BwdKey, FwdKey
from cudnn_sdpa_provider.ops import reference
from tests import fake_cudnn
from tests.util import assert_rel_close

TOL = 1e-6  # fp64 inside the fake, fp32 operands
H, D = 2, 16  # D % 16 == 0: the accumulator bound (max_total_seq_len) applies on the fake Hopper


@pytest.fixture
def fake(monkeypatch):
    built = fake_cudnn.install(monkeypatch)
    yield built
    graphs.clear_cache()


def _counts(built) -> tuple[int, int]:
    return (sum(isinstance(g.key, FwdKey) for g in built), sum(isinstance(g.key, BwdKey) for g in built))


def _batch(rng: random.Random, lens_q, lens_kv=None, tail=0, gen=None):
    """q, k, v, grad_out and cu_seqlens of one packed batch (``tail`` tokens past the last sequence)."""
    lens_kv = lens_q if lens_kv is None else lens_kv
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32)
    cu_kv = cu_q if lens_kv is lens_q else torch.tensor([0] + list(torch.tensor(lens_kv).cumsum(0).tolist()),
                                                         dtype=torch.int32)
    t_q, t_kv = int(cu_q[-1]) + tail, int(cu_kv[-1]) + tail
    q, go = torch.randn(t_q, H, D, generator=gen), torch.randn(t_q, H, D, generator=gen)
    k, v = torch.randn(t_kv, H, D, generator=gen), torch.randn(t_kv, H, D, generator=gen)
    return q, k, v, go, cu_q, cu_kv


def _step(q, k, v, go, cu_q, cu_kv, max_q, max_kv, *, window=(-1, 0), check=True):
    out, lse = packed.forward(q, k, v, cu_q, cu_kv, max_q, max_kv, scale=0.3, window=window)
    dq, dk, dv, _ = packed.backward(go, q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, scale=0.3, window=window)
    if check:
        args = (cu_q, cu_kv, max_q, max_kv)
        want, _ = reference.varlen(q.double(), k.double(), v.double(), *args, scale=0.3, window=window,
                                   compute_dtype=torch.float64)
        assert_rel_close(out, want, TOL, "out")
        grads = reference.varlen_backward(go.double(), q.double(), k.double(), v.double(), *args, scale=0.3,
                                          window=window, compute_dtype=torch.float64)
        for got, ref, name in zip((dq, dk, dv), grads, ("dq", "dk", "dv")):
            assert_rel_close(got, ref, TOL, name)
    return out, dq


def _ran(built, before: dict, kind) -> list:
    """The graphs of ``kind`` that executed since ``before`` (``{graph: calls}`` snapshot)."""
    return [g for g in built if isinstance(g.key, kind) and len(g.calls) > before.get(g, 0)]


def _lengths_in_bucket(rng: random.Random, batch: int, bucket: int) -> list[int]:
    """``batch`` lengths in [1, bucket], the longest in (bucket / 2, bucket] (so max_seqlen's bucket is ``bucket``);
    some sequences may be empty."""
    lens = [0 if rng.random() < 0.1 else rng.randint(1, bucket) for _ in range(batch)]
    lens[rng.randrange(batch)] = rng.randint(bucket // 2 + 1, bucket)
    return lens


def test_varlen_training_inside_one_bucket_builds_one_forward_and_one_backward(fake):
    """40 steps of one configuration: 5 to 8 sequences (one batch bucket), lengths up to 32 with the
    longest above 16 (one S bucket), token counts from about 20 to 260 and tails past the last
    sequence: one forward and one backward graph for all of them, every answer the reference's."""
    rng, gen = random.Random(28), torch.Generator().manual_seed(28)
    tokens, batches = set(), set()
    for _ in range(40):
        batch = rng.randint(5, 8)
        lens = _lengths_in_bucket(rng, batch, 32)
        q, k, v, go, cu_q, cu_kv = _batch(rng, lens, tail=rng.randint(0, 3), gen=gen)
        max_len = max(lens) + rng.randint(0, 32 - max(lens))  # max_seqlen: any bound inside the bucket
        _step(q, k, v, go, cu_q, cu_kv, max_len, max_len)
        tokens.add(q.shape[0])
        batches.add(batch)
    assert len(tokens) > 20 and len(batches) == 4, "the loop changes token counts and batch counts"
    assert _counts(fake) == (1, 1), [g.key for g in fake]
    fwd, bwd = (g.key for g in fake)
    assert fwd.q.dims == (8, H, 32, D) and bwd.q.dims == (8, H, 32, D), "declared: the batch and S buckets"
    assert bwd.max_total is None, "a nominal accumulator of 8 x 32 tokens is far under the budget"


def test_cross_attention_lengths_of_their_own_one_graph_per_bucket_pair(fake):
    """Queries and keys with lengths of their own (chunked prefill over a cache): the S_q and S_kv
    buckets are separate, each builds once."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    for _ in range(12):
        batch = rng.randint(3, 4)
        lens_q = _lengths_in_bucket(rng, batch, 8)
        lens_kv = [n + rng.randint(0, 56) for n in lens_q]  # keys: the query chunk plus a cache
        lens_kv[0] = rng.randint(33, 64)
        q, k, v, go, cu_q, cu_kv = _batch(rng, lens_q, lens_kv, gen=gen)
        _step(q, k, v, go, cu_q, cu_kv, max(lens_q), max(lens_kv), window=(-1, -1))
    assert _counts(fake) == (1, 1)
    assert fake[0].key.q.dims[2] == 8 and fake[0].key.k.dims[2] == 64


def test_lengths_at_the_bucket_edges_build_once_per_doubling(fake):
    """Longest sequence at 2^k - 1, 2^k, 2^k + 1 for k = 3..6, each length seen twice with other
    batches: one forward and one backward graph per S bucket (8, 16, 32, 64, 128), none repeated."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    edges = [e for k in range(3, 7) for e in (2**k - 1, 2**k, 2**k + 1)]
    for longest in edges + edges[::-1]:
        lens = [rng.randint(1, longest) for _ in range(3)] + [longest]
        q, k, v, go, cu_q, cu_kv = _batch(rng, lens, tail=1, gen=gen)
        _step(q, k, v, go, cu_q, cu_kv, longest, longest, check=longest < 40)
    buckets = {packed.seqlen_bucket(e) for e in edges}
    assert buckets == {8, 16, 32, 64, 128}
    assert _counts(fake) == (len(buckets), len(buckets))
    assert sorted(g.key.q.dims[2] for g in fake if isinstance(g.key, FwdKey)) == sorted(buckets)


def test_batch_counts_build_once_per_batch_bucket(fake):
    """1 to 9 sequences: batch buckets 1, 2, 4, 8, 16; the sequences a bucket adds are empty (length 0,
    offset at the last token) and nothing of them is read or written."""
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    for batch in list(range(1, 10)) * 2:
        lens = _lengths_in_bucket(rng, batch, 16)
        q, k, v, go, cu_q, cu_kv = _batch(rng, lens, tail=2, gen=gen)
        before = {g: len(g.calls) for g in fake}
        out, dq = _step(q, k, v, go, cu_q, cu_kv, 16, 16)
        used = int(cu_q[-1])
        assert (out[used:] == 0).all() and (dq[used:] == 0).all(), "rows past the last sequence stay 0"
        (graph,) = _ran(fake, before, FwdKey)
        call, nb = graph.calls[-1], packed.batch_bucket(batch)
        assert graph.key.q.dims[0] == nb and call[UID.SEQ_Q].numel() == nb and call[UID.RAG_Q].numel() == nb + 1
        assert (call[UID.SEQ_Q].view(-1)[batch:] == 0).all(), "the added sequences are empty"
        assert (call[UID.RAG_Q].view(-1)[batch:] == used * H * D).all(), "at the last token, inside the buffer"
    assert _counts(fake) == (5, 5)


def test_over_the_accumulator_budget_the_backward_keys_on_the_token_bound(fake, monkeypatch):
    """Over the budget the dQ accumulator is sized by the packed tokens (``max_total_seq_len``), so
    the backward builds once per token bound (16 per octave of the token count) while the forward
    still builds once; every bound covers the tokens the call uses (the fake checks the accumulator
    against the dQ offsets and lengths)."""
    monkeypatch.setattr(packed, "ACCUMULATOR_BUDGET", 0)
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    bounds = set()
    for _ in range(16):
        lens = _lengths_in_bucket(rng, 8, 64)
        q, k, v, go, cu_q, cu_kv = _batch(rng, lens, tail=rng.randint(0, 40), gen=gen)
        before = {g: len(g.calls) for g in fake}
        _step(q, k, v, go, cu_q, cu_kv, 64, 64, check=False)
        want = min(packed.token_bucket(q.shape[0]), 8 * 64)
        bounds.add(want)
        (graph,) = _ran(fake, before, BwdKey)
        assert graph.key.max_total == ((want, want) if want < 8 * 64 else None), graph.key.max_total
    assert _counts(fake) == (1, len(bounds)) and len(bounds) > 1


def test_max_total_is_unset_under_the_budget_and_never_below_the_tokens():
    caps = fake_cudnn.HOPPER
    budget_tokens = packed.ACCUMULATOR_BUDGET // (16 * 128 * 4)  # H_q 16, D_qk 128
    # under the budget: nothing about the tokens is in the key
    assert {packed.max_total(caps, t, t, 8, 1024, 1024, 16, 128, 128) for t in (1, 500, 4000, 8192)} == {None}
    assert 8 * 1024 <= budget_tokens
    # over it (the bench's varlen mix: 16 x 4096 nominal, 42052 tokens): today's token bound
    assert packed.max_total(caps, 42052, 42052, 16, 4096, 4096, 16, 128, 128) == (43008, 43008)
    for t in (1, 777, 42052, 65536):
        bound = packed.max_total(caps, t, t, 16, 4096, 4096, 16, 128, 128)
        assert bound is None or (t <= bound[0] <= 16 * 4096 and t <= bound[1] <= 16 * 4096)
    assert packed.max_total(fake_cudnn.with_caps(compute_capability=(8, 0)), 42052, 42052, 16, 4096, 4096, 16, 128,
                            128) is None  # the frontend's Ampere-style kernels


def test_the_lse_form_is_a_function_of_the_bucket_alone():
    """Padded while the padded (B, H, S, 1) LSE is small, whatever the token count."""
    assert packed.padded_lse_pays(16, 4096, 16)  # the bench's varlen case: 4 MiB
    assert not packed.padded_lse_pays(512, 8192, 16)  # 256 MiB: many short documents under a long one
    assert packed.padded_lse_pays(1, 1, 1)



@pytest.mark.parametrize("version, exact", [(91900, True), (92500, False)])
def test_a_deterministic_backward_with_a_dims_sized_workspace_declares_the_calls_dims(monkeypatch, version, exact):
    """On sm_90 below cuDNN 9.25 the deterministic backward's workspace is O(B x S_q x S_kv), and the
    route's gate bounds it on the call's dims: the graph declares those (B 3, S 21), not the buckets
    (4, 32). From 9.25 the workspace is small and the buckets apply."""
    built = fake_cudnn.install(monkeypatch, fake_cudnn.with_caps(cudnn_version=version))
    try:
        gen = torch.Generator().manual_seed(2)
        q, k, v, go, cu_q, cu_kv = _batch(random.Random(2), [21, 4, 9], tail=2, gen=gen)
        out, lse = packed.forward(q, k, v, cu_q, cu_kv, 21, 21, scale=0.3)
        dq, dk, dv, _ = packed.backward(go, q, k, v, out, lse, cu_q, cu_kv, 21, 21, scale=0.3, deterministic=True)
        want = reference.varlen_backward(go.double(), q.double(), k.double(), v.double(), cu_q, cu_kv, 21, 21,
                                         scale=0.3, compute_dtype=torch.float64)
        for got, ref, name in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
            assert_rel_close(got, ref, TOL, name)
        (bwd,) = [g.key for g in built if isinstance(g.key, BwdKey)]
        assert bwd.deterministic and bwd.q.dims == ((3, H, 21, D) if exact else (4, H, 32, D))
    finally:
        graphs.clear_cache()
