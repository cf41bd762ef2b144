"""CPU tier: the ``cudnn-sdpa`` CLI through ``main(argv)`` (exit codes, help, run, demo, doctor)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.tools import cli
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.core.reasons import PATHS

REPO = pathlib.Path(__file__).resolve().parent.parent

HELP = """\
usage: cudnn-sdpa [-h] [--version] {run,demo,doctor,bench} ...

PyTorch attention on cuDNN graphs, with an audit.

positional arguments:
  {run,demo,doctor,bench}
    run                 run a Python script under the provider and report at exit
    demo                train a small built-in transformer a few steps under the provider
    doctor              versions, GPU, served features, coexistence, GPU self-test
    bench               time the provider side by side with PyTorch's native attention paths

options:
  -h, --help            show this help message and exit
  --version             print the versions of this package, torch and the frontend
"""

RUN_HELP = """\
usage: cudnn-sdpa run [-h] [--strict] [--report FILE] script [args ...]

Options go before the script: everything after it is the script's (as with coverage run).

positional arguments:
  script         the script to run
  args           arguments for the script

options:
  -h, --help     show this help message and exit
  --strict       stop at the first call that would fall back (csp.FallbackError; exit status 5)
  --report FILE  also write the telemetry JSON to FILE

The exit status is the script's; 2 for bad options, a missing script (or a folder without
__main__.py) or a --report FILE that cannot be written (checked before the script starts). Exit
status 5 when --strict refused a call that would have fallen back (one line on stderr: the path
and the reasons).
"""

#: A small CPU script for ``run``: attention forward + backward, then exits with the code in argv[1].
SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    import cudnn_sdpa_provider as csp
    print("enabled:", csp.enabled(), "argv:", sys.argv)
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).sum().backward()
    code = sys.argv[1] if len(sys.argv) > 1 else "none"
    if code != "none":
        sys.exit(int(code) if code.lstrip("-").isdigit() else code)
    """
)


@pytest.fixture(autouse=True)
def _fixed_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps help to the terminal width
    counters.reset_stats()
    yield
    assert not csp.enabled(), "the CLI left the provider enabled"


def test_exit_codes_are_distinct_named_constants():
    codes = [cli.EXIT_OK, cli.EXIT_FAILURE, cli.EXIT_USAGE, cli.EXIT_SELF_TEST_FAILED, cli.EXIT_NO_CUDA,
             cli.EXIT_REFUSED]
    assert codes == [0, 1, 2, 3, 4, 5]
    assert {name for name in cli.__all__ if name.startswith("EXIT_")} == {
        "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_SELF_TEST_FAILED", "EXIT_NO_CUDA", "EXIT_REFUSED"}


def test_every_nonzero_exit_code_is_documented_in_ways_in():
    page = (REPO / "docs" / "ways-in.md").read_text()
    table = page.split("| exit code | meaning |")[1].split("\n\n")[0]
    documented = {int(line.split("|")[1].strip().strip("`")) for line in table.splitlines()[2:] if line.startswith("|")}
    assert documented == {getattr(cli, n) for n in cli.__all__ if n.startswith("EXIT_")}, table


def test_help_text(capsys):
    assert cli.main(["--help"]) == cli.EXIT_OK
    assert capsys.readouterr().out == HELP


def test_run_help_text(capsys):
    assert cli.main(["run", "--help"]) == cli.EXIT_OK
    assert capsys.readouterr().out == RUN_HELP


@pytest.mark.parametrize("argv", [[], ["bogus"], ["demo", "--device", "tpu"], ["demo", "--steps", "x"],
                                  ["doctor", "--bogus"], ["run"]])
def test_usage_errors(argv, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: cudnn-sdpa") and "error:" in err


#: (argv, the usage line's start, the error line): each names what is wrong, with the right usage
USAGE_MESSAGES = [
    (["--bogus"], "usage: cudnn-sdpa [-h]", "cudnn-sdpa: error: unrecognized arguments: --bogus"),
    (["--bogus", "demo"], "usage: cudnn-sdpa [-h]", "cudnn-sdpa: error: unrecognized arguments: --bogus"),
    ([], "usage: cudnn-sdpa [-h]", "cudnn-sdpa: error: a command is required: one of run, demo, doctor, bench"),
    (["demo", "--bogus"], "usage: cudnn-sdpa demo [-h]", "cudnn-sdpa demo: error: unrecognized arguments: --bogus"),
    (["doctor", "--bogus"], "usage: cudnn-sdpa doctor [-h]",
     "cudnn-sdpa doctor: error: unrecognized arguments: --bogus"),
    (["run"], "usage: cudnn-sdpa run [-h]", "cudnn-sdpa run: error: a script is required"),
    (["run", "--bogus", "x.py"], "usage: cudnn-sdpa run [-h]",
     "cudnn-sdpa run: error: unrecognized arguments: --bogus"),
    (["demo", "--steps", "100000000000"], "usage: cudnn-sdpa demo [-h]",
     "cudnn-sdpa demo: error: argument --steps: expected an integer from 1 to 10000, got '100000000000'"),
    (["demo", "--steps", "0"], "usage: cudnn-sdpa demo [-h]",
     "cudnn-sdpa demo: error: argument --steps: expected an integer from 1 to 10000, got '0'"),
]


@pytest.mark.parametrize("argv, usage, message", USAGE_MESSAGES,
                         ids=[" ".join(a) or "none" for a, _, _ in USAGE_MESSAGES])
def test_usage_errors_name_the_problem_with_the_commands_usage(argv, usage, message, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(usage), err
    assert err.splitlines()[-1] == message, err
    assert "required" not in err or "a script is required" in err or "a command is required" in err, err


def test_demo_max_steps_is_the_demos():
    from cudnn_sdpa_provider.tools import demo

    assert cli.DEMO_MAX_STEPS == demo.MAX_STEPS
    with pytest.raises(ValueError, match="steps must be an int from 1 to 10000, got 10001"):
        demo.run_demo(steps=demo.MAX_STEPS + 1)


def test_version_names_the_three_versions_without_importing_torch():
    from importlib.metadata import version

    code = ("import sys; from cudnn_sdpa_provider.tools import cli\n"
            "try:\n    cli.main(['--version'])\nfinally:\n    print('torch imported:', 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, last = result.stdout.splitlines()
    assert first.startswith(f"cudnn-sdpa-provider {csp.__version__} (torch {version('torch')}, "
                            f"nvidia-cudnn-frontend {version('nvidia-cudnn-frontend')}, Python "), first
    assert last == "torch imported: False"


def test_help_and_python_dash_m_never_import_torch():
    code = ("import sys; from cudnn_sdpa_provider.tools import cli; cli.main(['--help']); "
            "print('torch imported:', 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="100")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("torch imported: False\n")
    result = subprocess.run([sys.executable, "-m", "cudnn_sdpa_provider", "--help"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, HELP)


# ------------------------------------------------------------------------------------------ run


def write_script(tmp_path, source=SCRIPT) -> str:
    path = tmp_path / "script.py"
    path.write_text(source)
    return str(path)


@pytest.mark.parametrize("code, expected", [("none", 0), ("0", 0), ("3", 3), ("stop", cli.EXIT_FAILURE)])
def test_run_propagates_the_exit_code_and_writes_the_report(tmp_path, capsys, code, expected):
    script, report = write_script(tmp_path), tmp_path / "run.json"
    argv_before = list(sys.argv)
    assert cli.main(["run", "--report", str(report), script, code]) == expected
    assert sys.argv == argv_before, "sys.argv restored"
    out, err = capsys.readouterr()
    assert f"enabled: True argv: [{script!r}, {code!r}]" in out
    assert "cudnn-sdpa-provider report:" in err and "no_cuda=1" in err
    data = json.loads(report.read_text())
    assert set(data) == set(PATHS) | {"meta"}
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 1}}
    assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 1}}


def test_run_passes_options_after_the_script_to_it(tmp_path, capsys):
    script = write_script(tmp_path, "import sys\nprint(sys.argv[1:])\n")
    assert cli.main(["run", script, "--strict", "--report", "x", "-h"]) == cli.EXIT_OK
    assert "['--strict', '--report', 'x', '-h']" in capsys.readouterr().out


def test_run_missing_script_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.py")
    assert cli.main(["run", missing]) == cli.EXIT_USAGE
    assert f"cudnn-sdpa run: no such script: {missing}" in capsys.readouterr().err


def test_run_a_folder_without_main_is_not_a_script(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path)]) == cli.EXIT_USAGE  # was exit 1 and an ImportError from runpy
    out, err = capsys.readouterr()
    assert err == f"cudnn-sdpa run: {tmp_path} is a directory without __main__.py, not a script\n", err


def test_run_a_folder_with_main_runs_it(tmp_path, capsys):
    (tmp_path / "__main__.py").write_text("print('main ran')\n")
    assert cli.main(["run", str(tmp_path)]) == cli.EXIT_OK
    assert "main ran" in capsys.readouterr().out


@pytest.mark.parametrize("after", [["--report", "r.json"], ["--report=r.json"], ["x", "--strict"]])
def test_run_options_after_the_script_get_one_hint_line(tmp_path, capsys, after, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = write_script(tmp_path, "import sys\nprint(sys.argv[1:])\n")
    assert cli.main(["run", script, *after]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert repr(after) in out, "still the script's arguments (as with coverage run)"
    hints = [line for line in err.splitlines() if line.startswith("cudnn-sdpa run: note:")]
    assert len(hints) == 1, err
    assert "after the script is passed to the script, not to run" in hints[0], hints
    assert "run's options go before the script" in hints[0], hints
    assert not (tmp_path / "r.json").exists()


def test_run_options_before_the_script_give_no_hint(tmp_path, capsys):
    script = write_script(tmp_path, "print('ok')\n")
    assert cli.main(["run", "--report", str(tmp_path / "r.json"), script, "--other"]) == cli.EXIT_OK
    assert "note:" not in capsys.readouterr().err


def test_run_strict_refusal_is_one_line_and_its_exit_code(tmp_path, capsys):
    script, report = write_script(tmp_path), tmp_path / "run.json"
    assert cli.main(["run", "--strict", "--report", str(report), script]) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if line.startswith("cudnn-sdpa run: refused")]
    assert len(refusals) == 1 and "Traceback" not in err, err
    assert refusals[0].startswith("cudnn-sdpa run: refused: cudnn-sdpa-provider (strict): dense_fwd would fall back; "
                                  "reasons: no_cuda"), err
    assert "cudnn-sdpa-provider report:" in err and "no_cuda=1 (refused 1)" in err, "the audit shows the refusal"
    data = json.loads(report.read_text())
    assert data["meta"]["enabled"] is True
    assert data["dense_fwd"]["fallback"] == {"no_cuda": 1} and data["meta"]["refused"] == {"dense_fwd": {"no_cuda": 1}}


@pytest.mark.parametrize("kind", ["directory", "missing_dir", "under_a_file", "read_only"])
def test_run_unwritable_report_is_refused_before_the_script_runs(tmp_path, capsys, kind):
    script = write_script(tmp_path, "open('ran', 'w').close()\n")
    target = {"directory": tmp_path, "missing_dir": tmp_path / "nope" / "run.json",
              "under_a_file": tmp_path / "script.py" / "run.json", "read_only": tmp_path / "script.py"}.get(kind)
    if kind == "read_only":
        os.chmod(target, 0o444)  # refused even for root: the user marked it read-only
    assert cli.main(["run", "--report", str(target), script]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"cudnn-sdpa run: --report {target}: cannot write there: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.py"], "the script did not run; nothing created"
    if kind == "read_only":
        assert err.endswith("it is read-only (mode 0444)\n")
        assert (tmp_path / "script.py").stat().st_mode & 0o777 == 0o444


def test_run_report_to_a_fifo_nobody_reads_is_one_line_at_the_end(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # not refused up front (a reader may come), never waited for at the end
    script = write_script(tmp_path, "print('ran')\n")
    assert cli.main(["run", "--report", str(fifo), script]) == cli.EXIT_OK, "the script's exit status"
    out, err = capsys.readouterr()
    assert "ran" in out and "Traceback" not in err
    assert f"cudnn-sdpa run: warning: report not written to {str(fifo)!r}: no process is reading the FIFO" in err


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_run_report_to_a_character_device_keeps_the_device(tmp_path, capsys):
    import stat

    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what `--report /dev/null` replaced, as root
    assert cli.main(["run", "--report", str(null), write_script(tmp_path)]) == cli.EXIT_OK
    assert stat.S_ISCHR(os.lstat(null).st_mode) and sorted(os.listdir(tmp_path)) == ["null", "script.py"]


def test_run_script_exception_propagates_and_disables(tmp_path, capsys):
    script = write_script(tmp_path, "raise ZeroDivisionError('in the script')\n")
    with pytest.raises(ZeroDivisionError, match="in the script"):
        cli.main(["run", script])


def test_run_script_imports_its_sibling_modules(tmp_path, capsys):
    sub = tmp_path / "project"
    sub.mkdir()
    (sub / "helper_mod_for_cli_test.py").write_text("VALUE = 42\n")
    script = write_script(sub, "import helper_mod_for_cli_test as h\nprint('helper', h.VALUE)\n")
    try:
        assert cli.main(["run", script]) == cli.EXIT_OK
    finally:
        sys.modules.pop("helper_mod_for_cli_test", None)
    assert "helper 42" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- demo


def test_demo_json_on_cpu(capsys):
    assert cli.main(["demo", "--steps", "1", "--device", "cpu", "--json"]) == cli.EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"device", "losses"} | set(PATHS)
    assert data["device"] == "cpu"
    (loss,) = data["losses"]
    assert math.isfinite(loss) and abs(loss - math.log(256)) < 1.0, "an untrained byte model: about ln(256)"
    layers = 2
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": layers}}
    assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": layers}}
    assert data["varlen_fwd"] == data["varlen_bwd"] == {"served": 0, "fallback": {}}


def test_demo_loss_falls_and_is_deterministic_on_cpu():
    from cudnn_sdpa_provider.tools.demo import run_demo

    state = torch.random.get_rng_state()
    first, second = (run_demo(device="cpu")["losses"] for _ in range(2))
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG state is left alone"
    assert len(first) == 5 and first == second, (first, second)
    assert first[-1] < first[0] - 1.0, f"the default 5 steps learn the corpus' byte statistics: {first}"


def test_demo_table_on_cpu(capsys):
    assert cli.main(["demo", "--steps", "1", "--device", "cpu"]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "demo: TinyGQA, 1 steps on cpu"
    assert lines[1].startswith("losses: ") and math.isfinite(float(lines[1].split()[1]))
    assert lines[2].split() == ["path", "served", "fallback", "fallback", "reasons"]
    assert lines[3].split() == ["dense_fwd", "0", "2", "no_cuda=2"]
    assert lines[4].split() == ["dense_bwd", "0", "2", "no_cuda=2"]


def test_demo_cuda_without_cuda_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert cli.main(["demo", "--device", "cuda"]) == cli.EXIT_USAGE
    assert "--device cuda but CUDA is not available" in capsys.readouterr().err


def test_demo_strict_json_prints_the_json_with_the_refusal(capsys):
    if torch.cuda.is_available():
        pytest.skip("on CUDA the demo is served")
    assert cli.main(["demo", "--strict", "--json", "--device", "cpu", "--steps", "2"]) == cli.EXIT_REFUSED
    out, err = capsys.readouterr()
    data = json.loads(out)  # was empty: stdout is JSON whatever happens
    assert set(data) == {"device", "losses", "refused"} | set(PATHS)
    assert data["device"] == "cpu" and data["losses"] == []
    assert data["refused"]["path"] == "dense_fwd" and data["refused"]["reasons"] == ["no_cuda"]
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 1}}
    refusal = f"cudnn-sdpa demo: refused: {data['refused']['message']}"
    assert [line for line in err.splitlines() if line.strip()] == [refusal]


def test_demo_prints_progress_on_stderr_every_ten_steps(capsys, monkeypatch):
    from cudnn_sdpa_provider.tools import demo

    real = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda **kw: real(**{**kw, "seq": 16, "batch": 1}))  # fast: 40 tiny steps
    assert cli.main(["demo", "--steps", "40", "--device", "cpu", "--json"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert len(json.loads(out)["losses"]) == 40, "stdout is the JSON alone"
    progress = [line for line in err.splitlines() if line.startswith("cudnn-sdpa demo: step ")]
    assert [line.split(",")[0] for line in progress] == [f"cudnn-sdpa demo: step {n}/40" for n in (10, 20, 30, 40)]


def test_demo_strict_on_cpu_is_one_refusal_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("on CUDA the demo is served")
    assert cli.main(["demo", "--strict", "--device", "cpu", "--steps", "1"]) == cli.EXIT_REFUSED
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    first, *rest = err.splitlines()
    assert first.startswith("cudnn-sdpa demo: refused: cudnn-sdpa-provider (strict): dense_fwd would fall back; "
                            "reasons: no_cuda"), err
    assert rest[0].split() == ["path", "served", "fallback", "fallback", "reasons"], "then the report table"


def test_demo_zero_steps_is_a_usage_error(capsys):
    assert cli.main(["demo", "--steps", "0", "--device", "cpu"]) == cli.EXIT_USAGE


# --------------------------------------------------------------------------------------- doctor


def doctor_json(capsys) -> list[dict]:
    assert cli.main(["doctor", "--json", "--no-self-test"]) == cli.EXIT_OK
    return json.loads(capsys.readouterr().out)


def test_doctor_json_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    rows = doctor_json(capsys)
    for row in rows:
        assert set(row) == {"section", "label", "ok", "value"}
        assert row["ok"] in (True, False, None) and isinstance(row["value"], str)
    by_label = {(r["section"], r["label"]): r for r in rows}
    assert by_label[("versions", "cudnn-sdpa-provider")]["value"] == csp.__version__
    assert by_label[("versions", "torch")]["value"] == torch.__version__
    assert by_label[("device", "GPU")] == {"section": "device", "label": "GPU", "ok": False, "value": "none"}
    assert by_label[("features", "all")] == {"section": "features", "label": "all", "ok": False,
                                             "value": "no: no_cuda (no CUDA device)"}
    from importlib.metadata import version

    assert by_label[("versions", "nvidia-cudnn-frontend")] == {
        "section": "versions", "label": "nvidia-cudnn-frontend", "ok": True, "value": version("nvidia-cudnn-frontend")}
    assert [r for r in rows if r["section"] == "self-test"] == [
        {"section": "self-test", "label": "GPU self-test", "ok": None, "value": "skipped: --no-self-test"}]
    assert [r["section"] for r in rows].count("coexistence") >= 1, "a coexistence row even when nothing is found"


def test_doctor_self_test_without_cuda_says_skipped(capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    assert cli.main(["doctor", "--json"]) == cli.EXIT_OK
    rows = json.loads(capsys.readouterr().out)
    assert [r for r in rows if r["section"] == "self-test"] == [
        {"section": "self-test", "label": "GPU self-test", "ok": None, "value": "skipped: no CUDA device"}]


def test_doctor_coexistence_row_when_nothing_is_found(capsys, monkeypatch):
    from cudnn_sdpa_provider.hooks import activation

    monkeypatch.setattr(activation, "coexistence", lambda: [])
    rows = doctor_json(capsys)
    assert [r for r in rows if r["section"] == "coexistence"] == [
        {"section": "coexistence", "label": "problems", "ok": True, "value": "none found"}]


def test_doctor_says_when_the_startup_hook_is_missing(capsys, monkeypatch):
    from cudnn_sdpa_provider.tools import doctor

    monkeypatch.setattr(doctor, "startup_hook_path", lambda: None)
    (row,) = [r for r in doctor_json(capsys) if r["section"] == "startup"]
    assert row["ok"] is False and "CUDNN_SDPA_PROVIDER does nothing here" in row["value"], row


def test_doctor_reports_disabled_cudnn_sdp(capsys):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        rows = doctor_json(capsys)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    (row,) = [r for r in rows if r["section"] == "coexistence" and r["label"] == "cudnn_sdp_disabled"]
    assert row["ok"] is False and "enable_cudnn_sdp(False)" in row["value"]


def test_doctor_table(capsys):
    assert cli.main(["doctor", "--no-self-test"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "\n[versions]\n" in out and "\n[device]\n" in out and "\n[features]\n" in out
    if not torch.cuda.is_available():
        assert "NO  all" in out and "no: no_cuda (no CUDA device)" in out


@pytest.mark.parametrize("command", ["run", "demo"])
def test_run_and_demo_warn_about_invalid_variables_on_cpu(tmp_path, capsys, monkeypatch, command):
    from cudnn_sdpa_provider.core import env

    monkeypatch.setenv(env.AUTOTUNE, "maybe")
    monkeypatch.setenv(env.DETERMINISTIC_WORKSPACE_MB, "-1")
    monkeypatch.setattr(env, "_warned", set())
    argv = ["run", write_script(tmp_path, "print(1)\n")] if command == "run" else ["demo", "--steps", "1",
                                                                                   "--device", "cpu"]
    with pytest.warns(RuntimeWarning) as caught:
        assert cli.main(argv) == cli.EXIT_OK
    texts = sorted(str(w.message).split("=")[0] for w in caught)
    assert texts == [env.AUTOTUNE, env.DETERMINISTIC_WORKSPACE_MB], texts
