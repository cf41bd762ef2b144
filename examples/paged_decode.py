"""Serving with a paged KV cache: chunked prefill, then decode, through ``csp.attention(block_table=)``.

    python examples/paged_decode.py          (from a checkout: PYTHONPATH=.)

A vLLM-style cache: one pool of fixed-size blocks per layer, (N, block_size, H_kv, D) like
FlashAttention's, and a block table that lists each sequence's blocks in order, so sequences grow
without copying. ``csp.attention`` reads the cache through the table: pass the pool as it is with
``kv_layout="NHD"`` (required with a block table: a pool stored (N, H_kv, block_size, D) is
``kv_layout="HND"``, and the two can have the same shape), the table, and each sequence's cached
length. Prefill chunks are the last tokens of their sequences, hence ``is_causal=True,
bottom_right=True``; a decode step is S_q = 1. On CUDA (cuDNN >= 9.6) this runs on cuDNN's paged
attention graph; on CPU it falls back (reason ``no_cuda``) to a gather and the aten composite, and
the report says so. Each sequence's output is checked against F.sdpa (in fp64) on its keys gathered
dense.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
PROMPTS, CHUNK, DECODE_STEPS = [37, 5, 60], 32, 4


class PagedCache:
    """A pool of blocks and a block table; ``append`` writes new keys/values at each sequence's end."""

    def __init__(self, batch: int, max_blocks: int, blocks: int, device, dtype):
        self.k = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        free = torch.randperm(blocks)  # any blocks, in any order: the table says where each one is
        self.table = free[: batch * max_blocks].view(batch, max_blocks).to(device=device, dtype=torch.int32)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)

    def append(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, H_kv, D): the next n tokens of sequence b."""
        pos = torch.arange(int(self.lengths[b]), int(self.lengths[b]) + k.shape[0], device=k.device)
        blocks = self.table[b, pos // BLOCK].long()
        self.k[blocks, pos % BLOCK] = k
        self.v[blocks, pos % BLOCK] = v
        self.lengths[b] += k.shape[0]

    def attend(self, q: torch.Tensor, lengths_q: torch.Tensor) -> torch.Tensor:
        """q (B, H, S_q, D): each sequence's newest ``lengths_q`` tokens against its whole cache."""
        return csp.attention(q, self.k, self.v, block_table=self.table, kv_layout="NHD", seq_lens_q=lengths_q,
                             seq_lens_kv=self.lengths, is_causal=True, bottom_right=True)


def main() -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batch, total = len(PROMPTS), max(PROMPTS) + DECODE_STEPS
    cache = PagedCache(batch, -(-total // BLOCK), batch * -(-total // BLOCK) + 4, device, dtype)
    keys = [torch.randn(n + DECODE_STEPS, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for n in PROMPTS]
    values = [torch.randn_like(k) for k in keys]
    queries = [torch.randn(n + DECODE_STEPS, HEADS, HEAD_DIM, device=device, dtype=dtype) for n in PROMPTS]
    outputs = [[] for _ in PROMPTS]

    def step(counts):  # the next counts[b] tokens of every sequence, padded into one (B, H, S_q, D) query
        s_q = max(counts)
        q = torch.zeros(batch, HEADS, s_q, HEAD_DIM, device=device, dtype=dtype)
        for b, n in enumerate(counts):
            start = int(cache.lengths[b])
            cache.append(b, keys[b][start:start + n], values[b][start:start + n])
            q[b, :, :n] = queries[b][start:start + n].transpose(0, 1)
        out = cache.attend(q, torch.tensor(counts, dtype=torch.int32, device=device))
        for b, n in enumerate(counts):
            outputs[b].append(out[b, :, :n])

    before = csp.stats()
    with torch.inference_mode():
        done = [0] * batch
        while any(d < n for d, n in zip(done, PROMPTS)):  # chunked prefill
            counts = [min(CHUNK, n - d) for d, n in zip(done, PROMPTS)]
            step(counts)
            done = [d + c for d, c in zip(done, counts)]
        for _ in range(DECODE_STEPS):
            step([1] * batch)
    run = csp.stats() - before

    worst = 0.0
    for b in range(batch):
        got = torch.cat(outputs[b], dim=1).double()  # (H, tokens, D)
        k = keys[b].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0).double()
        v = values[b].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0).double()
        want = F.scaled_dot_product_attention(queries[b].transpose(0, 1).double(), k, v, is_causal=True)  # fp64
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    print(f"paged cache: {cache.k.shape[0]} blocks of {BLOCK} tokens on {device}; prompts {PROMPTS} in chunks of "
          f"{CHUNK}, then {DECODE_STEPS} decode steps; lengths {cache.lengths.tolist()}")
    print(f"max |out - F.sdpa on each sequence's keys| / max|ref| = {worst:.2e}")
    print(csp.report(run))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; unknown options: exit 2
    main()
