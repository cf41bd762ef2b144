"""Where warm generation's time goes: decode calls at lengths already seen, native against the provider (GPU).

    python3 scripts/decode_profile.py calls [--batches 1,8] [--steps 128]
    python3 scripts/decode_profile.py generate PATH [--batch 8] [--top 25]

``calls``: the decode calls a generation makes, layer by layer, as Hugging Face's eager Llama makes
them (q (B, 1, 32, 128) seen through ``transpose(1, 2)``; K/V (B, 8, S, 128) grown by ``torch.cat``
along S, as DynamicCache does), for S = 512 .. 512 + steps, first a pass that sees every length,
then the timed pass over the same lengths (what a warm generation is). Per path (native's default,
``sdpa_kernel(FLASH_ATTENTION)``, the provider under ``csp.enable()``): host microseconds per call
(no sync between calls: what the CPU spends), the pass's wall time (synchronised at its ends), and
the median CUDA-event time of one call at the last length. 16 layers per step, as the bench's model.

``generate PATH`` (native, flash, provider, cudnn; the paths of the bench's ``hf_generate`` rows:
provider is ``attn_implementation="sdpa"`` inside ``csp.enable()``, cudnn the registered
``attn_implementation="cudnn"`` with the provider not enabled): the bench's 16-layer model (random weights,
bf16), prompt 808 + 128 new tokens, generated once to see every length, then again under
torch.profiler: the top ops by self CPU time and by CUDA time, and the number of attention calls
with their share. So the gap between the warm ``hf_generate`` rows (results/gpu-runs.md, run 50:
batch 8, provider 329 tokens/s against native 606) is broken down in one call.

Inputs are random (never zeros); timing follows the project's method (events, warm-up, medians).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

PATHS = ("native", "flash", "provider")
GENERATE_PATHS = ("native", "flash", "provider", "cudnn")
LAYERS = 16


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    calls = sub.add_parser("calls", help="decode calls at seen lengths, host and kernel time per path")
    calls.add_argument("--batches", default="1,8", type=_batches, help="comma-separated batch sizes (default 1,8)")
    calls.add_argument("--steps", default=128, type=_positive, help="new tokens per pass (default 128)")
    gen = sub.add_parser("generate", help="a warm generation under torch.profiler")
    gen.add_argument("path", choices=GENERATE_PATHS)
    gen.add_argument("--batch", default=8, type=_positive)
    gen.add_argument("--top", default=25, type=_positive, help="rows of each profiler table (default 25)")
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _batches(text: str) -> tuple[int, ...]:
    return tuple(_positive(part) for part in text.split(","))


def _scope(path: str):
    if path == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    if path == "provider":
        import cudnn_sdpa_provider as csp

        return csp.enable()
    return contextlib.nullcontext()  # native; cudnn: the registered attn_implementation, provider not enabled


def _caches(torch, batch: int, prompt: int, steps: int):
    """Each step's (k, v) as DynamicCache holds them: the prompt's, then one token cat'ed per step."""
    k = torch.randn(batch, 8, prompt, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = []
    for _ in range(steps):
        k = torch.cat([k, torch.randn(batch, 8, 1, 128, device="cuda", dtype=torch.bfloat16)], dim=-2)
        v = torch.cat([v, torch.randn(batch, 8, 1, 128, device="cuda", dtype=torch.bfloat16)], dim=-2)
        out.append((k, v))
    return out


def calls(batches, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    for batch in batches:
        caches = _caches(torch, batch, 512, steps)
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for path in PATHS:
            with _scope(path):
                def walk():
                    for k, v in caches:
                        for _ in range(LAYERS):
                            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

                walk()  # every length seen once (a warm generation's lengths)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                walk()
                host = time.perf_counter() - t0
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                k, v = caches[-1]
                events = []
                for _ in range(25):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    b.record()
                    b.synchronize()
                    events.append(a.elapsed_time(b))
            n = steps * LAYERS
            print(f"batch {batch:2d} {path:9s} host {host / n * 1e6:7.1f} us/call  wall {wall / n * 1e6:7.1f} us/call  "
                  f"kernel at S {k.shape[-2]} {statistics.median(events[5:]) * 1e3:6.1f} us")
        if "cudnn_sdpa_provider" in sys.modules:
            import cudnn_sdpa_provider as csp

            print(csp.report())


def generate(path: str, batch: int, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    if path == "cudnn":
        from cudnn_sdpa_provider.integrations import transformers as csp_hf

        csp_hf.register()
    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="cudnn" if path == "cudnn" else "sdpa",
                                              dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (batch, 808), device="cuda")

    def once():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                       do_sample=False, pad_token_id=0)

    with _scope(path), torch.inference_mode():
        once()  # every length seen
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once()
            torch.cuda.synchronize()
    print(f"{path} batch {batch}: warm generation {plain * 1e3:.1f} ms, {batch * 128 / plain:.1f} tokens/s "
          f"(unprofiled)")
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=top))
    print(table.table(sort_by="cuda_time_total" if hasattr(table[0], "cuda_time_total") else "device_time_total",
                      row_limit=top))
    if path in ("provider", "cudnn"):
        import cudnn_sdpa_provider as csp

        print(csp.report())


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("decode_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "calls":
        calls(args.batches, args.steps)
    else:
        generate(args.path, args.batch, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
