"""What a fresh process runs for one changing-shape (case, path[, batch]) of ``cudnn-sdpa bench``
(the cases are described in ``shapes``):

    python -m cudnn_sdpa_provider.tools.bench.shape_child CASE PATH [--batch N] --out FILE

Each row is appended to FILE as one JSON line as soon as it is measured, so a process that fails
later keeps what it measured; an exception ends the process with a traceback on stderr, which
``shape_runner`` turns into an error row. Nothing is built before a timed region but what the
warm-up says (the libraries, and graphs at lengths outside the measured ones).

Timing: first calls at a new length are synchronised wall time (a build runs on the host); the
repeated call is the median of CUDA-event times after warm-up calls (and of synchronised wall
times, for a like-for-like ``first_vs_repeated``); generation and training steps are synchronised
wall time (the host is part of what they cost). Inputs are random, never zeros.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ...core import counters
from .shapes import HF_SHAPE_PATHS, SHAPE_CASES

__all__ = ["measure", "new_length", "hf_generate", "hf_dynamic_padding", "profile_first_calls", "main"]

REPEATS, WARMUP = 20, 3  # the repeated call: timed calls, and untimed calls before them
NEW_TOKENS = 128
COLD_PROMPTS, WARM_PROMPTS = (512, 660, 808), (808, 808, 808)
PADDING_STEPS, PADDING_BATCH, PADDING_LENGTHS = 50, 8, (128, 2048)
_VOCAB = 32000
_COUNTED = ("provider", "cudnn")  # the paths whose builds and served calls the package counts


def _scope(path: str):
    if path == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    if path == "provider":
        from ...hooks import activation

        return activation.enable()
    return contextlib.nullcontext()  # native; cudnn: the registered attn_implementation


class _Counted:
    """Graph builds and served/fallback calls of the package over a region (None on paths that do
    not run it: PyTorch's own cuDNN builds are not visible from here)."""

    def __init__(self, path: str):
        self.on, self.before = path in _COUNTED, counters.stats()

    def fields(self, builds_key: str = "builds") -> dict:
        if not self.on:
            return {builds_key: None, "build_ms": None}
        diff = counters.stats() - self.before
        fallback: dict = {}
        for p in diff.to_dict().values():
            for reason, n in p["fallback"].items():
                fallback[reason] = fallback.get(reason, 0) + n
        return {builds_key: diff.builds["built"], "build_ms": round(diff.builds["build_ms"], 1),
                "served": sum(p["served"] for p in diff.to_dict().values()), "fallback_reasons": fallback}


def _event_median(fn: Callable, n: int = REPEATS, warmup: int = WARMUP) -> float:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    for a, b in zip(starts, ends):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def _wall(fn: Callable) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def decode_inputs(s_kv: int, b: int = 8, h_q: int = 32, h_kv: int = 8, d: int = 128, grad: bool = False):
    """One query token (B, H_q, 1, D seen through a transpose, as HF projects it) against a
    contiguous (B, H_kv, S_kv, D) cache (``grad`` is accepted for a like call; decode is inference)."""
    q = torch.randn(b, 1, h_q, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, h_kv, s_kv, d, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def prefill_inputs(s: int, b: int = 1, h_q: int = 32, h_kv: int = 8, d: int = 128, grad: bool = False):
    """Token-major projections (B, S, H, D) seen as (B, H, S, D), as Hugging Face models pass them."""
    def make(h):
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(grad)

    return make(h_q), make(h_kv), make(h_kv)


NEW_LENGTH_PARTS = (("decode", "fwd", decode_inputs, range(4000, 4032), False),
                    ("prefill", "fwd", prefill_inputs, range(700, 732), True),
                    ("prefill", "fwd_bwd", prefill_inputs, range(700, 732), True))


def _new_length_part(path: str, part: str, mode: str, make: Callable, lengths, causal: bool) -> dict:
    first, counted = [], _Counted(path)
    with _scope(path):
        for s in lengths:
            inputs = make(s, grad=mode == "fwd_bwd")
            grad = torch.randn(inputs[0].shape, device="cuda", dtype=inputs[0].dtype) if mode == "fwd_bwd" else None

            def call(inputs=inputs, grad=grad):
                out = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=True)
                if grad is not None:
                    torch.autograd.grad(out, inputs, grad)

            first.append(_wall(call))
        repeated = _event_median(call)
        repeated_wall = statistics.median(_wall(call) for _ in range(REPEATS))
    return {"case": f"new_length_{part}_{mode}", "group": "new_length", "path": path, "status": "ok",
            "first_ms_median": statistics.median(first), "first_ms_max": max(first),
            "repeated_wall_ms": repeated_wall, "repeated_ms": repeated,
            "first_vs_repeated": statistics.median(first) / repeated_wall, "lengths": len(first),
            **counted.fields()}


def new_length(path: str) -> Iterator[dict]:
    """Rows new_length_decode_fwd, new_length_prefill_fwd, new_length_prefill_fwd_bwd."""
    with _scope(path):  # load the process's libraries at a length outside the measured ones
        F.scaled_dot_product_attention(*decode_inputs(64), enable_gqa=True)
    torch.cuda.synchronize()
    for part, mode, make, lengths, causal in NEW_LENGTH_PARTS:
        yield _new_length_part(path, part, mode, make, lengths, causal)


def llama(path: str, layers: int = 16):
    """The Llama-like model on the GPU, random bf16 weights (seed 0): ``attn_implementation`` "cudnn"
    on the cudnn path (registered here), "sdpa" on the others."""
    from transformers import LlamaConfig, LlamaForCausalLM

    attn = "sdpa"
    if path == "cudnn":
        from ...integrations import transformers as csp_hf

        csp_hf.register()
        attn = csp_hf.DEFAULT_NAME
    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=5632, vocab_size=_VOCAB, max_position_embeddings=4096, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)


def hf_generate(path: str, batch: int) -> Iterator[dict]:
    """Rows hf_generate_b{batch}_cold and _warm: the median of three generations each."""
    model = llama(path).eval()

    def generate(prompt_len: int) -> tuple[float, dict]:
        ids = torch.randint(0, _VOCAB, (batch, prompt_len), device="cuda")
        counted = _Counted(path)
        with _scope(path), torch.inference_mode():
            t = _wall(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0))
        return t, counted.fields()

    generate(64)  # load the kernels and libraries (its own lengths: 64..192)
    for label, prompts in (("cold", COLD_PROMPTS), ("warm", WARM_PROMPTS)):
        times, counts = zip(*(generate(p) for p in prompts))
        ms = statistics.median(times)
        yield {"case": f"hf_generate_b{batch}_{label}", "group": "hf_generate", "path": path, "status": "ok",
               "batch": batch, "ms": ms, "tokens_per_s": batch * NEW_TOKENS / (ms / 1e3),
               "times_ms": list(times), "prompts": list(prompts), "new_tokens": NEW_TOKENS, **_per_generation(counts)}


def _per_generation(counts) -> dict:
    """builds and build_ms as one entry per generation; served and fallback_reasons summed."""
    if counts[0]["builds"] is None:
        return {"builds": None, "build_ms": None}
    fallback: dict = {}
    for c in counts:
        for reason, n in c["fallback_reasons"].items():
            fallback[reason] = fallback.get(reason, 0) + n
    return {"builds": [c["builds"] for c in counts], "build_ms": [c["build_ms"] for c in counts],
            "served": sum(c["served"] for c in counts), "fallback_reasons": fallback}


def padded_batches(steps: int = PADDING_STEPS, batch: int = PADDING_BATCH, lengths=PADDING_LENGTHS, seed: int = 1):
    """The same (ids, mask) batches on every path: random lengths, right-padded to each batch's longest."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lens = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=gen)
        s = int(lens.max())
        mask = (torch.arange(s)[None, :] < lens[:, None]).long()
        out.append((torch.randint(0, _VOCAB, (batch, s), generator=gen), mask))
    return out


def hf_dynamic_padding(path: str, steps: int = PADDING_STEPS) -> Iterator[dict]:
    """Row hf_dynamic_padding: ``steps`` training steps, the first one included."""
    model = llama(path, layers=4).train()
    batches = padded_batches(steps)
    times, counted = [], _Counted(path)
    with _scope(path):
        for ids, mask in batches:
            ids, mask = ids.cuda(), mask.cuda()

            def step(ids=ids, mask=mask):
                loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            times.append(_wall(step))
    yield {"case": "hf_dynamic_padding", "group": "hf_dynamic_padding", "path": path, "status": "ok",
           "ms": sum(times), "first_step_ms": times[0], "median_step_ms": statistics.median(times), "steps": steps,
           "batch": PADDING_BATCH, **counted.fields()}


def measure(case: str, path: str, batch: int | None = None) -> Iterator[dict]:
    """The rows of one (case, path[, batch]), as they are measured. Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"the shape case {case!r} needs a CUDA GPU (CUDA is not available)")
    known = {c.name: c for c in SHAPE_CASES}
    if case not in known:
        raise ValueError(f"unknown shape case {case!r}. Available: {list(known)}")
    if path not in known[case].paths:
        raise ValueError(f"the shape case {case!r} has no path {path!r}. Its paths: {list(known[case].paths)}")
    torch.manual_seed(0)
    if case == "new_length":
        return new_length(path)
    if case == "hf_generate":
        return hf_generate(path, 1 if batch is None else batch)
    return hf_dynamic_padding(path)


def profile_first_calls(path: str = "provider", n: int = 32, top: int = 25) -> str:
    """cProfile of ``n`` first calls at new decode lengths (the host cost of a new length), as text."""
    with _scope(path):
        F.scaled_dot_product_attention(*decode_inputs(64), enable_gqa=True)
        inputs = [decode_inputs(s) for s in range(4100, 4100 + n)]
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for x in inputs:
            F.scaled_dot_product_attention(*x, enable_gqa=True)
        torch.cuda.synchronize()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[c.name for c in SHAPE_CASES])
    parser.add_argument("path", choices=HF_SHAPE_PATHS)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--out", required=True, help="append the rows here, one JSON line each")
    args = parser.parse_args(argv)
    for row in measure(args.case, args.path, args.batch):
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
