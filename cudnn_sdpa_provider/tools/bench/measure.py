"""Timing the paths on the GPU. Every path of a case is measured in ONE process on the SAME input
sets, in ABBA order (half the repeats in path order, half reversed) so clock drift does not favour
a path. Per path: one probe call (builds graphs and models; a path PyTorch cannot run is
``skipped`` with PyTorch's reason), the timed calls (CUDA events), then one call for the peak
memory and, for host-cost cases, ``host_calls`` back-to-back calls.

Returns data only. A path that raises is recorded in its row (one line of the exception) and its
whole traceback goes to the ``cudnn_sdpa_provider.bench`` logger (ERROR: stderr unless logging is
configured otherwise); progress goes to the caller's ``progress`` callback.
"""

from __future__ import annotations

import logging
import re
import warnings
from time import perf_counter
from typing import Callable, Iterable

import torch

from ...hooks import activation
from . import fp8_case
from .cases import DEFAULT, MODES, Case, Preset, audited, case_paths, check_modes, check_peers, check_settings, select
from .inputs import make_sets, set_bytes, unavailable
from .paths import capture, scope, step
from .report import Measurement, Row, add_ratios, summarize

__all__ = ["BenchError", "run"]

log = logging.getLogger("cudnn_sdpa_provider.bench")
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")  # the C++ source location of TORCH_WARN


class BenchError(RuntimeError):
    """The benchmark cannot run here (no CUDA, or the provider is already enabled process-wide)."""


class _Live:
    """A path while it is measured: its Measurement, the step it runs, what the step keeps alive."""

    __slots__ = ("m", "step", "keep")

    def __init__(self, path: str):
        self.m, self.step, self.keep = Measurement(path), None, None  # keep: a captured CUDA graph


# ------------------------------------------------------------------------------------ timing


def event_times(step_fn: Callable, sets: list, n: int, warmup: int,
                refresh: Callable | None = None) -> list[float]:
    """CUDA-event milliseconds of ``n`` calls after ``warmup`` calls, rotating through ``sets``;
    ``refresh(set)`` after each call (warm-up too), outside the timed window (fp8 cases: new values)."""
    for i in range(warmup):
        step_fn(sets[i % len(sets)])
        if refresh is not None:
            refresh(sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    for i in range(n):
        s = sets[(warmup + i) % len(sets)]  # rotate on from the warm-up: sets too big for L2 are never hot
        starts[i].record()
        step_fn(s)
        ends[i].record()
        if refresh is not None:  # after the end event: on the stream, outside the window
            refresh(s)
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def peak_mib(step_fn: Callable, s) -> float:
    """MiB allocated at the peak of one call above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_fn(s)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def host_us(step_fn: Callable, sets: list, n: int) -> float:
    """Wall microseconds per call of ``n`` back-to-back calls, one sync at the end."""
    torch.cuda.synchronize()
    t0 = perf_counter()
    for i in range(n):
        step_fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    return (perf_counter() - t0) / n * 1e6


# ------------------------------------------------------------------------------- one path


def _why(exc: BaseException, caught: list) -> str:
    said = [f"{type(exc).__name__}: {exc}"] + [str(w.message) for w in caught]  # the exception first
    said = [_TRIGGERED.sub("", s).strip().splitlines() for s in said]
    text = "; ".join(dict.fromkeys(lines[0] for lines in said if lines))
    return text if len(text) <= 400 else text[:397] + "..."


def _guard(p: _Live, fn: Callable, peers: dict) -> None:
    """Run ``fn`` in the path's scope; an exception marks the path errored (the run goes on)."""
    try:
        with scope(p.m, peers):
            fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        p.m.skip, p.m.error = _why(exc, []), True
        log.error("bench: path %s raised:", p.m.path, exc_info=exc)


def _probe(p: _Live, case: Case, mode: str, sets: list, peers: dict) -> None:
    """One call: builds graphs, and finds the paths PyTorch cannot run (skipped, with its reasons)."""
    caught: list = []
    m = p.m
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # PyTorch explains "No available kernel" in warnings
            p.step = step(case, mode, m.path)
            with scope(m, peers):
                if m.path == "provider_graphed":
                    p.step, p.keep, python_steps = capture(sets[0])
                    m.calls += python_steps
                else:
                    p.step(sets[0])
                    m.calls += 1
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        m.skip, m.error = _why(exc, caught), audited(m.path)  # the provider's and FP8 paths must never raise
        if m.error:
            log.error("bench: path %s raised:", m.path, exc_info=exc)


def _count(p: _Live, n: int) -> None:
    p.m.calls += n
    if p.keep is not None:  # a captured graph: these calls were replays
        p.m.replays += n


def _timed(p: _Live, sets: list, n: int, warmup: int, case: Case) -> None:
    p.m.times_ms += event_times(p.step, sets, n, warmup, fp8_case.refresh if case.kind == "fp8" else None)
    _count(p, n + warmup)


def _extras(p: _Live, sets: list, case: Case, host_calls: int) -> None:
    p.m.peak_mib = peak_mib(p.step, sets[0])
    _count(p, 1)
    if case.host:
        p.m.host_us = host_us(p.step, sets, host_calls)
        _count(p, host_calls)


# ----------------------------------------------------------------------------- one case


def _bench_mode(case: Case, mode: str, sets: list, cfg: Preset, tick: Callable, peers: dict) -> list[Measurement]:
    live = [_Live(path) for path in case_paths(case, peers)]
    for p in live:
        _probe(p, case, mode, sets, peers)
    ran = [p for p in live if p.m.skip is None]
    first = (cfg.repeats + 1) // 2
    for order, n, warm in ((ran, first, cfg.warmup), (ran[::-1], cfg.repeats - first, 1)):  # ABBA
        for p in order if n else ():
            if p.m.skip is None:
                _guard(p, lambda p=p, n=n, warm=warm: _timed(p, sets, n, warm, case), peers)
    for p in live:
        if p.m.skip is None:
            _guard(p, lambda p=p: _extras(p, sets, case, cfg.host_calls), peers)
        tick(f"{case.name} {mode} {p.m.path}")
    return [p.m for p in live]


def _case_modes(case: Case, modes: tuple) -> list[str]:
    return [m for m in modes if m in case.modes]


def _unavailable_rows(case: Case, modes: tuple, reason: str, tick: Callable, peers: dict) -> list[Row]:
    """Every path of a case that cannot run here, skipped with ``reason`` (nothing touches the GPU)."""
    rows = []
    for mode in _case_modes(case, modes):
        for path in case_paths(case, peers):
            rows.append(summarize(case, mode, Measurement(path, skip=reason), set_bytes(case, mode) / 2**20, 0))
            tick(f"{case.name} {mode} {path}")
    return rows


def _bench_case(case: Case, modes: tuple, cfg: Preset, tick: Callable, peers: dict) -> list[Row]:
    reason = unavailable(case)
    if reason is not None:
        return _unavailable_rows(case, modes, reason, tick, peers)
    sets = make_sets(case)
    try:
        rows = []
        for mode in _case_modes(case, modes):
            mib = set_bytes(case, mode) / 2**20
            rows += [summarize(case, mode, m, mib, len(sets))
                     for m in _bench_mode(case, mode, sets, cfg, tick, peers)]
        return rows
    finally:
        del sets
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- the run


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
    peers = check_peers(peers)
    _require_gpu()
    total, done = sum(len(case_paths(c, peers)) * len(_case_modes(c, modes)) for c in cases), 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    rows: list[Row] = []
    for case in cases:
        rows += _bench_case(case, modes, cfg, tick, peers)
    return add_ratios(rows)
