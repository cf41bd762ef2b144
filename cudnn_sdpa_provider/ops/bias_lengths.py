"""A bias that is a right-padding mask, served as per-sequence lengths.

Hugging Face models hand ``F.scaled_dot_product_attention`` their padding as a (B, 1, S, S) mask,
which PyTorch turns into a bias of 0 and -65504 before the cuDNN op sees it. A bias's strides follow
S, so the engine builds an exact graph per length (GPU run 71: 94 builds in 50 dynamic-padding
steps under ``enable()``, against 2 through the transformers integration, which passes lengths).
Where the bias is exactly a right-padding mask, causal or not, it is the same attention as cuDNN's
padding mask with ``seq_len_kv`` = each sequence's real tokens and ``seq_len_q`` = S: every query
row, padded ones included, sees the keys the bias lets it see, and no row sees none. The engine
serves that call with the length buckets (one graph per doubling of S).

``recognise`` decides it on the device, in one synchronising read per call (a forward: its
backward runs what the forward ran, ``markers.Record.padding``; no mask's contents are remembered
across calls, since they can change without the version counter: a CUDA-graph replay, a ``.data``
write; a shape that stays, below, stops being read), and only where it is exact:

* S_q == S_kv > 1 and a 4-D bias (B or 1, H_q or 1, S, S) of a floating dtype, every entry 0 or
  at most ``MASKED`` (-65504: what PyTorch's cuDNN path makes of a boolean mask's False; -inf and
  ``finfo.min`` too);
* every batch row has at least one real token, and for every row and head the entries at 0 are
  exactly ``j < len`` (bidirectional) or ``j <= i and j < len`` (causal, top-left).

Only where the length buckets are on (``folded.buckets_on``: ``CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS``;
``0`` keeps every bias), never while tracing or capturing a CUDA graph (nothing can be read there),
for a tensor subclass, or for a bias of more than ``MAX_ENTRIES`` entries (the comparison's
temporaries; a read that runs out of memory keeps the bias). A configuration (dtypes, heads, the
bias's broadcast dims, device) whose bias once was not such a mask is not read again: a model that
passes another bias (ALiBi, a relative position bias) pays one read, not one per call. Anything
else stays a bias on today's exact graph: left padding, a sequence of no real token (its rows see
no key: a masked value there is not the same as no key), a sliding window, any other pattern.

A read costs a synchronisation per forward call; the buckets spare a build per new length. Where
the shape does not change (training padded to one length), they spare none, so an exact shape (its
configuration, B and S) recognised ``STABLE_AFTER`` times (its first 256 calls read) keeps its
bias from the next call on, unread, on the exact graph it builds once (rent, then buy, with the
number ``engine.dense.PROMOTE_AFTER`` uses for the folded graphs), while its configuration has
been recognised at no more than ``STABLE_SHAPES`` shapes. A configuration seen at more (dynamic
padding, a new longest length per batch) keeps reading for good, its stable shapes too: its
shapes come back, in a long run, often enough to get there one by one, and an exact graph for
each would be the build per length, and the cache's turnover, that the buckets avoid.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..core import counters, length_terms
from ..engine import dense, folded

__all__ = ["MAX_ENTRIES", "STABLE_AFTER", "STABLE_SHAPES", "Padding", "recognise", "clear"]

#: The most bias entries ``recognise`` reads (B 16 at S 2048, B 4 at S 4096): its comparison makes
#: a few boolean tensors of the bias's size.
MAX_ENTRIES = 1 << 26
#: A bias entry at or below this masks its key: PyTorch's cuDNN path turns a boolean mask's False into
#: -65504 (``convert_boolean_attn_mask_cudnn``, pytorch#177842), transformers' float masks use
#: ``finfo.min``, other code -inf. In a row that sees a key, such a key's softmax weight,
#: exp(score - 65504 - the row's best score), is 0 in fp32 unless its score exceeds the row's best by
#: more than 65000: exactly what leaving it out gives.
MASKED = -65504.0

#: Recognitions of one exact shape after which it keeps its bias unread (module docstring).
STABLE_AFTER = dense.PROMOTE_AFTER
#: The most shapes a configuration may be recognised at and still have one kept unread.
STABLE_SHAPES = 8
#: Configurations whose shapes are counted, least recently counted dropped (one whose stable shape
#: is no longer read is not counted either, so it goes first: it then starts over, read again).
_CONFIGURATIONS = 1024

_lock = threading.Lock()
_not_masks: set = set()  # configurations (``_configuration``) whose bias was read and was not such a mask
#: configuration -> {exact shape: times recognised}, or None once it was recognised at more than
#: ``STABLE_SHAPES`` shapes
_recognised: "OrderedDict[tuple, dict | None]" = OrderedDict()


@dataclass(frozen=True, eq=False)
class Padding:
    """What a recognised bias is: the window, and (B,) int32 lengths on the bias's device (compared
    by identity: tensors have no truth value)."""

    window: tuple[int, int]
    seq_len_q: torch.Tensor
    seq_len_kv: torch.Tensor


def recognise(bias, q: torch.Tensor, k: torch.Tensor) -> Padding | None:
    """The call's bias as a right-padding mask (module docstring), or None: keep the bias."""
    if not _candidate(bias, q, k):
        return None
    configuration = _configuration(bias, q)
    shape = (tuple(bias.shape), q.shape[0], q.shape[2])
    with _lock:  # first what this process already knows: an ALiBi model's every call ends here
        if configuration in _not_masks or (_recognised.get(configuration) or {}).get(shape, 0) >= STABLE_AFTER:
            return None
    if not _readable(bias, q):
        return None
    try:
        found = _read(bias)
    except torch.OutOfMemoryError:  # the comparison's temporaries: the bias path needs none of them
        return None
    if found is None:
        with _lock:
            _not_masks.add(configuration)
        return None
    _count(configuration, shape)
    if found.seq_len_kv.shape[0] != q.shape[0]:  # a bias broadcast over the batch
        lengths = found.seq_len_kv.expand(q.shape[0]).contiguous()
        found = Padding(found.window, torch.full_like(lengths, q.shape[2]), lengths)
    # made here: the forward and its backward share row terms; _read read every length in [1, S]
    length_terms.own(found.seq_len_q, found.seq_len_kv, full=(q.shape[2], k.shape[2]))
    return found


def clear() -> None:
    """Forget which configurations' biases were not masks and how often each shape was recognised (tests)."""
    with _lock:
        _not_masks.clear()
        _recognised.clear()


def _count(configuration: tuple, shape: tuple) -> None:
    with _lock:
        shapes = _recognised.pop(configuration, {})
        became_dynamic = shapes is not None and shape not in shapes and len(shapes) >= STABLE_SHAPES
        if became_dynamic:
            shapes = None  # dynamic: never kept unread, its stable shapes (if any) read again
        _recognised[configuration] = shapes
        while len(_recognised) > _CONFIGURATIONS:
            _recognised.popitem(last=False)
        times = None
        if shapes is not None:
            times = shapes[shape] = shapes.get(shape, 0) + 1
    if became_dynamic:
        counters.log_once(("bias_lengths_dynamic", configuration), logging.INFO, "F.sdpa's padding mask came at more "
                          "than %d shapes of one configuration: read at every call from now on (the length "
                          "buckets, no exact graph per length)", STABLE_SHAPES)
    elif times == STABLE_AFTER:
        counters.log_once(("bias_lengths_stable", configuration, shape), logging.INFO, "F.sdpa's padding mask came "
                          "%d times at one shape (B %d, S %d): kept as a bias from the next call on, unread (its "
                          "exact graph), while this configuration comes at no more than %d shapes",
                          STABLE_AFTER, shape[1], shape[2], STABLE_SHAPES)


def _configuration(bias, q) -> tuple:
    return (bias.dtype, bias.shape[0] == 1, bias.shape[1] == 1, q.dtype, q.shape[1], q.device)


def _candidate(bias, q, k) -> bool:
    """The host-side conditions: nothing read on the device."""
    if type(bias) is not torch.Tensor or bias.dim() != 4 or not bias.dtype.is_floating_point or bias.is_meta:
        return False
    s = q.shape[2]
    if s < 2 or k.shape[2] != s or tuple(bias.shape[2:]) != (s, s) or bias.numel() > MAX_ENTRIES:
        return False
    return bias.shape[0] in (1, q.shape[0]) and bias.shape[1] in (1, q.shape[1])


def _readable(bias, q) -> bool:
    """Whether the bias may be read now: not while compiling or capturing, and only where the length
    buckets are on (else an exact graph per length either way: keep the bias)."""
    if torch.compiler.is_compiling() or bias.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return folded.buckets_on(q.device)


def _read(bias: torch.Tensor) -> Padding | None:
    """The ``Padding`` of ``bias``'s own batch where it is a right-padding mask, else None: one read."""
    s = bias.shape[-1]
    allowed = bias == 0
    lengths = allowed[:, 0, -1, :].sum(-1, dtype=torch.int32)  # the last row sees every real key in both
    j = torch.arange(s, device=bias.device)
    keys = (j < lengths[:, None])[:, None, None, :]  # (B|1, 1, 1, S)
    only_0_or_masked = (allowed | (bias <= MASKED)).all()
    bidirectional = (allowed == keys).all()
    causal = (allowed == (keys & (j[None, :] <= j[:, None]))).all()
    flags = torch.stack([only_0_or_masked, (lengths > 0).all(), bidirectional, causal]).tolist()
    if not (flags[0] and flags[1]):
        return None
    if not (flags[2] or flags[3]):
        return None
    return Padding((-1, 0) if flags[3] else (-1, -1), torch.full_like(lengths, s), lengths)
