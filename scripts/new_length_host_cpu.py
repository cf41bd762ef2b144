"""The Python cost of a dense decode call at a new KV length, on CPU, with the CPU tier's stand-in cuDNN.

What it measures: ``engine.dense.forward`` (the folded, length-bucketed path) on a decode call
(S_q = 1, GQA) over a contiguous KV cache whose length grows by one each call (``--case decode``),
or a causal prefill on token-major projections, forward and backward, at a new length each call
(``--case prefill``, the bench's ``new_length`` prefill layout; ``--case prefill_fwd`` the forward
alone), against the same call repeated. The stand-in's execute is replaced by a no-op, so the time is the package's Python
and torch's CPU bookkeeping only: no kernel, no upload to a GPU. It is the part of GPU run 58's
first-call cost (0.319 ms against 0.125 ms repeated, an H100) that does not need a GPU to see.

    python3 scripts/new_length_host_cpu.py [--case decode|prefill|prefill_fwd] [--lengths 100] [--rounds 3]

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

from cudnn_sdpa_provider.engine import dense, folded, graphs  # noqa: E402
from tests import fake_cudnn  # noqa: E402


class _Patch:
    """The part of pytest's monkeypatch that ``fake_cudnn.install`` uses."""

    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("decode", "prefill", "prefill_fwd"), default="decode")
    parser.add_argument("--lengths", type=int, default=100, help="new lengths per round")
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    fake_cudnn.install(_Patch())
    fake_cudnn.FakeGraph.execute = lambda self, *args, **kw: None
    b, h_q, h_kv, d, start = 2, 8, 2, 64, 2100
    if a.case == "decode":
        q = torch.randn(b, h_q, 1, d).bfloat16()
        cache = torch.randn(b, h_kv, start + a.lengths * (a.rounds + 1), d).bfloat16()

        def make(s):
            k = cache[:, :, :s].contiguous()  # as a cache concatenated along S: contiguous BHSD
            return q, k, k.clone()

        def run(args):
            dense.forward(*args, scale=0.125, compute_lse=False)
    else:
        b, h_q, h_kv, d, start = 1, 8, 2, 64, 520

        def make(s):
            q, k, v = (torch.randn(b, s, h, d).bfloat16().transpose(1, 2) for h in (h_q, h_kv, h_kv))
            return q, k, v, torch.randn(b, s, h_q, d).bfloat16().transpose(1, 2)

        def run(args):
            q, k, v, go = args
            out, lse = dense.forward(q, k, v, scale=0.125, window=(-1, 0))
            if a.case == "prefill":
                dense.backward(go, q, k, v, out, lse, scale=0.125, window=(-1, 0))

    def timed(calls) -> float:
        t = time.perf_counter()
        for args in calls:
            run(args)
        return (time.perf_counter() - t) / len(calls) * 1e6

    last = start + a.lengths * (a.rounds + 1)
    if folded.seqlen_bucket(start + 1) != folded.seqlen_bucket(last):
        parser.error(f"lengths {start + 1}..{last} cross a length bucket (a build would be timed): "
                     f"use --lengths {(folded.seqlen_bucket(start + 1) - start) // (a.rounds + 1)} or fewer")
    run(make(start))  # builds the bucket's graphs
    timed([make(s) for s in range(start + 1, start + 1 + a.lengths)])  # warm-up round
    new, repeated = [], []
    for r in range(a.rounds):
        lo = start + 1 + a.lengths * (r + 1)
        calls = [make(s) for s in range(lo, lo + a.lengths)]
        new.append(timed(calls))
        repeated.append(timed(calls[:1] * len(calls)))
    print(f"torch {torch.__version__}, {a.case}, B {b}, H {h_q}/{h_kv}, D {d}, S from {start}; "
          f"graphs built: {graphs.cache_info()['built']}")
    print(f"new length {statistics.median(new):7.1f} us/call   repeated {statistics.median(repeated):6.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
