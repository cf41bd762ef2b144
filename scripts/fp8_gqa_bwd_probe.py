"""How cuDNN's FP8 attention kernels time with GQA against the same call with K/V expanded (GPU).

    python3 scripts/fp8_gqa_bwd_probe.py [--shape 4,32,8,8192,128] [--repeats 10]

For FP8 q (B, H_q, S, D), k, v (B, H_kv, S, D) (``csp.fp8.quantize`` of randn), causal and not:
the forward and backward of ``csp.fp8.forward`` / ``csp.fp8.backward`` as given (GQA), and with
k and v expanded to H_q heads (``repeat_interleave`` on the FP8 bytes, timed separately), CUDA
events, median of ``--repeats`` after warm-up; bf16 native (``F.scaled_dot_product_attention``
forward+backward with ``enable_gqa``) beside them. Scales are fixed (1 for the gradients: the
timing does not depend on the values), so nothing is re-run. ``per row``: the same backward as B
calls on one batch row each (views, B = 1 graphs), with the largest difference of its dQ, dK, dV
from the whole-batch call's (as floats; 0 means the same values), and ``package``: the backward as
``csp.fp8.backward`` runs it (``fp8_cudnn.ROW_SPLIT_CAUSAL``: by rows where causal and B > 1). The
other rows run with ``ROW_SPLIT_CAUSAL`` off: one whole-batch graph.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.engine import fp8_cudnn  # noqa: E402
from bench_fp8_quant import median_ms  # noqa: E402  (scripts/, this script's folder)


def _time(fn, repeats):
    return median_ms(fn, repeats, 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,32,8,8192,128", help="B,H_q,H_kv,S,D")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    b, h, hk, s, d = (int(x) for x in args.shape.split(","))
    group = h // hk
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, go = (torch.randn(b, n, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for n in (h, hk, hk, h))
    (q8, dq), (k8, dk), (v8, dv), (go8, ddo) = (csp.fp8.quantize(t) for t in (q, k, v, go))
    one = torch.ones(1, device="cuda")
    print(f"{torch.cuda.get_device_name()}: FP8 ({b}, {h}/{hk}, {s}, {d}); torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; ms, median of {args.repeats}")
    expand = lambda t: t.view(torch.uint8).repeat_interleave(group, dim=1).view(torch.float8_e4m3fn)  # noqa: E731
    print(f"expand k and v to {h} heads: {_time(lambda: (expand(k8), expand(v8)), args.repeats):.3f}")
    for causal in (True, False):
        qn, kn, vn = (t.clone().requires_grad_() for t in (q, k, v))
        native_fwd = _time(lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal, enable_gqa=True),
                           args.repeats)
        native_bwd = _time(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal, enable_gqa=True), (qn, kn, vn), go),
            args.repeats)
        print(f"causal={causal}: bf16 native fwd {native_fwd:.3f}  fwd+bwd {native_bwd:.3f}")
        for name, kk, vv in (("gqa", k8, v8), ("expanded", expand(k8), expand(v8))):
            kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, is_causal=causal)
            fwd = csp.fp8.forward(q8, kk, vv, scale_o=one, return_lse=True, **kw)
            t_fwd = _time(lambda: csp.fp8.forward(q8, kk, vv, scale_o=one, return_lse=True, **kw), args.repeats)
            bwd = lambda: csp.fp8.backward(go8, q8, kk, vv, fwd.out, fwd.lse, descale_o=one, descale_do=ddo,  # noqa
                                           scale_dq=one, scale_dk=one, scale_dv=one, scale_dp=one, **kw)
            fp8_cudnn.ROW_SPLIT_CAUSAL = False
            t_bwd = _time(bwd, args.repeats)
            print(f"  {name:9s} fp8 fwd {t_fwd:.3f}  bwd {t_bwd:.3f}  (fwd {native_fwd / t_fwd:.2f}x, "
                  f"fwd+bwd {native_bwd / (t_fwd + t_bwd):.2f}x native)")
            if b > 1 and name == "gqa":
                rows = lambda: [csp.fp8.backward(  # noqa: E731
                    go8[i:i + 1], q8[i:i + 1], kk[i:i + 1], vv[i:i + 1], fwd.out[i:i + 1], fwd.lse[i:i + 1],
                    descale_o=one, descale_do=ddo, scale_dq=one, scale_dk=one, scale_dv=one, scale_dp=one, **kw)
                    for i in range(b)]
                t_rows = _time(rows, args.repeats)
                whole, split = bwd(), rows()
                diff = max(float((getattr(whole, g).float()[i] - getattr(r, g).float()[0]).abs().max())
                           for i, r in enumerate(split) for g in ("dq", "dk", "dv"))
                print(f"  per row   fp8 bwd {t_rows:.3f}  (fwd+bwd {native_bwd / (t_fwd + t_rows):.2f}x native; "
                      f"largest gradient difference from the whole batch {diff:.3g})")
                fp8_cudnn.ROW_SPLIT_CAUSAL = True
                t_pkg = _time(bwd, args.repeats)
                print(f"  package   fp8 bwd {t_pkg:.3f}  (fwd+bwd {native_bwd / (t_fwd + t_pkg):.2f}x native)")
    stats = csp.stats()
    print("served:", {p: n for p, n in stats.served.items() if p.startswith("fp8")},
          "fell back:", {p: dict(r) for p, r in stats.fallback.items() if p.startswith("fp8") and r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
