"""The guard where operands meet a cached graph, and the per-signature binding that runs it.

A call's *signature* is everything that decides how its operands meet a cuDNN graph: each
tensor's shape, strides, dtype and whether its data pointer is 16-byte aligned, plus the options.
Tensor values and pointers are never part of it. For each signature, a ``Binding`` is made once,
on the first call: which operands are used in place and which are repaired (copied into the layout
the graph is built for), the layout of every output and whether cuDNN writes it directly, the
built graph and the fixed order of its buffers. Every later call with that signature only
allocates, repairs what its binding says, and executes: the guard costs nothing per call, and an
operand that does not fit its graph can never be launched, because any difference in strides,
alignment or dtype is a different signature with a binding of its own.

Bindings live in ``graphs``' per-thread LRU cache beside the built graphs (cuDNN plans are per
thread), bounded like it. A binding executed while a CUDA graph is being captured is also kept for
good (``run``): the captured graph replays its plan's kernels and reads its device tensors by
address, whatever later evicts them from the caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import graphs
from ..core import layout
from .graphs import Desc

__all__ = ["tensor_key", "Binding", "lookup", "store", "small_operand", "desc", "run", "captured", "outputs",
           "copy_back"]


def tensor_key(t):
    """A tensor's part of a signature: (shape, strides, dtype, 16-byte aligned), or None."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.data_ptr() % layout.ALIGN == 0)


@dataclass
class Binding:
    """How one signature runs: ``repair`` flags per operand, output (size, stride) pairs and
    whether cuDNN writes each one in place, the built plan and its buffer uids in order."""

    plan: "graphs.Plan"
    uids: tuple
    repair: tuple
    outputs: tuple  # ((size, stride), ...) in the caller's layout
    direct: tuple  # per output: cuDNN writes it in place (else into a scratch buffer, then copied)
    extra: dict  # per-path facts decided once (e.g. whether rows can be dead)
    fix: bool = True  # any(repair): whether a call has anything to repair


def lookup(signature: tuple) -> Binding | None:
    return graphs.fast_get(signature)


def store(signature: tuple, binding: Binding) -> Binding:
    graphs.fast_put(signature, binding)
    return binding


def small_operand(t: torch.Tensor, shape: tuple, dtype=None) -> torch.Tensor:
    """A small option tensor (lengths, sink logits) as the graph declares it: ``shape``, packed
    strides, ``dtype``, 16-byte-aligned base; ``t`` itself when it already is, else a fresh copy
    (a strided or offset view, e.g. one column of a (B, 2) tensor, would be read wrongly)."""
    dtype = t.dtype if dtype is None else dtype
    if t.dtype == dtype and t.is_contiguous() and t.data_ptr() % layout.ALIGN == 0:
        return t.view(shape)
    return torch.empty(shape, dtype=dtype, device=t.device).copy_(t.reshape(shape))


def desc(t: torch.Tensor) -> Desc:
    """Dims and strides as cuDNN should see them: a size-1 dim gets the stride it would have if
    packed (cuDNN rejects 0 and can misread odd strides on dims that are never stepped)."""
    dims = tuple(t.shape)
    strides = list(t.stride())
    for i, size in enumerate(dims):
        if size == 1:
            inner = 1
            for s in dims[i + 1 :]:
                inner *= s
            strides[i] = max(inner, 1)
    return Desc(dims, tuple(strides), t.dtype)


_captured: dict = {}  # id -> every binding a CUDA graph captured, kept for good (``run``)


def _capturing(device) -> bool:
    """Whether the current stream is capturing a CUDA graph (``device`` None: the CPU tier's fake)."""
    return device is not None and torch.cuda.is_current_stream_capturing()


def run(binding: Binding, buffers: tuple, device: int) -> None:
    """Execute the binding's plan on ``buffers`` (in ``binding.uids`` order) on the current stream.

    Under a CUDA-graph capture the binding is kept for good (``captured``): every replay launches
    the kernels of its plan (a cuDNN execution plan owns its kernels and whatever it loaded to run
    them, freed with it) and reads the device tensors in its ``extra`` (the folded graphs' offsets,
    lengths and dead-row mask) by address. Without this, the plan's LRU cache evicting it (256
    other graphs built later, a ``clear_cache``, a folded binding replaced by its exact graph) would
    leave the captured graph launching freed kernels. A handful of objects per captured
    configuration; a capture of the same binding again adds nothing."""
    if _capturing(device):
        _captured[id(binding)] = binding
    graphs.execute(binding.plan, binding.uids, buffers, device, torch._C._cuda_getCurrentRawStream(device))


def captured() -> list:
    """The bindings kept because a CUDA graph captured them (``run``)."""
    return list(_captured.values())


def outputs(binding: Binding, dtypes: tuple, device, fill: torch.Tensor | None = None) -> tuple[list, list]:
    """(the outputs in the caller's layout, the buffers cuDNN writes) for one call; with ``fill``
    (a 0-dim device tensor, read on the device) the buffers cuDNN writes start at that value, so
    rows it does not write keep it."""
    results, targets = [], []
    for (size, stride), direct, dtype in zip(binding.outputs, binding.direct, dtypes):
        out = torch.empty_strided(size, stride, dtype=dtype, device=device)
        buf = out if direct else torch.empty(size, dtype=dtype, device=device)
        if fill is not None:
            buf.fill_(fill)
        results.append(out)
        targets.append(buf)
    return results, targets


def copy_back(results: list, targets: list) -> None:
    """Copy what cuDNN wrote into scratch buffers into the caller's layout."""
    for out, buf in zip(results, targets):
        if out is not buf:
            out.copy_(buf)
