"""CPU tier: choosing a graph's plan by timing (``tuning``, ``CUDNN_SDPA_PROVIDER_AUTOTUNE``) with a
stand-in graph whose plans write known outputs and a timer that reports known times, and its use by
``graphs.execute`` (tuned once, outside CUDA-graph captures, then run by index)."""

from __future__ import annotations

import logging

import pytest
import torch

from cudnn_sdpa_provider.core import env
from cudnn_sdpa_provider.engine import graphs, tuning


class PlansGraph:
    """Plans by index: name, device ms, the value each writes into the output, and workspace bytes
    (100 x the index + 1, so a returned size names its plan)."""

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
        return 100 * i + 1

    def execute_plan_at_index(self, buffers, workspace, index=0, handle=None, tensor_uids=None):
        assert workspace is not None and workspace.numel() == 100 * index + 1, "each plan gets its own workspace"
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


def _alloc(size):
    return torch.empty(size, dtype=torch.uint8)


def _choose(graph, default=0):
    out = torch.zeros(4)
    return tuning.choose(graph, lambda i, ws: graph.execute_plan_at_index((None, out), ws, index=i), [out], default,
                         0, timer=_timer(graph), alloc=_alloc)


def test_the_fastest_plan_that_agrees_replaces_the_heuristics():
    g = PlansGraph([("h", 1.00, 1.0), ("a", 0.95, 1.0001), ("b", 0.90, 1.0)])
    assert _choose(g) == (2, 201, "b")
    g = PlansGraph([("b", 0.90, 1.0), ("h", 1.00, 1.0), ("c", 0.99, 1.0)])  # the heuristic's plan need not be first
    assert _choose(g, default=1) == (0, 1, "b")


def test_a_plan_within_the_noise_margin_or_slower_keeps_the_heuristics():
    assert _choose(PlansGraph([("h", 1.00, 1.0), ("a", 1.0 - tuning.MIN_GAIN / 2, 1.0)])) is None
    assert _choose(PlansGraph([("h", 1.00, 1.0), ("a", 1.50, 1.0)])) is None


def test_a_faster_plan_that_computes_something_else_is_never_chosen(caplog):
    g = PlansGraph([("h", 1.00, 1.0), ("wrong", 0.50, 1.5), ("b", 0.90, 1.0)])
    with caplog.at_level(logging.WARNING, logger="cudnn_sdpa_provider"):
        assert _choose(g) == (2, 201, "b")  # the fastest disagrees: the next one that agrees
    assert "disagrees" in caplog.text
    assert _choose(PlansGraph([("h", 1.00, 1.0), ("wrong", 0.50, 1.5)])) is None


def test_unbuilt_plans_are_skipped_and_nothing_is_chosen_without_the_heuristics_plan():
    g = PlansGraph([("h", 1.00, 1.0), ("x", 0.10, 1.0), ("b", 0.80, 1.0)], broken={1})
    assert _choose(g) == (2, 201, "b")
    assert _choose(PlansGraph([("h", 1.0, 1.0)])) is None  # one plan: nothing to choose
    assert _choose(PlansGraph([("a", 1.0, 1.0), ("b", 0.5, 1.0)], broken={0})) is None  # the heuristic's unbuilt


def test_agree_compares_finite_values_relative_to_the_reference_and_non_finite_ones_exactly():
    inf = float("inf")
    ref = torch.tensor([1.0, -2.0, float("nan"), -inf])
    assert tuning.agree([ref + 0.01], [ref])
    assert not tuning.agree([ref + 0.1], [ref])
    assert not tuning.agree([torch.tensor([1.0, -2.0, 0.0, -inf])], [ref])  # NaN where the reference has none
    assert not tuning.agree([torch.tensor([50.0, -2.0, inf])], [torch.tensor([1.0, -2.0, inf])])  # inf is no scale
    assert not tuning.agree([torch.tensor([1.0, -2.0, inf])], [torch.tensor([1.0, -2.0, -inf])])


def _cpu_empty(empty):
    def cpu(*args, **kwargs):
        kwargs.pop("device", None)
        return empty(*args, **kwargs)
    return cpu


@pytest.fixture
def executing(monkeypatch):
    monkeypatch.setattr(graphs, "_handle", lambda device: "handle")
    monkeypatch.setattr(graphs, "_ORDERED", True)
    monkeypatch.setattr(graphs, "cudnn", type("C", (), {"set_stream": staticmethod(lambda handle, stream: None)}))
    graphs.clear_cache()


def test_execute_tunes_once_outside_captures_then_runs_the_chosen_plan(executing, monkeypatch):
    g = PlansGraph([("h", 1.00, 1.0), ("wrong", 0.50, 9.0), ("b", 0.80, 1.0)])  # the graph writes uid O's buffer
    p = graphs.Plan(graph=g, workspace=1, name="h", outputs=frozenset({int(graphs.UID.O)}), tune=True, label="x")
    monkeypatch.setattr(tuning, "_cuda_workspace", lambda device: _alloc)
    monkeypatch.setattr(torch, "empty", _cpu_empty(torch.empty))  # graphs.execute's own workspace, on the CPU
    monkeypatch.setattr(tuning, "cuda_timer", _timer(g))  # CUDA events need a GPU
    uids, buffers = (int(graphs.UID.Q), int(graphs.UID.O)), (torch.zeros(4), torch.zeros(4))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    graphs.execute(p, uids, buffers, None, 0)
    assert p.tune and p.index is None and g.ran == [("default",)], "no tuning inside a capture"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs.execute(p, uids, buffers, None, 0)
    assert not p.tune and (p.index, p.workspace, p.name) == (2, 201, "b"), "compared on the output it writes"
    g.ran.clear()
    graphs.execute(p, uids, buffers, None, 0)
    assert g.ran == [("index", 2)], "later calls run the chosen plan, untimed"


def test_tuning_keeps_the_heuristics_plan_when_deterministic_or_on_any_failure(monkeypatch):
    g = PlansGraph([("h", 1.00, 1.0), ("b", 0.80, 1.0)])
    monkeypatch.setattr(tuning, "cuda_timer", _timer(g))
    monkeypatch.setattr(tuning, "_cuda_workspace", lambda device: _alloc)
    out = torch.zeros(4)
    run = lambda i, ws: g.execute_plan_at_index((None, out), ws, index=i)  # noqa: E731
    p = graphs.Plan(graph=g, workspace=1, name="h", tune=True)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    tuning.tune(p, run, [out], 0)
    assert not p.tune and p.index is None and g.ran == []
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)

    def no_memory(size):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tuning, "_cuda_workspace", lambda device: no_memory)
    p = graphs.Plan(graph=g, workspace=1, name="h", tune=True)
    tuning.tune(p, run, [out], 0)  # does not raise into the user's call
    assert not p.tune and (p.index, p.workspace, p.name) == (None, 1, "h")


def test_what_each_graph_writes():
    fwd = graphs.FwdKey(device=0, q=None, k=None, v=None, o=None, lse=None, scale=1.0, window=(-1, -1),
                        bottom_right=False)
    bwd = graphs.BwdKey(device=0, q=None, k=None, v=None, o=None, do=None, lse=None, dq=None, dk=None, dv=None,
                        scale=1.0, window=(-1, -1), bottom_right=False)
    U = graphs.UID
    assert graphs.writes(fwd) == {int(U.O), int(U.LSE), int(U.RNG_DUMP)}
    assert graphs.writes(bwd) == {int(U.DQ), int(U.DK), int(U.DV), int(U.DSINK)}  # the backward reads the LSE


def test_the_environment_switch():
    assert env.parse_flag(env.AUTOTUNE, "1").value is True and env.parse_flag(env.AUTOTUNE, " On ").value is True
    assert env.parse_flag(env.AUTOTUNE, None).value is False and env.parse_flag(env.AUTOTUNE, "0").value is False
    bad = env.parse_flag(env.AUTOTUNE, "fast")
    assert bad.value is False and env.AUTOTUNE in bad.warning and "1 (on) or 0 (off)" in bad.warning


def test_prepare_builds_every_plan_only_when_tuning_and_falls_back_to_the_usual_build(monkeypatch):
    class Modes:
        A, B, FALLBACK = "A", "B", "FALLBACK"

    class Policy:
        ALL = "all"

    monkeypatch.setattr(graphs, "cudnn", type("C", (), {"build_plan_policy": Policy, "heur_mode": Modes}))

    class G:
        def __init__(self, refuse=()):
            self.refuse, self.calls = refuse, []

        def create_execution_plans(self, modes):
            self.calls.append(("plans", tuple(modes)))
            if "B" in modes and "B" in self.refuse:
                raise RuntimeError("no mode B")

        def check_support(self):
            self.calls.append(("check",))

        def build_plans(self, *policy):
            self.calls.append(("build",) + policy)
            if policy and "ALL" in self.refuse:
                raise RuntimeError("no ALL here")

    g = G()
    assert graphs._prepare(g, False) is False
    assert g.calls == [("plans", ("A", "FALLBACK")), ("check",), ("build",)], "the default build is as before"
    g = G()
    assert graphs._prepare(g, True) is True
    assert g.calls == [("plans", ("A", "B", "FALLBACK")), ("check",), ("build", "all")]
    g = G(refuse=("B", "ALL"))
    assert graphs._prepare(g, True) is False  # whatever autotune cannot have, the usual build runs
    assert g.calls[-1] == ("build",) and ("plans", ("A", "FALLBACK")) in g.calls
