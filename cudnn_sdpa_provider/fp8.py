"""FP8 attention on cuDNN's per-tensor-scaled FP8 graphs (Hopper and newer), audited like every call.

    import cudnn_sdpa_provider as csp
    recipe = csp.fp8.Recipe()                        # one per model (or per layer)
    out = csp.fp8.attention(q, k, v, is_causal=True, recipe=recipe)   # bf16 in, bf16 out
    out.sum().backward()                             # dq, dk, dv in bf16

Two levels:

* ``attention``: activations (bf16, fp16 or fp32) in, the same dtype out, differentiable through
  autograd. It quantises q, k, v (and, in the backward, dO) as its ``Recipe`` says
  (``ops.fp8_quant``): current scaling by default (``quantize``: this call's amax), or delayed
  scaling (one pass, the scale from an amax history on the device; a call the history's scale
  would clip is redone at its own scale and counted in ``csp.stats().fp8_saturated``). O's scale
  comes from max |V| (|O| <= max |V|: each row of O is a convex combination of V's rows). The
  scales of dQ, dK, dV and dS, which cuDNN needs before it computes them, come from earlier
  backwards (``fp8_ops``): under current scaling checked after the call and re-run when an output
  would have saturated (no clipped gradient is returned, one host sync); under delayed scaling
  predicted on the device and counted when they clip (no host sync). A padded call (seq_lens or
  packed) also reads its lengths once: a zero length, which cuDNN's FP8 graphs fault on, and every
  padded backward (wrong on cuDNN 9.19) run the FP8 reference (``core.known_issues``). docs/fp8.md
  says exactly.
* ``forward`` / ``backward``: FP8 operands with the caller's own factors, returning what a scaling
  recipe needs (the amax values). Real value = stored value x descale; an output stored in FP8 is
  its real value x scale, saturated at 448 (float8_e4m3fn), as cuDNN stores it.

Paths ``fp8_fwd`` / ``fp8_bwd`` count the calls; a call cuDNN cannot serve (an older GPU, a head
dim its FP8 backward lacks) runs on ``fp8_reference`` with a reason, or raises ``FallbackError``
in strict mode. docs/fp8.md states the accuracy measured against fp32 and the speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import arguments, scope
from .ops import fp8_quant
from .ops.fp8_reference import FORMAT_MAX

SCALINGS = ("delayed", "current")
#: Amax values a delayed recipe keeps per tensor (Transformer Engine's DelayedScaling keeps 1024 by
#: default; 16 follows a changing model closely and still rides out one small step).
DEFAULT_HISTORY = 16
MAX_HISTORY = 1024

__all__ = ["E4M3", "E5M2", "DEFAULT_SCALE_S", "DEFAULT_HISTORY", "SCALINGS", "quantize", "Forward", "Backward",
           "forward", "backward", "Recipe", "attention"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: Scale of the softmax probabilities P (in [0, 1]) before they are stored in FP8.
DEFAULT_SCALE_S = 256.0
#: O is stored with scale = the largest power of 2 at most largest FP8 value x this / max |V| (P's
#: rounding can push a row of O a little past max |V|; ``ops.fp8_quant``).
O_HEADROOM = fp8_quant.O_HEADROOM


def _kernels(q):
    from .ops import fp8_ops  # registers the ops on first use

    return fp8_ops.kernels(q)


def _current(t: torch.Tensor, dtype, margin: float = 1.0):
    """(t in FP8 ``dtype``, descale (1,), amax): current scaling (``ops.fp8_quant``). A non-finite
    amax (an inf or NaN anywhere in ``t``) has no scale: it is NaN, and so are the descale and
    every stored value, so that everything computed from ``t`` is NaN (with a scale of 0, which
    top / inf gives, one inf would zero the whole tensor instead, issue #29)."""
    from .ops import fp8_quant

    return fp8_quant.current(t, dtype, margin=margin)


def quantize(t: torch.Tensor, dtype: torch.dtype = E4M3, *, margin: float = 1.0):
    """``t`` in FP8 with current scaling: (stored, descale (1,) fp32), stored x descale ~ t.

    scale = largest value of ``dtype`` / (``margin`` x max |t|), rounded down to a power of 2 (so
    descale is exact); an all-zero ``t`` gets scale 1; a ``t`` with an inf or NaN has no scale:
    its descale and every stored value are NaN."""
    arguments.require_tensor("t", t)
    if dtype not in FORMAT_MAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not t.is_floating_point():
        raise TypeError(f"t must be floating point, got {t.dtype}")
    _positive("margin", margin, 1.0)
    stored, descale, _ = _current(t, dtype, margin)
    return stored, descale


@dataclass
class Forward:
    """``forward``'s result: ``out`` float8_e4m3fn (real = out x 1/scale_o), ``lse`` (B, H, S_q, 1) fp32
    or None, ``amax_s`` (the largest softmax probability) and ``amax_o`` (max |O|), 0-dim fp32."""

    out: torch.Tensor
    lse: torch.Tensor | None
    amax_s: torch.Tensor
    amax_o: torch.Tensor


@dataclass
class Backward:
    """``backward``'s result: dq, dk, dv float8_e4m3fn (real = stored / its scale) and the amax of
    each and of dS (``amax_dp``: cuDNN's name), 0-dim fp32."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    amax_dq: torch.Tensor
    amax_dk: torch.Tensor
    amax_dv: torch.Tensor
    amax_dp: torch.Tensor


def _scale_s(value) -> float:
    """P's scale: P~ = exp(S - rowmax) reaches 1 in every row, so a scale above the largest FP8
    value saturates it."""
    value = _positive("scale_s", value)
    if value > FORMAT_MAX[E4M3]:
        raise ValueError(f"scale_s must be at most {FORMAT_MAX[E4M3]} (the softmax's largest value, 1, times "
                         f"scale_s must fit float8_e4m3fn), got {value!r}")
    return value


def _positive(name: str, value, minimum: float = 0.0) -> float:
    low = f">= {minimum}" if minimum else "> 0"
    return arguments.real(name, value, valid=f"a finite real number {low}", ok=lambda x: x > 0 and x >= minimum)


def _factor(name: str, t, device) -> torch.Tensor:
    arguments.require_tensor(name, t)
    if t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a one-element float32 tensor (a per-tensor factor), got shape "
                         f"{tuple(t.shape)} {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.reshape(1)


def _operands(q, k, v, fp8: bool):
    for name, t in (("q", q), ("k", k), ("v", v)):
        arguments.require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
        if fp8 and t.dtype != E4M3:
            raise TypeError(f"{name} must be torch.float8_e4m3fn (use csp.fp8.quantize), got {t.dtype}")
    if not fp8:
        if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"q, k, v must share one of bfloat16, float16, float32 (FP8 operands go to "
                            f"csp.fp8.forward), got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0] or v.shape[2] != k.shape[2]:
        raise ValueError(f"batch/sequence sizes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _heads(q, k, v)


def _heads(q, k, v) -> None:
    """Heads (dim 1, dense and packed alike): H_q a multiple of H_k = H_v; q and k share the head dim (last)."""
    h_q, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]
    if h_k == 0 or h_v == 0 or h_q % h_k or h_q % h_v or h_k != h_v:
        raise ValueError(f"H_q={h_q} must be a multiple of H_k={h_k} = H_v={h_v} (GQA/MQA)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")


def _lengths(q, k, seq_lens_q, seq_lens_kv):
    if (seq_lens_q is None) != (seq_lens_kv is None):
        raise ValueError("pass both seq_lens_q and seq_lens_kv (padded batches), or neither")
    if seq_lens_q is None:
        return None, None
    given = seq_lens_q, seq_lens_kv  # checked as given: int64 values reported unclamped
    seq_lens_q = arguments.lengths("seq_lens_q", seq_lens_q, q.shape[0], q.device)
    seq_lens_kv = arguments.lengths("seq_lens_kv", seq_lens_kv, q.shape[0], q.device)
    if q.device.type == "cpu" and arguments.readable(seq_lens_q):
        arguments.check_lengths("seq_lens_q", given[0], q.shape[2], "S_q")
        arguments.check_lengths("seq_lens_kv", given[1], k.shape[2], "S_kv")
    return seq_lens_q, seq_lens_kv


def _fallback() -> bool:
    return torch.compiler.is_compiling() or not scope.strict()


def forward(q, k, v, *, descale_q, descale_k, descale_v, scale_o, is_causal=False, scale=None, seq_lens_q=None,
            seq_lens_kv=None, scale_s=DEFAULT_SCALE_S, return_lse=False) -> Forward:
    """FP8 attention forward on float8_e4m3fn q (B, H_q, S_q, D), k, v (B, H_k, S_kv, D).

    ``descale_*`` / ``scale_o``: one-element fp32 tensors. ``is_causal``: top-left causal mask;
    ``seq_lens_q`` / ``seq_lens_kv`` (B,) int: padding by lengths (rows past them are 0).
    ``return_lse``: also the softmax's log-sum-exp, which ``backward`` needs."""
    _operands(q, k, v, fp8=True)
    factors = [_factor(n, t, q.device) for n, t in (("descale_q", descale_q), ("descale_k", descale_k),
                                                    ("descale_v", descale_v), ("scale_o", scale_o))]
    arguments.flag("is_causal", is_causal)
    arguments.flag("return_lse", return_lse)
    seq_lens_q, seq_lens_kv = _lengths(q, k, seq_lens_q, seq_lens_kv)
    out, lse, amax = _kernels(q)[0](q, k, v, *factors, seq_lens_q, seq_lens_kv, arguments.scale(scale, q.shape[3]),
                                    _scale_s(scale_s), is_causal, return_lse, _fallback())
    return Forward(out, lse if return_lse else None, amax[0], amax[1])


def backward(grad_out, q, k, v, out, lse, *, descale_q, descale_k, descale_v, descale_o, descale_do, scale_dq,
             scale_dk, scale_dv, scale_dp, is_causal=False, scale=None, seq_lens_q=None, seq_lens_kv=None,
             scale_s=DEFAULT_SCALE_S) -> Backward:
    """FP8 attention backward at the caller's scales: ``grad_out`` float8_e4m3fn or float8_e5m2 like
    ``out``; ``out`` and ``lse`` from ``forward(return_lse=True)`` on the same q, k, v and options;
    ``scale_dp`` scales dS = P (dP - rowsum(dO O)) x scale, which cuDNN stores in FP8 on the way to
    dQ and dK. A scale too large saturates its output: check the returned amax values."""
    _operands(q, k, v, fp8=True)
    for name, t in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        arguments.require_tensor(name, t)
    for name, t, shape in (("grad_out", grad_out, out.shape), ("out", out, q.shape[:3] + v.shape[3:]),
                           ("lse", lse, q.shape[:3] + (1,))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if grad_out.dtype not in (E4M3, E5M2) or out.dtype != E4M3 or lse.dtype != torch.float32:
        raise TypeError(f"grad_out must be float8_e4m3fn or float8_e5m2, out float8_e4m3fn, lse float32; got "
                        f"{grad_out.dtype}, {out.dtype}, {lse.dtype}")
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do")
    descales = [_factor(n, t, q.device) for n, t in zip(names, (descale_q, descale_k, descale_v, descale_o,
                                                                 descale_do))]
    scales = torch.cat([_factor(n, t, q.device) for n, t in (("scale_dq", scale_dq), ("scale_dk", scale_dk),
                                                              ("scale_dv", scale_dv), ("scale_dp", scale_dp))])
    arguments.flag("is_causal", is_causal)
    seq_lens_q, seq_lens_kv = _lengths(q, k, seq_lens_q, seq_lens_kv)
    dq, dk, dv, _, amax = _kernels(q)[1](grad_out, q, k, v, out, lse, *descales, scales, 0, seq_lens_q,
                                         seq_lens_kv, arguments.scale(scale, q.shape[3]),
                                         _scale_s(scale_s), 2.0, is_causal, _fallback())
    return Backward(dq, dk, dv, *amax.unbind())


def _device(device) -> torch.device:
    """``device`` with its index: "cuda" is the current CUDA device, so that ``Recipe.history("cuda")``
    is the state the kernels update for tensors on ``cuda:0`` (a tensor's device always has one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Recipe:
    """Scaling for ``attention`` (docs/fp8.md says what each guarantees).

    ``scaling="delayed"``: q, k, v and dO are quantised in one pass at a scale from the
    largest of their last ``history`` amax values (x ``margin``), kept on the device; a call whose
    scale would clip (or flush: more than 16x too small), or the first one, is redone on the
    device at its own amax (``ops.fp8_quant``), and a clipping one is counted
    (``csp.stats().fp8_saturated``, ``saturated``). dQ, dK, dV, dS: scales from the last
    ``history`` backwards' amax x ``margin``, no host sync after the recipe's first backward; a
    backward whose scale clipped is counted, not re-run.
    ``scaling="current"`` (default; ``delayed`` becomes it once the GPU tier has passed on it):
    q, k, v, dO at this call's own amax (two passes each); dQ, dK, dV, dS
    from the last backward's amax x ``margin``, checked after the backward (one host sync) and
    re-run when an output would have saturated: no clipped gradient is ever returned.

    Both: O from max |V|; ``grad_dtype``: dO's FP8 format (e4m3fn, or e5m2 for more range). One
    recipe holds one state per device; share it across layers or give each its own (layers whose
    tensors differ in size share the largest one's scales)."""

    def __init__(self, *, scaling: str = "current", history: int = DEFAULT_HISTORY, margin: float = 2.0,
                 scale_s: float = DEFAULT_SCALE_S, grad_dtype: torch.dtype = E4M3, _pinned: bool = False):
        if not isinstance(scaling, str) or scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {list(SCALINGS)}, got {scaling!r}")
        if isinstance(history, bool) or not isinstance(history, int) or not 1 <= history <= MAX_HISTORY:
            raise ValueError(f"history must be an int from 1 to {MAX_HISTORY} (the amax values kept per tensor), "
                             f"got {history!r}")
        self.scaling = scaling
        self.history_len = history
        self.margin = _positive("margin", margin, 1.0)
        self.scale_s = _scale_s(scale_s)
        if grad_dtype not in (E4M3, E5M2):
            raise ValueError(f"grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {grad_dtype}")
        self.grad_dtype = grad_dtype
        self._states: dict = {}
        self._histories: dict = {}
        self._warm: set = set()
        from .ops import fp8_ops

        self.id = fp8_ops.register(self, _pinned)  # how the kernels find this recipe's state

    def state(self, device) -> torch.Tensor:
        """This device's (5,) fp32 state: last amax of dQ, dK, dV, dS (0: none yet), re-runs so far."""
        device = _device(device)
        found = self._states.get(device)
        if found is None:
            found = self._states[device] = torch.zeros(5, dtype=torch.float32, device=device)
        return found

    def history(self, device):
        """This device's delayed-scaling state (``ops.fp8_quant.History``): ``amax`` (history, 8)
        fp32, the last amax values of q, k, v, dO (0: none) and of dQ, dK, dV, dS per unit of
        their operands' descales (``ops.fp8_ops``: dQ per dO x V x K, dK per dO x V x Q, dV per
        dO, dS per dO x V); ``row`` (8,) each one's next row; ``saturated`` (8,): calls whose
        scale would have clipped (q, k, v, dO each; backwards in slot 4) and backwards whose
        scale was more than 16x too small (slot 5)."""
        device = _device(device)
        found = self._histories.get(device)
        if found is None:
            from .ops import fp8_ops, fp8_quant

            found = self._histories[device] = fp8_quant.History.zeros(self.history_len, fp8_ops.SLOTS, device)
        return found

    def warm(self, device, value: bool | None = None) -> bool:
        """Whether a delayed recipe's backward on ``device`` takes its scales from the history
        (after its first backward with finite gradients); ``value`` sets it."""
        device = _device(device)
        if value is not None:
            (self._warm.add if value else self._warm.discard)(device)
        return device in self._warm

    @property
    def retries(self) -> int:
        """Backwards re-run because an output would have saturated (all devices; a host sync)."""
        return int(sum(s[4].item() for s in self._states.values()))

    @property
    def saturated(self) -> int:
        """Calls of this recipe whose delayed scale would have clipped, all devices (a host sync)."""
        return int(sum((h.saturated.sum() - h.saturated[5]).item() for h in self._histories.values()))

    @property
    def flushed(self) -> int:
        """Delayed backwards whose gradient scale was more than 16x too small for this call's
        amax (small gradients flushed to 0; not re-run), all devices (a host sync)."""
        return int(sum(h.saturated[5].item() for h in self._histories.values()))

    def reset(self) -> None:
        """Forget every amax, re-run and saturation count: the next call is a first call."""
        self._states.clear()
        self._histories.clear()
        self._warm.clear()

    def __repr__(self) -> str:
        return (f"Recipe(scaling={self.scaling!r}, history={self.history_len}, margin={self.margin}, "
                f"scale_s={self.scale_s}, grad_dtype={self.grad_dtype})")


_DEFAULT = Recipe(_pinned=True)


def _quantize(t, dtype, recipe: int, slot: int, margin: float, delayed: bool):
    """dO in FP8: the recipe's delayed scaling from its history ``slot``, or current scaling at
    margin 1 (``ops.fp8_ops.quantize``)."""
    from .ops import fp8_ops

    return fp8_ops.quantize(t, dtype, recipe if delayed else 0, slot, margin if delayed else 1.0)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_q, seq_kv, recipe, scale, is_causal, scale_s, margin, grad_dtype, fallback,
                delayed):
        from .ops import fp8_ops

        # current scaling at margin 1, or the recipe's delayed scaling (``Recipe``)
        f = fp8_ops.quantize_inputs(q, k, v, E4M3, recipe if delayed else 0, margin if delayed else 1.0)
        out8, lse, _ = _kernels(f.q8)[0](f.q8, f.k8, f.v8, f.descale_q, f.descale_k, f.descale_v, f.scale_o, seq_q,
                                         seq_kv, scale, scale_s, is_causal, True, fallback)
        ctx.save_for_backward(f.q8, f.k8, f.v8, out8, lse, f.descale_q, f.descale_k, f.descale_v, f.descale_o, seq_q,
                              seq_kv, f.poison)
        ctx.options = (recipe, scale, is_causal, scale_s, margin, grad_dtype, fallback, q.dtype, delayed)
        return fp8_ops.dequantize(out8, f.out_factor, q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q8, k8, v8, out8, lse, descale_q, descale_k, descale_v, descale_o, seq_q, seq_kv, poison = ctx.saved_tensors
        recipe, scale, is_causal, scale_s, margin, grad_dtype, fallback, dtype, delayed = ctx.options
        do8, descale_do, _ = _quantize(grad_out, grad_dtype, recipe, 3, margin, delayed)
        dq, dk, dv, used, _ = _kernels(q8)[1](do8, q8, k8, v8, out8, lse, descale_q, descale_k, descale_v, descale_o,
                                             descale_do, None, recipe, seq_q, seq_kv, scale, scale_s, margin,
                                             is_causal, fallback)
        from .ops import fp8_ops

        return fp8_ops.dequantize_grads(dq, dk, dv, used, poison, descale_do, dtype) + (None,) * 10


def attention(q, k, v, *, is_causal=False, scale=None, seq_lens_q=None, seq_lens_kv=None, cu_seqlens_q=None,
              cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, recipe=None):
    """Attention of bf16/fp16/fp32 q (B, H_q, S_q, D), k, v (B, H_k, S_kv, D) computed in FP8, output
    in q's dtype; differentiable (dq, dk, dv in q's dtype). ``recipe``: a ``Recipe`` (default: one
    shared by every call that passes none). An inf or NaN in q, k or v (or in the gradient of the
    output) makes the whole output (and every gradient) NaN: such a tensor has no per-tensor scale.

    Packed (varlen) inputs, as ``csp.attention`` takes them: q (T_q, H_q, D), k, v (T_kv, H_k, D)
    with ``cu_seqlens_q`` ((B+1,) int32 prefix sums from 0 to T_q; ``cu_seqlens_kv`` defaults to it)
    and ``max_seqlen_q`` / ``max_seqlen_kv`` (host ints, the longest sequences); output (T_q, H_q,
    D_v). The forward runs on cuDNN's packed FP8 graph, the backward on the padded form (on the FP8
    reference where the known-issues table keeps cuDNN's padded FP8 backward off: cuDNN 9.14+ on
    sm_90+), docs/fp8.md, "Packed (varlen) inputs"."""
    arguments.flag("is_causal", is_causal)
    recipe = _recipe(recipe)
    if cu_seqlens_q is not None:
        return _packed(q, k, v, is_causal, scale, seq_lens_q, seq_lens_kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                       max_seqlen_kv, recipe)
    if cu_seqlens_kv is not None or max_seqlen_q is not None or max_seqlen_kv is not None:
        raise ValueError("cu_seqlens_kv / max_seqlen_q / max_seqlen_kv are for packed (T, H, D) inputs; pass "
                         "cu_seqlens_q too (or seq_lens_q / seq_lens_kv for padded (B, H, S, D) batches)")
    _operands(q, k, v, fp8=False)
    seq_lens_q, seq_lens_kv = _lengths(q, k, seq_lens_q, seq_lens_kv)
    return _Attention.apply(q, k, v, seq_lens_q, seq_lens_kv, recipe.id, arguments.scale(scale, q.shape[3]),
                            is_causal, recipe.scale_s, recipe.margin, recipe.grad_dtype, _fallback(),
                            recipe.scaling == "delayed")


def _recipe(recipe) -> Recipe:
    if recipe is None:
        return _DEFAULT
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a csp.fp8.Recipe or None, got {type(recipe).__name__}")
    return recipe


def _packed_operands(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        arguments.require_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (T, H, D) with cu_seqlens_q (packed inputs), got shape "
                             f"{tuple(t.shape)}; dense (B, H, S, D) inputs take seq_lens_q / seq_lens_kv")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share a device")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one of bfloat16, float16, float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    _heads(q, k, v)


def _check_packed_values(name: str, given, tokens: int, max_name: str, max_len: int, tensor: str) -> None:
    """Prefix sums from 0, non-decreasing, no sequence longer than ``max_len``, ending at exactly
    ``tokens``: a per-tensor scale is taken over the whole tensor, so rows past the last sequence
    would change every sequence's quantisation (CPU tensors: free to read)."""
    arguments.check_cu_seqlens(name, given, tokens, max_name, max_len)
    last = int(given[-1])
    if last != tokens:
        raise ValueError(f"{name}[-1] = {last} must equal the {tokens} packed tokens of {tensor} (FP8 scales "
                         f"are per tensor: every row must belong to a sequence)")


def _packed(q, k, v, is_causal, scale, seq_lens_q, seq_lens_kv, cu_q, cu_kv, max_q, max_kv, recipe):
    """Packed (T, H, D) inputs: checks, then ``ops.fp8_varlen``."""
    if seq_lens_q is not None or seq_lens_kv is not None:
        raise ValueError("seq_lens_q / seq_lens_kv are for padded (B, H, S, D) inputs; packed inputs take their "
                         "lengths from cu_seqlens_q / cu_seqlens_kv")
    _packed_operands(q, k, v)
    given, cu_q, cu_kv, max_q, max_kv = arguments.packed_lengths(q, k, cu_q, cu_kv, max_q, max_kv)
    if q.device.type == "cpu" and arguments.readable(cu_q):
        _check_packed_values("cu_seqlens_q", given[0], q.shape[0], "max_seqlen_q", max_q, "q")
        kv_name = "cu_seqlens_kv" if given[1] is not given[0] else "cu_seqlens_q (as cu_seqlens_kv)"
        _check_packed_values(kv_name, given[1], k.shape[0], "max_seqlen_kv", max_kv, "k")
    from .ops import fp8_varlen

    return fp8_varlen.attention(q, k, v, cu_q, cu_kv, max_q, max_kv, recipe, arguments.scale(scale, q.shape[2]),
                                is_causal, _fallback())
