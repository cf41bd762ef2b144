"""CPU tier: the arithmetic a folded binding at a new length is derived from (``fold_values``).

``layout_of``, ``follows`` and ``operand_at`` are written out for speed (a new length's binding runs
them for every operand, GPU run 72). Here they are held to their definitions: the layout as PyTorch's
contiguity sees it and the strides ``strides`` lists, and the offsets ``operand`` computes from a real
tensor of that layout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudnn_sdpa_provider.engine import fold_values as fv

_DIMS = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 9), st.sampled_from([1, 8, 16]))


def _made(kind: str, shape, dtype=torch.bfloat16) -> torch.Tensor:
    b, h, s, d = shape
    if kind == "bhsd":
        return torch.empty(b, h, s, d, dtype=dtype)
    if kind == "bshd":
        return torch.empty(b, s, h, d, dtype=dtype).transpose(1, 2)
    if kind == "hbsd":  # neither layout: heads outermost
        return torch.empty(h, b, s, d, dtype=dtype).transpose(0, 1)
    return torch.empty(b, h, d, s, dtype=dtype).transpose(2, 3)  # "bhds": D not innermost


def _defined_layout(t: torch.Tensor):
    """The layout by its definition: PyTorch's contiguity of the tensor or of its token-major view,
    where the strides are also ``strides``' at every dim of extent above 1."""
    kind = "bhsd" if t.is_contiguous() else "bshd" if t.transpose(1, 2).is_contiguous() else None
    if kind is None:
        return None
    want = fv.strides(kind, t.shape[1], t.shape[2], t.shape[3])
    return kind if all(g == w for n, g, w in zip(t.shape, t.stride(), want) if n > 1) else None


@given(kind=st.sampled_from(["bhsd", "bshd", "hbsd", "bhds"]), shape=_DIMS)
def test_layout_of_and_follows_agree_with_their_definitions(kind, shape):
    t = _made(kind, shape)
    assert fv.layout_of(t) == _defined_layout(t)
    for other in ("bhsd", "bshd"):
        want = fv.strides(other, t.shape[1], t.shape[2], t.shape[3])
        assert fv.follows(t, other) == all(g == w for n, g, w in zip(t.shape, t.stride(), want) if n > 1)


@pytest.mark.parametrize("kind", ["bhsd", "bshd"])
def test_a_size_1_dim_s_stride_does_not_change_the_layout(kind):
    t = _made(kind, (1, 4, 1, 8))
    odd = t.as_strided(t.shape, (999, t.stride(1), 777, 1))
    assert fv.layout_of(odd) == fv.layout_of(t) == "bhsd"  # both layouts fit; "bhsd" is named first
    assert fv.follows(odd, "bshd") and fv.follows(odd, "bhsd")


@given(kind=st.sampled_from(["bhsd", "bshd"]), shape=_DIMS, h_kv=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_operand_at_is_operand_of_a_tensor_of_that_layout(kind, shape, h_kv, dtype):
    b, h, s, d = shape
    h = h * h_kv  # query-side heads: a multiple of the KV heads
    t = _made(kind, (b, h, s, d), dtype)
    groups = h // h_kv
    spec = fv.spec(t, groups)
    end, (key, values) = fv.operand_at(spec, s, h_kv, t.device, 0)
    want_end, (want_key, want_values) = fv.operand(t, h_kv, groups, 0)
    assert (end, key, values()) == (want_end, want_key, want_values())


@given(kind=st.sampled_from(["bhsd", "bshd"]), shape=_DIMS, dim=st.integers(0, 3),
       stride=st.sampled_from([0, 1, 2, 8, 16, 24, 72, 144, 576]))
def test_layout_of_and_follows_agree_with_their_definitions_one_stride_off(kind, shape, dim, stride):
    """A layout's strides with one of them replaced: the near misses a dim-by-dim check can get wrong."""
    strides = list(fv.strides(kind, shape[1], shape[2], shape[3]))
    strides[dim] = stride
    t = torch.empty(1 << 16, dtype=torch.bfloat16).as_strided(shape, strides)
    assert fv.layout_of(t) == _defined_layout(t)
    for other in ("bhsd", "bshd"):
        want = fv.strides(other, t.shape[1], t.shape[2], t.shape[3])
        assert fv.follows(t, other) == all(g == w for n, g, w in zip(t.shape, t.stride(), want) if n > 1)
