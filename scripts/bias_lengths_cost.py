"""What reading F.sdpa's padding mask (``ops/bias_lengths.py``) costs a fixed-shape training step (GPU).

    python3 scripts/bias_lengths_cost.py [--cases hf_llama_l2_d256_b2_s256_padded,...] [--repeats 20]

For each of the bench's Hugging Face Llama cases (``cudnn_sdpa_provider.tools.bench``: random weights,
one right-padded batch, plain sdpa), in one process, in ABBA order: native (provider off), the
provider reading the mask at every forward (``bias_lengths.STABLE_AFTER`` lifted out of reach for
it; where the mask is a right-padding mask, served as lengths) and the provider with ``bias_lengths.recognise`` returning None (the mask kept as a bias, as
before ops/bias_lengths.py). Per path: the step's CUDA-event median, graph builds, and the device
time of the attention kernels against the rest over profiled steps (torch.profiler). Then the read
alone (``bias_lengths._read`` on a (B, 1, S, S) bf16 mask of 0 / -65504): its synchronised wall time.
Run 75 (results/gpu-run75-bias-lengths-cost.txt) ran a first form that also printed a host time
taken behind a 20 ms GPU sleep (the read waits for the sleep, so that figure was not a cost), and
whose "provider" path was STABLE_AFTER-bound: 136 calls of the 4-layer case there (68 of the
2-layer one), under 256, so it read at every call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from cudnn_sdpa_provider.engine import graphs  # noqa: E402
from cudnn_sdpa_provider.ops import bias_lengths  # noqa: E402
from cudnn_sdpa_provider.tools.bench import cases, inputs, paths  # noqa: E402
from cudnn_sdpa_provider.tools.bench.report import Measurement  # noqa: E402
from cudnn_sdpa_provider.engine.tuning import cuda_timer  # noqa: E402

CASES = "hf_llama_l2_d256_b2_s256_padded,hf_llama_l4_d2048_b4_s2048_padded"
ATTENTION = ("sdpa", "fmha", "flash", "attention")


def _split(fn, steps: int) -> tuple[float, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    attn = other = 0.0
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0) / 1000.0 / steps
        if ms > 0:
            if any(word in e.key.lower() for word in ATTENTION):
                attn += ms
            else:
                other += ms
    return attn, other


class _KeepBias:
    """``bias_lengths.recognise`` returning None while entered."""

    def __enter__(self):
        self.saved = bias_lengths.recognise
        bias_lengths.recognise = lambda *a, **k: None

    def __exit__(self, *exc):
        bias_lengths.recognise = self.saved


def _path(case, s, name: str, repeats: int):
    path = "native" if name == "native" else "provider"
    m = Measurement(path=path)
    step = paths.step(case, "fwd_bwd", path)
    keep = _KeepBias() if name == "provider_keep_bias" else None
    stable, bias_lengths.STABLE_AFTER = bias_lengths.STABLE_AFTER, 1 << 62  # "provider": read at every call
    with paths.scope(m, {}):
        if keep:
            keep.__enter__()
        try:
            s.model(paths.HF_IMPLEMENTATION[path])
            fn = lambda: step(s)  # noqa: E731
            before = graphs.cache_info().get("built", 0)
            fn()
            ms = cuda_timer(fn, warmup=3, repeats=repeats)
            builds = graphs.cache_info().get("built", 0) - before
            attn, other = _split(fn, 3)
        finally:
            if keep:
                keep.__exit__(None, None, None)
            bias_lengths.STABLE_AFTER = stable
    return ms, builds, attn, other, m


def _read_cost(b: int, s: int, lengths) -> float:
    """Synchronised wall time of one ``_read`` (microseconds, median of 20). The read ends in a
    host-device synchronisation, so its host time is its wall time: no separate host figure."""
    allowed = torch.arange(s, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    mask = allowed[:, None, None, :] & causal
    bias = torch.where(mask, 0.0, -65504.0).to(torch.bfloat16)
    for _ in range(3):
        assert bias_lengths._read(bias) is not None
    wall = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bias_lengths._read(bias)
        wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bias_lengths_cost: needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
          flush=True)
    for case in cases.select(args.cases.split(",")):
        why = inputs.unavailable(case)
        if why:
            print(f"{case.name}: {why}", flush=True)
            continue
        s = inputs.make_sets(case)[0]
        print(f"{case.name}, lengths {list(case.seq_lens)}", flush=True)
        rows: dict = {}
        for name in ("native", "provider", "provider_keep_bias", "provider_keep_bias", "provider", "native"):
            ms, builds, attn, other, m = _path(case, s, name, args.repeats)
            rows.setdefault(name, []).append(ms)
            print(f"  {name:20s} step {ms:8.3f} ms  builds {builds:3d}  served {m.served} fallback "
                  f"{dict(m.fallback) if m.fallback else {}}  device: attention {attn:7.3f} ms, other {other:8.3f}",
                  flush=True)
        native = statistics.median(rows["native"])
        for name in ("provider", "provider_keep_bias"):
            print(f"  native / {name}: {native / statistics.median(rows[name]):.3f}x", flush=True)
        wall = _read_cost(case.batch, case.seq, case.seq_lens)
        print(f"  bias_lengths._read alone at ({case.batch}, 1, {case.seq}, {case.seq}): synchronised wall "
              f"{wall:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
