"""The folded graphs' small device tensors (sequence lengths, ragged offsets): kept by value,
uploaded together.

A folded binding (``folded``) reads a handful of small int32 tensors: the lengths of its folds and
the ragged offset of each operand's folds. Each is a constant of its value (never written after it
is made), so they are kept per thread and per stream by value: a new length reuses what did not
change. What is missing is written on the host and copied to the device in ONE copy (pinned
memory, stream-ordered), each tensor a 16-byte-aligned view of that copy: GPU run 56's profile of
new decode lengths spent about 75 us per separate upload (``torch.tensor``, ``pin_memory``, the
copy), and a new prefill length needed four.

Decode walks its length up one token a step. When a decode binding misses its KV length, the
lengths and the K/V offsets of the next ``AHEAD`` lengths inside the bucket are uploaded in the
same copy (``ahead``), for K/V caches whose strides follow from their length (a contiguous
(B, H, S, D) cache, as HF's DynamicCache concatenates, or token-major (B, S, H, D) seen through
``transpose(1, 2)``): the next steps then find them in the cache. A self-attention binding (prefill,
training: S_q = S_kv) that misses its length uploads the lengths and offsets of every length of its
chunk (``CHUNK`` lengths, ``chunk``) the same way, so the chunk's other lengths, in whatever order
they come, upload nothing. A guess that does not come true costs a few hundred bytes; every entry
is correct for its key, whatever call finds it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..core import layout

__all__ = ["SMALL_KEPT", "AHEAD", "CHUNK", "BLOCK_VALUES", "stream_of", "upload_mark", "fold_strides", "length_key",
           "length_request", "offsets_request", "operand", "operand_at", "resolve", "ahead", "chunk", "kept", "clear",
           "layout_of", "strides", "follows", "spec"]

#: How many small device tensors each thread keeps (LRU); bindings hold the tensors they use, so an
#: eviction frees nothing a binding still needs.
SMALL_KEPT = 8192
#: Decode lengths uploaded ahead of the one a binding misses (``ahead``).
AHEAD = 32
#: Self-attention lengths uploaded together when a binding misses one of them (``chunk``).
CHUNK = 32
#: The most int32 values one block of look-ahead or chunk rows may hold (256 KiB).
BLOCK_VALUES = 1 << 16
_PER = layout.ALIGN // 4  # int32 values per 16 bytes: every view starts 16-byte aligned
_INT32_MAX = 2**31 - 1
_tls = threading.local()


def _cache() -> OrderedDict:
    cache = getattr(_tls, "small", None)
    if cache is None:
        cache = _tls.small = OrderedDict()
    return cache


def kept():
    """This thread's tensors by key (read-only use: membership)."""
    return _cache()


def clear() -> None:
    """Forget this thread's tensors (bindings keep theirs)."""
    _tls.small = OrderedDict()


def upload_mark(device, stream: int):
    """The CUDA event recorded on ``stream`` right after this thread's latest upload there (``_upload``);
    None before the first. Every tensor this thread keeps for that stream was copied before it."""
    return getattr(_tls, "marks", {}).get((device, stream))


def stream_of(device) -> int:
    """The raw current stream of ``device`` (0 off CUDA)."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def fold_strides(shape, stride, itemsize: int, h_kv: int, groups: int) -> tuple[int, int]:
    """(batch stride, KV-group stride) of an operand of this shape and stride, in elements, as its
    offsets use them. A size-1 dim's stride is arbitrary in PyTorch: a single KV group's is 0 (never
    stepped), a single batch row's is its groups' extent (the end offset)."""
    sg = stride[1] * groups if h_kv > 1 else 0
    if shape[0] > 1:
        return stride[0], sg
    per = layout.ALIGN // itemsize
    extent = (shape[1] - 1) * stride[1] + (shape[2] - 1) * stride[2] + (shape[3] - 1) * stride[3] + 1  # 4-D
    return max(h_kv * sg, -(-extent // per) * per), sg


def length_key(n: int, s: int, device, stream: int) -> tuple:
    """The key of the (n, 1, 1, 1) lengths tensor whose every entry is ``s``."""
    return ("len", device, stream, n, s)


def _offsets_key(device, stream: int, n: int, h_kv: int, sb: int, sg: int) -> tuple:
    return ("off", device, stream, n, h_kv, sb, sg)


def length_request(n: int, s: int, device, stream: int):
    """(key, values) of the (n, 1, 1, 1) lengths tensor whose every entry is ``s``."""
    return length_key(n, s, device, stream), (lambda: [s] * n)


def offsets_request(t: torch.Tensor, h_kv: int, groups: int, stream: int):
    """(key, values) of the (n + 1, 1, 1, 1) ragged offsets of ``t``'s folds, n = B * H_kv: fold
    i = b * H_kv + g starts at b * stride_b + g * stride_g; the last entry, B * stride_b, is the end."""
    return operand(t, h_kv, groups, stream)[1]


def operand(t: torch.Tensor, h_kv: int, groups: int, stream: int):
    """(end, request): the element one past the last that ``t``'s folds reach from its base (the
    ragged offsets are int32: callers check it), and ``offsets_request``'s (key, values)."""
    return _operand(t.shape, t.stride(), t.element_size(), h_kv, groups, t.device, stream)


def operand_at(spec: tuple, s: int, h_kv: int, device, stream: int):
    """``operand``'s (end, request) for the operand that ``spec`` (``spec``) describes, at length
    ``s``, from arithmetic alone: no tensor is made or looked at. ``strides`` and ``fold_strides``
    written out (a new length's binding computes it for every operand: ``fold_family.rebind``);
    tests/test_fold_values.py compares it with ``operand`` on tensors of both layouts."""
    kind, b, h, d, item, groups = spec
    if kind == "bhsd":
        s_b, s_h, s_s = h * s * d, s * d, d
    else:
        s_b, s_h, s_s = s * h * d, d, h * d
    sg = s_h * groups if h_kv > 1 else 0
    tail = (h - 1) * s_h + (s - 1) * s_s + d  # the last element of one batch row, plus one (stride(3) is 1)
    if b > 1:
        sb = s_b
    else:
        per = layout.ALIGN // item
        sb = max(h_kv * sg, -(-tail // per) * per)
    n = b * h_kv
    return b * sb + tail, (
        ("off", device, stream, n, h_kv, sb, sg), (lambda: _offsets(n, h_kv, sb, sg)))


def _operand(shape, stride, item: int, h_kv: int, groups: int, device, stream: int):
    sb, sg = fold_strides(shape, stride, item, h_kv, groups)
    n = shape[0] * h_kv
    end = shape[0] * sb + (shape[1] - 1) * stride[1] + (shape[2] - 1) * stride[2] + (shape[3] - 1) * stride[3] + 1
    return end, (_offsets_key(device, stream, n, h_kv, sb, sg), (lambda: _offsets(n, h_kv, sb, sg)))


def _offsets(n: int, h_kv: int, sb: int, sg: int) -> list:
    """The offsets of folds 0..n for strides (sb, sg), the formula ``_offset_rows`` applies to many
    rows at once (plain ints: a handful of tensor ops on a few ints cost tens of us each call)."""
    return [(i // h_kv) * sb + (i % h_kv) * sg for i in range(n + 1)]


def _offset_rows(n: int, h_kv: int, sb, sg) -> torch.Tensor:
    """(len(sb), n + 1) int64: row j holds ``_offsets(n, h_kv, sb[j], sg[j])``."""
    i = torch.arange(n + 1, dtype=torch.int64)
    sb, sg = (torch.tensor(x, dtype=torch.int64)[:, None] for x in (sb, sg))
    return (i // h_kv)[None, :] * sb + (i % h_kv)[None, :] * sg


def layout_of(t: torch.Tensor) -> str | None:
    """``"bhsd"`` (contiguous), ``"bshd"`` (token-major, seen through ``transpose(1, 2)``) or None: the
    layouts whose strides follow from their length alone (``follows``; ``"bhsd"`` where both do)."""
    shape, got = t.shape, t.stride()
    if _follows(shape, got, "bhsd"):
        return "bhsd"
    return "bshd" if _follows(shape, got, "bshd") else None


def strides(kind: str, h: int, s: int, d: int) -> tuple:
    """The strides of a dense (B, h, s, d) tensor of layout ``kind`` (``layout_of``)."""
    return (h * s * d, s * d, d, 1) if kind == "bhsd" else (s * h * d, d, h * d, 1)


def follows(t: torch.Tensor, kind: str) -> bool:
    """Whether ``t``'s strides are those of layout ``kind`` at its shape (``strides``) at every dim
    of extent above 1 (a size-1 dim's stride is arbitrary in PyTorch and never stepped)."""
    return _follows(t.shape, t.stride(), kind)


def _follows(shape, got, kind: str) -> bool:
    # ``strides`` compared dim by dim, written out: a new length's binding checks every operand
    b, h, s, d = shape
    if d > 1 and got[3] != 1:
        return False
    if kind == "bhsd":
        return (s <= 1 or got[2] == d) and (h <= 1 or got[1] == s * d) and (b <= 1 or got[0] == h * s * d)
    return (h <= 1 or got[1] == d) and (s <= 1 or got[2] == h * d) and (b <= 1 or got[0] == s * h * d)


def spec(t: torch.Tensor, groups: int) -> tuple | None:
    """(layout, B, H, D, element size, groups) of an operand whose strides follow from its length
    (``layout_of``), or None: what ``operand_at`` and ``chunk`` compute its offsets at any length from."""
    kind = layout_of(t)
    return None if kind is None else (kind, t.shape[0], t.shape[1], t.shape[3], t.element_size(), groups)


def ahead(kv: tuple, n: int, h_kv: int, s_kv: int, bucket: int, device, stream: int) -> list:
    """Blocks (keys, (rows, width) int32 values) of the decode lengths after ``s_kv`` (up to ``AHEAD``
    of them, inside ``bucket``): their lengths, and the offsets of each K/V tensor whose strides
    follow from its length (``resolve`` uploads them with its requests)."""
    lengths = list(range(s_kv + 1, min(s_kv + AHEAD, bucket) + 1))
    return _blocks(lengths, [spec(t, 1) for t in kv], n, h_kv, device, stream)


def chunk(specs, n: int, h_kv: int, s: int, bucket: int, device, stream: int) -> list:
    """Blocks of every length of ``s``'s chunk (the ``CHUNK`` lengths ``c * CHUNK + 1 ..
    (c + 1) * CHUNK`` that hold ``s``, inside ``bucket``): their lengths, and the offsets of each
    operand of ``specs`` (``spec``; None entries are left out), with S_q = S_kv = that length
    (self-attention: prefill, training). Uploaded when a binding misses ``s``'s lengths, so later
    lengths of the chunk, in any order, upload nothing."""
    lo = (s - 1) // CHUNK * CHUNK + 1
    return _blocks(list(range(lo, min(lo + CHUNK - 1, bucket) + 1)), specs, n, h_kv, device, stream)


def _blocks(lengths: list, specs, n: int, h_kv: int, device, stream: int) -> list:
    """The lengths block of ``lengths`` and one offsets block per distinct operand of ``specs``
    (None entries left out), each row that operand's offsets at that length. None where the rows
    would pass ``BLOCK_VALUES`` values (so many folds: each length then uploads its own)."""
    if not lengths or len(lengths) * (n + 1) > BLOCK_VALUES:
        return []
    blocks = [([length_key(n, s, device, stream) for s in lengths],
               torch.tensor(lengths, dtype=torch.int32)[:, None].expand(len(lengths), n))]
    seen = set()
    for op in specs:
        if op is None:
            continue
        kind, b, h, d, item, groups = op
        pair = lambda s: fold_strides((b, h, s, d), strides(kind, h, s, d), item, h_kv, groups)  # noqa: E731
        first = _offsets_key(device, stream, n, h_kv, *pair(lengths[0]))
        if first in seen:
            continue  # another operand with the same strides (K and V, Q and O): the same rows
        seen.add(first)
        pairs = [pair(s) for s in lengths]
        keys = [_offsets_key(device, stream, n, h_kv, sb, sg) for sb, sg in pairs]
        sb, sg = zip(*pairs)
        rows = _offset_rows(n, h_kv, sb, sg)
        fits = rows.amax(dim=1) <= _INT32_MAX  # a longer length's offsets may pass int32: not kept
        if not bool(fits.all()):
            keys, rows = [key for key, ok in zip(keys, fits.tolist()) if ok], rows[fits]
        if keys:
            blocks.append((keys, rows.to(torch.int32)))
    return blocks


def resolve(requests: list, device, blocks: list = ()) -> dict:
    """{key: (m, 1, 1, 1) int32 tensor on ``device``} for every (key, values) request: from this
    thread's cache, or, for the missing ones, from one copy of their values together with
    ``blocks`` (``ahead``'s guesses, kept whether or not an equal tensor was kept already)."""
    cache = _cache()
    found: dict = {}
    missing: dict = {}
    for key, values in requests:
        if key in found or key in missing:
            continue
        t = cache.get(key)
        if t is None:
            missing[key] = values
        else:
            cache.move_to_end(key)
            found[key] = t
    if missing or blocks:
        covered = {key for keys, _ in blocks for key in keys}
        made = _upload({key: values() for key, values in missing.items() if key not in covered}, blocks, device)
        cache.update(made)
        found.update((key, made[key]) for key in missing)
        while len(cache) > SMALL_KEPT:
            cache.popitem(last=False)
    return found


def _padded(m: int) -> int:
    return -(-m // _PER) * _PER


def _upload(values: dict, blocks, device) -> dict:
    """The values (lists of ints) and the blocks' rows as device tensors, views of one buffer written
    on the host (pinned memory, from torch's caching host allocator, which keeps the block until the
    copy is done) and copied in stream order: one copy, no kernel."""
    spans, head = {}, []
    for key, v in values.items():
        spans[key] = (len(head), len(v))
        head += v
        head += [0] * (_padded(len(v)) - len(v))
    placed, total = [], len(head)
    for keys, block in blocks:
        width = _padded(block.shape[1])
        placed.append((keys, block, total, width))
        total += len(keys) * width
    host = torch.empty(total, dtype=torch.int32, pin_memory=device.type == "cuda")
    if head:
        host[:len(head)] = torch.tensor(head, dtype=torch.int32)
    for keys, block, start, width in placed:
        host[start:start + len(keys) * width].view(len(keys), width)[:, :block.shape[1]] = block
    if device.type == "cuda":
        flat = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        marks = getattr(_tls, "marks", None)
        if marks is None:
            marks = _tls.marks = {}
        marks[(device, stream_of(device))] = event
    else:
        flat = host.to(device)
    made = {key: flat[start:start + m].view(-1, 1, 1, 1) for key, (start, m) in spans.items()}
    for keys, block, start, width in placed:
        rows = flat[start:start + len(keys) * width].view(len(keys), width)[:, :block.shape[1]]
        made.update(zip(keys, rows.unsqueeze(-1).unsqueeze(-1).unsqueeze(-1).unbind(0)))  # one op for every row
    return made
