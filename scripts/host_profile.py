"""Where the host time of a served call goes, at the tiny shape (1, 2, 128, 64) bf16 causal (GPU).

    python3 scripts/host_profile.py [--calls 2000] [--profile 500]

Layer by layer, microseconds of wall time per call over ``--calls`` back-to-back calls (one sync
at the end; the median of 5 such runs): PyTorch's native cuDNN path, the provider through F.sdpa,
``csp.attention`` (eager, and through its custom ops as compiled code gets it), ``engine.dense_fwd`` (the fast path), ``graphs.execute`` (handle stream +
workspace + the frontend's execute) and the frontend's ``graph.execute`` alone (with a mapping,
and with ordered buffers where the frontend has ``tensor_uids``). Then cProfile's top entries for
the provider's forward+backward. Notes: docs/performance-notes.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
from time import perf_counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider import engine, graphs, ops  # noqa: E402
from cudnn_sdpa_provider.graphs import UID  # noqa: E402


def per_call_us(fn, calls: int, runs: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", type=int, default=500)
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

    def engine_fwd():
        return engine.dense_fwd(q, k, v, scale=scale, window=(-1, 0))

    rows = []
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        rows.append(("native cuDNN F.sdpa forward", per_call_us(sdpa, args.calls)))
        rows.append(("native cuDNN F.sdpa forward+backward", per_call_us(sdpa_bwd, args.calls)))
    with csp.enable():
        rows.append(("provider F.sdpa forward", per_call_us(sdpa, args.calls)))
        rows.append(("provider F.sdpa forward+backward", per_call_us(sdpa_bwd, args.calls)))
    rows.append(("csp.attention forward", per_call_us(attention, args.calls)))
    rows.append(("csp.attention forward+backward", per_call_us(attention_bwd, args.calls)))
    eager, ops.eager = ops.eager, lambda *tensors: False  # what compiled/traced calls get: the custom ops
    try:
        rows.append(("csp.attention forward, custom op", per_call_us(attention, args.calls)))
        rows.append(("csp.attention forward+backward, custom op", per_call_us(attention_bwd, args.calls)))
    finally:
        ops.eager = eager
    rows.append(("engine.dense_fwd (fast path)", per_call_us(engine_fwd, args.calls)))

    engine_fwd()
    entry = next(e for key, e in graphs._state()["fast"].items() if key[0] == "dense_fwd")
    out = torch.empty_strided(entry.sizes[0], entry.strides[0], dtype=q.dtype, device="cuda")
    lse = torch.empty(entry.lse_size, dtype=torch.float32, device="cuda")
    buffers = {UID.Q: q, UID.K: k, UID.V: v, UID.O: out, UID.LSE: lse}
    stream = torch.cuda.current_stream().cuda_stream
    rows.append(("graphs.execute (stream, workspace, execute)",
                 per_call_us(lambda: graphs.execute(entry.plan, buffers, 0, stream), args.calls)))
    handle = graphs._handle(0)
    ws = torch.empty(max(entry.plan.workspace, 1), dtype=torch.uint8, device="cuda")
    graph = entry.plan.graph
    rows.append(("frontend graph.execute(dict) alone", per_call_us(lambda: graph.execute(buffers, ws, handle=handle),
                                                                     args.calls)))
    uids, ordered = tuple(int(u) for u in buffers), tuple(buffers.values())
    try:
        graph.execute(ordered, ws, handle=handle, tensor_uids=uids)
        torch.cuda.synchronize()
        rows.append(("frontend graph.execute(ordered, tensor_uids)",
                     per_call_us(lambda: graph.execute(ordered, ws, handle=handle, tensor_uids=uids), args.calls)))
    except TypeError as exc:
        rows.append((f"frontend graph.execute(ordered): not in this frontend ({exc})", float("nan")))
    rows.append(("torch.empty x2 (out, lse)", per_call_us(
        lambda: (torch.empty_strided(entry.sizes[0], entry.strides[0], dtype=q.dtype, device="cuda"),
                 torch.empty(entry.lse_size, dtype=torch.float32, device="cuda")), args.calls)))

    width = max(len(name) for name, _ in rows)
    print(f"host us per call, (1, 2, 128, 64) bf16 causal, {args.calls} calls x 5 runs, median; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for name, us in rows:
        print(f"  {name.ljust(width)}  {us:8.1f}")

    prof = cProfile.Profile()
    with csp.enable():
        sdpa_bwd()
        prof.enable()
        for _ in range(args.profile):
            sdpa_bwd()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(f"\ncProfile, provider F.sdpa forward+backward x {args.profile}, by own time:")
    print(text.getvalue())


if __name__ == "__main__":
    main()
