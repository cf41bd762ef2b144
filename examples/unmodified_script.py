"""A plain PyTorch training script: it does not import cudnn-sdpa-provider at all.

Run it under the provider without editing it, through the environment (the package must be
installed, which puts its startup hook ``cudnn_sdpa_provider_startup.pth`` into site-packages):

    CUDNN_SDPA_PROVIDER=1 CUDNN_SDPA_PROVIDER_REPORT=run.json python examples/unmodified_script.py

The provider switches on right after the script's ``import torch``, and the telemetry is written
to run.json at exit. ``cudnn-sdpa run examples/unmodified_script.py`` does the same from the CLI.
Without the variable the script runs exactly as plain PyTorch.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(Attention(), Attention()).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(2, 32, 128, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f} on {device}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; unknown options: exit 2
    main()
