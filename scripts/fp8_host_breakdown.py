"""Where the host time of an FP8 call from bf16 activations goes (GPU): inclusive time per function.

    python3 scripts/fp8_host_breakdown.py [--shape 1,32,32,4096,128] [--no-causal] [--scaling delayed]

Wraps the functions an FP8 call passes through (``FUNCTIONS``, and every Triton launch) with a
timer, issues calls behind a long GPU sleep (so that no call waits for the GPU and the stream's
queue never fills: at most ``QUEUE_LAUNCHES`` launches), and prints, per call, the host time of
the whole call and each function's inclusive time and count. Nested functions count in their
callers too; a wrapper adds well under a microsecond. Also the floor: an empty Triton kernel's
launch, ``torch.empty`` and ``torch.zeros`` of one element.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.ops import fp8_ops  # noqa: E402

QUEUE_LAUNCHES = 400
#: Calls issued per measurement: about 11 launches per forward, 46 per forward+backward.
CALLS = {"fwd": 20, "fwd_bwd": 8}
P = "cudnn_sdpa_provider."
FUNCTIONS = [
    "fp8:_Attention.forward", "fp8:_Attention.backward", "fp8:_quantize", "fp8:attention",
    "ops.fp8_ops:quantize_inputs", "ops.fp8_ops:dequantize", "ops.fp8_ops:dequantize_grads", "ops.fp8_ops:_entry",
    "ops.fp8_ops:_bwd", "ops.fp8_ops:_warm", "ops.fp8_ops:_holder", "ops.fp8_ops:quantize",
    "ops.fp8_quant:attention_inputs", "ops.fp8_quant:dequantize", "ops.fp8_quant:grouped", "ops.fp8_quant:delayed",
    "ops.fp8_quant:current", "ops.fp8_quant_triton:inputs", "ops.fp8_quant_triton:dequantize",
    "ops.fp8_quant_triton:dequantize_grads", "ops.fp8_quant_triton:delayed", "ops.fp8_quant_triton:current",
    "ops.fp8_grad_triton:grad_scales", "ops.fp8_grad_triton:grad_books",
    "engine.fp8_cudnn:forward", "engine.fp8_cudnn:backward", "engine.fp8_cudnn:_amax_buffers",
    "engine.binding:lookup", "engine.binding:run", "engine.binding:outputs", "engine.binding:small_operand",
    "engine.graphs:execute", "ops.route:call", "ops.route:entry",
]
totals: dict = defaultdict(float)
counts: dict = defaultdict(int)


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            counts[name] += 1
    return wrapper


def instrument():
    for spec in FUNCTIONS:
        mod_name, attr = spec.split(":")
        try:
            mod = importlib.import_module(P + mod_name)
        except ImportError as exc:
            print(f"  (not wrapped: {spec}: {exc})")
            continue
        owner, *rest = attr.split(".")
        if rest:  # Class.method (a staticmethod here)
            cls = getattr(mod, owner)
            setattr(cls, rest[0], staticmethod(_timed(spec, getattr(cls, rest[0]))))
        else:
            setattr(mod, owner, _timed(spec, getattr(mod, owner)))
    for kind in ("fwd", "bwd"):  # the kernels are reached through this table
        fp8_ops._KERNELS[kind]["cuda"] = _timed(f"ops.fp8_ops:_fp8_{kind}_cuda", fp8_ops._KERNELS[kind]["cuda"])
    try:
        from triton.runtime.jit import JITFunction

        JITFunction.run = _timed("triton JITFunction.run", JITFunction.run)
    except ImportError:
        pass


def floors():
    out = {}
    x = torch.empty(1, device="cuda")
    for name, fn in (("torch.empty(1)", lambda: torch.empty(1, device="cuda")),
                     ("torch.zeros(1)", lambda: torch.zeros(1, device="cuda")),
                     ("x.view(1,1,1,1)", lambda: x.view(1, 1, 1, 1))):
        out[name] = _host(fn, 200)
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _noop(p, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(p + i, tl.load(p + i, mask=i < n), mask=i < n)

        _noop[(1,)](x, 1, BLOCK=16)
        out["triton launch, 3 args"] = _host(lambda: _noop[(1,)](x, 1, BLOCK=16), 200)
    except Exception as exc:  # no triton here: say so
        out["triton"] = f"{type(exc).__name__}: {exc}"
    return out


def _host(fn, n):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,32,32,4096,128", help="B,H_q,H_kv,S,D")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--scaling", default="delayed", choices=("delayed", "current"))
    args = parser.parse_args(argv)
    b, h, hk, s, d = (int(x) for x in args.shape.split(","))
    causal = not args.no_causal
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(4):
        q = torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        k, v = (torch.randn(b, hk, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
                for _ in range(2))
        sets.append((q, k, v, torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)))
    recipe = csp.fp8.Recipe(scaling=args.scaling)
    print(f"{torch.cuda.get_device_name()}: ({b}, {h}/{hk}, {s}, {d}) causal={causal}, {args.scaling}; torch "
          f"{torch.__version__}")
    for name, value in floors().items():
        print(f"floor  {name:28s} {value if isinstance(value, str) else f'{value:7.1f} us'}")

    def call(q, k, v, go, mode):
        out = csp.fp8.attention(q, k, v, is_causal=causal, recipe=recipe)
        if mode == "fwd_bwd":
            torch.autograd.grad(out, (q, k, v), go)

    plain = {}
    for mode in ("fwd", "fwd_bwd"):  # first without the wrappers
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            for i in range(8):
                call(*sets[i % 4], mode)
            torch.cuda.synchronize()
            plain[mode] = _issue(call, sets, mode, CALLS[mode])
    instrument()
    for mode in ("fwd", "fwd_bwd"):
        n = CALLS[mode]
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            for i in range(2):
                call(*sets[i % 4], mode)
            torch.cuda.synchronize()
            totals.clear()
            counts.clear()
            host = _issue(call, sets, mode, n)
        print(f"\n{mode}: host {plain[mode]:8.1f} us/call plain, {host:8.1f} instrumented ({n} calls)")
        for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {t / n * 1e6:8.1f} us  x{counts[name] / n:5.1f}  {name}")
    return 0


def _issue(call, sets, mode, n):
    torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    for i in range(n):
        call(*sets[i % 4], mode)
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


if __name__ == "__main__":
    sys.exit(main())
