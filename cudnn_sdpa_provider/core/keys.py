"""Graph keys: what identifies a cuDNN graph (every dim, stride, dtype and option that changes it;
never a pointer or a value), the fixed tensor uids its buffers are bound by, and the two facts read
off a key alone (its description for telemetry, the uids it writes). Pure data: no cudnn import.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from .support import Problem

__all__ = ["UID", "Desc", "FwdKey", "BwdKey", "Fp8Key", "describe", "writes", "graph_problem"]


class UID(IntEnum):
    Q = 1
    K = 2
    V = 3
    O = 4  # noqa: E741
    LSE = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    SEQ_Q = 10
    SEQ_KV = 11
    SINK = 12
    DSINK = 13
    BIAS = 14
    SEED = 15
    OFFSET = 16
    RAG_Q = 17
    RAG_K = 18
    RAG_V = 19
    RAG_O = 20
    RAG_LSE = 21
    RAG_DO = 22
    RAG_DQ = 23
    RAG_DK = 24
    RAG_DV = 25
    RNG_DUMP = 26
    PAGE_K = 27
    PAGE_V = 28
    DESCALE_Q = 40  # FP8 graphs: per-tensor factors (real value = stored value x descale)
    DESCALE_K = 41
    DESCALE_V = 42
    DESCALE_S = 43
    SCALE_S = 44
    SCALE_O = 45
    AMAX_S = 46
    AMAX_O = 47
    DESCALE_O = 48
    DESCALE_DO = 49
    DESCALE_DP = 50
    SCALE_DQ = 51
    SCALE_DK = 52
    SCALE_DV = 53
    SCALE_DP = 54
    AMAX_DQ = 55
    AMAX_DK = 56
    AMAX_DV = 57
    AMAX_DP = 58


@dataclass(frozen=True)
class Desc:
    """A tensor as cuDNN sees it: dims and strides (elements), plus its dtype."""
    dims: tuple
    strides: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class FwdKey:  # every field that changes the graph; never a pointer or a value
    device: int
    q: Desc
    k: Desc
    v: Desc
    o: Desc
    lse: Desc | None
    scale: float
    window: tuple
    bottom_right: bool
    sinks: bool = False
    bias: Desc | None = None
    padded: bool = False
    ragged: bool = False
    dropout_p: float = 0.0
    rng_dump: bool = False  # tests: also write the realised dropout keep-mask
    pages: tuple | None = None  # paged KV: (block table Desc (B, 1, M, 1), M x block size); k/v are the caches

@dataclass(frozen=True)
class BwdKey:
    device: int
    q: Desc
    k: Desc
    v: Desc
    o: Desc
    do: Desc
    lse: Desc
    dq: Desc
    dk: Desc
    dv: Desc
    scale: float
    window: tuple
    bottom_right: bool
    sinks: bool = False
    bias: Desc | None = None
    padded: bool = False
    ragged: bool = False
    dropout_p: float = 0.0
    deterministic: bool = False
    max_total: tuple | None = None  # ragged only: (tokens_q, tokens_kv) bounds that size the dQ accumulator
    padded_lse: bool = False  # ragged only: the LSE is a padded (B, H, S_max, 1) tensor, not ragged


@dataclass(frozen=True)
class Fp8Key:
    """An FP8 graph (``sdpa_fp8`` / ``sdpa_fp8_backward``, per-tensor scales). Forward: q, k, v, o
    (+ lse); backward (``backward=True``): also do and dq, dk, dv. Scales are runtime tensors.
    ``ragged``: a packed forward (``engine.fp8_packed``): q, k, v, o (and lse) declared as nominal
    (B, H, S_max, D) with token-major strides and ragged offsets, the lengths as a padding mask."""
    device: int
    backward: bool
    q: Desc
    k: Desc
    v: Desc
    o: Desc
    lse: Desc | None
    scale: float
    causal: bool
    padded: bool = False
    do: Desc | None = None
    dq: Desc | None = None
    dk: Desc | None = None
    dv: Desc | None = None
    ragged: bool = False


def describe(key) -> str:
    """A short human description of a graph key (telemetry and logs)."""
    shape = lambda d: "x".join(str(n) for n in d.dims)  # noqa: E731
    dtype = str(key.q.dtype).replace("torch.", "")
    if isinstance(key, Fp8Key):
        flags = " ".join(f for f, on in (("causal", key.causal), ("padded", key.padded), ("varlen", key.ragged)) if on)
        return (f"fp8 {'bwd' if key.backward else 'fwd'} {dtype} q={shape(key.q)} k={shape(key.k)} v={shape(key.v)} "
                f"{flags}").strip()
    kind = "bwd" if isinstance(key, BwdKey) else "fwd"
    flags = [f for f, on in (("bottom_right", key.bottom_right), ("sinks", key.sinks), ("bias", key.bias is not None),
                             ("padded", key.padded), ("varlen", key.ragged),
                             ("deterministic", getattr(key, "deterministic", False)),
                             ("padded_lse", getattr(key, "padded_lse", False)),
                             ("paged", getattr(key, "pages", None) is not None)) if on]
    if key.dropout_p:
        flags.append(f"dropout={key.dropout_p}")
    if getattr(key, "max_total", None):
        flags.append("max_total={}/{}".format(*key.max_total))
    return f"{kind} {dtype} q={shape(key.q)} k={shape(key.k)} v={shape(key.v)} window={key.window} {' '.join(flags)}".strip()


def writes(key) -> frozenset:
    """The uids of the buffers a graph for ``key`` writes (the backward reads the LSE)."""
    if isinstance(key, Fp8Key):
        uids = ((UID.DQ, UID.DK, UID.DV, UID.AMAX_DQ, UID.AMAX_DK, UID.AMAX_DV, UID.AMAX_DP) if key.backward
                else (UID.O, UID.LSE, UID.AMAX_S, UID.AMAX_O))
    else:
        uids = (UID.DQ, UID.DK, UID.DV, UID.DSINK) if isinstance(key, BwdKey) else (UID.O, UID.LSE, UID.RNG_DUMP)
    return frozenset(int(u) for u in uids)


def graph_problem(key) -> Problem:
    """The graph's own dims as a ``support.Problem`` (for the known-issues table at build time): a
    graph's S may be a bucket's, not its call's. Ragged graphs declare (B, H, S_max, D); a paged
    graph's S_kv is its table's capacity; an FP8 key's causal flag is its window."""
    if isinstance(key, Fp8Key):
        kind, backward, window = "fp8", key.backward, (-1, 0) if key.causal else (-1, -1)
        dtypes = (key.q.dtype, key.k.dtype, key.v.dtype) + ((key.do.dtype,) if key.backward else ())
    else:
        pages = getattr(key, "pages", None)
        kind = "paged" if pages is not None else "varlen" if key.ragged else "dense"
        backward, window, dtypes = isinstance(key, BwdKey), tuple(key.window), (key.q.dtype, key.k.dtype, key.v.dtype)
    b, h_q, s_q, d_qk = key.q.dims
    pages = getattr(key, "pages", None)
    s_kv = pages[1] if pages is not None else key.k.dims[2]
    return Problem(kind=kind, backward=backward, device_type="cuda", dtypes=dtypes, batch=b, h_q=h_q,
                   h_k=key.k.dims[1], h_v=key.v.dims[1], s_q=s_q, s_kv=s_kv, d_qk=d_qk, d_v=key.v.dims[3],
                   window=window, bottom_right=getattr(key, "bottom_right", False), padded=key.padded,
                   deterministic=getattr(key, "deterministic", False), dropout_p=getattr(key, "dropout_p", 0.0),
                   sinks=getattr(key, "sinks", False), bias=getattr(key, "bias", None) is not None)
