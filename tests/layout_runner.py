"""One layout configuration (tests/layouts.py) against native PyTorch, fp32 and the fake kernels.

``run_config(cfg, device)`` builds the operands, runs the call natively (no provider) and through the
provider, and checks, raising AssertionError with every mismatch it found:

* accuracy, per tensor (out, each gradient, the LSE when returned), by the FlashAttention rule used
  in tests/gpu/test_reliability.py: error vs an fp32 reference <= max(3 x the error of native
  PyTorch in the same dtype, a floor); gradient floors grow with the GQA group. Where native cannot
  run the call (a CPU varlen call, a layout FlashAttention refuses), the low-precision composite
  (``reference`` in the input dtype) stands in for it;
* no NaN anywhere (the masks leave every query a key), outputs written (the allocator is poisoned
  with NaN first on CUDA);
* strides of out and every gradient equal native's (same backend as the provider's scope selects),
  or where native did not run, what the fake / meta kernels say; dims of size 1 are ignored;
  native reads operands whose base or strides are not 16-byte aligned from aligned copies (the same
  strides where only the base is off; rows padded to 16 bytes where an outer stride is not aligned:
  its kernels fault on the originals or misread them), and then the fake kernels are the stride
  oracle where the provider served; a CUDA error in native's run is named as native's; a native
  result over ``layout_checks.MISREAD`` x the composite's error is noted, and the composite is the
  base instead;
* counters: the provider's call counts exactly one forward and one backward on its path, served or
  fallback with a catalogued reason, never neither; the native call counts nothing;
* dropout (masks differ between kernels): forward/backward consistency, <dV, V> = <dO, O> and
  <dQ, Q> = <dK, K> exactly in exact arithmetic for any mask, and the output is as far from the
  dropout-free result as native's is.

The checks themselves: tests/layout_checks.py. Batches of configurations run in child processes:
tests/layout_batches.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, reasons
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.core import layout as csp_layout
from tests import layouts
from tests.layout_checks import check_accuracy, check_counts, check_dropout, check_strides, outcome
from tests.util import poison_allocator


@dataclass
class Case:
    """What one API needs: the provider's call, native's, the fp32 reference and the layout rule."""

    paths: tuple
    provider: Callable  # () -> (out, lse or None)
    native: Callable | None
    in_scope: bool  # the provider call runs inside csp.enable()
    reference: Callable  # (q, k, v) fp32 leaves -> (out, lse)
    low: Callable  # () -> (out, lse, (dq, dk, dv)) in the input dtype, by the composite
    rule: Callable  # () -> (out strides, [grad strides]) from the fake / meta kernels
    native_strides: bool = True  # native's strides are the oracle (else ``rule``)


@dataclass
class Result:
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    grads: list = field(default_factory=list)
    delta: counters.Stats | None = None
    error: BaseException | None = None
    fault: BaseException | None = None  # a CUDA error that poisoned the process


# ------------------------------------------------------------------------------------- cases


def _meta(t):
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def _grad_rule(ops):
    return [torch.empty_like(_meta(t)).stride() for t in ops.inputs]


def _dense_rule(ops):
    """aten's meta kernel of the cuDNN op (the layout compiled code plans with); grads empty_like."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(_meta(ops.q), _meta(ops.k), _meta(ops.v), None, False)[0]
    return out.stride(), _grad_rule(ops)


def _by_name(op, **kwargs):
    """Call a torch_attn op with the arguments its schema has (they differ across torch releases)."""
    names = [a.name for a in op._schema.arguments]
    return op(**{k: v for k, v in kwargs.items() if k in names})


def _varlen_rule(cfg, ops):
    """torch's own fake kernels of torch_attn::_varlen_attn(_backward), on meta tensors: what
    compiled code plans with when the provider serves varlen_attn."""
    import torch.nn.attention.varlen  # noqa: F401  (defines torch_attn::*)

    ns = torch.ops.torch_attn
    m = [_meta(t) for t in (ops.q, ops.k, ops.v, ops.cu_q, ops.cu_k)]
    sizes = dict(max_q=max(cfg["lens_q"]), max_k=max(cfg["lens_kv"]), is_causal=False)
    out, lse, rng = _by_name(ns._varlen_attn.default, query=m[0], key=m[1], value=m[2], cu_seq_q=m[3], cu_seq_k=m[4],
                             enable_gqa=cfg["h_q"] != cfg["h_kv"], **sizes)
    grads = _by_name(ns._varlen_attn_backward.default, grad_out=_meta(ops.go), query=m[0], key=m[1], value=m[2],
                     out=out, lse=lse, cu_seq_q=m[3], cu_seq_k=m[4], rng_state=rng, **sizes)
    by_operand = dict(zip((id(ops.q), id(ops.k), id(ops.v)), (g.stride() for g in grads)))
    return out.stride(), [by_operand[id(t)] for t in ops.inputs]


def _fake_rule(ops, call):
    """The strides ``call`` gives on fake copies of the operands (the provider's own fake kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with warnings.catch_warnings():  # converting a non-leaf view reads its .grad (torch warns)
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        fakes = {id(t): mode.from_tensor(t) for t in (ops.q, ops.k, ops.v, ops.go, ops.cu_q, ops.cu_k) if t is not None}
    fake_ops = layouts.Operands(*(fakes[id(t)] for t in (ops.q, ops.k, ops.v, ops.go)),
                                cu_q=fakes.get(id(ops.cu_q)), cu_k=fakes.get(id(ops.cu_k)))
    with mode:
        out = call(fake_ops)
        grads = torch.autograd.grad(out, fake_ops.inputs, fake_ops.go)
    return out.stride(), [g.stride() for g in grads]


def _bias32(mask):
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def _low_dense(cfg, ops, **kw):
    dtype = layouts.DTYPES[cfg["dtype"]]
    q, k, v = (t.detach() for t in (ops.q, ops.k, ops.v))
    with torch.no_grad():
        out, lse = reference.dense(q, k, v, compute_dtype=dtype, **kw)
        grads = reference.dense_backward(ops.go, q, k, v, compute_dtype=dtype, **kw)[:3]
    return out, lse, grads


def _low_varlen(cfg, ops, **kw):
    dtype = layouts.DTYPES[cfg["dtype"]]
    q, k, v = (t.detach() for t in (ops.q, ops.k, ops.v))
    args = (ops.cu_q, ops.cu_k, max(cfg["lens_q"]), max(cfg["lens_kv"]))
    with torch.no_grad():
        out, lse = reference.varlen(q, k, v, *args, compute_dtype=dtype, **kw)
        grads = reference.varlen_backward(ops.go, q, k, v, *args, compute_dtype=dtype, **kw)[:3]
    return out, lse, grads


def _scale(cfg):
    return cfg["scale"] if cfg["scale"] is not None else 1.0 / math.sqrt(cfg["d"])


def _sdp_choice(ops, kw) -> int:
    return int(torch._fused_sdp_choice(ops.q, ops.k, ops.v, attn_mask=kw["attn_mask"], dropout_p=kw["dropout_p"],
                                       is_causal=kw["is_causal"], scale=kw["scale"],
                                       enable_gqa=kw.get("enable_gqa", False)))


def _sdpa_case(cfg, ops, like=None) -> Case:
    """F.sdpa inside ``enable()``; native on the backend the scope selects for ``like`` (default
    ``ops``: native's run on copies of the operands follows the choice made for the originals)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = dict(attn_mask=ops.mask, dropout_p=cfg["dropout_p"], is_causal=cfg["mask"] == "causal", scale=cfg["scale"])
    if cfg["h_q"] != cfg["h_kv"]:
        kw["enable_gqa"] = True

    def call():
        return F.scaled_dot_product_attention(ops.q, ops.k, ops.v, **kw), None

    chosen = ops if like is None else like
    outside = _sdp_choice(chosen, kw)
    with csp.enable():
        inside = _sdp_choice(chosen, kw)

    def native():  # native PyTorch on the backend the provider's scope selects, for equal strides
        with sdpa_kernel([SDPBackend(inside)]) if inside not in (outside, -1) else nullcontext():
            return call()

    ref_kw = dict(scale=_scale(cfg), window=(-1, 0) if kw["is_causal"] else (-1, -1))
    return Case(("dense_fwd", "dense_bwd"), call, native, True,
                lambda q, k, v: reference.dense(q, k, v, bias=_bias32(ops.mask), **ref_kw),
                lambda: _low_dense(cfg, ops, bias=_bias32(ops.mask), **ref_kw), lambda: _dense_rule(ops))


def _attention_window(cfg):
    w = cfg["window_w"]
    return {"none": ((-1, -1), False), "causal": ((-1, 0), False), "causal_br": ((-1, 0), True),
            "window": ((w, 0), False), "window_br": ((w, 0), True)}[cfg["window"]]


def _attention_case(cfg, ops) -> Case:
    window, br = _attention_window(cfg)
    s_q, s_kv = cfg["s_q"], cfg["s_kv"]

    def call():
        got = csp.attention(ops.q, ops.k, ops.v, scale=cfg["scale"], window=window, bottom_right=br,
                            return_lse=cfg["return_lse"])
        return got if cfg["return_lse"] else (got, None)

    def native():  # F.sdpa says every window here as is_causal or a boolean mask (no row is empty)
        mask, causal = None, False
        if window == (-1, 0) and (not br or s_q == s_kv):
            causal = True
        elif window != (-1, -1):
            mask = reference.allowed_mask(s_q, s_kv, window, br, device=ops.q.device)
        return F.scaled_dot_product_attention(ops.q, ops.k, ops.v, attn_mask=mask, is_causal=causal,
                                              scale=cfg["scale"], enable_gqa=cfg["h_q"] != cfg["h_kv"]), None

    ref_kw = dict(scale=_scale(cfg), window=window, bottom_right=br)
    return Case(("dense_fwd", "dense_bwd"), call, native, False,
                lambda q, k, v: reference.dense(q, k, v, **ref_kw), lambda: _low_dense(cfg, ops, **ref_kw),
                lambda: _dense_rule(ops), native_strides=False)  # F.sdpa's own preprocessing differs


def _varlen_window(cfg):
    return {"none": (-1, -1), "causal": (-1, 0), "window": (cfg["window_w"], 0)}[cfg["window"]]


def _varlen_params() -> set:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return set()
    return set(inspect.signature(varlen_attn).parameters)


def _varlen_kwargs(cfg, params: set) -> dict | None:
    """varlen_attn's keyword arguments for ``cfg`` in this torch's spelling; None if it has none."""
    window, kw = _varlen_window(cfg), {}
    if cfg["scale"] is not None:
        if "scale" not in params:
            return None
        kw["scale"] = cfg["scale"]
    if window != (-1, -1):
        if cfg.get("causal_form") == "is_causal" and window == (-1, 0) and "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = window
        else:
            return None
    if cfg["h_q"] != cfg["h_kv"]:
        if "enable_gqa" not in params:
            return None
        kw["enable_gqa"] = True
    if cfg["return_lse"] and cfg["api"] == "varlen_attn":
        from torch.nn.attention.varlen import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    return kw


def _strides_aligned(t) -> bool:
    """Every outer stride of a dim with extent > 1 a multiple of 16 bytes (0 included)."""
    item = t.element_size()
    return all((st * item) % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)


def _vector_aligned(t) -> bool:
    """Whether FlashAttention's 16-byte vector loads can read ``t``: an aligned base and outer strides.
    torch's varlen_attn does not check this before launching it (seen on the H200: a head-dim slice of
    width D + 4 and a base one element in both ended the process with 'misaligned address')."""
    return t.data_ptr() % 16 == 0 and _strides_aligned(t)


def _varlen_native(cfg, ops):
    """varlen_attn on the same operands (FlashAttention: bottom-right alignment), or None where it
    cannot say the call: no CUDA, an argument this torch lacks, top-left alignment of unequal lengths."""
    params = _varlen_params()
    kw = _varlen_kwargs(cfg, params)
    if ops.q.device.type != "cuda" or kw is None or not (cfg["bottom_right"] or cfg["lens_q"] == cfg["lens_kv"]):
        return None
    from torch.nn.attention.varlen import varlen_attn

    def call():
        got = varlen_attn(ops.q, ops.k, ops.v, ops.cu_q, ops.cu_k, max(cfg["lens_q"]), max(cfg["lens_kv"]), **kw)
        return got if isinstance(got, tuple) else (got, None)

    return call


def _varlen_case(cfg, ops) -> Case:
    window, br = _varlen_window(cfg), cfg["bottom_right"]
    native = _varlen_native(cfg, ops)
    sizes = (ops.cu_q, ops.cu_k, max(cfg["lens_q"]), max(cfg["lens_kv"]))

    def attention(o):
        return csp.attention(o.q, o.k, o.v, cu_seqlens_q=o.cu_q, cu_seqlens_kv=o.cu_k, max_seqlen_q=sizes[2],
                             max_seqlen_kv=sizes[3], scale=cfg["scale"], window=window, bottom_right=br,
                             return_lse=cfg["return_lse"])

    if cfg["api"] == "varlen_attn":
        call, rule = native, lambda: _varlen_rule(cfg, ops)  # the same call, inside enable()
    else:
        def call():
            got = attention(ops)
            return got if cfg["return_lse"] else (got, None)

        rule = lambda: _fake_rule(ops, lambda o: (attention(o)[0] if cfg["return_lse"] else attention(o)))  # noqa: E731
    if not all(_vector_aligned(t) for t in (ops.q, ops.k, ops.v)):
        native = None  # FlashAttention would fault (CUDA "misaligned address", fatal to the process)
    ref_kw = dict(scale=_scale(cfg), window=window, bottom_right=br)
    return Case(("varlen_fwd", "varlen_bwd"), call, native, cfg["api"] == "varlen_attn",
                lambda q, k, v: reference.varlen(q, k, v, *sizes, **ref_kw), lambda: _low_varlen(cfg, ops, **ref_kw),
                rule)


CASES = {"sdpa": _sdpa_case, "attention": _attention_case, "varlen_attn": _varlen_case,
         "attention_varlen": _varlen_case}


# --------------------------------------------------------------------------------------- runs


def _poison(device) -> None:
    """NaN in the caching allocator's free blocks, large pool and small (<= 1 MiB) pool alike, so an
    output or gradient a kernel did not write reads as NaN."""
    if torch.device(device).type != "cuda":
        return
    poison_allocator(device)
    junk = [torch.full((1 << 17,), float("nan"), device=device) for _ in range(64)]  # 512 KiB each
    del junk


def _run(fn, ops, seed: int, scope: bool, bwd_in_scope: bool = True) -> Result:
    """Forward and backward (autograd.grad of the views, so gradients keep the kernel's strides). A
    CUDA fault of the run (surfacing at the closing synchronize, whatever the run raised) is
    ``fault``: after one the process can run nothing more."""
    before = counters.stats()
    result = Result()
    try:
        torch.manual_seed(seed)
        with csp.enable() if scope else nullcontext():
            result.out, result.lse = fn()
            if bwd_in_scope:
                result.grads = list(torch.autograd.grad(result.out, ops.inputs, ops.go))
        if not bwd_in_scope:
            result.grads = list(torch.autograd.grad(result.out, ops.inputs, ops.go))
    except Exception as exc:  # compared by the caller: native may refuse a layout
        result.error = exc
    if ops.q.device.type == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception as exc:
            result.fault = exc
            result.error = result.error or exc
    result.delta = counters.stats() - before
    return result


def _moved(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a fresh 16-byte-aligned storage: with ``t``'s strides (they may be 0), except
    rows that are not 16-byte aligned (innermost stride 1, an outer stride that is not a multiple of
    16 bytes): those are padded, in ``t``'s dimension order (``layout.repaired``'s layout, which
    materialises expanded dims). F.sdpa makes a head dim that is not innermost contiguous itself."""
    if t.stride(-1) == 1 and not _strides_aligned(t):
        return csp_layout.repaired(t.detach())
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))  # the storage ``t`` reads
    region = t.detach().as_strided((span,), (1,), t.storage_offset())
    return torch.empty(span, dtype=t.dtype, device=t.device).copy_(region).as_strided(t.shape, t.stride(), 0)


def _for_native(ops):
    """The operands for native's run: ``ops`` itself, or where q, k, v or grad_out has a base or a
    stride that is not 16-byte aligned, those operands' values in fresh aligned storage (``_moved``;
    copies of q, k, v are leaves, so native's gradients keep its kernel's strides; an aliased q is k
    stays one tensor; a head dim that is not innermost keeps its strides, F.sdpa copies it itself).
    Native's kernels launch on such operands unchecked: FlashAttention and the backward fault with
    "misaligned address" (fatal to the process), and F.sdpa's kernels misread rows of D + 4 elements
    or fault on them at S_q = 1 (seen on the H200, GPU run 24); the provider copies them. The
    values, and so the results, are the same. The second value names the inputs' gradients ('dq',
    'dq+dk', ...) whose operand native read in another layout: then native's strides are no oracle
    (its kernels may lay out every output after q's or O's layout)."""
    if all(_vector_aligned(t) for t in (ops.q, ops.k, ops.v, ops.go)):
        return ops, set()
    moved = {}
    for t in ops.inputs:
        moved[id(t)] = t if _vector_aligned(t) else _moved(t).requires_grad_(t.requires_grad)
    go = ops.go if _vector_aligned(ops.go) else _moved(ops.go)
    relaid = {name for name, t in zip(ops.names, ops.inputs) if moved[id(t)].stride() != t.stride()}
    return dataclasses.replace(ops, q=moved[id(ops.q)], k=moved[id(ops.k)], v=moved[id(ops.v)], go=go), relaid


def _context_lost(error) -> bool:
    """Whether ``error`` is a CUDA error that poisons the process (after it nothing else can run)."""
    return error is not None and type(error).__name__ == "AcceleratorError"


def run_config(cfg: dict, device) -> str:
    """Run one configuration; raise AssertionError naming every mismatch; return what was counted."""
    ops = layouts.build(cfg, device)
    case = CASES[cfg["api"]](cfg, ops)
    theirs, relaid = _for_native(ops)
    if theirs is ops:
        native_call = case.native
    else:
        build = CASES[cfg["api"]]
        native_call = (build(cfg, theirs, like=ops) if build is _sdpa_case else build(cfg, theirs)).native
    native = _run(native_call, theirs, cfg["seed"], scope=False) if native_call is not None else None
    if native is not None and (native.fault is not None or _context_lost(native.error)):
        raise AssertionError(f"native PyTorch faulted on this layout before the provider ran (a harness fault: "
                             f"give native operands it can read): {(native.fault or native.error)!r}")
    _poison(device)
    got = _run(case.provider, ops, cfg["seed"], scope=case.in_scope, bwd_in_scope=cfg["bwd_in_scope"])
    if got.fault is not None:
        raise AssertionError(f"the provider's call faulted (CUDA): {got.fault!r}")
    if got.error is not None:
        if native is not None and type(native.error) is type(got.error):
            return f"native and provider both raise {type(got.error).__name__}"
        if theirs is not ops and case.native is not None:
            # native ran on copies: what does it do with the operands the provider got?
            same = _run(case.native, ops, cfg["seed"], scope=False)
            if same.fault is not None:
                raise AssertionError(f"the provider raised {got.error!r}; native on the same operands faulted "
                                     f"(CUDA): {same.fault!r}")
            fell_back = sum(got.delta.to_dict()[case.paths[0]]["fallback"].values()) > 0  # native's kernel raised
            if fell_back and type(same.error) is type(got.error):
                return f"native and provider both raise {type(got.error).__name__} on these operands"
        raise AssertionError(f"the provider raised {got.error!r}; native: {native.error if native else '-'!r}")
    if native is not None and native.error is not None:
        native = None  # native refuses this layout: the composite and the fake kernels stand in
    problems: list[str] = []
    check_counts(problems, got.delta, case.paths, cfg.get("expect", {}))
    if native is not None and any(native.delta.total(p) for p in reasons.PATHS):
        problems.append(f"counters: the native call outside any scope was counted: {native.delta.to_dict()}")
    if got.out.shape != (native.out.shape if native is not None else got.out.shape):
        problems.append(f"out shape {tuple(got.out.shape)}, native {tuple(native.out.shape)}")
    check_strides(problems, got, native, case, ops, relaid)
    notes: list[str] = []
    (check_dropout if cfg.get("dropout_p") else check_accuracy)(problems, cfg, ops, got, native, case, notes)
    if problems:
        raise AssertionError("; ".join(problems))
    return " ".join([outcome(got.delta, case.paths)] + [f"[{n}]" for n in notes])
