"""Host time of the folded graphs' chunk upload (``engine.fold_values``), this checkout against a git
revision, in one process (CPU; the work is host-side Python and CPU tensors on any machine).

    python3 scripts/fold_values_host.py [--base HEAD~1] [--rounds 15]

A new self-attention length that misses its chunk computes the chunk's rows (``chunk``) and copies
them in one upload (``_upload``; on CPU ``to`` a CPU device, so the pinned copy itself is not
timed). Both run here on the bench's prefill operands (B 1, H 32/8, D 128, S 750, token-major,
as ``bench_shapes.py new_length`` passes them), interleaved with the same functions of ``--base``
(its fold_values.py loaded from git), medians of ``--rounds`` rounds of 50 calls; then checks
that both give the same keys and values.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package

import torch  # noqa: E402

from cudnn_sdpa_provider.engine import fold_values  # noqa: E402


def _base_module(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:cudnn_sdpa_provider/engine/fold_values.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    text = text.replace("from ..core import layout", "from cudnn_sdpa_provider.core import layout")
    path = pathlib.Path(tempfile.mkdtemp()) / "fold_values_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("fold_values_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _operands(s: int):
    def token_major(h, d, dtype=torch.bfloat16):
        return torch.empty(1, s, h, d, dtype=dtype).transpose(1, 2)

    return [(token_major(32, 128), 4), (token_major(8, 128), 1), (token_major(8, 128), 1), (token_major(32, 128), 4),
            (token_major(32, 1, torch.float32), 4)]  # q, k, v, O, the LSE's scratch


def _chunk_operands(module, ops):
    """``chunk``'s operands in ``module``'s form: specs (``fold_values.spec``) since they exist,
    (tensor, groups) pairs before."""
    return [module.spec(t, g) for t, g in ops] if hasattr(module, "spec") else ops


def _per_call(fn, n=50):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    base = _base_module(args.base)
    ops, cpu, s = _operands(750), torch.device("cpu"), 750
    given = {name: _chunk_operands(m, ops) for name, m in (("base", base), ("checkout", fold_values))}
    times: dict = {}
    for _ in range(args.rounds):
        for name, m, o in ((args.base, base, given["base"]), ("checkout", fold_values, given["checkout"])):
            blocks = m.chunk(o, 8, 8, s, 1024, cpu, 0)
            times.setdefault((name, "chunk"), []).append(_per_call(lambda: m.chunk(o, 8, 8, s, 1024, cpu, 0)))
            times.setdefault((name, "_upload"), []).append(_per_call(lambda: m._upload({}, blocks, cpu)))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; us per call, median of {args.rounds} rounds of 50")
    for (name, what), values in sorted(times.items()):
        print(f"  {what:8s} {name:10s} {statistics.median(values):8.1f}")
    was = base.chunk(given["base"], 8, 8, s, 1024, cpu, 0)
    now = fold_values.chunk(given["checkout"], 8, 8, s, 1024, cpu, 0)
    same = [k for k, _ in was] == [k for k, _ in now] and all(torch.equal(a, b) for (_, a), (_, b) in zip(was, now))
    up_was, up_now = base._upload({}, was, cpu), fold_values._upload({}, now, cpu)
    same = same and up_was.keys() == up_now.keys() and all(
        torch.equal(up_was[k], up_now[k]) and up_was[k].shape == up_now[k].shape for k in up_was)
    print(f"same keys and values: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
