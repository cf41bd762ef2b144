"""Argument checks of ``csp.attention`` and ``csp.explain``: ValueError/TypeError naming the
argument, the value and what is valid.

Two kinds. What is free to check is always checked: types, dtypes, shapes, devices, options.
Values inside tensors (lengths, prefix sums) are checked where that needs no host-device sync (CPU
tensors) or where the caller asks (``validate=True``: one sync per call). On the GPU without
``validate``, out-of-range lengths are caught on the device instead (``rows``, ``packed``): they
never read or write outside a tensor, and their outputs are NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = ["require_tensor", "readable", "common", "lengths", "block_table", "cu_seqlens", "max_seqlen", "scale",
           "dropout", "flag", "validate_mode", "check_lengths", "check_cu_seqlens", "check_block_table"]


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def validate_mode(value) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"validate must be None (check values where it is free: CPU tensors), True (always, one "
                        f"host-device sync per call) or False (never), got {value!r}")
    return value


def common(q, k, v, sinks, dims: int, kv_dims: int | None = None) -> None:
    """q, k, v (and sinks): tensors of the layout's rank (``kv_dims`` for k and v when it differs:
    paged caches) on one device, one floating dtype, GQA heads (dim 1 in every layout)."""
    names = {4: "(B, H, S, D)", 3: "(T, H, D)"}
    for name, t, rank in (("q", q, dims), ("k", k, kv_dims or dims), ("v", v, kv_dims or dims)):
        require_tensor(name, t)
        if t.dim() != rank:
            layout_name = names[rank] if name == "q" or kv_dims is None else "(N, H, block_size, D) (a paged cache)"
            raise ValueError(f"{name} must be {rank}-D {layout_name} here, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise TypeError(f"q, k, v must be floating point, got {q.dtype}")
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


def max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (the longest sequence; it is never read from the device), "
                         f"got {value!r}")
    return value


def scale(value, head_dim: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"scale must be a finite float or None, got {value!r}")
    return float(value)


def dropout(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {value!r}")
    return float(value)


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
