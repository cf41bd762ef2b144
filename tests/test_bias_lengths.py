"""CPU tier: a bias that is a right-padding mask runs as per-sequence lengths (``ops.bias_lengths``).

What is recognised and what is not, one read per forward call (no contents remembered; a
configuration whose bias was not a mask is not read again, nor a shape recognised ``STABLE_AFTER``
times while its configuration came at few shapes), and the F.sdpa override served through it on the
stand-in cuDNN: answers and gradients against the fp64 reference with the bias itself, the engine
given lengths (no bias), one graph per direction across new lengths of a bucket, the backward
running what its forward ran.
"""

from __future__ import annotations

import pytest
import torch

from cudnn_sdpa_provider.core import counters, env, length_terms, rows
from cudnn_sdpa_provider.engine import dense, graphs
from cudnn_sdpa_provider.hooks import overrides
from cudnn_sdpa_provider.ops import bias_lengths, reference
from tests.test_route import _Original, cuda_like  # noqa: F401 (the served-override fixture)
from tests.util import assert_rel_close

INF = float("-inf")


def _mask(lengths, s, *, causal=True, left=False):
    """(B, 1, S, S) bool: True where a query row may see a key, as transformers builds it."""
    j = torch.arange(s)
    rows = []
    for n in lengths:
        keys = (j >= s - n) if left else (j < n)
        allowed = keys[None, :].expand(s, s)
        if causal:
            allowed = allowed & (j[None, :] <= j[:, None])
        rows.append(allowed)
    return torch.stack(rows)[:, None]


def _bias(mask, dtype=torch.float32, fill=INF):
    """A boolean mask as a bias: 0 where allowed, ``fill`` elsewhere (-inf as PyTorch's math path
    makes it; its cuDNN path, what the op sees, makes -65504)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, fill)


def _qk(b=3, h=2, s=9, d=8):
    return torch.randn(b, h, s, d), torch.randn(b, h, s, d)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv(env.SHAPE_BUCKETS, "1")  # the length buckets on, as on a verified GPU
    bias_lengths.clear()
    yield
    bias_lengths.clear()


@pytest.mark.parametrize("causal, window", [(True, (-1, 0)), (False, (-1, -1))])
def test_a_right_padding_mask_is_its_lengths(causal, window):
    q, k = _qk()
    found = bias_lengths.recognise(_bias(_mask([9, 4, 1], 9, causal=causal)), q, k)
    assert found.window == window
    assert found.seq_len_kv.tolist() == [9, 4, 1] and found.seq_len_q.tolist() == [9, 9, 9]
    assert found.seq_len_kv.dtype == found.seq_len_q.dtype == torch.int32


def test_a_mask_broadcast_over_the_batch_gives_every_row_its_lengths():
    q, k = _qk(b=4)
    found = bias_lengths.recognise(_bias(_mask([6], 9)), q, k)
    assert found.seq_len_kv.tolist() == [6] * 4 and found.seq_len_kv.is_contiguous()


@pytest.mark.parametrize("lengths", [[9, 4, 1], [6]])
def test_recognised_lengths_are_marked_as_made_here(lengths):
    """The forward and its backward share the row terms (core/length_terms.py) of lengths made here."""
    q, k = _qk()
    found = bias_lengths.recognise(_bias(_mask(lengths, 9)), q, k)
    calls = []
    for _ in range(2):
        length_terms.get(found.seq_len_q, found.seq_len_kv, ("term",), lambda: calls.append(1))
    assert calls == [1]
    # what the read found: every query length is S and every key length in [1, S]
    assert length_terms.full(found.seq_len_q, found.seq_len_kv, 9, 9)
    assert not length_terms.full(found.seq_len_q, found.seq_len_kv, 9, 10)


@pytest.mark.parametrize("fill", [INF, -65504.0, torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
def test_every_masking_value_at_or_below_minus_65504_masks(fill):
    """-65504 is what PyTorch's cuDNN path makes of a boolean mask's False; finfo.min transformers'."""
    q, k = _qk()
    found = bias_lengths.recognise(_bias(_mask([9, 4, 1], 9), fill=fill), q, k)
    assert found.window == (-1, 0) and found.seq_len_kv.tolist() == [9, 4, 1]


@pytest.mark.parametrize("what", ["left padding", "-65000", "a sequence of no tokens", "sliding window",
                                  "one head differs", "a finite bias", "no bias entries at -inf but 0 everywhere "
                                  "past a length"])
def test_what_is_not_exactly_right_padding_keeps_its_bias(what):
    q, k = _qk()
    mask = _mask([9, 4, 2], 9)
    bias = _bias(mask)
    if what == "left padding":
        bias = _bias(_mask([9, 4, 2], 9, left=True))
    elif what == "-65000":  # masks weakly: exp(-65000) is 0, but not below the bound this holds to
        bias = _bias(mask, fill=-65000.0)
    elif what == "a sequence of no tokens":
        bias = _bias(_mask([9, 4, 0], 9))
    elif what == "sliding window":
        j = torch.arange(9)
        bias = _bias(mask & (j[None, :] > j[:, None] - 3))
    elif what == "one head differs":
        bias = _bias(mask.expand(3, 2, 9, 9).clone())
        bias[1, 1, 5, 0] = INF
    elif what == "a finite bias":
        bias = bias.masked_fill(mask, 0.5)
    else:
        bias = torch.where(mask, 0.0, 1.0)
    assert bias_lengths.recognise(bias, q, k) is None


@pytest.mark.parametrize("what", ["decode", "3-D", "integer", "shape", "subclass", "compiling", "too large",
                                  "buckets off", "meta"])
def test_calls_it_does_not_read(what, monkeypatch):
    """Host-side refusals: nothing is read on the device."""
    reads = []
    monkeypatch.setattr(bias_lengths, "_read", lambda bias: reads.append(1))
    q, k = _qk()
    bias = _bias(_mask([9, 4, 2], 9))
    if what == "decode":
        q = q[:, :, :1]
        bias = bias[:, :, :1]
    elif what == "3-D":
        bias = bias[0]
    elif what == "integer":
        bias = bias.isinf().int()
    elif what == "shape":
        bias = bias[:, :, :, :8]
    elif what == "subclass":
        bias = torch.nn.Parameter(bias, requires_grad=False)
    elif what == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    elif what == "buckets off":  # an exact graph per length either way
        monkeypatch.setenv(env.SHAPE_BUCKETS, "0")
    elif what == "meta":
        bias = bias.to("meta")
    else:
        monkeypatch.setattr(bias_lengths, "MAX_ENTRIES", bias.numel() - 1)
    assert bias_lengths.recognise(bias, q, k) is None and reads == []


def _counted_reads(monkeypatch) -> list:
    reads = []
    real = bias_lengths._read
    monkeypatch.setattr(bias_lengths, "_read", lambda bias: reads.append(1) or real(bias))
    return reads


def test_every_call_reads_its_mask_nothing_is_remembered(monkeypatch):
    """A mask's contents can change without its version counter (a CUDA-graph replay, a ``.data``
    write): each call reads what it is given."""
    reads = _counted_reads(monkeypatch)
    q, k = _qk()
    bias = _bias(_mask([9, 4, 2], 9))
    assert bias_lengths.recognise(bias, q, k).seq_len_kv.tolist() == [9, 4, 2]
    version = bias._version
    bias.data.copy_(_bias(_mask([9, 7, 3], 9)))
    assert bias._version == version, "a write the version counter does not see"
    assert bias_lengths.recognise(bias, q, k).seq_len_kv.tolist() == [9, 7, 3] and len(reads) == 2


def test_a_configuration_whose_bias_was_not_a_mask_is_not_read_again(monkeypatch):
    """A model with another bias (ALiBi, a relative position bias) pays one read, not one per call;
    another configuration is still read."""
    reads = _counted_reads(monkeypatch)
    q, k = _qk()
    alibi = torch.randn(3, 1, 9, 9)
    for _ in range(3):
        assert bias_lengths.recognise(alibi, q, k) is None
    assert len(reads) == 1
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is None, "the same configuration"
    assert len(reads) == 1
    q8, k8 = _qk(h=4)
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q8, k8) is not None and len(reads) == 2


def test_a_shape_recognised_stable_after_times_keeps_its_bias_unread(monkeypatch):
    """Training padded to one length: after ``STABLE_AFTER`` recognitions of one exact shape the
    mask is kept as a bias without a read; another B or S is still read, and counted apart."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 3)
    reads = _counted_reads(monkeypatch)
    q, k = _qk()
    for lengths in ([9, 4, 2], [9, 7, 3], [5, 9, 1]):  # the same shape, other masks each step
        assert bias_lengths.recognise(_bias(_mask(lengths, 9)), q, k) is not None
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is None and len(reads) == 3
    q10, k10 = _qk(s=10)
    assert bias_lengths.recognise(_bias(_mask([10, 4, 2], 10)), q10, k10) is not None and len(reads) == 4
    q2, k2 = _qk(b=2)
    assert bias_lengths.recognise(_bias(_mask([9, 4], 9)), q2, k2) is not None and len(reads) == 5
    bias_lengths.clear()
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None and len(reads) == 6


def test_a_configuration_seen_at_more_than_stable_shapes_keeps_reading(monkeypatch):
    """Dynamic padding: once a configuration was recognised at more than ``STABLE_SHAPES`` shapes,
    no shape of it is kept unread, however often it comes back (an exact graph per length is what
    the buckets avoid); another configuration is counted apart."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 2)
    monkeypatch.setattr(bias_lengths, "STABLE_SHAPES", 2)
    reads = _counted_reads(monkeypatch)
    for s in (9, 10, 11):
        q, k = _qk(s=s)
        assert bias_lengths.recognise(_bias(_mask([s, 4, 2], s)), q, k) is not None
    q, k = _qk()
    for _ in range(4):
        assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None
    assert len(reads) == 7
    q8, k8 = _qk(h=4)
    for _ in range(2):
        assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q8, k8) is not None
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q8, k8) is None and len(reads) == 9


def test_stable_shapes_is_the_most_shapes_that_still_keep_one_unread(monkeypatch):
    """At exactly ``STABLE_SHAPES`` shapes a configuration's stable shape stops being read; at one
    more, the configuration reads again for good, the shape kept before included."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 2)
    monkeypatch.setattr(bias_lengths, "STABLE_SHAPES", 3)
    reads = _counted_reads(monkeypatch)
    for s in (10, 11):
        q, k = _qk(s=s)
        assert bias_lengths.recognise(_bias(_mask([s, 4, 2], s)), q, k) is not None
    q, k = _qk()  # the third shape
    for _ in range(2):
        assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is None and len(reads) == 4
    q12, k12 = _qk(s=12)  # a fourth shape: dynamic from now on
    assert bias_lengths.recognise(_bias(_mask([12, 4, 2], 12)), q12, k12) is not None and len(reads) == 5
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None and len(reads) == 6


def test_the_configurations_counted_are_bounded(monkeypatch):
    """At most ``_CONFIGURATIONS`` configurations are counted; the least recently counted one is
    dropped and starts over (read again until it comes ``STABLE_AFTER`` times more)."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 2)
    monkeypatch.setattr(bias_lengths, "_CONFIGURATIONS", 2)
    reads = _counted_reads(monkeypatch)
    pairs = [_qk(h=h) for h in (2, 3, 4)]
    mask = _bias(_mask([9, 4, 2], 9))
    for q, k in pairs[:2]:
        for _ in range(2):
            assert bias_lengths.recognise(mask, q, k) is not None
    assert all(bias_lengths.recognise(mask, q, k) is None for q, k in pairs[:2]) and len(reads) == 4
    assert bias_lengths.recognise(mask, *pairs[2]) is not None and len(bias_lengths._recognised) == 2
    assert bias_lengths.recognise(mask, *pairs[0]) is not None, "dropped: counted again from 0"
    assert bias_lengths.recognise(mask, *pairs[1]) is not None, "dropped when H 2 came back"
    assert len(reads) == 7


def test_only_recognised_calls_count_towards_stable(monkeypatch):
    """A call whose read found no padding mask (left padding here) is not a recognition: the shape
    is still read after ``STABLE_AFTER`` such calls."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 2)
    reads = _counted_reads(monkeypatch)
    q, k = _qk()
    left = _bias(_mask([9, 4, 2], 9, left=True))
    monkeypatch.setattr(bias_lengths, "_not_masks", set())  # left padding is read, and refused, each call
    for _ in range(2):
        assert bias_lengths.recognise(left, q, k) is None
        bias_lengths._not_masks.clear()
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None and len(reads) == 3


def test_a_read_that_runs_out_of_memory_keeps_the_bias(monkeypatch):
    def oom(bias):
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(bias_lengths, "_read", oom)
    q, k = _qk()
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is None
    monkeypatch.undo()
    monkeypatch.setenv(env.SHAPE_BUCKETS, "1")
    assert bias_lengths.recognise(_bias(_mask([9, 4, 2], 9)), q, k) is not None, "not taken for a non-mask"


# ------------------------------------------------------------- the F.sdpa override, served


def _engine_spy(monkeypatch):
    seen = []
    for name in ("forward", "backward"):
        real = getattr(dense, name)

        def spy(*args, _real=real, _name=name, **kw):
            seen.append((_name, kw.get("bias") is not None, kw.get("seq_len_kv") is not None, kw.get("window")))
            return _real(*args, **kw)

        monkeypatch.setattr(dense, name, spy)
    return seen


@pytest.mark.parametrize("fill", [-65504.0, INF])
@pytest.mark.parametrize("causal", [True, False])
def test_the_override_serves_a_padding_mask_as_lengths_with_the_bias_s_answers(cuda_like, monkeypatch, causal, fill):
    graphs.clear_cache()  # the bucket's graphs are built here, whatever ran before
    seen = _engine_spy(monkeypatch)
    reads = _counted_reads(monkeypatch)
    range_checks = []  # none: the read found every length in range (length_terms.own(..., full=))
    real_check = rows.bad_lengths
    monkeypatch.setattr(rows, "bad_lengths", lambda *a: range_checks.append(1) or real_check(*a))
    made = []  # the lengths' row terms (core/length_terms.py): made by the forward, kept for its backward
    real_get = length_terms.get
    monkeypatch.setattr(length_terms, "get", lambda lq, lk, key, make: real_get(
        lq, lk, key, lambda: made.append(key[0]) or make()))
    kernels = overrides._Dense(_Original(), _Original())
    before = counters.stats()
    for s, lengths in ((40, [40, 17, 3]), (45, [45, 44, 1]), (57, [20, 57, 30])):  # one length bucket
        gen = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(3, 4, s, 8, generator=gen) for _ in range(3))
        bias = _bias(_mask(lengths, s, causal=causal), fill=fill)
        result = kernels.forward(None, q, k, v, bias, True, 0.0, False, False, scale=None)
        out, lse = result[0], result[1]
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, bias=bias.double(),
                                  compute_dtype=torch.float64)
        assert_rel_close(out, want, 1e-6, f"out at S {s}")
        go = torch.randn(out.shape, generator=gen)
        grads = kernels.backward(None, go, q, k, v, out, lse, result[6], result[7], bias, None, None, s, s, 0.0,
                                 False, scale=None)
        wants = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=8 ** -0.5,
                                         bias=bias.double(), compute_dtype=torch.float64)[:3]
        for name, got, ref in zip(("dq", "dk", "dv"), grads, wants):
            assert_rel_close(got, ref, 1e-6, f"{name} at S {s}")
    window = (-1, 0) if causal else (-1, -1)
    assert seen == [("forward", False, True, window), ("backward", False, True, window)] * 3
    assert len(reads) == 3, "each backward ran what its forward ran, without reading the mask again"
    assert made.count("safe") == 3, "each backward took its forward's lengths for cuDNN"
    assert range_checks == [], "lengths the read found in range are not checked again on the device"
    region = counters.stats() - before
    assert region.served["dense_fwd"] == 3 and region.served["dense_bwd"] == 3
    assert region.builds["built"] == 2, "one forward and one backward graph for the bucket's three lengths"


def test_across_the_stable_switch_each_backward_runs_what_its_forward_ran(cuda_like, monkeypatch):
    """The call on which a shape stops being read: the forward before it ran as lengths, the one
    after it with the bias; each backward follows its own forward, with the bias's answers, even
    when the two backwards run after both forwards."""
    monkeypatch.setattr(bias_lengths, "STABLE_AFTER", 1)
    seen = _engine_spy(monkeypatch)
    reads = _counted_reads(monkeypatch)
    kernels = overrides._Dense(_Original(), _Original())
    gen = torch.Generator().manual_seed(3)
    calls = []
    for lengths in ([24, 9, 2], [11, 24, 5]):  # one shape, another mask at each call
        q, k, v = (torch.randn(3, 2, 24, 8, generator=gen) for _ in range(3))
        bias = _bias(_mask(lengths, 24), fill=-65504.0)
        result = kernels.forward(None, q, k, v, bias, True, 0.0, False, False, scale=None)
        calls.append((q, k, v, bias, result))
    for q, k, v, bias, result in calls:
        out, lse = result[0], result[1]
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, bias=bias.double(),
                                  compute_dtype=torch.float64)
        assert_rel_close(out, want, 1e-6, "out")
        go = torch.randn(out.shape, generator=gen)
        grads = kernels.backward(None, go, q, k, v, out, lse, result[6], result[7], bias, None, None, 24, 24, 0.0,
                                 False, scale=None)
        wants = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=8 ** -0.5,
                                         bias=bias.double(), compute_dtype=torch.float64)[:3]
        for name, got, ref in zip(("dq", "dk", "dv"), grads, wants):
            assert_rel_close(got, ref, 1e-6, name)
    assert len(reads) == 1
    assert seen == [("forward", False, True, (-1, 0)), ("forward", True, False, (-1, -1)),
                    ("backward", False, True, (-1, 0)), ("backward", True, False, (-1, -1))]


def test_the_override_keeps_a_left_padding_mask_as_a_bias(cuda_like, monkeypatch):
    seen = _engine_spy(monkeypatch)
    kernels = overrides._Dense(_Original(), _Original())
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    bias = _bias(_mask([12, 5], 12, left=True))
    out = kernels.forward(None, q, k, v, bias, False, 0.0, False, False, scale=None)[0]
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, bias=bias.double(),
                              compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert seen == [("forward", True, False, (-1, -1))]


def test_an_inference_tensor_mask_is_read_at_each_call(cuda_like, monkeypatch):
    """Under ``torch.inference_mode()`` (generation's prefill) the mask keeps no version counter:
    it is read at every call, never remembered, and served as lengths."""
    reads = []
    real = bias_lengths._read
    monkeypatch.setattr(bias_lengths, "_read", lambda bias: reads.append(1) or real(bias))
    seen = _engine_spy(monkeypatch)
    kernels = overrides._Dense(_Original(), _Original())
    with torch.inference_mode():
        q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
        bias = _bias(_mask([12, 5], 12))
        for _ in range(2):
            out = kernels.forward(None, q, k, v, bias, False, 0.0, False, False, scale=None)[0]
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, bias=bias.double(),
                              compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert len(reads) == 2 and seen == [("forward", False, True, (-1, 0))] * 2


def test_is_causal_with_a_mask_keeps_the_bias(cuda_like, monkeypatch):
    """Both apply (causal and the mask): not a padding mask's attention alone."""
    reads = _counted_reads(monkeypatch)
    seen = _engine_spy(monkeypatch)
    kernels = overrides._Dense(_Original(), _Original())
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    bias = _bias(_mask([12, 5], 12, causal=False))
    out = kernels.forward(None, q, k, v, bias, False, 0.0, True, False, scale=None)[0]
    want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, window=(-1, 0),
                              bias=bias.double(), compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert reads == [] and seen == [("forward", True, False, (-1, 0))]


def test_a_bias_that_needs_its_gradient_is_not_read(cuda_like, monkeypatch):
    reads = []
    monkeypatch.setattr(bias_lengths, "_read", lambda bias: reads.append(1))
    kernels = overrides._Dense(_Original(), _Original())
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    bias = _bias(_mask([12, 5], 12)).requires_grad_()
    with pytest.raises(AssertionError, match="must not reach"):  # bias_grad: a fallback to PyTorch's kernel
        kernels.forward(None, q, k, v, bias, False, 0.0, False, False, scale=None)
    assert reads == []
