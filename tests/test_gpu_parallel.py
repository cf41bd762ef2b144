"""CPU tier: scripts/gpu_parallel.sh, which runs parts of the GPU tier side by side (a stand-in
for scripts/gpu_tier.sh records what each part was given)."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent

FAKE_TIER = """#!/usr/bin/env bash
mkdir -p "$OUT"
printf '%s\\n%s\\n' "$PYTEST_K" "$SITE_ROOT" > "$OUT/given.txt"
touch "$OUT/started"
for i in $(seq 100); do  # wait for every part to have started: they run at once, or this times out
  [ "$(ls "$OUT"/../*/started 2>/dev/null | wc -l)" -ge "$PARTS" ] && break
  sleep 0.05
done
case $PYTEST_K in *bad*) echo "1 failed, 2 passed in 0.1s" > "$OUT/log-1.32.0.txt"; exit 1;; esac
echo "3 passed in 0.1s" > "$OUT/log-1.32.0.txt"
"""


def _run(tmp_path, *parts):
    tier = tmp_path / "fake_tier.sh"
    tier.write_text(FAKE_TIER)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "TIER": str(tier), "PARTS": str(len(parts)),
           "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_parallel.sh"), *parts], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, out


def test_parts_run_at_once_each_with_its_expression_site_and_outputs(tmp_path):
    done, out = _run(tmp_path, "layouts=test_layouts", "tier=not fuzzed and not test_layouts")
    assert done.returncode == 0, done.stderr
    assert (out / "layouts" / "given.txt").read_text().splitlines() == ["test_layouts",
                                                                       f"{tmp_path}/csp-parallel-layouts"]
    assert (out / "tier" / "given.txt").read_text().splitlines()[0] == "not fuzzed and not test_layouts"
    assert "== layouts: passed (3 passed in 0.1s)" in done.stdout and "== tier: passed" in done.stdout


def test_a_failing_part_fails_the_run_and_is_named(tmp_path):
    done, _ = _run(tmp_path, "good=test_engine", "worse=bad_one")
    assert done.returncode == 1
    assert "== good: passed" in done.stdout and "== worse: failed (1 failed, 2 passed in 0.1s)" in done.stdout


def test_bad_arguments_are_usage_errors(tmp_path):
    for parts in ((), ("no_expression",), ("bad name=x",)):
        done, _ = _run(tmp_path, *parts)
        assert done.returncode == 2 and done.stderr.startswith(("usage", "gpu_parallel:")), (parts, done.stderr)
