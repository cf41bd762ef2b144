"""Helpers of the lifecycle scripts (tests/gpu/test_lifecycles.py), which run in child processes.

A script reports one JSON object on a line of its own (``emit``); the parent judges it with
``rule_problems`` (the FlashAttention rule, as tests/layout_checks.py applies it) and plain
comparisons. Nothing here touches CUDA at import; ``DEV`` (default ``cuda``) can be set with
CSP_LIFECYCLE_DEVICE to dry-run a script's structure on CPU.
"""

from __future__ import annotations

import json
import math
import os
import traceback

import torch

from cudnn_sdpa_provider.core import counters
from tests.layout_checks import FLOOR
from tests.util import rel_error

__all__ = ["DEV", "MARK", "emit", "parse", "counted", "errors", "step", "sync", "noise_tol", "rule_problems", "layout",
           "run", "dense_ref", "varlen_ref", "accuracy", "varlen_causal_kwargs"]

DEV = os.environ.get("CSP_LIFECYCLE_DEVICE", "cuda")
MARK = "CSP-LIFECYCLE-RESULT "


def emit(**data) -> None:
    print(MARK + json.dumps(data), flush=True)


def parse(stdout: str) -> dict:
    lines = [line[len(MARK):] for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise ValueError("the script reported no result")
    return json.loads(lines[-1])


def sync() -> None:
    if torch.device(DEV).type == "cuda":
        torch.cuda.synchronize()


def counted(fn):
    """(fn's result, the counter delta of the call as a dict)."""
    before = counters.stats()
    result = fn()
    sync()
    return result, (counters.stats() - before).to_dict()


def step(results: dict, name: str, fn):
    """Run one step of a script; an exception becomes ``results[name + "_error"]`` (the parent asserts
    there is none) instead of ending the script, so the other steps still report."""
    try:
        return fn()
    except Exception as exc:
        results[name + "_error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-3000:]
        return None


def errors(got: dict, want: dict) -> dict:
    """{name: max|got - want| / max|want|} for the tensors both have."""
    return {name: rel_error(got[name], want[name])[0] for name in want if got.get(name) is not None}


def layout(t) -> list:
    """Strides of the dims of extent > 1."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def noise_tol(a: float) -> float:
    """Tolerance for "the same kernels as native, the same RNG", where native's own two runs differ by
    ``a``: 1e-6 relative when they agree bit for bit; else twice ``a``, and at least two bf16 rounding
    steps of the largest element (atomics make some backward kernels nondeterministic by about one).
    A dropout mask that differs between forward and recompute moves gradients by O(1)."""
    return 1e-6 if a == 0 else max(2 * a, 2 * 2.0**-8)


def rule_problems(provider: dict, native: dict, dtype: str = "bfloat16", group: int = 1) -> list[str]:
    """The FlashAttention rule per tensor: error vs fp32 <= max(3 x native's error, a floor); the
    gradient floors are twice the output's budget and grow with the GQA group for dK/dV."""
    floor = FLOOR[getattr(torch, dtype)]
    out_tol = max(3 * native.get("out", 0.0), floor)
    grad_floor = max(2 * out_tol, 3 * floor)
    found = []
    for name, err in provider.items():
        if name == "out":
            tol = out_tol
        else:
            tol = max(3 * native.get(name, 0.0), grad_floor * math.sqrt(group if name in ("dk", "dv") else 1))
        if not err <= tol:
            found.append(f"{name}: rel err {err:.3e} > {tol:.3e} (native {native.get(name, float('nan')):.3e})")
    return found


def run(call, inputs, go) -> dict:
    """Forward and gradients of ``inputs`` (autograd.grad keeps the kernels' strides)."""
    out = call()
    grads = torch.autograd.grad(out, inputs, go)
    sync()
    return {"out": out.detach(), **dict(zip(("dq", "dk", "dv"), grads))}


def dense_ref(q, k, v, go, **kw) -> dict:
    """fp32 reference (cudnn_sdpa_provider.ops.reference, differentiated by autograd)."""
    from cudnn_sdpa_provider.ops import reference

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    return run(lambda: reference.dense(*leaves, scale=1 / math.sqrt(q.shape[-1]), **kw)[0], leaves, go.float())


def varlen_ref(q, k, v, go, cu, max_len: int, **kw) -> dict:
    from cudnn_sdpa_provider.ops import reference

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    return run(lambda: reference.varlen(*leaves, cu, cu, max_len, max_len, scale=1 / math.sqrt(q.shape[-1]),
                                        bottom_right=True, **kw)[0], leaves, go.float())


def accuracy(provider: dict, native: dict, ref: dict) -> dict:
    return {"provider": errors(provider, ref), "native": errors(native, ref)}


def varlen_causal_kwargs(causal: bool) -> dict:
    """varlen_attn's causal argument in this torch's spelling (2.11: window_size; earlier: is_causal)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if not causal:
        return {}
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return {"window_size": (-1, 0)}
    return {"is_causal": True}
