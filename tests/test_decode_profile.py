"""CPU tier: scripts/decode_profile.py's options (its measurements need a CUDA GPU)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "decode_profile.py"


def _module():
    spec = importlib.util.spec_from_file_location("decode_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_parse_batches_and_paths():
    mod = _module()
    args = mod.parse(["calls", "--batches", "1,8,16", "--steps", "4"])
    assert (args.what, args.batches, args.steps) == ("calls", (1, 8, 16), 4)
    args = mod.parse(["generate", "cudnn", "--batch", "2"])
    assert (args.what, args.path, args.batch, args.top) == ("generate", "cudnn", 2, 25)


@pytest.mark.parametrize("argv", [["calls", "--batches", "1,0"], ["calls", "--steps", "x"],
                                  ["generate", "eager"], ["generate", "native", "--batch", "-1"], []])
def test_bad_options_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _module().parse(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="subprocess check on Linux")
def test_without_cuda_it_says_so_and_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real thing")
    done = subprocess.run([sys.executable, str(SCRIPT), "calls", "--steps", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
