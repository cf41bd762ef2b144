"""The ``fp8`` cases (issue #30): FP8 attention end to end from bf16 activations, beside bf16.

What an ``fp8`` case's paths run (``cases.FP8_PATHS``), on the same bf16 q, k, v (B, H, S, D):
  native       ``F.scaled_dot_product_attention``, provider off, PyTorch choosing the backend: the baseline
  provider     the same call inside ``enable()`` (bf16 on the provider's cuDNN graphs)
  fp8_delayed  ``csp.fp8.attention(q, k, v, is_causal=..., recipe=csp.fp8.Recipe(scaling="delayed"))``
  fp8_current  the same with ``Recipe(scaling="current")``
Each FP8 path gets one recipe per (case, mode), made with its step (before the probe call) and
kept through the warm-up and timed calls: the steady state of a training loop, where a delayed
recipe's amax history comes from the calls before. ``fwd_bwd`` is the forward, then
``torch.autograd.grad`` with a random grad_out (bf16 too: the FP8 backward quantises it).

Fresh inputs every call. The FP8 paths get bf16 activations and quantise them inside the timed
call: nothing is quantised ahead of time. The input sets rotate (at least ``MIN_SETS``, and enough
to span more than 5x L2, as for every case: ``inputs.make_sets``), and after each call, warm-up or
timed, outside the CUDA-event window, the set it read gets new random values (``refresh``). So no
call sees values an earlier call saw (a cache of quantised inputs, keyed on a tensor or its
version, could not help), and the call after a refill reads another set, which the calls since its
own refill have pushed out of L2. A real layer's q, k, v are as new each step.

``ratio_entries`` / ``ratio_table``: the rows side by side, bf16 native time / each path's time per
(case, mode), the form of issue #30's table; ``ratio_points``: the same for the plot. Pure data on
``report.Row``-like objects; this module imports torch only where a step is built.
"""

from __future__ import annotations

from typing import Callable

from .cases import BASELINE, FP8_PATHS, Case

__all__ = ["MIN_SETS", "SCALING", "recipe", "attn", "refresh", "ratio_entries", "ratio_table", "ratio_points"]

#: Input sets an fp8 case rotates through at least, so that a call never reads the set just refilled.
MIN_SETS = 2
#: The FP8 paths and the ``Recipe(scaling=...)`` each one runs.
SCALING = {"fp8_delayed": "delayed", "fp8_current": "current"}
#: The refill's generator seed (one generator per device), other than 0 and the fp8 cases' set seeds
#: (``inputs``: the CRC-32 of the case's name), so a refill does not redraw a set's first values.
#: Below 2**32: torch's CPU generator keeps only the low 32 bits of a seed.
REFRESH_SEED = 30_2026
_GENERATORS: dict = {}


def recipe(path: str):
    """A new ``csp.fp8.Recipe`` for an FP8 path (``SCALING``); ValueError for another path."""
    if path not in SCALING:
        raise ValueError(f"path {path!r} has no FP8 recipe; FP8 paths: {list(SCALING)}")
    from ... import fp8

    return fp8.Recipe(scaling=SCALING[path])


def attn(case: Case, path: str) -> Callable:
    """``(set, q, k, v) -> out`` for one path of an fp8 case (``paths.step`` adds the mode)."""
    if path not in FP8_PATHS:
        raise ValueError(f"unknown fp8 case path {path!r}. Available paths: {list(FP8_PATHS)}")
    causal = case.causal
    if path in SCALING:
        from ... import fp8

        r = recipe(path)
        return lambda s, q, k, v: fp8.attention(q, k, v, is_causal=causal, recipe=r)
    import torch.nn.functional as F

    sdpa, gqa = F.scaled_dot_product_attention, case.gqa
    return lambda s, q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)


def refresh(s) -> None:
    """New random values (standard normal, as ``inputs`` draws them) in the set's q, k, v and grad_out,
    in place: the same tensors (and graphs), new contents. A generator per device (``REFRESH_SEED``)."""
    import torch

    device = s.qd.device
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device).manual_seed(REFRESH_SEED)
    for t in (s.qd, s.kd, s.vd, s.g):  # the detached views share storage with the leaves
        t.normal_(generator=gen)


# --------------------------------------------------------------------------- side by side


def ratio_entries(rows) -> list[dict]:
    """One entry per (case, mode) of the fp8 rows, in row order: ``case``, ``mode``, ``seq``,
    ``causal``, ``native_ms`` (the baseline's median, None if it did not run) and ``paths``:
    {path: {"vs_native": bf16 native time / path time or None, "status": the row's status}}."""
    out: dict = {}
    for r in rows:
        if r.kind != "fp8":
            continue
        e = out.setdefault((r.case, r.mode), {"case": r.case, "mode": r.mode, "seq": r.seq, "causal": r.causal,
                                              "native_ms": None, "paths": {}})
        if r.path in BASELINE["fp8"] and r.median_ms:
            e["native_ms"] = r.median_ms
        e["paths"][r.path] = {"vs_native": r.vs_native, "status": r.status}
    return list(out.values())


def _cell(p: dict | None) -> str:
    if p is None:
        return "-"
    if p["vs_native"] is None:
        return p["status"] if p["status"] != "ok" else "-"
    return f"{p['vs_native']:.2f}x" + ("" if p["status"] == "ok" else "*")


def ratio_table(rows) -> str:
    """The fp8 rows side by side (empty when there are none): per (case, mode), native's median and
    each other path's bf16 native time / its time. A number from a row that is not "ok" (a call
    fell back) is marked ``*``; a path without a number shows its status."""
    entries = ratio_entries(rows)
    if not entries:
        return ""
    paths = [p for p in FP8_PATHS if p not in BASELINE["fp8"]]
    head = ("case", "mode", "native ms") + tuple(paths)
    cells = [head] + [(e["case"], e["mode"], "-" if e["native_ms"] is None else f"{e['native_ms']:.3f}")
                      + tuple(_cell(e["paths"].get(p)) for p in paths) for e in entries]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["FP8 end to end from bf16 activations: bf16 native time / path time (> 1 is faster)"]
    lines += ["  ".join(c[j].ljust(widths[j]) if j < 2 else c[j].rjust(widths[j]) for j in range(len(head))).rstrip()
              for c in cells]
    if any(c.endswith("*") for row in cells[1:] for c in row):
        lines.append("* not every call of that path was served (the table above says why): not the path's own time")
    return "\n".join(lines)


def ratio_points(rows, mode: str, gqa: frozenset = frozenset()) -> dict[tuple, list[tuple[int, float]]]:
    """For the plot: {(path, causal, is GQA): [(S, bf16 native time / path time), ...] sorted by S}
    over the fp8 rows of ``mode`` that are "ok"; ``gqa``: the names of the GQA cases."""
    pts: dict = {}
    for r in rows:
        if r.kind == "fp8" and r.mode == mode and r.status == "ok" and r.vs_native is not None \
                and r.path not in BASELINE["fp8"]:
            pts.setdefault((r.path, r.causal, r.case in gqa), []).append((r.seq, r.vs_native))
    return {k: sorted(v) for k, v in pts.items()}
