"""CPU tier: choosing a graph's plan by timing (``tuning``, ``CUDNN_SDPA_PROVIDER_AUTOTUNE``) with a
stand-in graph whose plans write known outputs and a timer that reports known times, and its use by
``graphs.execute`` (tuned once, outside CUDA-graph captures, then run by index)."""

from __future__ import annotations

import logging

import pytest
import torch

from cudnn_sdpa_provider import env, graphs, tuning


class PlansGraph:
    """Plans by index: name, workspace, device ms and the value each writes into the output."""

    def __init__(self, plans, broken=()):
        self.plans = plans  # [(name, ms, value)]
        self.broken = set(broken)  # indices whose workspace query raises (not built)
        self.ran: list = []  # ("index", i) or ("default",) per execute
        self.out = torch.zeros(4)

    def get_execution_plan_count(self):
        return len(self.plans)

    def get_plan_name_at_index(self, i):
        return self.plans[i][0]

    def get_workspace_size_plan_at_index(self, i):
        if i in self.broken:
            raise RuntimeError("not built")
        return 0

    def execute_plan_at_index(self, buffers, workspace, index=0, handle=None, tensor_uids=None):
        self.ran.append(("index", index))
        buffers[1].fill_(self.plans[index][2])

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        self.ran.append(("default",))
        buffers[1].fill_(self.plans[0][2])


def _timer(graph):
    def timer(fn):
        fn()
        return graph.plans[graph.ran[-1][1]][1]
    return timer


def _choose(graph, default="h"):
    out = torch.zeros(4)
    return tuning.choose(graph, lambda i, ws: graph.execute_plan_at_index((None, out), ws, index=i), [out], default,
                         0, timer=_timer(graph))


def test_the_fastest_agreeing_plan_replaces_the_heuristics():
    g = PlansGraph([("h", 1.00, 1.0), ("a", 0.95, 1.0001), ("b", 0.90, 1.0)])
    assert _choose(g) == (2, 0, "b")


def test_a_plan_within_the_noise_margin_or_slower_keeps_the_heuristics():
    assert _choose(PlansGraph([("h", 1.00, 1.0), ("a", 1.0 - tuning.MIN_GAIN / 2, 1.0)])) is None
    assert _choose(PlansGraph([("h", 1.00, 1.0), ("a", 1.50, 1.0)])) is None


def test_a_faster_plan_that_computes_something_else_is_never_chosen(caplog):
    g = PlansGraph([("h", 1.00, 1.0), ("wrong", 0.50, 1.5), ("b", 0.90, 1.0)])
    with caplog.at_level(logging.WARNING, logger="cudnn_sdpa_provider"):
        assert _choose(g) is None  # the fastest disagrees: the heuristic's plan stays
    assert "disagrees" in caplog.text


def test_unbuilt_plans_are_skipped_and_nothing_is_chosen_without_the_heuristics_plan():
    g = PlansGraph([("h", 1.00, 1.0), ("x", 0.10, 1.0), ("b", 0.80, 1.0)], broken={1})
    assert _choose(g) == (2, 0, "b")
    assert _choose(PlansGraph([("h", 1.0, 1.0)])) is None  # one plan: nothing to choose
    assert _choose(PlansGraph([("a", 1.0, 1.0), ("b", 0.5, 1.0)]), default="h") is None


def test_agree_compares_relative_to_the_reference_magnitude_and_nan_positions():
    ref = torch.tensor([1.0, -2.0, float("nan")])
    assert tuning.agree([ref + 0.01], [ref])
    assert not tuning.agree([ref + 0.1], [ref])
    assert not tuning.agree([torch.tensor([1.0, -2.0, 0.0])], [ref])  # NaN where the reference has none


@pytest.fixture
def executing(monkeypatch):
    monkeypatch.setattr(graphs, "_handle", lambda device: "handle")
    monkeypatch.setattr(graphs, "_ORDERED", True)
    monkeypatch.setattr(graphs, "cudnn", type("C", (), {"set_stream": staticmethod(lambda handle, stream: None)}))
    graphs.clear_cache()


def test_execute_tunes_once_outside_captures_then_runs_the_chosen_plan(executing, monkeypatch):
    g = PlansGraph([("h", 1.00, 1.0), ("b", 0.80, 1.0)])
    p = graphs.Plan(graph=g, workspace=0, name="h", outputs=frozenset({int(graphs.UID.O)}), tune=True, label="x")
    monkeypatch.setattr(tuning, "cuda_timer", _timer(g))  # CUDA events need a GPU
    uids, buffers = (int(graphs.UID.Q), int(graphs.UID.O)), (torch.zeros(4), torch.zeros(4))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    graphs.execute(p, uids, buffers, None, 0)
    assert p.tune and p.index is None and g.ran == [("default",)], "no tuning inside a capture"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs.execute(p, uids, buffers, None, 0)
    assert not p.tune and (p.index, p.name) == (1, "b")
    g.ran.clear()
    graphs.execute(p, uids, buffers, None, 0)
    assert g.ran == [("index", 1)], "later calls run the chosen plan, untimed"


def test_the_environment_switch():
    assert env.parse_flag(env.AUTOTUNE, "1").value is True and env.parse_flag(env.AUTOTUNE, " On ").value is True
    assert env.parse_flag(env.AUTOTUNE, None).value is False and env.parse_flag(env.AUTOTUNE, "0").value is False
    bad = env.parse_flag(env.AUTOTUNE, "fast")
    assert bad.value is False and env.AUTOTUNE in bad.warning and "1 (on) or 0 (off)" in bad.warning


def test_a_frontend_that_cannot_build_every_plan_keeps_the_heuristics_plan(monkeypatch):
    class Policy:
        ALL = "all"

    monkeypatch.setattr(graphs, "cudnn", type("C", (), {"build_plan_policy": Policy}))
    built = []

    class G:
        def __init__(self, fails):
            self.fails = fails

        def build_plans(self, *policy):
            built.append(policy)
            if self.fails:
                raise RuntimeError("no ALL here")

    assert graphs._build_all(G(fails=False)) is True and built == [("all",)]
    assert graphs._build_all(G(fails=True)) is False  # the caller then builds the first plan as usual
