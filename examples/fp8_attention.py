"""FP8 attention in a bf16 model: ``csp.fp8.attention`` with a ``Recipe``, forward and backward.

    python examples/fp8_attention.py          (from a checkout: PYTHONPATH=.)

A causal self-attention layer whose attention runs in FP8 (float8_e4m3fn) on cuDNN's FP8 graphs
(Hopper or newer, cuDNN >= 9.14, head dim 128 for the backward on Hopper): q, k, v are quantised
with the recipe's current scaling (the default: this call's amax; the backward checked and re-run
where it would saturate; ``Recipe(scaling="delayed")``: one pass, scales from an amax history on
the device, a call that would clip redone at its own scale and counted, docs/fp8.md).
Activations and gradients stay bf16 around it. A few
optimiser steps run beside an identical bf16 layer from the same weights; the losses and the
output's error against fp32 attention are printed with the provider's report, and so is a packed
(varlen) call: sequences of different lengths in one (T, H, D) tensor with ``cu_seqlens_q``
(forward on cuDNN's packed FP8 graph; backward on the FP8 reference over the padded form, reason
``cudnn_known_issue``: cuDNN 9.19's padded FP8 backward gave wrong gradients on Hopper). On CPU the same code
runs on the FP8 reference (reason ``no_cuda``), with the same quantisation.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp

WIDTH, HEADS, SEQ, BATCH, STEPS = 512, 4, 256, 2, 3


class SelfAttention(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)
        self.attend = attend

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4).unbind()
        return self.out(self.attend(q, k, v).transpose(1, 2).reshape(b, s, WIDTH))


def packed_error(device, recipe) -> float:
    """Packed (varlen) FP8 attention with gradients: three sequences in one (T, H, D) tensor."""
    lens = [200, 37, 120]
    cu_seqlens = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), HEADS, WIDTH // HEADS, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    out = csp.fp8.attention(q, k, v, cu_seqlens_q=cu_seqlens, max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                            is_causal=True, recipe=recipe)
    out.sum().backward()  # q.grad, k.grad, v.grad: (T, H, D) bf16
    ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].float().transpose(0, 1) for t in (q, k, v)),
                                                    is_causal=True).transpose(0, 1)
                     for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    recipe = csp.fp8.Recipe()
    fp8 = SelfAttention(lambda q, k, v: csp.fp8.attention(q, k, v, is_causal=True, recipe=recipe))
    fp8 = fp8.to(device, torch.bfloat16)
    bf16 = copy.deepcopy(fp8)
    bf16.attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = torch.randn(BATCH, SEQ, WIDTH, device=device, dtype=torch.bfloat16)
    target = torch.randn_like(x)
    csp.reset_stats()
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (fp8, bf16)]
    for step in range(STEPS):
        losses = []
        for model, opt in zip((fp8, bf16), opts):
            loss = F.mse_loss(model(x).float(), target.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"step {step}: loss fp8 {losses[0]:.5f}  bf16 {losses[1]:.5f}")
    with torch.no_grad():
        q, k, v = (t.detach() for t in torch.randn(3, BATCH, HEADS, SEQ, WIDTH // HEADS, device=device,
                                                     dtype=torch.bfloat16).unbind())
        got = csp.fp8.attention(q, k, v, is_causal=True, recipe=recipe).float()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    error = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"FP8 attention vs fp32: max|out - ref| / max|ref| = {error:.4f} (FP8's rounding: a few percent)")
    print(f"packed FP8 attention vs fp32: max|err| / max|ref| = {packed_error(device, recipe):.4f}")
    print(f"recipe re-runs: {recipe.retries}, saturated calls: {csp.stats().fp8_saturated}")
    print(csp.report())


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; unknown options: exit 2
    main()
