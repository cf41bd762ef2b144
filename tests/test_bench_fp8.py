"""CPU tier: the bench's fp8 group (issue #30, FP8 end to end from bf16 activations): its cases and
their selection, the paths' calls and counters on CPU tensors, the refill of the inputs outside the
timed window, rows, ratios, the side-by-side table, JSON and plot from synthetic rows.

Nothing here times anything or touches CUDA (tests/gpu/test_bench.py runs a small fp8 case)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.tools import bench, cli
from cudnn_sdpa_provider.tools.bench import Case, Measurement, Row, fp8_case
from tests.test_fp8 import ATTN_FWD_TOL
from tests.util import rel_error

FP8_NAMES = [c.name for c in bench.FP8_MATRIX]
B1_4K, GQA_8K = "fp8_b1_h32_s4096_d128_causal", "fp8_b4_h32kv8_s8192_d128"


def by_name(name: str) -> Case:
    return bench.select([name])[0]


# ---------------------------------------------------------------------------------- the cases


def test_fp8_group_is_the_issues_shapes_and_not_in_the_default_run():
    shapes = {(c.batch, c.h_q, c.h_kv, c.seq, c.head_dim, c.causal) for c in bench.FP8_MATRIX}
    want = {(1, 32, 32, s, 128, c) for s in (4096, 8192, 16384) for c in (False, True)}
    want |= {(4, 32, 8, s, 128, c) for s in (4096, 8192) for c in (False, True)}
    assert shapes == want and len(bench.FP8_MATRIX) == 10
    for c in bench.FP8_MATRIX:
        assert c.kind == "fp8" and c.modes == bench.MODES and not c.host
        assert c.paths == bench.FP8_PATHS == ("native", "provider", "fp8_delayed", "fp8_current")
        assert "FP8 end to end from bf16" in c.describe() and ("(GQA)" in c.describe()) == c.gqa
    assert bench.BASELINE["fp8"] == ("native",)
    assert not set(FP8_NAMES) & {c.name for c in bench.MATRIX}
    assert bench.select() == list(bench.MATRIX)  # the default run does not grow
    assert bench.GROUPS == {"fp8": bench.FP8_MATRIX}
    assert list(bench.KNOWN) == list(bench.MATRIX) + list(bench.FP8_MATRIX)
    assert len({c.name for c in bench.KNOWN}) == len(bench.KNOWN)


def test_select_a_group_by_name_expands_in_order_and_runs_each_case_once():
    assert bench.select(["fp8"]) == list(bench.FP8_MATRIX)
    assert bench.select("fp8") == list(bench.FP8_MATRIX)
    mixed = bench.select(["tiny_b1_h2_s128_d64_causal", GQA_8K, "fp8"])
    assert [c.name for c in mixed] == ["tiny_b1_h2_s128_d64_causal", GQA_8K] + [n for n in FP8_NAMES if n != GQA_8K]
    assert by_name(B1_4K).causal and by_name(GQA_8K).gqa and not by_name(GQA_8K).causal
    with pytest.raises(ValueError, match=r"unknown bench case 'fp9'.*Available groups: \['fp8'\]"):
        bench.select(["fp9"])
    with pytest.raises(ValueError, match="no bench case selected"):
        bench.select([])


def test_fp8_flops_and_input_sets():
    c = by_name(GQA_8K)
    assert bench.fwd_flops(c) == 4 * 4 * 32 * 8192 * 8192 * 128  # query heads count; not causal
    assert bench.fwd_flops(by_name(B1_4K)) == 4 * 32 * 4096 * 4096 * 128 / 2
    # one set of the B=1 16k case is 512 MiB (q, k, v, grad_out): one set spans L2, but the refill
    # needs a second to read while the first is new
    big = by_name("fp8_b1_h32_s16384_d128")
    assert bench.inputs.set_bytes(big) == 4 * 32 * 16384 * 128 * 2 == 512 << 20
    assert bench.inputs.set_count(big) == fp8_case.MIN_SETS == 2
    same_size = Case("d", "dense", 1, 32, 32, 16384, 128, False)
    assert bench.inputs.set_count(same_size) == 1  # other kinds: unchanged
    assert bench.inputs.set_count(by_name(B1_4K)) == 2  # 128 MiB sets span 256 MiB
    small = Case("s", "fp8", 1, 2, 2, 256, 64, True)
    assert bench.inputs.set_count(small) == bench.inputs.MAX_SETS


# ------------------------------------------------------------------------------- the paths


@pytest.fixture
def spy_recipe(monkeypatch):
    """``csp.fp8.Recipe`` recording the ``scaling`` each FP8 path asks for. Where Recipe does not take
    ``scaling`` yet (issue #30 item 2 lands it), the spy consumes it; otherwise it passes it on."""
    real, seen = csp.fp8.Recipe, []
    takes = "scaling" in inspect.signature(real).parameters

    class Spy(real):
        def __init__(self, **kw):
            seen.append(kw.get("scaling", "<missing>"))
            if not takes:
                kw.pop("scaling", None)
            super().__init__(**kw)

    monkeypatch.setattr(csp.fp8, "Recipe", Spy)
    return seen


def test_recipe_asks_each_fp8_path_for_its_scaling(spy_recipe):
    assert isinstance(fp8_case.recipe("fp8_delayed"), csp.fp8.Recipe)
    fp8_case.recipe("fp8_current")
    assert spy_recipe == ["delayed", "current"]
    with pytest.raises(ValueError, match=r"path 'native' has no FP8 recipe; FP8 paths: \['fp8_delayed', 'fp8_current"):
        fp8_case.recipe("native")
    with pytest.raises(ValueError, match="unknown fp8 case path 'flash'. Available paths"):
        fp8_case.attn(by_name(B1_4K), "flash")


def _cpu_set(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sq, skv = (case.batch, case.h_q, case.seq, case.head_dim), (case.batch, case.h_kv, case.seq, case.head_dim)
    q, k, v, go = (torch.randn(shape, generator=g, dtype=torch.bfloat16) for shape in (sq, skv, skv, sq))
    return bench.inputs.AttnSet(q, k, v, go)


@pytest.mark.parametrize("case", [Case("mha", "fp8", 1, 2, 2, 32, 128, True),
                                  Case("gqa", "fp8", 2, 4, 2, 32, 128, False)], ids=["mha_causal", "gqa_full"])
def test_every_path_computes_the_cases_attention_and_the_audited_ones_are_counted(case, spy_recipe):
    """On CPU every provider and FP8 call falls back (no_cuda), each counted as ``expected_calls``
    says; native is not counted; each path's forward is the case's attention (mask, GQA) of the
    set's inputs, the FP8 ones within FP8's bound (tests/test_fp8.py), far from the other mask."""
    s = _cpu_set(case)
    args = [t.detach().double() for t in (s.q, s.k, s.v)]
    right = F.scaled_dot_product_attention(*args, is_causal=case.causal, enable_gqa=True)
    wrong = F.scaled_dot_product_attention(*args, is_causal=not case.causal, enable_gqa=True)
    for mode in bench.MODES:
        for path in bench.FP8_PATHS:
            m = Measurement(path)
            with bench.paths.scope(m, {}):
                out = bench.paths.step(case, mode, path)(s)
            if path == "native":
                assert (m.served, m.fallback) == (0, {}), m
            else:
                assert m.served == 0 and m.fallback == {"no_cuda": bench.expected_calls(case, mode, 1)}, (path, m)
            if mode == "fwd":
                assert out.dtype == torch.bfloat16 and out.shape == s.q.shape
                err = rel_error(out, right)[0]
                assert err <= (ATTN_FWD_TOL if path.startswith("fp8_") else 2 ** -7), (path, err)
                assert rel_error(out, wrong)[0] > 4 * ATTN_FWD_TOL, path
    assert spy_recipe == ["delayed", "current"] * 2  # one recipe per FP8 path and mode


def test_fp8_paths_are_audited_and_their_exceptions_are_errors(monkeypatch):
    assert [p for p in bench.FP8_PATHS if bench.cases.audited(p)] == ["provider", "fp8_delayed", "fp8_current"]
    assert not bench.cases.audited("native") and bench.cases.audited("provider_graphed")

    def boom(case, mode, path):
        raise TypeError("Recipe.__init__() got an unexpected keyword argument 'scaling'")

    monkeypatch.setattr(bench.measure, "step", boom)
    case = by_name(B1_4K)
    for path, error in (("fp8_delayed", True), ("fp8_current", True), ("native", False)):
        live = bench.measure._Live(path)
        bench.measure._probe(live, case, "fwd", [None], {})  # raises before any CUDA call
        assert live.m.error is error and "unexpected keyword argument 'scaling'" in live.m.skip, path
        row = bench.summarize(case, "fwd", live.m, 1.0, 2)
        assert row.status == ("error" if error else "skipped") and row.median_ms is None


def test_peer_names_cannot_take_an_fp8_path_name():
    with pytest.raises(ValueError, match=r"not 'provider\*' or 'fp8_\*'"):
        bench.run(["tiny_b1_h2_s128_d64_causal"], peers={"fp8_mine": None})
    with pytest.raises(ValueError, match="peer path name 'native'"):
        bench.run(["tiny_b1_h2_s128_d64_causal"], peers={"native": None})  # the fp8 kind's baseline


# --------------------------------------------------------------------- fresh inputs each call


def test_refresh_draws_new_values_into_the_same_tensors():
    s = _cpu_set(Case("r", "fp8", 1, 2, 2, 64, 64, False))
    ptrs = [t.data_ptr() for t in (s.q, s.k, s.v, s.g)]
    before = [t.detach().clone() for t in (s.q, s.k, s.v, s.g)]
    fp8_case._GENERATORS.clear()
    fp8_case.refresh(s)
    first = [t.detach().clone() for t in (s.q, s.k, s.v, s.g)]
    for old, new, t in zip(before, first, (s.q, s.k, s.v, s.g)):
        assert not torch.equal(old, new) and new.dtype == torch.bfloat16
        assert 0.9 < new.float().std().item() < 1.1 and abs(new.float().mean().item()) < 0.1  # standard normal
    assert [t.data_ptr() for t in (s.q, s.k, s.v, s.g)] == ptrs and s.q.requires_grad and s.q.is_leaf
    assert torch.equal(s.qd, s.q.detach())  # the fwd mode's views see the new values
    fp8_case.refresh(s)
    assert not torch.equal(first[0], s.q.detach())
    fp8_case._GENERATORS.clear()  # seeded: the same sequence again
    fp8_case.refresh(s)
    assert all(torch.equal(a, b.detach()) for a, b in zip(first, (s.q, s.k, s.v, s.g)))


class _Event:
    """A stand-in for torch.cuda.Event that logs when it is recorded."""

    log: list = []

    def __init__(self, enable_timing=False):
        self.name = f"event{len(_Event.made)}"
        _Event.made.append(self)

    def record(self):
        _Event.log.append(("record", self))

    def elapsed_time(self, other):
        return 1.0


def test_event_times_refreshes_each_set_after_its_call_outside_the_window(monkeypatch):
    _Event.log, _Event.made = [], []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    log = _Event.log
    sets = ["s0", "s1", "s2"]
    times = bench.measure.event_times(lambda s: log.append(("step", s)), sets, n=4, warmup=2,
                                      refresh=lambda s: log.append(("refresh", s)))
    assert times == [1.0] * 4
    kinds = [(e[0], e[1] if e[0] != "record" else None) for e in log]
    assert kinds[:4] == [("step", "s0"), ("refresh", "s0"), ("step", "s1"), ("refresh", "s1")]  # warm-up
    timed = kinds[4:]
    assert len(timed) == 4 * 4
    for i in range(4):
        s = sets[(2 + i) % 3]
        assert timed[4 * i: 4 * i + 4] == [("record", None), ("step", s), ("record", None), ("refresh", s)]
    starts, ends = _Event.made[:4], _Event.made[4:]
    records = [e[1] for e in log if e[0] == "record"]
    assert records == [x for pair in zip(starts, ends) for x in pair]  # each refresh after its call's end event
    log.clear()
    bench.measure.event_times(lambda s: log.append(("step", s)), sets, n=2, warmup=1)  # other kinds: none
    assert not [e for e in log if e[0] == "refresh"]


def test_only_fp8_cases_pass_the_refresh(monkeypatch):
    seen = []
    monkeypatch.setattr(bench.measure, "event_times", lambda step, sets, n, warm, refresh=None: seen.append(refresh)
                        or [1.0] * n)
    for name in (B1_4K, "tiny_b1_h2_s128_d64_causal"):
        live = bench.measure._Live("native")
        bench.measure._timed(live, [None], 3, 1, by_name(name))
        assert live.m.times_ms == [1.0] * 3 and live.m.calls == 4
    assert seen == [fp8_case.refresh, None]


# ------------------------------------------------------------------------ rows and ratios


def _row(case, mode, path, ms, **kw) -> Row:
    c = by_name(case)
    return Row(case, c.kind, mode, path, c.seq, c.causal, median_ms=ms, p20_ms=ms and ms * 0.9,
               p80_ms=ms and ms * 1.1, tflops=ms and bench.flops(c, mode) / (ms * 1e-3) / 1e12, **kw)


def _synthetic() -> list[Row]:
    """Two cases x two modes with the issue's 4k ratios (0.19x forward, 0.28x forward+backward) and a
    fallback, an error and a case whose native did not run."""
    rows = []
    for mode, native, delayed, current in (("fwd", 0.252, 1.326, 1.2), ("fwd_bwd", 1.12, 4.0, 4.48)):
        rows += [_row(B1_4K, mode, "native", native),
                 _row(B1_4K, mode, "provider", native, served=9, expected=9, fallbacks=0),
                 _row(B1_4K, mode, "fp8_delayed", delayed, served=9, expected=9, fallbacks=0),
                 _row(B1_4K, mode, "fp8_current", current, served=9, expected=9, fallbacks=0)]
    rows += [_row(GQA_8K, "fwd", "native", 4.0),
             _row(GQA_8K, "fwd", "provider", 4.0),
             _row(GQA_8K, "fwd", "fp8_delayed", 2.5, status="fallback", reason="3 of 9 provider calls fell back"),
             _row(GQA_8K, "fwd", "fp8_current", None, status="error", reason="TypeError: scaling"),
             _row(GQA_8K, "fwd_bwd", "native", None, status="error", reason="RuntimeError: out of memory"),
             _row(GQA_8K, "fwd_bwd", "fp8_current", 10.0)]
    return bench.add_ratios(rows)


def test_summarize_fp8_rows_checks_every_fp8_call_was_served():
    c = by_name(B1_4K)
    ok = bench.summarize(c, "fwd_bwd", Measurement("fp8_delayed", times_ms=[2.0], calls=10, served=20), 128.0, 2)
    assert (ok.status, ok.expected, ok.served, ok.fallbacks) == ("ok", 20, 20, 0)  # an fp8_fwd and an fp8_bwd each
    fell = bench.summarize(c, "fwd", Measurement("fp8_current", times_ms=[2.0], calls=10, served=7,
                                                 fallback={"compute_capability": 3}), 128.0, 2)
    assert fell.status == "fallback" and "3 of 10" in fell.reason and "compute_capability=3" in fell.reason
    short = bench.summarize(c, "fwd", Measurement("fp8_current", times_ms=[2.0], calls=10, served=4), 128.0, 2)
    assert short.status == "unserved" and "4 of 10" in short.reason
    native = bench.summarize(c, "fwd", Measurement("native", times_ms=[2.0], calls=10), 128.0, 2)
    assert (native.status, native.served, native.expected) == ("ok", None, None)


def test_ratios_are_native_time_over_path_time_per_case_and_mode():
    by = {(r.case, r.mode, r.path): r.vs_native for r in _synthetic()}
    assert by[(B1_4K, "fwd", "fp8_delayed")] == pytest.approx(0.252 / 1.326) == pytest.approx(0.19, abs=5e-3)
    assert by[(B1_4K, "fwd_bwd", "fp8_delayed")] == pytest.approx(0.28)
    assert by[(B1_4K, "fwd", "native")] == 1.0 and by[(B1_4K, "fwd", "provider")] == 1.0
    assert by[(GQA_8K, "fwd", "fp8_delayed")] == pytest.approx(1.6)  # a number, though the row is a fallback
    assert by[(GQA_8K, "fwd", "fp8_current")] is None
    assert by[(GQA_8K, "fwd_bwd", "fp8_current")] is None  # no native, no ratio


def test_ratio_entries_and_table_side_by_side():
    rows = _synthetic()
    entries = fp8_case.ratio_entries(rows + [_row("tiny_b1_h2_s128_d64_causal", "fwd", "native_cudnn", 0.1)])
    assert [(e["case"], e["mode"]) for e in entries] == [(B1_4K, "fwd"), (B1_4K, "fwd_bwd"), (GQA_8K, "fwd"),
                                                         (GQA_8K, "fwd_bwd")]
    first = entries[0]
    assert (first["seq"], first["causal"], first["native_ms"]) == (4096, True, 0.252)
    assert first["paths"]["fp8_current"] == {"vs_native": pytest.approx(0.21), "status": "ok"}
    assert entries[3]["native_ms"] is None and entries[3]["paths"]["native"]["status"] == "error"
    lines = fp8_case.ratio_table(rows).splitlines()
    assert lines[0].startswith("FP8 end to end from bf16 activations: bf16 native time / path time")
    assert lines[1].split() == ["case", "mode", "native", "ms", "provider", "fp8_delayed", "fp8_current"]
    assert lines[2].split() == [B1_4K, "fwd", "0.252", "1.00x", "0.19x", "0.21x"]
    assert lines[3].split() == [B1_4K, "fwd_bwd", "1.120", "1.00x", "0.28x", "0.25x"]
    assert lines[4].split() == [GQA_8K, "fwd", "4.000", "1.00x", "1.60x*", "error"]
    assert lines[5].split() == [GQA_8K, "fwd_bwd", "-", "-", "-", "-"]
    assert lines[6].startswith("* not every call of that path was served") and len(lines) == 7
    assert fp8_case.ratio_table(rows[:8]).count("*") == 0  # no fallback: no footnote
    assert fp8_case.ratio_table([_row("tiny_b1_h2_s128_d64_causal", "fwd", "native_cudnn", 0.1)]) == ""


def test_format_table_appends_the_fp8_ratios_only_for_fp8_rows():
    rows = _synthetic()
    text = bench.format_table(rows)
    assert text.endswith(fp8_case.ratio_table(rows)) and "\n\nFP8 end to end" in text
    assert "FALLBACK: 3 of 9" in text and "ERROR: TypeError: scaling" in text
    other = bench.format_table([_row("tiny_b1_h2_s128_d64_causal", "fwd", "native_cudnn", 0.1)])
    assert "FP8" not in other


def test_json_of_fp8_rows_round_trips_with_their_ratios():
    rows = _synthetic()
    data = json.loads(bench.to_json(rows, {"settings": {"cases": ["fp8"]}}))
    assert data["rows"] == [r.as_dict() for r in rows]
    got = {(r["case"], r["mode"], r["path"]): (r["kind"], r["vs_native"], r["status"]) for r in data["rows"]}
    assert got[(B1_4K, "fwd_bwd", "fp8_delayed")] == ("fp8", pytest.approx(0.28), "ok")
    assert got[(GQA_8K, "fwd", "fp8_current")] == ("fp8", None, "error")


def test_ratio_points_for_the_plot():
    rows = _synthetic() + bench.add_ratios([_row("fp8_b1_h32_s8192_d128_causal", "fwd", "native", 1.0),
                                            _row("fp8_b1_h32_s8192_d128_causal", "fwd", "fp8_delayed", 0.5)])
    gqa = frozenset(c.name for c in bench.KNOWN if c.gqa)
    pts = fp8_case.ratio_points(rows, "fwd", gqa)
    assert pts[("fp8_delayed", True, False)] == [(4096, pytest.approx(0.19, abs=5e-3)), (8192, 2.0)]  # sorted by S
    assert pts[("provider", False, True)] == [(8192, 1.0)]
    assert ("fp8_delayed", False, True) not in pts and ("fp8_current", False, True) not in pts  # not ok
    assert not any(p == "native" for p, _, _ in pts)  # the baseline is the line at 1
    assert fp8_case.ratio_points(rows, "fwd_bwd", gqa)[("fp8_current", True, False)] == [(4096, pytest.approx(0.25))]


def test_plot_with_fp8_rows_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fp8.png"
    bench.plot(_synthetic(), str(out))
    assert out.stat().st_size > 0
    only_native = [r for r in _synthetic() if r.path == "native" and r.status == "ok"]
    bench.plot(only_native, str(tmp_path / "native.png"))  # no ratio to draw: one row of panels
    assert (tmp_path / "native.png").stat().st_size > 0


# ------------------------------------------------------------------------------------- CLI


def _fake_run(monkeypatch, rows):
    calls = []

    def run(cases, **kw):
        calls.append(([c.name for c in cases], kw))
        return rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "collect_meta", lambda **settings: {"settings": settings})
    return calls


def test_cli_runs_the_fp8_group_by_name_and_prints_the_ratios(monkeypatch, capsys, tmp_path):
    rows = _synthetic()
    calls = _fake_run(monkeypatch, rows)
    out = tmp_path / "fp8.json"
    assert cli.main(["bench", "--shapes", "fp8", "--modes", "fwd", "--json", str(out)]) == cli.EXIT_OK
    (names, kw), = calls
    assert names == FP8_NAMES and kw["modes"] == ("fwd",) and kw["repeats"] == bench.DEFAULT.repeats
    printed = capsys.readouterr().out
    assert printed.strip() == bench.format_table(rows) and "0.19x" in printed
    assert json.loads(out.read_text())["meta"]["settings"]["cases"] == FP8_NAMES
    assert cli.main(["bench", "--quick", "--shapes", f"{B1_4K},fp8"]) == cli.EXIT_OK  # quick preset, fp8 cases
    names, kw = calls[1]
    assert names == [B1_4K] + [n for n in FP8_NAMES if n != B1_4K] and kw["repeats"] == bench.QUICK.repeats
    assert cli.main(["bench", "--shapes", "fp8,fp9"]) == cli.EXIT_USAGE
    assert "unknown bench case 'fp9'" in capsys.readouterr().err


def test_cli_list_names_the_group_and_its_cases(capsys):
    assert cli.main(["bench", "--list"]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    shapes = [c.name for c in bench.SHAPE_CASES]  # the changing-shape cases, listed last
    assert names == [c.name for c in bench.MATRIX] + ["fp8"] + FP8_NAMES + shapes
    group = lines[len(bench.MATRIX)]
    assert "group of 10 cases, not in the default run: --shapes fp8" in group
    assert all(line.endswith("[fp8]") for line in lines[len(bench.MATRIX) + 1:len(lines) - len(shapes)])


def test_cli_help_names_the_groups(capsys):
    assert cli.main(["bench", "--help"]) == cli.EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "comma-separated case names or group names" in out and "fp8: FP8 end to end from bf16" in out


def test_the_refill_seed_is_none_of_the_sets_seeds():
    seeds = {bench.inputs._seed(c) for c in bench.FP8_MATRIX} | {0}
    assert fp8_case.REFRESH_SEED not in seeds and fp8_case.REFRESH_SEED < 2**32
