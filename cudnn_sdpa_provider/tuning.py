"""Choosing a graph's execution plan by timing every plan cuDNN built for it (opt-in).

cuDNN's heuristic ranks a graph's plans and the provider runs the first that builds. That is not
always the fastest: for the GQA forward at (1, 32/8, 16384, 128) causal, ``eng2`` with default
knobs ran 9% faster than the heuristic's ``eng2_k24=7`` on an H200 (``scripts/plan_sweep.py``,
results/gpu-run28-plan-sweep.txt). With ``CUDNN_SDPA_PROVIDER_AUTOTUNE=1`` (``env.autotune``) a
graph is built with all of its plans, and its first execute outside a CUDA-graph capture times each
on that call's own buffers (CUDA events, after warm-up, median) and keeps the fastest, but only
when it is at least ``MIN_GAIN`` faster than the heuristic's plan and its outputs agree with that
plan's (``agree``): a plan that computes something else is never chosen. The first call pays for
it: the build of every plan, and a host sync while timing.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch

__all__ = ["MIN_GAIN", "choose", "agree", "cuda_timer"]

log = logging.getLogger("cudnn_sdpa_provider")

#: A plan replaces the heuristic's only when it is at least this much faster (timing noise aside).
MIN_GAIN = 0.03


def cuda_timer(fn: Callable[[], None], warmup: int = 2, repeats: int = 5) -> float:
    """Median device milliseconds of ``fn`` on the current stream (CUDA events; syncs)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def agree(got: list[torch.Tensor], want: list[torch.Tensor], rel: float = 0.02) -> bool:
    """Whether two plans' outputs are the same function's: every output within ``rel`` of the
    largest magnitude of the reference's (bf16/fp16 plans differ in accumulation order only);
    NaN where and only where the reference has NaN (rows the provider poisons)."""
    for a, b in zip(got, want):
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            return False
        a, b = torch.nan_to_num(a.float(), nan=0.0), torch.nan_to_num(b.float(), nan=0.0)
        scale = float(b.abs().max()) if b.numel() else 0.0
        if b.numel() and float((a - b).abs().max()) > rel * scale + 1e-6:
            return False
    return True


def choose(graph, run: Callable[[int, torch.Tensor | None], None], outputs: list[torch.Tensor], default_name: str,
           device: int, timer: Callable | None = None) -> tuple[int, int, str] | None:
    """Time every plan of ``graph`` with ``run(index, workspace)`` (which executes that plan on the
    call's buffers; ``outputs`` are the buffers it writes) and return ``(index, workspace bytes,
    name)`` of the plan to run from now on, or None to keep the heuristic's (``default_name``).
    ``timer(fn)`` gives a run's time (default ``cuda_timer``)."""
    timer = timer or cuda_timer
    plans = []
    for i in range(int(graph.get_execution_plan_count())):
        try:
            plans.append((i, str(graph.get_plan_name_at_index(i)), int(graph.get_workspace_size_plan_at_index(i))))
        except Exception as exc:  # a plan that did not build has no workspace size: not a candidate
            log.debug("plan %d is not a candidate: %s", i, exc)
    default = next((p for p in plans if p[1] == default_name), None)
    if default is None or len(plans) < 2:
        return None
    times, results = {}, {}
    for index, name, ws in plans:
        workspace = torch.empty(ws, dtype=torch.uint8, device=torch.device("cuda", device)) if ws else None
        try:
            times[index] = timer(lambda index=index, workspace=workspace: run(index, workspace))
        except Exception as exc:  # cuDNN declined to run it: not a candidate
            log.debug("plan %s did not run: %s", name, exc)
            continue
        results[index] = [t.clone() for t in outputs]  # what this plan wrote (its last run)
    if default[0] not in times:
        return None
    best = min(times, key=times.get)
    if best == default[0] or times[best] > (1.0 - MIN_GAIN) * times[default[0]]:
        return None
    chosen = next(p for p in plans if p[0] == best)
    if not agree(results[best], results[default[0]]):
        log.warning("cudnn-sdpa-provider: autotune: plan %s disagrees with %s on this call; keeping %s",
                    chosen[1], default_name, default_name)
        return None
    log.info("autotune: plan %s (%.3f ms) replaces %s (%.3f ms)", chosen[1], times[best], default_name,
             times[default[0]])
    return chosen[0], chosen[2], chosen[1]
