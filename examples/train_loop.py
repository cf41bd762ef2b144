"""A training loop under ``csp.enable()``, then the audit of what ran.

    python examples/train_loop.py [--steps 3] [--device cpu|cuda]     (from a checkout: PYTHONPATH=.)

Trains the package's small GQA transformer (``cudnn_sdpa_provider.tools.demo.TinyGQA``: causal
attention through ``F.scaled_dot_product_attention``) for a few steps. On a CUDA machine with
cuDNN every attention forward and backward is served by a cuDNN graph; on a CPU-only machine every
call falls back to PyTorch's kernel with reason ``no_cuda``, and the report says so.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.tools.demo import TinyGQA


def train(steps: int, device: torch.device, batch: int = 2, seq: int = 64) -> list[float]:
    torch.manual_seed(0)
    model = TinyGQA().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 256, (batch, seq + 1), device=device)  # one batch, learned by heart
    losses = []
    with csp.enable():  # process-wide while the block runs; restored on exit, even on error
        for _ in range(steps):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad value is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps, >= 1 (default 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu")
    device = torch.device(args.device)

    before = csp.stats()
    losses = train(args.steps, device)
    run = csp.stats() - before  # this run only

    print(f"trained {len(losses)} steps on {device}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    calls = run.total("dense_fwd") + run.total("dense_bwd")
    served = run.served["dense_fwd"] + run.served["dense_bwd"]
    print(f"attention calls: {calls}, served by cuDNN graphs: {served}")
    print(csp.report(run))


if __name__ == "__main__":
    main()
