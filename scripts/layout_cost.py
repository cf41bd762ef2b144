"""What an operand layout costs the provider: the same attention call on contiguous operands and on
views as model code makes them, side by side in one process (GPU).

    python3 scripts/layout_cost.py [--repeats 30] [--json FILE]

Packed (varlen) operands that are not a contiguous, 16-byte-aligned (T, H, D) tensor are copied
before cuDNN reads them (docs/layouts.md); dense views with usable strides are read in place. For
each layout this prints the median CUDA-event time of the provider's forward and forward+backward
(``csp.attention``), the ratio to the contiguous layout, and the time of the copies alone (what
``.contiguous()`` of each operand costs), on the bench's varlen case (16 sequences of 128..4096
tokens, H=16, D=128, bf16, causal) and a dense (4, 16, 4096, 128) causal case. Inputs are randn,
never zeros; each timing is the median of ``--repeats`` samples of one call after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.core import counters  # noqa: E402
from cudnn_sdpa_provider.tools.bench import MATRIX  # noqa: E402
from cudnn_sdpa_provider.tools.bench.measure import event_times  # noqa: E402

DTYPE = torch.bfloat16


def _median_ms(fn, repeats: int, warmup: int = 5) -> float:
    """Median CUDA-event time of one ``fn()`` call (the bench's own timing loop)."""
    return statistics.median(event_times(lambda _: fn(), [None], repeats, warmup))


def _packed_layouts(t: int, h: int, d: int) -> dict:
    """name -> (q, k, v), each (T, H, D), built the way model code builds them."""
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE)

    qkv = leaf(t, 3 * h * d)
    fused = qkv.view(t, 3, h, d).unbind(1)  # one QKV projection
    wide = leaf(t, h, d + 64)
    htd = [leaf(h, t, d).transpose(0, 1) for _ in range(3)]
    off = leaf(3 * t * h * d + 1)[1:]
    return {
        "contiguous": (leaf(t, h, d), leaf(t, h, d), leaf(t, h, d)),
        "fused_qkv_views": fused,
        "q_head_dim_slice": (wide[..., :d], leaf(t, h, d), leaf(t, h, d)),
        "htd_storage": tuple(htd),
        "misaligned_base": tuple(off[i * t * h * d:(i + 1) * t * h * d].view(t, h, d) for i in range(3)),
    }


def _dense_layouts(b: int, h: int, s: int, d: int) -> dict:
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE)

    qkv = leaf(b, s, 3, h, d)
    off = leaf(3 * b * h * s * d + 1)[1:]
    return {
        "contiguous": (leaf(b, h, s, d), leaf(b, h, s, d), leaf(b, h, s, d)),
        "bshd_fused_qkv_views": tuple(x.transpose(1, 2) for x in qkv.unbind(2)),
        "misaligned_base": tuple(off[i * b * h * s * d:(i + 1) * b * h * s * d].view(b, h, s, d) for i in range(3)),
    }


def _measure(name: str, ops: tuple, call, repeats: int) -> dict:
    leaves = [x.detach().requires_grad_() for x in ops]  # views keep their strides: detach keeps them
    go = torch.randn_like(call(*ops))

    def fwd():
        with torch.no_grad():
            call(*ops)

    def fwd_bwd():
        out = call(*leaves)
        torch.autograd.grad(out, leaves, go)

    before = counters.stats()
    row = {"layout": name, "fwd_ms": _median_ms(fwd, repeats), "fwd_bwd_ms": _median_ms(fwd_bwd, repeats),
           "copy_ms": _median_ms(lambda: [x.contiguous() if x.is_contiguous() and x.data_ptr() % 16 == 0
                                          else torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
                                          for x in ops], repeats)}
    delta = counters.stats() - before
    row["counted"] = delta.to_dict()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layout_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    case = next(c for c in MATRIX if c.kind == "varlen")
    lens = torch.tensor(case.seq_lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu, top = cu.cuda(), int(lens.max())

    def packed(q, k, v):
        return csp.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top,
                             is_causal=True)

    def dense(q, k, v):
        return csp.attention(q, k, v, is_causal=True)

    rows = []
    for kind, made, call in (("varlen", _packed_layouts(int(lens.sum()), case.h_q, case.head_dim), packed),
                             ("dense", _dense_layouts(4, 16, 4096, 128), dense)):
        for name, ops in made.items():
            row = dict(_measure(name, ops, call, args.repeats), kind=kind)
            rows.append(row)
        base = next(r for r in rows if r["kind"] == kind and r["layout"] == "contiguous")
        for r in rows:
            if r["kind"] == kind:
                r["fwd_vs_contiguous"] = r["fwd_ms"] / base["fwd_ms"]
                r["fwd_bwd_vs_contiguous"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} cuDNN {torch.backends.cudnn.version()}")
    print(f"{'kind':7} {'layout':22} {'fwd ms':>8} {'x':>6} {'fwd+bwd ms':>11} {'x':>6} {'copies ms':>10}  counted")
    for r in rows:
        print(f"{r['kind']:7} {r['layout']:22} {r['fwd_ms']:8.3f} {r['fwd_vs_contiguous']:6.3f} "
              f"{r['fwd_bwd_ms']:11.3f} {r['fwd_bwd_vs_contiguous']:6.3f} {r['copy_ms']:10.3f}  {r['counted']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
