"""cudnn-sdpa-provider: PyTorch attention on cuDNN's Python graph API, with an audit of what ran.

    import cudnn_sdpa_provider as csp
    with csp.enable():             # process-wide while active; nestable
        loss = model(batch).loss
        loss.backward()
    print(csp.report())            # path x served / fallback reasons

Importing the package registers nothing with the dispatcher and reads no environment variable;
the heavy modules load on first use.
"""

from __future__ import annotations

from importlib import import_module

from .errors import FallbackError, NotSupportedError
from .reasons import PATHS, Reason

__version__ = "0.1.0"

__all__ = [
    "enable",
    "disable",
    "enabled",
    "stats",
    "reset_stats",
    "report",
    "explain",
    "attention",
    "Stats",
    "FallbackError",
    "NotSupportedError",
    "Reason",
    "PATHS",
    "__version__",
]

_LAZY = {
    "enable": ("activation", "enable"),
    "disable": ("activation", "disable"),
    "enabled": ("activation", "enabled"),
    "stats": ("counters", "stats"),
    "reset_stats": ("counters", "reset_stats"),
    "Stats": ("counters", "Stats"),
    "report": ("diagnostics", "report"),
    "explain": ("diagnostics", "explain"),
    "attention": ("functional", "attention"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'cudnn_sdpa_provider' has no attribute {name!r}")
    value = getattr(import_module(f".{target[0]}", __name__), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
