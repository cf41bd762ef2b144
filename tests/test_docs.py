"""Generated docs stay current (CI fails when docs/telemetry.md or docs/support.md is stale)."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

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

    import cudnn_sdpa_provider as csp
    from cudnn_sdpa_provider.hooks import telemetry

    csp.reset_stats()  # an earlier test's strict-mode refusals would add the conditional "refused" key
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
    tree = ast.parse(noxfile)
    values = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("TORCH", "NEED_GB")}
    assert sorted(values["NEED_GB"]) == sorted(values["TORCH"]), "every session checks its disk need"
    assert "session.skip(" in noxfile and "session.error(" in noxfile and "PIP_NO_CACHE_DIR" in noxfile


def test_docs_cite_no_document_outside_the_project():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "results").glob("*.md"))]
    citing = [str(p.relative_to(REPO)) for p in pages if "FACTS" in p.read_text()]
    assert not citing, f"cite a public source or a results/ file instead: {citing}"


# ------------------------------------------------------- documented contracts against the code


def _section(page: str, heading: str) -> str:
    """The text of a markdown section, from its heading to the next heading of any level."""
    import re

    body = page.split(heading + "\n", 1)[1]
    return re.split(r"\n#{1,6} ", body, maxsplit=1)[0]


def test_readme_to_dict_is_every_path_in_order():
    import re

    section = _section((REPO / "README.md").read_text(), "## Telemetry")
    shape = section.split("`csp.stats().to_dict()` is exactly", 1)[1].split(";", 1)[0]
    keys = [k for k in re.findall(r'"(\w+)": (?:\{|\.\.\.)', shape) if k not in ("served", "fallback")]
    assert keys == list(PATHS), shape


def test_no_page_states_another_number_of_paths():
    import re

    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}
    pages = {"README.md": (REPO / "README.md").read_text(), "telemetry (generated)": docgen.telemetry_page(),
             **{p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}}
    wrong = []
    for name, text in pages.items():
        for word in re.findall(r"\bof (\w+) paths\b", text, flags=re.IGNORECASE):
            if words.get(word.lower(), int(word) if word.isdigit() else None) not in (None, len(PATHS)):
                wrong.append(f"{name}: 'of {word} paths' (there are {len(PATHS)})")
    assert not wrong, wrong


def test_quickstart_shows_the_demos_table_on_cpu(capsys):
    import torch

    from cudnn_sdpa_provider.tools import cli

    if torch.cuda.is_available():
        pytest.skip("the page shows the CPU run")
    page = (REPO / "docs" / "quickstart.md").read_text()
    shown = page.split("```text\ndemo: TinyGQA, 5 steps on cpu\n", 1)[1].split("```", 1)[0].splitlines()
    assert cli.main(["demo", "--device", "cpu"]) == cli.EXIT_OK
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "demo: TinyGQA, 5 steps on cpu"
    table = printed[2:2 + len(shown) - 1]  # (after it, a process that built graphs also lists their plans)
    assert shown[0] == "losses: ..." and shown[1:] == table, "docs/quickstart.md's table is not the demo's"
    assert [line.split()[0] for line in shown[2:]] == list(PATHS)


def test_ways_in_variables_table_is_the_code_s():
    from cudnn_sdpa_provider.core import env

    table = _md_table((REPO / "docs" / "ways-in.md").read_text(), "| variable | values |")
    assert [cells[0].strip("`") for cells in table] == list(env.VARIABLES)
    bad = {name: "not-a-valid-value" for name in env.VARIABLES}
    warned = [message.split("=")[0] for message in env.invalid(bad)]
    assert warned == [v for v in env.VARIABLES if v != env.REPORT], "the docs say every other variable warns"


def test_the_number_of_ways_in_is_the_number_listed():
    import re

    readme, page = (REPO / "README.md").read_text(), (REPO / "docs" / "ways-in.md").read_text()
    heading = re.search(r"\n## (\w+) ways in", readme).group(1)
    items = re.findall(r"^(\d+)\. \*\*", _section(readme, f"## {heading} ways in (and FP8)"), flags=re.MULTILINE)
    sections = re.findall(r"^## (\d+)\. ", page, flags=re.MULTILINE)
    words = {"Three": 3, "Four": 4, "Five": 5}
    assert page.startswith(f"# {heading} ways in\n")
    expected = list(range(1, words[heading] + 1))
    assert [int(n) for n in items] == [int(n) for n in sections] == expected, (items, sections)


def test_readme_puts_run_options_before_the_script():
    readme = (REPO / "README.md").read_text()
    assert "`cudnn-sdpa run [--strict] [--report FILE] train.py [args]`" in readme
    assert "run train.py [args]` (`--strict`" not in readme


def test_readme_says_how_to_install_on_cpu_and_what_the_tests_cost():
    install = _section((REPO / "README.md").read_text(), "## Install")
    assert install.index("CPU build of torch") < install.index("python3 -m pip install ."), "torch first"
    assert "several GB of disk, per torch\nversion, under `.nox/`" in (REPO / "README.md").read_text()
