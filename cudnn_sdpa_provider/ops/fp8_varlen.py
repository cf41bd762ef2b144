"""FP8 attention on packed (varlen) inputs: op ``cudnn_sdpa::fp8_varlen_fwd`` and its autograd.

Forward (path ``fp8_fwd``): cuDNN's FP8 graph with ragged offsets (``engine.fp8_packed``), or,
with a reason, the FP8 reference (``fp8_reference``) on the padded form; CPU kernels always run
the reference (reason ``no_cuda``).

Backward (path ``fp8_bwd``): cuDNN has no packed FP8 backward on Hopper (9.19 refuses it: "sdpa
fp8 backward with THD is not supported on Hopper architecture", results/gpu-run57-fp8-varlen-probe.json).
So the backward places the packed FP8 q, k, v, O, dO and the LSE in the padded (B, H, S_max, D)
form at the forward graph's dims (``fp8_packed.buckets``), hands them to ``fp8_ops``'s dense
backward op with the lengths as its padding mask (decided, re-run and counted exactly as a dense
padded call: the recipe's gradient scales, its reasons, strict mode), and gathers dq, dk, dv back
to (T, H, D). The price is memory and two gathers: the padded tensors hold B x S_max rows instead
of T. On cuDNN 9.14+ on sm_90+ that op runs the FP8 reference (``cudnn_known_issue``): cuDNN 9.19's
FP8 backward with a padding mask gave wrong dK/dV (``core.known_issues``, run 65). Its served route,
the dense FP8 graph on the padded form, is kept (CPU-tested) for a release the table stops covering.

Placement: token t of sequence b sits at (b, t - cu[b]). Every index stays in range whatever
cu_seqlens holds; out-of-range cu_seqlens, or ones that end short of the packed tokens, give zero
lengths and NaN outputs and gradients (``packed._Lengths``, ``whole``).

Zero lengths never reach cuDNN: its FP8 graphs fault or hang on them (cuDNN 9.19, sm_90;
``core.known_issues``). The forward reads the lengths first (one host sync a call,
``fp8_ops.empty_sequence``) and runs the reference on a call with an empty sequence, a user's own
or one that bad cu_seqlens make (``cudnn_known_issue``); the backward's dense op does the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import rows, scope, support
from ..engine import fp8_packed
from ..engine.packed import _Lengths
from . import fp8_ops, fp8_reference, route
from . import dense_varlen as ops

__all__ = ["fp8_varlen_fwd", "Placement", "problem", "attention"]

E4M3 = torch.float8_e4m3fn
_ON_CPU = route.fixed("no_cuda", "inputs are on the CPU")


class Placement:
    """Where one call's packed tokens sit in the padded (B, H, S, D) form at the graph's buckets:
    ``n`` (``packed._Lengths``: safe cu_seqlens, lengths, ``bad``), gather indices for each side."""

    def __init__(self, cu_q: Tensor, cu_kv: Tensor, max_q: int, max_kv: int, t_q: int, t_kv: int):
        self.batch, self.s_q, self.s_kv = fp8_packed.buckets(cu_q.shape[0] - 1, max_q, max_kv)
        self.n = _Lengths(cu_q, cu_kv, self.batch, t_q, t_kv, max_q, max_kv, whole=True)
        self.t_q, self.t_kv = t_q, t_kv
        self._q = self._indices(self.n.cu_q, self.n.len_q.view(-1), self.s_q, t_q)
        self._kv = self._q if (cu_kv is cu_q and self.s_kv == self.s_q and t_kv == t_q) else \
            self._indices(self.n.cu_kv, self.n.len_kv.view(-1), self.s_kv, t_kv)

    @staticmethod
    def _indices(cu: Tensor, lengths: Tensor, s: int, t: int) -> tuple[Tensor, Tensor]:
        """(pad (B x S,) indices into the tokens plus one zero row at ``t``; unpad (T,) indices into
        the B x S padded rows plus one zero row at B x S)."""
        batch = cu.shape[0] - 1
        cu64, pos = cu.long(), torch.arange(s, device=cu.device)
        live = pos < lengths.long().view(-1, 1)
        pad = torch.where(live, cu64[:-1].view(-1, 1) + pos, t).view(-1)
        tok = torch.arange(t, device=cu.device)
        row = torch.searchsorted(cu64[1:].contiguous(), tok, right=True)  # sequence of each token, B past the end
        at = tok - cu64[row.clamp(max=batch - 1)]
        valid = (row < batch) & (at >= 0) & (at < lengths.long()[row.clamp(max=batch - 1)])
        unpad = torch.where(valid, row * s + at, batch * s)
        return pad, unpad

    def pad(self, x: Tensor, side: str) -> Tensor:
        """Packed (T, H, D) -> padded (B, H, S, D) (a (B, S, H, D) buffer seen as BHSD), 0 past each length."""
        idx, s = (self._q[0], self.s_q) if side == "q" else (self._kv[0], self.s_kv)
        raw = x.view(torch.uint8) if x.dtype == E4M3 else x
        padded = torch.cat((raw, raw.new_zeros((1,) + tuple(raw.shape[1:])))).index_select(0, idx)
        padded = padded.view(self.batch, s, x.shape[1], x.shape[2]).transpose(1, 2)
        return padded.view(E4M3) if x.dtype == E4M3 else padded

    def unpad(self, y: Tensor, side: str) -> Tensor:
        """Padded (B, H, S, D) -> packed (T, H, D): each token's row, 0 for tokens outside the sequences."""
        idx = self._q[1] if side == "q" else self._kv[1]
        raw = y.view(torch.uint8) if y.dtype == E4M3 else y
        flat = raw.transpose(1, 2).reshape(-1, y.shape[1], y.shape[3])
        out = torch.cat((flat, flat.new_zeros((1,) + tuple(flat.shape[1:])))).index_select(0, idx)
        return out.view(E4M3) if y.dtype == E4M3 else out

    def padded_lse(self, lse: Tensor) -> Tensor:
        """Packed (T_q, H) fp32 LSE -> (B, H, S_q, 1), 0 past each length."""
        return rows.padded_lse(lse, self.n.cu_q[:-1], self.n.len_q.view(-1), self.s_q)

    def lengths(self) -> tuple[Tensor, Tensor]:
        """(B,) int32 lengths for the padded form's padding mask."""
        return self.n.len_q.view(-1), self.n.len_kv.view(-1)

    def poison(self) -> Tensor:
        """(1,) fp32: NaN when the cu_seqlens were out of range, else 0 (added to the factors that
        turn results back)."""
        return torch.where(self.n.bad, float("nan"), 0.0).reshape(1)


def _sequences(cu_q: Tensor, cu_kv: Tensor) -> None:
    """The op's own check of what ``csp.fp8.attention`` checks first: one or more sequences, the same
    number on both sides (an empty batch has no lengths to place or read)."""
    if cu_q.shape[0] < 2 or cu_kv.shape[0] != cu_q.shape[0]:
        raise ValueError(f"cudnn_sdpa::fp8_varlen_fwd: cu_seqlens_q and cu_seqlens_kv must hold B + 1 >= 2 prefix "
                         f"sums each (one or more sequences); got shapes {tuple(cu_q.shape)} and {tuple(cu_kv.shape)}")


def problem(q, k, v, cu_q, max_q: int, max_kv: int) -> support.Problem:
    """The packed forward as a ``support.Problem`` (kind "fp8"; the backward is a dense padded one)."""
    return support.Problem(
        kind="fp8", backward=False, device_type=q.device.type, dtypes=(q.dtype, k.dtype, v.dtype), padded=True,
        batch=cu_q.shape[0] - 1, h_q=q.shape[1], h_k=k.shape[1], h_v=v.shape[1], s_q=int(max_q), s_kv=int(max_kv),
        d_qk=q.shape[2], d_v=v.shape[2], empty=q.numel() == 0 or k.numel() == 0 or v.numel() == 0,
        ragged_extent=route._extent(q, k, v))


def _reference(q, k, v, descale_q, descale_k, descale_v, scale_o, cu_q, cu_kv, max_q, max_kv, scale, scale_s,
               causal, compute_lse):
    """The FP8 reference on the padded form, back to packed: (out, lse (T, H) or empty, amax)."""
    place = Placement(cu_q, cu_kv, max_q, max_kv, q.shape[0], k.shape[0])
    len_q, len_kv = place.lengths()
    out, lse, amax = fp8_reference.forward(place.pad(q, "q"), place.pad(k, "kv"), place.pad(v, "kv"), descale_q,
                                           descale_k, descale_v, scale_o, len_q, len_kv, scale, scale_s, causal,
                                           compute_lse)
    bad = place.n.bad
    out = place.unpad(out, "q")
    out.view(torch.uint8).masked_fill_(bad, 0x7F)  # NaN, as the graph's outputs for bad lengths
    if compute_lse:
        lse = torch.where(bad, float("nan"), place.unpad(lse, "q")[..., 0])
    return out.contiguous(), lse, torch.where(bad, float("nan"), amax)


def _fwd(found, q, k, v, descale_q, descale_k, descale_v, scale_o, cu_q, cu_kv, max_q, max_kv, scale, scale_s,
         is_causal, compute_lse, fallback, lengths=None):
    args = (q, k, v, descale_q, descale_k, descale_v, scale_o, cu_q, cu_kv, max_q, max_kv)
    serve = None if found is _ON_CPU else (lambda: fp8_packed.forward(
        *args, scale=scale, scale_s=scale_s, causal=is_causal, compute_lse=compute_lse, whole=True, lengths=lengths))
    return route.call("fp8_fwd", found, serve, lambda reason: _reference(*args, scale, scale_s, is_causal, compute_lse),
                      lambda: route.describe_call(q=q, k=k, v=v, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                                                  max_seqlen_kv=max_kv, is_causal=is_causal),
                      strict=not fallback or scope.strict())


def _fp8_varlen_fwd_cuda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    descale_q: Tensor,
    descale_k: Tensor,
    descale_v: Tensor,
    scale_o: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    scale: float,
    scale_s: float,
    is_causal: bool,
    compute_lse: bool,
    fallback: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """FP8 varlen forward: (out float8_e4m3fn (T_q, H_q, D_v), lse (T_q, H_q) fp32 or (0,), amax (2,) [s, o])."""
    _sequences(cu_seqlens_q, cu_seqlens_kv)
    signature = ("op_fp8_varlen_fwd", q.device.index, route.varlen_key(q, k, v), cu_seqlens_q.shape[0],
                 max_seqlen_q, max_seqlen_kv, is_causal)
    make = lambda: problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv)  # noqa: E731
    found = route.entry(signature, make, q.device.index)
    n = None
    if found.first is None:
        n = _Lengths(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], max_seqlen_q,
                     max_seqlen_kv, whole=True)
        # out-of-range cu_seqlens give zero lengths too
        found = fp8_ops.with_lengths(found, signature, make, q.device.index, n.len_q, n.len_kv)
    return _fwd(found, q, k, v, descale_q, descale_k, descale_v, scale_o, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                max_seqlen_kv, scale, scale_s, is_causal, compute_lse, fallback, n)


fp8_varlen_fwd = torch.library.custom_op("cudnn_sdpa::fp8_varlen_fwd", _fp8_varlen_fwd_cuda, mutates_args=(),
                                         device_types="cuda")


@fp8_varlen_fwd.register_kernel("cpu")
def _fp8_varlen_fwd_cpu(q, k, v, descale_q, descale_k, descale_v, scale_o, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                        max_seqlen_kv, scale, scale_s, is_causal, compute_lse, fallback):
    _sequences(cu_seqlens_q, cu_seqlens_kv)
    return _fwd(_ON_CPU, q, k, v, descale_q, descale_k, descale_v, scale_o, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                max_seqlen_kv, scale, scale_s, is_causal, compute_lse, fallback)


@fp8_varlen_fwd.register_fake
def _fp8_varlen_fwd_fake(q, k, v, descale_q, descale_k, descale_v, scale_o, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                         max_seqlen_kv, scale, scale_s, is_causal, compute_lse, fallback):
    t, h, _ = q.shape
    out = q.new_empty((t, h, v.shape[2]), dtype=E4M3)  # contiguous, as the engine and the reference
    lse = q.new_empty((t, h) if compute_lse else (0,), dtype=torch.float32)
    return out, lse, q.new_empty((2,), dtype=torch.float32)


_KERNELS = {"cuda": _fp8_varlen_fwd_cuda, "cpu": _fp8_varlen_fwd_cpu}


def _forward_kernel(q: Tensor):
    """The kernel itself for plain eager tensors (no dispatcher round trip), else the op."""
    return _KERNELS[q.device.type] if ops.eager(q) else torch.ops.cudnn_sdpa.fp8_varlen_fwd


class _Attention(torch.autograd.Function):
    """``csp.fp8.attention`` on packed q (T_q, H_q, D), k, v (T_kv, H_k, D): quantised as the dense
    path (``fp8_ops.quantize_inputs``), the packed forward op, the padded dense backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q, max_kv, recipe, scale, is_causal, scale_s, margin, grad_dtype,
                fallback, delayed, grad):
        cu_kv = cu_q if cu_kv is None else cu_kv  # None: the same sequences (autograd.Function under
        # torch.compile takes no tensor twice)
        f = fp8_ops.quantize_inputs(q, k, v, E4M3, recipe if delayed else 0, margin if delayed else 1.0)
        out8, lse, _ = _forward_kernel(f.q8)(f.q8, f.k8, f.v8, f.descale_q, f.descale_k, f.descale_v, f.scale_o, cu_q,
                                             cu_kv, max_q, max_kv, scale, scale_s, is_causal, grad, fallback)
        ctx.save_for_backward(f.q8, f.k8, f.v8, out8, lse, f.descale_q, f.descale_k, f.descale_v, f.descale_o, cu_q,
                              None if cu_kv is cu_q else cu_kv, f.poison)
        ctx.options = (max_q, max_kv, recipe, scale, is_causal, scale_s, margin, grad_dtype, fallback, q.dtype, delayed)
        return fp8_ops.dequantize(out8, f.out_factor, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, out8, lse, descale_q, descale_k, descale_v, descale_o, cu_q, cu_kv, poison = ctx.saved_tensors
        cu_kv = cu_q if cu_kv is None else cu_kv
        max_q, max_kv, recipe, scale, is_causal, scale_s, margin, grad_dtype, fallback, dtype, delayed = ctx.options
        do8, descale_do, _ = fp8_ops.quantize(grad_out, grad_dtype, recipe if delayed else 0, 3,
                                              margin if delayed else 1.0)
        place = Placement(cu_q, cu_kv, max_q, max_kv, q8.shape[0], k8.shape[0])
        qp, kp, vp = place.pad(q8, "q"), place.pad(k8, "kv"), place.pad(v8, "kv")
        op, dop = place.pad(out8, "q"), place.pad(do8, "q")
        len_q, len_kv = place.lengths()
        dq, dk, dv, used, _ = fp8_ops.kernels(qp)[1](
            dop, qp, kp, vp, op, place.padded_lse(lse), descale_q, descale_k, descale_v, descale_o, descale_do, None,
            recipe, len_q, len_kv, scale, scale_s, margin, is_causal, fallback)
        dq, dk, dv = place.unpad(dq, "q"), place.unpad(dk, "kv"), place.unpad(dv, "kv")
        grads = fp8_ops.dequantize_grads(dq, dk, dv, used, poison + place.poison(), descale_do, dtype)
        return grads + (None,) * 13


def attention(q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, recipe, scale: float, is_causal: bool, fallback: bool):
    """Checked arguments (``csp.fp8.attention``) in, the output (T_q, H_q, D_v) in q's dtype out."""
    grad = ops.grad_needed(q, k, v)  # the LSE only for a backward
    return _Attention.apply(q, k, v, cu_q, None if cu_kv is cu_q else cu_kv, max_q, max_kv, recipe.id, scale, is_causal, recipe.scale_s,
                            recipe.margin, recipe.grad_dtype, fallback, recipe.scaling == "delayed", grad)
