"""CPU tier: non-finite in, non-finite out for FP8 attention (issue #29).

Per-tensor current scaling divides the format's largest value by the tensor's amax; an inf or NaN
anywhere makes that amax non-finite and the tensor has no scale. The contract (docs/fp8.md): the
whole output and all three gradients are NaN when q, k, v (or, in the backward, dO) hold an inf
or NaN; the recipe's state keeps its last finite amax, so the next finite call is unaffected.
Before the fix, one inf in q or k gave an all-zero output and all-zero gradients (scale 0 and a
reference that took NaN rows for rows without keys), and a NaN in q a finite, wrong output.
"""

from __future__ import annotations

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.ops import fp8_reference

fp8 = csp.fp8
E4M3 = torch.float8_e4m3fn
BAD = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _inputs(dtype=torch.float32, seed=0, hk=2):
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (2, 4, 6, 16), "k": (2, hk, 6, 16), "v": (2, hk, 6, 16)}
    return {n: torch.randn(*s, generator=g).to(dtype).requires_grad_() for n, s in shapes.items()}


def _plant(t, value, where=(1, 0, 2, 5)):
    with torch.no_grad():
        t[where] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_non_finite_input_makes_the_output_and_every_gradient_nan(which, bad, dtype):
    t = _inputs(dtype)
    _plant(t[which], BAD[bad])
    out = fp8.attention(t["q"], t["k"], t["v"], is_causal=True, recipe=fp8.Recipe())
    assert torch.isnan(out).all(), f"{which}={bad}: every output element NaN, got {out.isnan().sum()} NaN"
    out.float().sum().backward()
    for name in "qkv":
        grad = t[name].grad
        assert grad is not None and torch.isnan(grad).all(), f"{which}={bad}: d{name} all NaN"


@pytest.mark.parametrize("bad", list(BAD))
def test_a_non_finite_grad_out_makes_every_gradient_nan(bad):
    t = _inputs()
    out = fp8.attention(t["q"], t["k"], t["v"], recipe=fp8.Recipe())
    assert torch.isfinite(out).all()
    go = torch.ones_like(out)
    go[0, 1, 3, 2] = BAD[bad]
    out.backward(go)
    for name in "qkv":
        assert torch.isnan(t[name].grad).all(), f"dO={bad}: d{name} all NaN"


def test_padded_rows_do_not_hide_a_non_finite_input():
    t = _inputs()
    _plant(t["q"], float("nan"), (0, 0, 0, 0))
    lens = torch.tensor([3, 6], dtype=torch.int32)
    out = fp8.attention(t["q"], t["k"], t["v"], seq_lens_q=lens, seq_lens_kv=lens)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("bad", list(BAD))
def test_quantize_of_a_non_finite_tensor_has_no_scale(bad):
    t = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    t[2, 3] = BAD[bad]
    stored, descale = fp8.quantize(t)
    assert torch.isnan(descale).all() and torch.isnan(stored.float()).all()


def test_quantize_of_finite_and_zero_tensors_is_unchanged():
    stored, descale = fp8.quantize(torch.zeros(3, 4))
    assert descale.item() == 1.0 and torch.all(stored.float() == 0)
    stored, descale = fp8.quantize(torch.full((2, 2), 3.0))
    assert descale.item() == 2.0**-7 and torch.all(stored.float() * descale == 3.0)  # 448 / 3 -> 128


def _fp8_operands(seed=2):
    g = torch.Generator().manual_seed(seed)
    return [fp8.quantize(torch.randn(1, 2, 5, 16, generator=g)) for _ in range(3)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["descale_q", "descale_k", "descale_v"])
def test_the_reference_forward_keeps_nan_scores_nan(which):
    """fp8_reference on its own (the CPU kernel of fp8_fwd): a NaN score row is not a row without
    keys (which is 0): the output and lse stay NaN."""
    (q, dq), (k, dk), (v, dv) = _fp8_operands()
    descales = [dq, dk, dv]
    descales[which] = torch.tensor([float("nan")])
    out, lse, _ = fp8_reference.forward(q, k, v, *descales, torch.tensor([64.0]), None, None, 0.25, 256.0, False,
                                        True)
    assert torch.isnan(out.float()).all()
    assert torch.isnan(lse).all() if which < 2 else torch.isfinite(lse).all(), "lse reads the scores only"


def test_the_reference_backward_keeps_nan_nan_and_rows_without_keys_zero():
    (q, dq), (k, dk), (v, dv) = _fp8_operands()
    res = fp8.forward(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=torch.tensor([64.0]),
                      return_lse=True)
    do, ddo = fp8.quantize(torch.ones(1, 2, 5, 16))
    scales = [torch.tensor([16.0])] * 4
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_o=torch.tensor([1 / 64]), scale_dq=scales[0],
              scale_dk=scales[1], scale_dv=scales[2], scale_dp=scales[3])
    finite = fp8.backward(do, q, k, v, res.out, res.lse, descale_do=ddo, **kw)
    assert all(torch.isfinite(g.float()).all() for g in (finite.dq, finite.dk, finite.dv))
    poisoned = fp8.backward(do, q, k, v, res.out, res.lse, descale_do=torch.tensor([float("nan")]), **kw)
    assert all(torch.isnan(g.float()).all() for g in (poisoned.dq, poisoned.dk, poisoned.dv))
    # a query row without keys (seq_lens_kv = 0) still has zero gradients, not NaN
    lens_q, lens_kv = torch.tensor([5], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    res0 = fp8.forward(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, scale_o=torch.tensor([64.0]),
                       return_lse=True, seq_lens_q=lens_q, seq_lens_kv=lens_kv)
    assert torch.all(res0.out.float() == 0)
    empty = fp8.backward(do, q, k, v, res0.out, res0.lse, descale_do=ddo, seq_lens_q=lens_q, seq_lens_kv=lens_kv,
                         **kw)
    assert all(torch.all(g.float() == 0) for g in (empty.dq, empty.dk, empty.dv))


def test_the_recipe_state_keeps_its_last_finite_amax():
    recipe = fp8.Recipe(scaling="current")  # the state alone decides its next call
    t = _inputs(seed=3)
    fp8.attention(t["q"], t["k"], t["v"], recipe=recipe).sum().backward()
    state = recipe.state("cpu").clone()
    assert torch.isfinite(state).all() and (state[:4] > 0).all()
    bad = _inputs(seed=4)
    _plant(bad["k"], float("inf"))
    fp8.attention(bad["q"], bad["k"], bad["v"], recipe=recipe).sum().backward()
    assert torch.equal(recipe.state("cpu"), state), "a NaN call leaves the state (and the re-run count) alone"
    fresh = fp8.Recipe(scaling="current")
    fresh.state("cpu").copy_(state)
    good = [_inputs(seed=5), _inputs(seed=5)]
    for inputs, r in zip(good, (recipe, fresh)):
        fp8.attention(inputs["q"], inputs["k"], inputs["v"], recipe=r).sum().backward()
    for name in "qkv":
        assert torch.equal(good[0][name].grad, good[1][name].grad)


def test_a_delayed_recipe_s_history_stays_finite_through_a_nan_call():
    recipe = fp8.Recipe()
    t = _inputs(seed=3)
    fp8.attention(t["q"], t["k"], t["v"], recipe=recipe).sum().backward()
    bad = _inputs(seed=4)
    _plant(bad["q"], float("nan"))
    out = fp8.attention(bad["q"], bad["k"], bad["v"], recipe=recipe)
    out.sum().backward()
    assert torch.isnan(out).all() and all(torch.isnan(bad[n].grad).all() for n in "qkv")
    history = recipe.history("cpu")
    assert torch.isfinite(history.amax).all() and history.saturated.sum() == 0
    assert history.amax[1, 0] == 0 and history.amax[1, 4:8].eq(0).all(), "the NaN call's row holds no amax"
    good = _inputs(seed=5)
    out = fp8.attention(good["q"], good["k"], good["v"], recipe=recipe)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(good[n].grad).all() for n in "qkv")
