"""CPU tier: scripts/host_bisect.sh, which times copies of the package side by side on the GPU box
(a stand-in for scripts/host_profile.py prints what the real one prints, from the copy it was given)."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent

FAKE_PROFILE = """import os, sys
name = os.path.basename(os.environ["CSP_UNDER_TEST"])
us = {"old": (16.7, 130.0, 50.3, 313.2), "new": (17.8, 137.7, 58.2, 465.3)}[name]
cpu = 10 * int(os.environ["ROUND"])  # the CPU column differs per round: the medians must take it
assert sys.argv[1:] == ["--quick", "--calls", "7"], sys.argv
print("host us per call (wall, CPU of all threads), (1, 2, 128, 64) bf16 causal, 7 calls x 5 runs, median; stand-in")
print(f"  native cuDNN F.sdpa forward                           {us[0]}  {us[0] + 1}")
print(f"  native cuDNN F.sdpa forward+backward                  {us[1]}  {us[1] + cpu}")
print(f"  provider F.sdpa forward                               {us[2]}  {us[2] + 1}")
print(f"  provider F.sdpa forward+backward                      {us[3]}  {us[3] + cpu}")
"""


def _run(tmp_path, *dirs):
    profile = tmp_path / "fake_profile.py"
    profile.write_text(FAKE_PROFILE)
    env = {"PATH": "/usr/bin:/bin", "PROFILE": str(profile), "ROUNDS": "2", "CALLS": "7", "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "host_bisect.sh"), *map(str, dirs)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_each_copy_gets_a_row_per_round_with_its_own_figures(tmp_path):
    for name in ("old", "new"):
        (tmp_path / name / "cudnn_sdpa_provider").mkdir(parents=True)
    done = _run(tmp_path, tmp_path / "old", tmp_path / "new")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines[1:5]]
    assert rows == [["old", "1", "16.7", "50.3", "130.0", "313.2", "140.0", "323.2"],
                    ["old", "2", "16.7", "50.3", "130.0", "313.2", "150.0", "333.2"],
                    ["new", "1", "17.8", "58.2", "137.7", "465.3", "147.7", "475.3"],
                    ["new", "2", "17.8", "58.2", "137.7", "465.3", "157.7", "485.3"]]
    assert lines[5] == "medians over the rounds:"
    assert [line.split() for line in lines[6:]] == [
        ["old", "med", "16.7", "50.3", "130.0", "313.2", "145.0", "328.2", "(2", "rounds)"],
        ["new", "med", "17.8", "58.2", "137.7", "465.3", "152.7", "480.3", "(2", "rounds)"]]


def test_a_directory_without_the_package_and_no_arguments_are_usage_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert _run(tmp_path, tmp_path / "empty").returncode == 2
    assert _run(tmp_path).returncode == 2
