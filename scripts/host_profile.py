"""Where the host time of a served call goes, at the tiny shape (1, 2, 128, 64) bf16 causal (GPU).

    python3 scripts/host_profile.py [--calls 2000] [--profile 500] [--quick] [--kernels N] [--cprofile N]

``--quick``: only the four F.sdpa rows (native and provider, forward and forward+backward), through
the public API alone, so ``CSP_UNDER_TEST=<dir>`` can time another copy of the package (an older
commit's) on the same host for an A/B.

``--kernels N``: the GPU kernels of N forward+backward calls (torch.profiler), native and provider.
``--cprofile N`` (with ``--quick``): cProfile of N provider forward and forward+backward calls.

Layer by layer, microseconds per call over ``--calls`` back-to-back calls (one sync at the end; the
median of 5 such runs), wall time and the CPU time of all threads (which includes the final sync's
spin, and equals the wall time when the process is pinned to one core): PyTorch's native cuDNN path, the provider through F.sdpa,
``csp.attention`` (eager, and through its custom ops as compiled code gets it), the route's decision
for a seen signature (``route.entry`` + ``route.call`` around nothing), ``dense.forward`` through its
binding, ``graphs.execute`` (handle stream + workspace + the frontend's execute) and the frontend's
``graph.execute`` alone (with a mapping, and with ordered buffers where the frontend has
``tensor_uids``), and the two output allocations. Then, for the provider's forward and forward+backward, how much of
the wall time is spent inside its overrides and executes, and cProfile's top entries (native's
forward+backward for comparison). The breakdown is in docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import sys
from time import perf_counter, process_time

# CSP_UNDER_TEST=<dir>: import the package from <dir> (with --quick: an older commit's copy)
sys.path.insert(0, os.environ.get("CSP_UNDER_TEST") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402


def per_call_us(fn, calls: int, runs: int = 5) -> tuple[float, float]:
    """(wall, CPU) microseconds per call, each the median of ``runs`` runs of ``calls`` calls. CPU
    time is the process's, every thread's (autograd runs backwards on a device thread of its own):
    the host work, without the waits while one thread hands a call to another."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times, cpu = [], []
    for _ in range(runs):
        t0, c0 = perf_counter(), process_time()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((perf_counter() - t0) / calls * 1e6)
        cpu.append((process_time() - c0) / calls * 1e6)
    return statistics.median(times), statistics.median(cpu)


def breakdown(fn, calls: int) -> dict:
    """Wall us per call of ``fn`` under ``enable()``, and of it the time inside the dense cuDNN
    op's forward and backward overrides (each including its execute) and inside ``graphs.execute``
    (both executes); what is left is PyTorch's: dispatch, autograd, the device thread's handoff."""
    spent: dict = collections.defaultdict(float)

    def timed(name, f):
        def wrapper(*args, **kwargs):
            t0 = perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += perf_counter() - t0
        return wrapper

    from cudnn_sdpa_provider.engine import graphs
    from cudnn_sdpa_provider.hooks import overrides

    saved = [(overrides._Dense, "forward"), (overrides._Dense, "backward"), (graphs, "execute")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    for owner, name, f in saved:
        setattr(owner, name, timed(name if owner is graphs else f"override {name}", f))
    try:
        with csp.enable():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            spent.clear()
            t0 = perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            total = perf_counter() - t0
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    per = {name: us / calls * 1e6 for name, us in spent.items()}
    per["total"] = total / calls * 1e6
    per["outside the overrides"] = per["total"] - per.get("override forward", 0) - per.get("override backward", 0)
    return per


def cprofile(title: str, fn, calls: int, top: int, scope) -> None:
    """Print cProfile's ``top`` entries by own time for ``calls`` calls of ``fn`` inside ``scope()``
    (after one untimed call)."""
    prof = cProfile.Profile()
    with scope():
        fn()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(f"\ncProfile, {title}, by own time:")
    print(text.getvalue())


def kernels(title: str, fn, calls: int) -> None:
    """Print what the GPU ran for ``calls`` calls of ``fn`` (after warm-up): each kernel's launches
    and CUDA time per call, and the host time per call of the busiest operators."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device = [e for e in events if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in device) / calls
    print(f"\nkernels, {title}, per call over {calls} calls: {total:.1f} us of GPU time", flush=True)
    for e in sorted(device, key=lambda e: -e.self_device_time_total):
        print(f"  {e.count / calls:5.1f} x {e.self_device_time_total / calls:8.1f} us  {e.key[:110]}")
    on_device = {id(e) for e in device}
    host = sorted((e for e in events if id(e) not in on_device), key=lambda e: -e.self_cpu_time_total)[:15]
    print(f"host operators, {title}, self CPU us per call:")
    for e in host:
        print(f"  {e.count / calls:5.1f} x {e.self_cpu_time_total / calls:8.1f} us  {e.key[:110]}")


class _Rows:
    """Prints each (name, us) row as it is appended, so a failure later keeps what was measured."""

    def __init__(self, title: str):
        print(title, flush=True)

    def append(self, row: tuple) -> None:
        name, us = row
        wall, cpu = us if isinstance(us, tuple) else (us, float("nan"))
        print(f"  {name.ljust(48)}  {wall:8.1f}  {cpu:8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="only the F.sdpa rows, public API only")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also with --quick: cProfile's top entries for N provider forward and N "
                             "forward+backward calls (public API only)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also: the GPU kernels of N provider and N native forward+backward calls "
                             "(torch.profiler), per call")
    args = parser.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    go = torch.randn_like(q)
    scale = 64 ** -0.5

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_bwd():
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(out, (qg, kg, vg), go)

    def attention():
        return csp.attention(q, k, v, is_causal=True)

    def attention_bwd():
        out = csp.attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(out, (qg, kg, vg), go)

    rows = _Rows(f"host us per call (wall, CPU of all threads), (1, 2, 128, 64) bf16 causal, {args.calls} calls "
                 f"x 5 runs, median; "
                 f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        rows.append(("native cuDNN F.sdpa forward", per_call_us(sdpa, args.calls)))
        rows.append(("native cuDNN F.sdpa forward+backward", per_call_us(sdpa_bwd, args.calls)))
    with csp.enable():
        rows.append(("provider F.sdpa forward", per_call_us(sdpa, args.calls)))
        rows.append(("provider F.sdpa forward+backward", per_call_us(sdpa_bwd, args.calls)))
    print(f"  (package {csp.__file__})", flush=True)
    if args.kernels:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            kernels("native cuDNN F.sdpa forward+backward", sdpa_bwd, args.kernels)
        with csp.enable():
            kernels("provider F.sdpa forward+backward", sdpa_bwd, args.kernels)
    if args.quick:
        for name, fn in (("forward", sdpa), ("forward+backward", sdpa_bwd)) if args.cprofile else ():
            cprofile(f"provider F.sdpa {name} x {args.cprofile}", fn, args.cprofile, 40, csp.enable)
        return
    from cudnn_sdpa_provider.engine import dense, graphs
    from cudnn_sdpa_provider.ops import dense_varlen as ops, route  # internals: the current package's layout

    def engine_fwd():
        return dense.forward(q, k, v, scale=scale, window=(-1, 0))

    found = route.entry(("host_profile",), lambda: route.dense_problem(q, k, v, window=(-1, 0)), 0)

    def decision():
        return route.call("dense_fwd", route.entry(("host_profile",), None, 0), lambda: None, None, lambda: "")

    rows.append(("csp.attention forward", per_call_us(attention, args.calls)))
    rows.append(("csp.attention forward+backward", per_call_us(attention_bwd, args.calls)))
    eager, ops.eager = ops.eager, lambda *tensors: False  # what compiled/traced calls get: the custom ops
    try:
        rows.append(("csp.attention forward, custom op", per_call_us(attention, args.calls)))
        rows.append(("csp.attention forward+backward, custom op", per_call_us(attention_bwd, args.calls)))
    finally:
        ops.eager = eager
    assert found.first is None, found.first
    rows.append(("route decision of a seen signature (no work)", per_call_us(decision, args.calls)))
    rows.append(("dense.forward through its binding", per_call_us(engine_fwd, args.calls)))

    engine_fwd()  # the cache is LRU-ordered: the last dense forward binding is engine_fwd's
    binding = next(b for key, b in reversed(graphs._state()["fast"].items()) if key[0] == "dense_fwd")
    (size, stride), (lse_size, _) = binding.outputs
    out = torch.empty_strided(size, stride, dtype=q.dtype, device="cuda")
    lse = torch.empty(lse_size, dtype=torch.float32, device="cuda")
    uids, ordered = binding.uids, (q, k, v, out, lse)
    stream = torch.cuda.current_stream().cuda_stream
    rows.append(("graphs.execute (stream, workspace, execute)",
                 per_call_us(lambda: graphs.execute(binding.plan, uids, ordered, 0, stream), args.calls)))
    handle = graphs._handle(0)
    ws = torch.empty(max(binding.plan.workspace, 1), dtype=torch.uint8, device="cuda")
    graph = binding.plan.graph
    mapping = dict(zip(uids, ordered))
    rows.append(("frontend graph.execute(dict) alone", per_call_us(lambda: graph.execute(mapping, ws, handle=handle),
                                                                     args.calls)))
    try:
        graph.execute(ordered, ws, handle=handle, tensor_uids=uids)
        torch.cuda.synchronize()
        rows.append(("frontend graph.execute(ordered, tensor_uids)",
                     per_call_us(lambda: graph.execute(ordered, ws, handle=handle, tensor_uids=uids), args.calls)))
    except TypeError as exc:
        rows.append((f"frontend graph.execute(ordered): not in this frontend ({exc})", float("nan")))
    rows.append(("torch.empty x2 (out, lse)", per_call_us(
        lambda: (torch.empty_strided(size, stride, dtype=q.dtype, device="cuda"),
                 torch.empty(lse_size, dtype=torch.float32, device="cuda")), args.calls)))

    for name, fn in (("forward", sdpa), ("forward+backward", sdpa_bwd)):
        parts = breakdown(fn, args.calls)
        print(f"\nprovider F.sdpa {name}, where the time goes (us per call, one run of {args.calls}): "
              + ", ".join(f"{part} {us:.1f}" for part, us in parts.items()), flush=True)

    cprofile(f"native cuDNN F.sdpa forward+backward x {args.profile}", sdpa_bwd, args.profile, 12,
             lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))
    for name, fn in (("forward", sdpa), ("forward+backward", sdpa_bwd)):
        cprofile(f"provider F.sdpa {name} x {args.profile}", fn, args.profile, 25, csp.enable)


if __name__ == "__main__":
    main()
