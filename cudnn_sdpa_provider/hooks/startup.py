"""The environment-variable opt-in, run from ``cudnn_sdpa_provider_startup.pth``.

The .pth line imports this module only when ``CUDNN_SDPA_PROVIDER`` is set to something other
than 0, and wraps it in try/except so interpreter start can never break. ``run()`` does not import
torch: it records the requested mode and installs an import hook, and the provider is enabled at
the first moment when torch is fully imported and no module of this package is half-imported.

Why the second condition: ``cudnn_sdpa_provider.hooks.activation`` (and most other modules here)
import torch at their top. When the package is imported before torch (``csp.enable()`` at the
top of a script, ``cudnn-sdpa run``), the script's first ``import torch`` happens inside one of
those imports, and enabling then would import a module that is still executing ("cannot import
name ... partially initialized module"). So the hook wraps the loaders of torch and of this
package's submodules, counts the imports in progress on each thread, and enables when the
count returns to zero with torch loaded. A script that never imports torch pays nothing (with
``CUDNN_SDPA_PROVIDER_REPORT`` it still gets a report at exit: all zero, written without importing
torch); a failure to enable prints one line and never breaks the import that triggered it.
Calling ``run()`` twice is harmless.

``when_torch_loaded(callback)`` uses the same moment for other passive work: the package's
``__init__`` adds the provider's entry to torch's attention-implementation registry with it
(``registry``), at once when torch is already imported, else from this hook once it is.

In strict mode, a ``FallbackError`` that ends the program is one line on stderr, as with
``cudnn-sdpa run --strict``, but the exit status stays Python's 1 for an uncaught exception: the
only way to change it from an excepthook (raising ``SystemExit`` there, or ``os._exit`` later)
exits before the interpreter's cleanup flushes the script's unclosed files (tests/test_startup.py
shows both). ``cudnn-sdpa run --strict`` catches the error itself and exits 5.
"""

from __future__ import annotations

import atexit
import importlib.abc
import logging
import sys
import threading

__all__ = ["run", "activate", "pending", "when_torch_loaded"]

_PACKAGE = __name__.partition(".")[0]  # the top package, cudnn_sdpa_provider

_done = False
_pending: str | None = None  # the mode waiting for torch ("on" / "strict"), None once handled
_activated = False  # activate() ran: it arranged the report at exit
_callbacks: list = []  # when_torch_loaded's callbacks waiting for torch
_lock = threading.Lock()
_local = threading.local()  # .depth: imports of torch / this package in progress on this thread


def pending() -> str | None:
    """The mode the hook will enable once torch is imported, or None."""
    return _pending


def activate(mode: str) -> None:
    """Enable the provider now (torch is imported) and arrange the exit report."""
    from ..core import env
    from .activation import enable

    level = env.log_level()
    if level is not None:
        logger = logging.getLogger(_PACKAGE)
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            logger.addHandler(handler)
    global _activated
    enable(strict=(mode == "strict"), process_wide=True)  # the whole program, every thread
    _activated = True
    path = env.report_path()
    if path:
        atexit.register(_report_at_exit, path)


def _report_if_never_enabled(path: str) -> None:
    """Registered by ``run()``: the report of a program that never imported torch (all zero)."""
    if not _activated:
        _report_at_exit(path)


def _check_report_path(path: str) -> None:
    """Say now, not only after the script's work, when the report path cannot be written; it is
    tried again at exit all the same (the script may create the folder)."""
    from ..core import env
    from .telemetry import report_path_problem

    problem = report_path_problem(path)
    if problem:
        print(f"cudnn-sdpa-provider: warning: {env.REPORT}={path!r}: cannot write there now: {problem} "
              "(tried again at exit)", file=sys.stderr)


def _strict_excepthook(previous):
    """``sys.excepthook`` in strict mode: an uncaught ``FallbackError`` is one line, not a traceback
    (interactive sessions keep the traceback); anything else goes to the previous hook."""

    def hook(exc_type, exc, tb):
        from ..core.errors import FallbackError

        if issubclass(exc_type, FallbackError) and not (sys.flags.interactive or hasattr(sys, "ps1")):
            print(f"cudnn-sdpa-provider: refused: {exc.one_line()}", file=sys.stderr)
            return None
        return previous(exc_type, exc, tb)

    return hook


def _report_at_exit(path: str) -> None:
    """Write the report; a path that cannot be written is one line on stderr, never a traceback."""
    from .telemetry import write_report

    try:
        write_report(path)
    except Exception as exc:  # noqa: BLE001  (at exit: say it, do not raise)
        print(f"cudnn-sdpa-provider: warning: report not written to {path!r}: {_why(exc)}", file=sys.stderr)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _finish() -> None:
    """Run the waiting callbacks and enable the pending mode, once (whichever thread gets here first)."""
    global _pending
    with _lock:
        mode, _pending = _pending, None
        callbacks = list(_callbacks)
        _callbacks.clear()
        for finder in [f for f in sys.meta_path if isinstance(f, _Hook)]:
            sys.meta_path.remove(finder)
    for callback in callbacks:
        _call(callback)
    if mode is not None:
        try:
            activate(mode)
        except Exception as exc:  # never break the user's import
            print(f"cudnn-sdpa-provider: not enabled: {exc!r}", file=sys.stderr)


def _call(callback) -> None:
    try:
        callback()
    except Exception as exc:  # never break the user's import
        print(f"cudnn-sdpa-provider: {getattr(callback, '__name__', callback)} failed: {exc!r}", file=sys.stderr)


def when_torch_loaded(callback) -> None:
    """Run ``callback()`` once torch is fully imported and no module of this package is half-imported:
    now when that is already so, else from the import hook (installed here when needed). Never
    imports torch; a callback that raises prints one line and breaks nothing."""
    with _lock:
        now = _torch_loaded() and getattr(_local, "depth", 0) == 0
        if not now:
            _callbacks.append(callback)
            if not any(isinstance(f, _Hook) for f in sys.meta_path):
                sys.meta_path.insert(0, _Hook())
    if now:
        _call(callback)


def _torch_loaded() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is not None and not getattr(spec, "_initializing", False)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then puts it back on the module and checks whether to enable."""

    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            self.real.exec_module(module)
        finally:
            _local.depth -= 1
            module.__loader__ = self.real
            if module.__spec__ is not None:
                module.__spec__.loader = self.real
        # torch's own spec is still "initializing" here: it is loaded once its exec returned
        waiting = _pending is not None or _callbacks
        if _local.depth == 0 and waiting and (module.__name__ == "torch" or _torch_loaded()):
            _finish()

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source ... of the real loader
        return getattr(self.real, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loaders that the other finders return for the watched names."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" and not fullname.startswith(_PACKAGE + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def run() -> None:
    global _done, _pending
    if _done:
        return
    _done = True
    from ..core import env

    mode = env.activation()  # warns, naming the valid values, on anything it does not know
    if mode == "off":
        return
    try:
        env.warn_invalid()  # the other variables too, now, not when (or if) a GPU path reads them
    except Warning as exc:  # -W error: still one line, and the provider still starts
        print(f"cudnn-sdpa-provider: {type(exc).__name__}: {exc}", file=sys.stderr)
    _pending = mode
    if mode == "strict":
        sys.excepthook = _strict_excepthook(sys.excepthook)
    path = env.report_path()
    if path:
        _check_report_path(path)
        atexit.register(_report_if_never_enabled, path)
    if _torch_loaded() and getattr(_local, "depth", 0) == 0:
        _finish()
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
