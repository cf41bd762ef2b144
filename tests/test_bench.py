"""CPU tier: the bench matrix, flop formulas, rows, table, JSON, plot errors and the `bench` CLI.

Nothing here times anything or touches CUDA (``bench.run`` is only exercised in tests/gpu)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from cudnn_sdpa_provider.tools import bench, cli
from cudnn_sdpa_provider.tools.bench import Case, Measurement, Row

DOCUMENTED_DENSE = {(4, 16, 4096, 128), (16, 16, 1024, 64), (2, 16, 8192, 128)}
HF_CASE, HF_TINY = "hf_llama_l4_d2048_b4_s2048_padded", "hf_llama_l2_d256_b2_s256_padded"


def by_name(name: str) -> Case:
    return bench.select([name])[0]


# ----------------------------------------------------------------------------------- the matrix


def test_matrix_names_unique_and_well_formed():
    names = [c.name for c in bench.KNOWN]  # the default matrix and the groups (tests/test_bench_fp8.py)
    assert len(names) == len(set(names)) and not set(names) & set(bench.GROUPS)
    paths = {"dense": bench.DENSE_PATHS, "varlen": bench.VARLEN_PATHS, "padded": bench.PADDED_PATHS,
             "step": bench.STEP_PATHS, "hf_llama": bench.HF_PATHS, "fp8": bench.FP8_PATHS}
    for c in bench.KNOWN:
        assert c.h_q % c.h_kv == 0
        assert c.paths == paths[c.kind]
        assert set(bench.BASELINE[c.kind]) <= set(c.paths) and "provider" in c.paths
        assert c.modes == (("fwd_bwd",) if c.kind in ("step", "hf_llama") else bench.MODES)
        assert c.describe()
    assert set(bench.QUICK_CASES) <= set(names)


def test_matrix_has_the_documented_cases():
    dense = {(c.batch, c.h_q, c.seq, c.head_dim, c.causal) for c in bench.MATRIX if c.kind == "dense" and not c.gqa}
    for b, h, s, d in DOCUMENTED_DENSE:
        assert (b, h, s, d, False) in dense and (b, h, s, d, True) in dense
    gqa = [c for c in bench.MATRIX if c.gqa and c.kind == "dense"]
    assert [(c.batch, c.h_q, c.h_kv, c.seq, c.head_dim, c.causal) for c in gqa] == [(1, 32, 8, 16384, 128, True)]
    host = [c for c in bench.MATRIX if c.host and c.kind == "dense"]
    assert [(c.batch, c.h_q, c.seq, c.head_dim, c.causal) for c in host] == [(1, 2, 128, 64, True)]
    (step,) = [c for c in bench.MATRIX if c.kind == "step"]
    assert step.host and step.layers == 2 and step.gqa
    (varlen,) = [c for c in bench.MATRIX if c.kind == "varlen"]
    assert len(varlen.seq_lens) == 16 == varlen.batch
    assert all(128 <= n <= 4096 for n in varlen.seq_lens)
    assert varlen.seq == max(varlen.seq_lens) and varlen.causal and (varlen.h_q, varlen.head_dim) == (16, 128)
    assert varlen.seq_lens == bench.cases.varlen_lengths()  # a fixed seed: the same mix every run
    (padded,) = [c for c in bench.MATRIX if c.kind == "padded"]
    assert (padded.h_q, padded.h_kv, padded.seq, padded.head_dim, padded.causal) == (32, 8, 4096, 128, True)
    assert len(padded.seq_lens) == padded.batch and max(padded.seq_lens) == padded.seq


def test_padded_lengths_average_a_quarter_padding():
    lens = bench.cases.padded_lengths(8, 4096)
    assert lens[0] == 4096 and lens[-1] == 2048 and list(lens) == sorted(lens, reverse=True)
    assert 1 - sum(lens) / (8 * 4096) == pytest.approx(0.25, abs=1e-3)
    assert "25% padding" in by_name("padded_b8_h32kv8_s4096_d128_causal").describe()


def test_padding_mask_is_key_padding_and_causal():
    lens = torch.tensor([3, 1], dtype=torch.int32)
    mask = bench.inputs.padding_mask(lens, 4, causal=True)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool and mask.is_contiguous()
    for b, n in enumerate((3, 1)):
        for i in range(4):
            for j in range(4):
                assert bool(mask[b, 0, i, j]) == (j < n and j <= i), (b, i, j)
    assert bench.inputs.padding_mask(lens, 4, causal=False)[0, 0].tolist() == [[True, True, True, False]] * 4


def test_select_and_validation_errors_name_the_choices():
    assert bench.select() == list(bench.MATRIX)
    assert [c.name for c in bench.quick_matrix()] == list(bench.QUICK_CASES)
    custom = Case("mine", "dense", 1, 1, 1, 8, 8, False)
    assert bench.select([custom, "tiny_b1_h2_s128_d64_causal"])[0] is custom
    with pytest.raises(ValueError, match="Available cases: .*tiny_b1_h2_s128_d64_causal"):
        bench.select(["nope"])
    with pytest.raises(ValueError, match="Available modes"):
        bench.check_modes(["fwd", "bwd"])
    assert bench.check_modes(["fwd_bwd", "fwd", "fwd_bwd"]) == ("fwd_bwd", "fwd")
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        bench.check_settings(0, 1, 1)
    with pytest.raises(ValueError, match="warmup"):
        bench.check_settings(1, -1, 1)


# ------------------------------------------------------------------------------------ flops


def test_dense_flops_by_hand():
    c = by_name("b4_h16_s4096_d128")
    fwd = 4 * 4 * 16 * 4096 * 4096 * 128  # 4*B*H*S*S*D = 2**39
    assert fwd == 549_755_813_888
    assert bench.fwd_flops(c) == fwd
    assert bench.fwd_flops(by_name("b4_h16_s4096_d128_causal")) == fwd / 2
    assert bench.flops(c, "fwd") == fwd
    assert bench.flops(c, "fwd_bwd") == 3.5 * fwd


def test_gqa_flops_count_query_heads():
    c = by_name("gqa_b1_h32kv8_s16384_d128_causal")
    assert bench.fwd_flops(c) == 4 * 1 * 32 * 16384 * 16384 * 128 / 2


def test_varlen_flops_sum_over_sequences():
    c = Case("v", "varlen", 3, 2, 2, 300, 8, True, seq_lens=(100, 300, 200))
    per_seq = [4 * 2 * n * n * 8 / 2 for n in (100, 300, 200)]  # 320,000 + 2,880,000 + 1,280,000
    assert sum(per_seq) == 4_480_000
    assert bench.fwd_flops(c) == 4_480_000
    assert bench.flops(c, "fwd_bwd") == 3.5 * 4_480_000
    full = Case("v", "varlen", 3, 2, 2, 300, 8, False, seq_lens=(100, 300, 200))
    assert bench.fwd_flops(full) == 8_960_000


def test_padded_flops_count_real_lengths_and_step_has_none():
    c = Case("p", "padded", 3, 2, 1, 300, 8, True, seq_lens=(100, 300, 200))
    assert bench.fwd_flops(c) == 4_480_000  # the work on real tokens, as for varlen
    step = by_name("step_tinygqa_b2_s128")
    assert bench.fwd_flops(step) is None and bench.flops(step, "fwd_bwd") is None
    row = bench.summarize(step, "fwd_bwd", Measurement("native", times_ms=[1.0]), 0.0, 1)
    assert row.status == "ok" and row.tflops is None and row.median_ms == 1.0


# ------------------------------------------------------------------ the Hugging Face Llama step


def test_hf_llama_case_is_the_model_level_target():
    # 4 layers, hidden 2048, 16/4 heads, B=4 x S=2048 right-padded by 25% on average, causal
    c = by_name(HF_CASE)
    assert (c.kind, c.layers, c.batch, c.seq, c.h_q, c.h_kv, c.head_dim, c.causal) == \
        ("hf_llama", 4, 4, 2048, 16, 4, 128, True)
    assert c.seq_lens == bench.cases.padded_lengths(4, 2048) == (2048, 1707, 1365, 1024)
    assert c.paths == bench.HF_PATHS == ("provider", "provider_hf", "native") and c.modes == ("fwd_bwd",)
    assert bench.BASELINE["hf_llama"] == ("native",) and not c.host
    text = c.describe()
    for part in ("LlamaForCausalLM", "4 layers", "hidden 2048", "MLP 5632", "vocab 32000", "B=4 S=2048",
                 "lengths 1024..2048", "25% padding", "H=16/4 (GQA)", "D=128", "causal"):
        assert part in text, (part, text)


def test_hf_llama_tiny_variant_has_the_same_form():
    big, tiny = by_name(HF_CASE), by_name(HF_TINY)
    assert tiny.kind == big.kind and tiny.h_q // tiny.h_kv == big.h_q // big.h_kv == 4
    assert (tiny.layers, tiny.batch, tiny.seq, tiny.h_q * tiny.head_dim) == (2, 2, 256, 256)
    assert 1 - sum(tiny.seq_lens) / (tiny.batch * tiny.seq) == pytest.approx(0.25)
    assert "hidden 256" in tiny.describe() and "25% padding" in tiny.describe()


def test_hf_llama_config_follows_llamas_width_rule():
    cfg = bench.cases.llama_config(by_name(HF_CASE))
    assert cfg == dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048,
                       attention_dropout=0.0)
    assert bench.cases.llama_intermediate(4096) == 11008  # Llama 2 7B's MLP width
    assert bench.cases.llama_intermediate(256) == 768
    hf = pytest.importorskip("transformers")
    built = hf.LlamaConfig(**cfg)
    assert (built.hidden_size, built.intermediate_size, built.num_key_value_heads) == (2048, 5632, 4)
    assert bench.inputs.unavailable(by_name(HF_CASE)) is None  # transformers 5 is importable here


def test_hf_llama_with_old_transformers_says_which_version(monkeypatch):
    hf = pytest.importorskip("transformers")
    monkeypatch.setattr(hf, "__version__", "4.57.1")
    assert bench.inputs.unavailable(by_name(HF_TINY)) == \
        "the Hugging Face Llama case needs transformers >= 5, found 4.57.1"


def test_hf_llama_rows_have_no_flops_and_count_every_layer():
    c = by_name(HF_TINY)
    assert bench.fwd_flops(c) is None and bench.flops(c, "fwd_bwd") is None
    assert bench.expected_calls(c, "fwd_bwd", 5) == 5 * 2 * 2  # 2 layers, a forward and a backward each
    ok = bench.summarize(c, "fwd_bwd", Measurement("provider_hf", times_ms=[3.0], calls=5, served=20), 0.0, 1)
    assert (ok.status, ok.tflops, ok.expected, ok.served) == ("ok", None, 20, 20)
    short = bench.summarize(c, "fwd_bwd", Measurement("provider", times_ms=[3.0], calls=5, served=18,
                                                      fallback={"attn_bias": 2}), 0.0, 1)
    assert short.status == "fallback" and "2 of 20" in short.reason
    rows = bench.add_ratios([bench.summarize(c, "fwd_bwd", Measurement(p, times_ms=[t], calls=1, served=4), 0.0, 1)
                             for p, t in (("provider", 4.0), ("provider_hf", 2.0), ("native", 4.0))])
    assert [r.vs_native for r in rows] == [1.0, 2.0, 1.0]


def test_hf_llama_selection_on_the_command_line(monkeypatch):
    calls = _fake_run(monkeypatch, [_row(ms=2.0)])
    assert cli.main(["bench", "--shapes", f"{HF_TINY},{HF_CASE}", "--modes", "fwd_bwd"]) == cli.EXIT_OK
    (names, kw), = calls
    assert names == [HF_TINY, HF_CASE] and kw["modes"] == ("fwd_bwd",)
    assert HF_TINY not in bench.QUICK_CASES  # the quick preset's case count is in the CLI's help


def _block_transformers(monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError


def test_hf_llama_without_transformers_is_skipped_with_what_to_install(monkeypatch):
    assert bench.inputs.unavailable(by_name("tiny_b1_h2_s128_d64_causal")) is None  # only hf_llama needs it
    _block_transformers(monkeypatch)
    why = bench.inputs.unavailable(by_name(HF_TINY))
    assert "transformers is not importable" in why and "pip install 'transformers>=5'" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing below may touch CUDA
    seen = []
    rows = bench.run([HF_TINY, HF_CASE], progress=lambda d, t, label: seen.append((d, t)))
    assert [(r.case, r.path) for r in rows] == [(c, p) for c in (HF_TINY, HF_CASE) for p in bench.HF_PATHS]
    assert all(r.status == "skipped" and r.reason == why and r.median_ms is None for r in rows)
    assert seen[-1] == (6, 6)
    assert "SKIPPED: transformers is not importable" in bench.format_table(rows)


def test_hf_llama_step_on_cpu_counts_every_attention_call():
    """The paths' steps and scopes on a CPU-sized Llama: every call falls back (no_cuda) but each is
    counted, as many as ``expected_calls`` says, and every implementation gets the same weights."""
    pytest.importorskip("transformers")
    case = Case("hf_cpu", "hf_llama", 2, 2, 1, 16, 8, True, seq_lens=bench.cases.padded_lengths(2, 16), layers=2)
    s = bench.inputs.HFSet(case, torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32)
    assert s.mask.tolist() == [[1] * 16, [1] * 8 + [0] * 8] and (s.labels[1, 8:] == -100).all()
    for path in bench.HF_PATHS:
        m = Measurement(path)
        with bench.paths.scope(m, {}):
            bench.paths.step(case, "fwd_bwd", path)(s)
        if path == "native":
            assert (m.served, m.fallback) == (0, {}), m  # nothing counted outside a provider scope
        else:
            assert m.served == 0 and m.fallback == {"no_cuda": bench.expected_calls(case, "fwd_bwd", 1)}, m
    sdpa, cudnn = s.model("sdpa").state_dict(), s.model("cudnn").state_dict()
    assert sdpa.keys() == cudnn.keys() and all(torch.equal(sdpa[k], cudnn[k]) for k in sdpa)
    assert s.model("cudnn").config._attn_implementation == "cudnn"


# ---------------------------------------------------------------------------- rows (pure data)


def _measured(path, times, **kw) -> Measurement:
    return Measurement(path, times_ms=list(times), **kw)


def test_summarize_median_spread_and_tflops():
    c = by_name("b4_h16_s4096_d128")
    row = bench.summarize(c, "fwd", _measured("native_cudnn", [9.0, 7.0, 8.0, 6.0, 10.0], calls=9, peak_mib=64.0),
                          inputs_mib=384.0, input_sets=1)
    assert row.status == "ok" and row.reason == ""
    assert row.median_ms == 8.0
    assert row.p20_ms == pytest.approx(6.8) and row.p80_ms == pytest.approx(9.2)  # linear interpolation
    assert row.tflops == pytest.approx(549_755_813_888 / 8e-3 / 1e12)  # 68.7
    assert (row.repeats, row.calls, row.peak_mib, row.served) == (5, 9, 64.0, None)


def test_summarize_provider_rows_never_claim_fallback_calls():
    c = by_name("tiny_b1_h2_s128_d64_causal")
    ok = bench.summarize(c, "fwd_bwd", _measured("provider", [1.0], calls=10, served=20), 0.1, 8)
    assert (ok.status, ok.served, ok.fallbacks) == ("ok", 20, 0)
    fell = bench.summarize(c, "fwd_bwd", _measured("provider", [1.0], calls=10, served=17,
                                                   fallback={"graph_not_supported": 3}), 0.1, 8)
    assert fell.status == "fallback" and "3 of 20" in fell.reason and "graph_not_supported=3" in fell.reason
    missing = bench.summarize(c, "fwd", _measured("provider", [1.0], calls=10, served=4), 0.1, 8)
    assert missing.status == "unserved" and "4 of 10" in missing.reason


def test_summarize_graphed_rows_expect_calls_only_from_python_steps():
    step = by_name("step_tinygqa_b2_s128")  # 2 attention layers per step
    # 4 steps through Python (3 warm-up + capture) and 40 replays: 4 x 2 layers x (fwd + bwd) = 16
    ok = bench.summarize(step, "fwd_bwd", _measured("provider_graphed", [0.1], calls=44, replays=40, served=16),
                         0.0, 1)
    assert (ok.status, ok.expected, ok.replays) == ("ok", 16, 40)
    short = bench.summarize(step, "fwd_bwd", _measured("provider_graphed", [0.1], calls=44, replays=40, served=8),
                            0.0, 1)
    assert short.status == "unserved" and "8 of 16" in short.reason
    eager = bench.summarize(step, "fwd_bwd", _measured("provider", [0.1], calls=10, served=40), 0.0, 1)
    assert eager.status == "ok" and eager.expected == 40


def test_summarize_skipped_and_error_rows_have_no_numbers():
    c = by_name("gqa_b1_h32kv8_s16384_d128_causal")
    skipped = bench.summarize(c, "fwd", Measurement("efficient", skip="RuntimeError: No available kernel"), 1.0, 1)
    assert skipped.status == "skipped" and skipped.median_ms is None and skipped.tflops is None
    err = bench.summarize(c, "fwd", Measurement("provider", skip="ValueError: x", error=True), 1.0, 1)
    assert err.status == "error" and err.reason == "ValueError: x"


def _row(case="b4_h16_s4096_d128", mode="fwd", path="native_cudnn", ms=2.0, **kw) -> Row:
    c = by_name(case)
    return Row(case, c.kind, mode, path, c.seq, c.causal, median_ms=ms, p20_ms=ms * 0.9 if ms else None,
               p80_ms=ms * 1.1 if ms else None, tflops=bench.flops(c, mode) / (ms * 1e-3) / 1e12 if ms else None,
               **kw)


def test_add_ratios_against_the_native_baseline():
    rows = [
        _row(path="provider", ms=1.0, served=20, fallbacks=0, calls=20),
        _row(path="native_cudnn", ms=2.0),
        _row(path="flash", ms=4.0),
        _row(path="efficient", ms=None, status="skipped", reason="no"),
        _row(case="tiny_b1_h2_s128_d64_causal", path="provider", ms=0.1, host_us=50.0),
        _row(case="tiny_b1_h2_s128_d64_causal", path="native_cudnn", ms=0.1, host_us=25.0),
        _row(case="varlen_n16_h16_d128_causal", path="provider", ms=3.0),
        _row(case="varlen_n16_h16_d128_causal", path="native_varlen", ms=6.0),
    ]
    bench.add_ratios(rows)
    assert [r.vs_native for r in rows] == [2.0, 1.0, 0.5, None, 1.0, 1.0, 2.0, 1.0]
    assert rows[4].host_vs_native == 0.5 and rows[5].host_vs_native == 1.0 and rows[0].host_vs_native is None


def test_add_ratios_padded_prefers_native_cudnn_then_native():
    case = "padded_b8_h32kv8_s4096_d128_causal"
    both = bench.add_ratios([_row(case=case, path="provider", ms=1.0), _row(case=case, path="native", ms=4.0),
                             _row(case=case, path="native_cudnn", ms=2.0)])
    assert [r.vs_native for r in both] == [2.0, 0.5, 1.0]
    declined = bench.add_ratios([_row(case=case, path="provider", ms=1.0), _row(case=case, path="native", ms=4.0),
                                 _row(case=case, path="native_cudnn", ms=None, status="skipped", reason="no")])
    assert [r.vs_native for r in declined] == [4.0, 1.0, None]


def test_format_table_shows_numbers_reasons_and_groups_cases():
    rows = bench.add_ratios([
        _row(path="provider", ms=1.0, served=40, fallbacks=0, calls=40, expected=40),
        _row(path="native_cudnn", ms=2.0),
        _row(path="efficient", ms=None, status="skipped", reason="RuntimeError: No available kernel"),
        _row(case="tiny_b1_h2_s128_d64_causal", path="provider", ms=0.1, host_us=80.0, calls=10, served=7, expected=10,
             fallbacks=3, status="fallback", reason="3 of 10 provider calls fell back (dtype=3)"),
    ])
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["case", "mode", "path"] and "TFLOP/s" in lines[0] and "host us" in lines[0]
    assert "" in lines  # a blank line between cases
    provider = next(line for line in lines if "provider" in line and "b4_h16" in line)
    assert "1.000" in provider and "2.00x" in provider and "40/40" in provider and "549.8" in provider
    assert "SKIPPED: RuntimeError: No available kernel" in text
    assert "FALLBACK: 3 of 10" in text and "7/10" in text and "80.0" in text


def test_to_json_round_trip_with_meta():
    rows = [_row(path="provider", ms=1.0, served=4, fallbacks=0, calls=4, fallback_reasons={}),
            _row(path="efficient", ms=None, status="skipped", reason="no")]
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0", "settings": {"repeats": 30}}
    data = json.loads(bench.to_json(rows, meta))
    assert data["meta"] == meta
    assert data["rows"] == [r.as_dict() for r in rows]
    assert data["rows"][1]["median_ms"] is None and data["rows"][0]["path"] == "provider"


def test_collect_meta_on_cpu():
    meta = bench.collect_meta(["cudnn-sdpa", "bench", "--quick"], repeats=5)
    assert meta["command"] == "cudnn-sdpa bench --quick"
    assert meta["settings"] == {"repeats": 5} and meta["torch"] == torch.__version__
    assert set(meta["cases"]) == {c.name for c in bench.KNOWN} > {c.name for c in bench.MATRIX}  # groups too
    assert meta["cases"]["fp8_b4_h32kv8_s8192_d128_causal"]["h_kv"] == 8
    assert meta["cases"]["varlen_n16_h16_d128_causal"]["seq_lens"] == bench.cases.varlen_lengths()
    assert meta["fp8_quantisation"].endswith("aten ops (no CUDA device)"), "the fp8 rows say what quantised"
    json.dumps(meta)


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install cudnn-sdpa-provider\[plot\]"):
        bench.plot([_row()], str(tmp_path / "x.png"))


def test_plot_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    rows = bench.add_ratios([_row(path="provider", ms=1.0), _row(path="native_cudnn", ms=2.0),
                             _row(mode="fwd_bwd", ms=5.0), _row(case="b2_h16_s8192_d128_causal", ms=3.0)])
    out = tmp_path / "bench.png"
    bench.plot(rows, str(out))
    assert out.stat().st_size > 0


# ------------------------------------------------------------------------ data only, no printing


def test_no_bench_module_prints():
    import pathlib

    for path in pathlib.Path(bench.__file__).parent.glob("*.py"):
        text = path.read_text()
        for needle in ("print(", "sys.stdout", "sys.stderr"):
            assert needle not in text, (path.name, needle)


def test_pyproject_installs_every_subpackage():
    import pathlib

    from setuptools import find_packages

    repo = pathlib.Path(__file__).resolve().parent.parent
    text = (repo / "pyproject.toml").read_text()
    assert 'include = ["cudnn_sdpa_provider", "cudnn_sdpa_provider.*"]' in text
    found = set(find_packages(str(repo), include=["cudnn_sdpa_provider", "cudnn_sdpa_provider.*"]))
    folders = {".".join(p.parent.relative_to(repo).parts) for p in (repo / "cudnn_sdpa_provider").rglob("__init__.py")}
    assert "cudnn_sdpa_provider.tools.bench" in found and found == folders, (found, folders)


def test_a_path_that_raises_is_recorded_and_logged_not_printed(caplog, capsys):
    def boom():
        raise RuntimeError("boom")

    live = bench.measure._Live("native")
    with caplog.at_level("ERROR", logger="cudnn_sdpa_provider.bench"):
        bench.measure._guard(live, boom, {})  # raises before any CUDA call
    assert (live.m.skip, live.m.error) == ("RuntimeError: boom", True)
    (record,) = caplog.records
    assert record.getMessage() == "bench: path native raised:" and record.exc_info[1].args == ("boom",)
    assert capsys.readouterr().out == ""
    assert bench.summarize(by_name("tiny_b1_h2_s128_d64_causal"), "fwd", live.m, 0.0, 1).status == "error"


# ------------------------------------------------------------------------------------------ CLI


def test_bench_on_cpu_exits_no_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host
    assert cli.main(["bench", "--quick"]) == cli.EXIT_NO_CUDA == 4
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "cudnn-sdpa bench: CUDA is not available" in captured.err


def test_run_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bench.BenchError, match="CUDA is not available"):
        bench.run(["tiny_b1_h2_s128_d64_causal"])


def test_bench_help_lists_the_options(capsys):
    assert cli.main(["bench", "--help"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    for option in ("--quick", "--shapes", "--cases", "--modes", "--repeats", "--warmup", "--json", "--plot", "--list"):
        assert option in out
    assert f"Exit status {cli.EXIT_NO_CUDA} when CUDA is not available" in " ".join(out.split())


def test_bench_help_defaults_match_the_presets(capsys):
    cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    d, q = bench.DEFAULT, bench.QUICK
    assert f"(default {d.repeats})" in out and f"(default {d.warmup})" in out
    assert f"{len(bench.QUICK_CASES)} cases, {q.repeats} repeats, {q.warmup} warm-up calls, {q.host_calls} " in out


def test_bench_bad_options_are_usage_errors(capsys):
    assert cli.main(["bench", "--shapes", "b4_h16_s4096_d128,nope"]) == cli.EXIT_USAGE
    assert "unknown bench case 'nope'" in capsys.readouterr().err
    assert cli.main(["bench", "--modes", "fwd,backward"]) == cli.EXIT_USAGE
    assert "Available modes" in capsys.readouterr().err
    assert cli.main(["bench", "--repeats", "0"]) == cli.EXIT_USAGE
    assert "repeats must be an int >= 1" in capsys.readouterr().err


def test_bench_without_matplotlib_says_so_at_once(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--plot", "x.png"]) == cli.EXIT_NO_CUDA
    err = capsys.readouterr().err
    assert "--plot x.png will not be written" in err and "pip install cudnn-sdpa-provider[plot]" in err


def _fake_run(monkeypatch, rows):
    """``bench`` end to end on CPU: CUDA claimed, ``bench.run`` replaced by canned rows."""
    calls = []

    def run(cases, **kw):
        calls.append(([c.name for c in cases], kw))
        kw["progress"](1, 1, "done")
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "collect_meta", lambda **settings: {"gpu": "fake", "settings": settings})
    return calls


def test_bench_cli_writes_table_and_json(monkeypatch, capsys, tmp_path):
    rows = bench.add_ratios([_row(path="provider", ms=1.0, served=2, fallbacks=0, calls=2), _row(ms=2.0)])
    calls = _fake_run(monkeypatch, rows)
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--modes", "fwd", "--repeats", "7", "--json", str(out)]
    assert cli.main(argv) == cli.EXIT_OK
    (names, kw), = calls
    assert names == list(bench.QUICK_CASES) and callable(kw.pop("progress")) and kw.pop("peers") is None
    assert kw == dict(modes=("fwd",), repeats=7, warmup=bench.QUICK.warmup, host_calls=bench.QUICK.host_calls)
    captured = capsys.readouterr()
    assert captured.out.strip() == bench.format_table(rows)
    assert "1/1 done" in captured.err  # the progress bar goes to stderr
    data = json.loads(out.read_text())
    assert data["rows"] == [r.as_dict() for r in rows]
    assert data["meta"]["settings"] == {"quick": True, "modes": ["fwd"], "cases": list(bench.QUICK_CASES),
                                        "repeats": 7, "warmup": bench.QUICK.warmup,
                                        "host_calls": bench.QUICK.host_calls}


def test_bench_cli_without_matplotlib_keeps_results_and_fails(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    _fake_run(monkeypatch, [_row(ms=2.0)])
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--shapes", "b4_h16_s4096_d128", "--json", str(out), "--plot", "p.png"]) == \
        cli.EXIT_FAILURE
    captured = capsys.readouterr()
    assert "b4_h16_s4096_d128" in captured.out and out.exists()
    assert captured.err.count("--plot p.png will not be written") == 2  # before the run and after it


def test_bench_cli_writes_the_plot(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    _fake_run(monkeypatch, bench.add_ratios([_row(path="provider", ms=1.0), _row(ms=2.0)]))
    out = tmp_path / "bench.png"
    assert cli.main(["bench", "--plot", str(out)]) == cli.EXIT_OK
    assert out.stat().st_size > 0


def test_bench_list_works_without_cuda(capsys):
    assert cli.main(["bench", "--list"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert all(c.name in out for c in bench.KNOWN) and all(f"\n{g} " in out for g in bench.GROUPS)


def test_progress_line():
    assert cli._progress_line(0, 4, "x", width=8) == "[........] 0/4 x"
    assert cli._progress_line(2, 4, "a b", width=8) == "[####....] 2/4 a b"
    assert cli._progress_line(4, 4, "done", width=8) == "[########] 4/4 done"


def test_progress_writes_lines_when_not_a_tty():
    import io

    stream = io.StringIO()
    show = cli._progress(stream)
    show(1, 2, "one")
    show(2, 2, "two")
    assert stream.getvalue().splitlines() == [cli._progress_line(1, 2, "one"), cli._progress_line(2, 2, "two")]


def test_peer_paths_are_checked_before_anything_runs():
    for bad in ("provider_x", "native_cudnn", "flash", "provider_hf"):
        with pytest.raises(ValueError, match="peer path name"):
            bench.run(["tiny_b1_h2_s128_d64_causal"], peers={bad: None})
    peers = {"nvidia_x": None}
    assert bench.cases.case_paths(by_name("tiny_b1_h2_s128_d64_causal"), peers)[-1] == "nvidia_x"
    assert "nvidia_x" not in bench.cases.case_paths(by_name("padded_b8_h32kv8_s4096_d128_causal"), peers)  # masks
    assert "nvidia_x" not in bench.cases.case_paths(by_name("step_tinygqa_b2_s128"), peers)
    assert "nvidia_x" not in bench.cases.case_paths(by_name(HF_TINY), peers)


def test_peer_script_lists_cases_without_cuda():
    import subprocess

    script = __import__("pathlib").Path(__file__).resolve().parent.parent / "scripts" / "bench_peer.py"
    out = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "step_tinygqa_b2_s128" in out.stdout, out
