"""The changing-shape rows as text and as a figure. Rows are plain dicts (the JSON file holds them
under ``"shape_rows"``, beside the matrix's ``"rows"``), one per (case, path):

  every row    case, group (the shape case: new_length, hf_generate, hf_dynamic_padding), path,
               status (ok | error), reason (error rows: the failed process's last stderr line)
  new_length   (case new_length_{decode_fwd,prefill_fwd,prefill_fwd_bwd})
               first_ms_median, first_ms_max  synchronised wall time of the first call at each of
                                              the 32 new lengths (the max is the build, if any)
               repeated_ms       CUDA-event median of the last length's call repeated (after warm-up)
               repeated_wall_ms  the same call's synchronised wall time, median
               first_vs_repeated first_ms_median / repeated_wall_ms (1.0: a new length costs nothing)
               lengths           new lengths timed
  hf_generate  (case hf_generate_b{1,8}_{cold,warm}; batch)
               ms                median of the three generations' wall time (prompt + 128 new tokens)
               tokens_per_s      batch x 128 / ms
               times_ms, prompts, new_tokens   each generation's time and prompt length
               builds, build_ms  per generation (lists)
  hf_dynamic_padding
               ms                the 50 steps' total wall time, the first step included
               first_step_ms, median_step_ms, steps, batch
  provider and cudnn rows: builds (cuDNN graphs the package built in the timed region), build_ms
               (the host time of its builds, those cuDNN rejected included), served (calls served),
               fallback_reasons; builds and build_ms are None on native and flash
               (PyTorch's own builds are not visible)
  ratios       vs_native, vs_flash (``ms``), first_vs_native, first_vs_flash (``first_ms_median``),
               repeated_vs_native, repeated_vs_flash (``repeated_ms``): the baseline's figure / the
               row's, > 1 = faster than the baseline; on ok rows whose baseline row is ok
"""

from __future__ import annotations

import pathlib

from .report import require_matplotlib
from .shapes import SHAPE_CASES

__all__ = ["format_shape_table", "plot_shapes", "shape_plot_path", "shape_meta"]

# (header, row field, format); "x" is a ratio, "n" a count or a list of counts
_COLUMNS = {
    "new_length": (("first ms", "first_ms_median", ".3f"), ("first max ms", "first_ms_max", ".1f"),
                   ("repeated ms", "repeated_ms", ".3f"), ("first/repeated", "first_vs_repeated", ".1f"),
                   ("builds", "builds", "n"), ("first vs native", "first_vs_native", "x"),
                   ("repeated vs native", "repeated_vs_native", "x"), ("first vs flash", "first_vs_flash", "x")),
    "hf_generate": (("ms", "ms", ".1f"), ("tokens/s", "tokens_per_s", ".1f"), ("builds", "builds", "n"),
                    ("vs native", "vs_native", "x"), ("vs flash", "vs_flash", "x")),
    "hf_dynamic_padding": (("total ms", "ms", ".1f"), ("first step ms", "first_step_ms", ".1f"),
                           ("median step ms", "median_step_ms", ".1f"), ("builds", "builds", "n"),
                           ("vs native", "vs_native", "x"), ("vs flash", "vs_flash", "x")),
}


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "x":  # two decimals, or two significant digits below 0.1 (0.0025x, not 0.00x)
        return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"
    if fmt == "n":
        return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    return format(value, fmt)


def _table(group: str, rows: list[dict]) -> list[str]:
    cols = _COLUMNS[group]
    head = ("case", "path", *(c[0] for c in cols), "note")
    cells = [head]
    for r in rows:
        note = "" if r.get("status", "ok") == "ok" else f"ERROR: {r.get('reason', '')}"
        cells.append((r["case"], r["path"], *(_cell(r.get(f), fmt) for _, f, fmt in cols),
                      note if len(note) <= 120 else note[:117] + "..."))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    return ["  ".join([c[j].ljust(widths[j]) if j < 2 else c[j].rjust(widths[j]) for j in range(len(widths))]
                      + [c[-1]]).rstrip() for c in cells]


def format_shape_table(rows: list[dict]) -> str:
    """A table per shape case (its own columns), a blank line between them; error rows say why."""
    blocks = []
    for case in SHAPE_CASES:
        mine = [r for r in rows if r.get("group") == case.name]
        if mine:
            blocks.append("\n".join(_table(case.name, mine)))
    return "\n\n".join(blocks)


def shape_meta(cases) -> dict:
    """The shape cases' descriptions, for the JSON file's meta."""
    return {c.name: {"paths": list(c.paths), "batches": [b for b in c.batches if b is not None],
                     "description": c.summary} for c in cases}


def shape_plot_path(path: str, with_matrix: bool) -> str:
    """Where the shape figure goes: ``path`` itself when no matrix case ran, else beside it
    (``bench.png`` -> ``bench.shapes.png``; the matrix's figure keeps ``path``)."""
    if not with_matrix:
        return path
    p = pathlib.Path(path)
    return str(p.with_name(p.stem + ".shapes" + (p.suffix or ".png")))


# (group, figure, y label, log scale)
_PANELS = (("new_length", "first_ms_median", "first call at a new length, ms\n(median; dot: the repeated call)", True),
           ("hf_generate", "tokens_per_s", "tokens/s", False),
           ("hf_dynamic_padding", "ms", "50 training steps, ms", False))


_COLORS = {"native": "C1", "flash": "C2", "provider": "C0", "cudnn": "C3"}  # one colour per path in every panel


def _bars(ax, rows: list[dict], figure: str, log: bool) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = [p for p in _COLORS if any(r["path"] == p for r in rows)]
    width = 0.8 / max(1, len(paths))
    for i, p in enumerate(paths):
        labelled = False
        for j, case in enumerate(cases):
            r = next((r for r in rows if r["case"] == case and r["path"] == p and r.get(figure)), None)
            if r is None:  # an error row, or a path the case does not run
                continue
            x = j - 0.4 + width * (i + 0.5)
            ax.bar(x, r[figure], width, color=_COLORS[p], label=None if labelled else p)
            labelled = True
            if r.get("repeated_ms"):
                ax.plot(x, r["repeated_ms"], "o", color="black", markersize=3)
    ax.set_xticks(range(len(cases)), [c.replace("new_length_", "").replace("hf_generate_", "") for c in cases],
                  fontsize="small", rotation=20)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)


def plot_shapes(rows: list[dict], path: str) -> None:
    """One bar panel per shape case that has ok rows (paths side by side); written to ``path``."""
    figure_cls = require_matplotlib()
    panels = [(g, f, label, log) for g, f, label, log in _PANELS
              if any(r.get("group") == g and r.get("status", "ok") == "ok" and r.get(f) for r in rows)]
    if not panels:
        raise ValueError("no measured shape rows to plot")
    fig = figure_cls(figsize=(6 * len(panels), 4.5), layout="constrained")
    for ax, (group, figure, label, log) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        mine = [r for r in rows if r.get("group") == group and r.get("status", "ok") == "ok"]
        _bars(ax, mine, figure, log)
        ax.set(title=group, ylabel=label)
    fig.savefig(path)
