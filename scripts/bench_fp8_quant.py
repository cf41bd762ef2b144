"""Issue #30's quantisation rows: bf16 -> FP8 per-tensor quantisation (``ops.fp8_quant``), each
implementation and scaling, against the memory bandwidth (GPU).

    python3 scripts/bench_fp8_quant.py [--shape 1 32 4096 128] [--impls triton compiled torch]
                                       [--iters 50] [--warmup 10] [--json out.json]

Per (implementation, scaling), CUDA-event medians over ``--iters`` calls after ``--warmup`` (ms), on
a pool of random non-zero bf16 tensors of ``--shape`` cycled call by call (more bytes than the L2
holds, so every call reads from memory; magnitudes stay close, so a delayed recipe keeps its
scale, as in training). Rows:
  current   amax then scaled cast (two reads of x, one FP8 write)
  delayed   scale from an amax history, one pass (one read, one write) plus the check launch
  qkv       three tensors, as ``csp.fp8.attention``'s forward quantises q, k and v
  copy      x.clone(), 4 bytes an element (the bandwidth a pass reaches here; issue #30: 4.3 TB/s on the H200)
GB/s counts the bytes one ideal pass moves (read x once, write FP8 once: 3 bytes an element), so
100% of copy bandwidth would mean one pass at memory speed. Exit status 1 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

IMPLS = ("triton", "compiled", "torch")
COPY_TBS = 4.3  # H200 copy bandwidth measured in issue #30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[1, 32, 4096, 128], metavar=("B", "H", "S", "D"))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pool", type=int, default=4, help="input tensors cycled (fresh data every call)")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p.parse_args(argv)


def median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rows(args) -> list[dict]:
    from cudnn_sdpa_provider.ops import fp8_quant

    e4m3 = torch.float8_e4m3fn
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16, generator=gen) + 1e-3
            for _ in range(max(args.pool, 3))]
    n = pool[0].numel()
    ideal = 3 * n  # bytes: read bf16 once, write FP8 once
    turn = iter(range(1 << 60))
    pick = lambda: pool[next(turn) % len(pool)]  # noqa: E731
    out = []

    def add(name, impl, ms, tensors=1, nbytes=ideal):
        gbs = nbytes * tensors / (ms * 1e-3) / 1e9
        out.append({"row": name, "impl": impl, "shape": list(args.shape), "ms": round(ms, 4), "GB/s": round(gbs, 1),
                    "of_copy_bw": round(gbs / (COPY_TBS * 1e3), 3)})

    add("copy", "aten", median_ms(lambda: pick().clone(), args.iters, args.warmup), nbytes=4 * n)
    for impl in args.impls:
        if fp8_quant.choose(impl, pool[0]) != impl:
            print(f"skipping {impl}: not available here (triton missing?)", file=sys.stderr)
            continue
        add("current", impl, median_ms(lambda: fp8_quant.current(pick(), e4m3, impl=impl), args.iters, args.warmup))
        history = fp8_quant.History.zeros(16, 8, "cuda")
        delayed = lambda slot=0: fp8_quant.delayed(pick(), e4m3, history, slot, margin=2.0, impl=impl)  # noqa: E731
        add("delayed", impl, median_ms(delayed, args.iters, args.warmup))
        add("qkv current", impl, median_ms(lambda: [fp8_quant.current(pick(), e4m3, impl=impl) for _ in range(3)],
                                           args.iters, args.warmup), 3)
        add("qkv delayed", impl, median_ms(lambda: [delayed(s) for s in range(3)], args.iters, args.warmup), 3)
        if int(history.saturated.sum().item()):
            print(f"note: {impl}: {int(history.saturated.sum())} delayed calls saturated", file=sys.stderr)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_quant: needs a CUDA GPU", file=sys.stderr)
        return 1
    found = rows(args)
    print(f"{'row':<12} {'impl':<9} {'ms':>8} {'GB/s':>8} {'of 4.3 TB/s':>11}")
    for r in found:
        print(f"{r['row']:<12} {r['impl']:<9} {r['ms']:>8.4f} {r['GB/s']:>8.1f} {r['of_copy_bw']:>11.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
