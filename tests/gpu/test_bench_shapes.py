"""GPU tier: smoke runs of the changing-shape bench cases (no speed asserted): every path's process
runs, its rows carry the figures, the provider's calls are served and its builds counted, and a
path that cannot run gives an error row instead of stopping the bench."""

from __future__ import annotations

import functools
import json

import pytest

from cudnn_sdpa_provider.tools import bench, cli
from cudnn_sdpa_provider.tools.bench import shape_runner
from cudnn_sdpa_provider.tools.bench.shapes import Run

pytestmark = pytest.mark.gpu

NEW_LENGTH_ROWS = ("new_length_decode_fwd", "new_length_prefill_fwd", "new_length_prefill_fwd_bwd")
#: Seconds each bench process may run here (the slowest, native hf_generate batch 1, takes about a minute:
#: shape_runner.CHILD_TIMEOUT_S's note): well under the GPU tier's 600 s per device call, so a hung process is an error row and
#: this test's failure, not the whole call cut (the bench's own limit, shape_runner.CHILD_TIMEOUT_S, is 1800).
CHILD_TIMEOUT = 240


def test_new_length_through_the_cli_every_path_in_its_own_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_shapes", functools.partial(shape_runner.run_shapes, timeout=CHILD_TIMEOUT))
    out, fig = tmp_path / "shapes.json", tmp_path / "shapes.png"
    assert cli.main(["bench", "--cases", "new_length", "--json", str(out), "--plot", str(fig)]) == cli.EXIT_OK
    data = json.loads(out.read_text())
    rows = data["shape_rows"]
    assert data["rows"] == [] and fig.stat().st_size > 0
    assert [(r["case"], r["path"]) for r in rows] == [(c, p) for p in ("native", "flash", "provider")
                                                     for c in NEW_LENGTH_ROWS]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["lengths"] == 32 and 0 < r["repeated_ms"] and 0 < r["first_ms_median"] <= r["first_ms_max"], r
        assert r["first_vs_native"] > 0 and r["repeated_vs_flash"] > 0, r
    for r in rows:
        if r["path"] == "provider":  # the measured lengths sit in one bucket: a build per graph at most
            assert r["fallback_reasons"] == {} and r["served"] >= 32, r
            assert 0 <= r["builds"] <= (2 if r["case"].endswith("fwd_bwd") else 1), r
        else:
            assert r["builds"] is None and "served" not in r, r
    assert "new_length_decode_fwd" in capsys.readouterr().out


def test_flash_declining_hf_padding_is_an_error_row():
    pytest.importorskip("transformers")
    rows = shape_runner.run_one(Run("hf_dynamic_padding", "flash"), timeout=CHILD_TIMEOUT)
    assert [r["status"] for r in rows] == ["error"] and rows[0]["reason"], rows


def test_hf_generate_batch_one_provider_and_cudnn_rows():
    import transformers  # noqa: F401 - the GPU box has transformers 5.x: a missing one is a failure

    case = next(c for c in bench.SHAPE_CASES if c.name == "hf_generate")
    rows = []
    for path in ("native", "provider", "cudnn"):
        rows += shape_runner.run_one(Run(case.name, path, 1), timeout=CHILD_TIMEOUT)
    bench.shapes.add_shape_ratios(rows)
    assert [(r["case"], r["path"]) for r in rows] == [(f"hf_generate_b1_{label}", p)
                                                     for p in ("native", "provider", "cudnn")
                                                     for label in ("cold", "warm")]
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and len(r["times_ms"]) == 3 and r["vs_native"] > 0, r
        if r["path"] != "native":
            assert r["fallback_reasons"] == {} and len(r["builds"]) == 3, r
            if r["case"].endswith("warm"):
                assert r["builds"] == [0, 0, 0], r  # the lengths were built by the cold generations
