"""The provider's entry in torch's attention-implementation registry (torch >= 2.11).

``torch.nn.attention.activate_flash_attention_impl("CUDNN_SDPA_PROVIDER")`` turns the provider on
exactly as ``enable()`` does (it is ``enable()``: the same activation state, the same report and
counters), and ``restore_flash_attention_impl()`` turns it off again (the registry keeps
``enable()``'s ``Activation`` as its handle and calls its ``remove()``). Activating another entry
(nvidia's "CUDNN", "FA4") restores the active one first, so one is active at a time; the entry is
the provider's own name, never "CUDNN", which nvidia's ``cudnn.torch`` registers.

Adding the entry is passive, as PyTorch asks of providers ("providers should NOT automatically
activate their implementation on import"): it stores a name and a function in the registry's dict;
nothing is registered with the dispatcher and nothing is activated until the user activates it.
``register()`` is idempotent and needs torch to be imported (it never imports torch itself when it
is not: the package's ``__init__`` calls it through ``startup.when_torch_loaded``).
"""

from __future__ import annotations

import sys

from . import REGISTRY_NAME as NAME

__all__ = ["NAME", "register", "registered"]


def _attention():
    """``torch.nn.attention`` when torch is imported and has the registry, else None."""
    if "torch" not in sys.modules:
        return None
    import torch.nn.attention as attention

    return attention if hasattr(attention, "register_flash_attention_impl") else None


def _activate():
    """What ``activate_flash_attention_impl(NAME)`` runs: ``enable()`` itself. Its ``Activation`` is
    the handle the registry keeps; ``restore_flash_attention_impl()`` calls its ``remove()``."""
    from .activation import enable

    return enable()


def registered() -> bool:
    attention = _attention()
    return attention is not None and NAME in attention.list_flash_attention_impls()


def register() -> bool:
    """Add the entry (once); False where torch is not imported or has no registry (before 2.11)."""
    attention = _attention()
    if attention is None:
        return False
    if NAME not in attention.list_flash_attention_impls():
        attention.register_flash_attention_impl(NAME, register_fn=_activate)
    return True
