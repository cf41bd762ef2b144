"""Where a first call at a new sequence length spends its time, against the same call repeated (GPU).

    python3 scripts/new_length_breakdown.py [--lengths 16] [--top 30] [--segments]

The bench's ``new_length`` cases (``cudnn_sdpa_provider/tools/bench/shape_child.py``: decode,
causal prefill forward, prefill forward+backward; the same inputs) through F.sdpa inside
``csp.enable()``, after one call per case that builds the length bucket's graphs. For each case:

- host us: what the call takes before it returns (no sync), first call at a new length against the
  repeated call (median over ``--lengths`` lengths; the repeated call is the last length again);
- wall us: the same, synchronised at both ends (the bench's ``first_vs_repeated`` is their ratio);
- torch.profiler over 8 first calls and then 8 repeated calls: per op, calls and total CPU and CUDA
  time, so allocations, copies and kernels that only a new length runs show as a difference;
- cProfile of the first calls (cumulative), the package's Python by function;
- ``--segments``: instead of the profilers, the host time of the package's steps per first and per
  repeated call (each wrapped with a perf_counter, no profiler), and one small-tensor upload timed
  while the GPU is busy with a long matmul (an upload that waits for the GPU shows here).

The lengths of each measurement are new to the process; consecutive ones share a length chunk, so
a self-attention call's first call at a length is mostly a chunk hit (``fold_values.chunk``), as
in the bench. Inputs are random, never zeros. Prints text only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.tools.bench.shape_child import decode_inputs, prefill_inputs  # noqa: E402

CASES = (("decode_fwd", decode_inputs, 4000, False, False),
         ("prefill_fwd", prefill_inputs, 700, True, False),
         ("prefill_fwd_bwd", prefill_inputs, 700, True, True))


def _calls(make, start: int, n: int, causal: bool, backward: bool) -> list:
    calls = []
    for s in range(start, start + n):
        inputs = make(s, grad=backward)
        grad = torch.randn(inputs[0].shape, device="cuda", dtype=inputs[0].dtype) if backward else None

        def call(inputs=inputs, grad=grad):
            out = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=True)
            if grad is not None:
                torch.autograd.grad(out, inputs, grad)

        calls.append(call)
    return calls


def _host_and_wall(call) -> tuple[float, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host * 1e6, (time.perf_counter() - t) * 1e6


def _table(prof, top: int) -> str:
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=60)


def case(name, make, start, causal, backward, n, top) -> None:
    print(f"\n########## {name} (new lengths from {start + 1}, {n} per measurement)")
    _calls(make, start, 1, causal, backward)[0]()  # the bucket's graphs (outside the measured lengths)
    first = [_host_and_wall(c) for c in _calls(make, start + 1, n, causal, backward)]
    again = _calls(make, start + n, 1, causal, backward)[0]
    for _ in range(3):
        again()
    repeated = [_host_and_wall(again) for _ in range(n)]
    for label, rows in (("first", first), ("repeated", repeated)):
        host, wall = (statistics.median(r[i] for r in rows) for i in (0, 1))
        print(f"{label:9s} host {host:8.1f} us   wall {wall:8.1f} us")
    step = max(n, 8)  # each measurement's lengths new to the process
    for label, calls in (("first calls", _calls(make, start + 2 * step + 1, 8, causal, backward)),
                         ("repeated calls", [again] * 8)):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for c in calls:
                c()
            torch.cuda.synchronize()
        print(f"--- torch.profiler, 8 {label}")
        print(_table(prof, top))
    calls = _calls(make, start + 3 * step + 1, n, causal, backward)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for c in calls:
        c()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    print(f"--- cProfile, {n} first calls (cumulative)")
    print(text.getvalue())


_SEGMENTS = (("engine.dense", ("forward", "backward", "_rebound", "_fwd_family", "_bwd_family")),
             ("engine.folded", ("bind_forward", "bind_backward", "run_forward", "run_backward", "small_tensors",
                                "made_at", "_order")),
             ("engine.fold_family", ("rebind_forward", "rebind")),
             ("engine.fold_values", ("resolve", "_upload")),
             ("engine.binding", ("run",)),
             ("ops.route", ("call",)))


def _wrap_segments() -> dict:
    """Wrap the package's steps (``_SEGMENTS``) with host-time accumulators; returns {name: [s, n]}."""
    import importlib

    acc: dict = {}
    for mod_name, names in _SEGMENTS:
        mod = importlib.import_module(f"cudnn_sdpa_provider.{mod_name}")
        for name in names:
            real, slot = getattr(mod, name), acc.setdefault(f"{mod_name.split('.')[-1]}.{name}", [0.0, 0])

            def timed(*args, _real=real, _slot=slot, **kwargs):
                t = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    _slot[0] += time.perf_counter() - t
                    _slot[1] += 1

            setattr(mod, name, timed)
    return acc


def segments(n: int) -> None:
    acc = _wrap_segments()
    for name, make, start, causal, backward in CASES:
        _calls(make, start, 1, causal, backward)[0]()
        for label, calls in (("first", _calls(make, start + 1, n, causal, backward)), ("repeated", None)):
            if calls is None:
                again = _calls(make, start + n, 1, causal, backward)[0]
                for _ in range(3):
                    again()
                calls = [again] * n
            for slot in acc.values():
                slot[0], slot[1] = 0.0, 0
            host = statistics.median(_host_and_wall(c)[0] for c in calls)
            rows = sorted(((k, v[0] / n * 1e6, v[1] / n) for k, v in acc.items() if v[1]), key=lambda r: -r[1])
            print(f"{name:16s} {label:9s} host {host:7.1f} us/call: "
                  + ", ".join(f"{k} {us:.1f} ({c:g}x)" for k, us, c in rows))
    from cudnn_sdpa_provider.engine import fold_values as fv

    print("pinned host buffer:", torch.empty(8, dtype=torch.int32, pin_memory=True).is_pinned())
    a = torch.randn(8192, 8192, device="cuda")
    for busy in (False, True):
        fv.clear()
        torch.cuda.synchronize()
        if busy:
            for _ in range(4):
                a @ a  # about 10 ms of work queued ahead of the upload
        t = time.perf_counter()
        dev = torch.device("cuda", torch.cuda.current_device())
        fv.resolve([fv.length_request(8, 1234 + busy, dev, fv.stream_of(dev))], dev)
        print(f"one small upload, GPU {'busy' if busy else 'idle'}: {(time.perf_counter() - t) * 1e6:.1f} us host")
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=16)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--segments", action="store_true", help="host time per package step instead")
    a = parser.parse_args(argv)
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    with csp.enable():
        F.scaled_dot_product_attention(*decode_inputs(64), enable_gqa=True)
        if a.segments:
            segments(a.lengths)
            return 0
        for spec in CASES:
            case(*spec, a.lengths, a.top)
    print(csp.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
