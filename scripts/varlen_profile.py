"""What runs on the GPU for one varlen_attn call: the provider, nvidia's cudnn.torch (if its frontend
has it) and PyTorch's FlashAttention varlen, side by side in one process (GPU).

    python3 scripts/varlen_profile.py [--iters 10] [--json FILE]

The bench's varlen case (16 sequences of 128..4096 tokens, H=16, D=128, bf16, causal). For each
path and for forward and forward+backward: every CUDA kernel that ran, with its device time per
call (torch.profiler, averaged over ``--iters`` calls after warm-up), so extra kernels around the
attention kernel (fills, copies, transposes, length arithmetic) and the attention kernels' own
times can be compared; plus the cuDNN plan names the provider built.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from bench_peer import nvidia_cudnn_torch  # noqa: E402  (the peer's overrides, as scripts/bench_peer.py installs them)
from cudnn_sdpa_provider.tools.bench import MATRIX  # noqa: E402


PATHS = {"provider": csp.enable, "native_flash": contextlib.nullcontext, "nvidia_cudnn_torch": nvidia_cudnn_torch}


def _inputs():
    case = next(c for c in MATRIX if c.kind == "varlen")
    lens = torch.tensor(case.seq_lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, go = (torch.randn(total, case.h_q, case.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(4))
    return case, cu.cuda(), q, k, v, go


def _peer_plans() -> dict:
    """The plan each of the peer's cached graphs runs, by its cache key (empty without cudnn.torch)."""
    try:
        from cudnn.sdpa.fwd import torch_op
    except ImportError:
        return {}
    plans = {}
    for key, (graph, _ws, _uids) in getattr(torch_op, "_graph_cache", {}).items():
        try:
            plans[str(key)] = graph.get_plan_name_at_index(graph._plan_index)
        except Exception as exc:  # noqa: BLE001 - a frontend without these attributes
            plans[str(key)] = f"<unavailable: {type(exc).__name__}>"
    return plans


def _kernels(prof, iters: int) -> list[tuple[str, float, int]]:
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type == torch.autograd.DeviceType.CUDA and us > 0:
            rows.append((e.key, us / iters, e.count // iters))
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    case, cu, q, k, v, go = _inputs()
    m = case.seq
    results = {}
    for path, scope in PATHS.items():
        for mode in ("fwd", "fwd_bwd"):
            leaves = [t.detach().requires_grad_(mode == "fwd_bwd") for t in (q, k, v)]

            def step():
                out = varlen_attn(*leaves, cu, cu, m, m, window_size=(-1, 0))
                if mode == "fwd_bwd":
                    torch.autograd.grad(out, leaves, go)

            try:
                with scope():
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.iters):
                            step()
                        torch.cuda.synchronize()
            except Exception as exc:  # e.g. the peer on a frontend without cudnn.torch
                results[f"{path} {mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            kernels = _kernels(prof, args.iters)
            results[f"{path} {mode}"] = {"total_us": sum(r[1] for r in kernels),
                                         "kernels": [{"name": n, "us": round(us, 1), "per_call": c}
                                                     for n, us, c in kernels]}
    results["provider plans"] = dict(csp.stats().plans)
    results["peer plans"] = _peer_plans()
    print(f"varlen_attn, {case.describe()}; {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"device us per call over {args.iters} calls")
    for name, r in results.items():
        if name.endswith(" plans"):
            continue
        if "error" in r:
            print(f"\n{name}: {r['error']}")
            continue
        print(f"\n{name}: {r['total_us']:.1f} us of kernels per call")
        for kernel in r["kernels"][:12]:
            print(f"  {kernel['us']:9.1f} us  x{kernel['per_call']}  {kernel['name'][:110]}")
    print("\nprovider plans:")
    for config, plan in sorted(results["provider plans"].items()):
        print(f"  {plan}  <- {config}")
    print("\npeer plans (its graph cache: key -> plan):")
    for config, plan in results["peer plans"].items():
        print(f"  {plan}  <- {config}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
