"""CPU tier: what ``import cudnn_sdpa_provider`` does (nothing heavy) and what it makes reachable."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_SDPA_PROVIDER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_loads_neither_torch_nor_transformers():
    out = _python("import sys, cudnn_sdpa_provider\n"
                  "print(sorted(m for m in ('torch', 'transformers', 'cudnn') if m in sys.modules))")
    assert out == "[]\n"


def test_integrations_transformers_is_an_attribute_of_the_package():
    out = _python("import sys, cudnn_sdpa_provider as csp\n"
                  "t = csp.integrations.transformers\n"
                  "print(t.__name__, callable(t.register), 'transformers' in sys.modules)\n"
                  "print('integrations' in dir(csp) or 'integrations' in vars(csp))")
    assert out == "cudnn_sdpa_provider.integrations.transformers True False\nTrue\n", \
        "reachable, and the model library itself is still not imported"


def test_unknown_attribute_is_an_attribute_error_naming_it():
    out = _python("import cudnn_sdpa_provider as csp\n"
                  "try:\n    csp.nope\nexcept AttributeError as e:\n    print(e)")
    assert out == "module 'cudnn_sdpa_provider' has no attribute 'nope'\n"
