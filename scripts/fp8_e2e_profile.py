"""Where an FP8 call from bf16 activations spends its time (GPU): kernels against wall time.

    python3 scripts/fp8_e2e_profile.py [--shape 1,32,32,4096,128] [--no-causal] [--calls 20]

For ``csp.fp8.attention`` with each recipe (delayed, current), forward and forward+backward, and
for bf16 native ``F.scaled_dot_product_attention`` beside them, on fresh random bf16 inputs every
call (four sets rotated and refilled outside the timed region):

* wall: milliseconds per call over back-to-back calls, synchronised at both ends (what a training
  step sees when nothing else hides the host);
* host: milliseconds of CPU per call to issue it (the same loop without the final sync, issued
  behind a long GPU sleep so that the queue never drains), over at most ``QUEUE_LAUNCHES`` kernel
  launches: a stream holds about a thousand pending launches, and a loop that issues more waits
  for the sleep to end (run 56's forward+backward "host" of 56 ms was that wait: 106-162 launches
  per call x 20 calls); a path that synchronises with the GPU inside the call (the current recipe's
  backward checks saturation on the host) has no host time to measure this way: ``n/a (synchronises)``;
* kernels: the sum of the call's GPU kernel time (torch.profiler), and its kernels by total time.

Each FP8 path's line ends with native's time over its own, by wall and by kernels: the kernels'
ratio is what the path would reach if its host time were hidden entirely (its floor on this GPU).

When wall is close to host and above kernels, the call is bound by the host; when wall is close to
kernels, by the GPU. The quantisation implementation follows ``CUDNN_SDPA_PROVIDER_FP8_QUANT``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.ops import fp8_quant  # noqa: E402

SETS = 4
#: Launches issued behind the sleep when host time is measured: well below a stream's queue.
QUEUE_LAUNCHES = 400


def _sets(b, h, hk, s, d, gen):
    def one():
        q = torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        go = torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), go]
    return [one() for _ in range(SETS)]


def _step(path, mode, causal, gqa):
    recipe = csp.fp8.Recipe(scaling=path) if path in ("delayed", "current") else None

    def call(q, k, v, go):
        if recipe is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        else:
            out = csp.fp8.attention(q, k, v, is_causal=causal, recipe=recipe)
        if mode == "fwd_bwd":
            torch.autograd.grad(out, (q, k, v), go)
        return out
    return call


def _loop(call, sets, n, sync=True):
    for i in range(n):
        call(*sets[i % SETS])
    if sync:
        torch.cuda.synchronize()


def measure(path, mode, sets, causal, gqa, calls):
    call = _step(path, mode, causal, gqa)
    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
        _loop(call, sets, 8)  # warm-up: graphs built, recipe histories filled
        start = time.perf_counter()
        _loop(call, sets, calls)
        wall = (time.perf_counter() - start) / calls * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _loop(call, sets, calls)
        kernels = {}
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(evt.name, [0, 0.0])
                kernels[evt.name][0] += 1
                kernels[evt.name][1] += getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
        launches = sum(c for c, _ in kernels.values()) / calls
        # host: issue calls behind a long GPU wait, never more launches than the queue holds
        n = max(1, min(calls, int(QUEUE_LAUNCHES // max(launches, 1.0))))
        torch.cuda._sleep(int(2e9))  # about a second of GPU spin on an H100/H200
        start = time.perf_counter()
        _loop(call, sets, n, sync=False)
        host = (time.perf_counter() - start) / n * 1e3
        # the sleep outlasts any loop that issues without waiting: an idle stream here means a call
        # synchronised with the GPU (the current recipe's backward does), and the time above is the wait
        waited = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
    total = sum(t for _, t in kernels.values()) / calls / 1e3
    host_text = "host     n/a (synchronises)" if waited else f"host {host:7.3f} ms"
    print(f"{path:8s} {mode:8s} wall {wall:7.3f} ms  {host_text}  kernels {total:7.3f} ms  "
          f"launches/call {launches:.1f} (host over {n} calls)")
    if waited:
        host = float("nan")
    for name, (count, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"    {t / calls / 1e3:7.3f} ms  x{count / calls:4.1f}  {name[:110]}")
    return wall, host, total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,32,32,4096,128", help="B,H_q,H_kv,S,D")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="then cProfile N calls of the delayed recipe per mode (top 30 by own time), and "
                             "the host time of one quantisation per implementation")
    args = parser.parse_args(argv)
    b, h, hk, s, d = (int(x) for x in args.shape.split(","))
    causal = not args.no_causal
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = _sets(b, h, hk, s, d, gen)
    x = sets[0][0]
    print(f"{torch.cuda.get_device_name()}: ({b}, {h}/{hk}, {s}, {d}) causal={causal}; quantisation "
          f"{fp8_quant.choose(os.environ.get('CUDNN_SDPA_PROVIDER_FP8_QUANT', 'auto'), x)}")
    for mode in args.modes.split(","):
        native, _, native_kernels = measure("native", mode, sets, causal, h != hk, args.calls)
        for path in ("delayed", "current"):
            wall, _, kernels = measure(path, mode, sets, causal, h != hk, args.calls)
            print(f"    -> native / {path} = {native / wall:.2f}x wall, {native_kernels / kernels:.2f}x kernels "
                  f"(the ratio with the host hidden)")
    if args.cprofile:
        host_breakdown(sets, causal, h != hk, args.modes.split(","), args.cprofile)
    return 0


def host_breakdown(sets, causal, gqa, modes, calls):
    import cProfile
    import pstats

    x = sets[0][0].detach()
    for impl in fp8_quant.IMPLS:
        try:
            fn = lambda: fp8_quant.current(x, torch.float8_e4m3fn, impl=impl)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(1e9))
            start = time.perf_counter()
            for _ in range(50):
                fn()
            host = (time.perf_counter() - start) / 50 * 1e6
            torch.cuda.synchronize()
            print(f"quantise one tensor, current, {impl:8s}: host {host:7.1f} us/call")
        except Exception as exc:  # an implementation missing here (no triton): say so, go on
            print(f"quantise one tensor, current, {impl:8s}: {type(exc).__name__}: {exc}")
    for mode in modes:
        call = _step("delayed", mode, causal, gqa)
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            _loop(call, sets, 8)
            prof = cProfile.Profile()
            prof.enable()
            _loop(call, sets, calls)
            prof.disable()
        print(f"cProfile, delayed {mode}, {calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    sys.exit(main())
