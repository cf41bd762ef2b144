"""CPU tier: ``graphs.execute``'s host-cost choices with a stand-in graph (no cuDNN call is made):
ordered buffers where the frontend takes them, the mapping form where it does not, and the handle
re-bound only when the stream changes."""

from __future__ import annotations

import types

import pytest

from cudnn_sdpa_provider import graphs
from cudnn_sdpa_provider.graphs import UID


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


def test_ordered_buffers_where_the_frontend_takes_them(bound):
    g = FakeGraph(ordered=True)
    plan = graphs.Plan(graph=g, workspace=0, name="x")
    buffers = {UID.Q: "q", UID.K: "k", UID.O: "o"}
    graphs.execute(plan, buffers, 0, 7)
    assert plan.ordered is True
    assert g.calls == [(("q", "k", "o"), (int(UID.Q), int(UID.K), int(UID.O)), "handle0")]
    assert all(type(u) is int for u in g.calls[0][1])


def test_mapping_form_on_older_frontends_decided_once(bound):
    g = FakeGraph(ordered=False)
    plan = graphs.Plan(graph=g, workspace=0, name="x")
    buffers = {UID.Q: "q", UID.O: "o"}
    graphs.execute(plan, buffers, 0, 7)
    graphs.execute(plan, buffers, 0, 7)
    assert plan.ordered is False
    assert g.calls == [(buffers, None, "handle0")] * 2  # the failed ordered try made no call


def test_a_type_error_after_ordered_worked_is_raised(bound):
    g = FakeGraph(ordered=True)
    plan = graphs.Plan(graph=g, workspace=0, name="x", ordered=True)
    g.ordered = False  # the same graph now refuses: a real error, not an old frontend
    with pytest.raises(TypeError):
        graphs.execute(plan, {UID.Q: "q"}, 0, 7)


def test_stream_bound_only_when_it_changes(bound):
    plan = graphs.Plan(graph=FakeGraph(ordered=True), workspace=0, name="x")
    for device, stream in ((0, 7), (0, 7), (0, 9), (1, 9), (0, 9), (1, 7)):
        graphs.execute(plan, {UID.Q: "q"}, device, stream)
    assert bound == [("handle0", 7), ("handle0", 9), ("handle1", 9), ("handle1", 7)]
