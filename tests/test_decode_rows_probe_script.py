"""CPU tier: scripts/decode_rows_probe.py's parts that need no GPU (its measurement needs one): argument
parsing, the bucket, and its exit status without CUDA."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "decode_rows_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("decode_rows_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shape_is_four_positive_ints_with_h_kv_dividing_h_q(probe):
    assert probe.parse_shape("8,32,8,128") == (8, 32, 8, 128)
    for bad in ("8,32,8", "8,32,7,128", "8,32,0,128", "a,b,c,d", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--shape"):
            probe.parse_shape(bad)


def test_lengths_are_positive_ints(probe):
    assert probe.parse_ints("17,4096", None, "--lengths") == (17, 4096)
    for bad in ("0,5", "-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--lengths"):
            probe.parse_ints(bad, None, "--lengths")


@pytest.mark.parametrize("n, want", [(1, 1), (17, 32), (1000, 1024), (4096, 4096), (4097, 8192)])
def test_the_bucket_is_the_next_power_of_two(probe, n, want):
    assert probe.bucket(n) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit status without CUDA")
def test_without_cuda_it_exits_4(probe, capsys):
    assert probe.main(["--lengths", "17"]) == 4
    assert "needs a CUDA GPU" in capsys.readouterr().err
