"""GPU tier: smoke runs of ``cudnn-sdpa bench`` at tiny sizes (no speed asserted): every row timed,
every provider call served."""

from __future__ import annotations

import pytest

from cudnn_sdpa_provider.tools import bench

pytestmark = pytest.mark.gpu

TINY = "tiny_b1_h2_s128_d64_causal"


def test_quick_tiny_run_rows_served_and_timed():
    seen = []
    rows = bench.run([TINY], repeats=4, warmup=1, host_calls=10, progress=lambda d, t, label: seen.append((d, t)))
    by = {(r.path, r.mode): r for r in rows}
    assert seen[-1] == (len(rows), len(rows)) == (8, 8)
    for mode in bench.MODES:
        for path in ("provider", "native_cudnn"):
            r = by[(path, mode)]
            assert r.status == "ok", r
            assert r.median_ms > 0 and r.p20_ms <= r.median_ms <= r.p80_ms and r.tflops > 0, r
            assert r.host_us > 0 and r.repeats == 4 and r.peak_mib is not None, r
        provider = by[("provider", mode)]
        calls_per_step = 2 if mode == "fwd_bwd" else 1  # a forward and a backward
        assert provider.fallbacks == 0 and provider.fallback_reasons == {}, provider
        assert provider.served == provider.calls * calls_per_step > 0, provider
        assert provider.vs_native > 0 and by[("native_cudnn", mode)].vs_native == 1.0
    for r in rows:
        assert r.status in ("ok", "skipped"), r  # flash / efficient run this shape on Hopper, or say why not
    assert bench.format_table(rows)


def test_padded_and_graphed_step_cases_run_served():
    padded = bench.Case("padded_small", "padded", 2, 8, 2, 512, 64, True, seq_lens=bench.cases.padded_lengths(2, 512))
    step = bench.select(["step_tinygqa_b2_s128"])[0]
    rows = bench.run([padded, step], repeats=3, warmup=1, host_calls=5)
    by = {(r.case, r.mode, r.path): r for r in rows}
    assert len(rows) == len(bench.PADDED_PATHS) * 2 + len(bench.STEP_PATHS)  # step cases: fwd_bwd only
    for mode in bench.MODES:
        for path in ("provider", "provider_bias"):  # lengths, and the mask as a cuDNN bias
            r = by[("padded_small", mode, path)]
            assert r.status == "ok" and r.fallbacks == 0 and r.served == r.expected > 0, r
    for path in bench.STEP_PATHS:
        r = by[(step.name, "fwd_bwd", path)]
        assert r.status == "ok" and r.host_us > 0 and r.tflops is None, (r.reason, r)  # the reason first
    graphed = by[(step.name, "fwd_bwd", "provider_graphed")]
    python_steps = bench.GRAPH_WARMUP_STEPS + 1
    assert graphed.expected == python_steps * step.layers * 2 == graphed.served, graphed
    assert graphed.replays == graphed.calls - python_steps > 0, graphed
    for r in rows:
        assert r.status in ("ok", "skipped"), r


def test_hf_llama_tiny_step_every_provider_call_served():
    import transformers  # noqa: F401 - the GPU box has transformers 5.x: a missing one is a failure, not a skip

    case = bench.select(["hf_llama_l2_d256_b2_s256_padded"])[0]
    seen = []
    rows = bench.run([case], repeats=3, warmup=1, host_calls=5, progress=lambda d, t, label: seen.append((d, t)))
    by = {r.path: r for r in rows}
    assert [r.path for r in rows] == list(bench.HF_PATHS) and {r.mode for r in rows} == {"fwd_bwd"}
    assert seen[-1] == (3, 3)
    for r in rows:
        assert r.status == "ok", (r.reason, r)  # the reason first
        assert r.median_ms > 0 and r.p20_ms <= r.median_ms <= r.p80_ms and r.tflops is None, r
        assert r.peak_mib > 0 and r.vs_native > 0 and r.repeats == 3, r
    for path in ("provider", "provider_hf"):  # sdpa inside enable(): the bias path; "cudnn": lengths
        r = by[path]
        assert r.fallbacks == 0 and r.fallback_reasons == {}, r
        assert r.served == r.expected == r.calls * case.layers * 2 > 0, r  # each layer: a forward and a backward
    assert by["native"].vs_native == 1.0 and by["native"].served is None


def test_fp8_case_small_every_path_timed_and_every_fp8_call_served():
    """One small fp8 case, causal, and a GQA batch without the mask: the four paths timed in both
    modes on refilled inputs, every provider and FP8 call served, the ratios side by side."""
    from cudnn_sdpa_provider.tools.bench import fp8_case

    small = bench.Case("fp8_small_causal", "fp8", 1, 8, 8, 1024, 128, True)
    gqa = bench.Case("fp8_small_gqa", "fp8", 2, 8, 2, 1024, 128, False)
    rows = bench.run([small, gqa], repeats=3, warmup=1)
    assert [(r.case, r.mode, r.path) for r in rows] == [(c.name, m, p) for c in (small, gqa) for m in bench.MODES
                                                          for p in bench.FP8_PATHS]
    for r in rows:
        assert r.status == "ok", (r.case, r.mode, r.path, r.reason)  # the reason first
        assert r.median_ms > 0 and r.p20_ms <= r.median_ms <= r.p80_ms and r.tflops > 0 and r.vs_native > 0, r
        assert r.input_sets >= fp8_case.MIN_SETS and r.repeats == 3, r
        if r.path == "native":
            assert r.vs_native == 1.0 and r.served is None, r
        else:  # provider: dense_fwd/bwd; fp8_*: fp8_fwd/bwd, a forward (and a backward) per call
            assert r.fallbacks == 0 and r.served == r.expected == r.calls * (2 if r.mode == "fwd_bwd" else 1) > 0, r
    entries = fp8_case.ratio_entries(rows)
    assert len(entries) == 4 and all(e["native_ms"] > 0 for e in entries)
    assert all(e["paths"][p]["vs_native"] > 0 for e in entries for p in ("provider", "fp8_delayed", "fp8_current"))
    assert "FP8 end to end from bf16 activations" in bench.format_table(rows)
