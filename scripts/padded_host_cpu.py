"""What a padded dense call launches besides cuDNN's kernel, on CPU, with the CPU tier's stand-in cuDNN.

A padded call (per-sequence lengths) derives row terms from its lengths on the device
(``core/rows.py``); lengths the package made itself keep them across the calls of one forward
(``core/length_terms.py``). This counts the top-level aten ops (each a kernel launch on a GPU)
and times the Python of one forward+backward through ``csp.attention`` at the bench's
``hf_llama_l2_d256_b2_s256_padded`` attention shape ((2, 4/1, 256, 64), token-major, causal,
lengths 256 and 128), for four kinds of call:

* ``plain``: no lengths;
* ``padded``: the caller's own lengths (every call derives its terms);
* ``owned``: lengths marked as the package's own (``length_terms.own``), as the transformers
  integration's and ``ops/bias_lengths.py``'s are: every call after the first reuses the terms, so
  this is what a model's layers after the first issue (its first layer issues about ``padded``'s);
* ``full``: owned lengths whose maker also read on the host that every query length is S and every
  key length in [1, S] (``length_terms.own(..., full=)``, as the integration's ``padding="auto"`` and
  ``ops/bias_lengths.py`` state): no row is 0 by definition, so no row fix or dQ fill is issued.

With ``--hf`` (needs transformers), also the aten ops of one training step of that bench case's
model (2 layers) with ``attn_implementation="sdpa"`` and with the integration's ``"cudnn"``.

The stand-in's execute is a no-op and the CPU computes what a GPU would launch, so the times are
CPU compute and Python, not a GPU's host time; the op counts are what carries over.

    python3 scripts/padded_host_cpu.py [--calls 200] [--hf]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from cudnn_sdpa_provider import functional  # noqa: E402
from cudnn_sdpa_provider.core import counters, length_terms, support  # noqa: E402
from cudnn_sdpa_provider.ops import dense_varlen, route  # noqa: E402
from tests import fake_cudnn  # noqa: E402

B, H, H_KV, S, D = 2, 4, 1, 256, 64
LENGTHS = (256, 128)


class _Patch:
    """The part of pytest's monkeypatch that ``fake_cudnn.install`` uses."""

    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


def _serve_on_cpu() -> None:
    """The stand-in cuDNN with a no-op execute, the ``no_cuda`` and ``dtype`` rules left out, and the
    eager Function's CUDA kernels (forward and backward) taken for CPU tensors."""
    fake_cudnn.install(_Patch())
    fake_cudnn.FakeGraph.execute = lambda self, *args, **kw: None
    support.RULES = tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype"))
    route.clear()
    fn = dense_varlen.DenseFunction
    for f in (fn.forward, fn.no_grad, fn.backward, getattr(fn.backward, "__wrapped__", None)):
        for cell in getattr(f, "__closure__", None) or ():
            if isinstance(cell.cell_contents, dict) and "cuda" in cell.cell_contents:
                cell.cell_contents["cpu"] = cell.cell_contents["cuda"]


def _aten_ops(fn, n: int = 5) -> float:
    """Top-level aten ops per call of ``fn`` (ops not called by another aten op)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in ops if not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))) / n


def _attention_call(kind: str):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=gen).transpose(1, 2).requires_grad_() for h in (H, H_KV, H_KV))
    go = torch.randn(B, H, S, D, generator=gen)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    full = torch.full_like(lengths, S)
    if kind in ("owned", "full"):
        length_terms.own(full, lengths, full=(S, S) if kind == "full" else None)
    padding = {} if kind == "plain" else dict(seq_lens_q=full, seq_lens_kv=lengths)

    def call():
        out = functional.attention(q, k, v, is_causal=True, validate=False, **padding)
        torch.autograd.grad(out, (q, k, v), go)
    return call


def _hf_steps() -> dict:
    import transformers

    from cudnn_sdpa_provider.integrations import transformers as csp_hf
    from cudnn_sdpa_provider.tools.bench import cases

    registration = csp_hf.register()
    case = next(c for c in cases.MATRIX if c.name == "hf_llama_l2_d256_b2_s256_padded")
    ids = torch.randint(0, 1000, (case.batch, case.seq))
    mask = (torch.arange(case.seq)[None, :] < torch.tensor(case.seq_lens)[:, None]).long()
    found = {}
    try:
        for impl in ("sdpa", csp_hf.DEFAULT_NAME):
            torch.manual_seed(0)
            config = transformers.LlamaConfig(**cases.llama_config(case))
            model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl)
            step = lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()  # noqa: E731
            step()
            found[impl] = _aten_ops(step, 3)
    finally:
        registration.remove()
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf", action="store_true")
    a = parser.parse_args(argv)
    _serve_on_cpu()
    print(f"torch {torch.__version__}; csp.attention forward+backward, ({B}, {H}/{H_KV}, {S}, {D}) causal, "
          f"lengths {LENGTHS}; median of {a.rounds} rounds of {a.calls}")
    for kind in ("plain", "padded", "owned", "full"):
        call = _attention_call(kind)
        for _ in range(20):
            call()
        times = []
        for _ in range(a.rounds):
            start = time.perf_counter()
            for _ in range(a.calls):
                call()
            times.append((time.perf_counter() - start) / a.calls * 1e6)
        print(f"  {kind:7s} {_aten_ops(call):5.0f} aten ops, {statistics.median(times):7.1f} us per call")
    if a.hf:
        for impl, ops in _hf_steps().items():
            print(f"  training step, attn_implementation={impl!r}: {ops:.0f} aten ops")
    fell_back = {p: e["fallback"] for p, e in counters.stats().to_dict().items() if e["fallback"]}
    if fell_back:
        print(f"not served (the counts above are not the served paths'): {fell_back}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
