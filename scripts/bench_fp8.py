"""Issue #18's FP8 bench rows: ``csp.fp8`` beside bf16 native F.sdpa (cuDNN backend) and beside the
bare ``sdpa_fp8`` graph, in one process (GPU, Hopper or newer).

    python3 scripts/bench_fp8.py [--seqs 4096,8192,16384] [--heads 32] [--dim 128] [--repeats 20]

Shape (1, H, S, D), causal and not; inputs randn. Per row, CUDA-event medians (ms) of:
  bare fwd   the sdpa_fp8 graph's execute on prepared buffers (scripts/fp8_probe.py's build; the floor)
  op fwd     csp.fp8.forward on the same FP8 operands, no LSE like the bare graph (allocation,
             binding, route included)
  bf16 fwd   native F.scaled_dot_product_attention on the bf16 values (cuDNN backend)
  op bwd     csp.fp8.backward at fixed scales; bf16 bwd: native's backward (autograd, grad retained)
  e2e fwd / e2e fwd+bwd  csp.fp8.attention from bf16 activations with a Recipe (quantisation of q, k,
             v, dO and dequantisation included) against native bf16 forward / forward+backward.
Speed-ups are bf16 time / FP8 time; "op/bare" is the op's overhead over the graph. Exit status 1
when no row could be measured.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.ops import fp8_reference  # noqa: E402
from cudnn_sdpa_provider.engine.tuning import cuda_timer  # noqa: E402


def bare_forward(q8, k8, v8, descales, scale_o, causal, handle):
    """The graph alone: built once with the probe's builder, executed on fixed buffers."""
    import fp8_probe

    b, h, s, d = q8.shape
    g = fp8_probe.build(b, h, s, d, causal, True, False, handle)
    U = fp8_probe.UIDS
    one = torch.ones(1, 1, 1, 1, device="cuda")
    out = torch.empty_like(q8)
    pack = {U["q"]: q8, U["k"]: k8, U["v"]: v8, U["o"]: out, U["amax_s"]: one.clone(), U["amax_o"]: one.clone(),
            U["descale_q"]: descales[0].view(1, 1, 1, 1), U["descale_k"]: descales[1].view(1, 1, 1, 1),
            U["descale_v"]: descales[2].view(1, 1, 1, 1), U["descale_s"]: one / csp.fp8.DEFAULT_SCALE_S,
            U["scale_s"]: one * csp.fp8.DEFAULT_SCALE_S, U["scale_o"]: scale_o.view(1, 1, 1, 1)}
    workspace = torch.empty(max(int(g.get_workspace_size()), 1), device="cuda", dtype=torch.uint8)
    return lambda: g.execute(pack, workspace, handle=handle)


def row(s, causal, args, handle):
    h, d, reps = args.heads, args.dim, args.repeats
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v, go = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    (q8, dq), (k8, dk), (v8, dv), (do8, ddo) = (csp.fp8.quantize(t) for t in (q, k, v, go))
    scale_o = fp8_reference.pow2_scale(v.float().abs().amax() / csp.fp8.O_HEADROOM, 448.0).reshape(1)
    time = lambda fn: cuda_timer(fn, warmup=3, repeats=reps)  # noqa: E731
    bare = time(bare_forward(q8, k8, v8, (dq, dk, dv), scale_o, causal, handle))
    fwd = lambda lse: csp.fp8.forward(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,  # noqa: E731
                                      scale_o=scale_o, is_causal=causal, return_lse=lse)
    op = time(lambda: fwd(False))  # like the bare graph: no LSE
    res = fwd(True)
    scales = [torch.tensor([x], device="cuda") for x in (2.0 ** 6, 2.0 ** 6, 2.0 ** 6, 2.0 ** 8)]
    op_bwd = time(lambda: csp.fp8.backward(do8, q8, k8, v8, res.out, res.lse, descale_q=dq, descale_k=dk,
                                           descale_v=dv, descale_o=1 / scale_o, descale_do=ddo, scale_dq=scales[0],
                                           scale_dk=scales[1], scale_dv=scales[2], scale_dp=scales[3],
                                           is_causal=causal))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        native = time(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal))
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        native_bwd = time(lambda: torch.autograd.grad(out, leaves, go, retain_graph=True))
        native_step = time(lambda: torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal),
                                                       leaves, go))
    recipe = csp.fp8.Recipe()
    with torch.no_grad():
        e2e = time(lambda: csp.fp8.attention(q, k, v, is_causal=causal, recipe=recipe))
    e2e_step = time(lambda: torch.autograd.grad(csp.fp8.attention(*leaves, is_causal=causal, recipe=recipe), leaves,
                                                go))
    print(f"S={s:6d} {'causal    ' if causal else 'non-causal'}  bare fwd {bare:7.3f}  op fwd {op:7.3f} "
          f"(op/bare {op / bare:5.3f})  bf16 fwd {native:7.3f} -> {native / op:4.2f}x | op bwd {op_bwd:7.3f}  "
          f"bf16 bwd {native_bwd:7.3f} -> {native_bwd / op_bwd:4.2f}x | e2e fwd {e2e:7.3f} -> {native / e2e:4.2f}x  "
          f"e2e fwd+bwd {e2e_step:7.3f} vs bf16 {native_step:7.3f} -> {native_step / e2e_step:4.2f}x  "
          f"(re-runs {recipe.retries})", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8: needs a CUDA GPU", file=sys.stderr)
        return 4
    import cudnn

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, frontend "
          f"{cudnn.__version__}; (1, {args.heads}, S, {args.dim}), median of {args.repeats} calls, ms")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    done = 0
    for causal in (True, False):
        for s in (int(x) for x in args.seqs.split(",")):
            try:
                done += row(s, causal, args, handle)
            except Exception as exc:
                print(f"S={s:6d} causal={causal} failed: {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
            torch.cuda.empty_cache()
    print(csp.report() if hasattr(csp, "report") else "")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
