"""``cudnn-sdpa bench``: the provider timed side by side with PyTorch's native attention paths.

Data only; ``cli`` prints. ``run()`` returns one ``Row`` per (case, mode, path). Every path of a
case is measured in ONE process on the SAME random bf16 inputs (fresh per case, never zeros), in
ABBA order so clock drift does not favour a path (the fp8 group's inputs also get new values after
every call: ``fp8_case``). One module per job:

  cases    the matrix, each kind's paths and baseline, presets, flop counts, option checks (no torch)
  inputs   the input sets (tensors, or a model and a batch for the training steps)
  paths    what each path runs and in which scope (provider enabled, a backend forced, ...)
  measure  timing (CUDA events, peak memory, host cost), the ABBA order, ``run``
  report   ``Row``, ratios against the baseline, the table, the JSON file, the plot
  fp8_case the fp8 group (FP8 end to end from bf16, issue #30): its paths' calls, the refill of its
           inputs after every call, its side-by-side ratio table

The changing-shape cases (new_length, hf_generate, hf_dynamic_padding) run each (case, path) in a
fresh process instead, so that graph builds count: ``shapes`` (the cases, selection, ratios),
``shape_runner`` (the processes), ``shape_child`` (what one process measures), ``shape_report``
(their table and figure). Their rows are plain dicts; ``run_shapes`` returns them.

A path PyTorch cannot run at a case (efficient with GQA, ...) is ``skipped`` with PyTorch's
reason; a case the environment cannot run (the Hugging Face Llama step without transformers) has
every path ``skipped`` with what to install. ``cases`` lists the paths of each kind, ``report``
each row metric.
"""

from __future__ import annotations

from .cases import BASELINE, BWD_FACTOR, DEFAULT, DENSE_PATHS, FP8_MATRIX, FP8_PATHS, GROUPS, HF_PATHS, KNOWN, MATRIX, MODES, PADDED_PATHS, QUICK, QUICK_CASES, STEP_PATHS, VARLEN_PATHS, Case, Preset, check_modes, check_settings, expected_calls, flops, fwd_flops, listing, quick_matrix, select
from .inputs import padding_mask as _padding_mask  # noqa: F401 - tests/gpu/test_features.py uses this name
from .measure import BenchError, run
from .paths import GRAPH_WARMUP_STEPS
from . import shapes
from .report import Measurement, Row, add_ratios, collect_meta, format_table, plot, require_matplotlib, summarize, to_json
from .shape_report import format_shape_table, plot_shapes, shape_meta, shape_plot_path
from .shape_runner import run_shapes
from .shapes import SHAPE_CASES

__all__ = ["Case", "Row", "Measurement", "Preset", "BenchError", "MATRIX", "MODES", "DEFAULT", "QUICK", "select",
           "quick_matrix", "check_modes", "check_settings", "fwd_flops", "flops", "summarize", "add_ratios", "run",
           "collect_meta", "to_json", "format_table", "plot", "require_matplotlib", "SHAPE_CASES", "run_shapes",
           "format_shape_table", "plot_shapes", "GROUPS", "KNOWN", "FP8_MATRIX", "listing"]
# Also importable here as before: DENSE_PATHS, VARLEN_PATHS, PADDED_PATHS, STEP_PATHS, HF_PATHS, BASELINE,
# QUICK_CASES, BWD_FACTOR, GRAPH_WARMUP_STEPS, expected_calls, FP8_PATHS; shapes, shape_meta, shape_plot_path.
