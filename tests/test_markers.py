"""CPU tier: markers, how a backward finds what its forward did (keyed by a tensor's storage)."""

from __future__ import annotations

import gc

import torch

from cudnn_sdpa_provider.core import markers

SERVED = markers.Record(served=True)
FELL_BACK = markers.Record(served=False, reason="no_cuda")


def test_mark_and_lookup_by_storage():
    philox = torch.empty(2, dtype=torch.int64)
    before = markers.pending()
    markers.mark(philox, SERVED)
    assert markers.pending() == before + 1
    # The aten ops hand the backward philox[0] / philox[1]: views of the same storage.
    assert markers.lookup(philox) is SERVED
    assert markers.lookup(philox[1]) is SERVED
    assert markers.lookup(philox.view(1, 2)) is SERVED
    assert markers.lookup(torch.empty(2, dtype=torch.int64)) is None
    assert markers.lookup(None) is None


def test_record_vanishes_with_its_storage():
    before = markers.pending()
    t = torch.zeros(2, dtype=torch.uint64)
    markers.mark(t, FELL_BACK)
    view = t[1]
    assert markers.pending() == before + 1
    del t
    gc.collect()
    assert markers.lookup(view) is FELL_BACK, "a view keeps the storage (and the record) alive"
    del view
    gc.collect()
    assert markers.pending() == before


def test_on_empty_fires_when_the_last_record_goes(monkeypatch):
    monkeypatch.setattr(markers, "_records", {})  # records other tests may still hold stay out of this
    calls = []

    def listener():
        calls.append(markers.pending())

    markers.on_empty(listener)
    try:
        a, b = torch.empty(2), torch.empty(2)
        markers.mark(a, SERVED)
        markers.mark(b, SERVED)
        del a
        gc.collect()
        assert calls == [] and markers.pending() == 1
        del b
        gc.collect()
        assert calls == [0], "called exactly once, after the last record went"
    finally:
        markers._listeners.remove(listener)


def test_a_failing_listener_never_breaks_deallocation():
    def broken():
        raise RuntimeError("listener failed")

    markers.on_empty(broken)
    try:
        t = torch.empty(2)
        markers.mark(t, SERVED)
        del t
        gc.collect()  # filterwarnings=error would turn an "Exception ignored" into a failure
    finally:
        markers._listeners.remove(broken)
