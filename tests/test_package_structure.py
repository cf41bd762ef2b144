"""CPU tier: the shape of the package: the layers (each subpackage imports only from the layers
below it, so the tree and the imports cannot drift apart), no import circles (module-level or inside
functions), no module over ~500 lines, one owner for each external thing (cudnn, os.environ)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cudnn_sdpa_provider"
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, anywhere in the file (lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                out.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name and not name.startswith(m + ".") and m != "cudnn_sdpa_provider"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_short(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (split it by job)"


def test_only_graphs_imports_cudnn_and_only_env_reads_the_environment():
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        if "cudnn" in imported:
            assert name == "cudnn_sdpa_provider.engine.graphs", f"{name} imports cudnn"
        reads_env = any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") for n in ast.walk(tree))
        if reads_env:
            assert name in ("cudnn_sdpa_provider.core.env", "cudnn_sdpa_provider.hooks.startup", "cudnn_sdpa_provider.tools.cli"), \
                f"{name} reads os.environ"
