"""What a Triton launch costs the host through ``JITFunction.run`` against the compiled kernel's own
launcher, on the FP8 dequantisation kernel (GPU; a probe, not package code).

    python3 scripts/triton_launch_probe.py [--n 16777216]

Launches ``ops.fp8_quant_triton._dequant_kernel`` (4 runtime arguments, 2 constexprs) through
``kernel[grid](...)`` and through the ``CompiledKernel`` that call returned, called as
``JITFunction.run`` calls it in triton 3.3-3.6 (``kernel.run(grid..., stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *every bound argument)``), each behind a
GPU sleep (host time per launch, median of 5 rounds of 200), and checks that both write the same
bits (outputs poisoned with NaN first). Run it in its own process: a launcher called with
arguments it does not expect may fault the CUDA context.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import triton  # noqa: E402

from cudnn_sdpa_provider.ops import fp8_quant_triton as fqt  # noqa: E402


def _host(fn, n=200, rounds=5):
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3e8))
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24)
    args = parser.parse_args(argv)
    n = args.n
    x = (torch.randn(n, device="cuda") * 100).to(torch.float8_e4m3fn).view(torch.uint8)
    factor = torch.full((1,), 0.125, device="cuda")
    grid = (triton.cdiv(n, fqt.BLOCK),)
    out_jit = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
    out_direct = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    jit = lambda out: fqt._dequant_kernel[grid](x, out, n, factor, BLOCK=fqt.BLOCK, SOFT=False,  # noqa: E731
                                                num_warps=fqt._WARPS)
    compiled = jit(out_jit)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    try:  # triton 3.4+: the hooks live in knobs; before, on CompiledKernel
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except ImportError:
        hooks = (type(compiled).launch_enter_hook, type(compiled).launch_exit_hook)

    def direct(out=out_direct):
        values = (x, out, n, factor, fqt.BLOCK, False)
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values), *hooks, *values)

    try:
        direct()
        torch.cuda.synchronize()
    except Exception as exc:  # another triton's launcher signature: say so
        print(f"direct launch refused: {type(exc).__name__}: {exc}")
        return 1
    same = torch.equal(out_jit.view(torch.int16), out_direct.view(torch.int16))
    print(f"same bits: {same} (every parameter passed, constexprs included, in signature order)")
    empty = _host(lambda: torch.empty(1, device="cuda"))
    print(f"host per launch: JITFunction.run {_host(lambda: jit(out_jit)):6.1f} us, "
          f"compiled launcher {_host(direct):6.1f} us, torch.empty(1) {empty:6.1f} us")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
