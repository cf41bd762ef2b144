"""CPU tier: FP8 quantisation (``ops.fp8_quant``) and the two recipes of ``csp.fp8.Recipe`` (issue #30).

What is tested: the scale's definition (an exact power of 2 from exponent bits); delayed scaling's
history (the scale follows the largest of the last N amax values, a first call is current
scaling, a jump in amax is redone at the current scale and counted exactly once per saturated
call, in ``Recipe.saturated`` and ``csp.stats().fp8_saturated``, ``reset_stats`` / ``Recipe.reset``);
the delayed backward (no re-run after its first call, its history, a clipping call counted);
``Recipe`` validation; accuracy of ``csp.fp8.attention`` under both recipes against float64
F.sdpa over several calls; the Triton kernels' bits against the torch path (under
``TRITON_INTERPRET=1``, skipped without triton) and the torch.compile'd path's; the
``cudnn_sdpa::fp8_quantize`` op under opcheck and torch.compile; the environment variable; the
bench script's arguments.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, env
from cudnn_sdpa_provider.ops import fp8_ops, fp8_quant
from tests.test_fp8 import (ATTN_FWD_TOL, ATTN_GRAD_TOL, attn_inputs, run_attention, sdpa64_grads)
from tests.util import opcheck, rel_error

fp8 = csp.fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOP = {E4M3: 448.0, E5M2: 57344.0}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def gen(seed):
    return torch.Generator().manual_seed(seed)


def pow2_at_most(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """FP8 tensors equal byte for byte where finite, NaN at the same places (NaN's sign may differ)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb), f"{what}: NaN at different places ({int(na.sum())} vs {int(nb.sum())})"
    differ = (a.view(torch.uint8) != b.view(torch.uint8)) & ~na
    assert not differ.any(), f"{what}: {int(differ.sum())} bytes differ, e.g. {a.float()[differ][:4].tolist()} vs " \
                             f"{b.float()[differ][:4].tolist()}"


def same_value(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert torch.equal(a, b) or (torch.isnan(a).all() and torch.isnan(b).all()), f"{what}: {a} vs {b}"


def hard_inputs(seed: int, dtype: torch.dtype, fmt=E4M3):
    """Tensors that reach the cast's edges: random magnitudes, values at and near the format's top
    after scaling, e4m3/e5m2 subnormals after scaling, zeros and signed zeros, and one with each
    of +inf, -inf and NaN; transposed and sliced layouts."""
    g = gen(seed)
    out = []
    for exp in (-7, 0, 3):
        x = torch.randn(3, 4, 50, 16, generator=g) * 10.0 ** exp
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
        amax = x.abs().max()
        x[0, 1, 0, :4] = torch.tensor([1.0, -1.0, 0.999, 0.5]) * amax  # the top after scaling
        x[0, 2, 0, :8] = amax * torch.tensor([2.0**-12, 2.0**-13, 3 * 2.0**-14, 2.0**-17, 2.0**-20, -2.0**-15,
                                               2.0**-16, 5 * 2.0**-18])  # below e4m3's smallest normal
        out.append(x)
    out.append(out[1].transpose(1, 2))
    out.append(out[1][..., ::3])
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = out[1].clone()
        x[2, 3, 7, 5] = bad
        out.append(x)
    if dtype == torch.float16:  # keep within fp16's range
        out = [x / x[torch.isfinite(x)].abs().max() * 1000 for x in out]
    return [x.to(dtype) for x in out]


# ---------------------------------------------------------------------------------- definition


def test_pow2_below_is_the_largest_power_of_2_at_most_top_over_b():
    b = torch.cat([torch.rand(2000, generator=gen(1)) * 10.0 ** torch.randint(-20, 20, (2000,), generator=gen(2)),
                   torch.tensor([448.0, 224.0, 1.75, 1.7500001, 1.7499999, 1e-30, 3e38])])
    for dtype in (E4M3, E5M2):
        got = fp8_quant.pow2_below(b, dtype).double()
        ratio = TOP[dtype] / b.double()
        assert torch.all(got <= ratio) and torch.all(2 * got > ratio), dtype
        assert torch.all(torch.frexp(got).mantissa == 0.5), "a power of 2"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_current_scaling_is_the_power_of_2_that_fills_the_range(dtype, fmt):
    for x in hard_inputs(3, dtype, fmt)[:5]:
        stored, descale, amax = fp8_quant.current(x, fmt, impl="torch")
        assert amax.item() == x.float().abs().max().item()
        scale = 1 / descale.item()
        assert scale == pow2_at_most(TOP[fmt] / amax.item())
        assert torch.equal(stored.view(torch.uint8), (x.float() * scale).to(fmt).view(torch.uint8))
        assert stored.stride() == x.stride() or not fp8_quant.dense(x)


def _history(rows=4):
    return fp8_quant.History.zeros(rows, 8, "cpu")


def _delayed(x, h, slot=0, margin=2.0, dtype=E4M3):
    return fp8_quant.delayed(x, dtype, h, slot, margin=margin, impl="torch")


def test_delayed_first_call_is_current_scaling_and_starts_the_history():
    x = torch.randn(4, 64, generator=gen(4)) * 3
    h = _history()
    stored, descale, amax = _delayed(x, h, slot=2)
    want = fp8_quant.current(x, impl="torch")
    same_bits(stored, want[0])
    assert torch.equal(descale, want[1]) and torch.equal(amax, want[2])
    assert h.amax[0, 2] == amax and h.row.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert h.saturated.sum() == 0 and torch.all(h.amax[:, [0, 1, 3]] == 0), "one slot only"


def test_delayed_scale_follows_the_largest_of_the_last_n_amax_values():
    """History of 4 rows, margin 2: the scale is pow2(448 / (2 x max of the last 4 amax values)),
    except on the first call (current: 256) and on the jump to 8 (saturated: redone, current 32)."""
    rows = 4
    h = _history(rows)
    g = gen(5)
    mags = [1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9]
    want = [256.0, 32.0, 16.0, 16.0, 16.0, 16.0, 128.0, 128.0]  # the 8 leaves the window at call 6
    for i, mag in enumerate(mags):
        x = torch.randn(256, generator=g)
        x = x / x.abs().max() * mag
        stored, descale, amax = _delayed(x, h, margin=2.0)
        assert amax.item() == torch.tensor(mag).item()
        assert 1 / descale.item() == want[i], f"call {i}"
        assert torch.equal(stored.view(torch.uint8), (x * want[i]).to(E4M3).view(torch.uint8))
        assert h.saturated[0].item() == (0 if i < 1 else 1), "the jump to 8 counts once"
    assert sorted(h.amax[:, 0].tolist()) == sorted(torch.tensor(mags[-rows:]).tolist()), "a ring of the last 4"
    assert h.row[0].item() == len(mags) % rows


def test_a_jump_in_amax_is_redone_at_the_current_scale_and_counted_once_per_saturated_call():
    csp.reset_stats()
    h = _history(8)
    x = torch.randn(512, generator=gen(6))
    _delayed(x, h)
    before = csp.stats()
    for step in range(3):
        big = x * (20.0 * 4**step)  # above what the history's scale (margin 2) can hold
        stored, descale, amax = _delayed(big, h)
        want = fp8_quant.current(big, impl="torch")
        same_bits(stored, want[0], f"step {step}: redone at the current scale, not clipped")
        assert torch.equal(descale, want[1])
        assert h.saturated[0].item() == step + 1
        assert (csp.stats() - before).fp8_saturated == step + 1
    stored, descale, _ = _delayed(x * 200, h)  # within the history now (its largest: 320 x): kept, not counted
    assert h.saturated[0].item() == 3 and 1 / descale.item() == pow2_at_most(TOP[E4M3] / (h.amax[:, 0].max() * 2))
    assert csp.stats().fp8_saturated >= 3
    csp.reset_stats()
    assert csp.stats().fp8_saturated == 0 and h.saturated[0].item() == 3, "reset_stats zeroes the stats only"


def test_an_amax_that_drops_far_below_the_history_is_redone_not_flushed():
    h = _history()
    x = torch.randn(512, generator=gen(7))
    _delayed(x, h)
    tiny = x * 1e-4
    stored, descale, _ = _delayed(tiny, h)
    same_bits(stored, fp8_quant.current(tiny, impl="torch")[0])
    assert h.saturated.sum() == 0, "a scale too small is redone, but it is not a saturation"


def test_a_non_finite_tensor_gives_nan_and_leaves_the_history_finite():
    h = _history()
    x = torch.randn(64, generator=gen(8))
    _delayed(x, h)
    bad = x.clone()
    bad[3] = float("nan")
    stored, descale, amax = _delayed(bad, h)
    assert torch.isnan(descale).all() and torch.isnan(stored.float()).all() and torch.isnan(amax)
    assert torch.isfinite(h.amax).all() and h.amax[1, 0] == 0 and h.saturated.sum() == 0
    stored, descale, _ = _delayed(x, h)
    assert 1 / descale.item() == pow2_at_most(TOP[E4M3] / (x.abs().max() * 2)), "the history still serves"


# -------------------------------------------------------------------------------------- Recipe


def test_recipe_defaults():
    r = fp8.Recipe()
    assert r.scaling == "current" and r.history_len == fp8.DEFAULT_HISTORY == 16 and r.margin == 2.0
    assert "scaling='current'" in repr(r) and "history=16" in repr(r)
    h = r.history("cpu")
    assert h.amax.shape == (16, 8) and h.row.shape == (8,) and r.history(torch.device("cpu")) is h
    assert fp8.Recipe(scaling="current", history=1).scaling == "current"


@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling="Delayed"), r"scaling must be one of \['delayed', 'current'\], got 'Delayed'"),
    (dict(scaling=None), "scaling must be one of"),
    (dict(scaling="tensorwise"), "scaling must be one of"),
    (dict(history=0), "history must be an int from 1 to 1024"),
    (dict(history=-3), "history must be an int"),
    (dict(history=1025), "history must be an int"),
    (dict(history=2.0), "history must be an int"),
    (dict(history=True), "history must be an int"),
])
def test_recipe_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8.Recipe(**kwargs)


def test_recipe_state_for_cuda_without_an_index_is_the_current_device_s(monkeypatch):
    """``recipe.history("cuda")`` (and ``state``, ``warm``) name the current CUDA device: the state the
    kernels keep for tensors on ``cuda:0``, not a fresh one under a key no tensor has (run 56 found
    ``history("cuda")`` all zeros after a saturated call on ``cuda:0``)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    recipe = csp.fp8.Recipe(scaling="delayed")
    recipe.warm("cuda", True)
    assert recipe.warm(torch.device("cuda", 0)) and recipe.warm("cuda:0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not recipe.warm("cuda")  # now the current device is cuda:1
    assert recipe.warm("cpu", True) and recipe.warm(torch.device("cpu"))


def test_recipe_reset_forgets_the_history():
    r = fp8.Recipe(scaling="delayed")
    q, k, v, go = attn_inputs(4, 4, 16, torch.float32, seed=90)
    run_attention(q, k, v, go, r)
    run_attention(q * 50, k, v, go, r)
    assert r.history("cpu").saturated[0].item() == 1 and r.saturated >= 1 and r.warm("cpu")
    r.reset()
    assert r.saturated == 0 and not r.warm("cpu") and torch.all(r.history("cpu").amax == 0)


# ------------------------------------------------------------------------- attention, backward


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_over_several_calls_matches_fp64_under_both_recipes(scaling, causal):
    """Five calls on one recipe (the delayed one's history fills, its backward stops syncing
    after the first): each within the bounds of tests/test_fp8.py (not loosened)."""
    recipe = fp8.Recipe(scaling=scaling)
    for step in range(5):
        q, k, v, go = attn_inputs(8, 2, 32, torch.bfloat16, seed=100 + step)
        got = run_attention(q, k, v, go, recipe, is_causal=causal)
        want = sdpa64_grads(q, k, v, go, causal)
        err = rel_error(got[0], want[0])[0]
        assert err <= ATTN_FWD_TOL, f"{scaling} step {step}: out {err:.4f}"
        for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
            err = rel_error(a, b)[0]
            assert err <= ATTN_GRAD_TOL, f"{scaling} step {step}: {name} {err:.4f}"
    assert recipe.saturated == 0


def test_the_delayed_backward_reruns_only_its_first_call_and_keeps_a_history():
    recipe = fp8.Recipe(scaling="delayed")
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=110)
    run_attention(q, k, v, go * 1e-5, recipe)  # tiny gradients: the first backward re-runs
    first = recipe.retries
    assert first >= 1 and recipe.warm("cpu")
    h = recipe.history("cpu")
    assert torch.all(h.amax[0, 4:8] > 0) and h.row[4:8].tolist() == [1] * 4, "gradient amax per unit recorded"
    for i in range(3):
        run_attention(q, k, v, go * 1e-5, recipe)
    assert recipe.retries == first, "no re-run (no host sync) once the history holds amax values"
    assert h.row[4:8].tolist() == [4] * 4 and h.saturated.sum() == 0


def test_a_warm_delayed_backward_takes_its_scales_from_the_history_only(monkeypatch):
    """Once warm, a delayed backward's scales come from the history (``_grad_scales``, whose aten
    form rounds them with ``_scales_from`` once); the state's own scales (``_scales_from`` on the
    state, about 15 aten launches), which only the first, adaptive backward uses, are not computed."""
    recipe = fp8.Recipe(scaling="delayed")
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=111)
    run_attention(q, k, v, go, recipe)
    assert recipe.warm("cpu")
    calls = {"_scales_from": 0, "_grad_scales": 0}
    for name in calls:
        real = getattr(fp8_ops, name)
        monkeypatch.setattr(fp8_ops, name, lambda *a, _name=name, _real=real: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a))
    run_attention(q, k, v, go, recipe)
    assert calls == {"_scales_from": 1, "_grad_scales": 1}, calls


def test_a_delayed_backward_whose_scale_clips_is_counted_once():
    csp.reset_stats()
    recipe = fp8.Recipe(scaling="delayed")
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=111)
    run_attention(q, k, v, go, recipe)
    retries = recipe.retries
    recipe.history("cpu").amax[:, 4:8] *= 1e-3  # a stale history: every gradient scale 1000x too large
    got = run_attention(q, k, v, go, recipe)
    assert recipe.retries == retries, "not re-run"
    assert recipe.history("cpu").saturated.tolist() == [0, 0, 0, 0, 1, 0, 0, 0], "one backward, counted once"
    assert recipe.saturated == 1 and csp.stats().fp8_saturated == 1
    assert "FP8 calls whose delayed scale would have clipped: 1" in csp.report()
    assert max(g.abs().max().item() for g in got[1:]) > 0
    want = sdpa64_grads(q, k, v, go, False)
    assert max(rel_error(a, b)[0] for a, b in zip(got[1:], want[1:])) > ATTN_GRAD_TOL, "clipped: reported, not hidden"
    again = run_attention(q, k, v, go, recipe)  # the history has this call's amax now
    assert recipe.saturated == 1 and csp.stats().fp8_saturated == 1
    for a, b in zip(again[1:], want[1:]):
        assert rel_error(a, b)[0] <= ATTN_GRAD_TOL


@pytest.mark.parametrize("which, factor", [("go", 64.0), ("q", 4.0), ("k", 0.25), ("v", 20.0), ("go", 1e-3)])
def test_a_jump_in_do_q_or_v_moves_the_gradient_scales_before_the_backward(which, factor):
    """The gradient history is kept per unit of the operands' descales, so a jump their own
    (redone) scales see moves dQ, dK, dV, dS's scales too: no clipping, accurate gradients."""
    recipe = fp8.Recipe(scaling="delayed")
    t = dict(zip(("q", "k", "v", "go"), attn_inputs(4, 4, 32, torch.float32, seed=114)))
    run_attention(t["q"], t["k"], t["v"], t["go"], recipe)
    t[which] = t[which] * factor
    got = run_attention(t["q"], t["k"], t["v"], t["go"], recipe)
    assert recipe.history("cpu").saturated[4].item() == 0, "the backward did not clip"
    want = sdpa64_grads(t["q"], t["k"], t["v"], t["go"], False)
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert rel_error(a, b)[0] <= ATTN_GRAD_TOL, name


def test_a_delayed_backward_whose_scale_is_far_too_small_is_counted_as_flushed():
    """A history 1000x above this call's gradients (a spike that has not left the window): the
    delayed backward is not re-run; each such call is counted in ``flushed`` (not in
    ``fp8_saturated``: nothing clipped) until the spike leaves the window."""
    csp.reset_stats()
    recipe = fp8.Recipe(scaling="delayed", history=2)
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=115)
    run_attention(q, k, v, go, recipe)
    recipe.history("cpu").amax[:, 4:8] *= 1e3
    for calls in (1, 2):
        run_attention(q, k, v, go, recipe)
        assert recipe.flushed == calls
    got = run_attention(q, k, v, go, recipe)  # both spiked rows are gone
    assert recipe.flushed == 2 and recipe.saturated == 0 and csp.stats().fp8_saturated == 0
    want = sdpa64_grads(q, k, v, go, False)
    for a, b in zip(got[1:], want[1:]):
        assert rel_error(a, b)[0] <= ATTN_GRAD_TOL


def test_the_current_recipe_keeps_rerunning_instead_of_counting():
    recipe = fp8.Recipe(scaling="current")
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=112)
    run_attention(q, k, v, go, recipe)
    retries = recipe.retries
    got = run_attention(q, k, v, go * 64, recipe)
    want = sdpa64_grads(q, k, v, go * 64, False)
    assert recipe.retries > retries and recipe.saturated == 0
    for a, b in zip(got[1:], want[1:]):
        assert rel_error(a, b)[0] <= ATTN_GRAD_TOL
    assert torch.all(recipe.history("cpu").amax == 0), "current scaling keeps no history"


def test_a_delayed_recipe_saturating_on_q_is_not_clipped():
    recipe = fp8.Recipe(scaling="delayed")
    q, k, v, go = attn_inputs(4, 4, 32, torch.float32, seed=113)
    run_attention(q, k, v, go, recipe)
    q2 = q * 30
    got = run_attention(q2, k, v, go, recipe)
    fresh = run_attention(q2, k, v, go, fp8.Recipe(scaling="current"))
    assert recipe.history("cpu").saturated[0].item() == 1
    assert torch.equal(got[0], fresh[0]), "the saturated q was redone at its own scale: current scaling's output"


# --------------------------------------------------------------------- implementations agree


def _interpreted_triton():
    """ops.fp8_quant_triton with TRITON_INTERPRET=1 (set before triton is imported: triton.language's
    own jit functions are made interpreted or compiled then), under a name of its own."""
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (this test runs it in a subprocess)")
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    path = ROOT / "cudnn_sdpa_provider" / "ops" / "fp8_quant_triton.py"
    spec = importlib.util.spec_from_file_location("cudnn_sdpa_provider.ops._fp8_quant_triton_cpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the interpreter finds a kernel's helpers there
    spec.loader.exec_module(module)
    return module


def check_triton_bits(dtype, fmt):
    """The Triton kernels (interpreted, with the integer cast ``soft_cast``, which the GPU test
    compares with the hardware's cast on the device) against the torch path: current at three
    margins on ``hard_inputs``, and a delayed sequence through a first call, a saturating jump, a
    drop, a NaN and an all-zero tensor, history and counters included."""
    tri = _interpreted_triton()
    for i, x in enumerate(hard_inputs(10, dtype, fmt)):
        dense = x if fp8_quant.dense(x) else x.contiguous()
        for margin in (1.0, 2.0, 1.5):
            want = fp8_quant.current(x, fmt, margin=margin, impl="torch")
            got = tri.current(dense, fmt, margin, soft_cast=True)
            same_bits(got[0], want[0], f"current input {i} margin {margin}")
            same_value(got[1], want[1], "descale")
            assert torch.equal(got[2], want[2]) or (torch.isnan(got[2]) and torch.isnan(want[2]))
    h_torch, h_tri = _history(4), _history(4)
    total = torch.zeros(1, dtype=torch.int32)
    g = gen(11)
    for step, mag in enumerate([1.0, 1.0, 40.0, 1e-4, 1.0, float("nan"), 0.0, 3.0, 1.0]):
        x = (torch.randn(3, 333, generator=g) * mag).to(dtype)
        want = fp8_quant.delayed(x, fmt, h_torch, 3, margin=2.0, impl="torch")
        got = tri.delayed(x, fmt, h_tri, 3, 2.0, total, fp8_quant.UNDER, soft_cast=True)
        same_bits(got[0], want[0], f"delayed step {step}")
        same_value(got[1], want[1], f"delayed step {step} descale")
        for field in ("amax", "row", "saturated"):
            assert torch.equal(getattr(h_tri, field), getattr(h_torch, field)), f"step {step}: {field}"
    assert h_tri.saturated[3].item() == 1 and total.item() == 1


def run_fresh(code: str, expect: str, interpret: bool = True, timeout: int = 900) -> None:
    """Run ``code`` in a fresh interpreter from the repository root, with ``TRITON_INTERPRET=1`` (set
    before triton is imported, as the interpreter needs) or without it, and assert it exits 0 and
    prints ``expect``. Skipped without triton."""
    pytest.importorskip("triton")
    env_ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env_["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env_)
    assert done.returncode == 0 and expect in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_triton_kernels_give_the_torch_path_s_bits():
    """``check_triton_bits`` for bf16/fp16/fp32 into e4m3/e5m2, in a fresh interpreter (skipped
    without triton: torch's CPU wheels do not bring it; ``pip install triton`` does)."""
    code = ("import torch; from tests.test_fp8_recipes import check_triton_bits as c\n"
            "for d in (torch.bfloat16, torch.float16, torch.float32):\n"
            "    for f in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
            "        c(d, f)\n"
            "print('bits equal')\n")
    run_fresh(code, "bits equal", timeout=600)


def check_grouped_bits(dtype, fmt):
    """The kernels that quantise q, k, v together (``fp8_quant_triton.inputs``, interpreted, integer
    cast) against the torch path one tensor at a time with ``fp8_quant.forward_factors``: stored
    bits, the seven factors, and under delayed scaling the history and counters after every step of
    a sequence with a first call, jumps, drops, a NaN, an all-zero v and sizes that differ; and
    ``dequantize`` against ``x.to(dtype) * factor.to(dtype)`` on all 256 e4m3fn bit patterns."""
    tri = _interpreted_triton()
    inputs = hard_inputs(13, dtype, fmt)

    def compare(got, want, what):
        for i, name in enumerate(("q8", "k8", "v8")):
            same_bits(got[i], getattr(want, name), f"{what} {name}")
        for i, name in enumerate(fp8_quant.FACTORS):
            same_value(got[3][i, :1], getattr(want, name).reshape(1).float(), f"{what} {name}")

    for i in range(len(inputs) - 2):
        q, k, v = (x if fp8_quant.dense(x) else x.contiguous() for x in inputs[i:i + 3])
        for margin in (1.0, 2.0):
            want = fp8_quant.attention_inputs(q, k, v, fmt, margin=margin, impl="torch")
            compare(tri.inputs(q, k, v, fmt, margin, soft_cast=True), want, f"current {i} margin {margin}")
    steps = [(1, 1, 1), (1, 1, 1), (40, 1, 1), (1, 1e-4, 1), (1, 1, 1), (1, float("nan"), 1), (1, 1, 0), (3, 3, 3)]
    # 5 rows: the ring wraps; 20: rows past the first 16 of the kernel's row load (row 17 holds the largest)
    for rows in (5, 20):
        h_torch, h_tri = _history(rows), _history(rows)
        if rows == 20:
            for hist in (h_torch, h_tri):
                hist.amax[17, 2:5] = 6.0
        total = torch.zeros(1, dtype=torch.int32)
        g = gen(14)
        for step, mags in enumerate(steps):  # q, k of 2-3 blocks, v of one: sizes differ
            shapes = [(2, 3, 3333), (2, 4, 3333), (1, 3, 333)]
            q, k, v = ((torch.randn(*shape, generator=g) * m).to(dtype) for shape, m in zip(shapes, mags))
            want = fp8_quant.attention_inputs(q, k, v, fmt, h_torch, first=2, margin=2.0, impl="torch")
            compare(tri.inputs(q, k, v, fmt, 2.0, h_tri, 2, total, fp8_quant.UNDER, soft_cast=True), want,
                    f"{rows} rows, delayed step {step}")
            for field in ("amax", "row", "saturated"):
                assert torch.equal(getattr(h_tri, field), getattr(h_torch, field)), f"step {step}: {field}"
        assert h_tri.saturated[2:5].sum().item() == total.item() >= 1
        assert h_torch.row[2].item() == len(steps) % rows
    every = torch.arange(256, dtype=torch.uint8).view(E4M3).reshape(16, 16)
    for factor in (1.0, 2.0**-9, 2.0**-20, 2.0**-26, 2.0**60, float("nan")):
        f = torch.tensor([factor])
        got = tri.dequantize(every, f, dtype, soft_cast=True)
        want = every.to(dtype) * f.to(dtype)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"dequantize x {factor}: NaN at other places"
        same = (got == want) | torch.isnan(want)
        assert same.all() and torch.equal(torch.signbit(got[~torch.isnan(got)]), torch.signbit(want[~torch.isnan(want)])), \
            f"dequantize x {factor}: {got[~same][:4].tolist()} vs {want[~same][:4].tolist()}"


def test_grouped_kernels_give_the_torch_path_s_bits():
    """``check_grouped_bits`` for bf16/fp16/fp32 into e4m3 and e5m2, in a fresh interpreter
    (skipped without triton)."""
    code = ("import torch; from tests.test_fp8_recipes import check_grouped_bits as c\n"
            "for d in (torch.bfloat16, torch.float16, torch.float32):\n"
            "    for f in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
            "        c(d, f)\n"
            "print('bits equal')\n")
    run_fresh(code, "bits equal", timeout=900)


def check_grad_twins(dtype, device="cpu", soft_cast=True):
    """``fp8_grad_triton`` (interpreted) against ``fp8_ops``' aten code, bit for bit, over a sequence
    of warm delayed backwards: the gradient scales and units from a history and this call's
    descales (a jump, a NaN descale), then the books after amax values that fit, clip (dS too),
    flush, are 0 or NaN: the history, its rows, the saturation counts and ``stats()``'s counter; and
    ``dequantize_grads`` (one launch for dq, dk, dv) against ``grad_factors`` and aten, NaN poison
    and a NaN dO descale included. On the CPU, run with TRITON_INTERPRET=1 set before triton is
    imported (``soft_cast``: the integer FP8 decoding); tests/gpu runs it on the device."""
    from cudnn_sdpa_provider.ops import fp8_grad_triton as tri_grad
    from cudnn_sdpa_provider.ops import fp8_quant_triton as tri

    h = [fp8_quant.History.zeros(4, 8, device) for _ in range(2)]
    for hist in h:
        hist.amax[:, 4:8] = torch.tensor([[3.0, 0.5, 2.0, 7.0], [1.0, 9.0, 0.25, 1.5], [0, 0, 0, 0], [2.5, 2.5, 1, 4]],
                                         device=device)
    counter = fp8_quant.saturation_counter(h[0].amax.device)  # the device with its index, as the kernels key it
    g = gen(31)
    nan = float("nan")
    # descales of q, k, v, o, dO: plain, a jump, NaN in k, in o, in dO; tiny ones (the recorded amax per
    # unit overflows: clamped to 3e38) and huge ones (the predicted amax is clamped)
    steps = [(1.0, 1.0, 1.0, 0.5, 1.0), (2.0**-3, 1.0, 4.0, 0.5, 1.0), (1.0, nan, 1.0, 0.5, 1.0),
             (1.0, 1.0, 1.0, nan, 1.0), (1.0, 1.0, 1.0, 0.5, nan), (2.0**10, 2.0**-7, 1.0, 0.5, 2.0**4),
             (2.0**-60, 2.0**-60, 2.0**-60, 0.5, 2.0**-60), (2.0**60, 2.0**60, 2.0**60, 0.5, 2.0**60),
             (1.0, 1.0, 1.0, 0.5, 1.0)]
    # amax x scale / 448 per output: fit, clip (dS too), 0, flushed, NaN, just under and over the top, and
    # 0.04, flushed without the margin (2) but not with it
    amax_over = [(0.3, 0.9, 0.5, 0.7), (1.5, 0.2, 0.9, 2.5), (0.0, 1e-5, nan, 0.5), (0.99, 1.01, 1e-4, 0.1),
                 (0.04, 0.04, 0.04, 0.04)]
    clamped = False
    for step, step_descales in enumerate(steps):
        descales = [torch.tensor([x], device=device) for x in step_descales]
        at_margin_1 = fp8_ops._grad_scales(h[0], descales, 1.0)[0]  # a predicted amax clamped to 3e38 stays finite
        same_value(tri_grad.grad_scales(h[1], descales, 1.0)[0].contiguous(), at_margin_1, f"step {step} margin 1")
        use_t, unit_t = fp8_ops._grad_scales(h[0], descales, 2.0)
        use_g, unit_g = tri_grad.grad_scales(h[1], descales, 2.0)
        same_value(use_g.contiguous(), use_t, f"step {step} scales")
        assert torch.equal(torch.isnan(unit_g), torch.isnan(unit_t)), f"step {step} unit: NaN places"
        assert torch.equal(unit_g[~torch.isnan(unit_t)], unit_t[~torch.isnan(unit_t)]), f"step {step} unit"
        for i, over in enumerate(amax_over):
            amax = (torch.tensor(over, device=device) * 448.0 / use_t).float()
            before = counter.clone()
            fp8_ops._grad_books(h[0], amax, use_t, unit_t, descales, 2.0)
            torch_counted = (counter - before).item()
            before = counter.clone()
            tri_grad.grad_books(h[1], amax, use_g, unit_g, descales, 2.0)
            assert (counter - before).item() == torch_counted, f"step {step} amax {i}: stats() count"
            for field in ("amax", "row", "saturated"):
                assert torch.equal(getattr(h[1], field), getattr(h[0], field)), f"step {step} amax {i}: {field}"
        clamped |= bool((h[0].amax[:, 4:8] == torch.tensor(3e38)).any())
    assert h[0].saturated[4].item() >= 2 and h[0].saturated[5].item() >= 1, "clipped and flushed calls were met"
    assert clamped, "an amax per unit that overflows was met (clamped to 3e38)"
    grads = [torch.randint(0, 256, (n, 7), generator=g, dtype=torch.uint8).view(E4M3).to(device)
             for n in (300, 1, 2000)]
    for use, poison, ddo in [((2.0**-4, 2.0**6, 1.0, 8.0), 0.0, 1.0), ((2.0**-20, 2.0**-30, 2.0**20, 1.0), 0.0, 1.0),
                             ((1.0, 1.0, 1.0, 1.0), nan, 1.0), ((1.0, 2.0, 4.0, 1.0), 0.0, nan),
                             ((2.0**3, 2.0**-5, 2.0**7, 1.0), 0.0, 1.0)]:
        if use[0] == 2.0**3:  # a contiguous (4,), as the current recipe's backward gives
            use = torch.tensor(use, device=device)
        else:  # one 16-byte row each, as grad_scales gives
            use = torch.tensor([[u, 0, 0, 0] for u in use], device=device)[:, 0]
        poison, ddo = torch.tensor([poison], device=device), torch.tensor([ddo], device=device)
        got = tri.dequantize_grads(*grads, use, poison, ddo, dtype, soft_cast=soft_cast)
        factor = fp8_ops.grad_factors(use, poison, ddo).to(dtype)
        for i, (a, x) in enumerate(zip(got, grads)):
            want = x.to(dtype) * factor[i]
            assert a.dtype == dtype and torch.equal(torch.isnan(a), torch.isnan(want)), f"grad {i}: NaN places"
            finite = ~torch.isnan(want)
            assert torch.equal(a[finite], want[finite]), f"grad {i} at {use.tolist()}: values differ"


def test_the_backward_s_triton_twins_give_the_aten_code_s_bits():
    """``check_grad_twins`` for bf16/fp16/fp32 outputs, in a fresh interpreter (skipped without triton)."""
    code = ("import torch; from tests.test_fp8_recipes import check_grad_twins as c\n"
            "for d in (torch.bfloat16, torch.float16, torch.float32):\n"
            "    c(d)\n"
            "print('bits equal')\n")
    run_fresh(code, "bits equal", timeout=900)


def check_compiled_warm_delayed_backward():
    """A warm delayed recipe's backward through the Triton twins (interpreted, on CPU tensors standing
    in for CUDA ones) under torch.compile with inductor: the ``fp8_bwd`` op's outputs must have the
    strides its fake kernel gives (inductor asserts them); the gradients equal eager's."""
    from cudnn_sdpa_provider.ops import fp8_ops

    fp8_ops._fused = lambda q: "triton"  # as under CUDNN_SDPA_PROVIDER_FP8_QUANT=triton on a GPU
    g = gen(41)
    q, k, v, go = (torch.randn(2, 8, 16, 32, generator=g) for _ in range(4))
    recipe = fp8.Recipe(scaling="delayed")

    def step(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(go)
        return [t.grad for t in leaves]

    def attend(a, b, c):
        return fp8.attention(a, b, c, recipe=recipe)

    step(attend)
    assert recipe.warm("cpu"), "the next backwards take the history (the Triton twins)"
    eager = step(attend)
    torch._dynamo.reset()
    for name, a, b in zip(("dq", "dk", "dv"), step(torch.compile(attend, backend="inductor")), eager):
        assert rel_error(a, b)[0] < 0.02, f"{name}: {rel_error(a, b)}"


def test_a_compiled_warm_delayed_backward_through_the_triton_twins():
    """``check_compiled_warm_delayed_backward`` in a fresh interpreter (skipped without triton)."""
    code = ("from tests.test_fp8_recipes import check_compiled_warm_delayed_backward as c\n"
            "c()\nprint('compiled ok')\n")
    run_fresh(code, "compiled ok", timeout=900)


def compile_kernels_for(arch: int) -> list:
    """Every Triton kernel of ``fp8_quant_triton`` and ``fp8_grad_triton`` compiled (not run) for ``sm_{arch}`` with the
    hardware cast, bf16 input: triton compiles without a GPU, so a kernel that does not build for
    the device fails here, not in a user's first FP8 call. Returns the kernels' names."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cudnn_sdpa_provider.ops import fp8_grad_triton as g
    from cudnn_sdpa_provider.ops import fp8_quant_triton as m

    tops = dict(TOP_EXP=135, TOP_MANT=0x600000)  # 448 = 1.75 x 2^8
    three = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "nq": "i32", "nk": "i32", "nv": "i32", "bq": "i32",
             "bk": "i32"}
    kernels = [
        (m._amax_kernel, {"x_ptr": "*bf16", "n": "i32", "amax_ptr": "*i32"}, {}),
        (m._delayed_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "n": "i32", "hist_ptr": "*fp32", "rows": "i32",
                             "hist_stride": "i32", "margin": "fp32", "scale_ptr": "*fp32", "amax_ptr": "*i32"},
         dict(ROWS=16, E5M2=False, SOFT=False, **tops)),
        (m._cast_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "n": "i32", "amax_ptr": "*i32", "margin": "fp32",
                          "descale_ptr": "*fp32", "scale_ptr": "*fp32", "hist_ptr": "*fp32", "rows": "i32",
                          "hist_stride": "i32", "row_ptr": "*i32", "sat_ptr": "*i32", "total_ptr": "*i32",
                          "under": "fp32", "top": "fp32"}, dict(DELAYED=True, E5M2=False, SOFT=False, **tops)),
        (m._amax3_kernel, {**three, "amax_ptr": "*i32"}, {}),
        (m._delayed3_kernel, {**three, "q8_ptr": "*u8", "k8_ptr": "*u8", "v8_ptr": "*u8", "hist_ptr": "*fp32",
                              "rows": "i32", "hist_stride": "i32", "margin": "fp32", "used_ptr": "*fp32",
                              "amax_ptr": "*i32"}, dict(ROWS=16, E5M2=False, SOFT=False, **tops)),
        (m._finish3_kernel, {**three, "q8_ptr": "*u8", "k8_ptr": "*u8", "v8_ptr": "*u8", "amax_ptr": "*i32",
                             "used_ptr": "*fp32", "margin": "fp32", "factors_ptr": "*fp32", "hist_ptr": "*fp32",
                             "rows": "i32", "hist_stride": "i32", "row_ptr": "*i32", "sat_ptr": "*i32",
                             "total_ptr": "*i32", "under": "fp32", "top": "fp32"},
         dict(DELAYED=True, O_EXP=135, O_MANT=0x440000, E5M2=False, SOFT=False, **tops)),
        (m._dequant_kernel, {"x_ptr": "*u8", "out_ptr": "*bf16", "n": "i32", "factor_ptr": "*fp32"}, dict(SOFT=False)),
        (m._dequant3_kernel, {"q_ptr": "*u8", "k_ptr": "*u8", "v_ptr": "*u8", "oq_ptr": "*bf16", "ok_ptr": "*bf16",
                              "ov_ptr": "*bf16", "nq": "i32", "nk": "i32", "nv": "i32", "bq": "i32", "bk": "i32",
                              "use_ptr": "*fp32", "use_stride": "i32", "poison_ptr": "*fp32", "ddo_ptr": "*fp32"},
         dict(SOFT=False)),
        (g._grad_scales_kernel, {"hist_ptr": "*fp32", "rows": "i32", "hist_stride": "i32", "dq_ptr": "*fp32",
                                 "dk_ptr": "*fp32", "dv_ptr": "*fp32", "ddo_ptr": "*fp32", "margin": "fp32",
                                 "use_ptr": "*fp32", "unit_ptr": "*fp64"},
         dict(ROWS=16, FIRST=4, TOP_EXP=135, TOP_MANT=0x600000, BLOCK=None)),
        (g._grad_books_kernel, {"amax_ptr": "*fp32", "use_ptr": "*fp32", "use_stride": "i32", "unit_ptr": "*fp64",
                                "dq_ptr": "*fp32", "dk_ptr": "*fp32", "dv_ptr": "*fp32", "do_ptr": "*fp32",
                                "ddo_ptr": "*fp32", "margin": "fp32", "under": "fp32", "inv_top": "fp32",
                                "hist_ptr": "*fp32", "rows": "i32", "hist_stride": "i32", "row_ptr": "*i32",
                                "sat_ptr": "*i32", "total_ptr": "*i32"}, dict(FIRST=4, BLOCK=None)),
    ]
    done = []
    for fn, signature, constants in kernels:
        constants = {"BLOCK": m.BLOCK, **constants}
        if constants["BLOCK"] is None:  # a single-program kernel without blocks
            del constants["BLOCK"]
        signature = {**signature, **{name: "constexpr" for name in constants}}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
        assert compiled.asm.get("cubin"), fn.__name__
        done.append(fn.__name__)
    return done


def test_the_triton_kernels_compile_for_sm90():
    """``compile_kernels_for(90)`` in a fresh interpreter without ``TRITON_INTERPRET`` (skipped
    without triton)."""
    run_fresh("from tests.test_fp8_recipes import compile_kernels_for as c; print('compiled', *c(90))",
              "_finish3_kernel", interpret=False)


def test_the_compiled_path_gives_the_torch_path_s_bits():
    torch._dynamo.reset()
    for x in hard_inputs(12, torch.bfloat16)[:4]:
        dense = x if fp8_quant.dense(x) else x.contiguous()
        want = fp8_quant._current_torch(dense, E4M3, 1.0)
        got = fp8_quant._compiled("current")(dense, E4M3, 1.0)
        same_bits(got[0], want[0], "compiled current")
        same_value(got[1], want[1])
    h = [_history(4), _history(4)]
    for step, mag in enumerate([1.0, 1.0, 40.0, 1e-4, 1.0]):
        x = torch.randn(4, 100, generator=gen(step)).bfloat16() * mag
        total = torch.zeros(1, dtype=torch.int32)  # ("compiled" runs only on CUDA through delayed())
        got = fp8_quant._compiled("delayed")(x, E4M3, h[1].amax, h[1].row, h[1].saturated, total, 1, 2.0)
        want = fp8_quant.delayed(x, E4M3, h[0], 1, margin=2.0, impl="torch")
        same_bits(got[0], want[0], f"compiled delayed step {step}")
        same_value(got[1], want[1])
    for field in ("amax", "row", "saturated"):
        assert torch.equal(getattr(h[0], field), getattr(h[1], field)), field


def test_choose_picks_torch_on_the_cpu_and_rejects_unknown_names():
    x = torch.zeros(2)
    assert [fp8_quant.choose(i, x) for i in fp8_quant.IMPLS] == ["torch"] * 4
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', 'triton', 'compiled', 'torch'\]"):
        fp8_quant.choose("cuda", x)


def test_auto_takes_the_triton_kernels_only_on_a_verified_device(monkeypatch):
    """On CUDA with triton importable, ``auto`` is ``triton`` only where the device's compute
    capability is in ``VERIFIED`` (the GPU tests passed there); ``triton`` forces it anywhere."""

    class OnCuda:  # what choose() reads of a CUDA tensor
        device = torch.device("cuda", 0)

    monkeypatch.setattr(fp8_quant, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_quant, "VERIFIED", ())
    assert [fp8_quant.choose(i, OnCuda()) for i in fp8_quant.IMPLS] == ["torch", "triton", "compiled", "torch"]
    monkeypatch.setattr(fp8_quant, "VERIFIED", ((10, 0),))
    assert fp8_quant.choose("auto", OnCuda()) == "torch"
    monkeypatch.setattr(fp8_quant, "VERIFIED", ((9, 0),))
    assert fp8_quant.choose("auto", OnCuda()) == "triton"


def test_the_grouped_kernels_run_under_auto_only_where_verified(monkeypatch):
    """``grouped``: the kernels for q, k, v together need ``choose`` to give triton and, under
    ``auto``, the device in ``GROUPED_VERIFIED`` as well; ``triton`` forces them; CPU never."""

    class OnCuda:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(fp8_quant, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_quant, "VERIFIED", ((9, 0),))
    monkeypatch.setattr(fp8_quant, "GROUPED_VERIFIED", ())
    assert [fp8_quant.grouped(i, OnCuda()) for i in fp8_quant.IMPLS] == [False, True, False, False]
    monkeypatch.setattr(fp8_quant, "GROUPED_VERIFIED", ((9, 0),))
    assert fp8_quant.grouped("auto", OnCuda()) and not fp8_quant.grouped("auto", torch.zeros(1))
    monkeypatch.setattr(fp8_quant, "VERIFIED", ())
    assert not fp8_quant.grouped("auto", OnCuda()), "the grouped kernels are Triton kernels: VERIFIED first"


def test_attention_inputs_and_dequantize_reject_what_they_cannot_take():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match=r"first must leave three history slots \(0 to 5\), got 6"):
        fp8_quant.attention_inputs(x, x, x, E4M3, _history(4), first=6)
    with pytest.raises(ValueError, match="margin must be >= 1"):
        fp8_quant.attention_inputs(x, x, x, E4M3, margin=0.5)
    with pytest.raises(TypeError, match="x must be float8_e4m3fn, got torch.float8_e5m2"):
        fp8_quant.dequantize(x.to(E5M2), torch.ones(1), torch.bfloat16)


def test_attention_inputs_on_the_torch_path_are_the_tensors_one_at_a_time_and_forward_factors():
    """``attention_inputs`` (CPU: the torch path) gives each tensor what ``current`` / ``delayed``
    give it alone, and factors: O's scale the largest power of 2 at most 392 / max |V| (1 for an
    all-zero V), descale_o its inverse, poison NaN exactly when q, k or v is not finite."""
    g = gen(21)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).bfloat16() * m for m in (1.0, 3.0, 0.01))
    f = fp8_quant.attention_inputs(q, k, v, E4M3, margin=1.0)
    for x, stored, descale in ((q, f.q8, f.descale_q), (k, f.k8, f.descale_k), (v, f.v8, f.descale_v)):
        alone = fp8_quant.current(x, E4M3, impl="torch")
        same_bits(stored, alone[0])
        same_value(descale, alone[1])
    amax_v = v.float().abs().max().item()
    assert f.scale_o.item() == pow2_at_most(392.0 / amax_v) and f.descale_o.item() == 1.0 / f.scale_o.item()
    assert f.poison.item() == 0.0 and f.out_factor.item() == f.descale_o.item()
    assert fp8_quant.attention_inputs(q, k, torch.zeros_like(v), E4M3).scale_o.item() == 1.0
    h = _history(4)
    fp8_quant.attention_inputs(q, k, v, E4M3, h, first=0, margin=2.0)
    assert torch.equal(h.row[:3], torch.ones(3, dtype=torch.int32)) and (h.amax[0, :3] > 0).all() and h.row[3] == 0
    bad = k.clone()
    bad[1, 2, 3, 4] = float("inf")
    f = fp8_quant.attention_inputs(q, bad, v, E4M3)
    assert torch.isnan(f.poison).all() and torch.isnan(f.out_factor).all() and torch.isnan(f.descale_k).all()
    assert not torch.isnan(f.descale_o).any(), "O's own scale comes from V alone"


def test_triton_s_own_errors_count_as_a_kernel_that_cannot_be_built(monkeypatch):
    """triton's CompilationError, PTXASError and OutOfResources derive from ``triton.errors.TritonError``,
    not from RuntimeError: once triton is imported, ``build_errors`` catches them too (so ``auto``
    falls back), and an error of another kind is still raised as it is."""
    import types

    class TritonError(Exception):
        pass

    class CompilationError(TritonError):
        pass

    assert CompilationError not in fp8_quant.build_errors() or "triton.errors" in sys.modules
    monkeypatch.setitem(sys.modules, "triton.errors", types.SimpleNamespace(TritonError=TritonError))
    assert issubclass(CompilationError, fp8_quant.build_errors()) and issubclass(RuntimeError, fp8_quant.build_errors())
    assert not issubclass(ValueError, fp8_quant.build_errors())

    class Broken:
        def inputs(self, *args):
            raise CompilationError("at 12:4: unsupported")

    monkeypatch.setattr(fp8_quant, "_BROKEN", [])
    monkeypatch.setattr(counters, "_logged", set())  # the warning is this test's to give
    monkeypatch.setattr(fp8_quant, "_triton", lambda: Broken())
    monkeypatch.setattr(fp8_quant, "grouped", lambda impl, x: not fp8_quant._BROKEN)
    q, k, v = (torch.randn(2, 3, 40, generator=gen(i)).bfloat16() for i in range(3))
    got = fp8_quant.attention_inputs(q, k, v, impl="auto")
    want = fp8_quant.attention_inputs(q, k, v, impl="torch")
    same_bits(got.q8, want.q8)
    same_value(got.out_factor, want.out_factor)
    assert fp8_quant.triton_failure().startswith("CompilationError: at 12:4")
    monkeypatch.setattr(fp8_quant, "_BROKEN", [])
    with pytest.raises(CompilationError):
        fp8_quant.attention_inputs(q, k, v, impl="triton")

    class Wrong:
        def inputs(self, *args):
            raise ValueError("a bug, not a build failure")

    monkeypatch.setattr(fp8_quant, "_triton", lambda: Wrong())
    with pytest.raises(ValueError, match="a bug"):
        fp8_quant.attention_inputs(q, k, v, impl="auto")
    assert not fp8_quant._BROKEN


def test_auto_falls_back_to_aten_for_good_when_the_triton_kernels_cannot_be_built(monkeypatch, caplog):
    """Triton builds its launcher with the machine's C compiler at first use: where that fails,
    ``auto`` quantises with aten ops (same bits, the history updated once), says so once, and no
    longer picks the kernels; ``triton`` asked for by name raises the error."""

    class Broken:
        calls = 0

        def _fail(self, *args):
            Broken.calls += 1
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

        current = delayed = _fail

    monkeypatch.setattr(fp8_quant, "_BROKEN", [])
    monkeypatch.setattr(counters, "_logged", set())
    monkeypatch.setattr(fp8_quant, "_triton", lambda: Broken())
    real_choose = fp8_quant.choose
    monkeypatch.setattr(fp8_quant, "choose", lambda impl, x: "torch" if fp8_quant._BROKEN else
                        {"auto": "triton", "triton": "triton"}.get(impl, impl))
    x = torch.randn(4, 333, generator=gen(5)).to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="cudnn_sdpa_provider"):
        got = fp8_quant.current(x, torch.float8_e4m3fn, impl="auto")
    want = fp8_quant.current(x, torch.float8_e4m3fn, impl="torch")
    same_bits(got[0], want[0], "auto after a failed build")
    assert torch.equal(got[1], want[1]) and Broken.calls == 1
    assert "the Triton kernels failed here (RuntimeError: Failed to find C compiler" in caplog.text
    h_auto, h_torch = _history(4), _history(4)
    for step in range(3):  # the kernels are not tried again, and the history moves one row a call
        got = fp8_quant.delayed(x * (step + 1), torch.float8_e4m3fn, h_auto, 2, margin=2.0, impl="auto")
        want = fp8_quant.delayed(x * (step + 1), torch.float8_e4m3fn, h_torch, 2, margin=2.0, impl="torch")
        same_bits(got[0], want[0], f"delayed step {step}")
    assert Broken.calls == 1 and torch.equal(h_auto.amax, h_torch.amax) and torch.equal(h_auto.row, h_torch.row)
    fp8_quant.saturated_total(discard=True)
    monkeypatch.setattr(fp8_quant, "_BROKEN", [])
    with pytest.raises(RuntimeError, match="C compiler"):
        fp8_quant.current(x, torch.float8_e4m3fn, impl="triton")

    class OnCuda:
        device = torch.device("cuda", 0)

    monkeypatch.setattr(fp8_quant, "choose", real_choose)
    monkeypatch.setattr(fp8_quant, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_quant.choose("auto", OnCuda()) == "triton"
    monkeypatch.setattr(fp8_quant, "_BROKEN", ["RuntimeError: no C compiler"])
    assert fp8_quant.choose("auto", OnCuda()) == "torch" and fp8_quant.choose("triton", OnCuda()) == "triton"


@pytest.mark.parametrize("raw, value, warns", [(None, "auto", False), ("", "auto", False), ("Triton", "triton", False),
                                              ("compiled", "compiled", False), ("torch", "torch", False),
                                              ("fast", "auto", True)])
def test_fp8_quant_variable(raw, value, warns):
    parsed = env.parse_fp8_quant(raw)
    assert parsed.value == value and bool(parsed.warning) == warns
    if warns:
        assert "CUDNN_SDPA_PROVIDER_FP8_QUANT='fast'" in parsed.warning and "'compiled'" in parsed.warning


# ----------------------------------------------------------------------- op, compile, counters


def test_opcheck_fp8_quantize_current_and_delayed():
    x = torch.randn(2, 8, 3, 16, generator=gen(13)).transpose(1, 2)
    opcheck(torch.ops.cudnn_sdpa.fp8_quantize, (x, E4M3, 0, 0, 1.0))
    recipe = fp8.Recipe(scaling="delayed")
    opcheck(torch.ops.cudnn_sdpa.fp8_quantize, (x, E5M2, recipe.id, 3, 2.0))
    assert recipe.history("cpu").row[3].item() > 0


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_compiled_attention_equals_eager_under_both_recipes(scaling):
    torch._dynamo.reset()
    q, k, v, go = attn_inputs(8, 2, 32, torch.float32, seed=120)

    def fn(q, k, v, recipe):
        return fp8.attention(q, k, v, is_causal=True, recipe=recipe)

    eager, compiled = fp8.Recipe(scaling=scaling), fp8.Recipe(scaling=scaling)
    step = torch.compile(fn, fullgraph=True)
    for i in range(3):
        scale = (1.0, 1.0, 40.0)[i]  # the third call saturates a delayed recipe's q
        a = _run(fn, q * scale, k, v, go, eager)
        b = _run(step, q * scale, k, v, go, compiled)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{scaling} call {i}"
    assert eager.saturated == compiled.saturated
    assert (eager.history("cpu").saturated[0].item() == 1) == (scaling == "delayed")
    assert torch.equal(eager.history("cpu").amax, compiled.history("cpu").amax)


def _run(fn, q, k, v, go, recipe):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, recipe)
    out.backward(go)
    return out.detach(), q.grad, k.grad, v.grad


def test_stats_diff_and_report_carry_the_saturation_count():
    a = counters.Stats()
    assert a.fp8_saturated == 0 and "fp8_saturated" not in a.to_dict(), "to_dict's keys stay the paths"
    assert "clipped" not in counters.format_table(a)


def test_a_device_count_that_cannot_be_read_leaves_stats_working(monkeypatch):
    def broken(discard):
        raise RuntimeError("CUDA is shutting down")

    monkeypatch.setitem(counters._drains, "fp8_saturated", broken)
    assert csp.stats().fp8_saturated >= 0
    csp.reset_stats()


# ------------------------------------------------------------------------------ bench script


def test_bench_script_arguments():
    spec = importlib.util.spec_from_file_location("bench_fp8_quant", ROOT / "scripts" / "bench_fp8_quant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args([])
    assert args.shape == [1, 32, 4096, 128] and args.impls == ["triton", "compiled", "torch"] and args.iters == 50
    args = module.parse_args(["--shape", "4", "8", "2048", "128", "--impls", "torch", "--iters", "5", "--json", "x"])
    assert args.shape == [4, 8, 2048, 128] and args.impls == ["torch"] and args.json == "x"
    with pytest.raises(SystemExit):
        module.parse_args(["--impls", "cuda"])


@pytest.mark.parametrize("raw, cuda, triton, verified, says", [
    (None, False, True, True, "aten ops (no CUDA device)"),
    (None, True, False, True, "aten ops (triton does not import here)"),
    (None, True, True, False, "aten ops (the Triton kernels are not verified on this GPU; =triton forces them)"),
    (None, True, True, True, "Triton kernels, one tensor at a time (verified on this GPU; the kernels for q, k, v "
                             "together are not yet: =triton forces them)"),
    (None, True, True, "grouped", "Triton kernels, q, k, v together (verified on this GPU)"),
    ("broken", True, True, True, "aten ops (the Triton kernels failed here: RuntimeError: no C compiler)"),
    ("triton", True, True, False, "triton (CUDNN_SDPA_PROVIDER_FP8_QUANT): forced (q, k, v together)"),
    ("torch", True, True, True, "torch (CUDNN_SDPA_PROVIDER_FP8_QUANT): aten ops"),
])
def test_the_doctor_says_which_code_quantises_fp8_inputs_here(monkeypatch, raw, cuda, triton, verified, says):
    """The doctor's [fp8] row follows ``choose`` and ``grouped``: auto takes the Triton kernels only
    on a verified GPU where triton imports, and the grouped ones only where those are verified too;
    a forced value is said as forced."""
    from cudnn_sdpa_provider.engine import machine
    from cudnn_sdpa_provider.tools import doctor
    from tests import fake_cudnn

    monkeypatch.setattr(fp8_quant, "_BROKEN", ["RuntimeError: no C compiler"] if raw == "broken" else [])
    if raw in (None, "broken"):
        monkeypatch.delenv(env.FP8_QUANT, raising=False)
    else:
        monkeypatch.setenv(env.FP8_QUANT, raw)
    caps = fake_cudnn.with_caps(cuda=cuda, compute_capability=(9, 0) if cuda else None)
    monkeypatch.setattr(machine, "capabilities", lambda device_index=None: caps)
    monkeypatch.setattr(fp8_quant, "triton_available", lambda: triton)
    monkeypatch.setattr(fp8_quant, "VERIFIED", ((9, 0),) if verified else ())
    monkeypatch.setattr(fp8_quant, "GROUPED_VERIFIED", ((9, 0),) if verified == "grouped" else ())
    rows = {(r.section, r.label): r.value for r in doctor.doctor_rows(run_self_test=False)}
    assert rows[("fp8", "quantisation")].endswith(says), rows[("fp8", "quantisation")]
