"""CPU tier: ``dense``/``packed`` host-side decisions that need no GPU: when bottom-right alignment is the
same mask as top-left (then top-left is used: cuDNN skips masked tiles there), and the token
bounds that size a ragged backward's dQ accumulator over its budget (tests/test_packed_buckets.py
drives the keying rule through the engine)."""

from __future__ import annotations

import torch

from cudnn_sdpa_provider.engine import dense, packed


def test_equal_lengths_make_bottom_right_top_left():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert dense.alignment(True, (cu, cu)) is False
    assert dense.alignment(True, (cu, cu[:])) is False  # a view of the same memory, shape and strides
    assert dense.alignment(True, (cu, cu.clone())) is True  # equal values are never read (no sync)
    assert dense.alignment(True, (cu, cu[:2])) is True
    assert dense.alignment(False, (cu, cu.clone())) is False


def test_dense_shapes_and_padded_lengths():
    lens = torch.tensor([5, 2], dtype=torch.int32)
    assert dense.alignment(True, (64, 64), (None, None)) is False
    assert dense.alignment(True, (1, 64), (None, None)) is True  # decoding: S_q < S_kv
    assert dense.alignment(True, (64, 64), (lens, lens)) is False
    assert dense.alignment(True, (64, 64), (lens, lens.clone())) is True
    assert dense.alignment(True, (64, 64), (lens, None)) is True
    assert dense.alignment(True, (64, 64), (lens.to(torch.int64), lens.to(torch.int64))) is True  # two tensors


def test_token_bucket_is_a_close_upper_bound():
    assert [packed.token_bucket(n) for n in (1, 64, 65, 1000, 1024, 1025)] == [64, 64, 128, 1024, 1024, 1088]
    for n in (1, 7, 100, 4097, 42052, 10**6):
        b = packed.token_bucket(n)
        assert n <= b and b - n < max(64, n // 16 + 1) and b % 64 == 0
    assert packed.token_bucket(42052) == 43008


def _caps(cc):
    from cudnn_sdpa_provider.core import support

    return support.Capabilities(cuda=True, device_name="test", compute_capability=cc, cudnn_version=91900)


def test_max_total_sizes_the_accumulator_by_tokens_over_the_budget_on_hopper_only():
    # the bench's varlen mix: 42052 tokens, 16 sequences up to 4092 (nominal 16 x 4096, H 16, D 128: 512 MiB)
    assert packed.max_total(_caps((9, 0)), 42052, 42052, 16, 4096, 4096, 16, 128, 128) == (43008, 43008)
    assert packed.max_total(_caps((8, 0)), 42052, 42052, 16, 4096, 4096, 16, 128, 128) is None  # Ampere-style
    assert packed.max_total(_caps((9, 0)), 42052, 42052, 16, 4096, 4096, 16, 72, 72) is None  # d % 16 != 0
    assert packed.max_total(_caps((9, 0)), 42052, 42052, 16, 4096, 4096, 4, 128, 128) is None  # 128 MiB: under
    assert packed.max_total(_caps((9, 0)), 500, 500, 2, 256, 256, 64, 64, 64) is None  # under the budget
    # 4 x 8192 query slots x 64 heads x 64 x 4 bytes = 512 MiB: over; the bound is capped at 4 x 8192
    assert packed.max_total(_caps((10, 0)), 300, 9000, 4, 8192, 4096, 64, 64, 64) == (320, 9216)
    assert packed.max_total(_caps((9, 0)), 40000, 9000, 4, 8192, 4096, 64, 64, 64) == (32768, 9216)


def test_padded_lse_places_each_token_at_its_sequence_and_position():
    from cudnn_sdpa_provider.core import rows

    starts = torch.tensor([0, 3, 3], dtype=torch.int32)  # lengths 3, 0, 4; tokens 7 and 8 are past the end
    lengths = torch.tensor([3, 0, 4], dtype=torch.int32)
    lse = torch.randn(3, 9).t()  # (T, H) = (9, 3), strided like the (H, T) LSE of varlen_attn transposed
    got = rows.padded_lse(lse, starts, lengths, s_max=4)
    assert got.shape == (3, 3, 4, 1) and got.stride() == (12, 4, 1, 1)
    want = torch.zeros(3, 3, 4)
    want[0, :, :3] = lse[0:3].t()
    want[2, :, :4] = lse[3:7].t()
    assert torch.equal(got[..., 0], want)
    # all-zero starts and lengths (a call whose lengths were out of range): nothing is placed
    zeros = torch.zeros(3, dtype=torch.int32)
    assert torch.equal(rows.padded_lse(lse, zeros, zeros, 4), torch.zeros(3, 3, 4, 1))
    assert rows.padded_lse(lse[:0], starts, lengths, 4).shape == (3, 3, 4, 1)  # no tokens at all


def test_padded_lse_only_while_the_padded_tensor_is_small():
    assert packed.padded_lse_pays(16, 4096, 16)  # the bench's varlen case: 4 MiB
    assert not packed.padded_lse_pays(512, 8192, 16)  # many short documents under one long one: 256 MiB
    assert packed.padded_lse_pays(1, 1, 1)


def test_fill_writes_zero_or_nan_whether_or_not_the_buffer_can_be_seen_as_words():
    from cudnn_sdpa_provider.core import rows

    for bad in (False, True):
        flag = torch.tensor(bad)
        value = torch.where(flag, float("nan"), 0.0)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            words = rows.fill_words(flag, dtype)
            # (5, 3, 8) takes the int64 view; (5, 3, 3) (a 6- or 12-byte last dim) and a transposed
            # buffer take the plain fill: every element must end up the same either way
            # (1, 4, 8) with an odd stride on its size-1 dim is contiguous but has no int64 view of
            # its own shape: the flat range is filled (a one-token varlen output is empty_like such a q)
            odd = torch.empty_strided((1, 4, 8), (33, 8, 1))
            for buf in (torch.randn(5, 3, 8), torch.randn(5, 3, 3), torch.randn(8, 3, 5).transpose(0, 2), odd):
                buf = buf.to(dtype)
                rows.fill(buf, value, words)
                assert (buf.isnan().all() if bad else (buf == 0).all()), (bad, dtype, buf.shape)
    assert rows.fill_words(torch.tensor(True), torch.int32) is None
