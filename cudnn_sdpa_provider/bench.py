"""``cudnn-sdpa bench``: the provider timed side by side with PyTorch's native attention paths.

Data only; ``cli`` prints. ``run()`` returns one ``Row`` per (case, mode, path). Every path of a
case is measured in ONE process on the SAME random bf16 inputs (fresh per case, never zeros), in
ABBA order (half the repeats in path order, half reversed) so clock drift does not favour a path.

Paths:
  provider       F.sdpa / varlen_attn inside ``cudnn_sdpa_provider.enable()``
  native_cudnn   provider off, ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` (PyTorch's C++ cuDNN path)
  flash          provider off, ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
  efficient      provider off, ``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``
  native_varlen  provider off, ``varlen_attn`` (FlashAttention varlen in torch 2.11-2.13)
Padded cases (a right-padded causal batch, as Hugging Face models pass it):
  provider       ``csp.attention`` with per-sequence lengths (cuDNN skips the padded tiles)
  provider_bias  F.sdpa with the boolean padding+causal mask inside ``enable()`` (a cuDNN bias graph)
  native_cudnn, efficient   F.sdpa with the same mask, provider off, that backend forced
  native                    the same, PyTorch choosing the backend (what a model gets by default)
Step cases (a training step of ``demo.TinyGQA``: forward, loss, backward; fwd_bwd only):
  provider, native          eager steps (native: provider off, PyTorch choosing the backend)
  provider_graphed          the same step captured once in a CUDA graph under the provider (after
                            warm-up steps that build every cuDNN graph), then ``graph.replay()``
A path PyTorch cannot run at a case (efficient with GQA, ...) is ``skipped`` with PyTorch's reason.

Modes: ``fwd`` (inference: inputs do not require grad, so no logsumexp is computed) and ``fwd_bwd``
(forward, then ``torch.autograd.grad`` with a random grad_out; nothing accumulates into ``.grad``).

Row metrics:
  median_ms, p20_ms, p80_ms  CUDA-event time of one call, over ``repeats`` timed calls after warm-up;
                             input sets rotate so a call never reads inputs the previous one left in L2
  tflops          flops(case, mode) / median: forward 4*B*H_q*S_q*S_kv*D, halved when causal (varlen and
                  padded: summed over the real lengths); fwd_bwd counts 3.5x forward (FACTS.md section 2);
                  none for step cases (a step is more than attention)
  vs_native       baseline median / this median, >1 = faster; baseline native_cudnn (varlen:
                  native_varlen; padded: native_cudnn, else native if cuDNN declined; step: native)
  peak_mib        peak memory allocated during one call above what was allocated before it (inputs)
  inputs_mib      one input set: q, k, v (and grad_out for fwd_bwd)
  host_us         host-cost cases: wall time per call of ``host_calls`` back-to-back calls, no sync
                  inside the loop, one at the end
  host_vs_native  baseline host_us / this host_us, >1 = cheaper on the host
  calls, served, fallbacks, fallback_reasons
                  provider rows: calls made and the counters' diff over them. A provider row is "ok"
                  only if every attention call (forward and backward) made through Python was served
                  (``expected``: graph replays run no Python, so only the warm-up and capture steps
                  count); otherwise its status is "fallback" or "unserved" and its numbers are not
                  the provider's.
Status: ok | skipped (PyTorch cannot run the path) | fallback | unserved | error (exception; reason).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import json
import math
import platform
import random
import re
import shlex
import statistics
import sys
import traceback
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from time import perf_counter
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from . import activation, counters, support

__all__ = ["Case", "Row", "Measurement", "Preset", "BenchError", "MATRIX", "MODES", "DEFAULT", "QUICK", "select",
           "quick_matrix", "check_modes", "check_settings", "fwd_flops", "flops", "summarize", "add_ratios", "run",
           "collect_meta", "to_json", "format_table", "plot", "require_matplotlib"]

MODES = ("fwd", "fwd_bwd")
DENSE_PATHS = ("provider", "native_cudnn", "flash", "efficient")
VARLEN_PATHS = ("provider", "native_varlen")
PADDED_PATHS = ("provider", "provider_bias", "native_cudnn", "native", "efficient")
STEP_PATHS = ("provider", "provider_graphed", "native")
_PATHS = {"dense": DENSE_PATHS, "varlen": VARLEN_PATHS, "padded": PADDED_PATHS, "step": STEP_PATHS}
#: Each kind's baselines for ``vs_native``, in order of preference (the first one that ran).
BASELINE = {"dense": ("native_cudnn",), "varlen": ("native_varlen",), "padded": ("native_cudnn", "native"),
            "step": ("native",)}
#: Extra paths for dense and varlen cases, {name: () -> context manager}, set for one ``run(peers=...)``
#: (scripts/bench_peer.py times nvidia's ``cudnn.torch`` this way; the package never imports it).
_PEERS: dict = {}
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before capture: every cuDNN graph is built by then
BWD_FACTOR = 3.5  # fwd+bwd = 3.5x forward flops (FACTS.md section 2: 2 matmuls forward, 5 backward)
ROTATE_BYTES = 256 << 20  # input sets rotate until they span this much: > 5x the 50 MB L2 of an H100/H200
MAX_SETS = 8
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")  # the C++ source location of TORCH_WARN
_BACKENDS = {"native_cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


class BenchError(RuntimeError):
    """The benchmark cannot run here (no CUDA, or the provider is already enabled process-wide)."""


@dataclass(frozen=True)
class Preset:
    repeats: int
    warmup: int
    host_calls: int


DEFAULT = Preset(repeats=30, warmup=5, host_calls=300)
QUICK = Preset(repeats=5, warmup=2, host_calls=50)


@dataclass(frozen=True)
class Case:
    """One shape. ``seq`` is S (dense, padded, step) or the longest sequence (varlen); ``seq_lens``
    are the varlen sequences' lengths or the padded batch's real lengths."""

    name: str
    kind: str  # "dense", "varlen", "padded" or "step"
    batch: int
    h_q: int
    h_kv: int
    seq: int
    head_dim: int
    causal: bool
    seq_lens: tuple[int, ...] = ()
    host: bool = False  # also measure the host cost per call
    layers: int = 1  # attention calls per step (step cases: the model's layers)

    @property
    def gqa(self) -> bool:
        return self.h_q != self.h_kv

    @property
    def paths(self) -> tuple[str, ...]:
        return _PATHS[self.kind]

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd_bwd",) if self.kind == "step" else MODES

    def describe(self) -> str:
        heads = f"H={self.h_q}" + (f"/{self.h_kv} (GQA)" if self.gqa else "")
        lens = self.seq_lens
        if self.kind == "varlen":
            shape = f"varlen {len(lens)} seqs of {min(lens)}..{max(lens)} ({sum(lens)} tokens)"
        elif self.kind == "padded":
            pad = 1 - sum(lens) / (self.batch * self.seq)
            shape = f"B={self.batch} S={self.seq} right-padded to lengths {min(lens)}..{max(lens)} ({pad:.0%} padding)"
        elif self.kind == "step":
            shape = f"training step of demo.TinyGQA ({self.layers} layers), B={self.batch} S={self.seq}"
        else:
            shape = f"B={self.batch} S={self.seq}"
        extra = ", host cost" if self.host else ""
        return f"{shape} {heads} D={self.head_dim}{' causal' if self.causal else ''}{extra}"


def _dense(b: int, h: int, s: int, d: int, causal: bool) -> Case:
    return Case(f"b{b}_h{h}_s{s}_d{d}" + ("_causal" if causal else ""), "dense", b, h, h, s, d, causal)


def _varlen_lengths(n: int = 16, low: int = 128, high: int = 4096, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)  # fixed seed: the same mix on every run and machine
    return tuple(rng.randint(low, high) for _ in range(n))


def _padded_lengths(batch: int, seq: int, mean_pad: float = 0.25) -> tuple[int, ...]:
    """Real lengths whose padding runs evenly from none to 2 x ``mean_pad`` of ``seq`` (mean ``mean_pad``)."""
    return tuple(seq - round(seq * 2 * mean_pad * i / (batch - 1)) for i in range(batch))


_LENS = _varlen_lengths()

#: The default matrix: FACTS.md section 2's six dense shapes, a Llama-3 GQA long sequence, a varlen
#: mix, a padded Llama-3 GQA batch (lengths against the mask), the tiny shape whose time is all host
#: cost, and a small training step (eager against CUDA-graph replay).
MATRIX: tuple[Case, ...] = (
    *(_dense(b, h, s, d, c) for b, h, s, d in ((4, 16, 4096, 128), (16, 16, 1024, 64), (2, 16, 8192, 128))
      for c in (False, True)),
    Case("gqa_b1_h32kv8_s16384_d128_causal", "dense", 1, 32, 8, 16384, 128, True),
    Case("varlen_n16_h16_d128_causal", "varlen", len(_LENS), 16, 16, max(_LENS), 128, True, seq_lens=_LENS),
    Case("padded_b8_h32kv8_s4096_d128_causal", "padded", 8, 32, 8, 4096, 128, True,
         seq_lens=_padded_lengths(8, 4096)),
    Case("tiny_b1_h2_s128_d64_causal", "dense", 1, 2, 2, 128, 64, True, host=True),
    Case("step_tinygqa_b2_s128", "step", 2, 4, 2, 128, 64, True, host=True, layers=2),
)
QUICK_CASES = ("b16_h16_s1024_d64_causal", "varlen_n16_h16_d128_causal", "tiny_b1_h2_s128_d64_causal")


def select(names: Iterable | None = None) -> list[Case]:
    """Cases by name (``Case`` objects pass through); ``None`` is the whole matrix."""
    if names is None:
        return list(MATRIX)
    if isinstance(names, (str, Case)):
        names = [names]
    by_name = {c.name: c for c in MATRIX}
    out = []
    for n in names:
        if not isinstance(n, Case) and n not in by_name:
            raise ValueError(f"unknown bench case {n!r}. Available cases: {list(by_name)}")
        out.append(n if isinstance(n, Case) else by_name[n])
    if not out:
        raise ValueError(f"no bench case selected. Available cases: {list(by_name)}")
    return out


def quick_matrix() -> list[Case]:
    return select(QUICK_CASES)


def check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(modes))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or modes!r}. Available modes: {list(MODES)}")
    return modes


def check_settings(repeats: int, warmup: int, host_calls: int) -> Preset:
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0), ("host_calls", host_calls, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return Preset(repeats, warmup, host_calls)


def fwd_flops(case: Case) -> float | None:
    """Forward flops: 4*H_q*D per (query, key) pair (QK^T and PV), half the pairs when causal;
    None for step cases."""
    if case.kind == "step":
        return None
    pairs = sum(n * n for n in case.seq_lens) if case.seq_lens else case.batch * case.seq * case.seq
    total = 4 * case.h_q * pairs * case.head_dim
    return float(total // 2 if case.causal else total)


def flops(case: Case, mode: str) -> float | None:
    f = fwd_flops(case)
    return None if f is None else f * (BWD_FACTOR if mode == "fwd_bwd" else 1.0)


# ------------------------------------------------------------------------------------ rows (pure)


@dataclass
class Row:
    """One (case, mode, path) result; see the module docstring for each metric."""

    case: str
    kind: str
    mode: str
    path: str
    seq: int
    causal: bool
    status: str = "ok"
    reason: str = ""
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    vs_native: float | None = None
    peak_mib: float | None = None
    inputs_mib: float | None = None
    host_us: float | None = None
    host_vs_native: float | None = None
    repeats: int = 0
    input_sets: int = 0
    calls: int = 0
    replays: int = 0
    expected: int | None = None
    served: int | None = None
    fallbacks: int | None = None
    fallback_reasons: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Measurement:
    """What was measured for one path (filled by ``run``; ``summarize`` turns it into a Row)."""

    path: str
    times_ms: list = field(default_factory=list)
    skip: str | None = None  # why the path did not run
    error: bool = False  # the skip is an unexpected exception, not PyTorch declining the path
    calls: int = 0
    replays: int = 0  # calls that replayed a CUDA graph (no Python, so no provider call)
    served: int = 0
    fallback: dict = field(default_factory=dict)
    peak_mib: float | None = None
    host_us: float | None = None
    step: Callable | None = None
    keep: object = None  # what the step needs alive (a captured CUDA graph)


def _quantile(ordered: list, q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def expected_calls(case: Case, mode: str, python_calls: int) -> int:
    """Attention calls the counters must show for ``python_calls`` steps run through Python."""
    return python_calls * case.layers * (2 if mode == "fwd_bwd" else 1)  # a forward and a backward each


def _provider_status(row: Row) -> tuple[str, str]:
    if row.fallbacks:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(row.fallback_reasons.items()))
        return "fallback", f"{row.fallbacks} of {row.expected} provider calls fell back ({reasons})"
    if row.served != row.expected:
        return "unserved", f"{row.served} of {row.expected} calls reached the provider"
    return "ok", ""


def summarize(case: Case, mode: str, m: Measurement, inputs_mib: float, input_sets: int) -> Row:
    """A Row from one path's measurement (pure)."""
    row = Row(case.name, case.kind, mode, m.path, case.seq, case.causal, inputs_mib=inputs_mib,
              input_sets=input_sets, calls=m.calls, replays=m.replays)
    if m.skip is not None:
        row.status, row.reason = ("error" if m.error else "skipped"), m.skip
        return row
    ordered = sorted(m.times_ms)
    row.median_ms, row.p20_ms, row.p80_ms = statistics.median(ordered), _quantile(ordered, 0.2), _quantile(ordered, 0.8)
    work = flops(case, mode)
    row.tflops = None if work is None else work / (row.median_ms * 1e-3) / 1e12
    row.repeats, row.peak_mib, row.host_us = len(ordered), m.peak_mib, m.host_us
    if m.path.startswith("provider"):
        row.expected = expected_calls(case, mode, m.calls - m.replays)
        row.served, row.fallbacks, row.fallback_reasons = m.served, sum(m.fallback.values()), dict(m.fallback)
        row.status, row.reason = _provider_status(row)
    return row


def add_ratios(rows: list[Row]) -> list[Row]:
    """Fill ``vs_native`` / ``host_vs_native`` against each (case, mode)'s baseline row."""
    base = {}
    for r in rows:
        if r.path in BASELINE[r.kind] and r.median_ms:
            key, prev = (r.case, r.mode), base.get((r.case, r.mode))
            if prev is None or BASELINE[r.kind].index(r.path) < BASELINE[r.kind].index(prev.path):
                base[key] = r
    for r in rows:
        b = base.get((r.case, r.mode))
        if b is not None and r.median_ms:
            r.vs_native = b.median_ms / r.median_ms
        if b is not None and b.host_us and r.host_us:
            r.host_vs_native = b.host_us / r.host_us
    return rows


# ------------------------------------------------------------------------------- measuring (GPU)


class _Set:
    """One input set: q, k, v, grad_out (requiring grad) and detached views for the fwd mode;
    ``cu`` (varlen prefix sums), ``lens`` and ``mask`` (padded: real lengths, and the boolean
    padding+causal mask the native paths get)."""

    def __init__(self, q, k, v, g, cu=None, lens=None, mask=None):
        self.q, self.k, self.v = (t.requires_grad_() for t in (q, k, v))
        self.qd, self.kd, self.vd = q.detach(), k.detach(), v.detach()
        self.g, self.cu, self.lens, self.mask = g, cu, lens, mask


class _StepSet:
    """A step case's input: a bf16 ``demo.TinyGQA`` and one batch of tokens."""

    def __init__(self, case: Case, gen: torch.Generator):
        from .demo import TinyGQA

        torch.manual_seed(zlib.crc32(case.name.encode()))
        dim = case.h_q * case.head_dim
        self.model = TinyGQA(dim=dim, heads=case.h_q, kv_heads=case.h_kv, layers=case.layers)
        self.model = self.model.to(device="cuda", dtype=torch.bfloat16)
        self.tokens = torch.randint(0, 256, (case.batch, case.seq + 1), generator=gen, device="cuda")


def _shapes(case: Case) -> tuple[tuple, tuple]:
    if case.kind == "varlen":
        t = sum(case.seq_lens)
        return (t, case.h_q, case.head_dim), (t, case.h_kv, case.head_dim)
    return (case.batch, case.h_q, case.seq, case.head_dim), (case.batch, case.h_kv, case.seq, case.head_dim)


def _set_bytes(case: Case, mode: str = "fwd_bwd") -> int:
    sq, skv = _shapes(case)
    elems = math.prod(sq) * (2 if mode == "fwd_bwd" else 1) + 2 * math.prod(skv)
    mask = case.batch * case.seq * case.seq if case.kind == "padded" else 0  # bool, 1 byte
    return 2 * elems + mask  # bf16


def _padding_mask(lens: torch.Tensor, s: int, causal: bool) -> torch.Tensor:
    """(B, 1, S, S) bool: key j visible to query i iff j < length (and j <= i when causal), the mask
    a Hugging Face model builds for a right-padded batch."""
    j = torch.arange(s, device=lens.device)
    mask = (j < lens[:, None])[:, None, None, :]
    if causal:
        mask = mask & (j[None, :] <= j[:, None])
    return mask.expand(len(lens), 1, s, s).contiguous()


def _make_sets(case: Case) -> list:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.name.encode()))  # fresh per case, reproducible
    if case.kind == "step":
        return [_StepSet(case, gen)]
    sq, skv = _shapes(case)
    extra = {}
    if case.kind == "varlen":
        extra["cu"] = torch.tensor([0, *itertools.accumulate(case.seq_lens)], dtype=torch.int32, device="cuda")
    if case.kind == "padded":
        lens = torch.tensor(case.seq_lens, dtype=torch.int32, device="cuda")
        extra.update(lens=lens, mask=_padding_mask(lens, case.seq, case.causal))
    n = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / _set_bytes(case))))

    def rnd(shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    return [_Set(rnd(sq), rnd(skv), rnd(skv), rnd(sq), **extra) for _ in range(n)]


def _varlen_kwargs(fn, causal: bool) -> dict:
    # torch 2.11+ folds is_causal into window_size ((-1, 0) is causal; compared as a tuple).
    if "window_size" in inspect.signature(fn).parameters:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    return {"is_causal": causal}


def _attn(case: Case, path: str) -> Callable:
    sdpa, causal, gqa = F.scaled_dot_product_attention, case.causal, case.gqa
    if case.kind == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        kw, m = _varlen_kwargs(varlen_attn, case.causal), case.seq
        return lambda s, q, k, v: varlen_attn(q, k, v, s.cu, s.cu, m, m, **kw)
    if case.kind == "padded" and path == "provider":
        from .functional import attention

        return lambda s, q, k, v: attention(q, k, v, is_causal=causal, seq_lens_q=s.lens, seq_lens_kv=s.lens)
    if case.kind == "padded":
        return lambda s, q, k, v: sdpa(q, k, v, attn_mask=s.mask, enable_gqa=gqa)
    return lambda s, q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)


def _train_step(s: _StepSet) -> None:
    logits = s.model(s.tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), s.tokens[:, 1:].flatten()).backward()  # grads accumulate


def _step(case: Case, mode: str, path: str) -> Callable:
    if case.kind == "step":
        return _train_step
    attn = _attn(case, path)
    if mode == "fwd":
        return lambda s: attn(s, s.qd, s.kd, s.vd)

    def fwd_bwd(s):
        torch.autograd.grad(attn(s, s.q, s.k, s.v), (s.q, s.k, s.v), s.g)

    return fwd_bwd


def _capture(m: Measurement, s: _StepSet) -> None:
    """Warm-up steps on a side stream (builds every cuDNN graph), then one step captured in a CUDA
    graph; ``m.step`` replays it. Counts the Python-run steps in ``m.calls``.

    Exactly the form of tests/gpu/test_cuda_graphs.py (passed in runs 9, 10 and 12 of
    results/gpu-runs.md): a model of its own (a copy with the same weights, whose autograd has
    never run on another stream; the other paths' eager steps ran on the default stream), gradients
    set to None before each warm-up step and before capture (the captured backward allocates them
    from the graph's pool), capture on the warm-up's stream."""
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
    m.calls += GRAPH_WARMUP_STEPS + 1
    m.keep, m.step = (graph, own), lambda _s: graph.replay()


@contextlib.contextmanager
def _provider_scope(m: Measurement):
    before = counters.stats()
    try:
        with activation.enable():
            yield
    finally:
        for p in (counters.stats() - before).to_dict().values():
            m.served += p["served"]
            for reason, n in p["fallback"].items():
                m.fallback[reason] = m.fallback.get(reason, 0) + n


def _paths(case: Case) -> tuple[str, ...]:
    return case.paths + (tuple(_PEERS) if case.kind in ("dense", "varlen") else ())


def _scope(m: Measurement):
    if m.path in _PEERS:
        return _PEERS[m.path]()
    if m.path.startswith("provider"):
        return _provider_scope(m)
    if m.path in _BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, _BACKENDS[m.path]))
    return contextlib.nullcontext()


def _why(exc: BaseException, caught: list) -> str:
    said = [f"{type(exc).__name__}: {exc}"] + [str(w.message) for w in caught]  # the exception first
    said = [_TRIGGERED.sub("", s).strip().splitlines() for s in said]
    text = "; ".join(dict.fromkeys(lines[0] for lines in said if lines))
    return text if len(text) <= 400 else text[:397] + "..."


def _guard(m: Measurement, fn: Callable) -> None:
    """Run ``fn`` in the path's scope; an exception marks the path errored (the run goes on)."""
    try:
        with _scope(m):
            fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        m.skip, m.error = _why(exc, []), True
        _report(m, exc)


def _probe(m: Measurement, case: Case, mode: str, sets: list) -> None:
    """One call: builds graphs, and finds the paths PyTorch cannot run (skipped, with its reasons)."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # PyTorch explains "No available kernel" in warnings
            m.step = _step(case, mode, m.path)
            with _scope(m):
                if m.path == "provider_graphed":
                    _capture(m, sets[0])
                else:
                    m.step(sets[0])
                    m.calls += 1
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        m.skip, m.error = _why(exc, caught), m.path.startswith("provider")  # the provider must never raise
        if m.error:
            _report(m, exc)


def _report(m: Measurement, exc: BaseException) -> None:
    """The whole traceback of an errored path on stderr (the row keeps one line of it)."""
    print(f"bench: path {m.path} raised:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)


def _event_times(step: Callable, sets: list, n: int, warmup: int) -> list[float]:
    for i in range(warmup):
        step(sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    for i in range(n):
        s = sets[(warmup + i) % len(sets)]  # rotate on from the warm-up: sets too big for L2 are never hot
        starts[i].record()
        step(s)
        ends[i].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def _peak_mib(step: Callable, s: _Set) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(s)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _host_us(step: Callable, sets: list, n: int) -> float:
    torch.cuda.synchronize()
    t0 = perf_counter()
    for i in range(n):
        step(sets[i % len(sets)])
    torch.cuda.synchronize()
    return (perf_counter() - t0) / n * 1e6


def _count(m: Measurement, n: int) -> None:
    m.calls += n
    if m.keep is not None:  # a captured graph: these calls were replays
        m.replays += n


def _timed(m: Measurement, sets: list, n: int, warmup: int) -> None:
    m.times_ms += _event_times(m.step, sets, n, warmup)
    _count(m, n + warmup)


def _extras(m: Measurement, sets: list, case: Case, host_calls: int) -> None:
    m.peak_mib = _peak_mib(m.step, sets[0])
    _count(m, 1)
    if case.host:
        m.host_us = _host_us(m.step, sets, host_calls)
        _count(m, host_calls)


def _bench_mode(case: Case, mode: str, sets: list, cfg: Preset, tick: Callable) -> list[Measurement]:
    ms = [Measurement(p) for p in _paths(case)]
    for m in ms:
        _probe(m, case, mode, sets)
    live = [m for m in ms if m.skip is None]
    first = (cfg.repeats + 1) // 2
    for order, n, warm in ((live, first, cfg.warmup), (live[::-1], cfg.repeats - first, 1)):  # ABBA
        for m in order if n else ():
            if m.skip is None:
                _guard(m, lambda m=m, n=n, warm=warm: _timed(m, sets, n, warm))
    for m in ms:
        if m.skip is None:
            _guard(m, lambda m=m: _extras(m, sets, case, cfg.host_calls))
        tick(f"{case.name} {mode} {m.path}")
    return ms


def _bench_case(case: Case, modes: tuple, cfg: Preset, tick: Callable) -> list[Row]:
    sets = _make_sets(case)
    try:
        rows = []
        for mode in (m for m in modes if m in case.modes):
            mib = _set_bytes(case, mode) / 2**20
            rows += [summarize(case, mode, m, mib, len(sets)) for m in _bench_mode(case, mode, sets, cfg, tick)]
        return rows
    finally:
        del sets
        torch.cuda.empty_cache()


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        raise BenchError("CUDA is not available; the benchmark times GPU kernels (run it on an NVIDIA GPU)")
    if activation.enabled():
        raise BenchError("the provider is already enabled in this process (CUDNN_SDPA_PROVIDER set, or enable() "
                         "called); the native paths must run with it off: unset CUDNN_SDPA_PROVIDER")


def run(matrix: Iterable | None = None, modes: Iterable[str] = MODES, repeats: int = DEFAULT.repeats,
        warmup: int = DEFAULT.warmup, host_calls: int = DEFAULT.host_calls,
        progress: Callable[[int, int, str], None] | None = None, peers: dict | None = None) -> list[Row]:
    """Time every (case, mode, path); ``progress(done, total, label)`` is called after each path.
    ``peers`` adds paths to the dense and varlen cases: {name: a function returning the context
    manager inside which F.sdpa / varlen_attn run that path}."""
    cases, modes, cfg = select(matrix), check_modes(modes), check_settings(repeats, warmup, host_calls)
    peers = dict(peers or {})
    for name in peers:
        if not isinstance(name, str) or name.startswith("provider") or any(name in p for p in _PATHS.values()):
            raise ValueError(f"peer path name {name!r} must be a new name (not a built-in path, not 'provider*')")
    _require_gpu()
    _PEERS.clear()
    _PEERS.update(peers)
    try:
        return _run_cases(cases, modes, cfg, progress)
    finally:
        _PEERS.clear()


def _run_cases(cases: list, modes: tuple, cfg: Preset, progress: Callable | None) -> list[Row]:
    total, done = sum(len(_paths(c)) * len([m for m in modes if m in c.modes]) for c in cases), 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    rows: list[Row] = []
    for case in cases:
        rows += _bench_case(case, modes, cfg, tick)
    return add_ratios(rows)


# --------------------------------------------------------------------------------------- output


def collect_meta(argv: list[str] | None = None, **settings) -> dict:
    """Versions, GPU, date and command line for the JSON file."""
    from . import __version__

    caps = support.capabilities()
    return {
        "package": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv if argv is None else argv),
        "gpu": caps.device_name,
        "compute_capability": list(caps.compute_capability or ()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_torch": torch.backends.cudnn.version() if caps.cuda else None,
        "cudnn_backend": support.version_str(caps.cudnn_version),
        "cudnn_frontend": caps.frontend_version,
        "cudnn_unavailable": caps.unavailable,
        "settings": settings,
        "cases": {c.name: {**dataclasses.asdict(c), "description": c.describe()} for c in MATRIX},
    }


def to_json(rows: list[Row], meta: dict) -> str:
    return json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows]}, indent=2) + "\n"


_HEAD = ("case", "mode", "path", "median ms", "p20-p80 ms", "TFLOP/s", "vs native", "peak MiB", "host us",
         "host vs native", "served", "note")


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _cells(r: Row) -> tuple:
    spread = "-" if r.p20_ms is None else f"{r.p20_ms:.3f}-{r.p80_ms:.3f}"
    served = "-" if r.served is None else f"{r.served}/{r.expected}"
    note = "" if r.status == "ok" else f"{r.status.upper()}: {r.reason}"
    note = note if len(note) <= 120 else note[:117] + "..."  # the JSON has the full reason
    return (r.case, r.mode, r.path, _num(r.median_ms, ".3f"), spread, _num(r.tflops, ".1f"),
            _num(r.vs_native, ".2f") + ("x" if r.vs_native is not None else ""), _num(r.peak_mib, ".0f"),
            _num(r.host_us, ".1f"), _num(r.host_vs_native, ".2f") + ("x" if r.host_vs_native is not None else ""),
            served, note)


def format_table(rows: list[Row]) -> str:
    """Plain-text table, a blank line between cases; non-ok rows say why in the note column."""
    cells = [_HEAD] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_HEAD) - 1)]

    def line(c: tuple) -> str:
        text = [c[j].ljust(widths[j]) if j < 3 else c[j].rjust(widths[j]) for j in range(len(widths))]
        return "  ".join(text + [c[-1]]).rstrip()

    lines = [line(_HEAD)]
    for prev, r, c in zip([None] + rows[:-1], rows, cells[1:]):
        if prev is not None and prev.case != r.case:
            lines.append("")
        lines.append(line(c))
    return "\n".join(lines)


def require_matplotlib():
    """matplotlib's Figure class, or an ImportError naming the extra to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install cudnn-sdpa-provider[plot]") from exc
    return Figure


_SERIES = (("dense", False, "o", ""), ("dense", True, "^", " causal"), ("varlen", False, "D", " varlen"),
           ("varlen", True, "s", " varlen causal"), ("padded", True, "v", " padded causal"))
# (kind, causal, marker, label suffix); step cases have no TFLOP/s


def plot(rows: list[Row], path: str) -> None:
    """TFLOP/s against sequence length per path, one panel per mode; written to ``path``."""
    figure = require_matplotlib()
    good = [r for r in rows if r.status == "ok" and r.tflops]
    modes = [m for m in MODES if any(r.mode == m for r in good)]
    if not modes:
        raise ValueError("no timed rows to plot")
    fig = figure(figsize=(6.5 * len(modes), 4.5), layout="constrained")
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    paths = list(dict.fromkeys(r.path for r in good))
    for ax, mode in zip(axes, modes):
        for i, p in enumerate(paths):
            for kind, causal, marker, tag in _SERIES:
                pts = sorted((r.seq, r.tflops) for r in good
                             if r.mode == mode and r.path == p and r.kind == kind and r.causal == causal)
                if pts:
                    ax.plot(*zip(*pts), marker=marker, linestyle="none", color=f"C{i}", label=p + tag)
        ax.set_xscale("log", base=2)
        ax.set(title=mode, xlabel="sequence length (varlen: longest)", ylabel="TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path)
