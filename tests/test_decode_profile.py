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


#: Runs a script's module code, then imports the package: the package comes from the script's own
#: sys.path entry or not at all (``-S``: no site-packages processing, so no editable install).
IMPORT_DRIVER = """
import runpy, sys
runpy.run_path(sys.argv[1], run_name="script_under_test")
import cudnn_sdpa_provider
print(cudnn_sdpa_provider.__file__)
"""


def run_without_installed_package(script: pathlib.Path, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """``script``'s module code in an interpreter where torch is importable but this package is not
    (as on the GPU box, which runs ``python3 scripts/X.py`` from the checkout without installing it)."""
    import sysconfig

    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    return subprocess.run([sys.executable, "-S", "-c", IMPORT_DRIVER, str(script)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(paths)})


def test_the_script_finds_this_checkout_s_package_without_an_install(tmp_path):
    hidden = subprocess.run([sys.executable, "-S", "-c", "import cudnn_sdpa_provider"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert hidden.returncode != 0 and "No module named 'cudnn_sdpa_provider'" in hidden.stderr
    done = run_without_installed_package(SCRIPT, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "cudnn_sdpa_provider" / "__init__.py")


def test_only_the_provider_path_enables_the_provider():
    """The paths are the bench's hf_generate ones (tools/bench/shapes.py): ``cudnn`` is the registered
    attn_implementation with the provider NOT enabled, so its profile is the bench's cudnn row's."""
    import cudnn_sdpa_provider as csp

    mod = _module()
    for path in ("native", "cudnn"):
        with mod._scope(path):
            assert not csp.enabled(), path
    with mod._scope("provider"):
        assert csp.enabled()
    assert not csp.enabled()
