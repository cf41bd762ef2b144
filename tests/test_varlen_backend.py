"""CPU tier: one varlen rule on every torch (issue #27 items 1 and 2).

The user's backend flags excluding cuDNN keep a varlen call off cuDNN (``backend_disabled``), as on
the dense path; torch 2.15's trailing ``backend`` argument is honoured (3, cuDNN: served; 1,
FlashAttention: counted ``torch_selection`` and run there; anything else: ``unsupported_argument``);
a backward follows what its forward recorded, whatever the flags are when it runs; 2.15's
``aten::_cudnn_attention_forward_no_dropout_inplace`` is served or counted once.

torch 2.15's schemas are declared here in a test namespace, so these tests exercise them on every
torch CI runs; on 2.15 itself ``test_the_declared_schemas_are_torch_215s`` checks they are the real
ones, and the kernels are also run with this torch's own ops.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudnn_sdpa_provider.core import counters, markers, support
from cudnn_sdpa_provider.engine import graphs
from cudnn_sdpa_provider.hooks import overrides, varlen_hooks
from cudnn_sdpa_provider.ops import reference, route
from tests import fake_cudnn
from tests.util import assert_rel_close

_ARGS = ("Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, SymInt max_q, SymInt max_k, "
         "bool is_causal=False, float? scale=None, SymInt[]? window_size=None, bool enable_gqa=False, "
         "Tensor? seqused_k=None, Tensor? block_table=None, SymInt? num_splits=None, SymInt backend=1")
#: torch 2.15.0's schemas (printed from its ops), namespace aside.
SCHEMAS_215 = {
    "_varlen_attn": f"_varlen_attn({_ARGS}) -> (Tensor, Tensor, Tensor)",
    "_varlen_attn_out": f"_varlen_attn_out(Tensor(a!) out, {_ARGS}) -> Tensor",
    "_varlen_attn_backward": "_varlen_attn_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
                             "Tensor out, Tensor lse, Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, "
                             "bool is_causal, Tensor rng_state, float? scale=None, SymInt[]? window_size=None, "
                             "SymInt backend=1) -> (Tensor, Tensor, Tensor)",
    "_cudnn_attention_forward_no_dropout_inplace":
        "_cudnn_attention_forward_no_dropout_inplace(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
        "Tensor cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, bool is_causal=False, *, "
        "float? scale=None, Tensor? seqused_k=None, Tensor? block_table=None) -> Tensor logsumexp",
}
_LIB = torch.library.Library("csp_test_varlen215", "FRAGMENT")
for _schema in SCHEMAS_215.values():
    _LIB.define(_schema)
OPS_215 = {name: getattr(torch.ops.csp_test_varlen215, name).default for name in SCHEMAS_215}
INPLACE = "_cudnn_attention_forward_no_dropout_inplace"


@pytest.fixture
def cuda_like(monkeypatch):
    """CPU float32 tensors decided as if they were bf16 on a CUDA machine, run on the stand-in cuDNN."""
    fake_cudnn.install(monkeypatch)
    monkeypatch.setattr(support, "RULES", tuple(r for r in support.RULES if r.slug not in ("no_cuda", "dtype")))
    route.clear()
    yield
    route.clear()
    graphs.clear_cache()


class Native:
    """PyTorch's kernel, as the hooks see it: counts its calls and returns outputs of the right form."""

    def __init__(self, make=None):
        self.calls = []
        self.make = make

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.make(*args, **kwargs) if self.make else None


def _fwd_result(q, k, v, *rest, **kw):
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), torch.zeros(2, dtype=torch.uint64)


def _bwd_result(grad_out, q, k, v, *rest, **kw):
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _kernels(ops=OPS_215, out_native=None):
    natives = {"fwd": Native(_fwd_result), "bwd": Native(_bwd_result), "out": out_native or Native(
        lambda out, q, *rest, **kw: torch.zeros(q.shape[1], q.shape[0])), "inplace": Native(
        lambda out, q, *rest, **kw: torch.zeros(q.shape[1], q.shape[0]))}
    kernels = varlen_hooks.Varlen(ops["_varlen_attn"], natives["fwd"], ops["_varlen_attn_backward"], natives["bwd"],
                                  ops.get("_varlen_attn_out"), natives["out"], ops.get(INPLACE), natives["inplace"])
    return kernels, natives


def _packed(t=12, h=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=gen) for _ in range(3)]


CU = torch.tensor([0, 5, 12], dtype=torch.int32)


def _forward(kernels, backend=None, causal=True):
    q, k, v = _packed()
    tail = () if backend is None else (None, None, False, None, None, None, backend)
    return (q, k, v), kernels.forward(None, q, k, v, CU, CU, 7, 7, causal, *tail)


def _backward(kernels, qkv, result, backend=None):
    q, k, v = qkv
    out, lse, rng = result
    tail = () if backend is None else (None, backend)
    return kernels.backward(None, torch.ones_like(out), q, k, v, out, lse, CU, CU, 7, 7, True, rng, None, *tail)


def _moved(before) -> dict:
    region = counters.stats() - before
    return {path: (region.served[path], dict(region.fallback[path])) for path in ("varlen_fwd", "varlen_bwd")}


# ----------------------------------------------------------------------- torch 2.15's backend


def test_backend_cudnn_is_served_and_its_backward_follows(cuda_like):
    kernels, natives = _kernels()
    before = counters.stats()
    qkv, result = _forward(kernels, backend=varlen_hooks.CUDNN_BACKEND)
    q, k, v = qkv
    want, _ = reference.varlen(q.double(), k.double(), v.double(), CU, CU, 7, 7, scale=8 ** -0.5, window=(-1, 0),
                               bottom_right=True, compute_dtype=torch.float64)
    assert_rel_close(result[0], want, 1e-6, "out")
    assert markers.lookup(result[2]).served
    _backward(kernels, qkv, result, backend=varlen_hooks.CUDNN_BACKEND)
    assert not natives["fwd"].calls and not natives["bwd"].calls
    assert _moved(before) == {"varlen_fwd": (1, {}), "varlen_bwd": (1, {})}


def test_backend_flash_is_counted_torch_selection_and_runs_pytorchs_kernel(cuda_like):
    kernels, natives = _kernels()
    before = counters.stats()
    qkv, result = _forward(kernels, backend=varlen_hooks.FLASH_BACKEND)
    _backward(kernels, qkv, result, backend=varlen_hooks.FLASH_BACKEND)
    assert len(natives["fwd"].calls) == 1 and natives["fwd"].calls[0][0][-1] == 1, "run as torch chose"
    assert len(natives["bwd"].calls) == 1
    assert _moved(before) == {"varlen_fwd": (0, {"torch_selection": 1}), "varlen_bwd": (0, {"torch_selection": 1})}


@pytest.mark.parametrize("backend", [0, 2, 4])
def test_another_backend_value_is_an_unsupported_argument_naming_it(cuda_like, backend):
    kernels, natives = _kernels()
    found = kernels._entry(OPS_215["_varlen_attn"], dict(query=_packed()[0], key=_packed()[1], value=_packed()[2],
                                                         cu_seq_q=CU, cu_seq_k=CU, max_q=7, max_k=7, backend=backend),
                           False)
    assert found.first.slug == "unsupported_argument" and "backend" in found.first.message
    before = counters.stats()
    _forward(kernels, backend=backend)
    assert len(natives["fwd"].calls) == 1
    assert _moved(before)["varlen_fwd"] == (0, {"unsupported_argument": 1})


def test_unknown_arguments_of_215s_schema():
    op = OPS_215["_varlen_attn"]
    for arg in op._schema.arguments:
        assert arg.name in varlen_hooks.VARLEN_ARGUMENTS, f"{arg.name} of 2.15's schema has no rule"
    a = {arg.name: None for arg in op._schema.arguments}
    for backend, unknown in ((1, ()), (3, ()), (2, ("backend",)), (-1, ("backend",))):
        assert varlen_hooks.unknown_arguments(op, {**a, "backend": backend}) == unknown


# ------------------------------------------------------------- the user's flags, every torch


def _this_torch_ops():
    ops = overrides._varlen_ops() or {}
    return {**ops, INPLACE: varlen_hooks.inplace_op()}


SCHEMAS = {"this torch": (_this_torch_ops, None), "torch 2.15": (lambda: OPS_215, varlen_hooks.CUDNN_BACKEND)}
RESTRICTIONS = {
    "sdpa_kernel": lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
    "enable_cudnn_sdp": lambda: _cudnn_sdp_off(),
}


class _cudnn_sdp_off:
    def __enter__(self):
        self.saved = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc):
        torch.backends.cuda.enable_cudnn_sdp(self.saved)


@pytest.mark.parametrize("restriction", sorted(RESTRICTIONS))
@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_the_users_flags_excluding_cudnn_are_honoured_and_the_backward_follows(cuda_like, schema, restriction):
    ops, backend = SCHEMAS[schema][0](), SCHEMAS[schema][1]
    if ops.get("_varlen_attn") is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch")
    kernels, natives = _kernels(ops)
    before = counters.stats()
    with RESTRICTIONS[restriction]():
        qkv, result = _forward(kernels, backend=backend)
    _backward(kernels, qkv, result, backend=backend)  # flags back: the backward still follows its forward
    assert len(natives["fwd"].calls) == 1 and len(natives["bwd"].calls) == 1
    assert _moved(before) == {"varlen_fwd": (0, {"backend_disabled": 1}), "varlen_bwd": (0, {"backend_disabled": 1})}

    before = counters.stats()
    qkv, result = _forward(kernels, backend=backend)
    with RESTRICTIONS[restriction]():  # a served forward's backward is served whatever the flags are now
        _backward(kernels, qkv, result, backend=backend)
    assert _moved(before) == {"varlen_fwd": (1, {}), "varlen_bwd": (1, {})}


def test_varlen_attn_out_follows_the_same_rule(cuda_like):
    kernels, natives = _kernels()
    q, k, v = _packed()
    for backend, expect in ((varlen_hooks.FLASH_BACKEND, (0, {"torch_selection": 1})),
                            (varlen_hooks.CUDNN_BACKEND, (1, {}))):
        out = torch.full_like(q, float("nan"))
        before = counters.stats()
        kernels.forward_out(None, out, q, k, v, CU, CU, 7, 7, True, None, None, False, None, None, None, backend)
        assert _moved(before)["varlen_fwd"] == expect
    want, _ = reference.varlen(q.double(), k.double(), v.double(), CU, CU, 7, 7, scale=8 ** -0.5, window=(-1, 0),
                               bottom_right=True, compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out written in place")
    before = counters.stats()
    with _cudnn_sdp_off():
        kernels.forward_out(None, out, q, k, v, CU, CU, 7, 7, True, None, None, False, None, None, None, 3)
    assert _moved(before)["varlen_fwd"] == (0, {"backend_disabled": 1})
    assert len(natives["out"].calls) == 2


# --------------------------------------------------- aten::_cudnn_attention_forward_no_dropout_inplace


def test_the_inplace_cudnn_op_is_served_with_cudnns_top_left_causal_mask(cuda_like):
    kernels, natives = _kernels()
    q, _, _ = _packed(t=5)
    _, k, v = _packed(t=9, seed=1)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    before = counters.stats()
    lse = kernels.inplace(None, out, q, k, v, cu_q, cu_k, 3, 5, True)
    want, want_lse = reference.varlen(q.double(), k.double(), v.double(), cu_q, cu_k, 3, 5, scale=8 ** -0.5,
                                      window=(-1, 0), bottom_right=False, compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-6, "out")
    assert lse.shape == (2, 5) and lse.is_contiguous(), "(H, T), as torch 2.15's varlen_attn_out returns it"
    assert_rel_close(lse, want_lse.t(), 1e-6, "lse")
    assert _moved(before)["varlen_fwd"] == (1, {}) and not natives["inplace"].calls
    before = counters.stats()
    kernels.inplace(None, out, q, k, v, cu_q, cu_k, 3, 5, True, seqused_k=torch.tensor([4, 5], dtype=torch.int32))
    assert _moved(before)["varlen_fwd"] == (0, {"paged_kv": 1}) and len(natives["inplace"].calls) == 1


def test_the_inplace_op_under_our_own_varlen_attn_out_fallback_is_counted_once(cuda_like):
    """torch 2.15's _varlen_attn_out calls the in-place op on its cuDNN branch: when our out hook
    falls back to it, that one call is counted once (by the out hook)."""
    holder = {}
    out_native = Native(lambda out, q, k, v, cu_q, cu_k, mq, mk, causal, *rest, **kw: holder["kernels"].inplace(
        None, out, q, k, v, cu_q, cu_k, mq, mk, causal))
    kernels, natives = _kernels(out_native=out_native)
    holder["kernels"] = kernels
    q, k, v = _packed()
    before = counters.stats()
    with _cudnn_sdp_off():
        kernels.forward_out(None, torch.empty_like(q), q, k, v, CU, CU, 7, 7, True, None, None, False, None, None,
                            None, varlen_hooks.CUDNN_BACKEND)
    assert _moved(before)["varlen_fwd"] == (0, {"backend_disabled": 1})
    assert len(natives["inplace"].calls) == 1, "PyTorch's in-place kernel ran, uncounted"


def test_the_inplace_op_is_registered_only_where_it_exists():
    exists = hasattr(torch.ops.aten, INPLACE)
    assert (varlen_hooks.inplace_op() is not None) == exists
    hooks = overrides.Hooks()
    if hooks._varlen_kernels is not None:  # a torch with CUDA kernels
        assert (hooks._varlen_kernels.inplace_op is not None) == exists


@pytest.mark.skipif(not hasattr(torch.ops.aten, INPLACE), reason="torch 2.15+: the schemas these tests declare")
def test_the_declared_schemas_are_torch_215s():
    def form(op):
        return [(a.name, str(a.type), a.default_value, a.kwarg_only) for a in op._schema.arguments]

    real = _this_torch_ops()
    for name, op in OPS_215.items():
        assert form(real[name]) == form(op), name
