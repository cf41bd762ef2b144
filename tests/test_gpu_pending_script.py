"""CPU tier: scripts/gpu_pending.sh, the staged GPU runs of what results/gpu-runs.md lists as not yet
run. What needs no GPU: the script parses; every test file and script it names exists; an unknown
stage is refused; and a whole stage with a stand-in ``python3`` (the commands it runs in order, the
log sections it writes under OUT, a failing command marking the stage failed while the rest still
run)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_pending.sh"


def test_the_script_parses_and_names_only_files_that_exist():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    named = set(re.findall(r"(?:tests/gpu|scripts)/[\w./]+\.(?:py|sh)", text))
    assert len(named) >= 8, named
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, missing


def _run(tmp_path, stage, fail_on=""):
    """The script with a stand-in python3 that records its arguments (and exits 1 when they contain
    ``fail_on``), and an installed frontend folder so nothing is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\necho ran \"$*\"\n"
                    f"if [ -n \"{fail_on}\" ] && [[ \"$*\" == *\"{fail_on}\"* ]]; then exit 1; fi\nexit 0\n")
    fake.chmod(0o755)
    (tmp_path / "site" / "csp-fe-1.32.0" / "cudnn").mkdir(parents=True)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "SITE_ROOT": str(tmp_path / "site"),
           "SANITIZER": str(tmp_path / "no-compute-sanitizer")}  # as on a machine without one
    done = subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else [], out


def test_an_unknown_stage_is_refused(tmp_path):
    done, calls, _ = _run(tmp_path, "everything")
    assert done.returncode == 2 and "unknown stage everything" in done.stderr


@pytest.mark.parametrize("stage, first, sections", [
    ("fp8", "-m pytest tests/gpu/test_fp8_recipes_gpu.py", ["grouped_kernels_on_device", "fp8_tests_forced",
                                                            "fp8_varlen_tests",
                                                            "e2e_auto", "e2e_grouped", "bench_fp8_grouped",
                                                            "fp8_varlen_probe"]),
    ("shapes", "-m pytest tests/gpu/test_shapes.py", ["shapes_tests", "new_length_provider", "new_length_native",
                                                      "new_length_flash", "new_length_breakdown", "decode_calls",
                                                      "decode_generate", "hf_all", "sanitize_folded"]),
    ("lengths", "-m pytest tests/gpu/test_shapes.py", ["shapes_tests", "new_length_provider", "new_length_native",
                                                       "new_length_flash", "new_length_breakdown",
                                                       "hf_dynamic_padding_provider", "hf_models_padded"]),
    ("generate", "scripts/decode_profile.py calls", ["decode_calls", "decode_rows_probe_8", "decode_rows_probe_1"]
     + [f"hf_generate_{p}_{b}" for b in (8, 1) for p in ("provider", "cudnn", "native", "flash")]
     + [f"hf_dynamic_padding_{p}" for p in ("provider", "cudnn", "native")]),
    ("host", "scripts/fp8_host_breakdown.py", ["fp8_host_breakdown", "fp8_gqa_bwd_probe", "new_length_segments",
                                                "fp8_e2e", "fp8_gqa_bwd_probe_4k", "shapes_folded_tests",
                                                "fp8_recipe_tests", "triton_launch_probe"]),
    ("floor", "-m cudnn_sdpa_provider bench --shapes fp8", ["bench_fp8"]
     + [f"fp8_e2e_b{b}_h32kv{hk}_s{s}{c}" for b, hk, s in ((1, 32, 4096), (1, 32, 8192), (1, 32, 16384),
                                                          (4, 8, 4096), (4, 8, 8192)) for c in ("_causal", "")]),
    ("graphed", "scripts/fp8_graphed.py --shape 1,32,32,4096,128",
     [f"fp8_graphed_b{b}_h32kv{hk}_s{s}{c}" for b, hk, s in ((1, 32, 4096), (4, 8, 4096), (1, 32, 8192))
      for c in ("_causal", "")]),
    ("hfhost", "scripts/hf_step_profile.py --case hf_llama_l2_d256_b2_s256_padded",
     ["hf_step_host_one_core", "hf_step_host_unpinned"]),
    ("tier", "-m pytest tests/gpu/test_known_issues_gpu.py", ["tier"]),
])
def test_a_stage_runs_its_commands_and_logs_each_section(tmp_path, stage, first, sections):
    done, calls, out = _run(tmp_path, stage)
    assert done.returncode == 0, done.stderr
    assert calls[0].startswith("-c import torch, cudnn"), "the versions first"
    assert calls[1].startswith(first) and ("--gpu" in calls[1]) == first.startswith("-m pytest")
    log = (out / f"{stage}.txt").read_text()
    assert [s for s in re.findall(r"^===== (\w+) \(", log, re.M)] == sections
    assert log.rstrip().endswith(f"stage {stage}: passed")
    if stage == "shapes":  # no compute-sanitizer here: said, not failed
        assert "compute-sanitizer not found: not run" in log


def test_a_failing_command_fails_the_stage_and_the_rest_still_run(tmp_path):
    done, calls, out = _run(tmp_path, "fp8", fail_on="fp8_e2e_profile.py --calls 20 --cprofile")
    assert done.returncode == 1
    assert any("bench --shapes fp8" in c for c in calls), "the bench after the failing profile still ran"
    log = (out / "fp8.txt").read_text()
    assert "===== exit 1" in log and log.rstrip().endswith("stage fp8: FAILED")
