"""CPU tier: a call the known-issues table keeps off cuDNN is kept off PyTorch's own cuDNN kernels too.

PyTorch's cuDNN kernels run on the same cuDNN as our graphs: on cuDNN 9.28.1 PyTorch's own cuDNN
backward segfaults at the NVIDIA/cudnn-frontend#1071 shape (GPU run 51, results/gpu-runs.md), so the
F.sdpa override's usual fallback (the kernel it replaced) would take the process with it. Such a
call runs on the aten composite instead: these tests hand the overrides a "PyTorch kernel" that fails
if called, on a fake cuDNN 9.28.1 H200, and check the composite's answer against the fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

from cudnn_sdpa_provider.core import counters, markers, support
from cudnn_sdpa_provider.engine import graphs
from cudnn_sdpa_provider.hooks import overrides, varlen_hooks
from cudnn_sdpa_provider.ops import composite, reference, route
from tests import fake_cudnn
from tests.util import assert_rel_close

H200_928 = support.with_version(support.Capabilities(cuda=True, compute_capability=(9, 0), cudnn_version=91900,
                                                     device_name="H200"), 92801)


@pytest.fixture
def cudnn_928(monkeypatch):
    """CPU float32 tensors decided as on an H200 with cuDNN 9.28.1 (no_cuda and dtype rules left out)."""
    fake_cudnn.install(monkeypatch, H200_928)
    monkeypatch.setattr(support, "RULES", tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype")))
    route.clear()
    yield
    route.clear()
    graphs.clear_cache()


class _Crashes:
    """PyTorch's kernel at a known-bad configuration: reaching it would be the segfault."""

    def call_boxed(self, *args, **kwargs):
        raise AssertionError("PyTorch's cuDNN kernel was called at a known-bad configuration")


def _decode(h=1):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, 1, 64, generator=gen)
    k, v = torch.randn(1, h, 128, 64, generator=gen), torch.randn(1, h, 128, 64, generator=gen)
    return q, k, v, torch.randn(1, h, 1, 64, generator=gen)


def test_sdpa_backward_at_the_1071_shape_runs_on_the_composite(cudnn_928):
    q, k, v, go = _decode()
    kernels = overrides._Dense(_Crashes(), _Crashes())
    before = counters.stats()
    result = kernels.forward(None, q, k, v, None, True, 0.0, False, False, scale=None)  # served (a forward)
    assert markers.lookup(result[1]).served
    dq, dk, dv = kernels.backward(None, go, q, k, v, result[0], result[1], result[6], result[7], None, None, None, 1,
                                  128, 0.0, False, scale=None)
    want = reference.dense_backward(go.double(), q.double(), k.double(), v.double(), scale=0.125,
                                    compute_dtype=torch.float64)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_rel_close(got, ref, 1e-5, name)
    region = counters.stats() - before
    assert region.served["dense_fwd"] == 1
    assert region.fallback["dense_bwd"] == {"cudnn_known_issue": 1}


def test_sdpa_with_dropout_at_the_1071_shape_runs_both_passes_on_the_composite_with_one_mask(cudnn_928):
    q, k, v, go = _decode()
    kernels = overrides._Dense(_Crashes(), _Crashes())
    before = counters.stats()
    result = kernels.forward(None, q, k, v, None, True, 0.5, False, False, scale=None)
    record = markers.lookup(result[1])
    assert not record.served and record.reason == "cudnn_known_issue"
    dq, dk, dv = kernels.backward(None, go, q, k, v, result[0], result[1], result[6], result[7], None, None, None, 1,
                                  128, 0.5, False, scale=None)
    # the mask both passes used is the composite's, a function of the philox pair the forward returned
    mask = composite._composite_dropout_mask(torch.stack([result[6], result[7]]), 0.5, q, k)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = reference.dense(*leaves, scale=0.125, dropout_p=0.5, dropout_mask=mask, compute_dtype=torch.float64)
    assert_rel_close(result[0], out.detach(), 1e-5, "out")
    out.backward(go.double())
    for name, got, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert_rel_close(got, leaf.grad, 1e-5, name)
    region = counters.stats() - before
    assert region.fallback["dense_fwd"] == {"cudnn_known_issue": 1}
    assert region.fallback["dense_bwd"] == {"cudnn_known_issue": 1}


def test_sdpa_outside_the_rows_still_falls_back_to_pytorchs_kernel(cudnn_928):
    """Only the table's rows avoid PyTorch's kernel: any other fallback is still the kernel it replaced."""
    calls = []

    class _Original:
        def call_boxed(self, *args, **kwargs):
            calls.append(args)
            q = args[1]
            return (torch.zeros_like(q), torch.zeros(q.shape[:3] + (1,)), None, None, q.shape[2], args[2].shape[2],
                    torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), None)

    q, k, v, _ = _decode(h=2)
    overrides._Dense(_Original(), _Crashes()).forward(None, q, k, v, None, True, 0.0, False, True, scale=None)
    assert len(calls) == 1  # return_debug_mask: unsupported_argument, PyTorch's kernel


def test_varlen_backward_at_the_1071_shape_runs_on_the_composite(cudnn_928):
    ops = varlen_hooks.varlen_ops()
    if ops is None or ops["_varlen_attn"] is None:
        pytest.skip("this torch has no torch_attn varlen ops")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 64, generator=gen)
    k, v = torch.randn(128, 1, 64, generator=gen), torch.randn(128, 1, 64, generator=gen)
    go = torch.randn(1, 1, 64, generator=gen)
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    cu_k = torch.tensor([0, 128], dtype=torch.int32)
    hooks = varlen_hooks.Varlen(ops["_varlen_attn"], _Crashes(), ops["_varlen_attn_backward"], _Crashes())
    args = dict(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=1, max_k=128, is_causal=False)
    before = counters.stats()
    out, lse, rng = hooks.forward(None, **args)
    grads = hooks.backward(None, grad_out=go, out=out, lse=lse, rng_state=rng, **args)
    want = reference.varlen_backward(go.double(), q.double(), k.double(), v.double(), cu_q, cu_k, 1, 128, scale=0.125,
                                     compute_dtype=torch.float64)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert_rel_close(got, ref, 1e-5, name)
    region = counters.stats() - before
    assert region.fallback["varlen_bwd"] == {"cudnn_known_issue": 1}
