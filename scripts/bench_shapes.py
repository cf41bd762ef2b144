"""Changing shapes on the GPU: what a new sequence length costs, and generation end to end.

A thin wrapper over the package's bench (``cudnn_sdpa_provider/tools/bench/shapes.py`` describes the
cases, ``shape_child.py`` measures them); the same cases run under
``cudnn-sdpa bench --cases new_length,hf_generate,hf_dynamic_padding --json FILE --plot FILE``.

    python3 scripts/bench_shapes.py new_length  PATH     # one path, in this process: build cost counts
    python3 scripts/bench_shapes.py hf_generate PATH BATCH
    python3 scripts/bench_shapes.py hf_dynamic_padding PATH
    python3 scripts/bench_shapes.py all --json FILE      # every case and path, each in a fresh process
    python3 scripts/bench_shapes.py profile              # cProfile of 32 first calls at new decode lengths

PATH: ``native`` (PyTorch's default SDPA choice), ``flash`` (``sdpa_kernel(FLASH_ATTENTION)``),
``provider`` (F.sdpa inside ``csp.enable()``), ``cudnn`` (the Hugging Face integration,
``attn_implementation="cudnn"``; HF cases only). Each row is printed as one JSON line; ``all`` adds
the ratios against native and flash (and writes the rows as a JSON list to ``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package

import torch  # noqa: E402

from cudnn_sdpa_provider.tools.bench import run_shapes, shape_child, shapes  # noqa: E402


def run_all(batches) -> list[dict]:
    cases = [dataclasses.replace(c, batches=tuple(batches)) if c.name == "hf_generate" else c
             for c in shapes.SHAPE_CASES]
    return run_shapes(cases, progress=lambda done, total, label: print(f"[{done}/{total}] {label}", file=sys.stderr))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=(*shapes.names(), "profile", "all"))
    parser.add_argument("path", nargs="?", choices=shapes.HF_SHAPE_PATHS)
    parser.add_argument("batch", nargs="?", type=int, default=1)
    parser.add_argument("--json", help="all: write the rows here")
    parser.add_argument("--batches", default="1,8", help="all: hf_generate's batches")
    a = parser.parse_args(argv)
    if a.what in shapes.names() and a.path is None:
        parser.error(f"{a.what} needs a PATH, one of {list(shapes.HF_SHAPE_PATHS)}")
    if not torch.cuda.is_available():
        print("bench_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.what == "profile":
        print(shape_child.profile_first_calls(), file=sys.stderr)
        return 0
    if a.what == "all":
        rows = run_all([int(x) for x in a.batches.split(",")])
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    else:
        rows = shape_child.measure(a.what, a.path, a.batch)
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
