"""The call pipeline: every entry point decides here, once, whether a call is served, falls back,
or is refused, and records it.

The four entry points (the aten SDPA overrides, the varlen_attn overrides, the ``cudnn_sdpa`` ops
behind ``csp.attention``, the Hugging Face integration) each describe their call as a
``support.Problem`` and hand it here:

* ``entry(signature, problem)`` computes the call's reasons once per signature (a tuple of shapes,
  strides, dtypes and options that is cheap to build) and caches them per thread;
* ``call(path, entry, serve, native, describe)`` applies the one policy: no reason -> ``serve``
  (cuDNN); cuDNN's rejection at build time becomes a reason too; a reason -> in strict mode, record
  the refusal and raise ``FallbackError``, else record the fallback (logged once per
  configuration) and run ``native``. Served calls are recorded after they ran.

Backward calls take the reason (and strictness) their forward recorded (``follow``); calls PyTorch
sent to another backend get theirs from ``elsewhere``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, TypeVar

import torch

from ..core import counters, env, scope, support
from ..engine import machine
from ..core.errors import FallbackError, NotSupportedError
from ..core.reasons import Reason, Slug

__all__ = ["Entry", "entry", "fixed", "elsewhere", "user_excludes_cudnn", "call", "reasons_for", "dense_problem",
           "varlen_problem", "recompute", "describe_call"]

log = logging.getLogger("cudnn_sdpa_provider")
T = TypeVar("T")
_tls = threading.local()


class Entry:
    """What the route knows of one call signature: its reasons (the first is the one counted)."""

    __slots__ = ("reasons",)

    def __init__(self, reasons: list[Reason]):
        self.reasons = reasons

    @property
    def first(self) -> Reason | None:
        return self.reasons[0] if self.reasons else None


def describe_call(**items) -> str:
    """Shapes, dtypes, strides and flags of a call, for FallbackError and logs."""
    parts = []
    for name, value in items.items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).replace("torch.", "")
            parts.append(f"{name}={tuple(value.shape)} {dtype} stride={tuple(value.stride())} {value.device}")
        elif value is not None:
            parts.append(f"{name}={value!r}")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------ problems


def recompute(dropout_p: float) -> bool:
    """Whether a dropout forward made now can be recomputed by autograd: saved-tensor hooks are
    active (non-reentrant checkpointing), grad is disabled (the first pass of reentrant
    checkpointing), or a backward pass is running (the recomputation itself). Checked only for
    dropout, where a recomputation must draw the forward's mask."""
    if dropout_p <= 0.0:
        return False
    return (not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


def dense_problem(q, k, v, *, backward=False, window=(-1, -1), bottom_right=False, sinks=False, bias=None,
                  dropout_p=0.0, padded=False, deterministic=False, recompute=False, unsupported=()) -> support.Problem:
    return support.Problem(
        kind="dense", backward=backward, device_type=q.device.type, dtypes=(q.dtype, k.dtype, v.dtype),
        batch=q.shape[0], h_q=q.shape[1], h_k=k.shape[1], h_v=v.shape[1], s_q=q.shape[2], s_kv=k.shape[2],
        d_qk=q.shape[3], d_v=v.shape[3], window=tuple(window), bottom_right=bottom_right, sinks=bool(sinks),
        bias=bias is not None, bias_grad=bias is not None and bias.requires_grad and torch.is_grad_enabled(),
        dropout_p=float(dropout_p), padded=padded, deterministic=deterministic,
        empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0, recompute=recompute, unsupported=tuple(unsupported))


def varlen_key(q, k, v) -> tuple:
    """What of packed q, k, v a decision depends on: heads, head dims, dtypes, and whether the ragged
    offsets overflow. Never the token count, which changes from batch to batch."""
    return (q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, q.device.type,
            _extent(q, k, v) > support.INT32_MAX, q.numel() == 0 or k.numel() == 0 or v.numel() == 0)


def _extent(q, k, v) -> int:
    # Ragged offsets are elements of the contiguous buffers cuDNN reads (operands are repaired to that
    # layout), O and dO included, whose D_v may exceed D_qk.
    return max(q.shape[0] * q.shape[1] * max(q.shape[2], v.shape[2]), k.shape[0] * k.shape[1] * k.shape[2],
               v.shape[0] * v.shape[1] * v.shape[2])


def varlen_problem(q, k, v, cu_seqlens_q, max_q, max_kv, *, backward=False, window=(-1, -1), bottom_right=False,
                   sinks=False, deterministic=False, paged=False, unsupported=()) -> support.Problem:
    extent = _extent(q, k, v)
    return support.Problem(
        kind="varlen", backward=backward, device_type=q.device.type, dtypes=(q.dtype, k.dtype, v.dtype),
        batch=cu_seqlens_q.shape[0] - 1, h_q=q.shape[1], h_k=k.shape[1], h_v=v.shape[1], s_q=int(max_q),
        s_kv=int(max_kv), d_qk=q.shape[2], d_v=v.shape[2], window=tuple(window), bottom_right=bottom_right,
        sinks=bool(sinks), deterministic=deterministic,
        empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or cu_seqlens_q.shape[0] < 2,
        ragged_extent=extent, paged=paged, unsupported=tuple(unsupported))


# ------------------------------------------------------------------------------------- reasons


def _deterministic_limit() -> int:
    mb = env.deterministic_workspace_mb()
    if mb is not None:
        return mb * 2**20
    free, _total = torch.cuda.mem_get_info()
    return free // 2


def reasons_for(problem: support.Problem, device_index: int | None = None,
                caps: support.Capabilities | None = None) -> list[Reason]:
    """Every reason ``problem`` is not served on this machine (or on ``caps``), most important first:
    the one place reasons are computed."""
    if caps is None:
        caps = machine.capabilities(device_index if problem.device_type == "cuda" else None)
    limit = None
    if problem.backward and problem.deterministic and caps.cuda and support.deterministic_workspace_bytes(problem, caps):
        limit = _deterministic_limit()
    return support.reasons(problem, caps, deterministic_limit_bytes=limit)


def _cache() -> OrderedDict:
    cache = getattr(_tls, "entries", None)
    if cache is None:
        cache = _tls.entries = OrderedDict()
    return cache


def entry(signature: tuple, problem: Callable[[], support.Problem], device_index: int | None = None,
          lengths_free: Callable[[], tuple] | None = None) -> Entry:
    """The entry of a call signature (this thread's cache; ``problem()`` is built on a miss only).
    Deterministic backwards whose workspace depends on free memory are decided afresh each call.
    ``lengths_free()`` (called on a miss only): a key that holds everything ``problem()`` depends
    on but the exact lengths, and their ``support.length_class`` instead (a dense call without a
    bias: its problem reads only shapes, dtypes and options); a signature missed at a new length
    then takes the decision made at another length of its class, as a copy (a length that cuDNN
    refuses at build time is marked on its own signature only, ``call``)."""
    cache = _cache()
    found = cache.get(signature)
    if found is not None:
        cache.move_to_end(signature)
        return found
    free = lengths_free() if lengths_free is not None else None
    shared = cache.get(free) if free is not None else None
    if shared is not None:
        cache.move_to_end(free)
        found = Entry(list(shared.reasons))
    else:
        p = problem()
        found = Entry(reasons_for(p, device_index))
        caps = machine.capabilities(device_index if p.device_type == "cuda" else None)
        if support.deterministic_workspace_bytes(p, caps):
            return found
        if free is not None:
            cache[free] = Entry(list(found.reasons))
    cache[signature] = found
    while len(cache) > env.cache_size():
        cache.popitem(last=False)
    return found


def fixed(slug: str, message: str) -> Entry:
    """An entry whose reason is already known (a backward whose forward fell back, an integration's
    own fallback)."""
    return Entry([Reason(str(slug), message)])


def user_excludes_cudnn() -> bool:
    """Whether the user's own SDPA backend flags exclude cuDNN (``sdpa_kernel([...])`` without
    CUDNN_ATTENTION, ``torch.backends.cuda.enable_cudnn_sdp(False)``). The one rule for every entry
    point PyTorch calls (F.sdpa's backends, varlen_attn on every torch): such a call is not served
    (``backend_disabled``); the provider never overrides the user's restriction."""
    return not torch.backends.cuda.cudnn_sdp_enabled()


def elsewhere(signature: tuple, problem: Callable[[], support.Problem], device_index: int | None) -> Entry:
    """The entry of a call PyTorch sent to a backend other than cuDNN, or one the user's flags keep
    off cuDNN (``user_excludes_cudnn``): our own first reason, else ``backend_disabled`` (the user's
    selection excludes cuDNN) or ``torch_selection``."""
    key = ("elsewhere", user_excludes_cudnn()) + signature
    cache = _cache()
    found = cache.get(key)
    if found is None:
        p = problem()
        found = Entry(reasons_for(p, device_index) or [_selection_reason(p)])
        cache[key] = found
        while len(cache) > env.cache_size():
            cache.popitem(last=False)
    return found


def _selection_reason(p: support.Problem) -> Reason:
    if user_excludes_cudnn():
        return Reason(Slug.BACKEND_DISABLED.value, "cuDNN SDPA is disabled (sdpa_kernel([...]) without CUDNN_ATTENTION, "
                                                   "or torch.backends.cuda.enable_cudnn_sdp(False))")
    return Reason(Slug.TORCH_SELECTION.value, f"PyTorch's SDPA selector did not pick cuDNN for {p.describe()}")


def clear() -> None:
    """Forget this thread's cached decisions (tests)."""
    _cache().clear()


# ------------------------------------------------------------------------------------- policy


def call(path: str, found: Entry, serve: Callable[[], T] | None, native: Callable[[Reason], T],
         describe: Callable[[], str], *, strict: bool | None = None, then: tuple[str, Entry] | None = None) -> T:
    """Serve, fall back or refuse one call, and record which: THE decision of every entry point.

    ``serve`` runs the call on cuDNN (None: it cannot be served here); ``native(reason)`` runs the
    fallback. ``strict`` defaults to this thread's/task's scope (``scope.strict()``); a backward
    passes what its forward recorded. ``then=(path, entry)`` names the backward a served forward
    will need: in strict mode its reason refuses the call now, where the user's code runs."""
    reason = found.first
    strict = scope.strict() if strict is None else strict
    if reason is None and strict and then is not None and then[1].first is not None:
        _refuse(then[0], then[1].first, describe)
    if reason is None and serve is not None:
        try:
            result = serve()
        except NotSupportedError as exc:  # cuDNN rejected the graph, or the known-issues table did
            reason = Reason(exc.reason, exc.detail)
            found.reasons = [reason]  # the signature's later calls fall back at once (no rebinding)
        else:
            counters.record(path)
            return result
    if reason is None:  # an entry point's bug, never the user's input
        raise RuntimeError(f"cudnn-sdpa-provider: {path} has no reason to fall back but cannot be served")
    if strict:
        _refuse(path, reason, describe)
    counters.record(path, reason.slug)
    counters.log_once((path, reason.slug, reason.message), logging.INFO, "%s falls back (%s): %s", path,
                      reason.slug, reason.message)
    return native(reason)


def _refuse(path: str, reason: Reason, describe: Callable[[], str]):
    counters.record(path, reason.slug, refused=True)
    raise FallbackError(path, [reason.slug], describe(), [reason.message])
