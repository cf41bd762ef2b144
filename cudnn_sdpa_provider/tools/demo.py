"""A small built-in transformer (GQA, causal, RMSNorm) trained a few steps under the provider.

Data only: ``run_demo`` returns the losses and the telemetry of the run; the CLI prints them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGQA", "run_demo", "batches", "default_device", "CORPUS", "MAX_STEPS"]

#: Steps at most: every step's batch is made up front (4 x 129 int64, 4 KB a step), so a huge count
#: would fail in the allocator instead of in the argument check.
MAX_STEPS = 10_000


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyGQA(nn.Module):
    """Byte-level decoder: 2 blocks, 4 query heads over 2 KV heads, head dim 64."""

    def __init__(self, vocab: int = 256, dim: int = 256, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


#: The training text: a byte-level model learns its letter and word statistics within a few steps,
#: so the loss falls visibly (random bytes would leave it at ln 256 whatever the model does).
CORPUS = (
    "Attention is computed on cuDNN graphs when the provider serves the call, and on PyTorch's own "
    "kernels when it falls back; every call is counted with the reason, so the report shows what ran. "
) * 8


def batches(steps: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``(steps, batch, seq + 1)`` int64 windows of ``CORPUS`` bytes at seeded random offsets."""
    text = torch.tensor(list(CORPUS.encode()), dtype=torch.int64)
    if text.numel() <= seq + 1:
        raise ValueError(f"seq must be < {text.numel() - 1} (the corpus length), got {seq}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    starts = torch.randint(0, text.numel() - seq - 1, (steps, batch), generator=gen)
    return text[starts.unsqueeze(-1) + torch.arange(seq + 1)]


def default_device(device: str | None = None) -> torch.device:
    """``device``, or CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def run_demo(steps: int = 5, device: str | None = None, strict: bool = False, seq: int = 128, batch: int = 4,
             seed: int = 0, lr: float = 1e-3, progress=None) -> dict:
    """Train ``TinyGQA`` for ``steps`` steps inside ``enable()``; return losses and telemetry.

    Seeded (model initialisation and data) without touching the caller's global RNG state: on the
    CPU two runs give the same losses. ``progress(step, steps, loss)``, when given, is called after
    each step (step counts from 1).
    """
    from ..hooks.activation import enable
    from ..core.counters import stats

    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an int from 1 to {MAX_STEPS}, got {steps!r}")
    dev = default_device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGQA().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = batches(steps, batch, seq, seed).to(dev)
    before = stats()
    losses = []
    with enable(strict=strict):
        for step in range(steps):
            tokens = data[step]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, steps, losses[-1])
    return {"device": str(dev), "losses": losses, "stats": stats() - before}
