"""GPU tier: the packed (varlen) graphs across changing lengths (engine/packed.py, "Keying").

Varlen batches of one configuration with random lengths inside and across length buckets (the
longest sequence at 2^k - 1, 2^k, 2^k + 1 and random lengths between), random batch counts and
tokens past the last sequence, forward and backward through ``csp.attention``. Each call is checked
against the fp32 reference relative to each tensor's magnitude, and against PyTorch's own
``varlen_attn`` (FlashAttention) where this torch has it (GQA where it takes ``enable_gqa``). Every
operand is a view of a longer buffer whose tokens past ``cu_seqlens[-1]`` are NaN, inside the tensor
and past its end (a canary: a kernel that read past a sequence would make the answer NaN); rows past
the last sequence must come back 0. The graphs built are counted with ``graphs.cache_info()``: at
most one forward and one backward per bucket, and none when the configuration comes back with new
lengths.
"""
from __future__ import annotations

import inspect
import random

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.engine import graphs, packed
from cudnn_sdpa_provider.ops import reference
from tests.util import TOL, assert_rel_close, grad_tol, poison_allocator

pytestmark = pytest.mark.gpu
DEV = "cuda"
DT = torch.bfloat16


def _builds() -> int:
    info = graphs.cache_info()
    return info["built"] + info["rejected"]


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)


def _canary(used: int, tail: int, h: int, d: int, pad: int = 64) -> torch.Tensor:
    """(used + tail, H, D) leaf viewing a (used + tail + pad, H, D) buffer: tokens past ``used`` NaN."""
    buf = torch.full((used + tail + pad, h, d), float("nan"), device=DEV, dtype=DT)
    buf[:used].normal_()
    return buf[: used + tail].detach().requires_grad_()


def _native_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _native_takes(name: str) -> bool:
    return name in inspect.signature(_native_varlen()).parameters


def _native(q, k, v, go, cu_q, cu_kv, max_q, max_kv, causal: bool):
    """PyTorch's varlen_attn (outside any provider scope) on clones: (out, dq, dk, dv)."""
    varlen_attn = _native_varlen()
    kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if causal:  # 2.11: window_size; before: is_causal
        kw.update({"window_size": (-1, 0)} if _native_takes("window_size") else {"is_causal": True})
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attn(*leaves, cu_q, cu_kv, max_q, max_kv, **kw)
    out.backward(go)
    return (out, *(t.grad for t in leaves))


def _step(lens_q, lens_kv, max_q, max_kv, h_q, h_kv, d, *, causal, bottom_right=False, tail=0, native=True):
    """One packed forward+backward through csp.attention, checked against the fp32 reference and
    varlen_attn; ``lens_kv`` None: self-attention (one cu_seqlens for both). Returns the q tokens."""
    same = lens_kv is None
    lens_kv = lens_q if same else lens_kv
    cu_q = _cu(lens_q)
    cu_kv = cu_q if same else _cu(lens_kv)
    used_q, used_kv = sum(lens_q), sum(lens_kv)
    q = _canary(used_q, tail, h_q, d)
    k, v = _canary(used_kv, tail, h_kv, d), _canary(used_kv, tail, h_kv, d)
    go = _canary(used_q, tail, h_q, d).detach()
    window = (-1, 0) if causal else (-1, -1)
    out = csp.attention(q, k, v, window=window, bottom_right=bottom_right, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                        max_seqlen_q=max_q, max_seqlen_kv=max_kv)
    out.backward(go)
    where = f"lens_q={lens_q} lens_kv={lens_kv} max={max_q}/{max_kv} tail={tail}"
    for name, t, used in (("out", out, used_q), ("dq", q.grad, used_q), ("dk", k.grad, used_kv),
                          ("dv", v.grad, used_kv)):
        assert torch.count_nonzero(t[used:]) == 0 and not t[used:].isnan().any(), f"{name} past the last token, {where}"
    leaves = [t.detach().float().masked_fill(torch.isnan(t.detach()), 0).requires_grad_() for t in (q, k, v)]
    ref, _ = reference.varlen(*leaves, cu_q, cu_kv, max_q, max_kv, scale=d ** -0.5, window=window,
                              bottom_right=bottom_right)
    ref.backward(go.float().masked_fill(torch.isnan(go), 0))
    group = h_q // h_kv
    assert_rel_close(out, ref.detach(), TOL[DT], f"out, {where}")
    for name, got, want, g in (("dq", q.grad, leaves[0].grad, 1), ("dk", k.grad, leaves[1].grad, group),
                               ("dv", v.grad, leaves[2].grad, group)):
        assert_rel_close(got, want, grad_tol(DT, g), f"{name}, {where}")
    if native and not bottom_right and _native_varlen() is not None and (group == 1 or _native_takes("enable_gqa")):
        n_out, n_dq, n_dk, n_dv = _native(q, k, v, go, cu_q, cu_kv, max_q, max_kv, causal)
        for name, got, nat, used in (("out", out, n_out, used_q), ("dq", q.grad, n_dq, used_q),
                                     ("dk", k.grad, n_dk, used_kv), ("dv", v.grad, n_dv, used_kv)):
            assert_rel_close(got[:used], nat[:used], 2 * grad_tol(DT), f"{name} against varlen_attn, {where}")
    return used_q


def _lens(rng: random.Random, batch: int, longest: int) -> list[int]:
    lens = [rng.randint(1, longest) for _ in range(batch - 1)] + [longest]
    rng.shuffle(lens)
    return lens


def _edges(lo_k: int, hi_k: int) -> list[int]:
    return [e for k in range(lo_k, hi_k + 1) for e in (2**k - 1, 2**k, 2**k + 1)]


def test_self_attention_sweep_builds_once_per_bucket():
    """Causal self-attention, H 8, D 128: the longest sequence at every 2^k - 1, 2^k, 2^k + 1 from 3 to
    1025 and two random lengths per bucket, 5-8 sequences (one batch bucket), 0-9 tokens past the end;
    then the same buckets again with new lengths, which must build nothing."""
    rng = random.Random(28)
    edges = _edges(2, 10)
    buckets = sorted({packed.seqlen_bucket(m) for m in edges})
    first = edges + [rng.randint(b // 2 + 1, b) for b in buckets for _ in range(2)]
    poison_allocator(DEV)
    before, built = counters.stats(), _builds()
    for longest in first:
        _step(_lens(rng, rng.randint(5, 8), longest), None, longest, longest, 8, 8, 128, causal=True,
              tail=rng.randint(0, 9))
    assert _builds() - built <= 2 * len(buckets), (_builds() - built, buckets)
    again = _builds()
    second = [rng.randint(b // 2 + 1, b) for b in buckets for _ in range(2)]
    rng.shuffle(second)
    for longest in second:
        _step(_lens(rng, rng.randint(5, 8), longest), None, longest, longest, 8, 8, 128, causal=True,
              tail=rng.randint(0, 9))
    assert _builds() == again, "a configuration seen before built again inside its buckets"
    delta = (counters.stats() - before).to_dict()
    n = len(first) + len(second)
    served = {"served": n, "fallback": {}}
    assert delta["varlen_fwd"] == served and delta["varlen_bwd"] == served, delta


def test_chunked_prefill_gqa_builds_once_per_bucket_pair():
    """Bottom-right causal chunks of 1-16 queries over caches of 31 to 1025 keys (the longest at the
    bucket edges), H 8/2, D 64, cu_seqlens of their own: one forward and one backward per (S_q, S_kv)
    bucket pair, none for new lengths in the same pairs."""
    rng = random.Random(7)
    pairs, calls = set(), []
    for longest_kv in _edges(5, 10):  # every key length at least the chunk's: no query without keys
        lens_q = [rng.randint(1, 16) for _ in range(4)]
        lens_kv = [n + rng.randint(0, longest_kv - n) for n in lens_q]
        lens_kv[rng.randrange(4)] = longest_kv
        calls.append((lens_q, lens_kv))
        pairs.add((packed.seqlen_bucket(max(lens_q)), packed.seqlen_bucket(longest_kv)))
    built = _builds()
    for lens_q, lens_kv in calls:
        _step(lens_q, lens_kv, max(lens_q), max(lens_kv), 8, 2, 64, causal=True, bottom_right=True, tail=3)
    assert _builds() - built <= 2 * len(pairs), (_builds() - built, sorted(pairs))
    again = _builds()
    for lens_q, lens_kv in calls[::-1]:
        shorter = [max(1, n - 1) for n in lens_q]  # new lengths; max_seqlen as before: the same buckets
        _step(shorter, lens_kv, max(lens_q), max(lens_kv), 8, 2, 64, causal=True, bottom_right=True, tail=1)
    assert _builds() == again


def test_batch_counts_build_once_per_batch_bucket():
    """1 to 9 sequences in the 256 bucket: batch buckets 1, 2, 4, 8, 16, whose added sequences are
    empty; then each count again with new lengths, which builds nothing."""
    rng = random.Random(9)
    built = _builds()
    for batch in range(1, 10):
        lens = _lens(rng, batch, rng.randint(129, 256))
        _step(lens, None, max(lens), max(lens), 4, 4, 128, causal=False, tail=2)
    assert _builds() - built <= 2 * 5
    again = _builds()
    for batch in range(9, 0, -1):
        lens = _lens(rng, batch, rng.randint(129, 256))
        _step(lens, None, max(lens), max(lens), 4, 4, 128, causal=False, tail=0)
    assert _builds() == again


def test_over_the_accumulator_budget_the_token_bound_covers_every_call(monkeypatch):
    """With the budget at 0 every backward sizes cuDNN's dQ accumulator by its token bound
    (``max_total_seq_len``): on real kernels, with the canaries, every bound gives the reference's
    gradients, and the backward builds once per distinct bound."""
    monkeypatch.setattr(packed, "ACCUMULATOR_BUDGET", 0)
    rng = random.Random(11)
    bounds = set()
    built = _builds()
    for _ in range(8):
        lens = _lens(rng, 6, rng.randint(257, 512))
        tail = rng.randint(0, 200)
        _step(lens, None, max(lens), max(lens), 4, 4, 64, causal=True, tail=tail)
        bounds.add(min(packed.token_bucket(sum(lens) + tail), 8 * 512))
    assert _builds() - built <= 1 + len(bounds), (_builds() - built, sorted(bounds))


def test_the_ragged_lse_form_across_a_bucket(monkeypatch):
    """The backward's LSE ragged instead of padded (``PADDED_LSE_BUDGET`` 0) with the batch bucket's
    empty sequences: the reference's gradients, one backward graph for the bucket."""
    monkeypatch.setattr(packed, "PADDED_LSE_BUDGET", 0)
    rng = random.Random(13)
    built = _builds()
    for _ in range(6):
        longest = rng.randint(65, 128)
        _step(_lens(rng, rng.randint(3, 4), longest), None, longest, longest, 4, 4, 64, causal=True, tail=5)
    assert _builds() - built <= 2
