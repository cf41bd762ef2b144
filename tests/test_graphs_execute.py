"""CPU tier: ``graphs.execute`` with a stand-in graph (no cuDNN call is made): ordered buffers on
frontends 1.31+, the mapping form before, and the handle re-bound only when the stream changes."""

from __future__ import annotations

import types

import pytest

from cudnn_sdpa_provider.engine import graphs
from cudnn_sdpa_provider.engine.graphs import UID


class FakeGraph:
    def __init__(self, ordered: bool):
        self.ordered = ordered
        self.calls = []

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        if tensor_uids is not None and not self.ordered:  # what pybind says to an old frontend's caller
            raise TypeError("execute(): incompatible function arguments")
        self.calls.append((buffers, tensor_uids, handle))


@pytest.fixture
def bound(monkeypatch):
    streams = []
    monkeypatch.setattr(graphs, "_handle", lambda device: f"handle{device}")
    monkeypatch.setattr(graphs, "cudnn", types.SimpleNamespace(set_stream=lambda handle, stream: streams.append(
        (handle, stream))))
    monkeypatch.setattr(graphs._tls, "state", None, raising=False)  # this thread starts with no bound streams
    return streams


@pytest.mark.parametrize("version, ordered", [("1.28.0", False), ("1.30.9", False), ("1.31.0", True),
                                              ("1.32.0", True), ("2.0.0", True), (None, False), ("1.x", False)])
def test_ordered_form_from_frontend_1_31(version, ordered):
    assert graphs.ordered_execute(version) is ordered


def test_ordered_buffers(bound, monkeypatch):
    monkeypatch.setattr(graphs, "_ORDERED", True)
    g = FakeGraph(ordered=True)
    plan = graphs.Plan(graph=g, workspace=0, name="x")
    uids = (int(UID.Q), int(UID.K), int(UID.O))
    graphs.execute(plan, uids, ("q", "k", "o"), 0, 7)
    assert g.calls == [(("q", "k", "o"), uids, "handle0")]
    assert all(type(u) is int for u in g.calls[0][1])  # plain ints, as pybind wants, not IntEnum members


def test_mapping_form(bound, monkeypatch):
    monkeypatch.setattr(graphs, "_ORDERED", False)
    g = FakeGraph(ordered=False)
    plan = graphs.Plan(graph=g, workspace=0, name="x")
    graphs.execute(plan, (int(UID.Q), int(UID.O)), ("q", "o"), 0, 7)
    assert g.calls == [({int(UID.Q): "q", int(UID.O): "o"}, None, "handle0")]


def test_stream_bound_only_when_it_changes(bound):
    plan = graphs.Plan(graph=FakeGraph(ordered=True), workspace=0, name="x")
    for device, stream in ((0, 7), (0, 7), (0, 9), (1, 9), (0, 9), (1, 7)):
        graphs.execute(plan, (int(UID.Q),), ("q",), device, stream)
    assert bound == [("handle0", 7), ("handle0", 9), ("handle1", 9), ("handle1", 7)]
