"""The Python cost of a served decode call through ``csp.attention`` (what the transformers
integration calls) against the F.sdpa override (what ``enable()`` serves), on CPU, with the CPU
tier's stand-in cuDNN.

Both paths run their real code down to the engine's execute, which is replaced by a no-op, on CPU
float32 tensors decided as if they were bf16 on a CUDA machine (the ``no_cuda`` and ``dtype``
rules left out; the eager Function's CUDA kernel taken for CPU tensors), under inference mode:
a decode step of the bench's model, q (8, 32, 1, 128) seen through ``transpose(1, 2)``, K/V
(8, 8, 600, 128) contiguous. ``--window causal`` passes the integration's decode mask (causal,
bottom-right), ``none`` no mask. Prints the median over rounds of the mean time per call, in us;
on a shared machine compare rows of one run.

    python3 scripts/functional_host_cpu.py [--window causal|none] [--rounds 9] [--calls 500]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cudnn_sdpa_provider import functional  # noqa: E402
from cudnn_sdpa_provider.core import counters, support  # noqa: E402
from cudnn_sdpa_provider.hooks import overrides  # noqa: E402
from cudnn_sdpa_provider.ops import dense_varlen, route  # noqa: E402
from tests import fake_cudnn  # noqa: E402


class _Patch:
    """The part of pytest's monkeypatch that ``fake_cudnn.install`` uses."""

    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


class _Native:
    def call_boxed(self, *args, **kwargs):
        raise AssertionError("a served call reached PyTorch's kernel")


def _cuda_kernels_for_cpu() -> None:
    """The eager Functions' kernel table (closed over by their forward and no_grad) maps "cpu" to
    the CUDA kernel, as the route would run it on a GPU."""
    for fn in (dense_varlen.DenseFunction.forward, getattr(dense_varlen.DenseFunction, "no_grad", None)):
        for cell in getattr(fn, "__closure__", None) or ():
            if isinstance(cell.cell_contents, dict) and "cuda" in cell.cell_contents:
                cell.cell_contents["cpu"] = cell.cell_contents["cuda"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", choices=("causal", "none"), default="causal")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=500)
    a = parser.parse_args(argv)
    fake_cudnn.install(_Patch())
    fake_cudnn.FakeGraph.execute = lambda self, *args, **kw: None
    support.RULES = tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype"))
    route.clear()
    _cuda_kernels_for_cpu()
    q = torch.randn(8, 1, 32, 128).transpose(1, 2)
    k, v = torch.randn(8, 8, 600, 128), torch.randn(8, 8, 600, 128)
    mask = dict(window=(-1, 0), bottom_right=True) if a.window == "causal" else {}
    kernels = overrides._Dense(_Native(), _Native())
    paths = {
        "csp.attention (the integration)": lambda: functional.attention(q, k, v, **mask).transpose(1, 2).contiguous(),
        "F.sdpa override (enable())": lambda: kernels.forward(None, q, k, v, None, False, 0.0, False, False,
                                                              scale=None)[0].transpose(1, 2).contiguous(),
    }
    times: dict = {}
    with torch.inference_mode():
        for fn in paths.values():
            for _ in range(200):
                fn()
        for _ in range(a.rounds):
            for name, fn in paths.items():
                start = time.perf_counter()
                for _ in range(a.calls):
                    fn()
                times.setdefault(name, []).append((time.perf_counter() - start) / a.calls * 1e6)
    print(f"torch {torch.__version__}, decode B 8, H 32/8, D 128, S_kv 600, window {a.window}; us per call, "
          f"median of {a.rounds} rounds of {a.calls}")
    for name, values in times.items():
        print(f"  {name:34s} {statistics.median(values):7.1f}")
    fell_back = {path: e["fallback"] for path, e in counters.stats().to_dict().items() if e["fallback"]}
    if fell_back:
        print(f"not served (the timings above are not the served paths'): {fell_back}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
