"""Where the bench's Hugging Face Llama training step spends its GPU time: attention against the rest (GPU).

    python3 scripts/hf_step_profile.py [--case hf_llama_l4_d2048_b4_s2048_padded] [--steps 5] [--repeats 10]

The bench's ``hf_llama`` case (``cudnn_sdpa_provider.tools.bench``: a LlamaForCausalLM from a LlamaConfig,
random weights, one right-padded batch), one training step (forward, loss, backward) per call, for
two paths in one process: ``native`` (attn_implementation="sdpa", PyTorch's own choice of kernel
for the padding mask) and ``provider_hf`` (attn_implementation="cudnn", the padding as lengths).
For each: the step's CUDA-event median over ``--repeats`` steps, and over ``--steps`` profiled
steps (torch.profiler) the device time of the attention kernels (names with sdpa, fmha, flash or
attention) and of everything else. The bound printed is Amdahl's: the native step's time over
its time without any attention at all, the most any attention kernel could make this step gain.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from cudnn_sdpa_provider.tools.bench import cases, inputs, paths  # noqa: E402
from cudnn_sdpa_provider.tools.bench.report import Measurement  # noqa: E402
from cudnn_sdpa_provider.engine.tuning import cuda_timer  # noqa: E402

ATTENTION = ("sdpa", "fmha", "flash", "attention")


def _device_split(fn, steps: int) -> tuple[float, float, dict]:
    """(attention ms, other ms, {attention kernel name: ms}) per step, from torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    attn, other, names = 0.0, 0.0, {}
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0) / 1000.0 / steps
        if ms <= 0:
            continue
        if any(word in e.key.lower() for word in ATTENTION):
            attn += ms
            names[e.key[:70]] = ms
        else:
            other += ms
    return attn, other, names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="hf_llama_l4_d2048_b4_s2048_padded")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hf_step_profile: needs a CUDA GPU", file=sys.stderr)
        return 1
    (case,) = cases.select([args.case])
    why = inputs.unavailable(case)
    if why:
        print(f"hf_step_profile: {why}", file=sys.stderr)
        return 1
    s = inputs.make_sets(case)[0]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {case.name}, lengths {list(case.seq_lens)}, "
          f"median of {args.repeats} steps, kernels over {args.steps} profiled steps", flush=True)
    rows = {}
    for path in ("native", "provider_hf"):
        m = Measurement(path=path)
        step = paths.step(case, "fwd_bwd", path)
        with paths.scope(m, {}):
            s.model(paths.HF_IMPLEMENTATION[path])
            fn = lambda: step(s)  # noqa: E731
            fn()
            ms = cuda_timer(fn, warmup=2, repeats=args.repeats)
            attn, other, names = _device_split(fn, args.steps)
        rows[path] = (ms, attn, other)
        assert path == "native" or (m.served > 0 and not m.fallback), (m.served, m.fallback)
        print(f"{path:12s} step {ms:8.3f} ms | device: attention {attn:7.3f} ms, other {other:8.3f} ms "
              f"(attention {100 * attn / (attn + other):4.1f}%)", flush=True)
        for name, t in sorted(names.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {t:7.3f} ms  {name}", flush=True)
    (n_ms, n_attn, n_other), (p_ms, p_attn, p_other) = rows["native"], rows["provider_hf"]
    print(f"step ratio native / provider_hf: {n_ms / p_ms:.3f}x; attention alone {n_attn / max(p_attn, 1e-9):.2f}x; "
          f"non-attention device time {p_other / n_other:.3f} of native's", flush=True)
    print(f"Amdahl bound (native step without any attention): {(n_attn + n_other) / n_other:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
