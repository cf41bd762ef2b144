"""What cuDNN can serve: the capability table as data, and pure reason functions.

Nothing here touches a GPU. ``Problem`` describes one attention call (shapes, dtypes, options and
the few facts of its context that decide support), ``Capabilities`` describes the machine (cuDNN
version, compute capability); ``reasons(problem, caps)`` lists why the call cannot run on our cuDNN
graphs, most important first. "Supported" means that list is empty. Each rule has its own slug
(``reasons.Slug``); ``machine.capabilities()`` is the one place that asks the device.

The version gates come from cuDNN's release notes (docs/support.md is generated from ``RULES`` and
lists them with the releases).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .known_issues import KNOWN_ISSUES, KnownIssue, known_issue
from .reasons import Reason, Slug

__all__ = [
    "Capabilities",
    "Problem",
    "Rule",
    "RULES",
    "KnownIssue",
    "KNOWN_ISSUES",
    "known_issue",
    "MIN_CUDNN",
    "reasons",
    "length_class",
    "canonical_window",
    "cudnn_bounds",
    "version_str",
    "with_version",
]

#: Oldest cuDNN backend we build graphs for. Tested on 9.19; older 9.x releases lack pieces we use
#: (int64/int32 ragged offsets for THD since 9.1-9.6, sliding-window bands since 9.2).
MIN_CUDNN = 90600
#: Releases withdrawn for SDPA correctness bugs (cuDNN 9.10.0 / 9.10.1 release notes).
BLOCKED_CUDNN = frozenset({91000, 91001})
SINK_MIN = 91300  # sink_token forward and dense backward
SINK_RAGGED_BWD_MIN = 92600  # ragged (THD) + sink backward
PAGED_WIDE_MIN = 91000  # paged caches with head dims > 128, and masked paged decode (S_q == 1)
FP8_MIN = 91400  # FP8 SDPA (sdpa_fp8 / sdpa_fp8_backward): cudnn-frontend's own FP8 SDPA tests need 9.14.0
FP8_CC = (9, 0)  # FP8 tensor cores: Hopper and newer
FP8_BWD_HEAD_DIM_SM90 = 128  # sm_90's FP8 backward engine serves D = 128 only (results/gpu-run40-fp8-bwd-probe.txt)
DETERMINISTIC_SMALL_WS_MIN = 92500  # below this, sm_90 deterministic bwd needs O(B*H*S_q*S_kv) workspace
DROPOUT_BROKEN = (91100, 91400)  # [first bad, first good): cuDNN SDPA dropout bug
MAX_HEAD_DIM = 256
MAX_HEAD_DIM_BWD_PRE_HOPPER = 128
INT32_MAX = 2**31 - 1


def version_str(v: int | None) -> str:
    """91900 -> '9.19.0' (cuDNN's encoding: major*10000 + minor*100 + patch)."""
    if v is None:
        return "none"
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


@dataclass(frozen=True)
class Capabilities:
    """The machine, as far as attention support is concerned."""

    cuda: bool
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None
    frontend_version: str | None = None
    unavailable: str | None = None  # why cuDNN cannot be used (frontend missing, no libcudnn, ...)
    device_name: str | None = None


@dataclass(frozen=True)
class Problem:
    """One attention call, reduced to what decides support. Build it with ``dataclasses.replace``.

    ``recompute`` says the call is a dropout forward that autograd can recompute (activation
    checkpointing); ``paged`` a varlen call with seqused_k or block_table alone; ``unsupported`` names arguments
    given values the provider does not serve. Kind "paged" is a dense query over a paged KV cache
    (``csp.attention(block_table=)``): ``s_kv`` is the table's capacity (blocks x ``block_size``),
    ``backward`` that its inputs require grad. Kind "fp8" is ``csp.fp8`` (per-tensor scaled FP8
    operands; ``dtypes`` has a fourth entry in a backward, dO's)."""

    kind: str  # "dense", "varlen", "paged" or "fp8"
    backward: bool
    device_type: str
    dtypes: tuple  # (q, k, v) torch dtypes
    batch: int
    h_q: int
    h_k: int
    h_v: int
    s_q: int  # max_seqlen_q for varlen
    s_kv: int
    d_qk: int
    d_v: int
    window: tuple[int, int] = (-1, -1)  # FlashAttention convention; (-1, 0) is causal
    bottom_right: bool = False
    sinks: bool = False
    bias: bool = False
    bias_grad: bool = False
    dropout_p: float = 0.0
    padded: bool = False
    deterministic: bool = False
    empty: bool = False
    empty_sequence: bool = False  # kind "fp8", padded: a sequence of no tokens (a length <= 0) in this call
    ragged_extent: int = 0  # varlen: largest packed extent * token stride (elements)
    recompute: bool = False
    paged: bool = False
    unsupported: tuple = ()
    block_size: int = 0  # kind "paged": tokens per cache block

    @property
    def path(self) -> str:
        return f"{self.kind}_{'bwd' if self.backward else 'fwd'}"

    def describe(self) -> str:
        names = [str(d).replace("torch.", "") for d in self.dtypes]
        parts = [
            f"{self.path} B={self.batch} H={self.h_q}/{self.h_k}/{self.h_v} S={self.s_q}/{self.s_kv}",
            f"D={self.d_qk}/{self.d_v} dtype={'/'.join(names)} window={self.window}",
        ]
        flags = [n for n, on in (("bottom_right", self.bottom_right), ("sinks", self.sinks), ("bias", self.bias),
                                 ("padded", self.padded), ("deterministic", self.deterministic)) if on]
        if self.dropout_p:
            flags.append(f"dropout={self.dropout_p}")
        return " ".join(parts + flags)


class Rule(NamedTuple):
    """One capability rule: ``check`` returns a message when the rule rejects the call."""

    slug: str
    summary: str
    check: Callable[[Problem, Capabilities], "str | None"]


def _no_cuda(p: Problem, c: Capabilities) -> str | None:
    if p.device_type != "cuda":
        return f"inputs are on {p.device_type!r}"
    if not c.cuda:
        return "CUDA is not available"
    return None


def _unavailable(p: Problem, c: Capabilities) -> str | None:
    return c.unavailable


def _cc(p: Problem, c: Capabilities) -> str | None:
    if c.compute_capability is not None and c.compute_capability < (8, 0):
        return f"compute capability {c.compute_capability} < (8, 0)"
    if p.kind == "fp8" and c.compute_capability is not None and c.compute_capability < FP8_CC:
        return f"FP8 attention needs compute capability >= {FP8_CC} (Hopper), have {c.compute_capability}"
    return None


def _global_version(p: Problem, c: Capabilities) -> str | None:
    v = c.cudnn_version
    if v is None:
        return None
    if v < MIN_CUDNN:
        return f"cuDNN {version_str(v)} is older than {version_str(MIN_CUDNN)}"
    if v in BLOCKED_CUDNN:
        return f"cuDNN {version_str(v)} is blocked for SDPA (withdrawn release)"
    return None


def _paged(p: Problem, c: Capabilities) -> str | None:
    return "seqused_k or block_table without the other" if p.paged and p.kind == "varlen" else None


def _paged_block_size(p: Problem, c: Capabilities) -> str | None:
    bs = p.block_size
    if p.kind == "paged" and (bs <= 0 or bs & (bs - 1)):
        return f"cache block size {bs} is not a power of 2"
    return None


def _paged_backward(p: Problem, c: Capabilities) -> str | None:
    return "a paged KV call whose inputs require grad (no paged backward)" if p.kind == "paged" and p.backward else None


def _unsupported(p: Problem, c: Capabilities) -> str | None:
    return f"argument(s) {', '.join(p.unsupported)} with values the provider does not serve" if p.unsupported else None


def _empty(p: Problem, c: Capabilities) -> str | None:
    return "an input has zero elements" if p.empty else None


def _dtype(p: Problem, c: Capabilities) -> str | None:
    import torch

    if p.kind == "fp8":
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        if any(d != e4m3 for d in p.dtypes[:3]) or any(d not in (e4m3, e5m2) for d in p.dtypes[3:]):
            names = "/".join(str(d).replace("torch.", "") for d in p.dtypes)
            return f"dtypes {names}; FP8 attention needs float8_e4m3fn q, k, v (and an e4m3fn or e5m2 dO)"
        return None
    q, k, v = p.dtypes
    if q not in (torch.float16, torch.bfloat16) or k != q or v != q:
        return f"dtypes {q}/{k}/{v}; cuDNN SDPA needs all float16 or all bfloat16"
    return None


def _head_dim(p: Problem, c: Capabilities) -> str | None:
    for name, d in (("D_qk", p.d_qk), ("D_v", p.d_v)):
        if d % 8 or d <= 0 or d > MAX_HEAD_DIM:
            return f"{name}={d} (need a multiple of 8 in 8..{MAX_HEAD_DIM})"
    pre_hopper = c.compute_capability is not None and c.compute_capability < (9, 0)
    sm90 = c.compute_capability is not None and c.compute_capability[0] == 9
    if p.kind == "fp8" and p.backward and sm90 and (p.d_qk, p.d_v) != (FP8_BWD_HEAD_DIM_SM90,) * 2:
        return f"FP8 backward with head dims {p.d_qk}/{p.d_v} on sm_90 (its engine serves {FP8_BWD_HEAD_DIM_SM90} only)"
    if p.backward and pre_hopper and max(p.d_qk, p.d_v) > MAX_HEAD_DIM_BWD_PRE_HOPPER:
        return f"backward with head dim {max(p.d_qk, p.d_v)} > {MAX_HEAD_DIM_BWD_PRE_HOPPER} before Hopper"
    return None


def _gqa(p: Problem, c: Capabilities) -> str | None:
    if p.h_k <= 0 or p.h_v <= 0 or p.h_q % p.h_k or p.h_q % p.h_v:
        return f"H_q={p.h_q} is not a multiple of H_k={p.h_k} and H_v={p.h_v}"
    return None


def _feature(p: Problem, c: Capabilities) -> str | None:
    v = c.cudnn_version
    if v is not None and p.kind == "fp8" and v < FP8_MIN:
        return f"FP8 attention needs cuDNN >= {version_str(FP8_MIN)} (have {version_str(v)})"
    if v is not None and p.sinks and v < SINK_MIN:
        return f"attention sinks need cuDNN >= {version_str(SINK_MIN)} (have {version_str(v)})"
    if v is not None and p.kind == "paged" and v < PAGED_WIDE_MIN:
        if max(p.d_qk, p.d_v) > 128:
            return f"a paged KV cache with head dim > 128 needs cuDNN >= {version_str(PAGED_WIDE_MIN)}"
        if p.s_q == 1 and p.window[1] >= 0:
            return f"a masked paged decode (S_q == 1) needs cuDNN >= {version_str(PAGED_WIDE_MIN)}"
    return None


def _bug(p: Problem, c: Capabilities) -> str | None:
    v = c.cudnn_version
    if v is None:
        return None
    left, right = p.window
    # cuDNN 9.14.0: wrong results for non-causal sliding windows once s_kv > 1024 (fixed in 9.15.0).
    if v == 91400 and left >= 0 and right != 0 and p.s_kv > 1024:
        return "cuDNN 9.14.0 sliding-window bug (non-causal window, s_kv > 1024)"
    # cuDNN 9.11-9.13 SDPA dropout is broken; PyTorch's own selector refuses it there too.
    if p.dropout_p > 0.0 and DROPOUT_BROKEN[0] <= v < DROPOUT_BROKEN[1]:
        return f"dropout is broken in cuDNN {version_str(v)} (9.11.0 - 9.13.x)"
    return None


def _known_issue(p: Problem, c: Capabilities) -> str | None:
    found = known_issue(c.cudnn_version, c.compute_capability, p)  # the known-issues table
    return found.message if found else None


def _sink_ragged_bwd(p: Problem, c: Capabilities) -> str | None:
    v = c.cudnn_version
    if p.sinks and p.backward and p.kind == "varlen" and v is not None and v < SINK_RAGGED_BWD_MIN:
        return f"varlen sink backward needs cuDNN >= {version_str(SINK_RAGGED_BWD_MIN)} (have {version_str(v)})"
    return None


def _sink_decode(p: Problem, c: Capabilities) -> str | None:
    return "attention sinks with S_q == 1" if p.sinks and p.s_q == 1 else None


def _seq_one_bwd(p: Problem, c: Capabilities) -> str | None:
    return "backward with S_q == S_kv == 1" if p.backward and p.s_q == 1 and p.s_kv == 1 else None


def _bias(p: Problem, c: Capabilities) -> str | None:
    if p.bias and p.kind == "varlen":
        return "a bias on packed (varlen) inputs"
    if p.bias_grad:
        return "a bias that requires grad (dBias is not served)"
    return None


def _dropout(p: Problem, c: Capabilities) -> str | None:
    if p.dropout_p <= 0.0:
        return None
    if p.kind == "varlen":
        return f"dropout_p={p.dropout_p} on packed inputs"
    if p.dropout_p >= 1.0:
        return f"dropout_p={p.dropout_p} (must be < 1)"
    return None


def _recompute(p: Problem, c: Capabilities) -> str | None:
    if p.dropout_p > 0.0 and p.recompute and not p.backward:
        return "a dropout forward that autograd may recompute (activation checkpointing)"
    return None


def _ragged(p: Problem, c: Capabilities) -> str | None:
    if p.kind in ("varlen", "fp8") and p.ragged_extent > INT32_MAX:  # fp8: packed (csp.fp8, cu_seqlens)
        return f"packed extent {p.ragged_extent} elements exceeds int32 ragged offsets"
    return None


def length_class(s_q: int, s_kv: int) -> tuple:
    """What ``RULES`` and the known-issues table read of a call's lengths: whether each is 0, 1 or
    more, and whether S_kv passes 1024 (cuDNN 9.14.0's window bug). Two dense problems equal in
    every other field and in this class have the same reasons (tests/test_support.py checks every
    rule on random problems): ``route.entry`` decides a dense call once per class of lengths."""
    return min(s_q, 2), min(s_kv, 2), s_kv > 1024


#: Evaluated in order; the first reason is the one counted, ``explain()`` shows them all. One rule
#: per slug (``tests/test_support.py`` checks it), so a slug has one meaning.
RULES: tuple[Rule, ...] = (
    Rule(Slug.NO_CUDA.value, "inputs on a CUDA device", _no_cuda),
    Rule(Slug.CUDNN_UNAVAILABLE.value, "nvidia-cudnn-frontend importable and cuDNN loadable", _unavailable),
    Rule(Slug.COMPUTE_CAPABILITY.value, "GPU sm_80 or newer (FP8: sm_90 or newer)", _cc),
    Rule(Slug.CUDNN_VERSION.value, f"cuDNN >= {version_str(MIN_CUDNN)}, not 9.10.0/9.10.1", _global_version),
    Rule(Slug.PAGED_KV.value, "varlen_attn's seqused_k and block_table both or neither", _paged),
    Rule(Slug.PAGED_BACKWARD.value, "a paged KV cache (block_table) without grad", _paged_backward),
    Rule(Slug.UNSUPPORTED_ARGUMENT.value, "no argument the provider does not serve", _unsupported),
    Rule(Slug.EMPTY.value, "no zero-size inputs", _empty),
    Rule(Slug.DTYPE.value, "q, k, v all float16 or all bfloat16 (FP8: float8_e4m3fn, dO e4m3fn or e5m2)", _dtype),
    Rule(Slug.HEAD_DIM.value, "head dims multiples of 8 up to 256 (backward before Hopper: 128; FP8 backward on "
                              "sm_90: 128)", _head_dim),
    Rule(Slug.GQA_HEADS.value, "H_q divisible by H_k and by H_v", _gqa),
    Rule(Slug.PAGED_BLOCK_SIZE.value, "paged KV cache blocks of a power-of-2 size", _paged_block_size),
    Rule(Slug.CUDNN_FEATURE.value, f"attention sinks on cuDNN >= {version_str(SINK_MIN)}; paged head dims > 128 "
                                   f"and masked paged decode on >= {version_str(PAGED_WIDE_MIN)}; FP8 on >= "
                                   f"{version_str(FP8_MIN)}", _feature),
    Rule(Slug.CUDNN_BUG.value, "no known bug of this cuDNN release for this configuration", _bug),
    Rule(Slug.CUDNN_KNOWN_ISSUE.value, "not a known-bad cuDNN configuration (the known-issues table below)",
         _known_issue),
    Rule(Slug.SINK_BACKWARD_RAGGED.value, "varlen sink backward on cuDNN >= 9.26", _sink_ragged_bwd),
    Rule(Slug.SINK_DECODE.value, "no sinks at S_q == 1", _sink_decode),
    Rule(Slug.SEQ_LEN_ONE_BACKWARD.value, "no backward at S_q == S_kv == 1", _seq_one_bwd),
    Rule(Slug.ATTN_BIAS.value, "bias only on dense inputs, without grad", _bias),
    Rule(Slug.DROPOUT.value, "dropout only on dense inputs, p < 1", _dropout),
    Rule(Slug.DROPOUT_RECOMPUTE.value, "no dropout in a forward that autograd may recompute", _recompute),
    Rule(Slug.RAGGED_OFFSET_OVERFLOW.value, "packed operands within int32 offsets", _ragged),
)

_MACHINE_SLUGS = (Slug.NO_CUDA.value, Slug.CUDNN_UNAVAILABLE.value)


def deterministic_workspace_bytes(p: Problem, c: Capabilities) -> int:
    """Workspace the deterministic backward needs on this machine (0 where it is small).

    On sm_90 before cuDNN 9.25 it is O(B*H*S_q*S_kv): 2 bytes per score element, about 34 GB at
    B=8, H=32, S=8k.
    """
    v = c.cudnn_version or 0
    if not (p.backward and p.deterministic) or c.compute_capability != (9, 0) or v >= DETERMINISTIC_SMALL_WS_MIN:
        return 0
    return 2 * p.batch * p.h_q * p.s_q * p.s_kv


def reasons(p: Problem, caps: Capabilities, *, deterministic_limit_bytes: int | None = None) -> list[Reason]:
    """Every reason this call cannot run on our cuDNN graphs, most important first."""
    found: list[Reason] = []
    for rule in RULES:
        message = rule.check(p, caps)
        if message:
            found.append(Reason(rule.slug, message))
            if rule.slug in _MACHINE_SLUGS:
                break  # nothing else is meaningful without a GPU and cuDNN
    if not found and deterministic_limit_bytes is not None:
        need = deterministic_workspace_bytes(p, caps)
        if need > deterministic_limit_bytes:
            found.append(Reason(Slug.DETERMINISTIC_WORKSPACE.value, f"needs {need / 2**20:.0f} MiB workspace, "
                                                                    f"limit {deterministic_limit_bytes / 2**20:.0f} MiB"))
    return found


def canonical_window(is_causal: bool, window: tuple[int, int] | list[int] | None) -> tuple[int, int]:
    """Fold ``is_causal`` and a FlashAttention-style ``window=(left, right)`` into one pair.

    ``-1`` means unbounded. ``(-1, -1)`` is full attention, ``(-1, 0)`` causal, ``(w, 0)`` causal
    with a sliding window that sees ``w`` keys before the diagonal (``w + 1`` keys in all). The one
    place where ``is_causal`` becomes a window.
    """
    if window is None:
        window = (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}")
    left, right = window
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"window {name} bound must be an int >= -1 (-1 = unbounded), got {value!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal:
        if right > 0:
            raise ValueError(f"is_causal=True conflicts with window right bound {right}; use window=({left}, 0)")
        right = 0
    return int(left), int(right)


def cudnn_bounds(window: tuple[int, int]) -> tuple[int | None, int | None]:
    """FlashAttention window -> cuDNN (diagonal_band_left_bound, diagonal_band_right_bound).

    cuDNN's left bound counts the visible keys INCLUDING the diagonal, so FA's left ``w`` is
    ``w + 1``; the right bound is the same number (0 with TOP_LEFT alignment is causal). ``None``
    means unbounded on that side.
    """
    left, right = window
    return (left + 1 if left >= 0 else None, right if right >= 0 else None)


def with_version(caps: Capabilities, version: int) -> Capabilities:
    """A copy of ``caps`` claiming another cuDNN version (tests, doctor's what-if rows)."""
    return dataclasses.replace(caps, cudnn_version=version)
