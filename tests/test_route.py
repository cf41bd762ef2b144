"""CPU tier: the call pipeline. Every entry point decides through ``route.call`` (a spy sees each
one), the aten and varlen overrides serve on the stand-in cuDNN (tests/fake_cudnn.py) with the
right outputs, markers and counts, a backward follows its forward, the user's backend restriction
is counted as ``backend_disabled``, and dropout that autograd may recompute is recognised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, layout, markers, support
from cudnn_sdpa_provider.engine import graphs
from cudnn_sdpa_provider.hooks import overrides
from cudnn_sdpa_provider.ops import reference, route
from tests import fake_cudnn
from tests.util import assert_rel_close


@pytest.fixture
def spy(monkeypatch):
    seen = []
    real = route.call

    def call(path, found, serve, native, describe, **kw):
        seen.append((path, found.first.slug if found.first else None))
        return real(path, found, serve, native, describe, **kw)

    monkeypatch.setattr(route, "call", call)
    return seen


def _qkv(shape=(1, 2, 8, 8), seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


# ------------------------------------------------------------------------- every entry point


def test_functional_entry_point_decides_through_route(spy):
    q, k, v = _qkv()
    csp.attention(q, k, v).sum().backward()
    assert spy == [("dense_fwd", "no_cuda"), ("dense_bwd", "no_cuda")]
    spy.clear()
    t = torch.randn(6, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    csp.attention(t, t, t, cu_seqlens_q=cu, max_seqlen_q=4, max_seqlen_kv=4).sum().backward()
    assert spy == [("varlen_fwd", "no_cuda"), ("varlen_bwd", "no_cuda")]


@pytest.mark.parametrize("backend", [None, SDPBackend.MATH])
def test_sdpa_entry_point_decides_through_route(spy, backend):
    q, k, v = _qkv()
    with csp.enable():
        if backend is None:
            F.scaled_dot_product_attention(q, k, v).sum().backward()
        else:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert spy == [("dense_fwd", "no_cuda"), ("dense_bwd", "no_cuda")]


def test_integration_entry_point_decides_through_route(spy):
    pytest.importorskip("transformers")
    from cudnn_sdpa_provider.integrations import transformers as hf

    q, k, v = _qkv((1, 2, 4, 8))
    module = torch.nn.Module()
    module.is_causal = True
    hf.attention_forward(module, q, k, v, None)  # served path: csp.attention -> ops -> route
    module.num_key_value_groups = 1
    hf._fallback(module, q, k, v, None, 0.0, None, True, {}, ("attn_bias", "a position_bias"))
    assert spy[0] == ("dense_fwd", "no_cuda") and spy[-1] == ("dense_fwd", "attn_bias")


# ----------------------------------------------------------------- served overrides (fake cuDNN)


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU float32 tensors decided as if they were bf16 on a CUDA machine (the no_cuda and dtype rules
    left out), run on the stand-in cuDNN (which computes in fp64)."""
    fake_cudnn.install(monkeypatch)
    monkeypatch.setattr(support, "RULES", tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype")))
    route.clear()
    yield
    route.clear()
    graphs.clear_cache()


class _Original:
    def __init__(self):
        self.calls = 0

    def call_boxed(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("a served call must not reach PyTorch's kernel")


def test_dense_override_serves_marks_and_backward_follows(cuda_like):
    q, k, v = _qkv((2, 2, 8, 8), requires_grad=False)
    kernels = overrides._Dense(_Original(), _Original())
    before = counters.stats()
    result = kernels.forward(None, q, k, v, None, True, 0.0, True, False, scale=None)
    out, lse = result[0], result[1]
    want, want_lse = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, window=(-1, 0),
                                     compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert markers.lookup(lse) == markers.Record(served=True, strict=False)
    assert result[6].dtype == torch.int64 and result[6].data_ptr() % 16 == 0, "philox stand-ins are aligned"
    go = torch.randn_like(out)
    dq, dk, dv = kernels.backward(None, go, q, k, v, out, lse, result[6], result[7], None, None, None, 8, 8, 0.0, True,
                                  scale=None)
    rq, _, _, _ = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=8 ** -0.5,
                                           window=(-1, 0), compute_dtype=torch.float64)
    assert_rel_close(dq, rq, 1e-6, "dq")
    region = counters.stats() - before
    assert region.served["dense_fwd"] == 1 and region.served["dense_bwd"] == 1


def test_a_new_length_of_a_decided_class_is_decided_without_a_problem(cuda_like, monkeypatch):
    """The F.sdpa forward at a new length takes the decision made at another length of its
    ``support.length_class`` (no problem built, no rule run) and is served; a length of another
    class, or a call with a bias, is decided afresh."""
    built = []
    real = route.dense_problem
    monkeypatch.setattr(route, "dense_problem", lambda *a, **kw: built.append(a[0].shape[2]) or real(*a, **kw))
    kernels = overrides._Dense(_Original(), _Original())
    before = counters.stats()
    for s in (40, 41, 57, 1):
        q, k, v = _qkv((1, 2, s, 8), seed=s, requires_grad=False)
        out = kernels.forward(None, q, k, v, None, False, 0.0, False, False, scale=None)[0]
        want, _ = reference.dense(q.double(), k.double(), v.double(), scale=8 ** -0.5, compute_dtype=torch.float64)
        assert_rel_close(out, want, 1e-6, f"out at S {s}")
    assert built == [40, 1], "S 41 and 57 share S 40's class; S 1 is a class of its own"
    q, k, v = _qkv((1, 2, 42, 8), requires_grad=False)
    kernels.forward(None, q, k, v, torch.zeros(1, 1, 42, 42), False, 0.0, False, False, scale=None)
    assert built == [40, 1, 42], "a bias's call is decided by its own problem"
    assert (counters.stats() - before).served["dense_fwd"] == 5


def test_entry_shares_a_class_decision_as_a_copy():
    """A signature's entry taken from its class is its own: cuDNN refusing one length (``call``
    replaces that entry's reasons) leaves the other lengths' decisions as they were."""
    route.clear()
    made = []

    def problem():
        made.append(1)
        return support.Problem(kind="dense", backward=False, device_type="cpu", dtypes=(torch.float32,) * 3,
                               batch=1, h_q=2, h_k=2, h_v=2, s_q=40, s_kv=40, d_qk=8, d_v=8)

    free = ("lengths_free", support.length_class(40, 40))
    first = route.entry(("sig", 40), problem, None, lambda: free)
    second = route.entry(("sig", 41), problem, None, lambda: free)
    assert len(made) == 1 and first is not second and first.reasons == second.reasons
    second.reasons = []
    assert route.entry(("sig", 42), problem, None, lambda: free).reasons == first.reasons != []
    route.entry(("sig", 1), problem, None, lambda: ("lengths_free", support.length_class(1, 40)))
    assert len(made) == 2
    route.clear()


def test_inference_mode_first_then_training(cuda_like):
    """Issue #14 item 4: nothing made under inference_mode is reused by a training call."""
    q, k, v = _qkv((1, 2, 8, 8), requires_grad=False)
    kernels = overrides._Dense(_Original(), _Original())
    with torch.inference_mode():
        first = kernels.forward(None, q, k, v, None, False, 0.0, False, False, scale=None)
    assert first[6].is_inference(), "made under inference mode, for that call only"
    second = kernels.forward(None, q, k, v, None, True, 0.0, False, False, scale=None)
    assert second[6] is not first[6], "nothing is reused from an earlier call"
    assert not any(t.is_inference() for t in (second[0], second[1], second[6], second[7]))
    assert second[6].shape == () and second[6].data_ptr() % 16 == 0


def test_philox_stand_ins_are_fresh_distinct_blocks_in_the_calling_context():
    with torch.inference_mode():
        first = overrides._unused_philox(torch.device("cpu"))
    seed, offset = overrides._unused_philox(torch.device("cpu"))
    assert all(t.is_inference() for t in first) and not (seed.is_inference() or offset.is_inference())
    pointers = {t.untyped_storage().data_ptr() for t in (*first, seed, offset)}
    assert len(pointers) == 4, "each call gets blocks of its own"
    assert seed.shape == offset.shape == () and seed.dtype == offset.dtype == torch.int64


def test_varlen_override_serves_and_follows_native_layout(cuda_like):
    t, h, d = 12, 2, 8
    storage = torch.randn(3, h, t, d)
    q, k, v = (x.transpose(0, 1) for x in storage.unbind(0))  # (H, T, D) storage seen as (T, H, D)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    ops = overrides._varlen_ops()
    kernels = overrides._Varlen(ops["_varlen_attn"], _Original(), ops["_varlen_attn_backward"], _Original())
    out, lse, rng = kernels.forward(None, q, k, v, cu, cu, 7, 7, True)
    want, want_lse = reference.varlen(q.double(), k.double(), v.double(), cu, cu, 7, 7, scale=d ** -0.5,
                                      window=(-1, 0), bottom_right=True, compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert out.stride() == torch.empty_like(q).stride() == (d, t * d, 1), "native's layout"
    assert lse.shape == (h, t) and lse.is_contiguous(), "torch_attn's (H, T) LSE"
    assert markers.lookup(rng).served


def test_unknown_varlen_arguments_fall_back_with_their_name(cuda_like, monkeypatch):
    """An argument a newer torch adds is never ignored: a non-default value falls back. Every argument
    of this torch's schema has a rule (torch 2.15's ``backend`` too: tests/test_varlen_backend.py)."""
    ops = overrides._varlen_ops()
    schema_op = ops["_varlen_attn"]
    for arg in schema_op._schema.arguments:
        assert arg.name in overrides.VARLEN_ARGUMENTS, f"{arg.name} of this torch's schema has no rule"
    a = {arg.name: arg.default_value if arg.has_default_value() else None for arg in schema_op._schema.arguments}
    a["future_argument"] = 2  # not in this torch's schema: nothing to judge
    assert overrides._unknown_arguments(schema_op, a) == ()
    lib = torch.library.Library("csp_test_future", "FRAGMENT")
    lib.define("va(Tensor query, int future=0) -> Tensor")
    future = torch.ops.csp_test_future.va.default
    assert overrides._unknown_arguments(future, {"query": None, "future": 0}) == ()
    assert overrides._unknown_arguments(future, {"query": None, "future": 5}) == ("future",)


# --------------------------------------------------------------- decisions from the context


def test_user_backend_restriction_counts_backend_disabled():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=gen) for _ in range(3))
    found = route.elsewhere(("test", 0), lambda: route.dense_problem(q.to("meta"), k.to("meta"), v.to("meta")), None)
    assert found.first.slug == "no_cuda"
    cuda_problem = support.Problem(kind="dense", backward=False, device_type="cuda", dtypes=(torch.bfloat16,) * 3,
                                   batch=1, h_q=2, h_k=2, h_v=2, s_q=8, s_kv=8, d_qk=64, d_v=64)
    saved = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for enabled, slug in ((False, "backend_disabled"), (True, "torch_selection")):
            torch.backends.cuda.enable_cudnn_sdp(enabled)
            assert route._selection_reason(cuda_problem).slug == slug
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved)


def test_dropout_recompute_is_recognised_under_checkpointing():
    seen = []

    def block(x):
        seen.append(route.recompute(0.1))
        return (x * 2).sin()

    for reentrant in (True, False):
        seen.clear()
        x = torch.randn(3, requires_grad=True)
        checkpoint(block, x, use_reentrant=reentrant).sum().backward()
        assert seen == [True, True], (reentrant, seen)  # the forward and its recomputation
    x = torch.randn(3, requires_grad=True)
    assert block(x) is not None and seen[-1] is False, "a plain training forward is not a recomputation"
    assert route.recompute(0.0) is False


def test_compiled_math_route_inside_enable_traces_without_reading_fake_tensors():
    """torch.compile traces F.sdpa's math composite through the counting kernel on the autograd key
    with fake tensors: the kernel must pass them through (no data pointer to read) instead of
    failing the compile. The compiled call runs the decomposed math ops: nothing of ours runs."""
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    before = counters.stats()
    with csp.enable(), sdpa_kernel(SDPBackend.MATH):
        compiled = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                                 backend="aot_eager")
        out = compiled(q)
        out.sum().backward()
    want = F.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), is_causal=True)
    assert torch.allclose(out.detach(), want, atol=1e-6)
    assert (counters.stats() - before).to_dict()["dense_fwd"] == {"served": 0, "fallback": {}}


class _Recording:
    """PyTorch's kernel, as a fallback reaches it: records the tensors it was given."""

    def __init__(self, backward=False):
        self.args, self.backward = [], backward

    def call_boxed(self, keyset, *args, **kwargs):
        self.args.append(args)
        if self.backward:
            return tuple(torch.zeros_like(t) for t in args[1:4])
        q = args[0]
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[:3] + (1,))
        return out, lse, None, None, q.shape[2], args[1].shape[2], torch.zeros((), dtype=torch.int64), \
            torch.zeros((), dtype=torch.int64), None


def test_a_fallback_hands_pytorchs_cudnn_kernel_aligned_copies_of_misaligned_operands(cuda_like):
    """PyTorch's cuDNN kernel misreads a base or rows that are not 16-byte aligned (GPU run 24): the
    cuDNN op's fallback gets copies of those, in their dimension order; aligned operands as given."""
    base = torch.randn(2 * 2 * 8 * 8 + 1)
    q = base[1:].view(2, 2, 8, 8)  # base one element in
    wide = torch.randn(2, 2, 8, 12)
    k = wide[..., :8]  # rows of 12 floats: 48 bytes, aligned; and v rows of 10: 40 bytes, not
    v = torch.randn(2, 2, 8, 10)[..., :8]
    assert q.data_ptr() % 16 and layout.misaligned(v) and not layout.misaligned(k)
    fwd, bwd = _Recording(), _Recording(backward=True)
    kernels = overrides._Dense(fwd, bwd)
    before = counters.stats()
    result = kernels.forward(None, q, k, v, None, True, 0.0, False, True, scale=None)  # return_debug_mask
    got_q, got_k, got_v = fwd.args[0][:3]
    assert got_k is k and got_q is not q and got_v is not v
    assert torch.equal(got_q, q) and torch.equal(got_v, v) and got_q.data_ptr() % 16 == 0
    assert not layout.misaligned(got_v) and got_v.stride(-1) == 1
    go = torch.randn(2, 2, 8, 8).transpose(2, 3).contiguous().transpose(2, 3)[1:2].expand(2, 2, 8, 8)
    kernels.backward(None, go, q, k, v, result[0], result[1], result[6], result[7], None, None, None, 8, 8, 0.0, False,
                     scale=None)
    do, bq, bk, bv = bwd.args[0][:4]
    assert bk is k and torch.equal(bq, q) and bq.data_ptr() % 16 == 0 and not layout.misaligned(bv)
    assert do is go  # expanded, aligned: as given
    region = counters.stats() - before
    assert region.fallback["dense_fwd"] == {"unsupported_argument": 1}
    assert sum(region.fallback["dense_bwd"].values()) == 1


def test_a_backward_of_a_forward_outside_the_provider_gets_its_operands_as_given():
    base = torch.randn(2 * 2 * 8 * 8 + 1)
    q = base[1:].view(2, 2, 8, 8)
    bwd = _Recording(backward=True)
    kernels = overrides._Dense(_Original(), bwd)
    lse = torch.zeros(2, 2, 8, 1)  # unmarked: its forward did not run through the provider
    kernels.backward(None, torch.randn(2, 2, 8, 8), q, q, q, torch.randn(2, 2, 8, 8), lse, None, None, None, None,
                     None, 8, 8, 0.0, False, scale=None)
    assert bwd.args[0][1] is q
