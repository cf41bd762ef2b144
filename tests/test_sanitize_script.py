"""CPU tier: scripts/sanitize_folded.sh, which runs the folded-graph sweep under compute-sanitizer on
the GPU box. What needs no GPU: the script parses, its verdict on canned memcheck logs (clean, errors,
a killed run, a sweep that failed without errors), what it does without compute-sanitizer (a clear
message, its own exit status, nothing run), and a whole run with stand-ins for the sanitizer and
the sweep (the options, environment and lengths it passes; the files it writes under OUT)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "sanitize_folded.sh"

CLEAN = """========= COMPUTE-SANITIZER
START S=63
decode S_kv=63: fwd {'served': 1, 'fallback': {}} bwd {'served': 1, 'fallback': {}}
SWEEP OK 72 calls
========= ERROR SUMMARY: 0 errors
"""

ERRORS = """========= COMPUTE-SANITIZER
START S=65
========= Invalid __global__ read of size 16 bytes
=========     at cudnn_generated_fort_native_sdpa_sm90_flash_fprop+0x1c30
=========     by thread (64,0,0) in block (3,0,0)
=========     Address 0x7f0a3c000400 is out of bounds
=========
========= Invalid __global__ read of size 16 bytes
=========     at cudnn_generated_fort_native_sdpa_sm90_flash_fprop+0x1c30
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

ONE_ERROR = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 2 bytes
=========     Address 0x7f0a3c000400 is out of bounds
SWEEP OK 72 calls
========= ERROR SUMMARY: 1 error
"""

KILLED = """========= COMPUTE-SANITIZER
START S=63
START S=64
"""

SWEEP_FAILED = """========= COMPUTE-SANITIZER
START S=127
SWEEP WRONG BHSD GQA prefill S=127 dq: max|err|/max|ref| = 3.1e-01 > 8.0e-02
========= Target application returned an error
========= ERROR SUMMARY: 0 errors
"""


def _verdict(tmp_path, log: str, rc: int):
    path = tmp_path / "sanitizer.log"
    path.write_text(log)
    return subprocess.run(["bash", str(SCRIPT), "--verdict", str(path), str(rc)], capture_output=True, text=True,
                          timeout=30)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


@pytest.mark.parametrize("log,rc,status,says", [
    (CLEAN, 0, 0, "PASS: compute-sanitizer memcheck, 0 errors; 72 calls served"),
    (ERRORS, 1, 1, "FAIL: compute-sanitizer memcheck reported 3 error(s); first: Invalid __global__ read of size 16 bytes"),
    (ONE_ERROR, 0, 1, "FAIL: compute-sanitizer memcheck reported 1 error(s); first: Invalid __global__ write of size 2"),
    (KILLED, 124, 3, "FAIL: no ERROR SUMMARY in"),
    (SWEEP_FAILED, 1, 3, "FAIL: 0 sanitizer errors, but the sweep did not finish (exit status 1; last line: SWEEP WRONG"),
    (CLEAN, 1, 3, "FAIL: 0 sanitizer errors, but the sweep did not finish (exit status 1"),
])
def test_the_verdict_on_canned_logs(tmp_path, log, rc, status, says):
    done = _verdict(tmp_path, log, rc)
    assert done.returncode == status, (done.stdout, done.stderr)
    assert done.stdout.startswith(says), done.stdout
    assert len(done.stdout.splitlines()) == 1, "one line"


def test_bad_arguments_are_usage_errors(tmp_path):
    assert subprocess.run(["bash", str(SCRIPT), "--verdict"], capture_output=True, text=True).returncode == 2
    assert subprocess.run(["bash", str(SCRIPT), "--verdict", str(tmp_path / "none.log"), "0"],
                          capture_output=True, text=True).returncode == 2
    assert subprocess.run(["bash", str(SCRIPT), "--lengths"], capture_output=True, text=True).returncode == 2


def _run(tmp_path, *args, **env):
    base = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def test_a_missing_sanitizer_is_named_and_has_its_own_exit_status(tmp_path):
    done = _run(tmp_path, SANITIZER=str(tmp_path / "no-such-sanitizer"))
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "compute-sanitizer not found" in done.stderr and "SANITIZER=" in done.stderr
    verdict = (tmp_path / "out" / "sanitize-folded-verdict.txt").read_text()
    assert verdict.startswith("NOT RUN: compute-sanitizer not found")
    assert not (tmp_path / "out" / "sanitize-folded.log").exists(), "nothing was run"


@pytest.mark.skipif(os.path.exists("/usr/local/cuda/bin/compute-sanitizer"), reason="this host has compute-sanitizer")
def test_no_sanitizer_on_path_or_in_the_cuda_folder(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 4 and "not on PATH, not /usr/local/cuda/bin/compute-sanitizer" in done.stderr


FAKE_SANITIZER = """#!/usr/bin/env bash
echo "========= COMPUTE-SANITIZER"
[ "$1 $2 $3" = "--tool memcheck --print-limit" ] || { echo "bad options: $*"; exit 9; }
shift 4
"$@"
rc=$?
[ -n "${FAKE_ERRORS:-}" ] && echo "========= Invalid __global__ read of size 4 bytes"
echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"
exit $rc
"""

FAKE_SWEEP = """import os, sys
print("env", os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"], os.environ["CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS"])
print("lengths", sys.argv[1:])
if os.environ.get("FAKE_SWEEP_FAIL"):
    sys.exit("SWEEP WRONG decode out")
print("SWEEP OK 8 calls")
"""


@pytest.mark.parametrize("errors,fail,status", [("", "", 0), ("2", "", 1), ("", "1", 3)])
def test_a_whole_run_with_stand_ins(tmp_path, errors, fail, status):
    sanitizer, sweep = tmp_path / "compute-sanitizer", tmp_path / "sweep.py"
    sanitizer.write_text(FAKE_SANITIZER)
    sanitizer.chmod(0o755)
    sweep.write_text(FAKE_SWEEP)
    done = _run(tmp_path, "63", "64", PATH=f"{tmp_path}:/usr/bin:/bin", SWEEP=str(sweep), PYTHON=sys.executable,
                FAKE_ERRORS=errors, FAKE_SWEEP_FAIL=fail)
    assert done.returncode == status, (done.stdout, done.stderr)
    log = (tmp_path / "out" / "sanitize-folded.log").read_text()
    assert "env 1 1" in log and "lengths ['63', '64']" in log, log
    verdict = (tmp_path / "out" / "sanitize-folded-verdict.txt").read_text()
    assert verdict == done.stdout and verdict.startswith("PASS" if status == 0 else "FAIL"), verdict


def test_the_sweep_finds_this_checkout_s_package_without_an_install(tmp_path):
    """The GPU box runs ``python3 scripts/folded_sweep.py`` from the checkout, the package not installed."""
    from tests.test_decode_profile import run_without_installed_package

    done = run_without_installed_package(ROOT / "scripts" / "folded_sweep.py", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "cudnn_sdpa_provider" / "__init__.py")


HANGING_SWEEP = """import time
print("START S=63", flush=True)
time.sleep(120)
"""


def test_a_sweep_cut_by_timeout_still_gets_its_verdict(tmp_path):
    """TIMEOUT bounds the run (its default fits a 600 s device call): the sweep is cut, the verdict
    written, exit status 3, the log keeping how far it got."""
    assert 'timeout --kill-after=30 "${TIMEOUT:-540}"' in SCRIPT.read_text()
    sanitizer, sweep = tmp_path / "compute-sanitizer", tmp_path / "sweep.py"
    sanitizer.write_text(FAKE_SANITIZER)
    sanitizer.chmod(0o755)
    sweep.write_text(HANGING_SWEEP)
    done = _run(tmp_path, PATH=f"{tmp_path}:/usr/bin:/bin", SWEEP=str(sweep), PYTHON=sys.executable, TIMEOUT="3")
    assert done.returncode == 3, (done.stdout, done.stderr)
    verdict = (tmp_path / "out" / "sanitize-folded-verdict.txt").read_text()
    assert verdict.startswith("FAIL") and "exit status 124" in verdict, verdict
    assert "START S=63" in (tmp_path / "out" / "sanitize-folded.log").read_text()
