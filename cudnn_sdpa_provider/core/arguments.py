"""Argument checks of ``csp.attention`` and ``csp.explain``: ValueError/TypeError naming the
argument, the value and what is valid.

Two kinds. What is free to check is always checked: types, dtypes, shapes, devices, options.
Values inside tensors (lengths, prefix sums) are checked where that needs no host-device sync (CPU
tensors) or where the caller asks (``validate=True``: one sync per call). On the GPU without
``validate``, out-of-range lengths are caught on the device instead (``rows``, ``packed``): they
never read or write outside a tensor, and their outputs are NaN.

Numbers: one helper per kind (``integer``, ``real``, ``flag``), used by every public function.
An integer argument takes any integral number (``operator.index``: int, numpy integers), a real
one any real number (``numbers.Real``: int, float, numpy floats and integers), a flag a bool (or
numpy bool). bool is refused where a number is wanted (``True`` as a length or a scale is a
mistake), and so are tensors, 0-dim included: these values are read on the host, and reading a CUDA
tensor would be a device sync (pass ``int(t)`` / ``float(t)``). A wrong type is a TypeError, a
wrong value (out of range, not finite) a ValueError.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys

import torch

from . import support

__all__ = ["require_tensor", "readable", "common", "lengths", "block_table", "cu_seqlens", "max_seqlen",
           "packed_lengths", "scale", "dropout", "flag", "integer", "real", "window", "KV_LAYOUTS", "kv_layout",
           "validate_mode", "check_lengths", "check_cu_seqlens", "check_block_table"]


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _is_bool(value) -> bool:
    numpy = sys.modules.get("numpy")  # a numpy bool can only come from a program that imported numpy
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def flag(name: str, value) -> bool:
    """A bool (or numpy bool), as a bool; anything else is a TypeError."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def integer(name: str, value, *, minimum: int | None = None, what: str = "") -> int:
    """An integral number (int, numpy integer: ``operator.index``) as an int, at least ``minimum``.
    bool, floats and tensors are TypeErrors (a float length is a mistake, a tensor a device read)."""
    valid = f"an integer >= {minimum}" if minimum is not None else "an integer"
    valid += f" ({what})" if what else ""
    if _is_bool(value) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {valid}, got {type(value).__name__} {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {valid}, got {type(value).__name__} {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {valid}, got {number}")
    return number


def real(name: str, value, *, valid: str, ok=lambda x: True) -> float:
    """A real number (int, float, numpy number: ``numbers.Real``), finite and ``ok``, as a float.
    bool, strings and tensors are TypeErrors; a value that is not finite or not ``ok`` a ValueError
    (``valid`` says what is, e.g. "a float in [0, 1)")."""
    if _is_bool(value) or isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {valid}, got {type(value).__name__} {value!r}")
    number = float(value)
    # a comparison, not math.isfinite: under torch.compile(dynamic=True) a float can be traced as a
    # SymFloat, which math.isfinite cannot take (a graph break that fails fullgraph=True)
    if not abs(number) < math.inf or not ok(number):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    return number


def window(is_causal, value) -> tuple[int, int]:
    """``window=(left, right)`` (integers >= -1, -1 unbounded) folded with ``is_causal``
    (``support.canonical_window``) into a pair of ints."""
    if type(is_causal) is bool and type(value) is tuple and len(value) == 2:  # the common form, checked quickly
        left, right = value
        if type(left) is int and type(right) is int and left >= -1 and right >= -1 and not (is_causal and right > 0):
            return (left, 0) if is_causal else value
    is_causal = flag("is_causal", is_causal)
    if value is None:
        value = (-1, -1)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"window must be a pair (left, right) of integers >= -1, got {value!r}")
    left, right = (integer(f"window {side} bound", bound, minimum=-1, what="-1 = unbounded")
                   for side, bound in zip(("left", "right"), value))
    return support.canonical_window(is_causal, (left, right))


#: ``kv_layout``'s values: the dims of a paged KV cache, by FlashInfer's names for them (its
#: ``kv_layout="NHD"/"HND"``, flashinfer.page.append_paged_kv_cache). Both orders have the same
#: rank and, where block_size and H_kv divide H_q alike, shapes that fit either reading, so the
#: caller must say which (a cache read in the wrong order gives wrong numbers, not an error).
KV_LAYOUTS = {"NHD": "(N, block_size, H_kv, D): FlashAttention, vLLM, torch's varlen_attn(block_table=)",
              "HND": "(N, H_kv, block_size, D)"}


def _layouts() -> str:
    return " or ".join(f"{name!r} {dims}" for name, dims in KV_LAYOUTS.items())


def kv_layout(value, paged: bool) -> str | None:
    """The paged cache's layout: required with ``block_table`` (no default: see KV_LAYOUTS), refused
    without it."""
    if not paged:
        if value is not None:
            raise ValueError(f"kv_layout={value!r} is for a paged KV cache; pass block_table too (or drop kv_layout)")
        return None
    if value is None:
        raise TypeError(f"block_table needs kv_layout: the order of the caches' dims, {_layouts()}; it has no "
                        f"default because both fit the same shapes")
    if not isinstance(value, str):
        raise TypeError(f"kv_layout must be a str, {_layouts()}, got {type(value).__name__} {value!r}")
    if value not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be {_layouts()}, got {value!r}")
    return value


def validate_mode(value) -> bool | None:
    if value is not None and not _is_bool(value):
        raise TypeError(f"validate must be None (check values where it is free: CPU tensors), True (always, one "
                        f"host-device sync per call) or False (never), got {value!r}")
    return None if value is None else bool(value)


def common(q, k, v, sinks, dims: int, kv_dims: int | None = None) -> None:
    """q, k, v (and sinks): tensors of the layout's rank (``kv_dims`` for k and v when it differs:
    paged caches) on one device, one floating dtype, GQA heads (dim 1 in every layout)."""
    names = {4: "(B, H, S, D)", 3: "(T, H, D)"}
    for name, t, rank in (("q", q, dims), ("k", k, kv_dims or dims), ("v", v, kv_dims or dims)):
        require_tensor(name, t)
        if t.dim() != rank:
            layout_name = names[rank] if name == "q" or kv_dims is None else f"(a paged cache: {_layouts()})"
            raise ValueError(f"{name} must be {rank}-D {layout_name} here, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
    if q.element_size() == 1:  # float8_*: no kernel behind this API takes them (PyTorch's neither)
        raise TypeError(f"q, k, v must be float16, bfloat16 or float32 here, got {q.dtype}; FP8 attention is "
                        "cudnn_sdpa_provider.fp8: attention (from bf16/fp16/fp32 activations) or forward (from FP8 "
                        "tensors already quantised)")
    h_q, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]  # heads are dim 1 in both layouts
    if h_k == 0 or h_v == 0 or h_q % h_k or h_q % h_v:
        raise ValueError(f"H_q={h_q} must be a multiple of H_k={h_k} and H_v={h_v} (GQA/MQA)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if sinks is not None:
        require_tensor("sinks", sinks)
        if tuple(sinks.shape) != (h_q,):
            raise ValueError(f"sinks must have shape (H_q,) = ({h_q},), got {tuple(sinks.shape)}")
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be floating point, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def _int32_vector(name: str, t, device, shape_ok: bool, expected: str) -> torch.Tensor:
    require_tensor(name, t)
    if not shape_ok:
        raise ValueError(f"{name} must {expected}, got {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.dtype == torch.int32:
        return t
    # int64 values beyond int32 stay out of range (they would wrap into plausible ones)
    return t.clamp(min=-1, max=2**31 - 1).to(torch.int32)


def lengths(name: str, t, batch: int, device) -> torch.Tensor:
    """(B,) int32/int64 lengths on q's device, as int32."""
    ok = isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == batch
    return _int32_vector(name, t, device, ok, f"have shape ({batch},) (one length per batch row)")


def block_table(t, batch: int, device) -> torch.Tensor:
    """(B, M) int32/int64 block table on q's device, M >= 1, as int32."""
    ok = isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == batch and t.shape[1] >= 1
    return _int32_vector("block_table", t, device, ok, f"have shape ({batch}, M) with M >= 1 (a row of cache block "
                         "indices per sequence)")


def cu_seqlens(name: str, t, device) -> torch.Tensor:
    """(B+1,) int32/int64 prefix sums on q's device, as int32."""
    ok = isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] >= 2
    return _int32_vector(name, t, device, ok, "be 1-D prefix sums of shape (B+1,) with B >= 1")


def max_seqlen(name: str, value, tokens: int | None = None, tensor: str = "q") -> int:
    """A host integer >= 1, and at most ``tokens`` (the packed tensor's T: no sequence is longer,
    and the padded buffers are sized by it, so 10**6 would ask for terabytes)."""
    if value is None:  # required with cu_seqlens_q: a missing value, as before
        raise ValueError(f"{name} must be an integer >= 1 (the longest sequence; it is never read from the "
                         f"device), got None")
    number = integer(name, value, minimum=1, what="the longest sequence; it is never read from the device")
    if tokens is not None and number > max(tokens, 1):
        raise ValueError(f"{name} = {number} is more than the {tokens} packed tokens of {tensor}: no sequence is "
                         f"that long (pass the longest sequence's length)")
    return number


def packed_lengths(q, k, cu_q, cu_kv, max_q, max_kv) -> tuple:
    """The packed (varlen) length arguments of a call on q (T_q, H, D) and k (T_kv, H, D), checked:
    (given, cu_q, cu_kv, max_q, max_kv), with ``given`` the prefix sums as passed (cu_kv defaulting
    to cu_q; int64 values unclamped, for value checks), cu_q / cu_kv as int32 on q's device and the
    longest lengths as host ints."""
    given = (cu_q, cu_q if cu_kv is None else cu_kv)
    cu_q = cu_seqlens("cu_seqlens_q", cu_q, q.device)
    cu_kv = cu_q if cu_kv is None else cu_seqlens("cu_seqlens_kv", cu_kv, q.device)
    if cu_kv.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must have the same shape (one entry per sequence, plus "
                         f"one), got {tuple(cu_q.shape)} and {tuple(cu_kv.shape)}")
    return (given, cu_q, cu_kv, max_seqlen("max_seqlen_q", max_q, q.shape[0], "q"),
            max_seqlen("max_seqlen_kv", max_kv, k.shape[0], "k"))


def scale(value, head_dim: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    return real("scale", value, valid="a finite real number or None")


def dropout(value) -> float:
    return real("dropout_p", value, valid="a float in [0, 1)", ok=lambda p: 0.0 <= p < 1.0)


#: Tensor types that are plain data (nn.Parameter: e.g. gpt-oss's sinks); anything else is a subclass
#: that may trace or transform (FakeTensor, FunctionalTensor, user subclasses).
PLAIN = (torch.Tensor, torch.nn.Parameter)


def readable(t: torch.Tensor) -> bool:
    """Whether tensor values can be read here: eager code on a plain tensor (not compiling, tracing,
    or inside a fake/meta or other dispatch mode)."""
    return (type(t) in PLAIN and t.device.type != "meta" and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not torch._C._len_torch_dispatch_stack())


def _host(t: torch.Tensor) -> list[int]:
    return t.tolist()  # a CPU tensor costs nothing; a CUDA one is the sync ``validate=True`` asks for


def check_lengths(name: str, t: torch.Tensor, limit: int, limit_name: str) -> None:
    """Every length in [0, limit]."""
    bad = [(i, n) for i, n in enumerate(_host(t)) if not 0 <= n <= limit]
    if bad:
        i, n = bad[0]
        raise ValueError(f"{name}[{i}] = {n} is outside [0, {limit_name} = {limit}]")


def check_cu_seqlens(name: str, t: torch.Tensor, tokens: int, max_name: str, max_len: int) -> None:
    """Prefix sums from 0, non-decreasing, within the packed tokens, no sequence longer than max_len."""
    cu = _host(t)
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0 (prefix sums start at 0), got {cu[0]}")
    for i in range(1, len(cu)):
        n = cu[i] - cu[i - 1]
        if n < 0:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i}] = {cu[i]} < {name}[{i - 1}] = {cu[i - 1]}")
        if n > max_len:
            raise ValueError(f"sequence {i - 1} has {n} tokens ({name}[{i}] - {name}[{i - 1}]) but {max_name} = "
                             f"{max_len}; pass the longest sequence length")
    if cu[-1] > tokens:
        raise ValueError(f"{name}[-1] = {cu[-1]} runs past the {tokens} packed tokens of the tensor")


def check_block_table(table: torch.Tensor, seq_len_kv: torch.Tensor, blocks: int, block_size: int) -> None:
    """Every table entry a sequence's keys use (the first ceil(seq_len_kv / block_size)) in [0, blocks)."""
    rows, lengths = _host(table), _host(seq_len_kv)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        for j in range(-(-n // block_size)):
            if not 0 <= row[j] < blocks:
                raise ValueError(f"block_table[{b}, {j}] = {row[j]} is outside [0, N = {blocks}) (the cache's blocks), "
                                 f"and sequence {b} uses it (seq_lens_kv[{b}] = {n})")
