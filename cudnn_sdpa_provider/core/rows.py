"""Rows whose value is fixed by definition, and the small device-side terms around a cuDNN call.

All device-side, no host sync: rows of padded or keyless queries (0 by definition, cuDNN leaves
them unspecified), lengths that are out of range (their rows are poisoned with NaN instead of being
computed as something else: lengths are never read on the host), the sink gradient, and dropout's
Philox pair. A padded call's length terms (``safe_lengths``, ``padded_dead_rows``) are kept on
lengths the package made itself (``length_terms``).
"""

from __future__ import annotations

import torch

from . import length_terms

__all__ = ["dead_rows", "padded_dead_rows", "none_dead", "safe_lengths", "rows_past", "bad_lengths", "bad_packed_lengths", "paged_guard", "paged_dead_rows", "token_rows", "fill_words", "fill",
           "padded_lse", "sink_grad_dense", "sink_grad_packed", "new_philox"]


def dead_rows(s_q: int, s_kv: int, window, bottom_right: bool, seq_len_q=None, seq_len_kv=None, device=None):
    """(B|1, 1, S_q, 1) bool of query rows whose output is 0 by definition: padded rows, and rows
    that see no key at all (a window or alignment that excludes every key, or kv length 0). cuDNN
    leaves such rows unspecified (NaN before 9.25; with sinks, a wrong contribution to dSink).
    None when the shapes alone prove every row sees a key."""
    left, right = window
    if seq_len_q is None:
        off = s_kv - s_q if bottom_right else 0
        first_dead = right >= 0 and off + right < 0
        last_dead = left >= 0 and (s_q - 1) + off - left > s_kv - 1
        if not (first_dead or last_dead):
            return None
        lq = torch.full((1, 1), s_q, device=device)  # a fill kernel: torch.tensor would copy (and sync)
        lk = torch.full((1, 1), s_kv, device=device)
    else:
        lq, lk = seq_len_q.view(-1, 1).long(), seq_len_kv.view(-1, 1).long()
    i = torch.arange(s_q, device=device).view(1, -1)
    off = (lk - lq) if bottom_right else torch.zeros_like(lk)
    lo = (i + off - left).clamp(min=0) if left >= 0 else torch.zeros_like(i + off)
    hi = torch.minimum(i + off + right, lk - 1) if right >= 0 else (lk - 1).expand_as(i + off)
    live = (i < lq) & (lo <= hi)
    return (~live).view(live.shape[0], 1, s_q, 1)


def padded_dead_rows(s_q: int, s_kv: int, window, bottom_right: bool, seq_len_q, seq_len_kv, device):
    """``dead_rows`` of a padded call, kept on lengths the package made (``length_terms``): a
    forward's mask serves its backward and the other layers' calls."""
    return length_terms.get(seq_len_q, seq_len_kv, ("dead", s_q, s_kv, window, bottom_right), lambda: dead_rows(
        s_q, s_kv, window, bottom_right, seq_len_q, seq_len_kv, device))


def none_dead(s_q: int, s_kv: int, window, bottom_right: bool, seq_len_q, seq_len_kv) -> bool:
    """Whether a padded call is known, with no device work, to have no row that is 0 by definition
    and no length out of range (its ``safe_lengths`` flag all False): its lengths' maker read that
    every query length is S_q and every key length is in [1, S_kv] (``length_terms.full``), and the
    mask is top-left with no left bound, so every query row is real and sees key 0, which every
    sequence has. Such a call needs no forward row fix and no dQ row fill."""
    return window[0] < 0 and not bottom_right and length_terms.full(seq_len_q, seq_len_kv, s_q, s_kv)


def safe_lengths(seq_len_q, seq_len_kv, s_q: int, s_kv: int):
    """(lengths cuDNN is given, bad): a batch row whose lengths are outside [0, S] is given lengths 0,
    so cuDNN computes nothing for it, and ``bad`` (B, 1, 1, 1) makes its output NaN afterwards;
    (None, None, None) without lengths. Kept on lengths the package made (``length_terms``); lengths
    whose maker read them in range (``length_terms.full``) are given as they are, with ``bad`` all False."""
    if seq_len_q is None:
        return None, None, None

    def make():
        if length_terms.full(seq_len_q, seq_len_kv, s_q, s_kv):
            return seq_len_q, seq_len_kv, torch.zeros((seq_len_q.shape[0], 1, 1, 1), dtype=torch.bool,
                                                      device=seq_len_q.device)
        bad = bad_lengths(seq_len_q, seq_len_kv, s_q, s_kv)
        flat = bad.view(-1)
        return torch.where(flat, 0, seq_len_q), torch.where(flat, 0, seq_len_kv), bad

    return length_terms.get(seq_len_q, seq_len_kv, ("safe", s_q, s_kv), make)


def rows_past(lengths: torch.Tensor, s: int) -> torch.Tensor:
    """(B, 1, s, 1) bool: row index >= length."""
    rows = torch.arange(s, device=lengths.device, dtype=lengths.dtype)
    return (rows[None, :] >= lengths[:, None]).view(lengths.shape[0], 1, s, 1)


def bad_lengths(seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor, s_q: int, s_kv: int) -> torch.Tensor:
    """(B, 1, 1, 1) bool: batch rows whose lengths are outside [0, S] (never read on the host)."""
    bad = (seq_len_q < 0) | (seq_len_q > s_q) | (seq_len_kv < 0) | (seq_len_kv > s_kv)
    return bad.view(-1, 1, 1, 1)


def _packed_bad(cu: torch.Tensor, lens: torch.Tensor, tokens: int, max_len: int) -> torch.Tensor:
    low, high = torch.aminmax(lens)
    return (low < 0) | (high > max_len) | (cu[0] != 0) | (cu[-1] > tokens)


def bad_packed_lengths(cu_q, lens_q, cu_kv, lens_kv, tokens_q: int, tokens_kv: int, max_q: int, max_kv: int):
    """0-dim bool: cu_seqlens that do not start at 0, decrease, run past the packed tokens, or hold
    a sequence longer than its max_seqlen. The caller then gives cuDNN zero lengths (it reads and
    writes nothing) and poisons the outputs, so an out-of-range length can never reach memory
    outside the tensors and is never computed as something else. ``cu_kv is cu_q``: one check
    against the tighter of the two bounds."""
    if cu_kv is cu_q:
        return _packed_bad(cu_q, lens_q, min(tokens_q, tokens_kv), min(max_q, max_kv))
    return _packed_bad(cu_q, lens_q, tokens_q, max_q) | _packed_bad(cu_kv, lens_kv, tokens_kv, max_kv)


def paged_guard(table: torch.Tensor, seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor, blocks: int,
                block_size: int, s_q: int):
    """(safe table, safe seq_len_q, safe seq_len_kv, bad (B, 1, 1, 1)) for a paged KV call.

    A batch row is bad when a length is outside [0, S_q] / [0, M x block_size] or when one of the
    table entries its keys use (the first ceil(seq_len_kv / block_size)) is outside [0, blocks).
    Every entry is brought into [0, blocks) (the kernel may read entries past a sequence's keys),
    and a bad row's lengths become 0 (nothing of it is read or computed; the caller makes its output
    NaN): a wrong table can never read outside the cache, and is never computed as something else.
    About a dozen small kernels (decode's eager cost; a CUDA graph replays them for nothing)."""
    m = table.shape[1]
    safe_table = table.clamp(0, blocks - 1)
    used = torch.arange(0, m * block_size, block_size, device=table.device, dtype=seq_len_kv.dtype)
    bad = ((safe_table != table) & (used < seq_len_kv.view(-1, 1))).any(dim=1)
    bad |= (seq_len_q.clamp(0, s_q) != seq_len_q) | (seq_len_kv.clamp(0, m * block_size) != seq_len_kv)
    return safe_table, torch.where(bad, 0, seq_len_q), torch.where(bad, 0, seq_len_kv), bad.view(-1, 1, 1, 1)


def paged_dead_rows(s_q: int, window, bottom_right: bool, seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor):
    """``dead_rows`` for a paged call, with fewer kernels where the window is unbounded (decode's
    usual call: only rows past seq_len_q and sequences without keys are dead)."""
    if window == (-1, -1):
        rows = torch.arange(s_q, device=seq_len_q.device, dtype=seq_len_q.dtype)
        live = (rows < seq_len_q.view(-1, 1)) & (seq_len_kv.view(-1, 1) > 0)
        return ~live.view(-1, 1, s_q, 1)
    return dead_rows(s_q, 0, window, bottom_right, seq_len_q, seq_len_kv, seq_len_q.device)


def token_rows(cu: torch.Tensor, total: int, s_max: int):
    """(row, pos, lengths, bad) placing packed tokens in a padded (B + 1, S_max) batch: token t of
    sequence b goes to (b, t - cu[b]); tokens past cu[-1], and every token when ``bad`` (0-dim:
    cu not starting at 0, decreasing, past ``total`` tokens, or a sequence longer than ``s_max``),
    go to the spare row B, position 0. Every index is in range whatever ``cu`` holds (no device
    assert can fire); ``lengths`` (B,) int32 are 0 when bad."""
    batch = cu.shape[0] - 1
    cu64 = cu.long()
    lengths = cu64.diff()
    bad = (cu64[0] != 0) | (cu64[-1] > total) | (lengths.amin() < 0) | (lengths.amax() > s_max)
    tok = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu64[1:], tok, right=True)
    pos = tok - cu64[row.clamp(max=batch - 1)]
    valid = (row < batch) & ~bad & (pos >= 0) & (pos < s_max)
    return (torch.where(valid, row, batch), torch.where(valid, pos, 0), torch.where(bad, 0, lengths).to(torch.int32),
            bad)


#: Four NaNs of each dtype as one int64 word (quiet NaN bit patterns; all below 2**63).
_NAN_WORDS = {torch.bfloat16: 0x7FC0_7FC0_7FC0_7FC0, torch.float16: 0x7E00_7E00_7E00_7E00,
              torch.float32: 0x7FC0_0000_7FC0_0000}


def fill_words(bad: torch.Tensor, dtype) -> torch.Tensor | None:
    """0-dim int64 on ``bad``'s device: 8 bytes of NaN of ``dtype`` where ``bad``, else 8 zero
    bytes (None for a dtype without a pattern here)."""
    word = _NAN_WORDS.get(dtype)
    return None if word is None else torch.where(bad, word, 0)


def fill(buf: torch.Tensor, value: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    """Fill ``buf`` with the 0-dim device ``value`` (0 or NaN, read on the device, no sync).

    A fill from a device scalar is a broadcast copy; on a 2-byte dtype it moves 2 bytes per
    element, well under the memory's write bandwidth (docs/performance-notes.md, "Varlen"). A
    contiguous ``buf`` covers one dense byte range, so where that range is whole int64 words at an
    8-byte-aligned start, the same bytes are written as ``words`` (``fill_words``) through a flat
    int64 view of the range, a quarter of the elements. Returns ``buf``."""
    size = buf.element_size()
    if (words is not None and buf.numel() > 0 and buf.is_contiguous() and (buf.numel() * size) % 8 == 0
            and (buf.storage_offset() * size) % 8 == 0 and buf.data_ptr() % 8 == 0):
        # flat: a contiguous tensor's size-1 dims may carry any stride, which view(int64) rejects
        buf.as_strided((buf.numel(),), (1,)).view(torch.int64).fill_(words)
    else:
        buf.fill_(value)
    return buf


def padded_lse(lse: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, s_max: int) -> torch.Tensor:
    """Packed (T, H) fp32 log-sum-exp as a padded (B, H, S_max, 1) contiguous tensor for a ragged
    backward graph: [b, :, p] is row ``starts[b] + p`` of ``lse`` for p < ``lengths[b]``, else 0.
    A gather (deterministic, device-side, no sync); rows past the last sequence are never read.
    ``starts``/``lengths`` (B,) must describe valid sequences of at most ``s_max`` tokens (a checked
    call's safe ones: all 0 when a length was out of range, which gives all 0 here)."""
    t, h = lse.shape
    batch = starts.shape[0]
    if t == 0 or batch == 0:
        return torch.zeros((batch, h, s_max, 1), dtype=torch.float32, device=lse.device)
    pos = torch.arange(s_max, device=lse.device, dtype=torch.int64)
    rows = (starts.view(-1, 1).long() + pos).clamp_(max=t - 1)  # (B, S_max) token indices
    gathered = lse.t()[:, rows.view(-1)].view(h, batch, s_max)  # (H, B, S_max)
    live = (pos < lengths.view(-1, 1).long()).view(1, batch, s_max)
    return torch.where(live, gathered, 0.0).transpose(0, 1).contiguous().unsqueeze(-1)


def sink_grad_dense(sinks, lse, out, grad_out) -> torch.Tensor:
    """dSink[h] = -sum over b, i of p_sink * rowsum(dO * O), p_sink = exp(sink[h] - lse[b, h, i]).

    Computed here instead of read from cuDNN's dSink_token: cuDNN 9.19's dSink is wrong for a padded
    batch whose band window leaves query rows without any visible key (tests/gpu/test_reliability.py
    keeps the case). Rows whose output is 0 (padded, keyless) contribute exactly 0, whatever their
    LSE holds, as the definition says."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (B, H, S_q)
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse.view(delta.shape))
    return -torch.where(delta == 0, torch.zeros_like(delta), p_sink * delta).sum(dim=(0, 2))


def sink_grad_packed(sinks, lse, out, grad_out) -> torch.Tensor:
    """The same for packed (T, H) rows."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (T, H)
    p_sink = torch.exp(sinks.float().view(1, -1) - lse)
    return -torch.where(delta == 0, torch.zeros_like(delta), p_sink * delta).sum(dim=0)


def new_philox(device: torch.device, n: int = 2) -> torch.Tensor:
    """Random int64 words for dropout's Philox (seed, offset), drawn from torch's generator on
    ``device`` (``torch.manual_seed`` reproduces them; device-side, no sync, capturable in CUDA
    graphs). Callers take the pair they need (the provider uses elements 0 and 2, see overrides)."""
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)
