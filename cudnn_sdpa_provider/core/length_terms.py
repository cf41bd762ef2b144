"""The row terms of sequence lengths that the package made itself, computed once and shared.

A padded dense call derives small device tensors from its lengths (``core/rows.py``): the lengths
cuDNN is given (0 where out of range) with the out-of-range flag, the rows that are 0 by
definition, the value they get, the key rows past each length. That is about 40 small kernels for
a forward and its backward, each launched from Python, which a host-bound step (a small model)
pays in full. Lengths the package made itself are marked with ``own``: the transformers
integration's ``CudnnMask`` (one pair for every layer of a forward and their backwards) and a
padding mask read by ``ops/bias_lengths.py`` (one pair for a call and its backward). ``get``
computes a term of a marked pair at the first call that needs it and hands it to the later ones.

A term is reused only where nothing can have changed the values it was computed from:

* the pair was marked by the code that made it, which never writes it again (a caller's own
  lengths are never marked: a CUDA-graph replay or a ``.data`` write changes a tensor without its
  version counter), and both tensors' version counters are what they were when it was marked (an
  in-place write through torch drops the terms); inference tensors, which have no counter, are
  never marked;
* on the stream it was computed on (a term computed on another stream may not be ready yet; a
  stream is told by its handle, so an external stream destroyed and another created at the same
  handle would pass for it: torch's own streams are pooled and never destroyed);
* not while a CUDA graph is being captured: a capture neither reads nor keeps a term (a captured
  graph would read a term's memory after the term is freed, and a tensor made during a capture
  holds its value only after a replay), and marks nothing.

The terms live on the lengths tensor (an attribute) and are freed with it.

A maker that has read its lengths on the host may also state, with ``own(..., full=(S_q, S_kv))``,
that every query length is S_q and every key length is in [1, S_kv] (the transformers
integration's ``padding="auto"`` and ``ops/bias_lengths.py`` read exactly that before they serve
lengths). ``full`` answers it under the same conditions as ``get``, the stream aside (a fact about
values read on the host is no term on a stream): ``core/rows.py`` then gives cuDNN those lengths as
they are (``safe_lengths``) and, with ``none_dead``, knows with no device work that no row is 0 by
definition.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["own", "get", "full"]

_ATTR = "_cudnn_sdpa_length_terms"
_MISSING = object()


class _Terms:
    """A marked pair's terms: {stream: {key: term}}, valid while ``seq_len_q`` and the versions hold."""

    __slots__ = ("seq_len_q", "versions", "by_stream", "full")

    def __init__(self, seq_len_q: torch.Tensor, versions: tuple, full: tuple | None):
        self.seq_len_q = weakref.ref(seq_len_q)  # the kv lengths hold the terms: no reference cycle
        self.versions = versions
        self.by_stream: dict = {}
        self.full = full


def _versions(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor) -> tuple:
    return seq_len_q._version, seq_len_kv._version


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device's current stream is capturing a CUDA graph (not only the current device's)."""
    if not t.is_cuda:
        return False
    if t.device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(t.device):
        return torch.cuda.is_current_stream_capturing()


def own(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor, *, full: tuple[int, int] | None = None) -> None:
    """Mark a (B,) pair that the caller made and never writes again (module docstring); nothing is
    marked while compiling or tracing (those tensors stand for values of later runs), and no
    inference tensor (no version counter). ``full=(S_q, S_kv)``: the caller has read on the host
    that every query length is S_q and every key length is in [1, S_kv] (answered by ``full``)."""
    if seq_len_q.is_inference() or seq_len_kv.is_inference():
        return
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _capturing(seq_len_kv):
        return
    seq_len_kv.__dict__[_ATTR] = _Terms(seq_len_q, _versions(seq_len_q, seq_len_kv),
                                        None if full is None else (int(full[0]), int(full[1])))


def _valid(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor) -> _Terms | None:
    """The pair's terms where they may be used now: marked, unchanged since, with these query
    lengths, and no capture under way."""
    terms = seq_len_kv.__dict__.get(_ATTR)
    if terms is None or _capturing(seq_len_kv):
        return None
    if terms.versions != _versions(seq_len_q, seq_len_kv):
        seq_len_kv.__dict__.pop(_ATTR, None)  # written in place since it was marked: never reused again
        return None
    if terms.seq_len_q() is not seq_len_q:  # the kv lengths with other query lengths
        return None
    return terms


def full(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor, s_q: int, s_kv: int) -> bool:
    """Whether the pair's maker stated ``full=(s_q, s_kv)`` (``own``) and it still holds: every query
    length is ``s_q`` and every key length is in [1, ``s_kv``]. False wherever ``get`` would not reuse
    a term (unmarked, written since, other query lengths, capturing)."""
    terms = _valid(seq_len_q, seq_len_kv)
    return terms is not None and terms.full == (s_q, s_kv)


def get(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor, key: tuple, make: Callable):
    """``make()``, or, for a marked pair, what ``make`` returned for ``key`` at an earlier call on
    this stream. ``key`` must hold everything other than the lengths that the term depends on."""
    terms = _valid(seq_len_q, seq_len_kv)
    if terms is None:
        return make()
    stream = torch._C._cuda_getCurrentRawStream(seq_len_kv.device.index) if seq_len_kv.is_cuda else 0
    kept = terms.by_stream.setdefault(stream, {})
    term = kept.get(key, _MISSING)
    if term is _MISSING:
        term = kept[key] = make()
    return term
