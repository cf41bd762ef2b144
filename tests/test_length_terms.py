"""core/length_terms.py: the row terms of package-made lengths, computed once and reused only while
nothing can have changed them; and the engine's padded calls with such lengths (CPU, fake cuDNN)."""

from __future__ import annotations

import gc
import pathlib
import re
import subprocess
import sys
import weakref

import pytest
import torch

from cudnn_sdpa_provider.core import env, length_terms, rows
from cudnn_sdpa_provider.engine import dense, folded, graphs
from cudnn_sdpa_provider.ops import reference
from tests import fake_cudnn
from tests.util import assert_rel_close


def _pair(kv=(9, 4, 0)):
    return torch.full((len(kv),), 9, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32)


class _Make:
    """A term maker that counts its calls and returns a fresh tensor each time."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return torch.zeros(1)


def test_an_owned_pair_computes_each_term_once():
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make, other = _Make(), _Make()
    first = length_terms.get(lq, lk, ("a", 9), make)
    assert length_terms.get(lq, lk, ("a", 9), make) is first and make.calls == 1
    assert length_terms.get(lq, lk, ("a", 10), other) is not first and other.calls == 1, "another key, another term"


def test_lengths_nobody_marked_compute_every_time():
    lq, lk = _pair()
    make = _Make()
    length_terms.get(lq, lk, ("a",), make)
    length_terms.get(lq, lk, ("a",), make)
    assert make.calls == 2


def test_an_in_place_write_drops_the_terms_for_good():
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make = _Make()
    length_terms.get(lq, lk, ("a",), make)
    lk.add_(1)  # a write through torch: the version counter moves
    length_terms.get(lq, lk, ("a",), make)
    length_terms.get(lq, lk, ("a",), make)
    assert make.calls == 3
    lq2, lk2 = _pair()
    length_terms.own(lq2, lk2)
    lq2.fill_(3)  # the query lengths are checked too
    length_terms.get(lq2, lk2, ("a",), make)
    length_terms.get(lq2, lk2, ("a",), make)
    assert make.calls == 5


def test_the_kv_lengths_with_other_query_lengths_compute_afresh():
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make = _Make()
    length_terms.get(lq, lk, ("a",), make)
    length_terms.get(lq.clone(), lk, ("a",), make)
    assert make.calls == 2


def test_inference_tensors_are_not_marked():
    """They keep no version counter, so a write to them could not be seen."""
    with torch.inference_mode():
        lq, lk = _pair()
        length_terms.own(lq, lk)
        make = _Make()
        length_terms.get(lq, lk, ("a",), make)
        length_terms.get(lq, lk, ("a",), make)
    assert make.calls == 2


def test_a_marked_pair_used_inside_inference_mode_is_reused():
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make = _Make()
    with torch.inference_mode():
        length_terms.get(lq, lk, ("a",), make)
        length_terms.get(lq, lk, ("a",), make)
    assert make.calls == 1


def test_a_capture_neither_marks_nor_reads_nor_keeps(monkeypatch):
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make = _Make()
    kept = length_terms.get(lq, lk, ("a",), make)
    monkeypatch.setattr(length_terms, "_capturing", lambda t: True)
    assert length_terms.get(lq, lk, ("a",), make) is not kept, "a capture does not read a term made before it"
    length_terms.get(lq, lk, ("b",), make)
    fresh_q, fresh_kv = _pair()
    length_terms.own(fresh_q, fresh_kv)  # lengths made during a capture are not marked
    monkeypatch.setattr(length_terms, "_capturing", lambda t: False)
    length_terms.get(fresh_q, fresh_kv, ("a",), make)
    length_terms.get(fresh_q, fresh_kv, ("a",), make)
    length_terms.get(lq, lk, ("b",), make)  # what the capture computed for "b" was not kept
    assert make.calls == 6
    assert length_terms.get(lq, lk, ("a",), make) is kept and make.calls == 6


def test_terms_are_freed_with_their_lengths():
    lq, lk = _pair()
    length_terms.own(lq, lk)
    term = weakref.ref(length_terms.get(lq, lk, ("a",), _Make()))
    del lq, lk
    gc.collect()
    assert term() is None


# ------------------------------------------------------------------- the engine's padded calls


@pytest.fixture(params=["buckets", "exact"])
def fake(request, monkeypatch):
    """The stand-in cuDNN, with the length buckets on (the folded graphs) or off (the exact graphs)."""
    monkeypatch.setenv(env.SHAPE_BUCKETS, "1" if request.param == "buckets" else "0")
    fake_cudnn.FakeGraph.builds = 0
    graphs.clear_cache()
    built = fake_cudnn.install(monkeypatch)
    folds = []
    real = folded.run_forward
    monkeypatch.setattr(folded, "run_forward", lambda *a, **kw: folds.append(1) or real(*a, **kw))
    yield request.param, folds
    graphs.clear_cache()


def _counting(monkeypatch) -> dict:
    """Calls of the row-term functions on lengths, by name (``dead_rows`` without lengths, from the
    shapes alone, runs when a binding is made: not counted)."""
    calls = {}
    for name in ("bad_lengths", "dead_rows", "rows_past"):
        original = getattr(rows, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if _name != "dead_rows" or (args[4:5] or [kwargs.get("seq_len_q")])[0] is not None:
                calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(rows, name, counted)
    return calls


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (2, 0)])
def test_layers_sharing_owned_lengths_compute_the_row_terms_once_and_match_the_reference(fake, monkeypatch, window):
    """Three "layers" (their own q, k, v) and their backwards on one owned pair whose second batch
    row is padded and third out of range: every layer's answer and gradients are the fp64
    reference's (NaN for the out-of-range row), and the row terms were computed by the first."""
    mode, folds = fake
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    b, h, s, d = 3, 2, 9, 8
    lq = torch.tensor([9, 9, 9], dtype=torch.int32)
    lk = torch.tensor([9, 4, 11], dtype=torch.int32)  # 11 > S: out of range
    length_terms.own(lq, lk)
    for layer in range(3):
        q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
        go = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
        out, lse = dense.forward(q, k, v, scale=0.4, window=window, seq_len_q=lq, seq_len_kv=lk)
        dq, dk, dv, _ = dense.backward(go, q, k, v, out, lse, scale=0.4, window=window, seq_len_q=lq, seq_len_kv=lk)
        assert torch.isnan(out[2]).all(), "the out-of-range batch row is NaN in every layer"
        qr, kr, vr = (t[:2].clone().requires_grad_() for t in (q, k, v))
        want, _ = reference.dense(qr, kr, vr, scale=0.4, window=window, seq_len_q=lq[:2], seq_len_kv=lk[:2],
                                  compute_dtype=torch.float64)
        want_grads = torch.autograd.grad(want, (qr, kr, vr), go[:2])
        assert_rel_close(out[:2], want, 1e-9, f"layer {layer} out")
        for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads):
            assert_rel_close(got[:2], ref, 1e-9, f"layer {layer} {name}")
        assert (dk[1, :, 4:] == 0).all() and (dv[1, :, 4:] == 0).all(), "keys past the length get no gradient"
    assert calls == {"bad_lengths": 1, "dead_rows": 1, "rows_past": 1}, calls  # the backward takes the forward's
    assert len(folds) == (3 if mode == "buckets" else 0), "the path the fixture asked for ran"


def test_unowned_lengths_compute_the_row_terms_at_every_call(fake, monkeypatch):
    calls = _counting(monkeypatch)
    q, k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    lq, lk = torch.tensor([9, 9], dtype=torch.int32), torch.tensor([9, 4], dtype=torch.int32)
    for _ in range(2):
        dense.forward(q, k, v, scale=0.4, window=(-1, 0), seq_len_q=lq, seq_len_kv=lk)
    assert calls == {"bad_lengths": 2, "dead_rows": 2}, calls


def test_a_write_to_owned_lengths_between_layers_is_seen(fake):
    """The second layer runs on lengths written in place after the first: its padded rows follow the new
    lengths (terms computed from the old ones would keep rows 4.. of batch row 1 alive)."""
    q, k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    lq, lk = torch.tensor([9, 9], dtype=torch.int32), torch.tensor([9, 9], dtype=torch.int32)
    length_terms.own(lq, lk)
    dense.forward(q, k, v, scale=0.4, seq_len_q=lq, seq_len_kv=lk)
    lq[1] = 4
    out, _ = dense.forward(q, k, v, scale=0.4, seq_len_q=lq, seq_len_kv=lk)
    assert (out[1, :, 4:] == 0).all() and (out[1, :, :4] != 0).any()
    want, _ = reference.dense(q, k, v, scale=0.4, seq_len_q=lq, seq_len_kv=lk, compute_dtype=torch.float64)
    assert_rel_close(out, want, 1e-9, "out after the write")


def test_the_padded_host_script_counts_fewer_launches_for_owned_lengths():
    """scripts/padded_host_cpu.py (the stand-in cuDNN): the owned pair launches the row terms once."""
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "padded_host_cpu.py"
    done = subprocess.run([sys.executable, str(script), "--calls", "2", "--rounds", "1"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    ops = {m[0]: float(m[1]) for m in re.findall(r"^\s+(plain|padded|owned|full)\s+(\d+) aten ops", done.stdout,
                                                  re.M)}
    assert set(ops) == {"plain", "padded", "owned", "full"}, done.stdout
    assert ops["plain"] < ops["full"] < ops["owned"] < ops["padded"] / 3, ops


def test_the_transformers_integration_computes_its_row_terms_once_per_forward():
    """scripts/padded_host_cpu.py --hf: a 2-layer HF training step through the integration issues at
    most 30 aten ops more than the same step on sdpa (the mask builder and the keys past each length
    once, no range check or row fix: 9 fewer on the stand-in, results/cpu-padded-host.txt; with the
    range check, the row fix and the dead rows, 26 more; with every term at every layer's forward and
    backward, 121)."""
    pytest.importorskip("transformers")
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "padded_host_cpu.py"
    done = subprocess.run([sys.executable, str(script), "--calls", "1", "--rounds", "1", "--hf"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = dict(re.findall(r"attn_implementation='(\w+)': (\d+) aten ops", done.stdout))
    assert set(steps) == {"sdpa", "cudnn"}, done.stdout
    assert int(steps["sdpa"]) > 0 and int(steps["cudnn"]) - int(steps["sdpa"]) <= 30, steps


@pytest.mark.parametrize("owner, name", [(torch.compiler, "is_compiling"), (torch.jit, "is_tracing")])
def test_nothing_is_marked_while_compiling_or_tracing(monkeypatch, owner, name):
    monkeypatch.setattr(owner, name, lambda: True)
    lq, lk = _pair()
    length_terms.own(lq, lk)
    make = _Make()
    length_terms.get(lq, lk, ("a",), make)
    length_terms.get(lq, lk, ("a",), make)
    assert make.calls == 2


def _fwd_bwd(q, k, v, go, lq, lk, window, bottom_right):
    out, lse = dense.forward(q, k, v, scale=0.4, window=window, bottom_right=bottom_right, seq_len_q=lq,
                             seq_len_kv=lk)
    return (out,) + dense.backward(go, q, k, v, out, lse, scale=0.4, window=window, bottom_right=bottom_right,
                                   seq_len_q=lq, seq_len_kv=lk)[:3]


def test_each_key_part_gets_its_own_terms(fake):
    """One marked pair through calls that differ in one part of the terms' keys at a time (S_q, S_kv,
    window, alignment): each call's answers and gradients are those of the same call on lengths
    nobody marked (a term taken from another call's key would zero or keep other rows)."""
    gen = torch.Generator().manual_seed(5)
    lq, lk = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([7, 3], dtype=torch.int32)
    length_terms.own(lq, lk)
    # Batch row 1 (4 queries, 3 keys, bottom-right: offset -1): its first query sees no key under the
    # causal window aligned bottom-right, one under (0, 2) or top-left; S_kv 6 puts batch row 0's 7 keys
    # out of range (NaN).
    f64, f32 = torch.float64, torch.float32  # the output's dtype: its fill value's
    for s_q, s_kv, window, bottom_right, dtype in (
            (6, 8, (-1, 0), False, f64), (6, 8, (-1, 0), True, f64), (6, 8, (2, 0), True, f64),
            (5, 8, (-1, 0), True, f64), (6, 7, (-1, 0), True, f64), (6, 7, (0, 2), True, f64),
            (6, 7, (-1, -1), False, f64), (6, 7, (1, 1), False, f64), (6, 6, (-1, 0), False, f64),
            (6, 7, (-1, 0), False, f64), (6, 7, (-1, 0), False, f32)):
        q = torch.randn(2, 2, s_q, 8, generator=gen, dtype=dtype)
        k, v = (torch.randn(2, 2, s_kv, 8, generator=gen, dtype=dtype) for _ in range(2))
        go = torch.randn(2, 2, s_q, 8, generator=gen, dtype=dtype)
        marked = _fwd_bwd(q, k, v, go, lq, lk, window, bottom_right)
        plain = _fwd_bwd(q, k, v, go, lq.clone(), lk.clone(), window, bottom_right)
        for name, a, b in zip(("out", "dq", "dk", "dv"), marked, plain):
            assert torch.equal(a.nan_to_num(9.0), b.nan_to_num(9.0)), (name, s_q, s_kv, window, bottom_right)


# ------------------------------------------------------------ what a maker read: every row is live


def test_full_answers_only_what_the_maker_stated_while_it_holds(monkeypatch):
    lq, lk = _pair(kv=(9, 4, 1))
    assert not length_terms.full(lq, lk, 9, 9), "nothing marked"
    length_terms.own(lq, lk)
    assert not length_terms.full(lq, lk, 9, 9), "marked, but nothing stated"
    length_terms.own(lq, lk, full=(9, 9))
    assert length_terms.full(lq, lk, 9, 9)
    assert not length_terms.full(lq, lk, 9, 10) and not length_terms.full(lq, lk, 8, 9), "other shapes"
    assert not length_terms.full(lq.clone(), lk, 9, 9), "other query lengths"
    monkeypatch.setattr(length_terms, "_capturing", lambda t: True)
    assert not length_terms.full(lq, lk, 9, 9), "not while capturing"
    monkeypatch.setattr(length_terms, "_capturing", lambda t: False)
    assert length_terms.full(lq, lk, 9, 9)
    lk[2] = 0  # a write through torch: what was read no longer holds
    assert not length_terms.full(lq, lk, 9, 9)


@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (-1, 3), (0, 0), (2, 0), (2, -1), (1, 1)])
def test_none_dead_holds_only_where_no_row_is_dead_and_no_length_is_out_of_range(window, bottom_right):
    """Over random lengths that satisfy a ``full`` statement (query lengths S_q, key lengths in
    [1, S_kv]), S_q both below and above S_kv: ``bad_lengths`` is all False, so ``safe_lengths`` may
    give them as they are; where ``rows.none_dead`` says so, the rows ``dead_rows`` computes on the
    device are all live; and it does say so for every top-left window without a left bound (the
    transformers integration's causal and full masks)."""
    gen = torch.Generator().manual_seed(11)
    said = 0
    for s_q, s_kv in ((7, 7), (5, 9), (9, 5), (1, 6), (6, 1)):
        for _ in range(20):
            lk = torch.randint(1, s_kv + 1, (4,), generator=gen, dtype=torch.int32)
            lq = torch.full_like(lk, s_q)
            length_terms.own(lq, lk)
            assert not rows.none_dead(s_q, s_kv, window, bottom_right, lq, lk), "not without the maker's word"
            length_terms.own(lq, lk, full=(s_q, s_kv))
            safe_q, safe_kv, bad = rows.safe_lengths(lq, lk, s_q, s_kv)  # given as they are: in range
            assert safe_q is lq and safe_kv is lk and not bad.any()
            assert not rows.bad_lengths(lq, lk, s_q, s_kv).any()
            if not rows.none_dead(s_q, s_kv, window, bottom_right, lq, lk):
                continue
            said += 1
            dead = rows.dead_rows(s_q, s_kv, window, bottom_right, lq, lk)
            assert not dead.any(), (s_q, s_kv, lk.tolist())
    assert said == (100 if window[0] < 0 and not bottom_right else 0)


def test_a_full_pair_skips_the_dead_rows_and_matches_the_unmarked_call(fake, monkeypatch):
    """Layers on a pair whose maker stated ``full``: neither the dead-row mask (no forward row fix, no
    dQ fill) nor the out-of-range check is computed, the keys past each length once, and every
    answer and gradient is that of the same call on lengths nobody marked."""
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    b, h, s, d = 3, 2, 9, 8
    lq, lk = torch.full((b,), s, dtype=torch.int32), torch.tensor([9, 4, 1], dtype=torch.int32)
    length_terms.own(lq, lk, full=(s, s))
    for window in ((-1, 0), (-1, -1), (-1, 0)):
        q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
        go = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
        marked = _fwd_bwd(q, k, v, go, lq, lk, window, False)
        counted = dict(calls)
        plain = _fwd_bwd(q, k, v, go, lq.clone(), lk.clone(), window, False)
        calls.clear()
        calls.update(counted)
        for name, x, y in zip(("out", "dq", "dk", "dv"), marked, plain):
            assert torch.equal(x, y), (name, window)
        assert (marked[2][1, :, 4:] == 0).all() and (marked[3][2, :, 1:] == 0).all(), "keys past the length"
    assert calls == {"rows_past": 1}, calls
