"""Host cost of one ``csp.fp8.forward`` call at a small shape (GPU): wall-clock microseconds per call
over back-to-back calls, beside the bare graph's execute, and a cProfile of the op's calls.

    python3 scripts/fp8_host.py [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from bench_fp8 import bare_forward  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (csp.fp8.quantize(t) for t in (q, k, v))
    scale_o = torch.tensor([32.0], device="cuda")
    fwd = lambda: csp.fp8.forward(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=scale_o,  # noqa: E731
                                  is_causal=True)
    bare = bare_forward(q8, k8, v8, (dq, dk, dv), scale_o, True, handle)
    print(f"(1, 2, 128, 128) causal: csp.fp8.forward {per_call_us(fwd, args.calls):.1f} us/call, bare graph execute "
          f"{per_call_us(bare, args.calls):.1f} us/call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        fwd()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
