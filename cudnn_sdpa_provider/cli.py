"""``cudnn-sdpa`` / ``python -m cudnn_sdpa_provider``: the only module that prints.

Commands: run (a script under the provider, report at exit), demo, doctor. ``main(argv)``
returns an exit code (named constants below); ``entry()`` is the console script.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

__all__ = ["main", "entry", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_SELF_TEST_FAILED"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SELF_TEST_FAILED = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cudnn-sdpa", description="PyTorch attention on cuDNN graphs, with an audit.")
    sub = p.add_subparsers(dest="command", metavar="{run,demo,doctor}")
    sub.required = True

    run = sub.add_parser("run", help="run a Python script under the provider and report at exit")
    run.add_argument("--strict", action="store_true", help="raise FallbackError wherever a call would fall back")
    run.add_argument("--report", metavar="FILE", help="also write the telemetry JSON to FILE")
    run.add_argument("script", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    demo = sub.add_parser("demo", help="train a small built-in transformer a few steps under the provider")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    demo.add_argument("--strict", action="store_true", help="raise FallbackError on any fallback")
    demo.add_argument("--json", action="store_true", help="print JSON instead of a table")

    doctor = sub.add_parser("doctor", help="versions, GPU, served features, coexistence, GPU self-test")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.add_argument("--no-self-test", action="store_true", help="skip the GPU self-test")
    return p


def _cmd_run(args) -> int:
    from .activation import enable
    from .diagnostics import report
    from .telemetry import write_report

    if not os.path.exists(args.script):
        print(f"cudnn-sdpa run: no such script: {args.script}", file=sys.stderr)
        return EXIT_USAGE
    argv = sys.argv
    sys.argv = [args.script] + list(args.args)
    code = EXIT_OK
    activation = enable(strict=args.strict)
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_FAILURE)
    finally:
        activation.remove()
        sys.argv = argv
        print("\ncudnn-sdpa-provider report:\n" + report(), file=sys.stderr)
        if args.report:
            write_report(args.report)
    return code


def _cmd_demo(args) -> int:
    from .demo import run_demo
    from .diagnostics import report

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("cudnn-sdpa demo: --device cuda but CUDA is not available", file=sys.stderr)
            return EXIT_USAGE
    result = run_demo(steps=args.steps, device=args.device, strict=args.strict)
    if args.json:
        print(json.dumps({"device": result["device"], "losses": result["losses"], **result["stats"].to_dict()},
                         indent=2))
        return EXIT_OK
    print(f"demo: TinyGQA, {len(result['losses'])} steps on {result['device']}")
    print("losses: " + ", ".join(f"{x:.4f}" for x in result["losses"]))
    print(report(result["stats"]))
    return EXIT_OK


def _cmd_doctor(args) -> int:
    from .diagnostics import doctor_rows

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


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    handler = {"run": _cmd_run, "demo": _cmd_demo, "doctor": _cmd_doctor}[args.command]
    return handler(args)


def entry() -> None:
    sys.exit(main())
