"""Paged-KV decode: the provider's paged cuDNN graph against PyTorch on the same cache (GPU).

    python3 scripts/bench_paged.py [--batches 8,32,64] [--contexts 4096,16384,32768] [--heads 32/8]
                                   [--dim 128] [--block-size 16] [--repeats 20] [--json out.json]

One decode step (S_q = 1) per row: bf16 q (B, H_q, 1, D) over a paged cache of N blocks (N, H_k,
block_size, D) with a random block table (B, context / block_size) and lengths random in
[3/4 context, context]. Paths, in one process on the same values:

* ``provider``: ``csp.attention(q, k_cache, v_cache, block_table=, seq_lens_kv=, kv_layout="HND")``, eager;
* ``provider_graphed``: the same call captured in a CUDA graph and replayed (how decode is served);
* ``native_gather``: what PyTorch offers for this cache: gather the blocks into dense (B, H_k, S, D)
  K/V, then ``F.scaled_dot_product_attention`` with a boolean length mask and ``enable_gqa``;
* ``native_dense``: the same SDPA call on K/V that are already dense (no gather), for reference.

CUDA-event medians of ``--repeats`` calls after warm-up; ratio = native_gather / provider. The
output of every path is compared with the provider's on the same inputs (max error relative to the
largest |value|), and the provider call is checked to be served (its counter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.core import counters  # noqa: E402
from cudnn_sdpa_provider.engine.tuning import cuda_timer  # noqa: E402  (median ms by CUDA events)


def _case(b, ctx, h_q, h_k, d, block_size, gen):
    m = ctx // block_size
    n = b * m + 8
    q = torch.randn(b, h_q, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache = torch.randn(n, h_k, block_size, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(n, h_k, block_size, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(n, device="cuda", generator=gen)[: b * m].view(b, m).to(torch.int32)
    lens = torch.randint(ctx * 3 // 4, ctx + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    return q, k_cache, v_cache, table, lens


def _gather(cache, table):
    b, m = table.shape
    return cache[table.long()].permute(0, 2, 1, 3, 4).reshape(b, cache.shape[1], m * cache.shape[2], cache.shape[3])


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def row(b, ctx, args, gen) -> dict:
    h_q, h_k = (int(x) for x in args.heads.split("/"))
    q, kc, vc, table, lens = _case(b, ctx, h_q, h_k, args.dim, args.block_size, gen)
    mask = (torch.arange(ctx, device="cuda").view(1, 1, 1, -1) < lens.view(-1, 1, 1, 1))
    provider = lambda: csp.attention(q, kc, vc, block_table=table, seq_lens_kv=lens, kv_layout="HND")  # noqa: E731
    native_gather = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q, _gather(kc, table), _gather(vc, table), attn_mask=mask, enable_gqa=h_q != h_k)
    k_dense, v_dense = _gather(kc, table), _gather(vc, table)
    native_dense = lambda: F.scaled_dot_product_attention(  # noqa: E731
        q, k_dense, v_dense, attn_mask=mask, enable_gqa=h_q != h_k)
    with torch.no_grad():
        before = counters.stats()
        out = provider()
        served = (counters.stats() - before).to_dict()["paged_fwd"]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            provider()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_out = provider()
        graph.replay()
        ref = native_gather()
        result = {
            "batch": b, "context": ctx, "heads": args.heads, "dim": args.dim, "block_size": args.block_size,
            "served": served,
            "provider_ms": cuda_timer(provider, warmup=3, repeats=args.repeats),
            "provider_graphed_ms": cuda_timer(graph.replay, warmup=3, repeats=args.repeats),
            "native_gather_ms": cuda_timer(native_gather, warmup=3, repeats=args.repeats),
            "native_dense_ms": cuda_timer(native_dense, warmup=3, repeats=args.repeats),
            "err_provider_vs_native": _rel(out, ref),
            "err_graphed_vs_native": _rel(graphed_out, ref),
            "kv_bytes": int(lens.sum().item()) * h_k * args.dim * 2 * 2,
        }
    result["ratio"] = result["native_gather_ms"] / result["provider_ms"]
    result["ratio_graphed"] = result["native_gather_ms"] / result["provider_graphed_ms"]
    result["provider_graphed_TBps"] = result["kv_bytes"] / result["provider_graphed_ms"] / 1e9
    del graph, k_dense, v_dense
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_paged: needs a CUDA GPU", file=sys.stderr)
        return 1
    import cudnn

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"frontend {cudnn.__version__}; decode S_q=1, H {args.heads}, d{args.dim}, block {args.block_size}, bf16, "
          f"median of {args.repeats}", flush=True)
    print(f"{'B':>3} {'ctx':>6} | {'provider':>9} {'graphed':>9} {'native gather':>13} {'native dense':>12} | "
          f"{'ratio':>6} {'graphed':>7} | TB/s (graphed) | err vs native | served", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            r = row(b, ctx, args, gen)
            rows.append(r)
            print(f"{b:3d} {ctx:6d} | {r['provider_ms']:9.4f} {r['provider_graphed_ms']:9.4f} "
                  f"{r['native_gather_ms']:13.4f} {r['native_dense_ms']:12.4f} | {r['ratio']:5.2f}x "
                  f"{r['ratio_graphed']:6.2f}x | {r['provider_graphed_TBps']:14.2f} | "
                  f"{r['err_provider_vs_native']:.2e}/{r['err_graphed_vs_native']:.2e} | {r['served']}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                       "frontend": cudnn.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
