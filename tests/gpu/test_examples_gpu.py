"""GPU tier: every example, and the unmodified script under the environment variable, with every
attention call it reports served by a cuDNN graph and no fallback (the CPU tier's runs are
tests/test_examples.py, whose helpers these use)."""

from __future__ import annotations

import json

import pytest

from tests.test_examples import (CASES, EXAMPLES, _check_unmodified_report, _report_rows, _run, _run_with_startup_hook,
                                 paged_error)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_example_served_on_gpu(name, tmp_path):
    result = _run([str(EXAMPLES / name)], cwd=tmp_path)
    for line in CASES[name]:
        assert line in result.stdout, f"{line!r} not in the output of {name}:\n{result.stdout}"
    rows = _report_rows(result.stdout)
    assert sum(served for _, served, _ in rows) > 0, result.stdout
    assert all(fallbacks == 0 for _, _, fallbacks in rows), f"{name} fell back:\n{result.stdout}"
    if name == "hf_model.py":  # the served loss agrees with transformers' own sdpa (bf16)
        diff = float(result.stdout.split("|diff| ")[1].split()[0])
        assert diff < 2e-2, result.stdout
    if name == "paged_decode.py":  # bf16 on the GPU
        assert paged_error(result.stdout) < 2e-2, result.stdout


@pytest.mark.gpu
def test_unmodified_script_under_env_var_served_on_gpu(tmp_path):
    report = tmp_path / "run.json"
    _run_with_startup_hook(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report))
    data = _check_unmodified_report(json.loads(report.read_text()))
    assert data["dense_fwd"] == {"served": 4, "fallback": {}}, data
    assert data["dense_bwd"] == {"served": 4, "fallback": {}}, data
