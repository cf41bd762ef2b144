"""The varlen_attn kernels the provider registers (``overrides.Hooks`` registers them): the
torch_attn ops' forward, ``out`` form and backward, bound by argument name (their schemas differ
across torch 2.11-2.15). Served on cuDNN's ragged graphs (``packed``), or with a paged KV cache
(``block_table`` and ``seqused_k``, torch 2.12+) on the paged graph (``paged``); else PyTorch's
kernel, with a reason (``route``).

Which calls are ours to serve follows the rule of the dense path (``route.elsewhere``): while the
user's backend flags exclude cuDNN the call is not served (``backend_disabled``), on every torch;
on torch 2.15, whose wrapper picks the backend itself and passes it as the ops' trailing
``backend`` (1 FlashAttention, 3 cuDNN), a call torch sent to FlashAttention is counted
(``torch_selection``) and runs there. A backward follows what its forward recorded.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.nn.attention import SDPBackend

from ..core import markers, scope
from ..core.reasons import Slug
from ..engine import packed, paged
from ..ops import composite, paged_ops, route
from ..engine.binding import tensor_key
from ..ops.route import describe_call

__all__ = ["VARLEN_ARGUMENTS", "FLASH_BACKEND", "CUDNN_BACKEND", "Varlen", "bind", "scale_of", "unknown_arguments",
           "sent_elsewhere", "odd_paged_arguments", "varlen_ops", "inplace_op"]

#: Kept off PyTorch's cuDNN kernels as well as ours (they run on the same cuDNN): a packed call with a
#: known-issue row runs on the aten composite (overrides says why).
_KNOWN = Slug.CUDNN_KNOWN_ISSUE.value
_tls = threading.local()  # .native_out: inside our own _varlen_attn_out fallback (its kernel is counted already)


def bind(op, args, kwargs) -> dict:
    """An op call's arguments by schema name."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def scale_of(scale, q) -> float:
    return float(scale) if scale is not None else q.shape[-1] ** -0.5



#: torch 2.15's ``backend`` argument of the torch_attn ops (SDPBackend values as ints).
FLASH_BACKEND = int(SDPBackend.FLASH_ATTENTION)  # 1
CUDNN_BACKEND = int(SDPBackend.CUDNN_ATTENTION)  # 3

#: What the provider does with each argument of torch_attn::_varlen_attn (2.11 - 2.15 schemas):
#: "serve" (read and honoured), "paged" (with both: a paged KV cache, served on cuDNN's paged graph;
#: seqused_k alone falls back with paged_kv), "hint" (a performance hint for FlashAttention's kernel
#: with no effect on the result; cuDNN plans for itself), "backend" (2.15: the backend torch chose;
#: ``CUDNN_BACKEND`` is served, ``FLASH_BACKEND`` counted ``torch_selection``, any other value
#: ``unsupported_argument``). Any other argument a newer torch adds falls back with
#: ``unsupported_argument`` unless it has its schema default.
VARLEN_ARGUMENTS = {
    "query": "serve", "key": "serve", "value": "serve", "cu_seq_q": "serve", "cu_seq_k": "serve", "max_q": "serve",
    "max_k": "serve", "is_causal": "serve", "scale": "serve", "window_size": "serve", "enable_gqa": "serve",
    "seqused_k": "paged", "block_table": "paged", "num_splits": "hint", "out": "serve", "backend": "backend",
    # backward-only
    "grad_out": "serve", "lse": "serve", "rng_state": "serve",
}


def unknown_arguments(op, a) -> tuple:
    """Names of arguments this provider does not know, passed with a value other than their default,
    and a ``backend`` that is neither FlashAttention nor cuDNN."""
    found = []
    for arg in op._schema.arguments:
        if arg.name not in a:
            continue
        rule = VARLEN_ARGUMENTS.get(arg.name)
        if rule == "backend":
            if a[arg.name] not in (FLASH_BACKEND, CUDNN_BACKEND):
                found.append(arg.name)
        elif rule is None and (not arg.has_default_value() or a[arg.name] != arg.default_value):
            found.append(arg.name)
    return tuple(found)


def sent_elsewhere(a) -> bool:
    """A varlen forward the provider must not serve: the user's flags exclude cuDNN (the dense
    path's rule, ``route.user_excludes_cudnn``), or torch 2.15 sent it to FlashAttention. Never
    asked of a backward, which follows its forward."""
    return route.user_excludes_cudnn() or a.get("backend") == FLASH_BACKEND


def odd_paged_arguments(q, k, v, cu_q, table, used) -> tuple:
    """The paged arguments of a varlen_attn call the provider does not serve as given (it then falls
    back with ``unsupported_argument``, and PyTorch's kernel takes or refuses them)."""
    batch = cu_q.shape[0] - 1
    odd = []
    if k.dim() != 4 or v.dim() != 4 or k.shape[:2] != v.shape[:2]:
        odd.append("key/value (not (pages, page_size, H, D) pools of one shape)")
    if table.dim() != 2 or table.shape[0] != batch or table.dtype != torch.int32 or table.device != q.device:
        odd.append("block_table (not (B, pages) int32 on q's device)")
    if used.dim() != 1 or used.shape[0] != batch or used.dtype != torch.int32 or used.device != q.device:
        odd.append("seqused_k (not (B,) int32 on q's device)")
    if cu_q.dtype != torch.int32:
        odd.append("cu_seq_q (not int32)")
    return tuple(odd)


@contextlib.contextmanager
def _native_out():
    before = getattr(_tls, "native_out", False)
    _tls.native_out = True
    try:
        yield
    finally:
        _tls.native_out = before


class Varlen:
    """torch_attn varlen ops (schemas differ across torch 2.11-2.15, so arguments are bound by name),
    and torch 2.15's ``aten::_cudnn_attention_forward_no_dropout_inplace`` (``inplace``)."""

    def __init__(self, fwd_op, fwd_original, bwd_op, bwd_original, out_op=None, out_original=None, inplace_op=None,
                 inplace_original=None):
        self.fwd_op, self.fwd_original = fwd_op, fwd_original
        self.bwd_op, self.bwd_original = bwd_op, bwd_original
        self.out_op, self.out_original = out_op, out_original
        self.inplace_op, self.inplace_original = inplace_op, inplace_original

    @staticmethod
    def _options(a) -> tuple[tuple[int, int], float | None]:
        left, right = list(a.get("window_size") or [-1, -1])
        if a.get("is_causal"):
            right = 0
        return (int(left), int(right)), a.get("scale")

    def _entry(self, op, a, backward: bool, bottom_right: bool = True) -> route.Entry:
        q, k, v = a["query"], a["key"], a["value"]
        cu_q = a["cu_seq_q"]
        window, scale = self._options(a)
        table, used = a.get("block_table"), a.get("seqused_k")
        unknown = unknown_arguments(op, a)
        decide = route.elsewhere if not backward and sent_elsewhere(a) else route.entry
        if table is not None and used is not None:  # a paged KV cache: (pages, page_size, H_k, D) pools
            unknown += odd_paged_arguments(q, k, v, cu_q, table, used)
            signature = (op._schema.name, "paged", q.device.index, tensor_key(q), tensor_key(k), tensor_key(v),
                         cu_q.shape, a["max_q"], tensor_key(table), window, unknown, backward)
            return decide(signature, lambda: paged_ops.problem(
                q.new_empty((cu_q.shape[0] - 1, q.shape[1], a["max_q"], q.shape[2]), device="meta"), k.transpose(1, 2),
                v.transpose(1, 2), table, None, window, True, backward, unknown), q.device.index)
        paged = used is not None or table is not None
        deterministic = backward and torch.are_deterministic_algorithms_enabled()
        signature = (op._schema.name, q.device.index, route.varlen_key(q, k, v), cu_q.shape, a["max_q"], a["max_k"],
                     window, bottom_right, paged, unknown, deterministic)
        return decide(signature, lambda: route.varlen_problem(
            q, k, v, cu_q, a["max_q"], a["max_k"], backward=backward, window=window, bottom_right=bottom_right,
            deterministic=deterministic, paged=paged, unsupported=unknown), q.device.index)

    def _serve_fwd(self, a, bottom_right: bool = True):
        q, k, v = a["query"], a["key"], a["value"]
        cu_q = a["cu_seq_q"]
        if a.get("block_table") is not None:  # decided by _entry: with seqused_k, int32 on q's device
            window, scale = self._options(a)
            q_padded, lens_q, index, bad = paged_ops.pack_query(q, cu_q, a["max_q"])
            out, lse = paged.forward(q_padded, k.transpose(1, 2), v.transpose(1, 2), a["block_table"], lens_q,
                                     a["seqused_k"], scale=scale_of(scale, q), window=window, bottom_right=True)
            out, lse = paged_ops.unpack(out, lse, index, bad, q)
            return out, lse.t().contiguous()
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
        window, scale = self._options(a)
        # FlashAttention aligns causal masks and windows to the bottom right of each sequence.
        out, lse = packed.forward(q, k, v, cu_q, cu_k, a["max_q"], a["max_k"], scale=scale_of(scale, q),
                                  window=window, bottom_right=bottom_right)
        return out, lse.t().contiguous()  # torch_attn's convention is (H, T)

    def _composite(self, a, bottom_right: bool = True):
        """(out, lse (H, T)) of a packed call from the aten composite (no paged cache)."""
        q, k, v, cu_q = a["query"], a["key"], a["value"], a["cu_seq_q"]
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
        window, scale = self._options(a)
        out, lse = composite.varlen_fwd(q, k, v, cu_q, cu_k, a["max_q"], a["max_k"], None, scale_of(scale, q), window,
                                        bottom_right)
        return out, lse.t().contiguous()

    @staticmethod
    def _known(reason, a) -> bool:
        return reason is not None and reason.slug == _KNOWN and a.get("block_table") is None

    def forward(self, keyset, *args, **kwargs):
        a = bind(self.fwd_op, args, kwargs)
        strict = scope.strict()

        def serve():
            out, lse = self._serve_fwd(a)
            rng_state = torch.zeros(2, dtype=torch.uint64, device=out.device)
            markers.mark(rng_state, markers.Record(served=True, strict=strict))
            return out, lse, rng_state

        def native(reason):
            if self._known(reason, a):
                out, lse = self._composite(a)
                result = out, lse, torch.zeros(2, dtype=torch.uint64, device=out.device)
            else:
                result = self.fwd_original.call_boxed(keyset, *args, **kwargs)
            markers.mark(result[2], markers.Record(served=False, reason=reason.slug))
            return result

        return route.call("varlen_fwd", self._entry(self.fwd_op, a, False), serve, native,
                          lambda: describe_call(query=a["query"], key=a["key"], value=a["value"]), strict=strict)

    def forward_out(self, keyset, *args, **kwargs):
        a = bind(self.out_op, args, kwargs)

        def serve():
            out, lse = self._serve_fwd(a)
            a["out"].copy_(out)
            return lse

        def native(reason):
            if self._known(reason, a):
                out, lse = self._composite(a)
                a["out"].copy_(out)
                return lse
            with _native_out():  # torch 2.15's cuDNN branch calls ``inplace``: this call is counted here
                return self.out_original.call_boxed(keyset, *args, **kwargs)

        return route.call("varlen_fwd", self._entry(self.out_op, a, False), serve, native,
                          lambda: describe_call(query=a["query"], out=a["out"]))

    def inplace(self, keyset, *args, **kwargs):
        """``aten::_cudnn_attention_forward_no_dropout_inplace`` (torch 2.15+: varlen_attn_out on cuDNN).
        Reached from our own ``_varlen_attn_out`` fallback it is that call's native kernel, counted
        there; any other call is a varlen forward of its own, decided by the same rules. Without
        ``seqused_k`` cuDNN aligns a causal mask of packed sequences to the top left (torch 2.15's
        varlen.py), so it is served top-left; with a paged cache, bottom-right, as the paged path does."""
        if getattr(_tls, "native_out", False):
            return self.inplace_original.call_boxed(keyset, *args, **kwargs)
        a = bind(self.inplace_op, args, kwargs)
        a["cu_seq_q"], a["cu_seq_k"] = a.pop("cum_seq_q"), a.pop("cum_seq_k", None)
        bottom_right = a.get("seqused_k") is not None

        def serve():
            out, lse = self._serve_fwd(a, bottom_right)
            a["out"].copy_(out)
            return lse

        def native(reason):
            if self._known(reason, a):
                out, lse = self._composite(a, bottom_right)
                a["out"].copy_(out)
                return lse
            return self.inplace_original.call_boxed(keyset, *args, **kwargs)

        return route.call("varlen_fwd", self._entry(self.inplace_op, a, False, bottom_right), serve, native,
                          lambda: describe_call(query=a["query"], out=a["out"]))

    def backward(self, keyset, *args, **kwargs):
        a = bind(self.bwd_op, args, kwargs)

        def native(reason=None):
            if self._known(reason, a):
                cu_q = a["cu_seq_q"]
                cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
                window, scale = self._options(a)
                q = a["query"]
                return composite.varlen_bwd(a["grad_out"], q, a["key"], a["value"], cu_q, cu_k, a["max_q"],
                                            a["max_k"], None, scale_of(scale, q), window, True)[:3]
            return self.bwd_original.call_boxed(keyset, *args, **kwargs)

        record = markers.lookup(a["rng_state"])
        if record is None:
            return native()
        q, k, v = a["query"], a["key"], a["value"]
        describe = lambda: describe_call(query=q, key=k, value=v, grad_out=a["grad_out"])  # noqa: E731
        if not record.served:
            return route.call("varlen_bwd", route.fixed(record.reason, "its forward fell back"), None, native,
                              describe, strict=False)

        def serve():
            cu_q = a["cu_seq_q"]
            cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else cu_q
            window, scale = self._options(a)
            dq, dk, dv, _ = packed.backward(a["grad_out"], q, k, v, a["out"], a["lse"].t(), cu_q, cu_k, a["max_q"],
                                            a["max_k"], scale=scale_of(scale, q), window=window, bottom_right=True,
                                            deterministic=torch.are_deterministic_algorithms_enabled())
            return dq, dk, dv

        # Our forward's lse is flash's (H, T) natural-log LSE, so flash's backward can use it.
        return route.call("varlen_bwd", self._entry(self.bwd_op, a, True), serve, native, describe,
                          strict=record.strict)


def varlen_ops():
    """The torch_attn varlen ops of this torch (2.10+), importing their module first."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  (defines torch_attn::*)
    except Exception:
        return None
    ns = torch.ops.torch_attn
    names = ("_varlen_attn", "_varlen_attn_backward", "_varlen_attn_out")
    return {n: (getattr(ns, n).default if hasattr(ns, n) else None) for n in names}


def inplace_op():
    """torch 2.15's ``aten::_cudnn_attention_forward_no_dropout_inplace``, or None before 2.15."""
    name = "_cudnn_attention_forward_no_dropout_inplace"
    return getattr(torch.ops.aten, name).default if hasattr(torch.ops.aten, name) else None
