"""The rows of ``cudnn-sdpa doctor``: versions, device, startup hook, features, the known-bad cuDNN
configurations that apply here, coexistence, self-test.

Data only (``diagnostics.DoctorRow`` tuples); ``cli`` prints them. Every check that does not run
still has a row, ``skipped: <why>``, so a missing line never has to be interpreted.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import site
import sys
import sysconfig

__all__ = ["doctor_rows", "fp8_quantisation", "package_version", "versions_line", "startup_hook_path", "PTH_NAME"]

PTH_NAME = "cudnn_sdpa_provider_startup.pth"
FRONTEND = "nvidia-cudnn-frontend"


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` from its metadata (imports nothing), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions_line() -> str:
    """``cudnn-sdpa --version``: read from package metadata, so torch is not imported."""
    from .. import __version__

    torch = package_version("torch") or "not installed"
    frontend = package_version(FRONTEND) or "not installed"
    return (f"cudnn-sdpa-provider {__version__} (torch {torch}, {FRONTEND} {frontend}, "
            f"Python {platform.python_version()})")


def startup_hook_path() -> str | None:
    """Where the startup hook is installed (a site directory that ``site`` reads), or None."""
    dirs = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    for d in dict.fromkeys(dirs):
        candidate = os.path.join(d, PTH_NAME)
        if os.path.isfile(candidate):
            return candidate
    return None


def _versions(caps) -> list:
    import torch

    from .. import __version__
    from ..core import support
    from ..diagnostics import DoctorRow as Row

    frontend = caps.frontend_version or package_version(FRONTEND)
    rows = [
        Row("versions", "cudnn-sdpa-provider", None, __version__),
        Row("versions", "python", None, platform.python_version()),
        Row("versions", "torch", None, torch.__version__),
        Row("versions", "CUDA (torch build)", None, str(torch.version.cuda)),
        Row("versions", "cuDNN (torch)", None, str(torch.backends.cudnn.version())),
        Row("versions", FRONTEND, frontend is not None, frontend or "not installed"),
        Row("versions", "cuDNN backend (frontend)", caps.cudnn_version is not None if caps.cuda else None,
            support.version_str(caps.cudnn_version) if caps.cuda else "skipped: no CUDA device"),
    ]
    gpu = f"{caps.device_name} (sm_{caps.compute_capability[0]}{caps.compute_capability[1]})" if caps.cuda else "none"
    rows.append(Row("device", "GPU", caps.cuda, gpu))
    if caps.unavailable and caps.cuda:
        rows.append(Row("device", "cuDNN usable", False, caps.unavailable))
    return rows


def _startup_hook() -> list:
    from ..diagnostics import DoctorRow as Row

    path = startup_hook_path()
    if path:
        return [Row("startup", "hook (CUDNN_SDPA_PROVIDER)", True, path)]
    return [Row("startup", "hook (CUDNN_SDPA_PROVIDER)", False,
                f"not installed in {sys.prefix}: CUDNN_SDPA_PROVIDER does nothing here; "
                "pip install the package (`pip install .` or `pip install -e .`), or use `cudnn-sdpa run`")]


def _coexistence() -> list:
    from ..hooks.activation import coexistence
    from ..diagnostics import DoctorRow as Row

    try:
        found = coexistence()
    except Exception as exc:  # the doctor reports, it does not crash
        return [Row("coexistence", "check", None, f"skipped: {type(exc).__name__}: {exc}")]
    if not found:
        return [Row("coexistence", "problems", True, "none found")]
    return [Row("coexistence", slug, False, message) for slug, message in found]


def _self_test(caps, run_self_test: bool) -> list:
    from ..diagnostics import DoctorRow as Row, self_test

    why = ("--no-self-test" if not run_self_test else "no CUDA device" if not caps.cuda
           else f"cuDNN not usable: {caps.unavailable}" if caps.unavailable else None)
    if why:
        return [Row("self-test", "GPU self-test", None, f"skipped: {why}")]
    try:
        return self_test()
    except Exception as exc:  # the doctor reports, it does not crash
        return [Row("self-test", "run", False, f"{type(exc).__name__}: {exc}")]


def _buckets(caps) -> str:
    """The shape-bucket mode, and in the default mode whether it folds on this machine."""
    from ..core import env
    from ..engine import folded

    mode = env.shape_buckets()
    if mode != "auto":
        return f"{mode} ({env.SHAPE_BUCKETS})"
    if caps.cuda and folded.verified_on(caps.compute_capability, caps.cudnn_version):
        return f"auto ({env.SHAPE_BUCKETS}; folding on: verified on this GPU and cuDNN)"
    return f"auto ({env.SHAPE_BUCKETS}; folding off here: not verified on this GPU and cuDNN, =1 forces it)"


def _graph_rows(caps) -> list:
    """The graph cache's settings and this process's builds (the self-test's, in a fresh process)."""
    from ..core import counters, env
    from ..diagnostics import DoctorRow as Row

    b = counters.stats().builds
    return [Row("graphs", "cache", None, f"{env.cache_size()} graphs per thread (LRU), shape buckets: "
                                           f"{_buckets(caps)}"),
            Row("graphs", "built", None, f"{b['built']} cuDNN graphs in this process ({b['build_ms']:.0f} ms), "
                                           f"{b['rejected']} rejected by cuDNN")]


def fp8_quantisation(caps) -> str:
    """Which code quantises ``csp.fp8.attention``'s inputs here (``ops.fp8_quant.choose``), and why."""
    from ..core import env
    from ..ops import fp8_quant

    impl = env.fp8_quant()
    if not caps.cuda:
        return f"{impl} ({env.FP8_QUANT}): aten ops (no CUDA device)"
    if impl == "torch":
        return f"torch ({env.FP8_QUANT}): aten ops"
    if not fp8_quant.triton_available():
        return f"{impl} ({env.FP8_QUANT}): aten ops (triton does not import here)"
    if impl != "auto":
        return f"{impl} ({env.FP8_QUANT}): forced" + (" (q, k, v together)" if impl == "triton" else "")
    if fp8_quant.triton_failure():
        return f"auto ({env.FP8_QUANT}): aten ops (the Triton kernels failed here: {fp8_quant.triton_failure()[:120]})"
    cc = tuple(caps.compute_capability or ())
    if cc in fp8_quant.VERIFIED:
        if cc in fp8_quant.GROUPED_VERIFIED:
            return f"auto ({env.FP8_QUANT}): Triton kernels, q, k, v together (verified on this GPU)"
        return (f"auto ({env.FP8_QUANT}): Triton kernels, one tensor at a time (verified on this GPU; the kernels "
                f"for q, k, v together are not yet: =triton forces them)")
    return f"auto ({env.FP8_QUANT}): aten ops (the Triton kernels are not verified on this GPU; =triton forces them)"


def _fp8_rows(caps) -> list:
    from ..diagnostics import DoctorRow as Row

    return [Row("fp8", "quantisation", None, fp8_quantisation(caps))]


def doctor_rows(run_self_test: bool = True) -> list:
    """Every row of the doctor, in display order (``diagnostics.DoctorRow``)."""
    from ..engine import machine
    from ..diagnostics import DoctorRow, feature_rows, known_issue_rows

    caps = machine.capabilities()
    rows = _versions(caps) + _startup_hook()
    rows += feature_rows(caps) if caps.cuda else [DoctorRow("features", "all", False, "no: no_cuda (no CUDA device)")]
    rows += known_issue_rows(caps)
    rows += _coexistence()
    rows += _self_test(caps, run_self_test)
    rows += _graph_rows(caps)
    rows += _fp8_rows(caps)
    return rows
