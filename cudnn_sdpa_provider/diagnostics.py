"""Data for humans: ``report()``, ``explain()``, the doctor's feature rows and its GPU self-test
(``doctor`` assembles the doctor's page).

Everything returns data (strings, lists of tuples, dicts); only ``cli`` prints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from .hooks import activation
from .core import arguments, counters, known_issues, support
from .engine import machine
from .ops import dense_varlen, route
from .core.reasons import Reason

__all__ = ["report", "explain", "DoctorRow", "feature_rows", "known_issue_rows", "self_test"]


def report(snapshot: "counters.Stats | None" = None) -> str:
    """The telemetry as a table: path x served / fallback (with reasons), and the plans used."""
    if snapshot is not None and not isinstance(snapshot, counters.Stats):
        raise TypeError(f"report() takes a Stats snapshot (csp.stats()) or nothing, got {type(snapshot).__name__}")
    return counters.format_table(snapshot if snapshot is not None else counters.stats())


def explain(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, window=(-1, -1), bottom_right=False,
            sinks=None, scale=None, seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None,
            max_seqlen_q=None, max_seqlen_kv=None, return_lse=False, validate=None, block_table=None, kv_layout=None,
            deterministic=None, through_sdpa=True, device=None) -> dict[str, list[Reason]]:
    """The reasons a call would get, forward and backward, without running it.

    Takes every ``csp.attention`` keyword (dense (B, H, S, D); with ``cu_seqlens_q``, packed
    (T, H, D); with ``block_table`` and ``kv_layout``, a paged KV cache) plus F.sdpa's
    ``attn_mask``. ``through_sdpa=True`` (default) describes an F.scaled_dot_product_attention /
    varlen_attn call, which the provider only sees while enabled; ``False`` describes a direct
    ``attention()`` call. A paged call is always a direct one (``through_sdpa`` does not apply):
    ``{"paged_fwd": [...]}``, whose backward is known from the inputs (``paged_backward`` when one
    requires grad). ``return_lse`` and ``validate`` are checked and change no reason. ``device``
    answers for another machine: a ``support.Capabilities`` or ``{"compute_capability": (9, 0),
    "cudnn_version": "9.19.0"}`` (the inputs are then taken as if they were on that CUDA device;
    meta tensors work). Returns ``{"dense_fwd": [...], "dense_bwd": [...]}`` (or the varlen
    paths, or paged_fwd); empty = served.
    """
    packed, paged = cu_seqlens_q is not None, block_table is not None
    if arguments.kv_layout(kv_layout, paged) == "NHD":  # as csp.attention reads it
        k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (k, v))
    arguments.common(q, k, v, sinks, 3 if packed else 4, 4 if paged else None)
    window = arguments.window(is_causal, window)
    arguments.flag("bottom_right", bottom_right)
    arguments.flag("return_lse", return_lse)
    arguments.validate_mode(validate)
    arguments.scale(scale, q.shape[-1])
    dropout_p = arguments.dropout(dropout_p)
    det = torch.are_deterministic_algorithms_enabled() if deterministic is None else arguments.flag(
        "deterministic", deterministic)
    caps = machine.describe_device(device) if device is not None else None
    device_type = "cuda" if caps is not None else q.device.type
    if paged:
        if dropout_p:
            raise ValueError("dropout_p is not supported with block_table (a paged KV cache is for inference)")
        problems = [_paged_problem(q, k, v, block_table, cu_seqlens_q, max_seqlen_q, sinks, window, bottom_right)]
        through_sdpa = False
    elif packed:
        cu_q = arguments.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        if cu_seqlens_kv is not None:
            arguments.cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, q.device)
        if max_seqlen_q is None or max_seqlen_kv is None:
            raise ValueError("explain() of a packed call needs max_seqlen_q and max_seqlen_kv")
        problems = [route.varlen_problem(q, k, v, cu_q, arguments.max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0]),
                                         arguments.max_seqlen("max_seqlen_kv", max_seqlen_kv, k.shape[0], "k"),
                                         backward=b, window=window, bottom_right=bottom_right,
                                         sinks=sinks is not None, deterministic=det) for b in (False, True)]
        if dropout_p:
            problems = [dataclasses.replace(p, dropout_p=dropout_p) for p in problems]
    else:
        if (seq_lens_q is None) != (seq_lens_kv is None) and seq_lens_kv is not None:
            raise ValueError("pass seq_lens_q together with seq_lens_kv (padded batches), or neither")
        problems = [route.dense_problem(q, k, v, backward=b, window=window, bottom_right=bottom_right,
                                        sinks=sinks is not None, bias=attn_mask, dropout_p=dropout_p,
                                        padded=seq_lens_q is not None, deterministic=det) for b in (False, True)]
    problems = [dataclasses.replace(p, device_type=device_type) for p in problems]
    result = {}
    for p in problems:
        found = route.reasons_for(p, q.device.index if q.device.type == "cuda" else None, caps=caps)
        if through_sdpa and not activation.enabled():
            found.insert(0, Reason("not_enabled", "the provider is not enabled (csp.enable() or CUDNN_SDPA_PROVIDER=1)"))
        result["paged_fwd" if paged else p.path] = found
    return result


def _paged_problem(q, k_cache, v_cache, table, cu_seqlens_q, max_seqlen_q, sinks, window, bottom_right):
    """A paged call as ``paged_ops`` decides it: packed queries are attended as a padded
    (B, H, max_seqlen_q, D) batch (a shape-only stand-in here: nothing is copied)."""
    from .ops import paged_ops

    grad = dense_varlen.grad_needed(q, k_cache, v_cache, sinks)  # as csp.attention decides it
    device = q.device
    if cu_seqlens_q is not None:
        cu_q = arguments.cu_seqlens("cu_seqlens_q", cu_seqlens_q, device)
        max_q = arguments.max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0], "q")
        q = torch.empty((cu_q.shape[0] - 1, q.shape[1], max_q, q.shape[2]), dtype=q.dtype, device="meta")
    table = arguments.block_table(table, q.shape[0], device)
    return paged_ops.problem(q, k_cache, v_cache, table, sinks, window, bottom_right, grad)


# -------------------------------------------------------------------------------------- doctor


class DoctorRow(NamedTuple):
    section: str
    label: str
    ok: bool | None  # None: informational
    value: str


def _sample(kind: str, **overrides) -> support.Problem:
    import torch as t

    base = dict(kind=kind, backward=False, device_type="cuda", dtypes=(t.bfloat16,) * 3, batch=2, h_q=8, h_k=8,
                h_v=8, s_q=1024, s_kv=1024, d_qk=128, d_v=128)
    base.update(overrides)
    return support.Problem(**base)


#: (feature, problem) pairs the doctor evaluates against this machine's capability rules.
FEATURES = (
    ("dense forward", _sample("dense")),
    ("dense backward", _sample("dense", backward=True)),
    ("varlen forward", _sample("varlen")),
    ("varlen backward", _sample("varlen", backward=True)),
    ("GQA/MQA", _sample("dense", backward=True, h_k=2, h_v=1)),
    ("causal / sliding window", _sample("dense", backward=True, window=(256, 0))),
    ("bottom-right alignment", _sample("dense", backward=True, window=(-1, 0), bottom_right=True, s_q=512)),
    ("sinks forward", _sample("dense", sinks=True)),
    ("sinks backward (dense)", _sample("dense", backward=True, sinks=True)),
    ("sinks backward (varlen)", _sample("varlen", backward=True, sinks=True)),
    ("padded dense (seq lens)", _sample("dense", backward=True, padded=True)),
    ("attention bias", _sample("dense", backward=True, bias=True)),
    ("dropout", _sample("dense", dropout_p=0.1)),
    ("deterministic backward", _sample("dense", backward=True, deterministic=True)),
    ("head dim 64", _sample("dense", backward=True, d_qk=64, d_v=64)),
    ("head dim 192/128", _sample("dense", backward=True, d_qk=192, d_v=128)),
    ("head dim 256", _sample("dense", backward=True, d_qk=256, d_v=256)),
    ("float16", _sample("dense", backward=True, dtypes=(torch.float16,) * 3)),
)


def feature_rows(caps: support.Capabilities | None = None) -> list[DoctorRow]:
    """One row per feature: served on this machine, or the reason it is not."""
    caps = caps if caps is not None else machine.capabilities()
    rows = []
    for name, problem in FEATURES:
        if problem.deterministic:
            found = support.reasons(problem, caps, deterministic_limit_bytes=8 << 30)
        else:
            found = support.reasons(problem, caps)
        rows.append(DoctorRow("features", name, not found, "served" if not found else f"no: {found[0]}"))
    return rows


def known_issue_rows(caps: support.Capabilities | None = None) -> list[DoctorRow]:
    """The rows of the known-issues table that apply to this machine's cuDNN and GPU (calls they
    cover fall back with ``cudnn_known_issue``), or one row saying none does."""
    caps = caps if caps is not None else machine.capabilities()
    if not caps.cuda or caps.cudnn_version is None:
        why = "no CUDA device" if not caps.cuda else "cuDNN version unknown"
        return [DoctorRow("known issues", "table", None, f"skipped: {why}")]
    rows = [DoctorRow("known issues", row.issue, None, f"{row.summary}, for {row.where} (cuDNN {row.versions}): "
                      "such calls fall back (cudnn_known_issue)")
            for row in known_issues.applicable(caps.cudnn_version, caps.compute_capability)]
    cc = caps.compute_capability
    where = f"cuDNN {support.version_str(caps.cudnn_version)} on sm_{cc[0]}{cc[1]}" if cc else "this machine"
    return rows or [DoctorRow("known issues", "table", True, f"no known-bad configuration of {where}")]


def self_test(device: int | None = None) -> list[DoctorRow]:
    """A few configurations forward+backward on the GPU against an fp32 reference."""
    from .ops import reference
    from .functional import attention

    configs = (
        ("bf16 causal GQA d128", dict(h=8, hk=2, s=256, d=128, dtype=torch.bfloat16, causal=True)),
        ("fp16 full d64", dict(h=4, hk=4, s=128, d=64, dtype=torch.float16, causal=False)),
        ("bf16 window d64", dict(h=4, hk=1, s=200, d=64, dtype=torch.bfloat16, causal=True, window=(31, 0))),
    )
    rows = []
    dev = torch.device("cuda", device if device is not None else torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1234)
    for name, c in configs:
        window = support.canonical_window(c["causal"], c.get("window", (-1, -1)))
        q = torch.randn(2, c["h"], c["s"], c["d"], device=dev, generator=gen, dtype=c["dtype"]).requires_grad_()
        k = torch.randn(2, c["hk"], c["s"], c["d"], device=dev, generator=gen, dtype=c["dtype"]).requires_grad_()
        v = torch.randn(2, c["hk"], c["s"], c["d"], device=dev, generator=gen, dtype=c["dtype"]).requires_grad_()
        go = torch.randn(2, c["h"], c["s"], c["d"], device=dev, generator=gen, dtype=c["dtype"])
        before = counters.stats()
        out = attention(q, k, v, window=window)
        out.backward(go)
        served = (counters.stats() - before).served
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref, _ = reference.dense(*leaves, scale=1 / math.sqrt(c["d"]), window=window)
        ref.backward(go.float())
        worst = 0.0
        for got, want in ((out, ref), (q.grad, leaves[0].grad), (k.grad, leaves[1].grad), (v.grad, leaves[2].grad)):
            worst = max(worst, ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
        tol = 4e-2 if c["dtype"] == torch.bfloat16 else 1e-2
        ok = worst <= tol and served["dense_fwd"] == 1 and served["dense_bwd"] == 1
        how = "served" if served["dense_fwd"] == 1 and served["dense_bwd"] == 1 else "NOT served"
        rows.append(DoctorRow("self-test", name, ok, f"{how}, max rel err {worst:.1e} (tol {tol:.0e})"))
    return rows
