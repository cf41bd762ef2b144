"""``cudnn-sdpa`` / ``python -m cudnn_sdpa_provider``: the only module that prints.

Commands: run (a script under the provider, report at exit), demo, doctor, bench; ``--version``.
``main(argv)`` returns an exit code (named constants below); ``entry()`` is the console script.
Parsing imports nothing heavy: ``--help`` and ``--version`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

__all__ = ["main", "entry", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_SELF_TEST_FAILED", "EXIT_NO_CUDA",
           "EXIT_REFUSED"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # bad arguments, a missing script, an unwritable --report, --device cuda without CUDA
EXIT_SELF_TEST_FAILED = 3  # doctor
EXIT_NO_CUDA = 4  # bench: nothing to time without a CUDA GPU
EXIT_REFUSED = 5  # --strict: a call would have fallen back (csp.FallbackError)

_REFUSED_EPILOG = (f"Exit status {EXIT_REFUSED} when --strict refused a call that would have fallen back "
                   "(one line on stderr: the path and the reasons).")


class _Version(argparse.Action):
    """``--version``: versions from package metadata, so parsing never imports torch."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .doctor import versions_line

        print(versions_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cudnn-sdpa", description="PyTorch attention on cuDNN graphs, with an audit.")
    p.add_argument("--version", action=_Version, help="print the versions of this package, torch and the frontend")
    sub = p.add_subparsers(dest="command", metavar="{run,demo,doctor,bench}")
    sub.required = True

    run = sub.add_parser(
        "run", help="run a Python script under the provider and report at exit",
        epilog=f"The exit status is the script's; {EXIT_USAGE} for bad options, a missing script or a --report FILE "
               f"that cannot be written (checked before the script starts). {_REFUSED_EPILOG}")
    run.add_argument("--strict", action="store_true",
                     help="stop at the first call that would fall back (csp.FallbackError; exit status 5)")
    run.add_argument("--report", metavar="FILE", help="also write the telemetry JSON to FILE")
    run.add_argument("script", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    demo = sub.add_parser(
        "demo", help="train a small built-in transformer a few steps under the provider",
        epilog=f"Exit status {EXIT_USAGE} for bad options or --device cuda without CUDA. {_REFUSED_EPILOG}")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    demo.add_argument("--strict", action="store_true",
                      help="stop at the first call that would fall back (csp.FallbackError; exit status 5)")
    demo.add_argument("--json", action="store_true", help="print JSON instead of a table")

    doctor = sub.add_parser("doctor", help="versions, GPU, served features, coexistence, GPU self-test",
                            epilog=f"Exit status {EXIT_SELF_TEST_FAILED} when a GPU self-test failed.")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.add_argument("--no-self-test", action="store_true", help="skip the GPU self-test")
    _bench_parser(sub)
    return p


def _bench_parser(sub) -> None:
    # Defaults are repeated here (not imported) so that --help never imports torch; tests/test_bench.py
    # checks them against cudnn_sdpa_provider.tools.bench.DEFAULT / QUICK.
    bench = sub.add_parser(
        "bench", help="time the provider side by side with PyTorch's native attention paths",
        description="Time the provider side by side with native cuDNN, flash and efficient attention (and "
                    "native varlen_attn) in one process on the same inputs: a table on stdout, progress on stderr.",
        epilog=f"Exit status {EXIT_NO_CUDA} when CUDA is not available, {EXIT_USAGE} for bad options, {EXIT_FAILURE} "
               "when the provider is already enabled in the process or the --plot file could not be written "
               "(the table and --json are written all the same).")
    bench.add_argument("--quick", action="store_true",
                       help="smoke preset: 3 cases, 5 repeats, 2 warm-up calls, 50 host-cost calls")
    bench.add_argument("--shapes", metavar="NAMES", help="comma-separated case names (default: all; see --list)")
    bench.add_argument("--modes", metavar="MODES", default="fwd,fwd_bwd",
                       help="comma-separated, from fwd,fwd_bwd (default: both)")
    bench.add_argument("--repeats", type=int, metavar="N", help="timed calls per case, mode and path (default 30)")
    bench.add_argument("--warmup", type=int, metavar="N", help="untimed calls before timing (default 5)")
    bench.add_argument("--json", metavar="FILE", help="also write the rows and meta (versions, GPU, date) as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also plot TFLOP/s against sequence length, a panel per mode "
                                                      "(needs matplotlib: pip install cudnn-sdpa-provider[plot])")
    bench.add_argument("--list", action="store_true", help="list the cases and exit")


def _refusal(prog: str, exc) -> str:
    """A strict-mode refusal as one line: the error's first line (path, reason slugs) and its details."""
    line = f"{prog}: refused: {str(exc).splitlines()[0]}"
    return line + (f" ({'; '.join(exc.details)})" if exc.details else "")


def _cmd_run(args) -> int:
    from ..hooks.telemetry import report_path_problem

    if not os.path.exists(args.script):
        print(f"cudnn-sdpa run: no such script: {args.script}", file=sys.stderr)
        return EXIT_USAGE
    problem = report_path_problem(args.report) if args.report is not None else None
    if problem:  # said before the script runs, not after an hour of training
        print(f"cudnn-sdpa run: --report {args.report}: cannot write there: {problem}", file=sys.stderr)
        return EXIT_USAGE
    return _run_script(args)


def _run_script(args) -> int:
    from ..hooks.activation import enable
    from ..diagnostics import report
    from ..core.errors import FallbackError
    from ..hooks.telemetry import write_report

    argv, path = sys.argv, list(sys.path)
    sys.argv = [args.script] + list(args.args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python script.py` does
    code = EXIT_OK
    activation = enable(strict=args.strict, process_wide=True)  # the whole script, every thread
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or EXIT_OK
        else:  # sys.exit("message"): Python prints the message and exits 1
            print(exc.code, file=sys.stderr)
            code = EXIT_FAILURE
    except FallbackError as exc:
        print(_refusal("cudnn-sdpa run", exc), file=sys.stderr)
        code = EXIT_REFUSED
    finally:
        try:
            if args.report:
                write_report(args.report)  # while still enabled, like the environment-variable route
        finally:
            activation.remove()
            sys.argv, sys.path[:] = argv, path
            print("\ncudnn-sdpa-provider report:\n" + report(), file=sys.stderr)
    return code


def _cmd_demo(args) -> int:
    from .demo import run_demo
    from ..diagnostics import report

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("cudnn-sdpa demo: --device cuda but CUDA is not available", file=sys.stderr)
            return EXIT_USAGE
    if args.steps < 1:
        print(f"cudnn-sdpa demo: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return EXIT_USAGE
    from ..core.counters import stats
    from ..core.errors import FallbackError

    before = stats()
    try:
        result = run_demo(steps=args.steps, device=args.device, strict=args.strict)
    except FallbackError as exc:
        print(_refusal("cudnn-sdpa demo", exc), file=sys.stderr)
        print(report(stats() - before), file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps({"device": result["device"], "losses": result["losses"], **result["stats"].to_dict()},
                         indent=2))
        return EXIT_OK
    print(f"demo: TinyGQA, {len(result['losses'])} steps on {result['device']}")
    print("losses: " + ", ".join(f"{x:.4f}" for x in result["losses"]))
    print(report(result["stats"]))
    return EXIT_OK


def _cmd_doctor(args) -> int:
    from .doctor import doctor_rows

    rows = doctor_rows(run_self_test=not args.no_self_test)
    failed = any(r.ok is False for r in rows if r.section == "self-test")
    if args.json:
        print(json.dumps([r._asdict() for r in rows], indent=2))
    else:
        section = None
        for r in rows:
            if r.section != section:
                section = r.section
                print(f"\n[{section}]")
            mark = {True: "ok ", False: "NO ", None: "   "}[r.ok]
            print(f"  {mark} {r.label:<28} {r.value}")
    return EXIT_SELF_TEST_FAILED if failed else EXIT_OK


def _progress_line(done: int, total: int, label: str, width: int = 24) -> str:
    filled = width * done // total if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"


def _progress(stream=None):
    """A text progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""
    stream = stream or sys.stderr
    tty, shown = stream.isatty(), [0]

    def show(done: int, total: int, label: str) -> None:
        line = _progress_line(done, total, label)
        if tty:
            stream.write("\r" + line.ljust(shown[0]) + ("\n" if done == total else ""))
            shown[0] = len(line)
        else:
            stream.write(line + "\n")
        stream.flush()

    return show


def _bench_options(args, bench):
    """(cases, modes, preset) from the options; ValueError for bad ones."""
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    if args.shapes:
        cases = bench.select(split(args.shapes))
    else:
        cases = bench.quick_matrix() if args.quick else bench.select()
    preset = bench.QUICK if args.quick else bench.DEFAULT
    settings = bench.check_settings(preset.repeats if args.repeats is None else args.repeats,
                                    preset.warmup if args.warmup is None else args.warmup, preset.host_calls)
    return cases, bench.check_modes(split(args.modes)), settings


def _plot_problem(path: str | None, bench) -> str | None:
    if path:
        try:
            bench.require_matplotlib()
        except ImportError as exc:
            return f"--plot {path} will not be written: {exc}"
    return None


def _cmd_bench(args, peers: dict | None = None) -> int:
    from . import bench

    if args.list:
        for case in bench.MATRIX:
            print(f"{case.name:<36} {case.describe()}")
        return EXIT_OK
    try:
        cases, modes, settings = _bench_options(args, bench)
    except ValueError as exc:
        print(f"cudnn-sdpa bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    no_plot = _plot_problem(args.plot, bench)
    if no_plot:  # said now, not after the run; the table and JSON are still written
        print(f"cudnn-sdpa bench: {no_plot}", file=sys.stderr)
    import torch

    if not torch.cuda.is_available():
        print("cudnn-sdpa bench: CUDA is not available; the benchmark times GPU kernels, so run it on a machine "
              "with an NVIDIA GPU", file=sys.stderr)
        return EXIT_NO_CUDA
    try:
        rows = bench.run(cases, modes=modes, repeats=settings.repeats, warmup=settings.warmup,
                         host_calls=settings.host_calls, progress=_progress(), peers=peers)
    except bench.BenchError as exc:
        print(f"cudnn-sdpa bench: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(bench.format_table(rows))
    if args.json:
        meta = bench.collect_meta(quick=args.quick, modes=list(modes), cases=[c.name for c in cases],
                                  **{k: getattr(settings, k) for k in ("repeats", "warmup", "host_calls")})
        with open(args.json, "w") as fh:
            fh.write(bench.to_json(rows, meta))
    if args.plot and not no_plot:
        try:
            bench.plot(rows, args.plot)
        except ValueError as exc:
            no_plot = f"--plot {args.plot} not written: {exc}"
    if no_plot:
        print(f"cudnn-sdpa bench: {no_plot}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def main(argv: list[str] | None = None, bench_peers: dict | None = None) -> int:
    """The CLI. ``bench_peers`` adds paths to ``bench`` (see ``bench.run``; scripts/bench_peer.py)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.command == "bench":
        return _cmd_bench(args, peers=bench_peers)
    handler = {"run": _cmd_run, "demo": _cmd_demo, "doctor": _cmd_doctor}[args.command]
    return handler(args)


def entry() -> None:
    sys.exit(main())
