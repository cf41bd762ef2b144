"""gpt-oss-style attention: learned per-head sinks with a causal sliding window, with backward.

    python examples/sinks.py          (from a checkout: PYTHONPATH=.)

A sink is one extra logit per head that joins every query's softmax but carries no value: it
lets a head put weight "nowhere". ``F.scaled_dot_product_attention`` cannot express it;
``csp.attention(..., sinks=...)`` can, with a gradient for the sinks. gpt-oss pairs sinks with a
128-token sliding window on alternate layers: FlashAttention's ``window=(127, 0)`` (a query sees
itself and the 127 keys before it). On CUDA (cuDNN >= 9.13) this runs on a cuDNN graph; on CPU
it falls back (reason ``no_cuda``) to the aten composite, and the report says so.
"""

from __future__ import annotations

import argparse

import torch

import cudnn_sdpa_provider as csp

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 2, 256, 8, 2, 64, 128


def main() -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)  # GQA
    v = torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    sinks = torch.nn.Parameter(torch.zeros(HEADS, device=device))  # (H_q,) logits, fp32

    before = csp.stats()
    out = csp.attention(q, k, v, window=(WINDOW - 1, 0), sinks=sinks)
    out.float().square().mean().backward()
    run = csp.stats() - before

    print(f"out {tuple(out.shape)} {out.dtype} on {device}, window=({WINDOW - 1}, 0)")
    print("sinks.grad:", [round(g, 6) for g in sinks.grad.tolist()])
    print(csp.report(run))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; unknown options: exit 2
    main()
