"""Changing shapes on the GPU: what a new sequence length costs, and generation end to end.

    python3 scripts/bench_shapes.py new_length  PATH     # one path per process: build cost counts
    python3 scripts/bench_shapes.py hf_generate PATH BATCH
    python3 scripts/bench_shapes.py all --json FILE      # every case and path, each in a fresh process

PATH: ``native`` (PyTorch's default SDPA choice; cuDNN on an H200 with torch 2.11), ``flash``
(``sdpa_kernel(FLASH_ATTENTION)``), ``provider`` (F.sdpa inside ``csp.enable()``), ``cudnn`` (the
Hugging Face integration, ``attn_implementation="cudnn"``; hf_generate only).

* ``new_length``: decode (B 8, H 32/8, D 128, one query against a cache of S_kv 4000..4031, each
  length new) and causal prefill (B 1, H 32/8, S 700..731), forward and forward+backward: the first
  call at each new length against the repeated call (wall time, synchronised, medians; the repeated
  call's CUDA-event time beside them).
* ``hf_dynamic_padding``: 50 training steps (forward + backward) of the same model with 4 layers,
  batch 8, lengths drawn from 128..2048 and right-padded to each batch's longest; total time,
  first step, graph builds (``flash`` cannot take HF's padding mask: its row is an error).
* ``hf_generate``: a 16-layer Llama-like model (hidden 2048, 32/8 heads, MLP 5632, random weights,
  bf16), greedy, prompt 512 + 128 new tokens; cold = three generations whose lengths (prompts 512,
  660, 808, each + 128) were never seen before, warm = the last one again; tokens/s, graph builds.

Each row is printed as JSON; ``all`` collects them with ratios against native. Inputs are random
(never zeros); timing follows the device METHOD (events, warm-up, medians).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

PATHS = ("native", "flash", "provider")
HF_PATHS = ("native", "flash", "provider", "cudnn")


def _scope(path: str):
    if path == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    if path in ("provider", "cudnn"):
        import cudnn_sdpa_provider as csp

        return csp.enable()
    return contextlib.nullcontext()


def _builds() -> int:
    """Graphs this process built (the package's own count; -1 on a path that never imports it)."""
    if "cudnn_sdpa_provider" not in sys.modules:
        return -1
    from cudnn_sdpa_provider.engine import graphs

    return graphs.cache_info()["built"]


def _event_median(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _decode_inputs(s_kv, b=8, h_q=32, h_kv=8, d=128):
    q = torch.randn(b, 1, h_q, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, h_kv, s_kv, d, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def _prefill_inputs(s, b=1, h_q=32, h_kv=8, d=128, grad=False):
    make = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    return tuple(t.requires_grad_(grad) for t in (make(h_q), make(h_kv), make(h_kv)))


def new_length(path: str) -> list[dict]:
    rows = []
    # warm-up outside the measured lengths: the process, cuBLAS and the library are loaded once
    with _scope(path):
        q, k, v = _decode_inputs(64)
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for case, make, lengths in (("decode", _decode_inputs, range(4000, 4032)), ("prefill", _prefill_inputs,
                                                                              range(700, 732))):
        for mode in ("fwd", "fwd_bwd"):
            if case == "decode" and mode == "fwd_bwd":
                continue
            first, builds0 = [], _builds()
            with _scope(path):
                for s in lengths:
                    inputs = make(s) if case == "decode" else make(s, grad=mode == "fwd_bwd")
                    causal = case == "prefill"

                    def call(inputs=inputs, causal=causal):
                        out = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=True)
                        if mode == "fwd_bwd":
                            out.backward(torch.ones_like(out))

                    first.append(_wall(call))
                repeated = _event_median(call)
                repeated_wall = statistics.median(_wall(call) for _ in range(20))
            rows.append({"case": f"new_length_{case}_{mode}", "path": path, "first_ms_median": statistics.median(first),
                         "first_ms_max": max(first), "repeated_wall_ms": repeated_wall, "repeated_ms": repeated,
                         "first_vs_repeated": statistics.median(first) / repeated_wall, "lengths": len(first),
                         "builds": _builds() - builds0 if builds0 >= 0 else None})
    return rows


def _llama(attn: str, layers: int = 16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).eval()
    return model


def hf_generate(path: str, batch: int) -> list[dict]:
    if path == "cudnn":
        from cudnn_sdpa_provider.integrations import transformers as csp_hf

        csp_hf.register()
    model = _llama("cudnn" if path == "cudnn" else "sdpa")
    rows = []

    def generate(prompt_len: int) -> tuple[float, int]:
        ids = torch.randint(0, 32000, (batch, prompt_len), device="cuda")
        builds0 = _builds()
        with _scope(path), torch.inference_mode():
            t = _wall(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128,
                                             min_new_tokens=128, do_sample=False, pad_token_id=0))
        return t, _builds() - builds0 if builds0 >= 0 else -1

    generate(64)  # load kernels and the library (its own lengths: 64..192)
    # cold: each generation's lengths (prompt .. prompt + 128) are all new; warm: the last one again
    for label, prompts in (("cold", (512, 660, 808)), ("warm", (808, 808, 808))):
        times, builds = [], []
        for p in prompts:
            t, n = generate(p)
            times.append(t)
            builds.append(n)
        rows.append({"case": f"hf_generate_b{batch}_{label}", "path": path, "ms": statistics.median(times),
                     "tokens_per_s": batch * 128 / (statistics.median(times) / 1e3), "builds": builds,
                     "times_ms": times})
    return rows


def hf_dynamic_padding(path: str, steps: int = 50) -> list[dict]:
    """Training steps (forward + backward) of the 4-layer model, batch 8, each batch's lengths drawn
    from 128..2048 and right-padded to its longest (what HF's data collators do); the same batches
    for every path. Step times include the first step; graph builds counted."""
    if path == "cudnn":
        from cudnn_sdpa_provider.integrations import transformers as csp_hf

        csp_hf.register()
    model = _llama("cudnn" if path == "cudnn" else "sdpa", layers=4).train()
    if path in ("provider", "cudnn"):
        import cudnn_sdpa_provider  # noqa: F401  (so that the first step's builds are counted)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(128, 2049, (8,), generator=gen)
        s = int(lengths.max())
        mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
        batches.append((torch.randint(0, 32000, (8, s), generator=gen), mask))
    times, builds0 = [], _builds()
    with _scope(path):
        for ids, mask in batches:
            ids, mask = ids.cuda(), mask.cuda()

            def step(ids=ids, mask=mask):
                loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            times.append(_wall(step))
    return [{"case": "hf_dynamic_padding", "path": path, "ms": sum(times), "first_step_ms": times[0],
             "median_step_ms": statistics.median(times), "steps": steps,
             "builds": _builds() - builds0 if builds0 >= 0 else None}]


def profile_first_calls(path: str = "provider") -> None:
    """cProfile of 32 first calls at new decode lengths (host cost of a new length), to stderr."""
    import cProfile
    import pstats

    with _scope(path):
        q, k, v = _decode_inputs(64)
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        inputs = [_decode_inputs(s) for s in range(4100, 4132)]
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for x in inputs:
            F.scaled_dot_product_attention(*x, enable_gqa=True)
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def _child(args: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        return [{"case": " ".join(args), "error": proc.stderr.strip().splitlines()[-1:] or [str(proc.returncode)]}]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_all(batches) -> list[dict]:
    rows = []
    for path in PATHS:
        rows += _child(["new_length", path])
    for batch in batches:
        for path in HF_PATHS:
            rows += _child(["hf_generate", path, str(batch)])
    for path in HF_PATHS:
        rows += _child(["hf_dynamic_padding", path])
    for row in rows:
        base = next((r for r in rows if r.get("case") == row.get("case") and r.get("path") == "native"), None)
        if base and "ms" in row:
            row["vs_native"] = base["ms"] / row["ms"]
        if base and "first_ms_median" in row:
            row["first_vs_native"] = base["first_ms_median"] / row["first_ms_median"]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("new_length", "hf_generate", "hf_dynamic_padding", "profile", "all"))
    parser.add_argument("path", nargs="?", choices=HF_PATHS)
    parser.add_argument("batch", nargs="?", type=int, default=1)
    parser.add_argument("--json", help="all: write the rows here")
    parser.add_argument("--batches", default="1,8")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.what == "all":
        rows = run_all([int(x) for x in a.batches.split(",")])
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        for row in rows:
            print(json.dumps(row))
        return 0
    if a.what == "profile":
        profile_first_calls()
        return 0
    if a.what == "new_length":
        rows = new_length(a.path)
    elif a.what == "hf_generate":
        rows = hf_generate(a.path, a.batch)
    else:
        rows = hf_dynamic_padding(a.path)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
