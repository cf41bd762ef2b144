"""cudnn-sdpa-provider: PyTorch attention on cuDNN's Python graph API, with an audit of what ran.

    import cudnn_sdpa_provider as csp
    with csp.enable():             # process-wide while active; nestable
        loss = model(batch).loss
        loss.backward()
    print(csp.report())            # path x served / fallback reasons

Importing the package registers nothing with the dispatcher, reads no environment variable and
imports neither torch nor any model library; the heavy modules load on first use, and so do
``csp.integrations`` and its submodules (``csp.integrations.transformers``). Its one passive step:
the provider's entry "CUDNN_SDPA_PROVIDER" in torch's attention-implementation registry is added
once torch is imported (at once if it already is), so ``activate_flash_attention_impl`` finds it
in either import order (``hooks.registry``); nothing is activated.
"""

from __future__ import annotations

from importlib import import_module

from .core.errors import FallbackError, NotSupportedError
from .core.reasons import PATHS, Reason

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
    "fp8",
    "Stats",
    "FallbackError",
    "NotSupportedError",
    "Reason",
    "PATHS",
    "__version__",
]

_LAZY = {
    "enable": ("hooks.activation", "enable"),
    "disable": ("hooks.activation", "disable"),
    "enabled": ("hooks.activation", "enabled"),
    "stats": ("core.counters", "stats"),
    "reset_stats": ("core.counters", "reset_stats"),
    "Stats": ("core.counters", "Stats"),
    "report": ("diagnostics", "report"),
    "explain": ("diagnostics", "explain"),
    "attention": ("functional", "attention"),
}


#: Submodules of ``integrations`` reachable as attributes once ``csp.integrations`` is used. Each
#: imports torch but not its model library (that happens when the integration is used).
_INTEGRATIONS = ("transformers",)


def _register_entry() -> None:
    from .hooks import registry

    registry.register()


def _integrations():
    package = import_module(".integrations", __name__)
    for name in _INTEGRATIONS:
        import_module(f".integrations.{name}", __name__)
    return package


def __getattr__(name: str):
    if name == "fp8":  # FP8 attention (``csp.fp8.attention``, ``csp.fp8.Recipe``): a submodule
        value = globals()[name] = import_module(".fp8", __name__)
        return value
    if name == "integrations":
        value = _integrations()
        globals()[name] = value
        return value
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'cudnn_sdpa_provider' has no attribute {name!r}")
    value = getattr(import_module(f".{target[0]}", __name__), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _when_torch_loaded() -> None:
    from .hooks.startup import when_torch_loaded

    when_torch_loaded(_register_entry)


_when_torch_loaded()
