"""CPU tier: scripts/gpu_summary.py, which the GPU tier's record is made from (junit counts per
frontend, fuzz configurations counted from CSP_FUZZ_LOG files, layout crashes from START lines)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

JUNIT = """<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">
<testcase classname="tests.gpu.a" name="ok"/><testcase classname="tests.gpu.a" name="bad"><failure/></testcase>
<testcase classname="tests.gpu.a" name="skip"><skipped/></testcase><testcase classname="tests.gpu.a" name="ok2">
<properties><property name="allocated_drift_bytes" value="0"/></properties></testcase>
</testsuite></testsuites>"""


def test_counts_junit_and_fuzz_lines(tmp_path):
    (tmp_path / "junit-1.32.0.xml").write_text(JUNIT)
    (tmp_path / "fuzz-1.32.0.log").write_text(
        "dense ok {'b': 1}\n" * 3 + "dense FAIL {'b': 2, 'x': 'a b'}\n" + "varlen ok {'lens': [0, 1]}\n")
    (tmp_path / "fuzz-1.28.0.log").write_text("varlen ok {}\n")  # killed before its junit file was written
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["frontends"]
    assert runs["1.32.0"]["passed"] == 2 and runs["1.32.0"]["failures"] == 1
    assert runs["1.32.0"]["failed_tests"] == ["tests.gpu.a::bad"]
    assert runs["1.32.0"]["figures"] == {"tests.gpu.a::ok2": {"allocated_drift_bytes": "0"}}
    assert runs["1.32.0"]["fuzz_configs"] == {"dense": {"ok": 3, "FAIL": 1}, "varlen": {"ok": 1}}
    assert runs["1.28.0"] == {"fuzz_configs": {"varlen": {"ok": 1}}}


def test_layout_lines_count_ok_fail_and_crashes(tmp_path):
    """A START that no ok / FAIL line of its id ends is a crash: the child died on it and a fresh one
    resumed after it; one still open at the end of the log crashed too."""
    (tmp_path / "fuzz-1.32.0.log").write_text("".join([
        'layouts START {"id": 0}\n', 'layouts ok {"id": 0} dense_fwd=served dense_bwd=served\n',
        'layouts START {"id": 1}\n', 'dense ok {\'b\': 1}\n',  # another kind in between changes nothing
        'layouts FAIL {"id": 1} AssertionError: dq: max|err|/max|ref| = 1.1e+00\n',
        'layouts START {"id": 2}\n',  # crashed: never ended
        'layouts START {"id": 3}\n', 'layouts ok {"id": 3} varlen_fwd=served varlen_bwd=served\n',
        'layouts START {"id": 4}\n',  # crashed: the log ends
    ]))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)["frontends"]["1.32.0"]["fuzz_configs"]
    assert counts == {"layouts": {"ok": 2, "FAIL": 1, "crash": 2}, "dense": {"ok": 1}}


def test_layout_lines_of_children_running_at_once_are_paired_by_id(tmp_path):
    """Batches run side by side (CSP_LAYOUT_JOBS) interleave their lines in one log."""
    (tmp_path / "fuzz-1.32.0.log").write_text("".join([
        'layouts START {"id": 0}\n', 'layouts START {"id": 125}\n', 'layouts ok {"id": 125} x\n',
        'layouts START {"id": 126}\n', 'layouts ok {"id": 0} y\n', 'layouts START {"id": 1}\n',
        'layouts FAIL {"id": 1} AssertionError: z\n',  # 126 never ends: the one crash
    ]))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["frontends"]["1.32.0"]["fuzz_configs"] == {
        "layouts": {"ok": 2, "FAIL": 1, "crash": 1}}
