"""The changing-shape cases of ``cudnn-sdpa bench``: what each measures, the paths it runs, how its
runs are split into fresh processes, and the ratios of its rows. Pure data; nothing here imports
torch.

Real work changes shapes every call (generation: a new S_kv each token; serving: each prompt;
dynamic-padding training: each batch), and a new length may cost a cuDNN graph build. So each
(case, path[, batch]) runs in a FRESH process (``shape_runner``) with nothing built before its timed
region: the build cost counts. Paths:

  native    provider off, PyTorch's default SDPA choice (cuDNN on an H100/H200 with torch 2.11+)
  flash     provider off, ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
  provider  F.sdpa inside ``cudnn_sdpa_provider.enable()`` (Hugging Face cases: ``attn_implementation="sdpa"``)
  cudnn     the Hugging Face integration: ``integrations.transformers.register()``, then
            ``attn_implementation="cudnn"`` (provider not enabled; Hugging Face cases only)

Cases (what ``shape_child`` measures; the row fields are listed in ``shape_report``):

  new_length          F.sdpa, bf16, random inputs: decode (B 8, H 32/8, D 128, one query against a
                      cache of S_kv 4000..4031, every length new) forward, and causal prefill (B 1,
                      H 32/8, D 128, S 700..731) forward and forward+backward: the first call at each
                      new length (synchronised wall time) against the repeated call (CUDA events and
                      wall time), after one warm-up call at S 64 that loads the libraries
  hf_generate         a 16-layer Llama-like ``LlamaForCausalLM`` (hidden 2048, 32/8 heads, MLP 5632,
                      random bf16 weights), greedy, 128 new tokens, batch 1 and batch 8 (a process
                      each); cold: three generations whose prompts (512, 660, 808) and every length
                      after them were never seen, warm: the last one three times more; tokens/s
  hf_dynamic_padding  50 training steps (forward + backward) of the same model with 4 layers, batch 8,
                      lengths drawn from 128..2048 (seeded) and right-padded to each batch's longest
                      (what Hugging Face's data collators do); total time counting the first step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["ShapeCase", "Run", "SHAPE_CASES", "SHAPE_PATHS", "HF_SHAPE_PATHS", "BASELINES", "names", "split_names",
           "runs", "add_shape_ratios", "error_row"]

SHAPE_PATHS = ("native", "flash", "provider")
HF_SHAPE_PATHS = ("native", "flash", "provider", "cudnn")
#: The paths each row is compared against: ``<figure>_vs_<baseline>`` = baseline's figure / the row's
#: (> 1 = this path is faster).
BASELINES = ("native", "flash")
#: Row figures compared across paths: figure -> the ratio's prefix (``vs_native``, ``first_vs_flash``...).
RATIO_FIGURES = {"ms": "vs", "first_ms_median": "first_vs", "repeated_ms": "repeated_vs"}


@dataclass(frozen=True)
class ShapeCase:
    """One changing-shape case: its paths and the batches that each get a process of their own
    (``(None,)``: one process per path)."""

    name: str
    paths: tuple[str, ...]
    summary: str
    batches: tuple = (None,)
    needs_transformers: bool = False

    def describe(self) -> str:
        return self.summary + f" (paths: {', '.join(self.paths)}; each in a fresh process)"


@dataclass(frozen=True)
class Run:
    """One fresh process: a case, a path, a batch (None where the case has no batch choice)."""

    case: str
    path: str
    batch: int | None = None

    @property
    def label(self) -> str:
        return f"{self.case} {self.path}" + ("" if self.batch is None else f" batch {self.batch}")


SHAPE_CASES: tuple[ShapeCase, ...] = (
    ShapeCase("new_length", SHAPE_PATHS,
              "first F.sdpa call at a new length against the repeated call: decode (B 8, H 32/8, D 128, "
              "S_kv 4000..4031) fwd, causal prefill (B 1, S 700..731) fwd and fwd+bwd"),
    ShapeCase("hf_generate", HF_SHAPE_PATHS,
              "HF generation, 16-layer Llama-like model (hidden 2048, 32/8 heads), 128 new tokens, batch 1 "
              "and 8: tokens/s cold (new prompt lengths 512/660/808) and warm, graph builds",
              batches=(1, 8), needs_transformers=True),
    ShapeCase("hf_dynamic_padding", HF_SHAPE_PATHS,
              "HF training, the same model with 4 layers, batch 8, lengths 128..2048 padded to each batch's "
              "longest: 50 steps counting the first, step time, graph builds", needs_transformers=True),
)


def names() -> list[str]:
    return [c.name for c in SHAPE_CASES]


def split_names(requested: Iterable[str], matrix_names: Iterable[str]) -> tuple[list[str], list[ShapeCase]]:
    """(the matrix cases' names, the shape cases) among ``requested``, each once, in order;
    ValueError naming every valid case for a name that is neither."""
    matrix_names, by_name = list(matrix_names), {c.name: c for c in SHAPE_CASES}
    matrix, shapes = [], []
    for n in dict.fromkeys(requested):
        if n in by_name:
            shapes.append(by_name[n])
        elif n in matrix_names:
            matrix.append(n)
        else:
            raise ValueError(f"unknown bench case {n!r}. Available cases: {matrix_names + list(by_name)}")
    if not matrix and not shapes:
        raise ValueError(f"no bench case selected. Available cases: {matrix_names + list(by_name)}")
    return matrix, shapes


def runs(cases: Iterable[ShapeCase]) -> list[Run]:
    """Every process the cases need: path by path, and batch by batch within a path."""
    return [Run(c.name, p, b) for c in cases for p in c.paths for b in c.batches]


def error_row(run: Run, reason: str) -> dict:
    """The row of a process that failed (an exception, a crash, a timeout): what it was, and why."""
    if run.batch is None:
        return {"case": run.case, "group": run.case, "path": run.path, "status": "error", "reason": reason}
    return {"case": f"{run.case}_b{run.batch}", "group": run.case, "path": run.path, "batch": run.batch,
            "status": "error", "reason": reason}


def add_shape_ratios(rows: list[dict]) -> list[dict]:
    """Fill ``<prefix>_vs_native`` / ``<prefix>_vs_flash`` on every ok row that has the figure,
    against the row of the same ``case`` on that baseline path (pure; returns ``rows``)."""
    base = {(r["case"], r["path"]): r for r in rows if r.get("status", "ok") == "ok" and r["path"] in BASELINES}
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        for baseline in BASELINES:
            b = base.get((r["case"], baseline))
            for figure, prefix in RATIO_FIGURES.items():
                if b is not None and b.get(figure) and r.get(figure):
                    r[f"{prefix}_{baseline}"] = b[figure] / r[figure]
    return rows
