"""CPU tier: the telemetry file (``telemetry.write_report``) is written whole or not at all, and
``report_path_problem`` says why a path cannot take it without leaving anything behind."""

from __future__ import annotations

import json
import os

import pytest

from cudnn_sdpa_provider.hooks import telemetry
from cudnn_sdpa_provider.core.reasons import PATHS


def test_write_report_writes_the_json(tmp_path):
    path = tmp_path / "run.json"
    telemetry.write_report(str(path))
    assert set(json.loads(path.read_text())) == set(PATHS) | {"meta"}
    assert os.listdir(tmp_path) == ["run.json"]


def test_a_failed_write_leaves_neither_report_nor_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "run.json"

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(telemetry.os, "replace", no_rename)
    with pytest.raises(OSError, match="No space left"):
        telemetry.write_report(str(path))
    assert os.listdir(tmp_path) == []


def test_an_existing_report_is_kept_when_the_new_one_fails(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text("old\n")
    monkeypatch.setattr(telemetry, "report_data", lambda: {"x": object()})  # not JSON-serialisable
    with pytest.raises(TypeError):
        telemetry.write_report(str(path))
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["run.json"]


@pytest.mark.parametrize("kind, why", [("directory", "it is a directory"), ("missing_dir", "does not exist"),
                                       ("under_a_file", "is not a directory")])
def test_report_path_problem_names_the_cause_and_creates_nothing(tmp_path, kind, why):
    (tmp_path / "file").write_text("")
    target = {"directory": tmp_path, "missing_dir": tmp_path / "nope" / "run.json",
              "under_a_file": tmp_path / "file" / "run.json"}[kind]
    problem = telemetry.report_path_problem(str(target))
    assert problem is not None and why in problem, problem
    assert os.listdir(tmp_path) == ["file"]


def test_report_path_problem_accepts_a_new_file(tmp_path):
    assert telemetry.report_path_problem(str(tmp_path / "run.json")) is None
    assert os.listdir(tmp_path) == [], "the probe file is removed"
