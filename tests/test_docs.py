"""Generated docs stay current (CI fails when docs/telemetry.md or docs/support.md is stale)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from cudnn_sdpa_provider.tools import docgen
from cudnn_sdpa_provider.core import support
from cudnn_sdpa_provider.core.reasons import CATALOG, PATHS

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_generated_docs_are_current():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "cudnn_sdpa_provider.tools.docgen", "--check"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stale generated docs:\n{result.stderr}{result.stdout}"


def test_telemetry_page_lists_every_slug_and_path():
    page = docgen.telemetry_page()
    for slug in CATALOG:
        assert f"| `{slug}` |" in page, f"slug {slug!r} missing from docs/telemetry.md"
    for path in PATHS:
        assert f'"{path}"' in page


PACKAGE = REPO / "cudnn_sdpa_provider"


def _package_sources(exclude=("reasons.py", "docgen.py")) -> dict[str, str]:
    """The package's code, by module path, without the slug catalog and the docs generator."""
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p.name not in exclude}


def _named_module(text: str) -> pathlib.Path | None:
    """The first module of the package that a ``docgen.OTHER_SOURCES`` entry names in backticks."""
    import re

    for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\(\))?`", text):
        parts = token.split(".")
        for n in range(len(parts), 0, -1):
            candidate = PACKAGE.joinpath(*parts[:n]).with_suffix(".py")
            if candidate.is_file():
                return candidate
    return None


def test_every_slug_has_a_source():
    emitted = {rule.slug for rule in support.RULES} | set(docgen.OTHER_SOURCES)
    assert set(CATALOG) <= emitted, f"slugs with no documented source: {sorted(set(CATALOG) - emitted)}"
    assert emitted <= set(CATALOG), f"sources for slugs not in CATALOG: {sorted(emitted - set(CATALOG))}"


def _emits(text: str, slug: str) -> bool:
    """A module emits a slug by its literal or by its ``reasons.Slug`` member."""
    return f'"{slug}"' in text or f"'{slug}'" in text or f"Slug.{slug.upper()}" in text


def test_every_slug_is_emitted_by_the_code_and_where_the_docs_say():
    sources = {path: text for path, text in _package_sources().items() if not str(path).endswith("reasons.py")}
    code = "\n".join(sources.values())
    never = sorted(slug for slug in CATALOG if not _emits(code, slug))
    assert not never, f"slugs in the catalog that no module emits: {never}"
    wrong = []
    for slug, text in docgen.OTHER_SOURCES.items():
        module = _named_module(text)
        if module is not None and not _emits(module.read_text(), slug):
            wrong.append(f"{slug}: docs say {module.relative_to(REPO)}, which never names it")
    assert not wrong, "\n".join(wrong)


def test_documented_meta_keys_match_the_report():
    import torch

    from cudnn_sdpa_provider.hooks import telemetry

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


# ------------------------------------------------------------- docs against the recorded runs


RUN15 = REPO / "results" / "bench" / "2026-12-02-h200-run15.txt"
RUN26 = REPO / "results" / "bench" / "2026-12-03-h200-run26.txt"  # the performance page's main table


def _bench_rows(path: pathlib.Path) -> dict[tuple[str, str, str], list[str]]:
    """(case, mode, path) -> the cells of a recorded ``cudnn-sdpa bench`` table."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = line.split()
        if len(cells) >= 5 and cells[1] in ("fwd", "fwd_bwd"):
            rows[(cells[0], cells[1], cells[2])] = cells[3:]
    return rows


def _md_table(page: str, header_start: str) -> list[list[str]]:
    lines = page.split(header_start, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]


def test_performance_results_table_matches_the_recorded_run():
    recorded = _bench_rows(RUN26)
    table = _md_table((REPO / "docs" / "performance.md").read_text(), "| case | fwd: provider ms |")
    checked = 0
    for cells in table:
        case = cells[0]
        if not any(key[0] == case for key in recorded):
            continue  # rows from other runs name their run in the case cell
        for mode, (mine, theirs, ratio) in (("fwd", cells[1:4]), ("fwd_bwd", cells[4:7])):
            if mine == "-":
                continue
            provider, native = recorded[(case, mode, "provider")], recorded[(case, mode, "native_cudnn")]
            assert (mine, theirs) == (provider[0], native[0]), (case, mode, cells)
            assert ratio.strip("*").split()[0] == provider[3], (case, mode, ratio, provider)
        checked += 1
    assert checked >= 8, f"only {checked} rows of docs/performance.md matched run 26's cases"


def test_padded_batch_figures_in_the_docs_are_run_15s():
    padded = _bench_rows(RUN15)
    fwd = padded[("padded_b8_h32kv8_s4096_d128_causal", "fwd", "provider")]
    both = padded[("padded_b8_h32kv8_s4096_d128_causal", "fwd_bwd", "provider")]
    models = (REPO / "docs" / "models.md").read_text()
    assert f"**{both[3]}**" in models and f"forward {fwd[3]}" in models, "docs/models.md quotes run 15"
    assert "3.77x" not in models
    readme = (REPO / "README.md").read_text()
    assert f"**{both[3][:3]}x**" in readme  # 3.62x, rounded


def test_ci_runs_exactly_the_readme_test_command_on_every_torch_version():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert f"```bash\n{ci}\n```" in readme, f"README does not show the CI command {ci!r}"
    assert ci.endswith("nox -s tests")
    noxfile = (REPO / "noxfile.py").read_text()
    assert 'TORCH = ["2.13.0", "2.14.1", "2.15.0"]' in noxfile and '@nox.parametrize("torch", TORCH)' in noxfile


def test_docs_cite_no_document_outside_the_project():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "results").glob("*.md"))]
    citing = [str(p.relative_to(REPO)) for p in pages if "FACTS" in p.read_text()]
    assert not citing, f"cite a public source or a results/ file instead: {citing}"
