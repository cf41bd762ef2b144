"""Whether cuDNN's FP8 backward gives the same, right gradients as one whole-batch graph and by batch
rows (GPU; the check behind ``engine.fp8_cudnn.ROW_SPLIT_CAUSAL``).

    python3 scripts/fp8_batch_rows_check.py

For each case, FP8 q, k, v, dO (``csp.fp8.quantize`` of randn, seed 0) and one forward, then five
identical ``csp.fp8.backward`` calls at unit gradient scales, with ``ROW_SPLIT_CAUSAL`` off (one
whole-batch graph) or on (a graph call per batch row). Prints, per gradient, the largest
difference between any two of the five calls, and (``ref``) the largest error of batch row 0 in
any call against fp32 autograd on the dequantised operands, both relative to the tensor's max.
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.engine import fp8_cudnn  # noqa: E402


def case(b, h, hk, s, causal, split, n=5, ref=False):
    d = 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, go = (torch.randn(b, m, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for m in (h, hk, hk, h))
    (q8, dq), (k8, dk), (v8, dv), (go8, ddo) = (csp.fp8.quantize(t) for t in (q, k, v, go))
    one = torch.ones(1, device="cuda")
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, is_causal=causal)
    fwd = csp.fp8.forward(q8, k8, v8, scale_o=one, return_lse=True, **kw)
    fp8_cudnn.ROW_SPLIT_CAUSAL = split
    runs = [csp.fp8.backward(go8, q8, k8, v8, fwd.out, fwd.lse, descale_o=one, descale_do=ddo, scale_dq=one,
                             scale_dk=one, scale_dv=one, scale_dp=one, **kw) for _ in range(n)]
    out = f"B{b} H{h}/{hk} S{s} causal={causal} split={split}:"
    for g in ("dq", "dk", "dv"):
        ts = [getattr(r, g).float() for r in runs]
        m = ts[0].abs().max().item()
        worst = max((x - y).abs().max().item() for x, y in itertools.combinations(ts, 2)) / m
        out += f" {g} repeat-diff {worst:.3f}"
        if ref:
            ops = [(t[:1].float() * f).requires_grad_() for t, f in ((q8, dq), (k8, dk), (v8, dv))]
            o = F.scaled_dot_product_attention(*ops, is_causal=causal, enable_gqa=True)
            want = torch.autograd.grad(o, ops, go8[:1].float() * ddo)[("dq", "dk", "dv").index(g)]
            err = max((t[:1] - want).abs().max().item() for t in ts) / want.abs().max().item()
            out += f" (row 0 vs fp32 {err:.3f})"
    print(out, flush=True)


def main() -> int:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    case(4, 32, 8, 4096, False, False)
    case(4, 32, 32, 4096, True, False)
    case(4, 32, 8, 4096, True, False, ref=True)
    case(4, 32, 8, 4096, True, True, ref=True)
    case(2, 32, 8, 4096, True, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
