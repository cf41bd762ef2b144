"""CPU tier: the changing-shape cases of ``cudnn-sdpa bench`` (new_length, hf_generate,
hf_dynamic_padding): option parsing and case selection, the fresh-process runner (real
subprocesses that fail, turned into rows), rows and ratios from synthetic measurements, the table,
the JSON file and the figure. Nothing here times anything or touches CUDA."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from cudnn_sdpa_provider.tools import bench, cli
from cudnn_sdpa_provider.tools.bench import shape_report, shape_runner, shapes
from cudnn_sdpa_provider.tools.bench.shapes import Run

SHAPE_NAMES = ["new_length", "hf_generate", "hf_dynamic_padding"]
MATRIX_NAMES = [c.name for c in bench.MATRIX]
REPO = pathlib.Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- the cases


def test_shape_cases_paths_and_processes():
    assert shapes.names() == SHAPE_NAMES
    by = {c.name: c for c in shapes.SHAPE_CASES}
    assert by["new_length"].paths == ("native", "flash", "provider")  # cudnn is the HF integration
    assert by["hf_generate"].paths == by["hf_dynamic_padding"].paths == ("native", "flash", "provider", "cudnn")
    assert by["hf_generate"].batches == (1, 8)
    assert not set(SHAPE_NAMES) & set(MATRIX_NAMES)  # one namespace for --cases
    todo = shapes.runs(shapes.SHAPE_CASES)
    assert len(todo) == 3 + 4 * 2 + 4 == 15 and len(set(todo)) == 15  # one process per (case, path, batch)
    assert Run("hf_generate", "cudnn", 8) in todo and Run("new_length", "native") in todo
    assert Run("hf_generate", "cudnn", 8).label == "hf_generate cudnn batch 8"


def test_split_names_keeps_order_and_rejects_unknown_names():
    matrix, shape = shapes.split_names(["hf_generate", "tiny_b1_h2_s128_d64_causal", "new_length", "hf_generate"],
                                       MATRIX_NAMES)
    assert matrix == ["tiny_b1_h2_s128_d64_causal"] and [c.name for c in shape] == ["hf_generate", "new_length"]
    with pytest.raises(ValueError, match=r"unknown bench case 'new_lenght'\. Available cases: \[.*"
                                         r"'tiny_b1_h2_s128_d64_causal'.*'new_length', 'hf_generate', "
                                         r"'hf_dynamic_padding'\]"):
        shapes.split_names(["new_lenght"], MATRIX_NAMES)
    with pytest.raises(ValueError, match="no bench case selected"):
        shapes.split_names([], MATRIX_NAMES)


# ---------------------------------------------------------------------- rows and ratios (pure)


def _nl(path, first, repeated, **kw):
    return {"case": "new_length_decode_fwd", "group": "new_length", "path": path, "status": "ok",
            "first_ms_median": first, "first_ms_max": first * 10, "repeated_ms": repeated,
            "repeated_wall_ms": repeated, "first_vs_repeated": first / repeated, "lengths": 32, "builds": None, **kw}


def _gen(path, ms, batch=8, label="cold", **kw):
    return {"case": f"hf_generate_b{batch}_{label}", "group": "hf_generate", "path": path, "status": "ok",
            "batch": batch, "ms": ms, "tokens_per_s": batch * 128 / (ms / 1e3), "builds": None, **kw}


def test_ratios_against_native_and_flash():
    rows = shapes.add_shape_ratios([
        _nl("provider", 0.5, 0.15, builds=1), _nl("native", 40.0, 0.06), _nl("flash", 0.1, 0.06),
        _gen("provider", 4000.0, builds=[2, 1, 0]), _gen("native", 8000.0), _gen("flash", 2000.0),
        _gen("cudnn", 1000.0, batch=1),  # batch 1: no native row measured, so no ratio
    ])
    prov, native, flash, gprov, gnative, gflash, lone = rows
    assert prov["first_vs_native"] == pytest.approx(80.0) and prov["repeated_vs_native"] == pytest.approx(0.4)
    assert prov["first_vs_flash"] == pytest.approx(0.2) and prov["repeated_vs_flash"] == pytest.approx(0.4)
    assert native["first_vs_native"] == 1.0 and flash["first_vs_flash"] == 1.0
    assert "vs_native" not in prov  # new_length rows have no "ms"
    assert gprov["vs_native"] == 2.0 and gprov["vs_flash"] == 0.5 and gnative["vs_flash"] == 0.25
    assert gflash["vs_native"] == 4.0 and "first_vs_native" not in gprov
    assert not any(k.startswith("vs_") or "_vs_" in k and k != "first_vs_repeated" for k in lone)


def test_error_rows_get_no_ratio_and_are_no_baseline():
    err = shapes.error_row(Run("hf_dynamic_padding", "flash"), "RuntimeError: No available kernel")
    assert err == {"case": "hf_dynamic_padding", "group": "hf_dynamic_padding", "path": "flash", "status": "error",
                   "reason": "RuntimeError: No available kernel"}
    native_err = shapes.error_row(Run("hf_generate", "native", 1), "boom")
    assert native_err["case"] == "hf_generate_b1" and native_err["batch"] == 1
    pad = {"case": "hf_dynamic_padding", "group": "hf_dynamic_padding", "status": "ok", "steps": 50}
    rows = shapes.add_shape_ratios([dict(pad, path="provider", ms=5000.0), dict(pad, path="native", ms=10000.0),
                                    err])
    assert rows[0]["vs_native"] == 2.0 and "vs_flash" not in rows[0]
    assert set(rows[2]) == set(err)


# ------------------------------------------------------------------------- the fresh processes


def test_child_command_runs_this_package_in_a_fresh_interpreter():
    cmd = shape_runner.child_command(Run("hf_generate", "cudnn", 8), "/tmp/rows.jsonl")
    assert cmd[0] == sys.executable
    assert cmd[1:] == ["-m", "cudnn_sdpa_provider.tools.bench.shape_child", "hf_generate", "cudnn", "--out",
                       "/tmp/rows.jsonl", "--batch", "8"]
    assert "--batch" not in shape_runner.child_command(Run("new_length", "flash"), "x")
    assert (shape_runner._ROOT / "cudnn_sdpa_provider" / "tools" / "bench" / "shape_child.py").is_file()


def test_a_real_child_without_cuda_gives_an_error_row(caplog):
    """The real child process, on a CPU: it raises before any measurement (no CUDA), exits 1, and the
    runner turns its last stderr line into the run's row."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the child would measure instead of failing")
    with caplog.at_level("ERROR", logger="cudnn_sdpa_provider.bench"):
        rows = shape_runner.run_one(Run("hf_generate", "native", 8), timeout=300)
    assert rows == [{"case": "hf_generate_b8", "group": "hf_generate", "path": "native", "batch": 8,
                     "status": "error", "reason": "RuntimeError: the shape case 'hf_generate' needs a CUDA GPU "
                                                  "(CUDA is not available)"}]
    assert "Traceback" in caplog.text  # the whole stderr is logged, not printed


def test_a_child_that_fails_after_a_row_keeps_the_row(capsys):
    script = ("import json, sys; open(sys.argv[1], 'a').write(json.dumps({'case': 'new_length_decode_fwd', "
              "'path': 'flash', 'first_ms_median': 1.0}) + '\\n'); "
              "raise RuntimeError('No available kernel: flash declined the mask')")
    rows = shape_runner.run_one(Run("new_length", "flash"), command=[sys.executable, "-c", script, "{out}"])
    assert rows == [{"case": "new_length_decode_fwd", "path": "flash", "first_ms_median": 1.0,
                     "group": "new_length", "status": "ok"},
                    {"case": "new_length", "group": "new_length", "path": "flash", "status": "error",
                     "reason": "RuntimeError: No available kernel: flash declined the mask"}]
    assert capsys.readouterr() == ("", "")


def test_a_child_that_crashes_silently_or_hangs_gives_an_error_row():
    rows = shape_runner.run_one(Run("new_length", "native"), command=[sys.executable, "-c", "import os; os._exit(7)"])
    assert rows[-1]["status"] == "error" and rows[-1]["reason"] == "exited with status 7"
    rows = shape_runner.run_one(Run("new_length", "native"), command=[sys.executable, "-c", "pass"])
    assert rows[-1]["reason"] == "the process wrote no rows"
    rows = shape_runner.run_one(Run("new_length", "native"), timeout=0.5,
                                command=[sys.executable, "-c", "import time; time.sleep(30)"])
    assert rows == [shapes.error_row(Run("new_length", "native"), "timed out after 0.5 s")]
    half = "import sys; open(sys.argv[1], 'w').write('{\"case\": \"x\", \"pa')"
    rows = shape_runner.run_one(Run("new_length", "native"), command=[sys.executable, "-c", half, "{out}"])
    assert rows[-1]["status"] == "error" and rows[-1]["reason"].startswith("unreadable row")


def test_run_shapes_checks_before_starting_anything(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bench.BenchError, match="CUDA is not available"):
        bench.run_shapes(shapes.SHAPE_CASES)


def test_run_shapes_runs_every_process_and_adds_ratios(monkeypatch):
    monkeypatch.setattr(shape_runner, "_require_gpu", lambda: None)
    seen, progress = [], []

    def fake(run, timeout):
        seen.append(run)
        if run.path == "flash":
            return [shapes.error_row(run, "RuntimeError: no")]
        return [_gen(run.path, {"native": 8000.0}.get(run.path, 4000.0), batch=run.batch)]

    monkeypatch.setattr(shape_runner, "run_one", fake)
    case = next(c for c in shapes.SHAPE_CASES if c.name == "hf_generate")
    rows = bench.run_shapes([case], progress=lambda d, t, label: progress.append((d, t, label)))
    assert seen == shapes.runs([case]) and progress[-1] == (8, 8, "hf_generate cudnn batch 8")
    assert [r["vs_native"] for r in rows if r["status"] == "ok"] == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # path by path
    assert all("vs_flash" not in r for r in rows)


def test_the_child_refuses_a_path_its_case_does_not_run(monkeypatch):
    from cudnn_sdpa_provider.tools.bench import shape_child

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"no path 'cudnn'. Its paths: \['native', 'flash', 'provider'\]"):
        shape_child.measure("new_length", "cudnn")
    with pytest.raises(ValueError, match="unknown shape case 'x'"):
        shape_child.measure("x", "native")
    batches = shape_child.padded_batches(steps=3)
    assert [ids.shape == mask.shape for ids, mask in batches] == [True] * 3
    for ids, mask in batches:
        lens = mask.sum(1)
        assert 128 <= int(lens.min()) and int(lens.max()) == ids.shape[1] <= 2048 and ids.float().std() > 0
        assert bool((mask[:, 1:] <= mask[:, :-1]).all())  # right padding
    assert [m.sum().item() for _, m in batches] == [m.sum().item() for _, m in shape_child.padded_batches(3)]


# ------------------------------------------------------------------------ table, JSON, figure


def _synthetic() -> list[dict]:
    pad = {"case": "hf_dynamic_padding", "group": "hf_dynamic_padding", "status": "ok", "steps": 50,
           "first_step_ms": 800.0, "median_step_ms": 200.0}
    return shapes.add_shape_ratios([
        _nl("provider", 0.5, 0.15, builds=1), _nl("native", 40.0, 0.06), _nl("flash", 0.1, 0.06),
        _gen("provider", 4000.0, builds=[2, 1, 0]), _gen("native", 8000.0), _gen("flash", 2000.0),
        _gen("provider", 3000.0, label="warm", builds=[0, 0, 0]), _gen("native", 1500.0, label="warm"),
        dict(pad, path="cudnn", ms=5000.0, builds=3), dict(pad, path="native", ms=10000.0),
        shapes.error_row(Run("hf_dynamic_padding", "flash"), "RuntimeError: No available kernel"),
    ])


def test_table_has_a_block_per_case_with_its_columns():
    text = bench.format_shape_table(_synthetic())
    blocks = text.split("\n\n")
    assert len(blocks) == 3
    assert blocks[0].splitlines()[0].split()[:4] == ["case", "path", "first", "ms"]
    prov = next(line for line in blocks[0].splitlines() if "provider" in line)
    assert "0.500" in prov and "80.00x" in prov and "0.40x" in prov and " 1 " in prov
    gen = next(line for line in blocks[1].splitlines() if "provider" in line and "cold" in line)
    assert "256.0" in gen and "2.00x" in gen and "2,1,0" in gen and "0.50x" in gen
    assert "tokens/s" in blocks[1].splitlines()[0]
    assert "ERROR: RuntimeError: No available kernel" in blocks[2] and "2.00x" in blocks[2]


def test_cli_runs_shape_cases_with_json_and_plot(monkeypatch, capsys, tmp_path):
    rows = _synthetic()
    calls = []

    def fake_run_shapes(cases, progress=None):
        calls.append([c.name for c in cases])
        progress(1, 1, "done")
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_shapes", fake_run_shapes)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("no matrix case was named"))
    monkeypatch.setattr(bench, "collect_meta", lambda **settings: {"gpu": "fake", "settings": settings})
    out, fig = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--cases", "new_length,hf_generate,hf_dynamic_padding", "--json", str(out)]
    pytest.importorskip("matplotlib")
    assert cli.main(argv + ["--plot", str(fig)]) == cli.EXIT_OK
    assert calls == [SHAPE_NAMES]
    captured = capsys.readouterr()
    assert captured.out.strip() == bench.format_shape_table(rows) and "1/1 done" in captured.err
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["shape_rows"] == rows
    assert data["meta"]["settings"]["cases"] == [] and set(data["meta"]["settings"]["shape_cases"]) == set(SHAPE_NAMES)
    assert fig.stat().st_size > 0  # only shape cases ran: their figure is the --plot file


def test_cli_with_matrix_and_shape_cases_writes_both(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from tests.test_bench import _row

    matrix_rows = bench.add_ratios([_row(path="provider", ms=1.0), _row(ms=2.0)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_shapes", lambda cases, progress=None: _synthetic())
    monkeypatch.setattr(bench, "run", lambda cases, **kw: matrix_rows)
    monkeypatch.setattr(bench, "collect_meta", lambda **settings: {"settings": settings})
    out, fig = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--shapes", "b4_h16_s4096_d128,new_length", "--json", str(out), "--plot", str(fig)]
    assert cli.main(argv) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert text.index("b4_h16_s4096_d128") < text.index("new_length_decode_fwd")
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2 and len(data["shape_rows"]) == len(_synthetic())
    assert fig.stat().st_size > 0 and (tmp_path / "b.shapes.png").stat().st_size > 0


def test_cli_shape_option_errors_and_list(capsys):
    assert cli.main(["bench", "--cases", "new_length,nope"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown bench case 'nope'" in err and "'hf_dynamic_padding'" in err and "'b4_h16_s4096_d128'" in err
    assert cli.main(["bench", "--list"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert all(any(line.startswith(n + " ") for line in out.splitlines()) for n in SHAPE_NAMES + MATRIX_NAMES)
    assert cli.main(["bench", "--help"]) == cli.EXIT_OK
    assert "--shapes NAMES, --cases NAMES" in capsys.readouterr().out


def test_plot_path_and_figure(tmp_path):
    assert bench.shape_plot_path("out/b.png", with_matrix=False) == "out/b.png"
    assert bench.shape_plot_path("out/b.png", with_matrix=True) == str(pathlib.Path("out/b.shapes.png"))
    assert bench.shape_plot_path("b", with_matrix=True) == "b.shapes.png"
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no measured shape rows"):
        bench.plot_shapes([shapes.error_row(Run("new_length", "flash"), "x")], str(tmp_path / "none.png"))
    out = tmp_path / "s.png"
    bench.plot_shapes(_synthetic(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_meta_describes_the_shape_cases():
    meta = shape_report.shape_meta(shapes.SHAPE_CASES)
    assert meta["hf_generate"]["batches"] == [1, 8] and meta["new_length"]["batches"] == []
    assert meta["hf_dynamic_padding"]["paths"] == ["native", "flash", "provider", "cudnn"]
    json.dumps(meta)


# ------------------------------------------------------------------------------ the script


def test_script_is_a_wrapper_with_the_old_modes():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_shapes.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "{new_length,hf_generate,hf_dynamic_padding,profile,all}" in out.stdout
    text = (REPO / "scripts" / "bench_shapes.py").read_text()
    assert "def new_length" not in text and "shape_child.profile_first_calls()" in text


def test_builds_and_calls_are_counted_over_the_region_on_provider_paths_only():
    from cudnn_sdpa_provider.core import counters
    from cudnn_sdpa_provider.tools.bench import shape_child

    counters.note_build(0.5)  # before the region: not counted
    mine, native = shape_child._Counted("cudnn"), shape_child._Counted("native")
    counters.note_build(0.040)
    counters.note_build(0.002, rejected=True)
    counters.record("dense_fwd")
    counters.record("dense_bwd")
    counters.record("dense_fwd", "attn_bias")
    fields = mine.fields()
    assert fields == {"builds": 1, "build_ms": 42.0, "served": 2, "fallback_reasons": {"attn_bias": 1}}  # rejected too
    assert native.fields() == {"builds": None, "build_ms": None}


def test_generation_counts_are_per_generation_and_summed():
    from cudnn_sdpa_provider.tools.bench import shape_child

    counts = [{"builds": 2, "build_ms": 80.0, "served": 100, "fallback_reasons": {}},
              {"builds": 1, "build_ms": 40.0, "served": 100, "fallback_reasons": {"dtype": 2}},
              {"builds": 0, "build_ms": 0.0, "served": 98, "fallback_reasons": {"dtype": 1, "attn_bias": 1}}]
    assert shape_child._per_generation(counts) == {"builds": [2, 1, 0], "build_ms": [80.0, 40.0, 0.0], "served": 298,
                                                   "fallback_reasons": {"dtype": 3, "attn_bias": 1}}
    off = [{"builds": None, "build_ms": None}] * 3
    assert shape_child._per_generation(off) == {"builds": None, "build_ms": None}
