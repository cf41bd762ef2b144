"""Host cost of one eager paged decode call, part by part (GPU).

    python3 scripts/paged_host.py [--calls 1000] [--batch 8] [--context 4096]

Wall time per call over ``--calls`` back-to-back calls (one sync at the end; median of 5 rounds)
of: the whole ``csp.attention(block_table=)`` call, ``paged.forward`` (the served path without the
argument checks and the route), ``rows.paged_guard`` and the output fix alone, and the same call's
kernels counted by torch.profiler. bf16 decode, H 32/8, d128, block 16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.engine import paged
from cudnn_sdpa_provider.core import rows  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, m, bs = args.batch, args.context // 16, 16
    q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(b * m + 8, 8, bs, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    table = torch.randperm(kc.shape[0], device="cuda", generator=gen)[: b * m].view(b, m).int()
    lk = torch.randint(args.context // 2, args.context + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    lq = torch.ones(b, device="cuda", dtype=torch.int32)
    scale = 128 ** -0.5
    parts = {
        "csp.attention(block_table=)": lambda: csp.attention(q, kc, vc, block_table=table, seq_lens_kv=lk,
                                                                    kv_layout="HND"),
        "paged.forward": lambda: paged.forward(q, kc, vc, table, lq, lk, scale=scale),
        "rows.paged_guard": lambda: rows.paged_guard(table, lq, lk, kc.shape[0], bs, 1),
        "rows.paged_dead_rows + two masked_fill_": lambda: torch.empty(b, 32, 1, 128, device="cuda").masked_fill_(
            rows.paged_dead_rows(1, (-1, -1), False, lq, lk), 0).masked_fill_(lk.view(-1, 1, 1, 1) < 0, 0.0),
        "torch.empty x2 (out, lse)": lambda: (torch.empty(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16),
                                              torch.empty(b, 32, 1, 1, device="cuda")),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; decode B={b} context {args.context}, "
          f"{args.calls} calls per round, median of 5 rounds", flush=True)
    with torch.no_grad():
        for fn in parts.values():
            fn()
        for name, fn in parts.items():
            print(f"{name:42s} {per_call_us(fn, args.calls):8.1f} us per call", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                parts["csp.attention(block_table=)"]()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"kernels per csp.attention call: {len(kernels) / 10:.1f}", flush=True)
    names = sorted({e.name for e in kernels})
    print("kernel names:", "; ".join(n[:60] for n in names), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
