"""Runs the changing-shape cases: each (case, path[, batch]) in a fresh Python process
(``shape_child``), so nothing is built before its timed region, and collects their rows.

A process that fails (an exception: an HF case without transformers, flash declining HF's padding
mask; a crash; a timeout) gives an error row with the last line it wrote on stderr, beside the rows
it measured before failing; the bench goes on. The child's whole stderr goes to the
``cudnn_sdpa_provider.bench`` logger (ERROR); nothing is printed here.
"""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
import tempfile
from typing import Callable, Iterable

from .measure import _require_gpu
from .shapes import Run, ShapeCase, add_shape_ratios, error_row, runs

__all__ = ["run_shapes", "run_one", "child_command", "CHILD_TIMEOUT_S"]

log = logging.getLogger("cudnn_sdpa_provider.bench")
#: One process's limit: the slowest measured (native hf_generate, batch 1, cold) took about 1 minute.
CHILD_TIMEOUT_S = 1800
_ROOT = pathlib.Path(__file__).resolve().parents[3]  # the folder holding cudnn_sdpa_provider/


def child_command(run: Run, out: str) -> list[str]:
    """The command line of one run's process (this interpreter, this copy of the package)."""
    cmd = [sys.executable, "-m", "cudnn_sdpa_provider.tools.bench.shape_child", run.case, run.path, "--out", out]
    return cmd + ([] if run.batch is None else ["--batch", str(run.batch)])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 400 else line[:397] + "..."


def _read_rows(path: pathlib.Path) -> tuple[list[dict], str | None]:
    """The rows the process wrote, and what was wrong with the file (a line cut short by a crash)."""
    rows, problem = [], None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                problem = f"unreadable row {line[:80]!r}"
    return rows, problem


def run_one(run: Run, timeout: float = CHILD_TIMEOUT_S, command: list[str] | None = None) -> list[dict]:
    """The rows of one process; its error row (after any rows it wrote) where it did not finish.
    ``command`` replaces ``child_command`` (tests); its ``{out}`` arguments become the rows file."""
    with tempfile.TemporaryDirectory(prefix="cudnn-sdpa-shapes-") as tmp:
        out = pathlib.Path(tmp) / "rows.jsonl"
        cmd = child_command(run, str(out)) if command is None else [a.replace("{out}", str(out)) for a in command]
        why = None
        try:
            proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:g} s"
        else:
            if proc.returncode:
                log.error("bench: %s exited with status %d:\n%s", run.label, proc.returncode, proc.stderr)
                why = _last_line(proc.stderr) or f"exited with status {proc.returncode}"
        rows, problem = _read_rows(out)
    for row in rows:
        row.setdefault("group", run.case)
        row.setdefault("status", "ok")
    if why is None and problem is not None:
        why = problem
    if why is None and not rows:
        why = "the process wrote no rows"
    return rows + ([error_row(run, why)] if why is not None else [])


def run_shapes(cases: Iterable[ShapeCase], progress: Callable[[int, int, str], None] | None = None,
               timeout: float = CHILD_TIMEOUT_S) -> list[dict]:
    """Every run of the cases, one process each, with the ratios against native and flash.
    ``progress(done, total, label)`` is called after each process. BenchError without CUDA or with
    the provider enabled in this process (the children would inherit it: the native paths would not
    be native)."""
    todo = runs(cases)
    _require_gpu()
    rows: list[dict] = []
    for i, run in enumerate(todo, 1):
        rows += run_one(run, timeout)
        if progress is not None:
            progress(i, len(todo), run.label)
    return add_shape_ratios(rows)
