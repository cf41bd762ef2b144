"""CPU tier: the telemetry counters (public API: five paths, served / fallback[reason])."""

from __future__ import annotations

import json
import logging
import threading
from types import MappingProxyType

import pytest

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from cudnn_sdpa_provider.core.reasons import PATHS

EMPTY = {p: {"served": 0, "fallback": {}} for p in PATHS}


@pytest.fixture(autouse=True)
def _zeroed():
    counters.reset_stats()
    yield
    counters.reset_stats()


def make_stats(served=None, fallback=None, plans=None) -> counters.Stats:
    served = {p: 0 for p in PATHS} | (served or {})
    fallback = {p: {} for p in PATHS} | (fallback or {})
    return counters.Stats(MappingProxyType(served), MappingProxyType({p: MappingProxyType(r) for p, r in
                                                                      fallback.items()}),
                          MappingProxyType(plans or {}))


def test_paths_are_the_seven_public_names():
    assert PATHS == ("dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd", "paged_fwd", "fp8_fwd", "fp8_bwd")
    assert csp.PATHS is PATHS


def test_to_dict_is_exactly_the_paths_served_and_fallback():
    counters.record("dense_fwd")
    counters.record("dense_fwd")
    counters.record("dense_bwd", "no_cuda")
    counters.record("varlen_fwd", "dtype")
    counters.record("varlen_fwd", "dtype")
    counters.record("varlen_fwd", "head_dim")
    d = csp.stats().to_dict()
    assert d == {
        "dense_fwd": {"served": 2, "fallback": {}},
        "dense_bwd": {"served": 0, "fallback": {"no_cuda": 1}},
        "varlen_fwd": {"served": 0, "fallback": {"dtype": 2, "head_dim": 1}},
        "varlen_bwd": {"served": 0, "fallback": {}},
        "paged_fwd": {"served": 0, "fallback": {}},
        "fp8_fwd": {"served": 0, "fallback": {}},
        "fp8_bwd": {"served": 0, "fallback": {}},
    }
    assert list(d) == list(PATHS)
    for entry in d.values():
        assert set(entry) == {"served", "fallback"}
        assert type(entry["served"]) is int and type(entry["fallback"]) is dict
    assert json.loads(json.dumps(d)) == d


def test_fresh_and_reset_stats_are_empty():
    assert counters.Stats().to_dict() == EMPTY
    counters.record("varlen_bwd")
    counters.record("dense_fwd", "dropout")
    assert csp.stats().to_dict() != EMPTY
    csp.reset_stats()
    assert csp.stats().to_dict() == EMPTY


def test_snapshot_is_immutable_and_independent():
    snap = csp.stats()
    counters.record("dense_fwd", "no_cuda")
    assert snap.to_dict() == EMPTY, "a snapshot does not follow later records"
    with pytest.raises(TypeError):
        snap.served["dense_fwd"] = 5  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.fallback["dense_fwd"]["x"] = 1  # type: ignore[index]
    d = csp.stats().to_dict()
    d["dense_fwd"]["fallback"]["no_cuda"] = 99
    assert csp.stats().to_dict()["dense_fwd"]["fallback"] == {"no_cuda": 1}


def test_diff_and_subtraction_give_the_region():
    counters.record("dense_fwd")
    counters.record("dense_bwd", "no_cuda")
    before = csp.stats()
    counters.record("dense_fwd")
    counters.record("dense_bwd", "no_cuda")
    counters.record("dense_bwd", "dtype")
    after = csp.stats()
    region = after - before
    assert region.to_dict() == after.diff(before).to_dict()
    assert region.to_dict() == EMPTY | {
        "dense_fwd": {"served": 1, "fallback": {}},
        "dense_bwd": {"served": 0, "fallback": {"no_cuda": 1, "dtype": 1}},
    }
    assert (after - after).to_dict() == EMPTY, "reasons with zero delta are dropped"
    assert region.total("dense_bwd") == 2 and region.fallbacks("dense_bwd") == 2 and region.total("dense_fwd") == 1


@pytest.mark.parametrize("other", [3, None, {"dense_fwd": 0}])
def test_diff_rejects_non_stats(other):
    with pytest.raises(TypeError, match="can only subtract Stats"):
        csp.stats() - other


def test_rows_sort_reasons_by_count_then_name():
    s = make_stats(served={"dense_fwd": 3}, fallback={"dense_bwd": {"dtype": 1, "no_cuda": 4, "attn_bias": 1}})
    assert s.rows() == [
        ("dense_fwd", 3, 0, "-"),
        ("dense_bwd", 0, 6, "no_cuda=4, attn_bias=1, dtype=1"),
        ("varlen_fwd", 0, 0, "-"),
        ("varlen_bwd", 0, 0, "-"),
        ("paged_fwd", 0, 0, "-"),
        ("fp8_fwd", 0, 0, "-"),
        ("fp8_bwd", 0, 0, "-"),
    ]


def test_format_table_exact_text():
    s = make_stats(served={"dense_fwd": 12}, fallback={"dense_bwd": {"no_cuda": 3}})
    assert counters.format_table(s) == (
        "path        served  fallback  fallback reasons\n"
        "dense_fwd       12         0  -\n"
        "dense_bwd        0         3  no_cuda=3\n"
        "varlen_fwd       0         0  -\n"
        "varlen_bwd       0         0  -\n"
        "paged_fwd        0         0  -\n"
        "fp8_fwd          0         0  -\n"
        "fp8_bwd          0         0  -"
    )


def test_format_table_lists_plans():
    s = make_stats(plans={"dense_fwd B=1": "eng9", "a config": "eng2"})
    lines = counters.format_table(s).splitlines()
    assert lines[-3:] == ["cuDNN plans:", "  eng2  <- a config", "  eng9  <- dense_fwd B=1"]


def test_report_uses_format_table():
    counters.record("varlen_fwd", "no_cuda")
    assert csp.report() == counters.format_table(csp.stats())
    assert "no_cuda=1" in csp.report()
    assert csp.report(counters.Stats()) == counters.format_table(counters.Stats())


def test_record_is_thread_safe():
    reasons = ("no_cuda", "dtype", None, "head_dim")
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        for n in range(500):
            counters.record(PATHS[(i + n) % 4], reasons[n % 4])  # the first four paths

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = csp.stats().to_dict()
    assert sum(d[p]["served"] + sum(d[p]["fallback"].values()) for p in PATHS) == 8 * 500
    # Each path gets each (n % 4) class the same number of times: 8 threads * 500 / 16.
    for p in PATHS[:4]:
        assert d[p]["served"] == 250
        assert d[p]["fallback"] == {"no_cuda": 250, "dtype": 250, "head_dim": 250}


def test_log_once_logs_once_per_key(caplog):
    caplog.set_level(logging.INFO, logger="cudnn_sdpa_provider")
    key_a, key_b = object(), object()  # fresh keys: the log-once memory is process-wide
    for _ in range(3):
        counters.log_once(key_a, logging.INFO, "config %s falls back", "A")
    counters.log_once(key_b, logging.WARNING, "config %s falls back", "B")
    counters.log_once(key_b, logging.WARNING, "config %s falls back", "B")
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [
        ("cudnn_sdpa_provider", logging.INFO, "config A falls back"),
        ("cudnn_sdpa_provider", logging.WARNING, "config B falls back"),
    ]


def test_reset_keeps_plans():
    counters.note_plan("test_reset_keeps_plans config", "eng0")
    csp.reset_stats()
    assert csp.stats().plans["test_reset_keeps_plans config"] == "eng0"


def test_unknown_path_and_wrong_report_argument_name_the_valid_choices():
    import cudnn_sdpa_provider as csp

    with pytest.raises(ValueError, match=r"unknown path 'dense'; valid paths: \['dense_fwd', 'dense_bwd', "):
        csp.stats().total("dense")
    with pytest.raises(ValueError, match="unknown path"):
        csp.stats().fallbacks("x")
    with pytest.raises(TypeError, match=r"report\(\) takes a Stats snapshot \(csp.stats\(\)\) or nothing, got str"):
        csp.report("x")
