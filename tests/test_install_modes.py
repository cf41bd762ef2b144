"""CPU tier: ``pip install .`` and ``pip install -e .`` into a fresh virtualenv, as a user does, then
an unmodified script under ``CUDNN_SDPA_PROVIDER=1`` and the installed ``cudnn-sdpa`` command.

The venv is made without pip and sees this environment's site-packages (less this package)
through a path file, so torch is not reinstalled; pip (this environment's, ``--python``) installs offline, without
dependencies or build isolation. The source is a copy of the checkout, so the build writes
nothing into it, and no PYTHONPATH points at the checkout: what runs is what was installed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "README.md", "cudnn_sdpa_provider_startup.pth", "cudnn_sdpa_provider")

SCRIPT = """\
import sys
import torch
import torch.nn.functional as F
import cudnn_sdpa_provider
q = torch.randn(1, 2, 16, 8, requires_grad=True)
F.scaled_dot_product_attention(q, q, q).sum().backward()
print("package from:", cudnn_sdpa_provider.__file__)
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDNN_SDPA_PROVIDER", "PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def _check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def _fresh_venv(tmp_path: pathlib.Path) -> pathlib.Path:
    venv = tmp_path / "venv"
    _check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                          timeout=120))
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this environment's packages (torch, setuptools, ...), seen through links that leave out this
    # package (installed here in CI: an editable finder comes after sys.path and would lose to it)
    parent = tmp_path / "parent-site"
    parent.mkdir()
    for d in dict.fromkeys([sysconfig.get_paths()["purelib"], *site.getsitepackages()]):
        for entry in pathlib.Path(d).iterdir() if pathlib.Path(d).is_dir() else ():
            if not (entry.name.startswith(("cudnn_sdpa_provider", "__editable__")) or entry.suffix == ".pth"
                    or (parent / entry.name).exists()):
                (parent / entry.name).symlink_to(entry)
    (pathlib.Path(purelib) / "_csp_test_parent.pth").write_text(f"{parent}\n")
    return python


def _source_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    return src


def _pip_install(python: pathlib.Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-index", *args]
    _check(subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env()))


@pytest.mark.parametrize("mode", ["regular", "editable"])
def test_install_then_env_var_opt_in_writes_the_report(tmp_path, mode):
    python, src = _fresh_venv(tmp_path), _source_copy(tmp_path)
    _pip_install(python, *(["-e", str(src)] if mode == "editable" else [str(src)]))
    script, report = tmp_path / "script.py", tmp_path / "run.json"
    script.write_text(SCRIPT)
    result = subprocess.run([str(python), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=_env(CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report)))
    out = _check(result)
    where = pathlib.Path(out.split("package from: ")[1].strip())
    if mode == "editable":
        assert where.is_relative_to(src), f"an editable install runs the source tree, not {where}"
    else:
        assert where.is_relative_to(python.parent.parent), f"a regular install runs its copy, not {where}"
    assert "not enabled" not in result.stderr and "skipped" not in result.stderr, result.stderr
    data = json.loads(report.read_text())
    assert data["meta"]["enabled"] is True
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 1}}, data
    assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 1}}, data

    # the console script is there, and the doctor finds the hook this install put in site-packages
    doctor = subprocess.run([str(python.parent / "cudnn-sdpa"), "doctor", "--json", "--no-self-test"],
                            capture_output=True, text=True, timeout=300, env=_env())
    rows = {(r["section"], r["label"]): r for r in json.loads(_check(doctor))}
    hook = rows[("startup", "hook (CUDNN_SDPA_PROVIDER)")]
    assert hook["ok"] is True and hook["value"].startswith(str(python.parent.parent)), hook
