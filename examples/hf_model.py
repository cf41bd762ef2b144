"""A Hugging Face model's attention on cuDNN graphs: ``attn_implementation="cudnn"``.

    python examples/hf_model.py [--device cpu|cuda]     (from a checkout: PYTHONPATH=.; needs transformers)

Builds a tiny random-weight Llama (GQA: 4 query heads over 2 KV heads), registers the package's
attention function with transformers, and runs one training step (forward + backward) on a
right-padded batch. Right padding reaches cuDNN as per-sequence lengths, not as an S x S mask.
The same step then runs with transformers' own ``"sdpa"`` attention, provider off, and the two
losses are compared. On a CPU-only machine every call falls back (reason ``no_cuda``) and the report
says so.
"""

from __future__ import annotations

import argparse

import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.integrations import transformers as csp_hf

LENGTHS = (64, 40, 17)  # real tokens per row; the rest is right padding


def build(attn_implementation: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    torch.manual_seed(0)  # the same weights for both implementations
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(device=device, dtype=dtype).train()


def batch(device: torch.device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)  # padded positions carry no loss
    return ids.to(device), mask.to(device), labels.to(device)


def step(model, ids, mask, labels) -> float:
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401  (checked here, after --help, so that its absence is one line)
    except ImportError as exc:
        parser.exit(1, f"{parser.prog}: needs transformers ({exc}); install it: "
                       "pip install 'transformers>=5' (or the package's [transformers] extra)\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available (torch {torch.__version__}); use --device cpu")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = batch(device)

    registration = csp_hf.register()  # attn_implementation="cudnn" from here on
    try:
        before = csp.stats()
        loss = step(build(csp_hf.DEFAULT_NAME, device, dtype), *data)
        run = csp.stats() - before
    finally:
        registration.remove()
    reference = step(build("sdpa", device, dtype), *data)  # provider off: PyTorch's own attention

    print(f"llama, lengths {list(LENGTHS)}, {device}: loss {loss:.4f} (attn_implementation={csp_hf.DEFAULT_NAME!r}), "
          f"{reference:.4f} ('sdpa', provider off), |diff| {abs(loss - reference):.2e}")
    print(f"attention calls: {run.total('dense_fwd') + run.total('dense_bwd')}, "
          f"served by cuDNN graphs: {run.served['dense_fwd'] + run.served['dense_bwd']}")
    print(csp.report(run))


if __name__ == "__main__":
    main()
