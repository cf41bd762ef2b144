"""The environment-variable opt-in, run from ``cudnn_sdpa_provider_startup.pth``.

The .pth line imports this module only when ``CUDNN_SDPA_PROVIDER`` is set to something other
than 0, and wraps it in try/except so interpreter start can never break. ``run()`` does not import
torch: it installs a one-shot import hook that enables the provider right after the script's own
``import torch`` finishes, so a script that never uses torch pays nothing and ``import torch``
itself runs unchanged. Calling ``run()`` twice is harmless.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import logging
import sys

__all__ = ["run", "activate"]

_done = False


def activate(mode: str) -> None:
    """Enable the provider now (torch is importable) and arrange the exit report."""
    from . import env
    from .activation import enable

    level = env.log_level()
    if level is not None:
        logger = logging.getLogger("cudnn_sdpa_provider")
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            logger.addHandler(handler)
    enable(strict=(mode == "strict"))
    path = env.report_path()
    if path:
        from .telemetry import write_report

        atexit.register(write_report, path)


class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself; wraps the real loader of ``torch`` to activate after it executes."""

    def __init__(self, mode: str):
        self.mode = mode
        self.loader = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return None
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            activate(self.mode)
        except Exception as exc:  # never break the user's import torch
            print(f"cudnn-sdpa-provider: not enabled: {exc!r}", file=sys.stderr)


def run() -> None:
    global _done
    if _done:
        return
    _done = True
    from . import env

    mode = env.activation()  # warns, naming the valid values, on anything it does not know
    if mode == "off":
        return
    if "torch" in sys.modules:
        activate(mode)
    else:
        sys.meta_path.insert(0, _AfterTorch(mode))
