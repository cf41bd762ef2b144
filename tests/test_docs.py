"""Generated docs stay current (CI fails when docs/telemetry.md or docs/support.md is stale)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from cudnn_sdpa_provider import docgen, support
from cudnn_sdpa_provider.reasons import CATALOG, PATHS

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_generated_docs_are_current():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "cudnn_sdpa_provider.docgen", "--check"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stale generated docs:\n{result.stderr}{result.stdout}"


def test_telemetry_page_lists_every_slug_and_path():
    page = docgen.telemetry_page()
    for slug in CATALOG:
        assert f"| `{slug}` |" in page, f"slug {slug!r} missing from docs/telemetry.md"
    for path in PATHS:
        assert f'"{path}"' in page


def test_every_slug_has_a_source():
    emitted = {rule.slug for rule in support.RULES} | set(docgen.OTHER_SOURCES)
    assert set(CATALOG) <= emitted, f"slugs with no documented source: {sorted(set(CATALOG) - emitted)}"
    assert emitted <= set(CATALOG), f"sources for slugs not in CATALOG: {sorted(emitted - set(CATALOG))}"


def test_documented_meta_keys_match_the_report():
    import torch

    from cudnn_sdpa_provider import telemetry

    meta = telemetry.report_data()["meta"]
    expected = set(docgen.META_KEYS) | (set(docgen.META_CUDA_KEYS) if torch.cuda.is_available() else set())
    assert set(meta) == expected


def test_support_page_has_every_rule_and_feature():
    from cudnn_sdpa_provider import diagnostics

    page = docgen.support_page()
    for i, rule in enumerate(support.RULES, 1):
        assert f"| {i} | `{rule.slug}` | {rule.summary} |" in page
    for name, _ in diagnostics.FEATURES:
        assert f"| {name} |" in page


def test_pages_are_deterministic():
    assert docgen.pages() == docgen.pages()


def test_check_names_stale_pages(tmp_path, capsys):
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    assert "telemetry.md is stale" in capsys.readouterr().err
    assert docgen.main(["--write", "--docs-dir", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    (tmp_path / "support.md").write_text("edited by hand\n")
    assert docgen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "support.md is stale" in err and "telemetry.md" not in err


def test_support_page_lists_every_support_constant():
    page = docgen.support_page()
    names = [name for name, _ in docgen._source_constants()]
    assert {"MIN_CUDNN", "BLOCKED_CUDNN", "SINK_MIN", "SINK_RAGGED_BWD_MIN", "DETERMINISTIC_SMALL_WS_MIN"} <= set(names)
    for name in names:
        assert f"| `{name}` |" in page


def test_relative_links_in_docs_resolve():
    import re

    missing = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, missing


def test_relative_links_in_docs_and_readme_resolve():
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
