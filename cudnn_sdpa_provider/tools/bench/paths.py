"""What each path runs and inside which scope: the step function of a (case, mode, path), the
scopes (provider enabled, a native backend forced, the transformers integration registered, the
counters around an FP8 path, a peer's), and the capture of the graphed training step. The paths
are listed in ``cases``; the fp8 cases' own are in ``fp8_case``."""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from ...hooks import activation
from ...core import counters
from ...integrations.transformers import DEFAULT_NAME as _HF_NAME
from . import fp8_case
from .cases import Case, audited
from .inputs import HFSet, StepSet
from .report import Measurement

__all__ = ["step", "scope", "capture", "GRAPH_WARMUP_STEPS", "HF_IMPLEMENTATION"]

GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before capture: every cuDNN graph is built by then
_BACKENDS = {"native_cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
#: hf_llama paths: the ``attn_implementation`` each one's model is built with.
HF_IMPLEMENTATION = {"native": "sdpa", "provider": "sdpa", "provider_hf": _HF_NAME}


def _varlen_kwargs(fn, causal: bool) -> dict:
    # torch 2.11+ folds is_causal into window_size ((-1, 0) is causal; compared as a tuple).
    if "window_size" in inspect.signature(fn).parameters:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    return {"is_causal": causal}


def _attn(case: Case, path: str) -> Callable:
    sdpa, causal, gqa = F.scaled_dot_product_attention, case.causal, case.gqa
    if case.kind == "fp8":
        return fp8_case.attn(case, path)
    if case.kind == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        kw, m = _varlen_kwargs(varlen_attn, case.causal), case.seq
        return lambda s, q, k, v: varlen_attn(q, k, v, s.cu, s.cu, m, m, **kw)
    if case.kind == "padded" and path == "provider":
        from ...functional import attention

        return lambda s, q, k, v: attention(q, k, v, is_causal=causal, seq_lens_q=s.lens, seq_lens_kv=s.lens)
    if case.kind == "padded":
        return lambda s, q, k, v: sdpa(q, k, v, attn_mask=s.mask, enable_gqa=gqa)
    return lambda s, q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)


def _train_step(s: StepSet) -> None:
    logits = s.model(s.tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), s.tokens[:, 1:].flatten()).backward()  # grads accumulate


def _hf_step(impl: str) -> Callable:
    def train_step(s: HFSet) -> None:
        model = s.model(impl)
        model(input_ids=s.ids, attention_mask=s.mask, labels=s.labels).loss.backward()  # grads accumulate

    return train_step


def step(case: Case, mode: str, path: str) -> Callable:
    """The function one call of the path runs, given one input set."""
    if case.kind == "step":
        return _train_step
    if case.kind == "hf_llama":
        return _hf_step(HF_IMPLEMENTATION[path])
    attn = _attn(case, path)
    if mode == "fwd":
        return lambda s: attn(s, s.qd, s.kd, s.vd)

    def fwd_bwd(s):
        torch.autograd.grad(attn(s, s.q, s.k, s.v), (s.q, s.k, s.v), s.g)

    return fwd_bwd


def capture(s: StepSet) -> tuple[Callable, object, int]:
    """Warm-up steps on a side stream (builds every cuDNN graph), then one step captured in a CUDA
    graph. Returns (the replay step, what it needs kept alive, the steps that ran through Python).

    The form of tests/gpu/test_cuda_graphs.py: a model of its own (a copy with the same weights,
    whose autograd has never run on another stream; the other paths' eager steps ran on the
    default stream), gradients set to None before each warm-up step and before capture (the
    captured backward allocates them from the graph's pool), capture on the warm-up's stream."""
    own = copy.copy(s)
    own.model = copy.deepcopy(s.model)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_STEPS):
            own.model.zero_grad(set_to_none=True)
            _train_step(own)
    torch.cuda.current_stream().wait_stream(side)
    own.model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        _train_step(own)
    return (lambda _s: graph.replay()), (graph, own), GRAPH_WARMUP_STEPS + 1


@contextlib.contextmanager
def _counted(m: Measurement):
    """Adds the counters' diff over the block to ``m`` (served, and fallbacks by reason)."""
    before = counters.stats()
    try:
        yield
    finally:
        for p in (counters.stats() - before).to_dict().values():
            m.served += p["served"]
            for reason, n in p["fallback"].items():
                m.fallback[reason] = m.fallback.get(reason, 0) + n


@contextlib.contextmanager
def _provider_scope(m: Measurement):
    with _counted(m), activation.enable():
        yield


@contextlib.contextmanager
def _integration_scope(m: Measurement):
    """attn_implementation="cudnn" registered with transformers (provider not enabled), counted."""
    from ...integrations import transformers as csp_hf

    registration = csp_hf.register(HF_IMPLEMENTATION["provider_hf"])
    try:
        with _counted(m):
            yield
    finally:
        registration.remove()


def scope(m: Measurement, peers: dict):
    """The context manager the path's calls run in; ``peers``: {name: () -> context manager}."""
    if m.path in peers:
        return peers[m.path]()
    if m.path == "provider_hf":
        return _integration_scope(m)
    if m.path.startswith("provider"):
        return _provider_scope(m)
    if audited(m.path):  # fp8_*: csp.fp8 needs no enable(); its calls are counted
        return _counted(m)
    if m.path in _BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, _BACKENDS[m.path]))
    return contextlib.nullcontext()
