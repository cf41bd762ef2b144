"""CPU tier: scripts/fp8_varlen_probe.py without a GPU: its arguments, its layouts and fp32 reference
(against autograd), the graphs it declares (read back through a fake ``cudnn`` that computes
attention from the declared dims, strides and ragged offsets, so a wrong descriptor gives a wrong
answer), a rejected build or a failed run recorded while the next configuration goes on, the
summary's form, and the child-process run on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "fp8_varlen_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("fp8_varlen_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


# ------------------------------------------------------------------------------- arguments


def test_arguments_defaults_and_errors(probe, capsys):
    args = probe.parse_args([])
    assert (args.lens, args.heads, args.dim, args.seed, args.json, args.in_process) == \
        ([1000, 517, 2048, 77], 8, 128, 0, None, False)
    assert [c.name for c in args.configs] == [c.name for c in probe.CONFIGS] and not args.configs[0].packed
    args = probe.parse_args(["--lens", "5,3", "--configs", "packed_full,padded_control,packed_full", "--heads", "4"])
    assert args.lens == [5, 3] and [c.name for c in args.configs] == ["packed_full", "padded_control"]
    for bad, said in ((["--lens", "5,0"], "positive integers"), (["--lens", "x"], "positive integers"),
                      (["--configs", "packed,nope"], "Available: ['padded_control'"),
                      (["--heads", "6"], "needs a multiple of 4"), (["--dim", "-1"], "positive integers")):
        with pytest.raises(SystemExit) as exc:
            probe.parse_args(bad)
        assert exc.value.code == 2 and said in capsys.readouterr().err, bad
    assert probe.parse_args(["--heads", "6", "--configs", "packed_causal"]).heads == 6  # no GQA config: fine


# ------------------------------------------------------------------------ layouts, reference


def test_layout_helpers(probe):
    assert probe.s_max([1000, 517, 2048, 77]) == 2048 and probe.s_max([1025]) == 2048 and probe.s_max([1]) == 1
    assert probe.cu_seqlens([3, 1, 2]).tolist() == [0, 3, 4, 6] and probe.cu_seqlens([3]).dtype == torch.int32
    x = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    padded = probe.to_padded(x, [3, 1, 2], 4)
    assert padded.shape == (3, 2, 4, 3) and torch.equal(padded[1, :, 0], x[3]) and not padded[1, :, 1:].any()
    assert torch.equal(probe.to_packed(padded, [3, 1, 2]), x)
    assert probe.pow2_scale(1.0) == 128.0 and probe.pow2_scale(3.0) == 64.0 and probe.pow2_scale(0.0) == 1.0
    assert probe.pow2_scale(448.0, margin=1.0) == 1.0
    assert probe.rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == 0.5
    assert probe.rel_error(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_reference_is_attention_and_its_gradients_per_sequence(probe, causal, group):
    lens, h, d = [5, 1, 7], 4, 8
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(sum(lens), h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lens), h // group, d, generator=g, dtype=torch.float64) for _ in range(2))
    ref = probe.reference(q, k, v, do, lens, causal, 0.3)
    start, amax_ds = 0, 0.0
    for n in lens:
        sl = slice(start, start + n)
        start += n
        qs, ks, vs = (t[sl].transpose(0, 1).detach().requires_grad_() for t in (q, k, v))
        kr, vr = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        qk = qs @ kr.transpose(-1, -2)
        qk.retain_grad()
        scores = qk * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = scores.softmax(-1) @ vr
        want = F.scaled_dot_product_attention(qs, kr, vr, is_causal=causal, scale=0.3)
        assert torch.allclose(o, want) and torch.allclose(ref["o"][sl], o.transpose(0, 1))
        assert torch.allclose(ref["lse"][sl], scores.logsumexp(-1).transpose(0, 1))
        o.backward(do[sl].transpose(0, 1))
        for name, leaf in (("dq", qs), ("dk", ks), ("dv", vs)):
            assert torch.allclose(ref[name][sl], leaf.grad.transpose(0, 1)), name
        amax_ds = max(amax_ds, qk.grad.abs().max().item())  # dS: the gradient of Q K^T (scale included)
    assert ref["amax_ds"].item() == pytest.approx(amax_ds)
    # D = rowsum(dO O) from another O moves dQ and dK, never dV (= P^T dO)
    other = probe.reference(q, k, v, do, lens, causal, 0.3, o_for_d=ref["o"] * 1.1)
    assert torch.equal(other["dv"], ref["dv"]) and torch.equal(other["o"], ref["o"])
    assert not torch.allclose(other["dq"], ref["dq"]) and not torch.allclose(other["dk"], ref["dk"])
    assert torch.allclose(probe.reference(q, k, v, do, lens, causal, 0.3, o_for_d=ref["o"])["dq"], ref["dq"])


# ------------------------------------------------------------------ a fake cudnn on CPU tensors


class FakeTensor:
    def __init__(self, graph, uid=None, dims=None, strides=None, dtype=None, role=None):
        self.graph, self.uid, self.dims, self.strides, self.dtype, self.role = graph, uid, dims, strides, dtype, role
        self.ragged = None
        self.output = False

    def set_output(self, flag):
        self.output = flag
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_dim(self, dims):
        self.dims = tuple(dims)
        return self

    def set_stride(self, strides):
        self.strides = tuple(strides)
        return self

    def set_data_type(self, dtype):
        self.dtype = dtype
        return self

    def set_ragged_offset(self, t):
        self.ragged = t
        return self


class FakeGraph:
    """Records the op and, at execute, computes it from the buffers as the tensors declare them."""

    reject = None  # a message: every graph raises it at check_support
    fail = None  # a message: every execute raises it
    made: list = []

    def __init__(self, **kw):
        self.op = None
        FakeGraph.made.append(self)

    def tensor(self, name, dim, stride, data_type, uid):
        return FakeTensor(self, uid, tuple(dim), tuple(stride), data_type, role=name)

    def sdpa_fp8(self, *args, **kw):
        self.op = ("fwd", args, kw)
        return tuple(FakeTensor(self, role=r) for r in ("o", "stats", "amax_s", "amax_o"))

    def sdpa_fp8_backward(self, *args, **kw):
        self.op = ("bwd", args, kw)
        return tuple(FakeTensor(self, role=r) for r in ("dq", "dk", "dv", "adq", "adk", "adv", "adp"))

    def validate(self):
        pass

    build_operation_graph = build_plans = validate

    def create_execution_plans(self, modes):
        assert modes == ["A", "FALLBACK"]

    def check_support(self):
        if FakeGraph.reject:
            raise RuntimeError(FakeGraph.reject)

    def get_workspace_size(self):
        return 0

    # ------------------------------------------------------------------- execute
    def _seqs(self, t, bufs, lens):
        """Per sequence, (H, n, D) views of t's buffer through its declared strides and offsets."""
        buf, (_, hs, ts, ds) = bufs[t.uid], t.strides
        if t.ragged is not None:
            offs = bufs[t.ragged.uid].view(-1).tolist()
        else:
            offs = [b * t.strides[0] for b in range(len(lens))]
        assert t.ragged is None or len(offs) == len(lens) + 1
        return [torch.as_strided(buf, (t.dims[1], n, t.dims[3]), (hs, ts, ds), buf.storage_offset() + o)
                for o, n in zip(offs, lens)]

    def execute(self, bufs, workspace, handle=None):
        if FakeGraph.fail:
            raise RuntimeError(FakeGraph.fail)
        kind, args, kw = self.op
        assert kw["use_padding_mask"] and kw["seq_len_q"].dims == (len(bufs[kw["seq_len_q"].uid]), 1, 1, 1)
        lens = bufs[kw["seq_len_q"].uid].view(-1).tolist()
        assert bufs[kw["seq_len_kv"].uid].view(-1).tolist() == lens
        val = lambda t: bufs[t.uid].reshape(()).item()  # noqa: E731
        outs = {t.role: t for t in self.outputs}
        (self._fwd if kind == "fwd" else self._bwd)(args, kw, bufs, lens, val, outs)

    def _attend(self, q, k, v, kw):
        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
        s = q @ k.transpose(-1, -2) * kw["attn_scale"]
        if kw["use_causal_mask"]:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return s, s.softmax(-1), k, v

    def _fwd(self, args, kw, bufs, lens, val, outs):
        q, k, v, dq, dk, dv, _, _, so = args
        seqs = [self._seqs(t, bufs, lens) for t in (q, k, v)]
        o_views = self._seqs(outs["o"], bufs, lens)
        stats = self._seqs(outs["stats"], bufs, lens) if "stats" in outs else [None] * len(lens)
        for qs, ks, vs, ov, sv in zip(*seqs, o_views, stats):
            s, p, _, vr = self._attend(qs.float() * val(dq), ks.float() * val(dk), vs.float() * val(dv), kw)
            ov.copy_((p @ vr * val(so)).to(torch.float8_e4m3fn))
            if sv is not None:
                sv.copy_(s.logsumexp(-1, keepdim=True))

    def _bwd(self, args, kw, bufs, lens, val, outs):
        q, k, v, o, do, stats, dq_, dk_, dv_, do_, ddo, _, _, _, sdq, sdk, sdv, _ = args
        ins = [self._seqs(t, bufs, lens) for t in (q, k, v, o, do)]
        grads = [self._seqs(outs[r], bufs, lens) for r in ("dq", "dk", "dv")]
        for (qs, ks, vs, os_, dos), gq, gk, gv in zip(zip(*ins), *grads):
            qf, kf, vf = qs.float() * val(dq_), ks.float() * val(dk_), vs.float() * val(dv_)
            of, dof = os_.float() * val(do_), dos.float() * val(ddo)
            _, p, kr, vr = self._attend(qf, kf, vf, kw)
            ds = p * (dof @ vr.transpose(-1, -2) - (dof * of).sum(-1, keepdim=True)) * kw["attn_scale"]
            group = qf.shape[0] // kf.shape[0]
            fold = lambda t: t.unflatten(0, (-1, group)).sum(1)  # noqa: E731
            gq.copy_((ds @ kr * val(sdq)).to(torch.float8_e4m3fn))
            gk.copy_((fold(ds.transpose(-1, -2) @ qf) * val(sdk)).to(torch.float8_e4m3fn))
            gv.copy_((fold(p.transpose(-1, -2) @ dof) * val(sdv)).to(torch.float8_e4m3fn))

    @property
    def outputs(self):
        return [t for t in self._all() if t.output]

    def _all(self):
        """Every tensor made for this graph (``_fake_cudnn`` keeps the list)."""
        raise NotImplementedError


def _fake_cudnn(monkeypatch):
    made: list = []
    real_init = FakeTensor.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(FakeTensor, "__init__", init)
    monkeypatch.setattr(FakeGraph, "_all", lambda self: [t for t in made if t.graph is self])
    FakeGraph.made, FakeGraph.reject, FakeGraph.fail = [], None, None
    return types.SimpleNamespace(data_type=types.SimpleNamespace(FP8_E4M3="fp8", FLOAT="f32", INT32="i32"),
                                 heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"), pygraph=FakeGraph)


def _args(probe, *extra):
    return probe.parse_args(["--lens", "37,5,64,20", "--heads", "4", "--dim", "16", *extra])


def test_every_configuration_runs_on_the_fake_within_bounds_and_writes_nothing_past_the_sequences(probe, monkeypatch):
    """The descriptors are right: a fake that computes from them gives the probe's reference back
    (up to the FP8 rounding of the outputs), in the padded control and every packed layout."""
    cudnn = _fake_cudnn(monkeypatch)
    args = _args(probe)
    results = [probe.run_config(c, args, cudnn, None, "cpu") for c in args.configs]
    assert [r["name"] for r in results] == [c.name for c in probe.CONFIGS]
    for r in results:
        fwd, bwd = r["forward"], r["backward"]
        assert fwd["status"] == "ran" and fwd["within_bounds"], r
        assert 0 < fwd["errors"]["o"] <= probe.BOUNDS["o"], r  # FP8 output rounding, nothing more
        if r["stats"] == "none":
            assert "lse_abs" not in fwd["errors"] and bwd["status"] == "skipped", r
        else:
            assert fwd["errors"]["lse_abs"] < 1e-4, r
            assert bwd["status"] == "ran" and bwd["within_bounds"], r
            assert all(0 < bwd["errors"][n] <= probe.BOUNDS[n] for n in ("dq", "dk", "dv")), r
        assert fwd["tail_untouched"] is (True if r["packed"] else None), r
    gqa = next(r for r in results if r["name"] == "packed_causal_gqa")
    assert (gqa["h_q"], gqa["h_kv"], gqa["s_max"], gqa["tokens"]) == (4, 1, 64, 126)
    assert next(r for r in results if r["name"] == "packed_causal_d64")["dim"] == 64


def test_packed_graphs_declare_token_major_operands_with_ragged_offsets(probe, monkeypatch):
    cudnn = _fake_cudnn(monkeypatch)
    args = _args(probe, "--configs", "packed_causal,padded_control")
    probe.run_config(args.configs[0], args, cudnn, None, "cpu")
    fwd = FakeGraph.made[0]
    kind, (q, k, v, *_), kw = fwd.op
    assert kind == "fwd" and kw["use_causal_mask"] and kw["attn_scale"] == 16 ** -0.5
    assert q.dims == (4, 4, 64, 16) and q.strides == (64 * 4 * 16, 16, 4 * 16, 1)  # (T, H, D) seen as (B, H, S, D)
    for t in (q, k, v):
        assert t.ragged is not None and t.ragged.dims == (5, 1, 1, 1)
    stats = next(t for t in fwd._all() if t.role == "stats")
    assert stats.ragged is not None and stats.strides == (64 * 4, 1, 4, 1)
    cudnn = _fake_cudnn(monkeypatch)
    probe.run_config(args.configs[1], args, cudnn, None, "cpu")
    _, (q, *_), _ = FakeGraph.made[0].op
    assert q.ragged is None and q.strides == (4 * 64 * 16, 64 * 16, 16, 1)


def test_a_rejected_build_or_a_failed_run_is_recorded_and_the_next_configuration_runs(probe, monkeypatch):
    cudnn = _fake_cudnn(monkeypatch)
    args = _args(probe)
    FakeGraph.reject = "cudnnGraphNotSupportedError: No valid engine configs for SDPA_FP8_FWD"
    results = [probe.run_config(c, args, cudnn, None, "cpu") for c in args.configs]
    assert len(results) == len(probe.CONFIGS) and len(FakeGraph.made) == len(probe.CONFIGS)  # each one tried
    for r in results:
        assert r["forward"] == {"status": "rejected", "message": "RuntimeError: " + FakeGraph.reject}
        assert r["backward"] == {"status": "skipped", "message": "the forward did not run"}
    FakeGraph.reject, FakeGraph.fail = None, "CUDA error: an illegal memory access was encountered"
    r = probe.run_config(probe.BY_NAME["packed_full"], args, cudnn, None, "cpu")
    assert r["forward"]["status"] == "failed" and "illegal memory access" in r["forward"]["message"]
    assert not probe.control_ran([r])
    summary = probe.summarize(args, results, {"gpu": "fake"})
    assert not summary["packed_forward_served"] and not summary["packed_backward_served"]
    assert "packed_causal: forward rejected: RuntimeError: cudnnGraphNotSupportedError" in probe.line(results[1])


def test_the_summary_document(probe, monkeypatch, tmp_path):
    cudnn = _fake_cudnn(monkeypatch)
    args = _args(probe, "--configs", "padded_control,packed_causal_inference")
    results = [probe.run_config(c, args, cudnn, None, "cpu") for c in args.configs]
    summary = json.loads(json.dumps(probe.summarize(args, results, {"gpu": "fake", "torch": "x"})))
    assert summary["meta"] == {"gpu": "fake", "torch": "x", "lens": [37, 5, 64, 20], "heads": 4, "dim": 16, "seed": 0}
    assert [c["name"] for c in summary["configs"]] == ["padded_control", "packed_causal_inference"]
    assert summary["packed_forward_served"] and not summary["packed_backward_served"]  # an inference-only packed run
    first = summary["configs"][0]
    assert set(first) == {"name", "packed", "causal", "h_q", "h_kv", "dim", "stats", "s_max", "tokens", "forward",
                          "backward"}
    assert set(first["forward"]) == {"status", "message", "errors", "within_bounds", "tail_untouched"}
    assert probe.control_ran(results)
    text = probe.line(results[0])
    assert text.startswith("padded_control: forward ran o 0.0") and "| backward ran dq " in text
    out_of_bounds = dict(results[1], forward=dict(results[1]["forward"], within_bounds=False, tail_untouched=False))
    assert "(OUT OF BOUNDS) (WROTE PAST THE LAST SEQUENCE)" in probe.line(out_of_bounds)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the probe itself")
def test_without_cuda_it_exits_4_and_a_child_that_dies_is_recorded_as_crashed(probe):
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == probe.EXIT_NO_CUDA == 4 and "needs a CUDA GPU" in done.stderr
    r = probe.run_isolated(probe.BY_NAME["packed_causal"], _args(probe))  # its child exits without a summary
    assert r["forward"] == {"status": "crashed", "message": "fp8_varlen_probe: needs a CUDA GPU"}
    assert r["backward"]["status"] == "skipped" and r["name"] == "packed_causal" and r["tokens"] == 126


def test_a_child_past_its_limit_is_recorded_as_crashed_within_a_device_call(probe, monkeypatch):
    """A configuration's process gets less than the GPU tier's 600 s per device call: a hung one is
    recorded (the next configurations run, the summary is written) before the call is cut."""
    assert probe.CHILD_TIMEOUT_S < 600
    monkeypatch.setattr(probe, "CHILD_TIMEOUT_S", 0.01)  # the child cannot even import torch in time
    r = probe.run_isolated(probe.BY_NAME["packed_full"], _args(probe))
    assert r["forward"] == {"status": "crashed", "message": "no answer in 0.01 s"}, r


def test_the_padded_controls_backward_gets_an_o_zeroed_past_each_length(probe, monkeypatch):
    """As csp.fp8 zeroes a padded O's rows past the lengths before its backward; the packed O keeps
    its NaN canary past the last sequence (a backward reading there would come out NaN)."""
    cudnn = _fake_cudnn(monkeypatch)
    args = _args(probe)
    for name in ("padded_control", "packed_causal"):
        p = probe.problem(probe.BY_NAME[name], args, "cpu")
        result, state = probe.forward_pass(cudnn, None, p, probe.make_operands(p, 0))
        assert result["status"] == "ran"
        raw = state["o_buf"].view(torch.uint8)
        if name == "padded_control":
            for b, n in enumerate(p.lens):
                assert not raw[b, :, n:].any() and (raw[b, :, :n] != probe.NAN_BYTE).all(), (b, n)
        else:
            assert (raw[p.t:] == probe.NAN_BYTE).all() and (raw[: p.t] != probe.NAN_BYTE).all()
