"""CPU tier: the provider's entry in torch's attention-implementation registry (issue #27 item 5).

``activate_flash_attention_impl("CUDNN_SDPA_PROVIDER")`` is ``enable()`` (same state, same counters),
``restore_flash_attention_impl()`` undoes it; the entry is listed whichever of torch and the package
is imported first, and importing registers nothing with the dispatcher and activates nothing; one
entry is active at a time (beside nvidia's "CUDNN"); the doctor does not warn about our own entry.
Import orders run in fresh interpreters.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.nn import attention

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters, scope
from cudnn_sdpa_provider.hooks import activation, registry

REPO = pathlib.Path(__file__).resolve().parent.parent
NAME = "CUDNN_SDPA_PROVIDER"

pytestmark = pytest.mark.skipif(not hasattr(attention, "register_flash_attention_impl"),
                                reason="torch's attention-implementation registry is torch 2.11+")

CHECK = textwrap.dedent("""
    import sys
    import torch
    from torch.nn import attention
    from cudnn_sdpa_provider.core import scope
    from cudnn_sdpa_provider.hooks import activation
    print("listed", "CUDNN_SDPA_PROVIDER" in attention.list_flash_attention_impls())
    print("active", attention.current_flash_attention_impl(), scope.enabled(), activation._hooks)
    print("hook left", [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_Hook"])
""")

ORDERS = {
    "torch_first": "import torch\nimport cudnn_sdpa_provider\n",
    "package_first": "import cudnn_sdpa_provider\nimport torch\n",
    "package_first_then_a_torch_submodule": "import cudnn_sdpa_provider\nimport torch.nn.attention\n",
    "package_submodule_first": "from cudnn_sdpa_provider.core import reasons\nimport torch\n",
    "package_api_before_torch": "import cudnn_sdpa_provider as csp\nprint(csp.report().splitlines()[0])\n",
}


def _python(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_SDPA_PROVIDER")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")]))
    environ.update(env)
    result = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_the_entry_is_listed_in_either_import_order_and_nothing_is_activated(order):
    out = _python(ORDERS[order] + CHECK)
    assert "listed True" in out, out
    assert "active None False None" in out, "passive: no activation, no dispatcher registration"
    assert "hook left []" in out, "the import hook removes itself once torch is loaded"


def test_importing_the_package_alone_imports_no_torch_and_adds_the_entry_when_torch_comes():
    out = _python("import sys, cudnn_sdpa_provider\nprint('torch' in sys.modules)\n"
                  "import torch\nprint(torch.nn.attention.list_flash_attention_impls())")
    assert out.splitlines()[0] == "False"
    assert "'CUDNN_SDPA_PROVIDER'" in out.splitlines()[1]


def test_under_the_environment_variable_the_entry_is_there_and_the_provider_on(tmp_path):
    from tests.test_startup import PTH

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / PTH.name).write_text(PTH.read_text())
    out = _python(f"import site; site.addsitedir({str(site_dir)!r})\nimport torch\n" + CHECK, CUDNN_SDPA_PROVIDER="1")
    assert "listed True" in out and "active None True" in out, out


@pytest.fixture
def clean_registry():
    assert registry.register() and attention.current_flash_attention_impl() is None
    before = (scope.live(), activation._hooks is not None and activation._hooks.forward_active)
    yield
    attention.restore_flash_attention_impl(_raise_warn=False)
    assert (scope.live(), activation._hooks is not None and activation._hooks.forward_active) == before


def test_activate_is_enable_and_restore_turns_it_off(clean_registry):
    q = torch.randn(1, 2, 8, 8)
    assert not csp.enabled()
    attention.activate_flash_attention_impl(NAME)
    assert csp.enabled() and attention.current_flash_attention_impl() == NAME
    assert len(scope.live()) == 1 and activation._hooks.forward_active, "the same state enable() sets"
    before = counters.stats()
    F.scaled_dot_product_attention(q, q, q)
    assert (counters.stats() - before).fallback["dense_fwd"] == {"no_cuda": 1}, "counted like any enabled call"
    attention.activate_flash_attention_impl(NAME)  # repeated: torch restores first, so still one activation
    assert len(scope.live()) == 1
    attention.restore_flash_attention_impl()
    assert not csp.enabled() and not activation._hooks.forward_active
    assert attention.current_flash_attention_impl() is None
    before = counters.stats()
    F.scaled_dot_product_attention(q, q, q)
    assert (counters.stats() - before).fallback["dense_fwd"] == {}, "off: nothing seen"


def test_it_nests_with_enable(clean_registry):
    with csp.enable():
        attention.activate_flash_attention_impl(NAME)
        attention.restore_flash_attention_impl()
        assert csp.enabled(), "the user's own enable() scope is still live"
    assert not csp.enabled()


def test_the_doctor_does_not_warn_about_our_own_entry(clean_registry, monkeypatch):
    attention.activate_flash_attention_impl(NAME)
    try:
        assert "flash_impl_active" not in [slug for slug, _ in activation.coexistence()]
    finally:
        attention.restore_flash_attention_impl()
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: "FA4")
    assert "flash_impl_active" in [slug for slug, _ in activation.coexistence()]


def test_one_active_at_a_time_beside_cudnn():
    """nvidia's cudnn.torch registers "CUDNN" (a stand-in here): activating either restores the other."""
    out = _python(textwrap.dedent("""
        import torch
        from torch.nn import attention
        import cudnn_sdpa_provider as csp
        removed = []

        class Handle:
            def remove(self):
                removed.append("CUDNN")

        attention.register_flash_attention_impl("CUDNN", register_fn=Handle)
        attention.activate_flash_attention_impl("CUDNN_SDPA_PROVIDER")
        print(attention.current_flash_attention_impl(), csp.enabled())
        attention.activate_flash_attention_impl("CUDNN")
        print(attention.current_flash_attention_impl(), csp.enabled())
        attention.activate_flash_attention_impl("CUDNN_SDPA_PROVIDER")
        print(attention.current_flash_attention_impl(), csp.enabled(), removed)
        attention.restore_flash_attention_impl()
        print(attention.current_flash_attention_impl(), csp.enabled())
    """))
    assert out.splitlines() == ["CUDNN_SDPA_PROVIDER True", "CUDNN False", "CUDNN_SDPA_PROVIDER True ['CUDNN']",
                                "None False"]
