"""``attention()``: what F.scaled_dot_product_attention cannot say, on cuDNN, with autograd.

Dense (B, H, S, D) inputs of any strides, or packed (T, H, D) inputs with ``cu_seqlens``. Runs the
``cudnn_sdpa`` kernels (served calls and fallbacks are counted in the same telemetry, decided by
``route``) whether or not the provider is enabled; inside a strict scope a call that would fall
back raises FallbackError. Eager calls on plain tensors go through ``ops.DenseFunction`` /
``VarlenFunction`` (cheaper on the host; without autograd at all where no input needs a gradient:
their ``no_grad``); torch.compile(fullgraph=True), tracing, tensor subclasses
and functorch transforms see the custom ops ``cudnn_sdpa::*`` with their fake kernels. The
returned LSE carries no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .core import arguments, rows, scope, support
from .ops import composite, dense_varlen as ops, paged_ops, route  # noqa: F401  (cudnn_sdpa::*)

__all__ = ["attention"]


def attention(q, k, v, *, scale=None, is_causal=False, window=(-1, -1), bottom_right=False, sinks=None,
              seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
              max_seqlen_kv=None, dropout_p=0.0, return_lse=False, validate=None, block_table=None, kv_layout=None):
    """Scaled dot-product attention on cuDNN graphs, forward and backward.

    Args:
        q, k, v: dense (B, H, S, D) with any strides, or packed (T, H, D) with ``cu_seqlens_q``.
            H_q must be a multiple of H_k and H_v (GQA/MQA); D_qk may differ from D_v.
        scale: softmax scale, default 1/sqrt(D_qk).
        is_causal: causal mask (same as ``window=(-1, 0)``).
        window: FlashAttention ``(left, right)``; -1 is unbounded. A query at i sees keys
            i - left .. i + right (shifted to the bottom right when ``bottom_right``).
        bottom_right: align the diagonal to the end of each sequence (needed when S_q != S_kv
            in decoding); packed inputs are aligned per sequence.
        sinks: (H_q,) per-head sink logits (gpt-oss); they get a gradient.
        seq_lens_q, seq_lens_kv: (B,) int32 device lengths for padded dense batches, each in
            [0, S]. Outputs and gradients are 0 past each length.
        cu_seqlens_q, cu_seqlens_kv: (B+1,) int32 prefix sums from 0 for packed inputs
            (``cu_seqlens_kv`` defaults to ``cu_seqlens_q``); ``max_seqlen_q/kv`` are required
            host ints, at least the longest sequence (no device sync is made to find them).
        dropout_p: attention dropout (dense inputs). The forward draws a Philox (seed, offset) pair
            from torch's generator (``torch.manual_seed`` reproduces it) and its backward reuses it.
        return_lse: also return the log-sum-exp: (B, H, S_q, 1) dense, (T, H) packed, fp32.
        block_table: (B, M) int32 on q's device: k and v are then a paged KV cache of N blocks, in
            the order ``kv_layout`` names (required), with any strides; row b of the table lists
            sequence b's blocks in order, and
            ``seq_lens_kv`` (required) holds each sequence's cached tokens (at most M x block_size);
            q is dense (B, H_q, S_q, D) with ``seq_lens_q`` (default S_q), or packed (T, H_q, D) with
            ``cu_seqlens_q`` and ``max_seqlen_q`` (varlen_attn's form). Decode is S_q = 1; for
            chunked prefill, whose queries are each sequence's last tokens, pass ``is_causal=True,
            bottom_right=True``. Forward only: with inputs that require grad it runs a gather and
            the composite (counted as a fallback, ``paged_backward``; under torch.compile a graph
            break, so ``fullgraph=True`` refuses it). No dropout.
        kv_layout: with ``block_table`` (required there, refused without): ``"NHD"`` for caches
            (N, block_size, H_kv, D), FlashAttention's, vLLM's and torch varlen_attn's; ``"HND"``
            for (N, H_kv, block_size, D). No default: both fit the same shapes when block_size and
            H_kv both divide H_q, and a cache read in the wrong order gives wrong numbers silently.
        validate: check the values of lengths, prefix sums and block tables (ValueError naming the argument).
            None (default): where it is free, i.e. on CPU tensors; True: also on the GPU, at the
            cost of one host-device sync per call; False: never. Values are read only in eager code
            on real tensors, never while compiling or tracing. Unchecked out-of-range values on the
            GPU never read or write outside the tensors: their outputs are NaN.

    Example::

        >>> import torch, cudnn_sdpa_provider as csp
        >>> q = torch.randn(1, 2, 8, 16)
        >>> out = csp.attention(q, q, q, is_causal=True)
        >>> tuple(out.shape)
        (1, 2, 8, 16)
    """
    paged, packed = block_table is not None, cu_seqlens_q is not None
    k, v = _kv_views(q, k, v, kv_layout, paged)
    arguments.common(q, k, v, sinks, 3 if packed else 4, 4 if paged else None)
    window = arguments.window(is_causal, window)
    arguments.flag("bottom_right", bottom_right)
    arguments.flag("return_lse", return_lse)
    validate = arguments.validate_mode(validate)
    scale = arguments.scale(scale, q.shape[-1])
    dropout_p = arguments.dropout(dropout_p)
    check_values = (validate if validate is not None else q.device.type == "cpu") and arguments.readable(q)
    # Compiled code cannot read the scope while tracing; its kernels read it when they run.
    fallback = torch.compiler.is_compiling() or not scope.strict()
    c = _Common(scale, window, bottom_right, sinks, sinks.float() if sinks is not None else None, return_lse,
                fallback, check_values)
    if paged:
        return _paged(q, k, v, block_table, seq_lens_q, seq_lens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                      max_seqlen_kv, dropout_p, c)
    if packed:
        return _packed(q, k, v, seq_lens_q, seq_lens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       dropout_p, c)
    return _dense(q, k, v, seq_lens_q, seq_lens_kv, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, dropout_p, c)


class _Common(NamedTuple):
    """What ``attention`` checked the same way for every kind of call."""
    scale: float
    window: tuple[int, int]
    bottom_right: bool
    sinks: torch.Tensor | None
    sinks32: torch.Tensor | None
    return_lse: bool
    fallback: bool
    check_values: bool


def _kv_views(q, k, v, kv_layout, paged):
    """The kv_layout rule (required with block_table, refused without): NHD caches are served as HND
    views of the same storage. Their heads are checked here, before ``arguments.common``'s generic
    GQA check, so that a cache in the other layout is named as such."""
    if arguments.kv_layout(kv_layout, paged) == "NHD":
        k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (k, v))
    if paged:
        _paged_heads(q, k, v, kv_layout)
    return k, v


def _dense(q, k, v, seq_lens_q, seq_lens_kv, cu_kv, max_q, max_kv, dropout_p, c):
    """Dense (B, H, S, D) inputs, optionally padded (seq_lens): checks, then ``dense_fwd``."""
    if cu_kv is not None or max_q is not None or max_kv is not None:
        raise ValueError("cu_seqlens_kv / max_seqlen_q / max_seqlen_kv are for packed inputs; pass cu_seqlens_q too")
    if (seq_lens_q is None) != (seq_lens_kv is None):
        raise ValueError("pass both seq_lens_q and seq_lens_kv (padded batches), or neither")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0] or v.shape[2] != k.shape[2]:
        raise ValueError(f"batch/sequence sizes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if seq_lens_q is not None:
        given = seq_lens_q, seq_lens_kv  # checked as given: an int64 value is reported as it is, not clamped
        seq_lens_q = arguments.lengths("seq_lens_q", seq_lens_q, q.shape[0], q.device)
        seq_lens_kv = arguments.lengths("seq_lens_kv", seq_lens_kv, q.shape[0], q.device)
        if c.check_values:
            arguments.check_lengths("seq_lens_q", given[0], q.shape[2], "S_q")
            arguments.check_lengths("seq_lens_kv", given[1], k.shape[2], "S_kv")
    philox = rows.new_philox(q.device) if dropout_p > 0.0 else None
    eager = ops.eager(q, k, v, c.sinks, seq_lens_q, seq_lens_kv)
    grad = ops.grad_needed(q, k, v, c.sinks)
    fwd = torch.ops.cudnn_sdpa.dense_fwd if not eager else ops.DenseFunction.apply \
        if ops.autograd_needed(grad) else ops.DenseFunction.no_grad
    out, lse = fwd(q, k, v, c.sinks32, None, seq_lens_q, seq_lens_kv, philox, c.scale, dropout_p, c.window[0],
                   c.window[1], c.bottom_right, c.return_lse or grad, c.fallback)
    return (out, lse) if c.return_lse else out


def _packed(q, k, v, seq_lens_q, seq_lens_kv, cu_q, cu_kv, max_q, max_kv, dropout_p, c):
    """Packed (T, H, D) inputs with cu_seqlens: checks, then ``varlen_fwd``."""
    if dropout_p:
        raise ValueError("dropout_p is not supported with packed (cu_seqlens) inputs; use dense inputs")
    if seq_lens_q is not None or seq_lens_kv is not None:
        raise ValueError("seq_lens_q/seq_lens_kv are for padded dense inputs; packed inputs use cu_seqlens")
    given, cu_q, cu_kv, max_q, max_kv = arguments.packed_lengths(q, k, cu_q, cu_kv, max_q, max_kv)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    if c.check_values:
        arguments.check_cu_seqlens("cu_seqlens_q", given[0], q.shape[0], "max_seqlen_q", max_q)
        if cu_kv is not cu_q:
            arguments.check_cu_seqlens("cu_seqlens_kv", given[1], k.shape[0], "max_seqlen_kv", max_kv)
        elif k.shape[0] != q.shape[0] or max_kv < max_q:
            arguments.check_cu_seqlens("cu_seqlens_q (as cu_seqlens_kv)", given[1], k.shape[0], "max_seqlen_kv",
                                       max_kv)
    eager = ops.eager(q, k, v, c.sinks32, cu_q, cu_kv)
    fwd = torch.ops.cudnn_sdpa.varlen_fwd if not eager else ops.VarlenFunction.apply \
        if ops.autograd_needed(ops.grad_needed(q, k, v, c.sinks)) else ops.VarlenFunction.no_grad
    out, lse = fwd(q, k, v, cu_q, cu_kv, max_q, max_kv, c.sinks32, c.scale, c.window[0], c.window[1], c.bottom_right,
                   c.fallback)
    return (out, lse) if c.return_lse else out


def _paged(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, cu_q, cu_kv, max_q, max_kv, dropout_p, c):
    """A paged KV cache (block_table), q dense or packed: the paged refusals, then ``paged_fwd``
    (packed queries through a padded dense q)."""
    if cu_kv is not None or max_kv is not None:
        raise ValueError("cu_seqlens_kv / max_seqlen_kv are not used with block_table: the keys are the cache's, "
                         "seq_lens_kv (B,) says how many each sequence has")
    if dropout_p:
        raise ValueError("dropout_p is not supported with block_table (a paged KV cache is for inference)")
    if cu_q is not None:
        out, lse = _paged_packed(q, k_cache, v_cache, table, cu_q, max_q, seq_lens_q, seq_lens_kv, c)
    elif max_q is not None:
        raise ValueError("max_seqlen_q is for packed queries; pass cu_seqlens_q too, or seq_lens_q for a dense q")
    else:
        out, lse = _paged_dense(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, c)
    return (out, lse) if c.return_lse else out


def _paged_heads(q, k_cache, v_cache, kv_layout):
    """H_q must be a multiple of the caches' H_kv, read where ``kv_layout`` says: a cache in the other
    layout usually fails here, and the message says which dim was read."""
    if not (isinstance(q, torch.Tensor) and q.dim() in (3, 4)
            and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k_cache, v_cache))):
        return  # arguments.common names the wrong type or rank
    h_q, dim = q.shape[1], 2 if kv_layout == "NHD" else 1
    for name, cache in (("k", k_cache), ("v", v_cache)):
        h_kv = cache.shape[1]  # the HND view
        if h_kv == 0 or h_q % h_kv:
            stored = tuple(cache.transpose(1, 2).shape) if kv_layout == "NHD" else tuple(cache.shape)
            raise ValueError(f"H_q={h_q} must be a multiple of the cache's H_kv={h_kv}, read from dim {dim} of "
                             f"{name} {stored}, kv_layout={kv_layout!r} being {arguments.KV_LAYOUTS[kv_layout]}; "
                             f"is the cache in the other layout?")


def _paged_dense(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, c):
    """Dense (B, H, S_q, D) queries over a paged cache: checks, then ``paged_fwd`` (or, with grad, the composite)."""
    b, s_q = q.shape[0], q.shape[2]
    given = table  # values are checked as given: an int64 entry of 2**33 is reported as 2**33, not clamped
    table = arguments.block_table(table, b, q.device)
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[2] != v_cache.shape[2]:
        raise ValueError(f"k and v caches must have the same blocks (N, ., block_size, .), got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if seq_lens_kv is None:
        raise ValueError("block_table needs seq_lens_kv: (B,) int32, each sequence's number of cached tokens")
    given = given, seq_lens_q, seq_lens_kv
    seq_lens_kv = arguments.lengths("seq_lens_kv", seq_lens_kv, b, q.device)
    if seq_lens_q is None:
        seq_lens_q = torch.full((b,), s_q, dtype=torch.int32, device=q.device)
    seq_lens_q = arguments.lengths("seq_lens_q", seq_lens_q, b, q.device)
    if c.check_values:
        arguments.check_lengths("seq_lens_q", seq_lens_q if given[1] is None else given[1], s_q, "S_q")
        arguments.check_lengths("seq_lens_kv", given[2], table.shape[1] * k_cache.shape[2], "M x block_size")
        arguments.check_block_table(given[0], seq_lens_kv, k_cache.shape[0], k_cache.shape[2])
    sinks32 = c.sinks32
    if ops.grad_needed(q, k_cache, v_cache, sinks32):
        return _paged_with_grad(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, sinks32, c.scale, c.window,
                                c.bottom_right)
    eager = ops.eager(q, k_cache, v_cache, sinks32, table, seq_lens_q, seq_lens_kv)
    fwd = paged_ops.run_eager[q.device.type] if eager else torch.ops.cudnn_sdpa.paged_fwd
    return fwd(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, sinks32, c.scale, c.window[0], c.window[1],
               c.bottom_right, c.return_lse, c.fallback)


def _paged_packed(q, k_cache, v_cache, table, cu_q, max_q, seq_lens_q, seq_lens_kv, c):
    """Packed (T, H, D) queries over a paged cache: placed in a padded (B, H, max_seqlen_q, D) batch,
    attended as a dense q, and gathered back (copies of q and out only; the cache is read in place)."""
    if seq_lens_q is not None:
        raise ValueError("seq_lens_q is for a dense q; packed queries take their lengths from cu_seqlens_q")
    given = cu_q
    cu_q = arguments.cu_seqlens("cu_seqlens_q", cu_q, q.device)
    max_q = arguments.max_seqlen("max_seqlen_q", max_q, q.shape[0], "q")
    if c.check_values:
        arguments.check_cu_seqlens("cu_seqlens_q", given, q.shape[0], "max_seqlen_q", max_q)
    q_padded, lens_q, index, bad = paged_ops.pack_query(q, cu_q, max_q)
    out, lse = _paged_dense(q_padded, k_cache, v_cache, table, lens_q, seq_lens_kv, c)
    return paged_ops.unpack(out, lse if c.return_lse else None, index, bad, q)
@torch.compiler.disable  # eager even inside compiled code (a graph break), so that each call is counted
def _paged_with_grad(q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, sinks32, scale, window, bottom_right):
    """A paged call that needs grad: the differentiable composite (cuDNN's paged graph has no backward)."""
    found = paged_ops.entry(q, k_cache, v_cache, table, sinks32, window, bottom_right, grad=True)
    return route.call("paged_fwd", found, None, lambda reason: composite.paged_fwd(
        q, k_cache, v_cache, table, seq_lens_q, seq_lens_kv, sinks32, scale, window, bottom_right),
        lambda: route.describe_call(q=q, k_cache=k_cache, block_table=table, window=window, bottom_right=bottom_right),
        strict=scope.strict())  # read when it runs: this function is never traced
