"""The Python cost of a dense decode call at a new KV length, on CPU, with the CPU tier's stand-in cuDNN.

What it measures: ``engine.dense.forward`` (the folded, length-bucketed path) on a decode call
(S_q = 1, GQA) over a contiguous KV cache whose length grows by one each call, against the same
call repeated. The stand-in's execute is replaced by a no-op, so the time is the package's Python
and torch's CPU bookkeeping only: no kernel, no upload to a GPU. It is the part of GPU run 58's
first-call cost (0.319 ms against 0.125 ms repeated, an H100) that does not need a GPU to see.

    python3 scripts/new_length_host_cpu.py [--lengths 200] [--rounds 3]

Prints the median over rounds of the mean time per new-length call and per repeated call, in us.
Timings on a shared 2-core machine vary between runs: compare rows of one run.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cudnn_sdpa_provider.engine import dense, graphs  # noqa: E402
from tests import fake_cudnn  # noqa: E402


class _Patch:
    """The part of pytest's monkeypatch that ``fake_cudnn.install`` uses."""

    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=200, help="new lengths per round")
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    fake_cudnn.install(_Patch())
    fake_cudnn.FakeGraph.execute = lambda self, *args, **kw: None
    b, h_q, h_kv, d, start = 2, 8, 2, 64, 2100
    q = torch.randn(b, h_q, 1, d).bfloat16()
    cache = torch.randn(b, h_kv, start + a.lengths * (a.rounds + 1), d).bfloat16()

    def call(s):
        k = cache[:, :, :s].contiguous()  # as a cache concatenated along S: contiguous BHSD
        return k, k.clone()

    def timed(pairs) -> float:
        t = time.perf_counter()
        for k, v in pairs:
            dense.forward(q, k, v, scale=0.125, compute_lse=False)
        return (time.perf_counter() - t) / len(pairs) * 1e6

    dense.forward(q, *call(start), scale=0.125, compute_lse=False)  # builds the bucket's graph
    timed([call(s) for s in range(start + 1, start + 1 + a.lengths)])  # warm-up round
    new, repeated = [], []
    for r in range(a.rounds):
        lo = start + 1 + a.lengths * (r + 1)
        pairs = [call(s) for s in range(lo, min(lo + a.lengths, cache.shape[2]))]
        new.append(timed(pairs))
        repeated.append(timed(pairs[:1] * len(pairs)))
    print(f"torch {torch.__version__}, B {b}, H {h_q}/{h_kv}, D {d}, S_kv from {start}; "
          f"graphs built: {graphs.cache_info()['built']}")
    print(f"new length {statistics.median(new):7.1f} us/call   repeated {statistics.median(repeated):6.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
