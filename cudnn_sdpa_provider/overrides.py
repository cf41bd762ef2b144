"""Kernels the provider registers over PyTorch's attention ops while it is enabled.

Served (our cuDNN graphs, ``engine``):
  aten::_scaled_dot_product_cudnn_attention (+ _backward)   CUDA   -> dense_fwd / dense_bwd
  torch_attn::_varlen_attn (+ _backward, _varlen_attn_out)   CUDA   -> varlen_fwd / varlen_bwd
Each falls back to the kernel it replaced (fetched with ``torch.library.get_kernel`` before the
override is registered), so a fallback is PyTorch's own C++ path, bit-exact with native.

Counted only (every other backend PyTorch's selector can pick; the original kernel runs):
  aten::_scaled_dot_product_{efficient,flash}_attention (+ _backward)  CUDA
  aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward)       CPU
  aten::_scaled_dot_product_attention_math   AutogradCUDA/AutogradCPU (its backward is counted
                                             by a hook on the output's gradient)

A backward follows its forward through ``markers``: the served forward returns philox/rng
tensors whose storage is recorded; the backward kernel looks it up. The backward overrides stay
registered after the scope exits while any such forward can still be differentiated.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from . import counters, engine, markers, support
from .errors import FallbackError, NotSupportedError

log = logging.getLogger("cudnn_sdpa_provider")

__all__ = ["Hooks", "describe_call"]


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


def _strict() -> bool:
    from . import activation

    return activation.strict()


def _fallback(path: str, reason: str, detail: str, inputs) -> None:
    """Record a fallback (or raise in strict mode); log once per configuration."""
    if _strict():
        raise FallbackError(path, [reason], inputs() if callable(inputs) else inputs, [detail])
    counters.record(path, reason)
    counters.log_once((path, reason, detail), logging.INFO, "%s falls back (%s): %s", path, reason, detail)


def _bind(op, args, kwargs) -> dict:
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _route_reason(q, k, v, *, backward: bool, is_causal=False, bias=None, dropout_p=0.0) -> tuple[str, str]:
    """Why a call that PyTorch sent to a non-cuDNN kernel is not ours: our first reason, or
    ``torch_selection`` when we could have served it but PyTorch's own checks chose otherwise."""
    if q.device.type != "cuda":
        return "no_cuda", f"inputs are on {q.device.type!r}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "rank", f"inputs of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} are not 4-D"
    problem = engine.dense_problem(q, k, v, backward=backward, window=(-1, 0) if is_causal else (-1, -1),
                                   bias=bias, dropout_p=dropout_p)
    caps = support.capabilities(q.device.index if q.device.type == "cuda" else None)
    found = support.reasons(problem, caps)
    if found:
        return found[0].slug, found[0].message
    return "torch_selection", f"PyTorch's SDPA selector did not pick cuDNN for {problem.describe()}"


# ------------------------------------------------------------------------------- dense, served


def _scale(scale, q) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


_UNUSED_PHILOX: dict = {}


def _unused_philox(device: torch.device) -> torch.Tensor:
    """One int64 buffer per device whose elements 0 and 2 (16-byte aligned, as inductor asserts
    of outputs) stand in for the philox seed/offset outputs when there is no dropout: the op must
    return them, nothing reads them, and a shared buffer costs no allocation per call."""
    found = _UNUSED_PHILOX.get(device)
    if found is None:
        found = _UNUSED_PHILOX.setdefault(device, torch.zeros(4, dtype=torch.int64, device=device))
    return found


class _Dense:
    """The dense cuDNN op pair: serve, or run the original kernel."""

    def __init__(self, fwd_original, bwd_original):
        self.fwd_original = fwd_original
        self.bwd_original = bwd_original

    def forward(self, keyset, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        window = (-1, 0) if is_causal else (-1, -1)
        try:
            if return_debug_mask:
                raise NotSupportedError("dropout", "return_debug_mask=True (the dropout debug mask)")
            philox = None
            if dropout_p > 0.0 or attn_bias is not None:
                # Decide before drawing dropout's Philox pair: a fallback must consume no RNG state,
                # so PyTorch's kernel then draws exactly what it would have drawn natively.
                engine.check(engine.dense_problem(query, key, value, window=window, bias=attn_bias,
                                                  dropout_p=dropout_p), query.device)
                # seed and offset are elements 0 and 2: each 16-byte aligned, as inductor asserts of outputs.
                philox = engine.new_philox(query.device, 4) if dropout_p > 0.0 else None
            # Without bias or dropout the engine checks for itself, and only when its fast path
            # has not seen this call signature before (a seen one passed the same check).
            out, lse = engine.dense_fwd(query, key, value, scale=_scale(scale, query), window=window, bias=attn_bias,
                                        dropout_p=dropout_p, compute_lse=compute_log_sumexp,
                                        philox=(philox[0], philox[2]) if philox is not None else None,
                                        checked=philox is not None or attn_bias is not None)
        except NotSupportedError as exc:
            inputs = lambda: describe_call(query=query, key=key, value=value, attn_bias=attn_bias,  # noqa: E731
                                           dropout_p=dropout_p, is_causal=is_causal, scale=scale)
            _fallback("dense_fwd", exc.reason, exc.detail, inputs)
            result = self.fwd_original.call_boxed(keyset, query, key, value, attn_bias, compute_log_sumexp, dropout_p,
                                                  is_causal, return_debug_mask, scale=scale)
            if compute_log_sumexp and isinstance(result[1], torch.Tensor) and result[1].numel() > 0:
                markers.mark(result[1], markers.Record("dense", served=False, reason=exc.reason))
            return result
        counters.record("dense_fwd")
        if compute_log_sumexp:  # a backward can follow: the LSE it will receive is the marker
            markers.mark(lse, markers.Record("dense", served=True))
        if philox is None:  # without dropout the pair's values are never read
            philox = _unused_philox(query.device)
        return out, lse, None, None, query.shape[2], key.shape[2], philox[0], philox[2], None

    def backward(self, keyset, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                 cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        def original():
            return self.bwd_original.call_boxed(keyset, grad_out, query, key, value, out, logsumexp, philox_seed,
                                                philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                                dropout_p, is_causal, scale=scale)

        record = markers.lookup(logsumexp)
        if record is None:  # the forward ran outside the provider: not ours to count
            return original()
        if not record.served:
            counters.record("dense_bwd", record.reason)
            return original()
        try:
            dq, dk, dv, _ = engine.dense_bwd(grad_out, query, key, value, out, logsumexp, scale=_scale(scale, query),
                                             window=(-1, 0) if is_causal else (-1, -1), bias=attn_bias,
                                             dropout_p=dropout_p, philox=(philox_seed, philox_offset),
                                             deterministic=torch.are_deterministic_algorithms_enabled())
        except NotSupportedError as exc:
            inputs = lambda: describe_call(query=query, key=key, value=value, grad_out=grad_out,  # noqa: E731
                                           attn_bias=attn_bias, is_causal=is_causal, scale=scale)
            _fallback("dense_bwd", exc.reason, exc.detail, inputs)
            # Our forward's out and lse have native cuDNN's meaning (natural-log stats, same
            # layout), so PyTorch's backward kernel is a valid fallback for a served forward.
            return original()
        counters.record("dense_bwd")
        return dq, dk, dv


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

    def _reason(self, a) -> tuple[str, str]:
        return _route_reason(a["query"], a["key"], a["value"], backward=self.backward,
                             is_causal=bool(a.get("is_causal", False)),
                             bias=a.get(self.bias_arg) if self.bias_arg else None,
                             dropout_p=float(a.get("dropout_p", 0.0) or 0.0))

    def __call__(self, keyset, *args, **kwargs):
        a = _bind(self.op, args, kwargs)
        if self.backward:
            record = markers.lookup(a.get("logsumexp"))
            if record is not None:
                counters.record(self.path, record.reason)
            return self.original.call_boxed(keyset, *args, **kwargs)
        reason, detail = self._reason(a)
        _fallback(self.path, reason, f"{self.op._schema.name.split('::')[1]}: {detail}",
                  lambda: describe_call(query=a["query"], key=a["key"], value=a["value"],
                                        dropout_p=a.get("dropout_p"), is_causal=a.get("is_causal")))
        result = self.original.call_boxed(keyset, *args, **kwargs)
        lse = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
        if self.marks_lse and isinstance(lse, torch.Tensor) and lse.numel() > 0:
            markers.mark(lse, markers.Record("dense", served=False, reason=reason))
        return result


class _CountedMath(_Counted):
    """The math composite runs under autograd; its backward is many ops, counted by a hook on
    the output's gradient (a fresh tensor per call, so hooks never pile up)."""

    marks_lse = False  # its second output is the attention weights, which no backward kernel reads

    def __call__(self, keyset, *args, **kwargs):
        reason, _ = self._reason(_bind(self.op, args, kwargs))
        result = super().__call__(keyset, *args, **kwargs)
        out = result[0]
        if out.requires_grad:
            out.register_hook(lambda grad, reason=reason: counters.record("dense_bwd", reason))
        return result


# -------------------------------------------------------------------------------------- varlen


class _Varlen:
    """torch_attn varlen ops (schemas differ across torch 2.11-2.15, so arguments are bound by name)."""

    def __init__(self, fwd_op, fwd_original, bwd_op, bwd_original, out_op=None, out_original=None):
        self.fwd_op, self.fwd_original = fwd_op, fwd_original
        self.bwd_op, self.bwd_original = bwd_op, bwd_original
        self.out_op, self.out_original = out_op, out_original

    @staticmethod
    def _options(a) -> tuple[tuple[int, int], float | None]:
        left, right = list(a.get("window_size") or [-1, -1])
        if a.get("is_causal"):
            right = 0
        return (int(left), int(right)), a.get("scale")

    def _serve_fwd(self, a):
        if a.get("seqused_k") is not None or a.get("block_table") is not None:
            raise NotSupportedError("paged_kv", "seqused_k/block_table (paged KV) are not served")
        q, k, v = a["query"], a["key"], a["value"]
        cu_q = a["cu_seq_q"]
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
        window, scale = self._options(a)
        out, lse = engine.varlen_fwd(q, k, v, cu_q, cu_k, a["max_q"], a["max_k"], scale=_scale(scale, q),
                                     window=window, bottom_right=True)
        # FlashAttention aligns causal masks and windows to the bottom right of each sequence.
        return out, lse.t().contiguous()  # torch_attn's convention is (H, T)

    def forward(self, keyset, *args, **kwargs):
        a = _bind(self.fwd_op, args, kwargs)
        try:
            out, lse = self._serve_fwd(a)
        except NotSupportedError as exc:
            _fallback("varlen_fwd", exc.reason, exc.detail, lambda: describe_call(query=a["query"], key=a["key"],
                                                                                   value=a["value"]))
            result = self.fwd_original.call_boxed(keyset, *args, **kwargs)
            markers.mark(result[2], markers.Record("varlen", served=False, reason=exc.reason))
            return result
        counters.record("varlen_fwd")
        rng_state = torch.zeros(2, dtype=torch.uint64, device=out.device)
        markers.mark(rng_state, markers.Record("varlen", served=True))
        return out, lse, rng_state

    def forward_out(self, keyset, *args, **kwargs):
        a = _bind(self.out_op, args, kwargs)
        try:
            out, lse = self._serve_fwd(a)
        except NotSupportedError as exc:
            _fallback("varlen_fwd", exc.reason, exc.detail, lambda: describe_call(query=a["query"]))
            return self.out_original.call_boxed(keyset, *args, **kwargs)
        a["out"].copy_(out)
        counters.record("varlen_fwd")
        return lse

    def backward(self, keyset, *args, **kwargs):
        a = _bind(self.bwd_op, args, kwargs)
        record = markers.lookup(a["rng_state"])
        if record is None:
            return self.bwd_original.call_boxed(keyset, *args, **kwargs)
        if not record.served:
            counters.record("varlen_bwd", record.reason)
            return self.bwd_original.call_boxed(keyset, *args, **kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        cu_q = a["cu_seq_q"]
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
        window, scale = self._options(a)
        try:
            dq, dk, dv, _ = engine.varlen_bwd(a["grad_out"], q, k, v, a["out"], a["lse"].t(), cu_q, cu_k, a["max_q"],
                                              a["max_k"], scale=_scale(scale, q), window=window, bottom_right=True,
                                              deterministic=torch.are_deterministic_algorithms_enabled())
        except NotSupportedError as exc:
            _fallback("varlen_bwd", exc.reason, exc.detail, lambda: describe_call(query=q, key=k, value=v))
            # Our forward's lse is flash's (H, T) natural-log LSE, so flash's backward can use it.
            return self.bwd_original.call_boxed(keyset, *args, **kwargs)
        counters.record("varlen_bwd")
        return dq, dk, dv


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


def _varlen_ops():
    """The torch_attn varlen ops of this torch (2.10+), importing their module first."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines torch_attn::*)
    except Exception:
        return None
    ns = torch.ops.torch_attn
    names = ("_varlen_attn", "_varlen_attn_backward", "_varlen_attn_out")
    return {n: (getattr(ns, n).default if hasattr(ns, n) else None) for n in names}


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
            fwd, bwd, out = v["_varlen_attn"], v["_varlen_attn_backward"], v["_varlen_attn_out"]
            self._varlen_kernels = _Varlen(fwd, _original(fwd, "CUDA"), bwd, _original(bwd, "CUDA"), out,
                                           _original(out, "CUDA") if out is not None else None)
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
