"""CPU tier: scripts/fp8_probe.py's parts that need no GPU: per-tensor current scaling round-trips
within E4M3's step and fills its range, and without CUDA the script says so and exits 4."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "fp8_probe.py"


def _module():
    spec = importlib.util.spec_from_file_location("fp8_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_current_scaling_fills_the_e4m3_range_and_round_trips_within_its_step():
    probe = _module()
    t = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(0)) * 7
    q8, descale = probe.quantize(t)
    assert q8.dtype == torch.float8_e4m3fn and descale.shape == (1, 1, 1, 1) and descale.dtype == torch.float32
    assert q8.float().abs().max().item() == probe.E4M3_MAX  # the amax element lands on 448 exactly
    err = (q8.float() * descale - t).abs() / t.abs().clamp(min=t.abs().max() * 2**-6)
    assert err.max().item() <= 2**-4  # E4M3 has 3 mantissa bits: half a step is 1/16 relative


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the probe itself")
def test_without_cuda_it_exits_4():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 4 and "needs a CUDA GPU" in done.stderr
