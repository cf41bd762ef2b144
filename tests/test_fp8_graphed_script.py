"""CPU tier: scripts/fp8_graphed.py's parts that need no GPU (its measurement needs one): the shape and
mode arguments are checked, and without CUDA it says so and exits 4."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "fp8_graphed.py"


def _module():
    spec = importlib.util.spec_from_file_location("fp8_graphed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_shape_is_five_positive_ints_with_h_kv_dividing_h_q():
    parse = _module().parse_shape
    assert parse("4,32,8,4096,128") == (4, 32, 8, 4096, 128)
    for bad in ("1,32,32,4096", "1,32,5,4096,128", "1,32,32,0,128", "a,b,c,d,e"):
        with pytest.raises(argparse.ArgumentTypeError, match="B,H_q,H_kv,S,D"):
            parse(bad)


def test_unknown_modes_are_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--modes", "fwd,bwd"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--modes takes fwd, fwd_bwd or both" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the measurement itself")
def test_without_cuda_it_exits_4():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 4 and "needs a CUDA GPU" in done.stderr
