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

#: ``demo --steps`` at most: the demo holds every step's batch (4 KB each) and takes about a second
#: a step on a CPU; tests/test_cli.py checks it against ``tools.demo.MAX_STEPS`` (not imported: torch).
DEMO_MAX_STEPS = 10_000
#: ``demo`` prints a progress line on stderr every this many steps (runs of fewer steps print none).
DEMO_PROGRESS_EVERY = 10
#: ``run``'s own options: after the script they are the script's, so ``run`` says so (one line).
_RUN_OPTIONS = ("--strict", "--report")

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


class _CommandParser(argparse.ArgumentParser):
    """A command's parser reports its own unknown options, with its own usage line (argparse would
    pass them up to the top-level parser, which names neither the command nor its options)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= DEMO_MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {DEMO_MAX_STEPS}, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cudnn-sdpa", description="PyTorch attention on cuDNN graphs, with an audit.")
    p.add_argument("--version", action=_Version, help="print the versions of this package, torch and the frontend")
    # Not ``required``: argparse checks that before unknown options, so `cudnn-sdpa --bogus` would
    # say "the following arguments are required"; main() checks both, unknown options first.
    sub = p.add_subparsers(dest="command", metavar="{run,demo,doctor,bench}", parser_class=_CommandParser)

    run = sub.add_parser(
        "run", help="run a Python script under the provider and report at exit",
        usage="%(prog)s [-h] [--strict] [--report FILE] script [args ...]",
        description="Options go before the script: everything after it is the script's (as with coverage run).",
        epilog=f"The exit status is the script's; {EXIT_USAGE} for bad options, a missing script (or a folder "
               f"without __main__.py) or a --report FILE that cannot be written (checked before the script "
               f"starts). {_REFUSED_EPILOG}")
    run.add_argument("--strict", action="store_true",
                     help="stop at the first call that would fall back (csp.FallbackError; exit status 5)")
    run.add_argument("--report", metavar="FILE", help="also write the telemetry JSON to FILE")
    run.add_argument("script", nargs="?", help="the script to run")  # "?": main() says it is missing, by name
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    demo = sub.add_parser(
        "demo", help="train a small built-in transformer a few steps under the provider",
        epilog=f"Exit status {EXIT_USAGE} for bad options or --device cuda without CUDA. {_REFUSED_EPILOG} "
               "With --json, stdout is the JSON either way (a refused run's has a \"refused\" key). Progress: a "
               f"line on stderr every {DEMO_PROGRESS_EVERY} steps.")
    demo.add_argument("--steps", type=_steps, default=5, metavar="N",
                      help=f"training steps, 1 to {DEMO_MAX_STEPS} (default 5)")
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
    bench.add_argument("--shapes", "--cases", metavar="NAMES",
                       help="comma-separated case names or group names (default: the main matrix; see --list); "
                            "fp8: FP8 end to end from bf16; the changing-shape cases new_length, hf_generate, "
                            "hf_dynamic_padding run only when named, each path in a fresh process")
    bench.add_argument("--modes", metavar="MODES", default="fwd,fwd_bwd",
                       help="comma-separated, from fwd,fwd_bwd (default: both)")
    bench.add_argument("--repeats", type=int, metavar="N", help="timed calls per case, mode and path (default 30)")
    bench.add_argument("--warmup", type=int, metavar="N", help="untimed calls before timing (default 5)")
    bench.add_argument("--json", metavar="FILE", help="also write the rows and meta (versions, GPU, date) as JSON")
    bench.add_argument("--plot", metavar="FILE", help="also plot TFLOP/s against sequence length, a panel per mode "
                                                      "(needs matplotlib: pip install cudnn-sdpa-provider[plot]); "
                                                      "changing-shape cases: a figure of their own, FILE when no "
                                                      "matrix case ran, else beside it (x.png: x.shapes.png)")
    bench.add_argument("--list", action="store_true", help="list the cases and exit")


def _refusal(prog: str, exc) -> str:
    """A strict-mode refusal as one line: the error's first line (path, reason slugs) and its details."""
    return f"{prog}: refused: {exc.one_line()}"


def _script_problem(script: str) -> str | None:
    if not os.path.exists(script):
        return f"no such script: {script}"
    if os.path.isdir(script) and not os.path.exists(os.path.join(script, "__main__.py")):
        return f"{script} is a directory without __main__.py, not a script"
    return None


def _misplaced_options(script_args: list[str]) -> list[str]:
    """``run``'s options among the script's arguments: ``run script.py --report r.json`` gives them
    to the script (as ``coverage run`` does) and writes no report, which is worth a hint."""
    return [a for a in script_args if a.split("=", 1)[0] in _RUN_OPTIONS]


def _cmd_run(args) -> int:
    from ..hooks.telemetry import report_path_problem

    problem = _script_problem(args.script)
    if problem:
        print(f"cudnn-sdpa run: {problem}", file=sys.stderr)
        return EXIT_USAGE
    misplaced = _misplaced_options(args.args)
    if misplaced:
        print(f"cudnn-sdpa run: note: {' '.join(misplaced)} after the script is passed to the script, not to run; "
              "run's options go before the script: cudnn-sdpa run [--strict] [--report FILE] script [args ...]",
              file=sys.stderr)
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
    from ..core import env

    env.warn_invalid()  # every variable now, not when (or if) a GPU path reads it
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
                try:
                    write_report(args.report)  # while still enabled, like the environment-variable route
                except OSError as exc:  # a FIFO nobody reads, a full disk: said, and the status stays the script's
                    print(f"cudnn-sdpa run: warning: report not written to {args.report!r}: "
                          f"{exc.strerror or exc}", file=sys.stderr)
        finally:
            activation.remove()
            sys.argv, sys.path[:] = argv, path
            print("\ncudnn-sdpa-provider report:\n" + report(), file=sys.stderr)
    return code


def _demo_progress(losses: list):
    """A ``run_demo`` progress callback: keeps the losses (a refused run still reports those it
    has) and prints a line on stderr every ``DEMO_PROGRESS_EVERY`` steps, never on stdout."""

    def progress(step: int, total: int, loss: float) -> None:
        losses.append(loss)
        if step % DEMO_PROGRESS_EVERY == 0:
            print(f"cudnn-sdpa demo: step {step}/{total}, loss {loss:.4f}", file=sys.stderr, flush=True)

    return progress


def _cmd_demo(args) -> int:
    from .demo import default_device, run_demo
    from ..diagnostics import report

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("cudnn-sdpa demo: --device cuda but CUDA is not available", file=sys.stderr)
            return EXIT_USAGE
    from ..core.counters import stats
    from ..core.errors import FallbackError

    from ..core import env

    env.warn_invalid()
    before, losses = stats(), []
    try:
        result = run_demo(steps=args.steps, device=args.device, strict=args.strict, progress=_demo_progress(losses))
    except FallbackError as exc:
        print(_refusal("cudnn-sdpa demo", exc), file=sys.stderr)
        if args.json:  # the same document as a finished run, with what was refused: stdout stays JSON
            refused = {"path": exc.path, "reasons": exc.reasons, "details": exc.details, "message": exc.one_line()}
            print(json.dumps({"device": str(default_device(args.device)), "losses": losses, "refused": refused,
                              **(stats() - before).to_dict()}, indent=2))
        else:
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
    """(cases, modes, preset, shape cases) from the options; ValueError for bad ones."""
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    shape_cases = []
    if args.shapes:
        known = [*bench.GROUPS, *(c.name for c in bench.KNOWN)]  # the matrix, the groups and their cases
        names, shape_cases = bench.shapes.split_names(split(args.shapes), known)
        cases = bench.select(names) if names else []
    else:
        cases = bench.quick_matrix() if args.quick else bench.select()
    preset = bench.QUICK if args.quick else bench.DEFAULT
    settings = bench.check_settings(preset.repeats if args.repeats is None else args.repeats,
                                    preset.warmup if args.warmup is None else args.warmup, preset.host_calls)
    return cases, bench.check_modes(split(args.modes)), settings, shape_cases


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
        for name, description in (*bench.listing(), *((c.name, c.describe()) for c in bench.SHAPE_CASES)):
            print(f"{name:<36} {description}")
        return EXIT_OK
    try:
        cases, modes, settings, shape_cases = _bench_options(args, bench)
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
    try:  # the shape cases first: their processes get the GPU before this one holds memory
        shape_rows = bench.run_shapes(shape_cases, progress=_progress()) if shape_cases else []
        rows = bench.run(cases, modes=modes, repeats=settings.repeats, warmup=settings.warmup,
                         host_calls=settings.host_calls, progress=_progress(), peers=peers) if cases else []
    except bench.BenchError as exc:
        print(f"cudnn-sdpa bench: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print("\n\n".join(([bench.format_table(rows)] if rows else []) +
                      ([bench.format_shape_table(shape_rows)] if shape_rows else [])))
    if args.json:
        meta = bench.collect_meta(quick=args.quick, modes=list(modes), cases=[c.name for c in cases],
                                  **{k: getattr(settings, k) for k in ("repeats", "warmup", "host_calls")},
                                  **({"shape_cases": bench.shape_meta(shape_cases)} if shape_cases else {}))
        with open(args.json, "w") as fh:
            fh.write(bench.to_json(rows, meta, **({"shape_rows": shape_rows} if shape_cases else {})))
    if args.plot and not no_plot:
        no_plot = _write_plots(bench, rows, shape_rows, args.plot)
    if no_plot:
        print(f"cudnn-sdpa bench: {no_plot}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _write_plots(bench, rows, shape_rows, path: str) -> str | None:
    """The matrix's figure at ``path``, the shape cases' own figure (``bench.shape_plot_path``);
    what could not be written, or None."""
    problems = []
    for draw, these, where in ((bench.plot, rows, path),
                               (bench.plot_shapes, shape_rows, bench.shape_plot_path(path, bool(rows)))):
        if these:
            try:
                draw(these, where)
            except ValueError as exc:
                problems.append(f"--plot {where} not written: {exc}")
    return "; ".join(problems) or None


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parse_args`` with messages that name what is wrong: unknown options before a missing
    command, and ``run``'s missing script by its name."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.error("a command is required: one of run, demo, doctor, bench")
    if args.command == "run" and args.script is None:
        _command_parser(parser, "run").error("a script is required")
    return args


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def main(argv: list[str] | None = None, bench_peers: dict | None = None) -> int:
    """The CLI. ``bench_peers`` adds paths to ``bench`` (see ``bench.run``; scripts/bench_peer.py)."""
    parser = _parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.command == "bench":
        return _cmd_bench(args, peers=bench_peers)
    handler = {"run": _cmd_run, "demo": _cmd_demo, "doctor": _cmd_doctor}[args.command]
    return handler(args)


def entry() -> None:
    sys.exit(main())
