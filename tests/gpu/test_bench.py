"""GPU tier: a smoke run of ``cudnn-sdpa bench`` at the tiny host-cost shape (no speed asserted)."""

from __future__ import annotations

import pytest

from cudnn_sdpa_provider import bench

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
