"""Packed variable-length attention: sequences of different lengths in one (T, H, D) batch.

    python examples/varlen_packing.py          (from a checkout: PYTHONPATH=.)

1. ``csp.attention`` with ``cu_seqlens_q`` (prefix sums of the lengths) and ``max_seqlen_q/kv``
   (host ints: the longest sequence; never read from the device), causal, forward and backward.
   Each sequence attends only to itself; the result is checked against F.sdpa per sequence.
   It runs anywhere: on CPU the call falls back (reason ``no_cuda``) to the aten composite.
2. On CUDA only, ``torch.nn.attention.varlen.varlen_attn`` under ``csp.enable()``: PyTorch's own
   varlen API, routed to the same cuDNN graphs. On CPU this part is skipped with a message.
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp

LENGTHS = [5, 12, 3, 9]
HEADS, HEAD_DIM = 4, 64


def pack(lengths, device, dtype):
    """Random packed q, k, v (T, H, D) and cu_seqlens (B+1,) int32 for the given lengths."""
    total = sum(lengths)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    return q, k, v, cu


def per_sequence_reference(q, k, v, lengths):
    """F.sdpa on each sequence separately, (T, H, D) packed again."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].detach().float().transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def functional_api(device, dtype) -> None:
    q, k, v, cu = pack(LENGTHS, device, dtype)
    longest = max(LENGTHS)  # a Python int: known on the host, no device sync
    before = csp.stats()
    out, lse = csp.attention(q, k, v, cu_seqlens_q=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                             is_causal=True, return_lse=True)
    out.float().square().sum().backward()
    run = csp.stats() - before
    err = (out.float() - per_sequence_reference(q, k, v, LENGTHS)).abs().max().item()
    print(f"csp.attention packed: lengths {LENGTHS} -> out {tuple(out.shape)}, lse {tuple(lse.shape)} (T, H), "
          f"q.grad {tuple(q.grad.shape)}")
    print(f"max |out - per-sequence F.sdpa| = {err:.2e}")
    print(csp.report(run))


def _causal_kwargs(varlen_attn) -> dict:
    # torch 2.11 spells causal as is_causal=True; later releases as window_size=(-1, 0).
    params = inspect.signature(varlen_attn).parameters
    return {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}


def torch_varlen_api(device, dtype) -> None:
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, cu = pack(LENGTHS, device, dtype)
    longest = max(LENGTHS)
    before = csp.stats()
    with csp.enable():
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **_causal_kwargs(varlen_attn))
        out.float().square().sum().backward()
    run = csp.stats() - before
    print(f"varlen_attn under csp.enable(): out {tuple(out.shape)}, "
          f"served varlen_fwd={run.served['varlen_fwd']} varlen_bwd={run.served['varlen_bwd']}")
    print(csp.report(run))


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    functional_api(device, dtype)
    if cuda:
        torch_varlen_api(device, dtype)
    else:
        print("varlen_attn part skipped: torch.nn.attention.varlen.varlen_attn needs CUDA")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; unknown options: exit 2
    main()
