"""Choosing a graph's execution plan by timing every plan cuDNN built for it (opt-in).

cuDNN's heuristic ranks a graph's plans and the provider runs the first that builds, which need
not be the fastest on a given GPU and shape (``scripts/plan_sweep.py`` times them all). With
``CUDNN_SDPA_PROVIDER_AUTOTUNE=1`` (``env.autotune``) a graph is built with all of its plans, and
its first execute outside a CUDA-graph capture times each on that call's own buffers (CUDA events,
after warm-up, median) and keeps the fastest, but only when it is at least ``MIN_GAIN`` faster than
the heuristic's plan and its outputs agree with that plan's (``agree``): a plan that computes
something else is never chosen, and any failure while tuning (memory, a plan that does not run)
keeps the heuristic's plan. The first call pays for it: the build of every plan, their workspaces
and copies of the outputs, and a wait for the device.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch

from ..core import counters

__all__ = ["MIN_GAIN", "tune", "choose", "agree", "cuda_timer"]

log = logging.getLogger("cudnn_sdpa_provider")

#: A plan replaces the heuristic's only when it is at least this much faster (timing noise aside).
MIN_GAIN = 0.03


def cuda_timer(fn: Callable[[], None], warmup: int = 2, repeats: int = 5) -> float:
    """Median device milliseconds of ``fn`` on the current stream (CUDA events; waits for the last
    event only, so another thread's capture is not disturbed)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    ends[-1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def agree(got: list[torch.Tensor], want: list[torch.Tensor], rel: float = 0.02) -> bool:
    """Whether two plans' outputs are the same function's: NaN, +inf and -inf in the same places,
    and every finite element within ``rel`` of the reference's largest finite magnitude (bf16/fp16
    plans differ in accumulation order only)."""
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return False
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        if not (torch.equal(finite, torch.isfinite(a)) and torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(a[torch.isinf(b)], b[torch.isinf(b)])):
            return False
        if finite.any():
            scale = float(b[finite].abs().max())
            if float((a[finite] - b[finite]).abs().max()) > rel * scale + 1e-6:
                return False
    return True


def _cuda_workspace(device: int):
    return lambda size: torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))


def choose(graph, run: Callable[[int, torch.Tensor | None], None], outputs: list[torch.Tensor], default: int,
           device: int, timer: Callable | None = None, alloc: Callable | None = None) -> tuple[int, int, str] | None:
    """Time every plan of ``graph`` with ``run(index, workspace)`` (which executes that plan on the
    call's buffers; ``outputs`` are the buffers it writes) and return ``(index, workspace bytes,
    name)`` of the plan to run from now on, or None to keep the heuristic's (plan ``default``).
    ``timer(fn)`` gives a run's time (default ``cuda_timer``), ``alloc(bytes)`` a workspace."""
    timer, alloc = timer or cuda_timer, alloc or _cuda_workspace(device)
    plans = {}
    for i in range(int(graph.get_execution_plan_count())):
        try:
            plans[i] = (str(graph.get_plan_name_at_index(i)), int(graph.get_workspace_size_plan_at_index(i)))
        except Exception as exc:  # a plan that did not build has no workspace size: not a candidate
            log.debug("plan %d is not a candidate: %s", i, exc)
    if default not in plans or len(plans) < 2:
        return None

    def timed(index: int) -> float:
        workspace = alloc(plans[index][1]) if plans[index][1] else None
        try:
            return timer(lambda: run(index, workspace))
        finally:
            del workspace

    base = timed(default)
    reference = [t.clone() for t in outputs]  # what the heuristic's plan wrote
    best, best_time = None, (1.0 - MIN_GAIN) * base
    for index in plans:
        if index == default:
            continue
        try:
            took = timed(index)
        except Exception as exc:  # cuDNN declined to run it: not a candidate
            log.debug("plan %s did not run: %s", plans[index][0], exc)
            continue
        if took >= best_time:
            continue
        if not agree(outputs, reference):  # what this plan wrote (its last run)
            log.warning("cudnn-sdpa-provider: autotune: plan %s disagrees with %s on this call; not chosen",
                        plans[index][0], plans[default][0])
            continue
        best, best_time = index, took
    if best is None:
        return None
    log.info("autotune: plan %s (%.3f ms) replaces %s (%.3f ms)", plans[best][0], best_time, plans[default][0], base)
    return best, plans[best][1], plans[best][0]


def tune(p, run: Callable[[int, torch.Tensor | None], None], outputs: list[torch.Tensor], device: int) -> None:
    """Choose the plan of ``graphs.Plan`` ``p`` on this call's buffers, once (``p.tune`` is cleared):
    ``p.index``/``workspace``/``name`` become the chosen plan's. Never under
    ``torch.use_deterministic_algorithms``, whose users want the same plan in every process; any
    failure (memory for the copies or workspaces, a plan that faults) keeps the heuristic's plan:
    tuning is never a reason for a call to fail."""
    p.tune = False
    if torch.are_deterministic_algorithms_enabled():
        return
    try:
        chosen = choose(p.graph, run, outputs, p.default_index, device)
    except Exception as exc:
        log.info("autotune: kept the heuristic's plan %s (%s: %s)", p.name, type(exc).__name__, exc)
        return
    if chosen is not None:
        p.index, p.workspace, p.name = chosen
        counters.note_plan(p.label, f"{p.name} (autotuned)")
