"""Issue #18's first measurement: cuDNN's per-tensor FP8 SDPA forward (``sdpa_fp8``) built with
``cudnn.pygraph`` beside native bf16 F.sdpa, in one process (GPU, Hopper or newer; frontend 1.28+).

    python3 scripts/fp8_probe.py [--seqs 4096,8192,16384] [--heads 32] [--dim 128] [--no-causal]
                                 [--o-dtype bf16|fp8] [--stats] [--repeats 20]

For each sequence length: bf16 q, k, v (randn), quantised to float8_e4m3fn with per-tensor current
scaling (scale = 448 / amax, descale = 1 / scale), the FP8 graph's output dequantised against the
fp32 reference and against native bf16 F.sdpa on the same values (max abs error / max |reference|),
its amax outputs beside the true ones, and CUDA-event medians of the graph's execute and of native
bf16 F.sdpa (cuDNN backend). O is FP8 by default below compute capability 10 (cuDNN serves a bf16 O
from FP8 inputs on Blackwell and newer only); ``--stats`` also writes the softmax stats (what a
training forward needs; native is then timed with inputs that require grad, so it writes its LSE
too). Exit status 1 when no length could be measured. The package serves no call here (only its
CUDA-event timer, ``tuning.cuda_timer``, is used): this measures what an FP8 path through it could
reach.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudnn  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from cudnn_sdpa_provider.engine.tuning import cuda_timer  # noqa: E402  (median ms by CUDA events)

E4M3_MAX = 448.0
UIDS = dict(q=1, k=2, v=3, o=4, stats=5, amax_s=6, amax_o=7, descale_q=8, descale_k=9, descale_v=10,
            descale_s=11, scale_s=12, scale_o=13)


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in float8_e4m3fn scaled by 448 / amax(t), the fp32 descale as a (1, 1, 1, 1) tensor)."""
    scale = E4M3_MAX / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1, 1, 1, 1)


def build(b, h, s, d, causal: bool, o_fp8: bool, stats_out: bool, handle):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    packed = [h * s * d, s * d, d, 1]
    q, k, v = (g.tensor(name=n, dim=[b, h, s, d], stride=packed, data_type=cudnn.data_type.FP8_E4M3, uid=UIDS[n])
               for n in ("q", "k", "v"))
    scalars = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=UIDS[n])
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    o, stats, amax_s, amax_o = g.sdpa_fp8(q, k, v, scalars["descale_q"], scalars["descale_k"], scalars["descale_v"],
                                          scalars["descale_s"], scalars["scale_s"], scalars["scale_o"],
                                          generate_stats=stats_out, attn_scale=d ** -0.5, use_causal_mask=causal)
    o.set_output(True).set_uid(UIDS["o"]).set_dim([b, h, s, d]).set_stride(packed).set_data_type(
        cudnn.data_type.FP8_E4M3 if o_fp8 else cudnn.data_type.BFLOAT16)
    if stats_out:
        stats.set_output(True).set_uid(UIDS["stats"]).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(
            cudnn.data_type.FLOAT)
    for t, n in ((amax_s, "amax_s"), (amax_o, "amax_o")):
        t.set_output(True).set_uid(UIDS[n]).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
            cudnn.data_type.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


def probe(s: int, args, handle) -> bool:
    b, h, d = 1, args.heads, args.dim
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
    one = torch.ones(1, 1, 1, 1, device="cuda")
    # P is in [0, 1]: scale_s = 448 puts it on the E4M3 range, descale_s undoes it for P @ V.
    scale_s, descale_s = one * E4M3_MAX, one / E4M3_MAX
    o_fp8 = args.o_dtype == "fp8"
    g = build(b, h, s, d, not args.no_causal, o_fp8, args.stats, handle)
    out = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out8 = torch.empty((b, h, s, d), device="cuda", dtype=torch.float8_e4m3fn)
    scale_o = one.clone()  # O is within the inputs' range (a convex combination of V's rows)
    if o_fp8:
        # |O| <= max|V| up to the rounding of the quantised P (its rows may sum to a little over 1)
        scale_o = 0.9 * E4M3_MAX / (v.abs().amax().float().clamp(min=1e-12)) * one
    stats = torch.empty((b, h, s, 1), device="cuda", dtype=torch.float32)
    amax_s, amax_o = torch.full_like(one, float("nan")), torch.full_like(one, float("nan"))
    workspace = torch.empty(max(int(g.get_workspace_size()), 1), device="cuda", dtype=torch.uint8)
    pack = {UIDS["q"]: q8, UIDS["k"]: k8, UIDS["v"]: v8, UIDS["o"]: out8 if o_fp8 else out,
            **({UIDS["stats"]: stats} if args.stats else {}), UIDS["amax_s"]: amax_s, UIDS["amax_o"]: amax_o, UIDS["descale_q"]: dq, UIDS["descale_k"]: dk,
            UIDS["descale_v"]: dv, UIDS["descale_s"]: descale_s, UIDS["scale_s"]: scale_s, UIDS["scale_o"]: scale_o}
    run = lambda: g.execute(pack, workspace, handle=handle)  # noqa: E731
    run()
    torch.cuda.synchronize()
    got = out8.float() / scale_o if o_fp8 else out.float()
    deq = [t.float() * ds for t, ds in ((q8, dq), (k8, dk), (v8, dv))]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # fp32 on the FP8 values, no S x S buffer
        ref = F.scaled_dot_product_attention(*deq, is_causal=not args.no_causal)
    nq, nk, nv = (t.detach().requires_grad_(args.stats) for t in (q, k, v))  # with grad: native writes its LSE
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        native = F.scaled_dot_product_attention(nq, nk, nv, is_causal=not args.no_causal).detach()
        native_ms = cuda_timer(lambda: F.scaled_dot_product_attention(nq, nk, nv, is_causal=not args.no_causal),
                               warmup=3, repeats=args.repeats)
    fp8_ms = cuda_timer(run, warmup=3, repeats=args.repeats)
    top = ref.abs().max().item()
    flops = 4 * b * h * s * s * d / (2 if not args.no_causal else 1)
    print(f"S={s:6d}  fp8 {fp8_ms:7.3f} ms ({flops / fp8_ms / 1e9:6.1f} TFLOP/s)  bf16 native {native_ms:7.3f} ms "
          f"({flops / native_ms / 1e9:6.1f})  speed-up {native_ms / fp8_ms:5.2f}x  "
          f"err vs fp32-on-fp8-values {(got - ref).abs().max().item() / top:.4f}  "
          f"vs native bf16 {(got - native.float()).abs().max().item() / top:.4f}  "
          f"amax_o {amax_o.item():.3f} (true {ref.abs().max().item():.3f})  amax_s {amax_s.item():.4f}  "
          f"NaN in out {bool(torch.isnan(got).any())}", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--o-dtype", choices=("bf16", "fp8"), default=None,
                        help="default: fp8 below compute capability 10, bf16 from Blackwell on")
    parser.add_argument("--stats", action="store_true", help="also write the softmax stats (a training forward)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_probe: needs a CUDA GPU", file=sys.stderr)
        return 4
    if args.o_dtype is None:
        args.o_dtype = "fp8" if torch.cuda.get_device_capability()[0] < 10 else "bf16"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, frontend "
          f"{cudnn.__version__}; (1, {args.heads}, S, {args.dim}) {'non-' if args.no_causal else ''}causal, "
          f"O {args.o_dtype}, stats {'on' if args.stats else 'off'}, median of {args.repeats} calls")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    measured = 0
    for s in (int(x) for x in args.seqs.split(",")):
        try:
            measured += probe(s, args, handle)
        except Exception as exc:  # a rejection at one length says what cuDNN wants; try the next
            print(f"S={s:6d}  failed: {type(exc).__name__}: {exc}", flush=True)  # whole: the cause is at the end
        torch.cuda.empty_cache()
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
