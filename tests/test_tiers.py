"""CPU tier: the tiers are kept apart by directory. Every test marked ``gpu`` lives under
tests/gpu, so a CPU-tier file holds no GPU test (skipped tests there would hide in the count)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_marker_only_under_tests_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--collect-only", "-q",
                             "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert ids, "the gpu tier collected nothing: the marker filter did not work"
    outside = [i for i in ids if not i.startswith("tests/gpu/")]
    assert not outside, f"tests marked gpu outside tests/gpu: {outside}"
