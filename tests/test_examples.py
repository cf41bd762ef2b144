"""The examples run: each in a fresh interpreter, as a user would run it.

CPU tier: on a machine without CUDA every attention call falls back with reason ``no_cuda``; the
examples must say so and exit 0, and a bad option is a usage error (exit 2). The GPU tier's
counterpart (every call served) is tests/gpu/test_examples_gpu.py. The unmodified script is run
under the environment-variable opt-in with the startup hook processed from a temporary site
directory (``.pth`` files are only read there).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cudnn_sdpa_provider.core.reasons import PATHS

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PTH = REPO / "cudnn_sdpa_provider_startup.pth"
_OPT_IN = ("CUDNN_SDPA_PROVIDER", "CUDNN_SDPA_PROVIDER_REPORT", "CUDNN_SDPA_PROVIDER_LOG")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _OPT_IN}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def _run(args, cwd, **extra) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(**extra), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# (example, lines that must appear in stdout)
CASES = {
    "train_loop.py": ["trained 3 steps on", "attention calls: 12,", "dense_fwd"],
    "varlen_packing.py": ["csp.attention packed: lengths [5, 12, 3, 9] -> out (29, 4, 64), lse (29, 4) (T, H)",
                          "max |out - per-sequence F.sdpa|", "varlen_fwd"],
    "sinks.py": ["out (2, 8, 256, 64)", "sinks.grad: [", "dense_bwd"],
    "hf_model.py": ["llama, lengths [64, 40, 17]", "attention calls: 4,", "dense_bwd"],
    "paged_decode.py": ["prompts [37, 5, 60] in chunks of 32, then 4 decode steps; lengths [41, 9, 64]",
                        "max |out - F.sdpa on each sequence's keys|", "paged_fwd"],
    "fp8_attention.py": ["step 2: loss fp8", "FP8 attention vs fp32: max|out - ref| / max|ref| =",
                         "packed FP8 attention vs fp32: max|err| / max|ref| =", "fp8_bwd"],
}


def paged_error(stdout: str) -> float:
    """The relative error examples/paged_decode.py prints against F.sdpa on each sequence."""
    return float(stdout.split("/ max|ref| = ")[1].split()[0])


def fp8_error(stdout: str) -> float:
    """The relative error examples/fp8_attention.py prints against fp32 attention."""
    return float(stdout.split("max|out - ref| / max|ref| = ")[1].split()[0])


def _report_rows(stdout: str) -> list[tuple[str, int, int]]:
    """(path, served, fallbacks) of every telemetry table (``csp.report``) an example printed."""
    rows = []
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0] in PATHS and cells[1].isdigit() and cells[2].isdigit():
            rows.append((cells[0], int(cells[1]), int(cells[2])))
    return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name, tmp_path):
    result = _run([str(EXAMPLES / name)], cwd=tmp_path)
    for line in CASES[name]:
        assert line in result.stdout, f"{line!r} not in the output of {name}:\n{result.stdout}"
    if _no_cuda():
        assert "no_cuda=" in result.stdout, result.stdout  # fallbacks are reported, not hidden
        if name == "paged_decode.py":  # fp32 on CPU, against fp64: 3.0e-7 with 1-3 threads, but 2.4e-5
            # with OMP_NUM_THREADS=4 (seen once in CI): the fp32 composite's rounding follows the
            # thread count; which kernel's blocking it is was not found. fp32's bound, not bf16's.
            assert paged_error(result.stdout) < 1e-4, result.stdout
    if name == "fp8_attention.py":  # FP8's bound (docs/fp8.md), on the reference or on cuDNN
        assert fp8_error(result.stdout) < 0.1, result.stdout
    assert _report_rows(result.stdout), f"no telemetry table in the output of {name}:\n{result.stdout}"


#: (example, arguments): each must stop with argparse's usage error, naming the option
USAGE_ERRORS = [
    ("train_loop.py", ["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    ("train_loop.py", ["--steps", "x"], "argument --steps: expected an integer >= 1, got 'x'"),
    ("train_loop.py", ["--device", "cuda"], "--device cuda: CUDA is not available"),
    ("hf_model.py", ["--device", "cuda"], "--device cuda: CUDA is not available"),
]


@pytest.mark.parametrize("name, args, message", USAGE_ERRORS, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_example_bad_option_is_a_usage_error(name, args, message, tmp_path):
    if "cuda" in args and not _no_cuda():
        pytest.skip("needs a machine without CUDA")
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("usage: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_hf_example_loss_equals_sdpa_on_cpu(tmp_path):
    if not _no_cuda():
        pytest.skip("on CUDA the GPU-tier test checks it in bf16")
    result = _run([str(EXAMPLES / "hf_model.py")], cwd=tmp_path)
    assert float(result.stdout.split("|diff| ")[1].split()[0]) < 1e-5, result.stdout


def test_varlen_example_says_why_it_skips_on_cpu(tmp_path):
    if not _no_cuda():
        pytest.skip("the skip message is only printed on a machine without CUDA")
    result = _run([str(EXAMPLES / "varlen_packing.py")], cwd=tmp_path)
    assert "varlen_attn part skipped: torch.nn.attention.varlen.varlen_attn needs CUDA" in result.stdout
    error = float(result.stdout.split("max |out - per-sequence F.sdpa| = ")[1].split()[0])
    assert error < 1e-4, result.stdout


def test_unmodified_script_does_not_import_the_package():
    source = (EXAMPLES / "unmodified_script.py").read_text()
    assert "import cudnn_sdpa_provider" not in source
    assert "from cudnn_sdpa_provider" not in source


_SITE_RUNNER = ("import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.argv = sys.argv[2:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")


def _run_with_startup_hook(tmp_path, **extra) -> subprocess.CompletedProcess:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(PTH, site_dir / PTH.name)
    return _run(["-c", _SITE_RUNNER, str(site_dir), str(EXAMPLES / "unmodified_script.py")], cwd=tmp_path, **extra)


def test_unmodified_script_under_env_var_writes_report(tmp_path):
    report = tmp_path / "run.json"
    result = _run_with_startup_hook(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report))
    assert "step 1: loss" in result.stdout, result.stdout
    assert "startup hook skipped" not in result.stderr and "not enabled" not in result.stderr, result.stderr
    _check_unmodified_report(json.loads(report.read_text()))


def _check_unmodified_report(data: dict) -> dict:
    assert set(data) == set(PATHS) | {"meta"}
    assert data["meta"]["enabled"] is True
    calls = data["dense_fwd"]["served"] + sum(data["dense_fwd"]["fallback"].values())
    assert calls == 4, data  # 2 attention layers x 2 steps
    if _no_cuda():
        assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 4}}, data
        assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 4}}, data
    return data


def test_unmodified_script_without_opt_in_writes_nothing(tmp_path):
    report = tmp_path / "run.json"
    result = _run_with_startup_hook(tmp_path, CUDNN_SDPA_PROVIDER="0", CUDNN_SDPA_PROVIDER_REPORT=str(report))
    assert "step 1: loss" in result.stdout, result.stdout
    assert not report.exists()


ALL_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_covered():
    assert ALL_EXAMPLES == sorted([*CASES, "unmodified_script.py"]), "a new example needs a case here"


@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_example_takes_help_and_rejects_unknown_options(name, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=300)

    helped = run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {name}"), helped.stdout + helped.stderr
    assert not _report_rows(helped.stdout), "--help ran the job"
    refused = run("--bogus")
    assert refused.returncode == 2, f"exit {refused.returncode}: the job ran\n{refused.stdout}"
    assert refused.stdout == "" and refused.stderr.startswith("usage: "), refused.stderr
    assert refused.stderr.splitlines()[-1] == f"{name}: error: unrecognized arguments: --bogus", refused.stderr


#: Runs a script with ``transformers`` unimportable, as on a machine without it.
_WITHOUT_TRANSFORMERS = ("import runpy, sys; sys.modules['transformers'] = None; sys.argv = sys.argv[1:]; "
                         "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_hf_example_without_transformers_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRANSFORMERS, str(EXAMPLES / "hf_model.py")],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("hf_model.py: needs transformers") and "pip install" in lines[0], lines
