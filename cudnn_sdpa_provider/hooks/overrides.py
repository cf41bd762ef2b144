"""Kernels the provider registers over PyTorch's attention ops while it is enabled.

Served (our cuDNN graphs, ``dense`` / ``packed`` / ``paged``), through ``route``:
  aten::_scaled_dot_product_cudnn_attention (+ _backward)   CUDA   -> dense_fwd / dense_bwd
  torch_attn::_varlen_attn (+ _backward, _varlen_attn_out)   CUDA   -> varlen_fwd / varlen_bwd
  aten::_cudnn_attention_forward_no_dropout_inplace (2.15+)   CUDA   -> varlen_fwd
                                                             (the kernels: ``varlen_hooks``)
Each falls back to the kernel it replaced (fetched with ``torch.library.get_kernel`` before the
override is registered), so a fallback is PyTorch's own C++ path, bit-exact with native; the cuDNN
op's fallback gets copies of operands whose base or rows are not 16-byte aligned (``layout.for_native``).

Counted only (every other backend PyTorch's selector can pick; the original kernel runs):
  aten::_scaled_dot_product_{efficient,flash}_attention (+ _backward)  CUDA
  aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward)       CPU
  aten::_scaled_dot_product_attention_math   AutogradCUDA/AutogradCPU (its backward is counted
                                             by a hook on the output's gradient)

A backward follows its forward through ``markers``: the forward marks its logsumexp (dense) or
rng_state (varlen) with what it did; the backward kernel looks it up. The backward overrides stay
registered after the scope exits while any such forward can still be differentiated.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..core import arguments, counters, layout, markers, rows, scope, support
from ..core.reasons import Slug
from ..engine import dense
from ..ops import bias_lengths, composite, route
from ..engine.binding import tensor_key
from ..ops.route import describe_call
from .varlen_hooks import VARLEN_ARGUMENTS, Varlen as _Varlen, bind as _bind, scale_of as _scale
from .varlen_hooks import unknown_arguments as _unknown_arguments, varlen_ops as _varlen_ops  # noqa: F401
from .varlen_hooks import inplace_op as _inplace_op

__all__ = ["Hooks", "VARLEN_ARGUMENTS"]


#: is_causal -> the FlashAttention window, as ``support.canonical_window`` folds it (computed once).
_WINDOWS = {flag: support.canonical_window(flag, None) for flag in (False, True)}


def _unused_philox(device: torch.device) -> tuple:
    """The philox seed/offset outputs of a call without dropout: the op must return them and nothing
    reads them. Fresh per call, never cached: a tensor kept across calls would be made inside
    whatever context the first call ran in (an inference tensor under ``torch.inference_mode()``,
    which training then cannot save; a block of a CUDA-graph pool under ``torch.compile(mode=
    "reduce-overhead")``, which cudagraph trees reject as an untracked allocation). Fresh blocks are
    16-byte aligned, as inductor asserts of outputs."""
    return (torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device))


def _lengths_free(signature: tuple, q, k, v) -> tuple:
    """The forward's signature without its lengths (``route.entry``): each operand's batch, heads,
    head dim and dtype (all its problem reads of it but S; no strides: the problem holds none), the
    options, and the lengths' ``support.length_class``. Only for a call without a bias (a bias's
    shape is a length)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    return ("sdpa_fwd_lengths", signature[1], (qs[0], qs[1], qs[3], q.dtype), (ks[0], ks[1], ks[3], k.dtype),
            (vs[0], vs[1], vs[3], v.dtype), signature[5:], support.length_class(qs[2], ks[2]))


def _padding(attn_bias, query, key, dropout_p, refused: bool):
    """The bias as a right-padding mask (``bias_lengths``), or None: a call with dropout, or one
    ``refused`` (its bias needs a gradient, its debug mask is asked for, or is_causal applies too),
    keeps its bias."""
    if attn_bias is None or refused or dropout_p > 0.0:
        return None
    found = bias_lengths.recognise(attn_bias, query, key)
    if found is not None:
        counters.log_once(("bias_lengths", found.window), logging.INFO, "F.sdpa's attn_mask is a %s right-padding "
                          "mask: served as per-sequence lengths (one graph per doubling of S)",
                          "causal" if found.window == (-1, 0) else "bidirectional")
    return found


def _as_lengths(padding) -> dict:
    """The engine's arguments for a bias taken as lengths: no bias, dropout or signature (the
    engine keys the lengths' tensors itself)."""
    return {"seq_len_q": padding.seq_len_q, "seq_len_kv": padding.seq_len_kv}


#: A configuration the known-issues table keeps off cuDNN is kept off PyTorch's own cuDNN kernels too:
#: they run on the same cuDNN (GPU run 51: PyTorch's cuDNN backward segfaults at the
#: NVIDIA/cudnn-frontend#1071 shape on cuDNN 9.28.1, as the bare graph does). Such a call runs on the
#: aten composite (fp32) instead.
_KNOWN = Slug.CUDNN_KNOWN_ISSUE.value


def _additive(bias):
    """The composite adds its bias: a boolean mask (True = attend) becomes 0 / -inf."""
    if bias is None or bias.dtype != torch.bool:
        return bias
    return torch.zeros(bias.shape, dtype=torch.float32, device=bias.device).masked_fill(~bias, float("-inf"))


def _composite_forward(query, key, value, attn_bias, compute_lse, dropout_p, window, scale):
    """The cuDNN op's nine outputs from the aten composite; a dropout mask of the composite's own,
    drawn from the philox pair it returns, which its backward (``_composite_backward``) re-draws."""
    philox = rows.new_philox(query.device, 2) if dropout_p > 0.0 else None
    out, lse = composite.dense_fwd(query, key, value, None, _additive(attn_bias), None, None, _scale(scale, query),
                                   window, False, philox=philox, dropout_p=float(dropout_p))
    if compute_lse:  # (B, H_q, S_q, 1) either way, as the served path returns it
        _mark(lse, markers.Record(served=False, reason=_KNOWN))
    seed, offset = _unused_philox(query.device) if philox is None else (philox[0], philox[1])
    return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, None


def _composite_backward(grad_out, query, key, value, attn_bias, philox_seed, philox_offset, dropout_p, window, scale):
    philox = torch.stack([philox_seed.reshape(()), philox_offset.reshape(())]) if dropout_p > 0.0 else None
    dq, dk, dv, _ = composite.dense_bwd(grad_out, query, key, value, None, _additive(attn_bias), None, None,
                                        _scale(scale, query), window, False, philox=philox, dropout_p=float(dropout_p))
    return dq, dk, dv


def _dropout_guard(signature, query, key, value, window, attn_bias, dropout_p):
    """A forward with dropout whose backward is known-bad on this cuDNN runs on the composite too
    (``cudnn_known_issue``): the composite backward can redraw the composite's dropout mask, not
    cuDNN's. None when the backward has no such row."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    entry = route.entry(("sdpa_bwd_of", deterministic) + signature, lambda: route.dense_problem(
        query, key, value, backward=True, window=window, bias=attn_bias, dropout_p=dropout_p,
        deterministic=deterministic), query.device.index)
    reason = entry.first
    if reason is None or reason.slug != _KNOWN:
        return None
    return route.fixed(_KNOWN, f"{reason.message}; with dropout, its forward runs where the backward can redraw "
                               "the mask")


def _traced(t) -> bool:
    """Fake or functional tensors, or a dispatch mode (torch.compile's tracing reaches the math
    kernel's autograd key): no data pointer to read, and nothing runs yet."""
    return not arguments.readable(t)


def _mark(t, record: markers.Record) -> None:
    if isinstance(t, torch.Tensor) and t.numel() > 0:
        markers.mark(t, record)


# ------------------------------------------------------------------------------- dense, served


class _Dense:
    """The dense cuDNN op pair: serve, or run the original kernel."""

    def __init__(self, fwd_original, bwd_original):
        self.fwd_original = fwd_original
        self.bwd_original = bwd_original

    def forward(self, keyset, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        window = _WINDOWS[bool(is_causal)]
        recompute = route.recompute(dropout_p)
        bias_grad = attn_bias is not None and attn_bias.requires_grad and torch.is_grad_enabled()
        refused = bias_grad or return_debug_mask or is_causal  # is_causal with a mask: both apply; keep the bias
        padding = _padding(attn_bias, query, key, dropout_p, refused)
        bias = None if padding is not None else attn_bias  # what the engine is given
        if padding is not None:
            window = padding.window
        # One signature for the route's decision and the engine's binding (it covers both).
        signature = ("sdpa_fwd", query.device.index, tensor_key(query), tensor_key(key), tensor_key(value),
                     tensor_key(bias) if padding is None else ("padding", window), bias_grad, dropout_p, window,
                     bool(return_debug_mask), recompute, scale, compute_log_sumexp)
        found = route.entry(signature, lambda: route.dense_problem(
            query, key, value, window=window, bias=bias, dropout_p=dropout_p, recompute=recompute,
            padded=padding is not None, unsupported=("return_debug_mask",) if return_debug_mask else ()),
            query.device.index, None if attn_bias is not None else lambda: _lengths_free(signature, query, key, value))
        if dropout_p > 0.0 and compute_log_sumexp and found.first is None:
            found = _dropout_guard(signature, query, key, value, window, attn_bias, dropout_p) or found
        strict = scope.strict()

        def serve():
            # Drawn only once the call is served: a fallback consumes no RNG state, so PyTorch's
            # kernel then draws exactly what it would have drawn natively.
            philox = rows.new_philox(query.device, 4) if dropout_p > 0.0 else None  # elements 0, 2: aligned
            given = _as_lengths(padding) if padding is not None else dict(
                bias=attn_bias, dropout_p=float(dropout_p), signature=signature,
                philox=(philox[0], philox[2]) if philox is not None else None)
            out, lse = dense.forward(query, key, value, scale=_scale(scale, query), window=window,
                                     compute_lse=compute_log_sumexp, **given)
            if compute_log_sumexp:  # a backward can follow: the LSE it will receive is the marker
                markers.mark(lse, markers.Record(served=True, strict=strict, padding=padding))
            seed, offset = _unused_philox(query.device) if philox is None else (philox[0], philox[2])
            return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, None

        def native(reason):  # operands PyTorch's cuDNN kernel would misread are copied first
            if reason.slug == _KNOWN:
                return _composite_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p, window, scale)
            q, k, v = (layout.for_native(t) for t in (query, key, value))
            result = self.fwd_original.call_boxed(keyset, q, k, v, attn_bias, compute_log_sumexp, dropout_p,
                                                  is_causal, return_debug_mask, scale=scale)
            if compute_log_sumexp:
                _mark(result[1], markers.Record(served=False, reason=reason.slug))
            return result

        return route.call("dense_fwd", found, serve, native, lambda: describe_call(
            query=query, key=key, value=value, attn_bias=attn_bias, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale), strict=strict)

    def backward(self, keyset, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                 cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        window = _WINDOWS[bool(is_causal)]

        def native(reason=None, fix=True):  # as the forward's fallback; ``fix=False``: as given
            if reason is not None and reason.slug == _KNOWN:
                if dropout_p > 0.0 and record.served:  # cuDNN drew the forward's mask: no composite redraws it
                    raise RuntimeError(f"cudnn-sdpa-provider: dense_bwd cannot run: {reason.message}, and the "
                                       "forward's dropout mask was drawn by cuDNN, which only cuDNN can reproduce")
                return _composite_backward(grad_out, query, key, value, attn_bias, philox_seed, philox_offset,
                                           dropout_p, window, scale)
            ops = (grad_out, query, key, value, out)
            do, q, k, v, o = (layout.for_native(t) for t in ops) if fix else ops
            return self.bwd_original.call_boxed(keyset, do, q, k, v, o, logsumexp, philox_seed, philox_offset,
                                                attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                                scale=scale)

        record = markers.lookup(logsumexp)
        if record is None:  # the forward ran outside the provider: not ours to count, nor to change
            return native(fix=False)
        describe = lambda: describe_call(query=query, key=key, value=value, grad_out=grad_out,  # noqa: E731
                                         attn_bias=attn_bias, is_causal=is_causal, scale=scale)
        if not record.served:
            return route.call("dense_bwd", route.fixed(record.reason, "its forward fell back"), None, native, describe,
                              strict=False)
        deterministic = torch.are_deterministic_algorithms_enabled()
        padding = record.padding  # the forward's decision, never read again: the backward runs what it ran
        bias = None if padding is not None else attn_bias
        if padding is not None:
            window = padding.window
        signature = ("sdpa_bwd", query.device.index, tensor_key(grad_out), tensor_key(query), tensor_key(key),
                     tensor_key(value), tensor_key(out), tensor_key(logsumexp),
                     tensor_key(bias) if padding is None else ("padding", window), dropout_p, window, deterministic,
                     scale)
        found = route.entry(signature, lambda: route.dense_problem(
            query, key, value, backward=True, window=window, bias=bias, dropout_p=dropout_p, padded=padding is not None,
            deterministic=deterministic), query.device.index)

        def serve():
            given = _as_lengths(padding) if padding is not None else dict(
                bias=attn_bias, dropout_p=dropout_p, philox=(philox_seed, philox_offset), signature=signature)
            dq, dk, dv, _ = dense.backward(grad_out, query, key, value, out, logsumexp, scale=_scale(scale, query),
                                           window=window, deterministic=deterministic, **given)
            return dq, dk, dv

        # Our forward's out and lse have native cuDNN's meaning (natural-log stats, same layout), so
        # PyTorch's backward kernel is a valid fallback for a served forward.
        return route.call("dense_bwd", found, serve, native, describe, strict=record.strict)


# ------------------------------------------------------------------------------ dense, counted


class _Counted:
    """Counts calls PyTorch routed to another backend, then runs the original kernel.

    Forward kernels mark their LSE output (``markers``) with the reason; backward kernels count
    only when the LSE they receive carries such a mark, so a backward is counted exactly when its
    forward was, whenever and on whatever thread it runs."""

    marks_lse = True

    def __init__(self, op, original, path: str, backward: bool, bias_arg: str | None):
        self.op = op
        self.original = original
        self.path = path
        self.backward = backward
        self.bias_arg = bias_arg
        self.name = op._schema.name.split("::")[1]

    def entry(self, a) -> route.Entry:
        q, k, v = a["query"], a["key"], a["value"]
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            if q.device.type != "cuda":
                return route.fixed("no_cuda", f"inputs are on {q.device.type!r}")
            return route.fixed("rank", f"inputs of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                                       "are not 4-D")
        bias = a.get(self.bias_arg) if self.bias_arg else None
        dropout_p = float(a.get("dropout_p", 0.0) or 0.0)
        window = _WINDOWS[bool(a.get("is_causal", False))]
        bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
        signature = (self.name, q.device.index, tensor_key(q), tensor_key(k), tensor_key(v), tensor_key(bias),
                     bias_grad, dropout_p, window, self.backward)
        return route.elsewhere(signature, lambda: route.dense_problem(
            q, k, v, backward=self.backward, window=window, bias=bias, dropout_p=dropout_p), q.device.index)

    def __call__(self, keyset, *args, **kwargs):
        a = _bind(self.op, args, kwargs)
        run = lambda reason=None: self.original.call_boxed(keyset, *args, **kwargs)  # noqa: E731
        if _traced(a["query"]):  # torch.compile / tracing: counted where the compiled code runs, not here
            return run()
        if self.backward:
            record = markers.lookup(a.get("logsumexp"))
            if record is None:
                return run()
            return route.call(self.path, route.fixed(record.reason, "its forward fell back"), None, run,
                              lambda: "", strict=False)
        strict = scope.strict()

        def native(reason):
            result = run()
            lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
            if self.marks_lse:
                _mark(lse, markers.Record(served=False, reason=reason.slug))
            self.after(result, reason)
            return result

        return route.call(self.path, self.entry(a), None, native, lambda: f"{self.name}: " + describe_call(
            query=a["query"], key=a["key"], value=a["value"], dropout_p=a.get("dropout_p"),
            is_causal=a.get("is_causal")), strict=strict)

    def after(self, result, reason) -> None:
        """Hook for subclasses (the math kernel counts its backward here)."""


class _CountedMath(_Counted):
    """The math composite runs under autograd; its backward is many ops, counted by a hook on
    the output's gradient (a fresh tensor per call, so hooks never pile up)."""

    marks_lse = False  # its second output is the attention weights, which no backward kernel reads

    def after(self, result, reason) -> None:
        out = result[0]
        if out.requires_grad:
            out.register_hook(lambda grad, slug=reason.slug: route.call(
                "dense_bwd", route.fixed(slug, "its forward fell back"), None, lambda r: None, lambda: "",
                strict=False))


# ------------------------------------------------------------------------------- registrations

_DENSE_COUNTED = (
    # op name, dispatch key, path, is backward, bias argument
    ("_scaled_dot_product_efficient_attention", "CUDA", "dense_fwd", False, "attn_bias"),
    ("_scaled_dot_product_efficient_attention_backward", "CUDA", "dense_bwd", True, "attn_bias"),
    ("_scaled_dot_product_flash_attention", "CUDA", "dense_fwd", False, None),
    ("_scaled_dot_product_flash_attention_backward", "CUDA", "dense_bwd", True, None),
    ("_scaled_dot_product_flash_attention_for_cpu", "CPU", "dense_fwd", False, "attn_mask"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "CPU", "dense_bwd", True, "attn_mask"),
)
_MATH = "_scaled_dot_product_attention_math"


def _op(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name).default


_ORIGINALS: dict = {}


def _original(op, key: str):
    """PyTorch's kernel for ``op`` at ``key``, fetched before any override of ours and kept, so a
    fallback always reaches the C++ kernel even while our registrations come and go."""
    name = (op._schema.name, key)
    if name not in _ORIGINALS:
        try:
            _ORIGINALS[name] = torch.library.get_kernel(op, key)
        except RuntimeError:  # e.g. no CUDA kernels in a CPU-only build: nothing to wrap
            _ORIGINALS[name] = None
    return _ORIGINALS[name]


class Hooks:
    """The provider's dispatcher registrations. Forward hooks live while the provider is enabled;
    backward hooks can outlive them (removed once no marked forward can still be differentiated)."""

    def __init__(self):
        self.problems: list[tuple[str, str]] = []
        self._fwd = self._bwd = None
        self._varlen = _varlen_ops()
        dense_fwd = _op("aten", "_scaled_dot_product_cudnn_attention")
        dense_bwd = _op("aten", "_scaled_dot_product_cudnn_attention_backward")
        self._dense = _Dense(_original(dense_fwd, "CUDA"), _original(dense_bwd, "CUDA"))
        self._counted = []
        for name, key, path, backward, bias_arg in _DENSE_COUNTED:
            op = _op("aten", name)
            if _original(op, key) is not None:
                self._counted.append((op, key, _Counted(op, _original(op, key), path, backward, bias_arg)))
        math_op = _op("aten", _MATH)
        for key in ("AutogradCUDA", "AutogradCPU"):
            self._counted.append((math_op, key, _CountedMath(math_op, _original(math_op, key), "dense_fwd", False,
                                                             "attn_mask")))
        self._varlen_kernels = None
        v = self._varlen
        if not self._dense.fwd_original or not self._dense.bwd_original:
            self._dense = None  # a torch without CUDA kernels: CUDA calls cannot happen
        if v and v["_varlen_attn"] is not None and v["_varlen_attn_backward"] is not None and self._dense is not None:
            fwd, bwd, out, inplace = v["_varlen_attn"], v["_varlen_attn_backward"], v["_varlen_attn_out"], _inplace_op()
            if inplace is not None and _original(inplace, "CUDA") is None:
                inplace = None
            self._varlen_kernels = _Varlen(fwd, _original(fwd, "CUDA"), bwd, _original(bwd, "CUDA"), out,
                                           _original(out, "CUDA") if out is not None else None, inplace,
                                           _original(inplace, "CUDA") if inplace is not None else None)
        elif self._dense is not None:
            self.problems.append(("varlen_unavailable", "torch.nn.attention.varlen is not in this torch"))

    def _impl(self, libs: dict, op, fn, key: str) -> None:
        namespace, name = op._schema.name.split("::")
        lib = libs.get(namespace)
        if lib is None:
            lib = libs[namespace] = torch.library.Library(namespace, "IMPL")
        try:
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel" is the point of a provider.
                warnings.filterwarnings("ignore", message=".*previously registered kernel.*")
                warnings.filterwarnings("ignore", message=".*other operators may also be overridden.*")
                lib.impl(name, fn, key, with_keyset=True)
        except RuntimeError as exc:  # torch <= 2.12: another Python override already holds this op
            self.problems.append(("override_collision", f"{op._schema.name} ({key}): {exc}"))

    def install_forward(self) -> None:
        if self._fwd is not None:
            return
        libs: dict = {}
        if self._dense is not None:
            self._impl(libs, _op("aten", "_scaled_dot_product_cudnn_attention"), self._dense.forward, "CUDA")
        for op, key, kernel in self._counted:
            if not kernel.backward:
                self._impl(libs, op, kernel, key)
        if self._varlen_kernels is not None:
            v = self._varlen
            self._impl(libs, v["_varlen_attn"], self._varlen_kernels.forward, "CUDA")
            if v["_varlen_attn_out"] is not None:
                self._impl(libs, v["_varlen_attn_out"], self._varlen_kernels.forward_out, "CUDA")
            if self._varlen_kernels.inplace_op is not None:
                self._impl(libs, self._varlen_kernels.inplace_op, self._varlen_kernels.inplace, "CUDA")
        self._fwd = libs

    def install_backward(self) -> None:
        if self._bwd is not None:
            return
        libs: dict = {}
        if self._dense is not None:
            self._impl(libs, _op("aten", "_scaled_dot_product_cudnn_attention_backward"), self._dense.backward, "CUDA")
        for op, key, kernel in self._counted:
            if kernel.backward:
                self._impl(libs, op, kernel, key)
        if self._varlen_kernels is not None:
            self._impl(libs, self._varlen["_varlen_attn_backward"], self._varlen_kernels.backward, "CUDA")
        self._bwd = libs

    @staticmethod
    def _destroy(libs) -> None:
        for lib in (libs or {}).values():
            lib._destroy()

    def remove_forward(self) -> None:
        self._destroy(self._fwd)
        self._fwd = None

    def remove_backward(self) -> None:
        self._destroy(self._bwd)
        self._bwd = None

    @property
    def forward_active(self) -> bool:
        return self._fwd is not None

    @property
    def backward_active(self) -> bool:
        return self._bwd is not None
