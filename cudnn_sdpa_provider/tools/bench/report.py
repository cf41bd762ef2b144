"""The bench's results as data and as text: one ``Row`` per (case, mode, path) from what was
measured, ratios against each case's baseline, the plain-text table, the JSON file, the plot.

Row metrics:
  median_ms, p20_ms, p80_ms  CUDA-event time of one call, over ``repeats`` timed calls after warm-up;
                             input sets rotate so a call never reads inputs the previous one left in L2
  tflops          flops(case, mode) / median: forward 4*B*H_q*S_q*S_kv*D, halved when causal (varlen and
                  padded: summed over the real lengths); fwd_bwd counts ``cases.BWD_FACTOR`` (3.5) x
                  forward; none for training steps (a step is more than attention)
  vs_native       baseline median / this median, >1 = faster; baseline native_cudnn (varlen:
                  native_varlen; padded: native_cudnn, else native if cuDNN declined; steps and fp8
                  cases: native, PyTorch's own choice of backend)
  peak_mib        peak memory allocated during one call above what was allocated before it (inputs,
                  and for steps the model, its gradients and activations kept between steps)
  inputs_mib      one input set: q, k, v (and grad_out for fwd_bwd); hf_llama: the token batch
  host_us         host-cost cases: wall time per call of ``host_calls`` back-to-back calls, no sync
                  inside the loop, one at the end
  host_vs_native  baseline host_us / this host_us, >1 = cheaper on the host
  calls, served, fallbacks, fallback_reasons
                  provider and fp8_* rows (``cases.audited``): calls made and the counters' diff over
                  them (an FP8 path's are ``fp8_fwd`` / ``fp8_bwd``). Such a row is "ok"
                  only if every attention call (forward and backward) made through Python was served
                  (``expected``: graph replays run no Python, so only the warm-up and capture steps
                  count); otherwise its status is "fallback" or "unserved" and its numbers are not
                  the provider's.
Status: ok | skipped (PyTorch or the environment cannot run the path) | fallback | unserved | error
(exception; reason).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone

from . import fp8_case
from .cases import BASELINE, KNOWN, MODES, Case, audited, expected_calls, flops

__all__ = ["Measurement", "Row", "summarize", "add_ratios", "collect_meta", "to_json", "format_table", "plot",
           "require_matplotlib"]


@dataclass
class Measurement:
    """What was measured for one path (filled by ``measure``; ``summarize`` turns it into a Row)."""

    path: str
    times_ms: list = field(default_factory=list)
    skip: str | None = None  # why the path did not run
    error: bool = False  # the skip is an unexpected exception, not PyTorch declining the path
    calls: int = 0
    replays: int = 0  # calls that replayed a CUDA graph (no Python, so no provider call)
    served: int = 0
    fallback: dict = field(default_factory=dict)
    peak_mib: float | None = None
    host_us: float | None = None


@dataclass
class Row:
    """One (case, mode, path) result; see the module docstring for each metric."""

    case: str
    kind: str
    mode: str
    path: str
    seq: int
    causal: bool
    status: str = "ok"
    reason: str = ""
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    vs_native: float | None = None
    peak_mib: float | None = None
    inputs_mib: float | None = None
    host_us: float | None = None
    host_vs_native: float | None = None
    repeats: int = 0
    input_sets: int = 0
    calls: int = 0
    replays: int = 0
    expected: int | None = None
    served: int | None = None
    fallbacks: int | None = None
    fallback_reasons: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _quantile(ordered: list, q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _provider_status(row: Row) -> tuple[str, str]:
    if row.fallbacks:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(row.fallback_reasons.items()))
        return "fallback", f"{row.fallbacks} of {row.expected} provider calls fell back ({reasons})"
    if row.served != row.expected:
        return "unserved", f"{row.served} of {row.expected} calls reached the provider"
    return "ok", ""


def summarize(case: Case, mode: str, m: Measurement, inputs_mib: float, input_sets: int) -> Row:
    """A Row from one path's measurement (pure)."""
    row = Row(case.name, case.kind, mode, m.path, case.seq, case.causal, inputs_mib=inputs_mib,
              input_sets=input_sets, calls=m.calls, replays=m.replays)
    if m.skip is not None:
        row.status, row.reason = ("error" if m.error else "skipped"), m.skip
        return row
    ordered = sorted(m.times_ms)
    row.median_ms, row.p20_ms, row.p80_ms = statistics.median(ordered), _quantile(ordered, 0.2), _quantile(ordered, 0.8)
    work = flops(case, mode)
    row.tflops = None if work is None else work / (row.median_ms * 1e-3) / 1e12
    row.repeats, row.peak_mib, row.host_us = len(ordered), m.peak_mib, m.host_us
    if audited(m.path):
        row.expected = expected_calls(case, mode, m.calls - m.replays)
        row.served, row.fallbacks, row.fallback_reasons = m.served, sum(m.fallback.values()), dict(m.fallback)
        row.status, row.reason = _provider_status(row)
    return row


def add_ratios(rows: list[Row]) -> list[Row]:
    """Fill ``vs_native`` / ``host_vs_native`` against each (case, mode)'s baseline row."""
    base = {}
    for r in rows:
        if r.path in BASELINE[r.kind] and r.median_ms:
            key, prev = (r.case, r.mode), base.get((r.case, r.mode))
            if prev is None or BASELINE[r.kind].index(r.path) < BASELINE[r.kind].index(prev.path):
                base[key] = r
    for r in rows:
        b = base.get((r.case, r.mode))
        if b is not None and r.median_ms:
            r.vs_native = b.median_ms / r.median_ms
        if b is not None and b.host_us and r.host_us:
            r.host_vs_native = b.host_us / r.host_us
    return rows


# ----------------------------------------------------------------------------------- JSON


def collect_meta(argv: list[str] | None = None, **settings) -> dict:
    """Versions, GPU, date and command line for the JSON file."""
    import torch

    from ... import __version__
    from ...engine import machine
    from ...core import support
    from ..doctor import fp8_quantisation

    caps = machine.capabilities()
    return {
        "package": __version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv if argv is None else argv),
        "gpu": caps.device_name,
        "compute_capability": list(caps.compute_capability or ()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_torch": torch.backends.cudnn.version() if caps.cuda else None,
        "cudnn_backend": support.version_str(caps.cudnn_version),
        "cudnn_frontend": caps.frontend_version,
        "cudnn_unavailable": caps.unavailable,
        "fp8_quantisation": fp8_quantisation(caps),  # which code quantises the fp8 cases' inputs (as doctor says)
        "settings": settings,
        "cases": {c.name: {**dataclasses.asdict(c), "description": c.describe()} for c in KNOWN},
    }


def to_json(rows: list[Row], meta: dict, **more_rows: list[dict]) -> str:
    """``{"meta": ..., "rows": [...]}``, and any further lists of row dicts under their own keys
    (``shape_rows``: the changing-shape cases, ``shape_report``)."""
    return json.dumps({"meta": meta, "rows": [r.as_dict() for r in rows], **more_rows}, indent=2) + "\n"


# ---------------------------------------------------------------------------------- table

_HEAD = ("case", "mode", "path", "median ms", "p20-p80 ms", "TFLOP/s", "vs native", "peak MiB", "host us",
         "host vs native", "served", "note")


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _cells(r: Row) -> tuple:
    spread = "-" if r.p20_ms is None else f"{r.p20_ms:.3f}-{r.p80_ms:.3f}"
    served = "-" if r.served is None else f"{r.served}/{r.expected}"
    note = "" if r.status == "ok" else f"{r.status.upper()}: {r.reason}"
    note = note if len(note) <= 120 else note[:117] + "..."  # the JSON has the full reason
    return (r.case, r.mode, r.path, _num(r.median_ms, ".3f"), spread, _num(r.tflops, ".1f"),
            _num(r.vs_native, ".2f") + ("x" if r.vs_native is not None else ""), _num(r.peak_mib, ".0f"),
            _num(r.host_us, ".1f"), _num(r.host_vs_native, ".2f") + ("x" if r.host_vs_native is not None else ""),
            served, note)


def format_table(rows: list[Row]) -> str:
    """Plain-text table, a blank line between cases; non-ok rows say why in the note column. With
    fp8 rows, their side-by-side ratios follow (``fp8_case.ratio_table``)."""
    cells = [_HEAD] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_HEAD) - 1)]

    def line(c: tuple) -> str:
        text = [c[j].ljust(widths[j]) if j < 3 else c[j].rjust(widths[j]) for j in range(len(widths))]
        return "  ".join(text + [c[-1]]).rstrip()

    lines = [line(_HEAD)]
    for prev, r, c in zip([None] + rows[:-1], rows, cells[1:]):
        if prev is not None and prev.case != r.case:
            lines.append("")
        lines.append(line(c))
    fp8 = fp8_case.ratio_table(rows)
    return "\n".join(lines + (["", fp8] if fp8 else []))


# ----------------------------------------------------------------------------------- plot


def require_matplotlib():
    """matplotlib's Figure class, or an ImportError naming the extra to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install cudnn-sdpa-provider[plot]") from exc
    return Figure


_SERIES = (("dense", False, "o", ""), ("dense", True, "^", " causal"), ("varlen", False, "D", " varlen"),
           ("varlen", True, "s", " varlen causal"), ("padded", True, "v", " padded causal"),
           ("fp8", False, "P", " fp8 case"), ("fp8", True, "X", " fp8 case causal"))
# (kind, causal, marker, label suffix); training steps have no TFLOP/s


def plot(rows: list[Row], path: str) -> None:
    """TFLOP/s against sequence length per path, one panel per mode; with fp8 rows, a second row of
    panels: bf16 native time / path time against S (``fp8_case.ratio_points``); written to ``path``."""
    figure = require_matplotlib()
    good = [r for r in rows if r.status == "ok" and r.tflops]
    modes = [m for m in MODES if any(r.mode == m for r in good)]
    if not modes:
        raise ValueError("no timed rows to plot")
    gqa = frozenset(c.name for c in KNOWN if c.gqa)
    ratios = {m: fp8_case.ratio_points(rows, m, gqa) for m in modes}
    panels = 2 if any(ratios.values()) else 1
    fig = figure(figsize=(6.5 * len(modes), 4.5 * panels), layout="constrained")
    grid = fig.subplots(panels, len(modes), squeeze=False)
    axes = grid[0]
    paths = list(dict.fromkeys(r.path for r in good))
    for ax, mode in zip(grid[1] if panels == 2 else (), modes):
        _plot_ratios(ax, mode, ratios[mode], paths)
    for ax, mode in zip(axes, modes):
        for i, p in enumerate(paths):
            for kind, causal, marker, tag in _SERIES:
                pts = sorted((r.seq, r.tflops) for r in good
                             if r.mode == mode and r.path == p and r.kind == kind and r.causal == causal)
                if pts:
                    ax.plot(*zip(*pts), marker=marker, linestyle="none", color=f"C{i}", label=p + tag)
        ax.set_xscale("log", base=2)
        ax.set(title=mode, xlabel="sequence length (varlen: longest)", ylabel="TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_ratios(ax, mode: str, points: dict, paths: list) -> None:
    """One panel of the fp8 rows' ratios: a series per (path, causal, GQA), a line at 1."""
    for (p, causal, is_gqa), pts in sorted(points.items()):
        color = f"C{paths.index(p)}" if p in paths else None
        marker = ("X" if causal else "P") if not is_gqa else ("v" if causal else "^")
        label = p + (" causal" if causal else "") + (" GQA" if is_gqa else "")
        ax.plot(*zip(*pts), marker=marker, linestyle="none", color=color, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set(title=f"{mode}: fp8 cases", xlabel="sequence length", ylabel="bf16 native time / path time")
    ax.grid(True, alpha=0.3)
    if points:
        ax.legend(fontsize="small")
