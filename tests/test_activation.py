"""CPU tier: enable()/disable(), SDP flag and priority restore, what F.sdpa records on CPU, strict mode."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.hooks import activation
from cudnn_sdpa_provider.core import counters

CUDNN = int(SDPBackend.CUDNN_ATTENTION)
FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH_OP = "aten::_scaled_dot_product_attention_math"


def sdp_state():
    return torch.backends.cuda.cudnn_sdp_enabled(), list(torch._C._get_sdp_priority_order())


def ours_registered(op: str) -> bool:
    return "cudnn_sdpa_provider" in torch._C._dispatch_dump(op)


def fallbacks(before: counters.Stats) -> dict:
    """The region's non-empty paths as {path: {reason: n}}; nothing here may be served on CPU."""
    d = (counters.stats() - before).to_dict()
    assert all(entry["served"] == 0 for entry in d.values()), d
    return {p: entry["fallback"] for p, entry in d.items() if entry["fallback"]}


@pytest.fixture(autouse=True)
def _provider_off():
    state = sdp_state()
    assert not csp.enabled(), "a previous test left the provider enabled"
    yield
    while csp.disable():
        pass
    assert sdp_state() == state, "SDP flags/priority not restored"


def qkv(shape=(2, 4, 16, 8), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


def fwd_bwd(q, k, v, **kw):
    """F.sdpa forward + backward; returns (out, grads) detached, and the recorded fallbacks."""
    for t in (q, k, v):
        t.grad = None
    before = counters.stats()
    torch.manual_seed(1234)  # dropout draws the same mask everywhere
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(torch.ones_like(out))
    return (out.detach(), [t.grad.clone() for t in (q, k, v)]), fallbacks(before)


# ------------------------------------------------------------------------------ enable/disable


def test_context_manager_enables_and_restores():
    assert not csp.enabled() and not activation.strict()
    with csp.enable() as act:
        assert csp.enabled() and not activation.strict()
        assert act.active and not act.strict
        assert repr(act) == "Activation(strict=False, active=True)"
    assert not csp.enabled() and not act.active


def test_plain_call_and_disable():
    act = csp.enable()
    try:
        assert csp.enabled() and act.active
    finally:
        assert csp.disable() is True
    assert not csp.enabled() and not act.active
    assert csp.disable() is False, "nothing left to disable"


def test_nesting_inner_strict_outer_not():
    with csp.enable():
        assert not activation.strict()
        with csp.enable(strict=True):
            assert csp.enabled() and activation.strict()
        assert csp.enabled() and not activation.strict(), "the outer activation is live again"
    assert not csp.enabled()


def test_removal_out_of_order():
    outer = csp.enable()
    inner = csp.enable(strict=True)
    outer.remove()
    assert csp.enabled() and activation.strict()
    outer.remove()  # removing twice is harmless
    assert csp.enabled()
    inner.remove()
    assert not csp.enabled()


def test_disable_undoes_the_most_recent():
    outer = csp.enable()
    inner = csp.enable(strict=True)
    assert csp.disable()
    assert outer.active and not inner.active and not activation.strict()
    assert csp.disable() and not csp.enabled()


def test_exception_inside_with_removes_and_propagates():
    with pytest.raises(KeyError, match="boom"):
        with csp.enable(strict=True):
            raise KeyError("boom")
    assert not csp.enabled() and not activation.strict()


@pytest.mark.parametrize("strict", ["yes", 1, None, 0.0])
def test_strict_must_be_bool(strict):
    with pytest.raises(TypeError, match=f"strict must be a bool \\(True or False\\), got {type(strict).__name__}"):
        csp.enable(strict=strict)
    assert not csp.enabled()


# ---------------------------------------------------------------------------- SDP flags/priority


def test_cudnn_first_inside_and_restored_exactly():
    before = sdp_state()
    with csp.enable():
        enabled, order = sdp_state()
        assert enabled and order[0] == CUDNN
        assert sorted(order) == sorted(before[1]), "same backends, cuDNN moved first"
        assert [b for b in order if b != CUDNN] == [b for b in before[1] if b != CUDNN], "others keep their order"
        with csp.enable(strict=True):
            assert sdp_state() == (enabled, order)
        assert sdp_state() == (enabled, order), "an inner exit does not restore"
    assert sdp_state() == before


def test_user_backend_flags_win_and_custom_priority_is_restored():
    saved = sdp_state()
    custom = list(reversed(saved[1]))
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch._C._set_sdp_priority_order(custom)
    try:
        with csp.enable():
            assert not torch.backends.cuda.cudnn_sdp_enabled(), "the user's restriction is never overridden"
            assert torch._C._get_sdp_priority_order()[0] == CUDNN
        assert sdp_state() == (False, custom)
        act = csp.enable()
        csp.disable()
        assert not act.active and sdp_state() == (False, custom), "plain call + disable() restores too"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved[0])
        torch._C._set_sdp_priority_order(saved[1])


def test_kernels_registered_only_while_enabled():
    assert not ours_registered(FLASH_CPU_OP) and not ours_registered(MATH_OP)
    with csp.enable():
        assert ours_registered(FLASH_CPU_OP) and ours_registered(MATH_OP)
        with csp.enable():
            assert ours_registered(FLASH_CPU_OP)
        assert ours_registered(FLASH_CPU_OP)
    assert not ours_registered(FLASH_CPU_OP) and not ours_registered(MATH_OP)
    assert not activation._hooks.backward_active, "no served forward is pending on CPU"


# ----------------------------------------------------------------------- what F.sdpa records on CPU

NO_CUDA_BOTH = {"dense_fwd": {"no_cuda": 1}, "dense_bwd": {"no_cuda": 1}}

ROUTES = [
    pytest.param(None, {}, (2, 4, 16, 8), id="flash_cpu"),
    pytest.param(None, dict(is_causal=True), (2, 4, 16, 8), id="flash_cpu_causal"),
    pytest.param(None, dict(dropout_p=0.3), (2, 4, 16, 8), id="flash_cpu_dropout"),
    pytest.param(None, dict(attn_mask=torch.linspace(-2, 2, 256).view(16, 16)), (2, 4, 16, 8), id="flash_cpu_float_mask"),
    pytest.param(None, dict(attn_mask=torch.ones(16, 16, dtype=torch.bool).tril()), (2, 4, 16, 8), id="flash_cpu_bool_mask"),
    pytest.param(SDPBackend.MATH, {}, (2, 4, 16, 8), id="math"),
    pytest.param(SDPBackend.MATH, dict(is_causal=True), (2, 4, 16, 8), id="math_causal"),
    pytest.param(SDPBackend.MATH, dict(dropout_p=0.3), (2, 4, 16, 8), id="math_dropout"),
    pytest.param(SDPBackend.MATH, dict(enable_gqa=True), None, id="math_gqa"),
    pytest.param(None, {}, (2, 3, 4, 16, 8), id="five_dims"),
    pytest.param(None, {}, (4, 16, 8), id="three_dims"),  # F.sdpa sends 3-D inputs to the math kernel
]


def run_route(backend, kw, shape):
    q, k, v = qkv(shape or (2, 4, 16, 8))
    if shape is None:  # GQA: 4 query heads over 2 key/value heads
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    if backend is None:
        return fwd_bwd(q, k, v, **kw)
    with sdpa_kernel(backend):
        return fwd_bwd(q, k, v, **kw)


@pytest.mark.parametrize("backend, kw, shape", ROUTES)
def test_cpu_calls_fall_back_no_cuda_and_are_bit_exact(backend, kw, shape):
    (out_a, grads_a), outside = run_route(backend, kw, shape)
    with csp.enable():
        (out_b, grads_b), inside = run_route(backend, kw, shape)
    (out_c, grads_c), after = run_route(backend, kw, shape)
    assert inside == NO_CUDA_BOTH
    assert outside == {} and after == {}, "nothing is counted outside the scope"
    for a, b, c in zip([out_a] + grads_a, [out_b] + grads_b, [out_c] + grads_c):
        assert torch.equal(a, b) and torch.equal(a, c), "a fallback runs PyTorch's own kernel"


def test_no_grad_forward_counts_forward_only():
    q, k, v = qkv()
    before = counters.stats()
    with csp.enable(), torch.no_grad():
        F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, v)
    assert fallbacks(before) == {"dense_fwd": {"no_cuda": 2}}


def test_calls_on_other_threads_are_counted():
    q, k, v = qkv()
    before = counters.stats()
    with csp.enable():
        worker = threading.Thread(target=lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
        worker.start()
        worker.join()
    assert fallbacks(before) == NO_CUDA_BOTH


BACKENDS = [pytest.param(SDPBackend.MATH, id="math"), pytest.param(SDPBackend.FLASH_ATTENTION, id="flash_cpu")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_after_scope_exit_is_counted(backend):
    """DESIGN: a backward follows its forward, whether or not the scope has exited."""
    q, k, v = qkv()
    before = counters.stats()
    with sdpa_kernel(backend):
        with csp.enable():
            out = F.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    assert fallbacks(before) == NO_CUDA_BOTH


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_of_a_forward_outside_the_scope_is_not_counted(backend):
    q, k, v = qkv()
    before = counters.stats()
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v)
        with csp.enable():
            out.sum().backward()
    assert fallbacks(before) == {}


# ------------------------------------------------------------------------------------- strict


def test_strict_raises_fallback_error_with_inputs_and_reason():
    q, k, v = qkv((2, 4, 8, 16))
    before = counters.stats()
    with csp.enable(strict=True):
        with pytest.raises(csp.FallbackError) as info:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = info.value
    assert err.path == "dense_fwd" and err.reasons == ["no_cuda"]
    text = str(err)
    assert text.startswith("cudnn-sdpa-provider (strict): dense_fwd would fall back; reasons: no_cuda")
    for piece in ("query=(2, 4, 8, 16)", "key=(2, 4, 8, 16)", "value=(2, 4, 8, 16)", "float32",
                  "stride=(512, 128, 16, 1)", "cpu", "is_causal=True"):
        assert piece in text, (piece, text)
    region = counters.stats() - before
    assert fallbacks(before) == {"dense_fwd": {"no_cuda": 1}}, "the audit shows what was refused and why"
    assert region.refused_dict() == {"dense_fwd": {"no_cuda": 1}}
    assert "no_cuda=1 (refused 1)" in counters.format_table(region)


def test_strict_raises_on_the_math_route():
    q, k, v = qkv()
    with csp.enable(strict=True), sdpa_kernel(SDPBackend.MATH):
        with pytest.raises(csp.FallbackError, match="no_cuda"):
            F.scaled_dot_product_attention(q, k, v)


def test_strict_is_per_thread():
    """Thread A's strict scope makes A's fallbacks raise; thread B, in its own lenient scope at the
    same time, falls back and counts."""
    barrier = threading.Barrier(2, timeout=30)
    results = {}

    def run(name, strict):
        q, k, v = qkv((1, 2, 8, 8), seed=3)
        with csp.enable(strict=strict):
            barrier.wait()  # both scopes are open now
            try:
                F.scaled_dot_product_attention(q, k, v)
                results[name] = "ran"
            except csp.FallbackError as exc:
                results[name] = exc.reasons
            barrier.wait()

    before = counters.stats()
    threads = [threading.Thread(target=run, args=("strict", True)), threading.Thread(target=run, args=("lenient", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"strict": ["no_cuda"], "lenient": "ran"}
    region = counters.stats() - before
    assert region.fallback["dense_fwd"] == {"no_cuda": 2} and region.refused_dict() == {"dense_fwd": {"no_cuda": 1}}


def test_thread_without_a_scope_takes_process_wide_strictness():
    q, k, v = qkv((1, 2, 8, 8))
    seen = {}

    def call():
        try:
            F.scaled_dot_product_attention(q, k, v)
            seen["result"] = "ran"
        except csp.FallbackError:
            seen["result"] = "refused"

    for process_wide, expected in ((False, "ran"), (True, "refused")):
        with csp.enable(strict=True, process_wide=process_wide):
            t = threading.Thread(target=call)
            t.start()
            t.join()
        assert seen["result"] == expected, process_wide


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_follows_a_lenient_forward_into_a_strict_scope(backend):
    """A backward decides from what its forward saved, never from the scope it runs in."""
    q, k, v = qkv()
    before = counters.stats()
    with sdpa_kernel(backend), csp.enable():
        out = F.scaled_dot_product_attention(q, k, v)
        with csp.enable(strict=True):
            out.sum().backward()
    assert fallbacks(before) == NO_CUDA_BOTH


def test_fallback_error_pickles():
    import pickle

    err = csp.FallbackError("dense_fwd", ["no_cuda"], "q=(1,)", ["inputs are on 'cpu'"])
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.path, copy.reasons, copy.inputs, copy.details, str(copy)) == (
        err.path, err.reasons, err.inputs, err.details, str(err))
    nse = pickle.loads(pickle.dumps(csp.NotSupportedError("no_cuda", "cpu")))
    assert (nse.reason, nse.detail, str(nse)) == ("no_cuda", "cpu", "[no_cuda] cpu")


def test_a_removal_inside_a_users_priority_context_keeps_their_order():
    """enable(), then the user's sdpa_kernel(set_priority=True), then the activation removed inside the
    block: the user's order is left as they set it. (On leaving the block PyTorch's context manager
    puts back what it saw on entry, the provider's order; docs/ways-in.md says so.)"""
    before = sdp_state()
    act = csp.enable()
    mine = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(mine, set_priority=True):
            theirs = list(torch._C._get_sdp_priority_order())
            act.remove()
            assert list(torch._C._get_sdp_priority_order()) == theirs, "the user's order is not clobbered"
    finally:
        torch._C._set_sdp_priority_order(before[1])


def test_enable_that_fails_leaves_nothing_applied(monkeypatch):
    from cudnn_sdpa_provider.hooks import backends

    before = sdp_state()

    def boom(self):
        raise RuntimeError("boom in coexistence")

    monkeypatch.setattr(activation, "_report_coexistence", lambda: boom(None))
    with pytest.raises(RuntimeError, match="boom"):
        csp.enable()
    assert not csp.enabled() and sdp_state() == before
    assert not activation._hooks.forward_active
    assert isinstance(activation._priority, backends.PriorityGuard)
