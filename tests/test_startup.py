"""CPU tier: the environment-variable opt-in (``cudnn_sdpa_provider_startup.pth`` + ``hooks.startup``),
each case in a fresh interpreter running an UNMODIFIED script.

``site.addsitedir`` on a directory holding a copy of the .pth processes it exactly as site-packages
would at interpreter start; then ``runpy`` runs the script as ``__main__``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from cudnn_sdpa_provider.core.reasons import PATHS

REPO = pathlib.Path(__file__).resolve().parent.parent
PTH = REPO / "cudnn_sdpa_provider_startup.pth"
VALID_VALUES = ("1 (enable)", "strict (enable, raise on fallback)", "0 (off)")

#: A plain CPU PyTorch script; it never mentions the provider, only looks at sys.modules.
SCRIPT = textwrap.dedent(
    """
    import sys
    print("before torch:", "torch" in sys.modules, "cudnn_sdpa_provider.hooks.activation" in sys.modules)
    import torch
    import torch.nn.functional as F
    print("after torch:", "cudnn_sdpa_provider.hooks.activation" in sys.modules)
    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    for _ in range(2):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    print("package imported:", "cudnn_sdpa_provider" in sys.modules)
    print("args:", sys.argv[1:])
    """
)

NO_TORCH_SCRIPT = 'import sys\nprint("torch imported:", "torch" in sys.modules)\n'

_RUNNER = ("import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.argv = sys.argv[2:]; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_SDPA_PROVIDER") and k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run_script(tmp_path, source=SCRIPT, *, args=(), via_pth=True, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    if via_pth:
        site_dir = tmp_path / "site"
        site_dir.mkdir(exist_ok=True)
        shutil.copy(PTH, site_dir / PTH.name)
        argv = ["-c", _RUNNER, str(site_dir), str(script), *args]
    else:
        argv = [str(script), *args]
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=_env(**env), capture_output=True, text=True,
                          timeout=300)


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_pth_is_one_guarded_line():
    lines = PTH.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import "), "site runs only lines that start with 'import'"
    assert "except BaseException" in lines[0], "interpreter start must never break"
    assert 'os.environ.get("CUDNN_SDPA_PROVIDER", "").strip() not in ("", "0")' in lines[0]


def test_enabled_writes_report_with_no_cuda_fallbacks(tmp_path):
    report = tmp_path / "run.json"
    out = ok(run_script(tmp_path, args=("--flag", "x"), CUDNN_SDPA_PROVIDER="1",
                        CUDNN_SDPA_PROVIDER_REPORT=str(report)))
    assert "before torch: False False" in out, "the hook imports neither torch nor the provider's torch parts"
    assert "after torch: True" in out, "activated right after the script's own import torch"
    assert "args: ['--flag', 'x']" in out
    data = json.loads(report.read_text())
    assert set(data) == set(PATHS) | {"meta"}
    assert data["meta"]["enabled"] is True
    for key in ("provider", "python", "torch", "time", "device"):
        assert key in data["meta"]
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 2}}
    assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 2}}
    assert data["varlen_fwd"] == data["varlen_bwd"] == {"served": 0, "fallback": {}}


def test_off_imports_nothing_and_writes_nothing(tmp_path):
    report = tmp_path / "run.json"
    out = ok(run_script(tmp_path, CUDNN_SDPA_PROVIDER=" 0 ", CUDNN_SDPA_PROVIDER_REPORT=str(report)))
    assert "package imported: False" in out
    assert not report.exists()


def test_invalid_value_warns_names_valid_values_and_runs(tmp_path):
    report = tmp_path / "run.json"
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="maybe", CUDNN_SDPA_PROVIDER_REPORT=str(report))
    out = ok(result)
    assert "RuntimeWarning" in result.stderr and "CUDNN_SDPA_PROVIDER='maybe' is not a valid value" in result.stderr
    for valid in VALID_VALUES:
        assert valid in result.stderr, result.stderr
    assert "after torch: False" in out, "an invalid value leaves the provider off"
    assert not report.exists()


def test_script_without_torch_never_imports_torch(tmp_path):
    out = ok(run_script(tmp_path, NO_TORCH_SCRIPT, CUDNN_SDPA_PROVIDER="1"))
    assert "torch imported: False" in out


def test_strict_refusal_ends_the_script_in_one_line(tmp_path):
    source = SCRIPT.replace("import torch\n", "import torch\nlog = open('log.txt', 'w'); log.write('unclosed')\n", 1)
    result = run_script(tmp_path, source, CUDNN_SDPA_PROVIDER="strict")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["cudnn-sdpa-provider: refused: cudnn-sdpa-provider (strict): dense_fwd would fall back; "
                     "reasons: no_cuda (inputs are on 'cpu')"], result.stderr  # as `cudnn-sdpa run --strict` says it
    # Python's status for an uncaught exception, not run --strict's 5: changing it from the hook
    # skips the cleanup that flushes the script's unclosed files (the next test shows it)
    assert result.returncode == 1
    assert (tmp_path / "log.txt").read_text() == "unclosed", "the interpreter's cleanup ran"


def test_why_the_strict_exit_status_stays_1(tmp_path):
    """The one way to set another status from sys.excepthook, raising SystemExit there, loses the
    buffered writes of files the script left open (as os._exit would): the env route keeps 1."""
    source = ("import sys\nlog = open('log.txt', 'w'); log.write('unclosed')\n"
              "def hook(*exc):\n    raise SystemExit(5)\nsys.excepthook = hook\nraise RuntimeError('x')\n")
    result = run_script(tmp_path, source, via_pth=False)
    assert result.returncode == 5 and (tmp_path / "log.txt").read_text() == "", "if this changes, exit 5 here too"


def test_strict_keeps_the_traceback_of_other_errors(tmp_path):
    result = run_script(tmp_path, "import torch\nraise KeyError('mine')\n", CUDNN_SDPA_PROVIDER="strict")
    assert result.returncode == 1 and "Traceback" in result.stderr and "KeyError: 'mine'" in result.stderr


def test_a_script_without_torch_still_gets_its_report(tmp_path):
    report = tmp_path / "run.json"
    out = ok(run_script(tmp_path, NO_TORCH_SCRIPT, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report)))
    assert "torch imported: False" in out
    data = json.loads(report.read_text())  # was: no report, and nothing said
    assert data["meta"]["enabled"] is False, "never enabled: torch was never imported"
    assert all(data[p] == {"served": 0, "fallback": {}} for p in PATHS), data


def test_invalid_values_of_every_variable_warn_on_cpu(tmp_path):
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_AUTOTUNE="maybe",
                        CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB="-1", CUDNN_SDPA_PROVIDER_CACHE_SIZE="lots",
                        CUDNN_SDPA_PROVIDER_LOG="loud")
    ok(result)
    for text in ("CUDNN_SDPA_PROVIDER_AUTOTUNE='maybe' is not a valid value; use 1 (on) or 0 (off)",
                 "CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB='-1' is not a positive integer",
                 "CUDNN_SDPA_PROVIDER_CACHE_SIZE='lots' is not a positive integer; using 256",
                 "CUDNN_SDPA_PROVIDER_LOG='loud' is not a valid value; use one of"):
        assert result.stderr.count(text) == 1, f"{text!r} once in:\n{result.stderr}"


def test_an_invalid_variable_under_warnings_as_errors_still_enables(tmp_path):
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_AUTOTUNE="maybe",
                        PYTHONWARNINGS="error::RuntimeWarning")
    assert "after torch: True" in ok(result), "the provider started all the same"
    assert "startup hook skipped" not in result.stderr
    assert "RuntimeWarning: CUDNN_SDPA_PROVIDER_AUTOTUNE='maybe' is not a valid value" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_report_to_a_character_device_keeps_the_device(tmp_path):
    import stat

    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what CUDNN_SDPA_PROVIDER_REPORT=/dev/null replaced
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(null))
    ok(result)
    assert "report not written" not in result.stderr and stat.S_ISCHR(os.lstat(null).st_mode)


def test_log_info_logs_each_configuration_once(tmp_path):
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_LOG="info")
    ok(result)
    lines = [line for line in result.stderr.splitlines() if line.startswith("cudnn_sdpa_provider INFO: ")]
    # two identical calls: the configuration's fallback is logged once, never per call
    assert any("dense_fwd falls back (no_cuda)" in line for line in lines), result.stderr
    assert len(lines) == len(set(lines)), result.stderr


#: Import orders a user's script may have: (first lines, the activations live after them). Each then
#: imports torch (again) and makes two attention calls. "once per intent": the variable's activation,
#: plus the script's own ``csp.enable()`` where it has one.
ORDERS = {
    "torch_first": ("import torch\n", 1),
    "package_first_enable_before_torch": ("import cudnn_sdpa_provider as csp\ncsp.enable()\n", 2),
    "package_first_then_torch": ("import cudnn_sdpa_provider as csp\nimport torch\n", 1),
    "functional_api_before_torch": ("from cudnn_sdpa_provider import attention\n", 1),
    "demo_module_before_torch": ("import cudnn_sdpa_provider.tools.demo\n", 1),
    "report_before_torch": ("import cudnn_sdpa_provider as csp\nprint(csp.report().splitlines()[0])\n", 1),
}

ORDER_TAIL = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    from cudnn_sdpa_provider.hooks import startup as _startup
    from cudnn_sdpa_provider.core import scope
    q = torch.randn(2, 2, 16, 8, requires_grad=True)
    for _ in range(2):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    print("live activations:", len(scope.live()))
    print("hook left:", [type(f).__name__ for f in sys.meta_path if type(f).__module__ == _startup.__name__])
    print("torch loader:", type(torch.__spec__.loader).__module__ == _startup.__name__,
          type(torch.__loader__).__module__ == _startup.__name__)
    """
)


def _no_cuda_report(path) -> dict:
    data = json.loads(path.read_text())
    assert data["meta"]["enabled"] is True
    assert data["dense_fwd"] == {"served": 0, "fallback": {"no_cuda": 2}}, data
    assert data["dense_bwd"] == {"served": 0, "fallback": {"no_cuda": 2}}, data
    return data


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_every_import_order_enables_once_and_writes_the_report(tmp_path, order):
    prelude, live = ORDERS[order]
    report = tmp_path / "run.json"
    result = run_script(tmp_path, prelude + ORDER_TAIL, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report))
    out = ok(result)
    assert "not enabled" not in result.stderr and "skipped" not in result.stderr, result.stderr
    assert f"live activations: {live}" in out, out
    assert "hook left: []" in out, "the import hook removes itself once it has enabled"
    assert "torch loader: False False" in out, "torch keeps its own loader"
    _no_cuda_report(report)


def test_cli_run_under_the_variable_enables_for_each_and_writes_both_reports(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(ORDER_TAIL)
    env_report, run_report = tmp_path / "env.json", tmp_path / "run.json"
    runner = ("import site, sys; site.addsitedir(sys.argv[1]); sys.argv = ['cudnn-sdpa'] + sys.argv[2:]; "
              "from cudnn_sdpa_provider.tools.cli import entry; entry()")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(PTH, site_dir / PTH.name)
    result = subprocess.run([sys.executable, "-c", runner, str(site_dir), "run", "--report", str(run_report),
                             str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=_env(CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(env_report)))
    out = ok(result)
    assert "not enabled" not in result.stderr, result.stderr
    assert "live activations: 2" in out, "the variable's activation and the run's"
    _no_cuda_report(env_report)
    _no_cuda_report(run_report)


@pytest.mark.parametrize("kind", ["directory", "missing_dir", "under_a_file", "read_only"])
def test_unwritable_report_path_warns_at_start_and_at_exit_and_leaves_nothing(tmp_path, kind):
    target = {"directory": tmp_path, "missing_dir": tmp_path / "nope" / "run.json",
              "under_a_file": tmp_path / "script.py" / "run.json", "read_only": tmp_path / "kept.json"}[kind]
    if kind == "read_only":
        target.write_text("kept\n")
        target.chmod(0o444)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_script(tmp_path, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(target))
    ok(result)
    early, warnings, *rest = [line for line in result.stderr.splitlines() if line.strip()]
    assert not rest, result.stderr
    assert early.startswith(f"cudnn-sdpa-provider: warning: CUDNN_SDPA_PROVIDER_REPORT={str(target)!r}: cannot "
                            "write there now: ") and early.endswith(" (tried again at exit)"), result.stderr
    assert warnings.startswith(f"cudnn-sdpa-provider: warning: report not written to {str(target)!r}: "), result.stderr
    assert "Traceback" not in result.stderr
    after = sorted(p.name for p in tmp_path.iterdir())
    assert after == sorted(set(before) | {"script.py", "site"}), "no temporary file left behind"


def test_a_report_folder_the_script_creates_gets_the_report(tmp_path):
    source = "import os\nos.makedirs('out')\n" + SCRIPT
    result = run_script(tmp_path, source, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT="out/run.json")
    ok(result)
    assert "cannot write there now" in result.stderr and "report not written" not in result.stderr
    assert json.loads((tmp_path / "out" / "run.json").read_text())["dense_fwd"]["fallback"] == {"no_cuda": 2}


def _installed_pth() -> pathlib.Path | None:
    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages(), site.getusersitepackages()}
    for d in dirs:
        candidate = pathlib.Path(d) / PTH.name
        if candidate.exists():
            return candidate
    return None


@pytest.mark.skipif(_installed_pth() is None, reason="the package is not pip-installed (no .pth in site-packages)")
def test_installed_pth_plain_python_run(tmp_path):
    assert _installed_pth().read_text() == PTH.read_text(), "the installed hook is the shipped one"
    report = tmp_path / "run.json"
    out = ok(run_script(tmp_path, via_pth=False, CUDNN_SDPA_PROVIDER="1", CUDNN_SDPA_PROVIDER_REPORT=str(report)))
    assert "after torch: True" in out
    data = json.loads(report.read_text())
    assert data["dense_fwd"]["fallback"] == {"no_cuda": 2} and data["dense_bwd"]["fallback"] == {"no_cuda": 2}
    out = ok(run_script(tmp_path, via_pth=False, CUDNN_SDPA_PROVIDER="0"))
    assert "package imported: False" in out


def test_run_is_idempotent_in_process(monkeypatch):
    from cudnn_sdpa_provider.hooks import startup as _startup

    monkeypatch.setattr(_startup, "_done", True)
    monkeypatch.setenv("CUDNN_SDPA_PROVIDER", "maybe")
    _startup.run()  # already ran: no warning (filterwarnings=error), no activation
    import cudnn_sdpa_provider as csp

    assert not csp.enabled()
