"""Where the bench's Hugging Face Llama training step spends its GPU time: attention against the rest (GPU).

    python3 scripts/hf_step_profile.py [--case hf_llama_l4_d2048_b4_s2048_padded] [--steps 5] [--repeats 10]
                                       [--host N]

The bench's ``hf_llama`` case (``cudnn_sdpa_provider.tools.bench``: a LlamaForCausalLM from a LlamaConfig,
random weights, one right-padded batch), one training step (forward, loss, backward) per call, for
two paths in one process: ``native`` (attn_implementation="sdpa", PyTorch's own choice of kernel
for the padding mask) and ``provider_hf`` (attn_implementation="cudnn", the padding as lengths).
For each: the step's CUDA-event median over ``--repeats`` steps, and over ``--steps`` profiled
steps (torch.profiler) the device time of the attention kernels (names with sdpa, fmha, flash or
attention) and of everything else. The bound printed is Amdahl's: the native step's time over
its time without any attention at all, the most any attention kernel could make this step gain.

``--host N``: where each path's host time goes, for a step that the host bounds. cProfile over N
steps, its time split by where the code lives (this package, transformers, torch, the rest) and its
top entries by own time; and the device syncs of one step (``torch.cuda.set_sync_debug_mode``),
each with the line of this package or of transformers that asked for it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import traceback
import warnings

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


def _where(filename: str) -> str:
    for part, name in (("cudnn_sdpa_provider", "package"), ("transformers", "transformers"), ("torch", "torch")):
        if f"{os.sep}{part}{os.sep}" in filename:
            return name
    return "rest"


def _host(path: str, fn, steps: int) -> None:
    """Print where ``steps`` calls of ``fn`` spend their host time (cProfile) and one step's syncs."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    split = {}
    for (filename, _, _), (_, _, own, _, callers) in stats.stats.items():
        if filename == "~" and callers:  # a built-in (a C call): counted where its callers live
            whole = sum(t[3] for t in callers.values())
            for (caller_file, _, _), t in callers.items():
                share = t[3] / whole if whole else 1 / len(callers)
                split[_where(caller_file)] = split.get(_where(caller_file), 0.0) + own * share
        else:
            split[_where(filename)] = split.get(_where(filename), 0.0) + own
    total = sum(split.values())
    print(f"{path:12s} host (cProfile, own time per step): total {1e3 * total / steps:7.3f} ms | "
          + ", ".join(f"{k} {1e3 * v / steps:.3f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])),
          flush=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)
    syncs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs.append(str(w.message)[:60])
    # the warning carries no stack: run once more with the syncs raised, and say where the first came from
    where = ""
    if syncs:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError:
            frames = [f for f in traceback.extract_tb(sys.exc_info()[2])
                      if _where(f.filename) in ("package", "transformers")]
            where = f" (the first from {frames[-1].filename.rsplit(os.sep, 2)[-2:]}:{frames[-1].lineno})" \
                if frames else ""
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    print(f"{path:12s} device syncs in one step: {len(syncs)}{where}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="hf_llama_l4_d2048_b4_s2048_padded")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--host", type=int, default=0, metavar="N",
                        help="cProfile N steps of each path and count one step's device syncs")
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
    # Every step time first, before any profiler runs in this process: a torch.profiler session
    # slows every later step (GPU run 77: about 20% on one core), which would count against the
    # path measured after it.
    paths_ = ("native", "provider_hf")
    steps, times = {}, {}
    for path in paths_:
        m = Measurement(path=path)
        step = paths.step(case, "fwd_bwd", path)
        with paths.scope(m, {}):
            s.model(paths.HF_IMPLEMENTATION[path])
            fn = lambda step=step: step(s)  # noqa: E731
            fn()
            times[path] = cuda_timer(fn, warmup=2, repeats=args.repeats)
        assert path == "native" or (m.served > 0 and not m.fallback), (m.served, m.fallback)
        steps[path] = fn
    rows = {}
    for path in paths_:
        m = Measurement(path=path)
        with paths.scope(m, {}):
            attn, other, names = _device_split(steps[path], args.steps)
            if args.host:
                _host(path, steps[path], args.host)
        rows[path] = (times[path], attn, other)
        ms = times[path]
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
