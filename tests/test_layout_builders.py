"""CPU tier: the layout differential harness of the GPU tier (issue #14), proven before GPU time is spent.

The builders make the views they claim (strides, shared storage, offsets, aliasing, stride 0); the
generator is deterministic and covers every class; ``run_config`` passes real configurations end
to end on CPU (csp.attention's CPU kernels run the reference composite, reason ``no_cuda``) and
catches a wrong gradient, wrong strides, a missing count and a dropout mask that differs between
forward and backward; a batch runs in a child process, and a child that dies is reported with the
configuration it was running while the rest still run.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.core import layout as csp_layout
from tests import layout_checks, layout_runner, layouts
from tests.layout_batches import Batches, run_batch

SMALL = {"dense": ((2, 4, 4, 32, 32), (1, 4, 2, 16, 48), (2, 2, 2, 1, 40)), "varlen": ((20, 12), (5, 30, 9))}
CPU = layouts.capabilities("cpu")


def _dense(**over) -> dict:
    cfg = dict(api="sdpa", dtype="bfloat16", b=2, h_q=4, h_kv=4, s_q=32, s_kv=48, d=64, wide=8, group="none",
               q="bhsd", k="bhsd", v="bhsd", offsets=[0, 0, 0], go="bhsd", mask="none", mask_dims=[1, 1],
               dropout_p=0.0, scale=None, seed=3, bwd_in_scope=True, return_lse=False, id=0, family=0)
    return dict(cfg, **over)


def _varlen(**over) -> dict:
    cfg = dict(api="attention_varlen", dtype="bfloat16", lens_q=[20, 12], lens_kv=[20, 12], h_q=4, h_kv=4, d=64,
               wide=8, group="none", q="thd", k="thd", v="thd", offsets=[0, 0, 0], go="thd", window="causal",
               window_w=16, causal_form="window", bottom_right=True, scale=None, seed=4, bwd_in_scope=True,
               return_lse=False, id=0, family=0)
    return dict(cfg, **over)


def _shares(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------- builders

# class -> (q's expected strides for (B, H, S, D) = (2, 4, 32, 64) with wide = 8, storage offset past the base)
DENSE_EXPECTED = {
    "bhsd": ((4 * 32 * 64, 32 * 64, 64, 1), 0),
    "bshd": ((32 * 4 * 64, 64, 4 * 64, 1), 0),
    "sbhd": ((4 * 64, 64, 2 * 4 * 64, 1), 0),
    "hbsd": ((32 * 64, 2 * 32 * 64, 64, 1), 0),
    "bhds": ((4 * 64 * 32, 64 * 32, 1, 32), 0),
    "slice_lo": ((32 * 4 * 72, 72, 4 * 72, 1), 0),
    "slice_hi": ((32 * 4 * 72, 72, 4 * 72, 1), 8),
    "expand_heads": ((32 * 64, 0, 64, 1), 0),
    "expand_seq": ((4 * 64, 64, 0, 1), 0),
    "expand_batch": ((0, 32 * 64, 64, 1), 0),
}


@pytest.mark.parametrize("cls", sorted(layouts.DENSE_SOLO))
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_dense_classes_make_the_views_they_claim(cls, offset):
    ops = layouts.build(_dense(q=cls, offsets=[offset, 0, 0]), "cpu")
    strides, extra = DENSE_EXPECTED[cls]
    assert tuple(ops.q.shape) == (2, 4, 32, 64) and ops.q.stride() == strides
    assert ops.q.storage_offset() == offset + extra
    assert any(_shares(ops.q, leaf) for leaf in ops.leaves), "q must be a view of a leaf buffer"
    assert ops.q.requires_grad and ops.q.dtype == torch.bfloat16
    assert torch.isfinite(ops.q).all() and ops.q.abs().min() > 0, "random data, never zeros"
    if offset == 1:
        assert ops.q.data_ptr() % 16, "a 1-element offset must leave the base unaligned"


def test_sliced_rows_are_not_16_byte_aligned_with_wide_4():
    q = layouts.build(_dense(q="slice_lo", wide=4), "cpu").q
    assert q.stride(2) == 4 * 68 != 4 * 64, "the token stride is not H * D"
    assert (q.stride(1) * q.element_size()) % 16, "a head row of 68 bf16 is 136 bytes"
    hi = layouts.build(_dense(q="slice_hi", wide=4), "cpu").q
    assert hi.storage_offset() == 4 and hi.data_ptr() % 16


VARLEN_EXPECTED = {  # (T, H, D) = (32, 4, 64), wide = 8
    "thd": (4 * 64, 64, 1),
    "htd": (64, 32 * 64, 1),
    "tdh": (64 * 4, 1, 4),
    "slice_lo": (4 * 72, 72, 1),
    "slice_hi": (4 * 72, 72, 1),
    "expand_heads": (64, 0, 1),
    "expand_tokens": (0, 64, 1),
}


@pytest.mark.parametrize("cls", sorted(layouts.VARLEN_SOLO))
def test_varlen_classes_make_the_views_they_claim(cls):
    ops = layouts.build(_varlen(q=cls, k=cls), "cpu")
    assert tuple(ops.q.shape) == (32, 4, 64) and ops.q.stride() == VARLEN_EXPECTED[cls]
    assert tuple(ops.k.shape) == (32, 4, 64) and ops.k is not ops.q
    assert ops.cu_q.tolist() == [0, 20, 32] and ops.cu_q.dtype == torch.int32


@pytest.mark.parametrize("varlen", [False, True])
def test_fused_qkv_views_share_one_buffer(varlen):
    cfg = (_varlen(group="fused3") if varlen else _dense(group="fused3", s_kv=32))
    ops = layouts.build(cfg, "cpu")
    h, d = 4, 64
    token = 0 if varlen else 2
    assert _shares(ops.q, ops.k) and _shares(ops.k, ops.v) and len(ops.leaves) == 1
    assert ops.q.stride(token) == 3 * h * d, "token stride spans q, k and v"
    assert [t.storage_offset() for t in (ops.q, ops.k, ops.v)] == [0, h * d, 2 * h * d]
    assert ops.names == ["dq", "dk", "dv"]


def test_chunk3_linear_split_and_kv_fused2():
    chunk = layouts.build(_dense(group="chunk3", s_kv=32), "cpu")
    assert chunk.q.stride(1) == 3 * 64 and chunk.k.storage_offset() == 64 and _shares(chunk.q, chunk.v)
    split = layouts.build(_dense(group="linear_split", h_kv=2, s_kv=32), "cpu")
    assert split.q.stride(2) == split.k.stride(2) == (4 + 2 * 2) * 64
    assert split.k.storage_offset() == 4 * 64 and tuple(split.k.shape) == (2, 2, 32, 64)
    kv = layouts.build(_varlen(group="kv_fused2", q="htd"), "cpu")
    assert _shares(kv.k, kv.v) and not _shares(kv.q, kv.k) and kv.k.stride(0) == 2 * 4 * 64


def test_aliased_operands_are_one_tensor_with_one_gradient():
    qk = layouts.build(_dense(group="alias_qk", s_kv=32, q="bshd", k="bshd"), "cpu")
    assert qk.q is qk.k and qk.v is not qk.q
    assert qk.inputs == [qk.q, qk.v] and qk.names == ["dq+dk", "dv"]
    qkv = layouts.build(_varlen(group="alias_qkv"), "cpu")
    assert qkv.q is qkv.k is qkv.v and qkv.names == ["dq+dk+dv"]


@pytest.mark.parametrize("kind,check", [
    ("bhsd", lambda g: g.is_contiguous()),
    ("bshd", lambda g: g.transpose(1, 2).is_contiguous()),
    ("col", lambda g: g.stride(-1) == 2 * 32),  # the .t() of an (H*D, B*S) matrix
    ("broadcast", lambda g: g.stride(1) == 0),
    ("slice", lambda g: g.stride(2) == 4 * 128),
    ("offset", lambda g: g.data_ptr() % 16 != 0),
])
def test_grad_out_has_a_layout_of_its_own(kind, check):
    ops = layouts.build(_dense(go=kind, s_kv=32), "cpu")
    assert tuple(ops.go.shape) == (2, 4, 32, 64) and not ops.go.requires_grad and check(ops.go)
    assert ops.go.abs().min() > 0


@pytest.mark.parametrize("kind", ["offset", "broadcast", "bhsd"])
def test_native_reads_a_misaligned_grad_out_from_an_aligned_copy_with_its_strides(kind):
    ops = layouts.build(_dense(go=kind, s_kv=32), "cpu")
    if kind == "broadcast":  # a stride-0 grad_out one element in: copied as the storage it reads
        base = torch.randn(1 + ops.go.numel())
        ops.go = base[1:].as_strided(ops.go.shape, ops.go.stride())
    theirs, relaid = layout_runner._for_native(ops)
    if layout_runner._vector_aligned(ops.go):
        assert theirs is ops and not relaid
        return
    assert not relaid
    assert theirs.go.data_ptr() % 16 == 0 and theirs.go.stride() == ops.go.stride()
    assert torch.equal(theirs.go, ops.go) and theirs.go.data_ptr() != ops.go.data_ptr()
    assert theirs.q is ops.q and theirs.k is ops.k and theirs.v is ops.v  # aligned operands stay


@pytest.mark.parametrize("varlen", [False, True])
def test_native_reads_misaligned_operands_from_aligned_leaves_and_aliases_stay_one(varlen):
    alias = dict(offsets=[1, 0, 0], group="alias_qk")
    cfg = _varlen(**alias) if varlen else _dense(**alias, s_kv=32)
    ops = layouts.build(cfg, "cpu")
    theirs, relaid = layout_runner._for_native(ops)
    assert not relaid and ops.q is ops.k and theirs.q is theirs.k and theirs.q is not ops.q
    assert theirs.q.data_ptr() % 16 == 0 and theirs.q.stride() == ops.q.stride() and torch.equal(theirs.q, ops.q)
    assert theirs.q.is_leaf and theirs.q.requires_grad and len(theirs.inputs) == len(ops.inputs)
    assert theirs.v is ops.v or layout_runner._vector_aligned(theirs.v)
    layout_runner.run_config(cfg, "cpu")  # native on the copies, the provider on the originals: they agree


def test_native_reads_rows_that_are_not_16_byte_aligned_from_padded_copies():
    ops = layouts.build(_dense(q="slice_lo", wide=4, s_kv=32), "cpu")  # rows of D + 4 elements
    assert not layout_runner._vector_aligned(ops.q)
    theirs, relaid = layout_runner._for_native(ops)
    assert relaid == {"dq"} and layout_runner._vector_aligned(theirs.q) and torch.equal(theirs.q, ops.q)
    assert theirs.q.is_leaf and theirs.q.requires_grad and theirs.k is ops.k
    outcome = layout_runner.run_config(_dense(q="slice_lo", wide=4, s_kv=32), "cpu")
    assert "dense_fwd=" in outcome  # on the CPU the provider falls back: no stride oracle for dq


def _picky_sdpa(monkeypatch, count_fallback: bool):
    """The sdpa case with a native kernel that refuses a misaligned q (as PyTorch's efficient kernel
    does), reached by the provider's call as a counted fallback or not."""
    real = layout_runner._sdpa_case

    def case(cfg, ops):
        made = real(cfg, ops)

        def picky(provider):
            def call():
                if not layout_runner._vector_aligned(ops.q):
                    if provider and count_fallback:
                        counters.record("dense_fwd", "torch_selection")
                    raise RuntimeError("p.query_ptr is not correctly aligned")
                return made.native()
            return call

        return layout_runner.Case(made.paths, picky(True), picky(False), made.in_scope, made.reference, made.low,
                                  made.rule)

    monkeypatch.setitem(layout_runner.CASES, "sdpa", case)


def test_a_provider_error_native_also_raises_on_the_same_operands_is_not_a_failure(monkeypatch):
    """Native ran on aligned copies; the provider's call, on the originals, fell back to a native
    kernel that raised what native raises on them: both raise, not a failure."""
    _picky_sdpa(monkeypatch, count_fallback=True)
    assert "both raise RuntimeError on these operands" in layout_runner.run_config(_dense(offsets=[1, 0, 0]), "cpu")
    assert "dense_fwd=" in layout_runner.run_config(_dense(), "cpu")


def test_a_provider_error_without_a_fallback_is_a_failure_even_if_native_raises_alike(monkeypatch):
    _picky_sdpa(monkeypatch, count_fallback=False)  # the provider's own code raised
    with pytest.raises(AssertionError, match="the provider raised RuntimeError"):
        layout_runner.run_config(_dense(offsets=[1, 0, 0]), "cpu")


def test_varlen_col_grad_out():
    go = layouts.build(_varlen(go="col"), "cpu").go
    assert go.stride() == (1, 64 * 32, 32)


@pytest.mark.parametrize("mask,dims,shape", [("bool", [2, 2], (2, 4, 32, 48)), ("bool", [1, 2], (1, 4, 32, 48)),
                                             ("float", [2, 1], (2, 1, 32, 48)), ("float", [0, 0], (32, 48)),
                                             ("bool_pad", [1, 1], (2, 1, 32, 48))])
def test_masks_leave_every_query_a_key(mask, dims, shape):
    m = layouts.build(_dense(mask=mask, mask_dims=dims), "cpu").mask
    assert tuple(m.shape) == shape
    if m.dtype == torch.bool:
        assert m.any(dim=-1).all()
        assert mask != "bool_pad" or m.stride(2) == 0, "a key-padding mask is broadcast over queries"
    else:
        assert m.dtype == torch.bfloat16 and torch.isfinite(m).all()


# --------------------------------------------------------------------------------- generation


def test_generation_is_deterministic_json_and_respects_each_group():
    caps = layouts.capabilities("cuda")
    a, b = layouts.generate(300, 9, caps), layouts.generate(300, 9, caps)
    assert a == b and json.loads(json.dumps(a)) == a
    assert [c["id"] for c in a] == list(range(300))
    for c in a:
        varlen = c["api"] in ("varlen_attn", "attention_varlen")
        same = c["lens_q"] == c["lens_kv"] if varlen else c["s_q"] == c["s_kv"]
        if c["group"] in ("fused3", "chunk3", "alias_qk", "alias_qkv"):
            assert same and c["h_q"] == c["h_kv"], c
        if c["group"] == "linear_split":
            assert same, c
        assert c["h_q"] % c["h_kv"] == 0


def test_default_run_covers_every_class_group_api_and_grad_out_layout():
    configs = layouts.generate(1000, 14, layouts.capabilities("cuda"))
    seen = {key: {str(c.get(key)) for c in configs} for key in ("api", "group", "go", "mask", "window", "dtype")}
    dense_q = {c["q"] for c in configs if c["api"] in ("sdpa", "attention") and c["group"] in ("none", "kv_fused2")}
    varlen_q = {c["q"] for c in configs if c["api"].startswith(("varlen", "attention_v")) and c["group"] == "none"}
    assert dense_q == set(layouts.DENSE_SOLO) and varlen_q == set(layouts.VARLEN_SOLO)
    assert set(layouts.GROUPS) <= seen["group"]
    assert seen["api"] == {"sdpa", "attention", "varlen_attn", "attention_varlen"}
    assert set(layouts.DENSE_GO) | set(layouts.VARLEN_GO) <= seen["go"]
    assert set(layouts.DENSE_MASKS) <= seen["mask"] and set(layouts.ATTENTION_WINDOWS) <= seen["window"]
    assert any(c.get("dropout_p") for c in configs) and any(c["h_q"] != c["h_kv"] for c in configs)
    assert any(c["offsets"][0] == 1 for c in configs) and any(c["return_lse"] for c in configs)


def test_varlen_arguments_follow_the_torch_signature():
    """Only what this torch's varlen_attn takes is generated (torch 2.11 and later differ)."""
    old = dict(CPU, apis=CPU["apis"] + ["varlen_attn"], varlen_params=["query", "key", "value", "cu_seq_q",
                                                                        "cu_seq_k", "max_q", "max_k", "is_causal"])
    for c in layouts.generate(200, 2, old):
        if c["api"] == "varlen_attn":
            assert c["h_q"] == c["h_kv"] and c["window"] != "window" and c["scale"] is None, c
            assert not c["return_lse"] and c["window"] == "none" or c["causal_form"] == "is_causal", c
    kwargs = layout_runner._varlen_kwargs(dict(_varlen(api="varlen_attn"), causal_form="is_causal"), {"is_causal"})
    assert kwargs == {"is_causal": True}
    assert layout_runner._varlen_kwargs(_varlen(api="varlen_attn", h_kv=2), {"window_size"}) is None


def test_varlen_stride_oracle_is_torchs_fake_kernel():
    """Where native varlen_attn cannot run (CPU here; a layout FlashAttention refuses on the GPU), the
    strides come from torch's own fake kernels, which follow q for an (H, T, D) storage."""
    cfg = _varlen(api="varlen_attn", q="htd", k="htd", v="htd")
    ops = layouts.build(cfg, "cpu")
    out, grads = layout_runner._varlen_rule(cfg, ops)
    assert out == ops.q.stride() == (64, 32 * 64, 1) and grads == [t.stride() for t in (ops.q, ops.k, ops.v)]


# --------------------------------------------------------------------------------- end to end

E2E = [
    _dense(),
    _dense(group="linear_split", h_kv=2, s_kv=32, mask="bool", mask_dims=[2, 1], go="col", q="bshd"),
    _dense(k="slice_lo", v="expand_heads", mask="float", mask_dims=[0, 0], go="broadcast", offsets=[1, 8, 0],
           bwd_in_scope=False),
    _dense(group="fused3", s_kv=32, dropout_p=0.25, go="slice"),
    _dense(api="attention", group="kv_fused2", q="bhds", window="window_br", window_w=16, go="offset",
           return_lse=True),
    _dense(api="attention", group="alias_qk", s_kv=32, q="sbhd", k="sbhd", window="causal", window_w=16),
    _varlen(group="fused3", go="col", return_lse=True),
    _varlen(q="htd", k="slice_hi", v="expand_heads", h_kv=2, lens_kv=[25, 30], window="window"),
    _varlen(group="alias_qkv", bottom_right=False, lens_kv=[20, 12], window="none", offsets=[1, 0, 0]),
]


@pytest.mark.parametrize("cfg", E2E, ids=lambda c: f"{c['api']}-{c['group']}-{c['q']}")
def test_configs_pass_end_to_end_on_cpu(cfg):
    outcome = layout_runner.run_config(cfg, "cpu")
    path = "varlen" if cfg["api"] == "attention_varlen" else "dense"
    assert outcome == f"{path}_fwd=fallback:no_cuda {path}_bwd=fallback:no_cuda"


def test_generated_cpu_configs_pass():
    for cfg in layouts.generate(12, 21, CPU, sizes=SMALL):
        layout_runner.run_config(cfg, "cpu")


def test_a_wrong_gradient_is_caught(monkeypatch):
    real = reference.dense_backward  # what csp.attention's CPU kernel differentiates with

    def wrong_dq(*args, **kwargs):
        dq, dk, dv, ds = real(*args, **kwargs)
        return dq * 1.1, dk, dv, ds

    monkeypatch.setattr(reference, "dense_backward", wrong_dq)
    with pytest.raises(AssertionError, match=r"dq: max\|err\|"):
        layout_runner.run_config(_dense(api="attention", window="none", window_w=16), "cpu")


def test_wrong_strides_are_caught(monkeypatch):
    monkeypatch.setattr(csp_layout, "grad_like", lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    with pytest.raises(AssertionError, match=r"dq: strides .* fake kernels"):
        layout_runner.run_config(_dense(api="attention", q="bshd", window="none", window_w=16), "cpu")


def test_a_call_counted_nowhere_is_caught(monkeypatch):
    monkeypatch.setattr(counters, "record", lambda path, reason=None: None)
    with pytest.raises(AssertionError, match="dense_fwd counted 0 calls"):
        layout_runner.run_config(_dense(api="attention", window="none", window_w=16), "cpu")


def test_dropout_identities_catch_a_backward_with_another_mask():
    ops = layouts.build(_dense(s_kv=32), "cpu")
    q, k, v = (t.detach() for t in (ops.q, ops.k, ops.v))
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(2, 4, 32, 32, generator=gen) >= 0.25 for _ in range(2)]
    kw = dict(scale=1 / math.sqrt(64), dropout_p=0.25)
    out = reference.dense(q, k, v, dropout_mask=masks[0], **kw)[0].to(q.dtype)
    for mask, consistent in ((masks[0], True), (masks[1], False)):
        grads = [g.to(q.dtype) for g in reference.dense_backward(ops.go, q, k, v, dropout_mask=mask, **kw)[:3]]
        gaps = layout_checks.identity_gaps(ops, layout_runner.Result(out=out, grads=grads), torch.bfloat16)
        assert (not gaps) == consistent, gaps


def test_a_provider_without_dropout_is_caught_even_where_native_breaks_an_identity():
    """The identities hold for any mask, no mask included: the distance from the dropout-free
    output is what shows dropout was applied, and it is compared whatever native's identities say."""
    cfg = _dense(dropout_p=0.25, s_kv=32)
    ops = layouts.build(cfg, "cpu")
    case = layout_runner._sdpa_case(cfg, ops)
    native = layout_runner._run(case.native, ops, cfg["seed"], scope=False)
    native.grads[-1] = native.grads[-1] * 1.5  # dV off: native "misread" the layout
    q, k, v = (t.detach() for t in (ops.q, ops.k, ops.v))
    kw = dict(scale=1 / math.sqrt(64))
    out = reference.dense(q, k, v, **kw)[0].to(q.dtype)  # the provider forgot dropout, consistently
    grads = [g.to(q.dtype) for g in reference.dense_backward(ops.go, q, k, v, **kw)[:3]]
    got = layout_runner.Result(out=out, grads=grads)
    problems, notes = [], []
    layout_checks.check_dropout(problems, cfg, ops, got, native, case, notes)
    assert any(p.startswith("dropout: rms") for p in problems), problems
    assert notes and "native broke a dropout identity" in notes[0]


def test_strides_are_checked_where_native_read_padded_copies(monkeypatch):
    monkeypatch.setattr(csp_layout, "grad_like", lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    cfg = _dense(api="attention", q="slice_lo", k="bshd", wide=4, window="none", window_w=16, s_kv=32)
    assert layout_runner._for_native(layouts.build(cfg, "cpu"))[1] == {"dq"}
    with pytest.raises(AssertionError, match=r"dk: strides .* fake kernels"):
        layout_runner.run_config(cfg, "cpu")


# --------------------------------------------------------------------------------- child processes


def test_a_batch_runs_in_a_child_and_logs_each_config(tmp_path, monkeypatch):
    log = tmp_path / "fuzz.log"
    monkeypatch.setenv("CSP_FUZZ_LOG", str(log))
    configs = layouts.generate(4, 5, CPU, sizes=SMALL)
    result = run_batch(configs, tmp_path, "cpu", timeout=120)
    assert not result.problems(configs) and sorted(result.ok) == [0, 1, 2, 3]
    statuses = [line.split(" ", 2)[:2] for line in log.read_text().splitlines()]
    assert statuses == [["layouts", "START"], ["layouts", "ok"]] * 4


def test_a_child_that_dies_is_reported_with_its_config_and_the_rest_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CSP_LAYOUT_TEST_INJECT", "1")
    configs = [_dense(id=0, q="bshd"), _dense(id=1, inject="abort"), _dense(id=2, go="col")]  # 1: os.abort()
    result = run_batch(configs, tmp_path, "cpu", timeout=120)
    assert [cid for cid, _ in result.crashed] == [1] and "died while it ran" in result.crashed[0][1]
    assert sorted(result.ok) == [0, 2] and not result.failed and not result.not_run
    problems = result.problems(configs)
    assert len(problems) == 1 and problems[0].startswith("config 1 CRASH") and '"inject": "abort"' in problems[0]


# ------------------------------------------------------------ the lifecycle tier's scripts and rule


def test_lifecycle_scripts_compile():
    """The GPU tier's lifecycle scripts (tests/gpu/test_lifecycles.py) are at least valid Python."""
    import textwrap

    from tests.gpu import test_lifecycles as lifecycles

    bodies = {"item3": lifecycles.ITEM3, "item4": lifecycles.ITEM4, "item5": lifecycles.ITEM5,
              "item6": lifecycles.ITEM6, "item7": lifecycles.ITEM7, "item8": lifecycles.ITEM8,
              "compile": lifecycles.COMPILE}
    for name, body in bodies.items():
        compile(lifecycles.PREAMBLE + textwrap.dedent(body), name, "exec")
    ids = [c["id"] for cs in lifecycles.ITEM_CONFIGS.values() for c in cs]
    assert len(ids) == len(set(ids))
    for cfg in (c for cs in lifecycles.ITEM_CONFIGS.values() for c in cs):
        layouts.build(cfg, "cpu")  # every item configuration builds


def test_lifecycle_rule_and_result_parsing():
    from tests import lifecycle_support as ls

    native = {"out": 4e-3, "dq": 1.2e-2, "dk": 1e-3}
    # out: 3 x native = 1.2e-2; gradient floor: max(2 x 1.2e-2, 3 x 1e-2) = 3e-2; dq: 3 x native = 3.6e-2
    assert not ls.rule_problems({"out": 1.1e-2, "dq": 3.5e-2, "dk": 2.9e-2}, native)
    found = ls.rule_problems({"out": 1.3e-2, "dq": 3.7e-2, "dk": 4e-2}, native, group=2)
    assert [p.split(":")[0] for p in found] == ["out", "dq"]  # dk's floor grows with the group: sqrt(2) x 3e-2
    assert [p.split(":")[0] for p in ls.rule_problems({"dk": 4e-2}, native)] == ["dk"]
    assert ls.noise_tol(0.0) == 1e-6 and ls.noise_tol(1e-3) == 2 * 2.0**-8
    assert ls.parse(f"noise\n{ls.MARK}{{\"a\": 1}}\n{ls.MARK}{{\"a\": 2}}\n") == {"a": 2}
    with pytest.raises(ValueError):
        ls.parse("Traceback ...")


def _scaled(monkeypatch, native=1.0, provider=1.0, api="sdpa"):
    """``api``'s case with native's and the provider's outputs multiplied by these factors (a kernel
    that misreads)."""
    real = layout_runner.CASES[api]

    def times(call, factor):
        def wrong():
            out, lse = call()
            return out * factor, lse
        return wrong

    def case(cfg, ops):
        made = real(cfg, ops)
        return layout_runner.Case(made.paths, times(made.provider, provider), times(made.native, native),
                                  made.in_scope, made.reference, made.low, made.rule, made.native_strides)

    monkeypatch.setitem(layout_runner.CASES, api, case)


def test_a_native_that_misreads_is_noted_and_not_the_tolerance(monkeypatch):
    _scaled(monkeypatch, native=3.0)
    outcome = layout_runner.run_config(_dense(), "cpu")
    assert "native misread this layout (out)" in outcome and "dense_fwd=" in outcome


def test_a_wrong_provider_is_caught_even_where_native_misreads(monkeypatch):
    _scaled(monkeypatch, native=3.0, provider=1.05, api="attention")
    with pytest.raises(AssertionError, match=r"out: max\|err\|"):
        layout_runner.run_config(_dense(api="attention", window="none", window_w=16), "cpu")


def test_a_native_within_the_rule_is_the_base():
    assert "misread" not in layout_runner.run_config(_dense(), "cpu")


def test_batches_run_side_by_side_and_a_deadline_stops_those_not_started(tmp_path):
    configs = layouts.generate(6, 5, CPU, sizes=SMALL)
    batches = {0: configs[:2], 1: configs[2:4], 2: configs[4:]}
    dirs = {i: tmp_path / f"b{i}" for i in batches}
    for d in dirs.values():
        d.mkdir()
    runs = Batches(batches, dirs, "cpu", jobs=2, deadline=600, batch_timeout=120, restarts=0)
    try:
        assert [sorted(runs.result(i).ok) for i in batches] == [[c["id"] for c in b] for b in batches.values()]
    finally:
        runs.close()
    late = Batches(batches, dirs, "cpu", jobs=1, deadline=0, batch_timeout=120, restarts=0)
    assert [late.result(i) for i in batches] == [None, None, None]
    late.close()
