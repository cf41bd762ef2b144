"""CPU tier: the telemetry file (``telemetry.write_report``) is written whole or not at all, and
``report_path_problem`` says why a path cannot take it without leaving anything behind."""

from __future__ import annotations

import json
import os
import stat

import pathlib

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


# ------------------------------------------- every kind of path: written where a user expects, or refused


REPO = pathlib.Path(__file__).resolve().parent.parent


def _env() -> dict:
    """The environment of a child interpreter that imports this checkout's package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_SDPA_PROVIDER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="device nodes are made with mknod, which needs root")


def _is_report(text: str) -> bool:
    return set(json.loads(text)) == set(PATHS) | {"meta"}


def test_an_existing_file_is_replaced_keeping_its_mode(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("old\n")
    os.chmod(path, 0o640)
    telemetry.write_report(str(path))
    assert _is_report(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o640, "the permission bits are kept, not reset to 0644"
    assert os.listdir(tmp_path) == ["run.json"]


@needs_root
def test_an_existing_file_keeps_its_owner_when_root_rewrites_it(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("old\n")
    os.chown(path, 65534, 65534)
    telemetry.write_report(str(path))
    assert (path.stat().st_uid, path.stat().st_gid) == (65534, 65534) and _is_report(path.read_text())


def test_a_read_only_file_is_refused_and_kept(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("keep me\n")
    os.chmod(path, 0o444)
    problem = telemetry.report_path_problem(str(path))
    assert problem == "it is read-only (mode 0444)", problem
    with pytest.raises(telemetry.ReportPathError, match="read-only"):
        telemetry.write_report(str(path))
    assert path.read_text() == "keep me\n" and stat.S_IMODE(path.stat().st_mode) == 0o444
    assert os.listdir(tmp_path) == ["run.json"]


def test_a_file_the_process_may_not_write_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text("theirs\n")
    monkeypatch.setattr(telemetry.os, "access", lambda p, mode: False)  # as for another user's 0644 file
    assert telemetry.report_path_problem(str(path)) == "permission denied"
    with pytest.raises(telemetry.ReportPathError, match="permission denied"):
        telemetry.write_report(str(path))
    assert path.read_text() == "theirs\n"


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old\n")
    link.symlink_to(target)
    telemetry.write_report(str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _is_report(target.read_text())
    assert sorted(os.listdir(tmp_path)) == ["link.json", "real.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    (tmp_path / "out").mkdir()
    target, link = tmp_path / "out" / "run.json", tmp_path / "link.json"
    link.symlink_to(target)
    telemetry.write_report(str(link))
    assert link.is_symlink() and _is_report(target.read_text())


@needs_root
def test_a_character_device_is_written_directly_never_replaced(tmp_path):
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the same device as /dev/null
    assert telemetry.report_path_problem(str(null)) is None
    telemetry.write_report(str(null))
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    assert os.listdir(tmp_path) == ["null"], "no temporary file either"


@needs_root
def test_a_symlink_to_a_character_device_stays_a_link(tmp_path):
    null, link = tmp_path / "null", tmp_path / "report.json"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    link.symlink_to(null)
    telemetry.write_report(str(link))
    assert link.is_symlink() and stat.S_ISCHR(os.lstat(null).st_mode)


@needs_root
def test_a_block_device_is_refused_and_never_opened(tmp_path):
    disk = tmp_path / "loop"
    os.mknod(disk, stat.S_IFBLK | 0o660, os.makedev(7, 0))
    assert "block device" in telemetry.report_path_problem(str(disk))
    with pytest.raises(telemetry.ReportPathError, match="block device"):
        telemetry.write_report(str(disk))
    assert stat.S_ISBLK(os.lstat(disk).st_mode) and os.listdir(tmp_path) == ["loop"]


def test_a_fifo_is_written_to_its_reader(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader first, so that nothing blocks
    try:
        assert telemetry.report_path_problem(str(fifo)) is None
        telemetry.write_report(str(fifo))
        chunks = []
        while True:
            try:
                chunk = os.read(reader, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(reader)
    assert _is_report(b"".join(chunks).decode())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["fifo"]


def test_a_fifo_without_a_reader_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(telemetry.ReportPathError, match="no process is reading the FIFO"):
        telemetry.write_report(str(fifo))  # would hang without O_NONBLOCK
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["fifo"]


def test_a_socket_is_refused(tmp_path):
    import socket

    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        assert "socket" in telemetry.report_path_problem(str(path))
        with pytest.raises(telemetry.ReportPathError, match="socket"):
            telemetry.write_report(str(path))
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_script_without_torch_gets_a_report_without_importing_torch(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "run.json"
    code = ("import sys; from cudnn_sdpa_provider.hooks import telemetry; telemetry.write_report(sys.argv[1]); "
            "print('torch imported:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                            env=_env())
    assert result.returncode == 0 and "torch imported: False" in result.stdout, result.stderr
    data = json.loads(path.read_text())
    assert data["meta"]["enabled"] is False and data["meta"]["torch"]
    assert all(data[p] == {"served": 0, "fallback": {}} for p in PATHS), data


@pytest.mark.parametrize("redirect", ["file", "pipe"])
def test_dev_stdout_gets_the_report_after_the_output(tmp_path, redirect):
    import subprocess
    import sys

    code = ("import sys; print('printed first'); from cudnn_sdpa_provider.hooks import telemetry; "
            "telemetry.write_report('/dev/stdout')")
    if redirect == "file":
        out = tmp_path / "out.txt"
        with open(out, "w") as fh:
            result = subprocess.run([sys.executable, "-c", code], stdout=fh, stderr=subprocess.PIPE, text=True,
                                    timeout=120, env=_env())
        text = out.read_text()  # was: the file replaced by the report, the printed line lost
    else:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
        text = result.stdout
    assert result.returncode == 0, result.stderr
    first, rest = text.split("\n", 1)
    assert first == "printed first" and _is_report(rest), text
    assert os.listdir(tmp_path) == (["out.txt"] if redirect == "file" else [])
