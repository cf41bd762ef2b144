"""CPU tier: ``engine``'s host-side decisions that need no GPU: when bottom-right alignment is the
same mask as top-left (then top-left is used: cuDNN skips masked tiles there)."""

from __future__ import annotations

import torch

from cudnn_sdpa_provider import engine


def test_equal_lengths_make_bottom_right_top_left():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert engine._alignment(True, (cu, cu)) is False
    assert engine._alignment(True, (cu, cu[:])) is False  # a view of the same memory, shape and strides
    assert engine._alignment(True, (cu, cu.clone())) is True  # equal values are never read (no sync)
    assert engine._alignment(True, (cu, cu[:2])) is True
    assert engine._alignment(False, (cu, cu.clone())) is False


def test_dense_shapes_and_padded_lengths():
    lens = torch.tensor([5, 2], dtype=torch.int32)
    assert engine._alignment(True, (64, 64), (None, None)) is False
    assert engine._alignment(True, (1, 64), (None, None)) is True  # decoding: S_q < S_kv
    assert engine._alignment(True, (64, 64), (lens, lens)) is False
    assert engine._alignment(True, (64, 64), (lens, lens.clone())) is True
    assert engine._alignment(True, (64, 64), (lens, None)) is True
    assert engine._alignment(True, (64, 64), (lens.to(torch.int64), lens.to(torch.int64))) is True  # two tensors
