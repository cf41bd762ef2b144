"""CPU tier: environment variables (env.py is their only reader)."""

from __future__ import annotations

import pytest

from cudnn_sdpa_provider.core import env

ACTIVATION_VALID = ["1", "on", "true", "yes", "strict", "0", "off", "false", "no", "", " On ", "STRICT", "TRUE"]


@pytest.mark.parametrize(
    "raw, value",
    [(None, "off"), ("", "off"), ("0", "off"), ("off", "off"), ("false", "off"), ("no", "off"), ("  ", "off"),
     ("1", "on"), ("on", "on"), ("true", "on"), ("yes", "on"), (" YES ", "on"), ("strict", "strict"),
     ("Strict", "strict")],
)
def test_parse_activation_valid(raw, value):
    assert env.parse_activation(raw) == (value, None)


@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "strict=1", "-1", "01"])
def test_parse_activation_invalid_names_valid_values(raw):
    value, warning = env.parse_activation(raw)
    assert value == "off"
    assert f"CUDNN_SDPA_PROVIDER={raw!r} is not a valid value" in warning
    for valid in ("1 (enable)", "strict (enable, raise on fallback)", "0 (off)"):
        assert valid in warning


@pytest.mark.parametrize("raw, value", [(None, None), ("", None), ("warning", "warning"), ("INFO", "info"),
                                        (" debug ", "debug")])
def test_parse_log_level_valid(raw, value):
    assert env.parse_log_level(raw) == (value, None)


@pytest.mark.parametrize("raw", ["verbose", "error", "10"])
def test_parse_log_level_invalid(raw):
    value, warning = env.parse_log_level(raw)
    assert value is None
    assert warning == f"CUDNN_SDPA_PROVIDER_LOG={raw!r} is not a valid value; use one of ['warning', 'info', 'debug']."


@pytest.mark.parametrize("raw, value", [(None, 7), ("", 7), ("1", 1), ("256", 256), (" 12 ", 12)])
def test_parse_positive_int_valid(raw, value):
    assert env.parse_positive_int("X", raw, 7) == (value, None)


@pytest.mark.parametrize("raw", ["0", "-3", "abc", "1.5", "1e3"])
def test_parse_positive_int_invalid(raw):
    value, warning = env.parse_positive_int("X", raw, 7)
    assert value == 7
    assert warning == f"X={raw!r} is not a positive integer; using 7."


@pytest.fixture
def clean_env(monkeypatch):
    for name in (env.ACTIVATION, env.REPORT, env.LOG, env.CACHE_SIZE, env.DETERMINISTIC_WORKSPACE_MB, env.AUTOTUNE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(env, "_warned", set())  # warnings are once per process
    return monkeypatch


def test_defaults_without_variables(clean_env):
    assert env.activation() == "off"
    assert env.report_path() is None
    assert env.log_level() is None
    assert env.autotune() is False
    assert env.cache_size() == env.DEFAULT_CACHE_SIZE == 256
    assert env.deterministic_workspace_mb() is None


@pytest.mark.parametrize("raw, value", [(v, env.parse_activation(v).value) for v in ACTIVATION_VALID])
def test_activation_reads_environment(clean_env, raw, value):
    clean_env.setenv(env.ACTIVATION, raw)
    assert env.activation() == value


def test_activation_invalid_warns(clean_env):
    clean_env.setenv(env.ACTIVATION, "maybe")
    with pytest.warns(RuntimeWarning, match=r"CUDNN_SDPA_PROVIDER='maybe' is not a valid value; use 1 \(enable\), "
                                            r"strict \(enable, raise on fallback\) or 0 \(off\)"):
        assert env.activation() == "off"


def test_log_level_reads_and_warns(clean_env):
    clean_env.setenv(env.LOG, "Debug")
    assert env.log_level() == "debug"
    clean_env.setenv(env.LOG, "loud")
    with pytest.warns(RuntimeWarning, match=r"use one of \['warning', 'info', 'debug'\]"):
        assert env.log_level() is None


def test_cache_size_reads_and_warns(clean_env):
    clean_env.setenv(env.CACHE_SIZE, "64")
    assert env.cache_size() == 64
    clean_env.setenv(env.CACHE_SIZE, "lots")
    with pytest.warns(RuntimeWarning, match="CUDNN_SDPA_PROVIDER_CACHE_SIZE='lots' is not a positive integer; "
                                            "using 256"):
        assert env.cache_size() == 256


def test_deterministic_workspace_mb_reads_and_warns(clean_env):
    clean_env.setenv(env.DETERMINISTIC_WORKSPACE_MB, "2048")
    assert env.deterministic_workspace_mb() == 2048
    clean_env.setenv(env.DETERMINISTIC_WORKSPACE_MB, "0")
    with pytest.warns(RuntimeWarning, match="CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB='0' is not a positive "
                                            "integer; using the default \\(half of the device's free memory\\)"):
        assert env.deterministic_workspace_mb() is None


@pytest.mark.parametrize("raw, path", [("run.json", "run.json"), ("  /tmp/r.json ", "/tmp/r.json"), ("", None),
                                       ("   ", None)])
def test_report_path(clean_env, raw, path):
    clean_env.setenv(env.REPORT, raw)
    assert env.report_path() == path


def test_valid_values_do_not_warn(clean_env):
    # filterwarnings=error turns any stray warning into a failure here.
    for name, raw in ((env.ACTIVATION, "strict"), (env.LOG, "info"), (env.CACHE_SIZE, "8"),
                      (env.DETERMINISTIC_WORKSPACE_MB, "1")):
        clean_env.setenv(name, raw)
    env.activation(), env.log_level(), env.cache_size(), env.deterministic_workspace_mb()


def test_env_py_is_the_only_reader_of_os_environ():
    import pathlib

    import cudnn_sdpa_provider

    pkg = pathlib.Path(cudnn_sdpa_provider.__file__).parent
    readers = sorted(p.name for p in pkg.rglob("*.py") if "os.environ" in p.read_text() or "getenv" in p.read_text())
    assert readers == ["env.py"], "env.py is the only reader of os.environ"


INVALID = {env.ACTIVATION: "maybe", env.LOG: "loud", env.CACHE_SIZE: "lots", env.DETERMINISTIC_WORKSPACE_MB: "-1",
           env.AUTOTUNE: "maybe", env.SHAPE_BUCKETS: "sometimes", env.FP8_QUANT: "fast"}


def test_every_variable_but_the_report_path_has_an_invalid_value_that_warns():
    messages = env.invalid(INVALID)
    assert [m.split("=")[0] for m in messages] == [v for v in env.VARIABLES if v != env.REPORT]
    for message in messages:
        assert "use " in message or "is not a positive integer" in message, f"names what is valid: {message}"
    assert env.invalid({}) == [] and env.invalid({env.REPORT: "anything"}) == []


def test_warn_invalid_warns_each_message_once_per_process(clean_env):
    for name, raw in INVALID.items():
        clean_env.setenv(name, raw)
    with pytest.warns(RuntimeWarning) as caught:
        env.warn_invalid()
        env.warn_invalid()
        assert env.autotune() is False and env.cache_size() == env.DEFAULT_CACHE_SIZE
    texts = [str(w.message) for w in caught]
    assert len(texts) == len(set(texts)) == len(INVALID) - 1, texts  # the activation variable is the startup hook's to read
    assert not any(t.startswith(env.ACTIVATION + "=") for t in texts)
