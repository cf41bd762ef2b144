"""GPU tier: ``CUDNN_SDPA_PROVIDER_AUTOTUNE=1`` on real cuDNN graphs. Every graph built under it is
tuned on its first call (``Plan.tune`` cleared), the served results match the fp32 reference and
native PyTorch cuDNN's on the same inputs, and a tuned graph captured into a CUDA graph after
its warm-up, running a plan other than the heuristic's, replays right."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, env
from cudnn_sdpa_provider.engine import graphs, tuning
from cudnn_sdpa_provider.ops import reference
from tests.util import TOL, assert_rel_close, grad_tol, make_dense, poison_allocator

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture
def autotune(monkeypatch):
    """Autotune on, and every tuning (on any thread: backwards run on autograd's) recorded by label."""
    if not graphs._ORDERED:
        pytest.skip("autotune needs frontend 1.31+ (execute by plan index with ordered buffers)")
    monkeypatch.setenv(env.AUTOTUNE, "1")
    graphs.clear_cache()
    tuned = []
    real = tuning.tune

    def recorded(p, *args, **kwargs):
        real(p, *args, **kwargs)
        tuned.append((p.label, p.index, p.name))

    monkeypatch.setattr(tuning, "tune", recorded)
    yield tuned
    graphs.clear_cache()


def _plans():
    return list(graphs._state()["plans"].values())  # this thread's: the forward graphs


def _run(q, k, v, go, native=False):
    gqa = q.shape[1] != k.shape[1]
    for t in (q, k, v):
        t.grad = None
    poison_allocator(DEV)
    before = counters.stats()
    if native:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        with csp.enable():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.backward(go)
    delta = counters.stats() - before
    served = (0, 0) if native else (1, 1)
    assert (delta.served["dense_fwd"], delta.served["dense_bwd"]) == served, delta.to_dict()
    return out.detach().clone(), [t.grad.clone() for t in (q, k, v)]


@pytest.mark.parametrize("shape", [(1, 8, 2, 2048, 128), (2, 4, 4, 1024, 64)], ids=["gqa", "mha"])
def test_autotuned_plans_match_the_reference_native_cudnn_and_the_heuristics_plans(autotune, shape, monkeypatch):
    b, h_q, h_k, s, d = shape
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = make_dense(b, h_q, h_k, h_k, s, s, d, d, torch.bfloat16, DEV, gen=gen)
    go = torch.randn(b, h_q, s, d, device=DEV, generator=gen, dtype=torch.bfloat16)
    out, grads = _run(q, k, v, go)
    again, grads_again = _run(q, k, v, go)  # the chosen plans, run by index from now on
    labels = [label for label, _, _ in autotune]
    # each graph tuned once, on its first call (the second run tuned nothing)
    assert len(labels) == 2 and labels[0].startswith("fwd") and labels[1].startswith("bwd"), autotune
    assert all(not p.tune for p in _plans())

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.dense(*leaves, scale=1 / math.sqrt(d), window=(-1, 0))
    ref_out.backward(go.float())
    native, native_grads = _run(q, k, v, go, native=True)  # PyTorch's own cuDNN kernels, same inputs
    for got, grad in ((out, grads), (again, grads_again), (native, native_grads)):
        assert_rel_close(got, ref_out, TOL[torch.bfloat16], "out")
        assert_rel_close(grad[0], leaves[0].grad, grad_tol(torch.bfloat16), "dq")
        assert_rel_close(grad[1], leaves[1].grad, grad_tol(torch.bfloat16, h_q // h_k), "dk")
        assert_rel_close(grad[2], leaves[2].grad, grad_tol(torch.bfloat16, h_q // h_k), "dv")
    assert_rel_close(again, native, TOL[torch.bfloat16], "out vs native cuDNN")
    for name, a, n in zip(("dq", "dk", "dv"), grads_again, native_grads):
        assert_rel_close(a, n, grad_tol(torch.bfloat16, h_q // h_k), f"{name} vs native cuDNN")

    monkeypatch.setenv(env.AUTOTUNE, "0")  # the heuristic's plans (clear_cache reaches autograd's thread)
    graphs.clear_cache()
    tuned, built = len(autotune), graphs.cache_info()["built"]
    plain, plain_grads = _run(q, k, v, go)
    assert graphs.cache_info()["built"] == built + 2, "the clear reached the backward's thread: both rebuilt"
    assert len(autotune) == tuned and all(p.index is None and not p.tune for p in _plans())
    assert_rel_close(again, plain, TOL[torch.bfloat16], "out vs the heuristic's plan")
    for name, a, n in zip(("dq", "dk", "dv"), grads_again, plain_grads):
        assert_rel_close(a, n, grad_tol(torch.bfloat16, h_q // h_k), f"{name} vs the heuristic's plan")


def test_a_tuned_graph_captured_after_its_warm_up_replays_right(autotune, monkeypatch):
    # Any plan that agrees with the heuristic's counts as faster: the graph then runs another plan
    # by index, inside the capture too (unless the heuristic's is the only one that runs).
    monkeypatch.setattr(tuning, "MIN_GAIN", -1e9)
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v = (torch.randn(1, 4, 512, 64, device=DEV, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    with csp.enable():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: the graph is built and tuned here
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (plan,) = _plans()
        assert not plan.tune and len(autotune) == 1
        assert plan.index is not None or plan.graph.get_execution_plan_count() < 2, autotune
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.current_stream().wait_stream(stream)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    ref, _ = reference.dense(q.float(), k.float(), v.float(), scale=1 / 8, window=(-1, 0))
    assert_rel_close(out, ref, TOL[torch.bfloat16], "replayed out")
