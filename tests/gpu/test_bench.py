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
