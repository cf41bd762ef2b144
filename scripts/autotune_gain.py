"""What ``CUDNN_SDPA_PROVIDER_AUTOTUNE=1`` buys, per bench case and mode, in one process (GPU):

    python3 scripts/autotune_gain.py [--shapes NAMES] [--repeats 30] [--rounds 2]

For each case and mode the provider's step (the bench's ``provider`` path, same inputs) is timed
with the heuristic's plans, then with autotuned plans, ``--rounds`` times alternating (each switch
clears the graph caches of every thread, so the backward's graphs are rebuilt too): CUDA events,
after warm-up, median; ratio = heuristic / autotuned. Each row names, per graph, the heuristic's plan
and the one that ran under autotune ("(autotuned)" where tuning switched), and the first call's cost
under autotune (building every plan and timing them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from time import perf_counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.core import counters, env
from cudnn_sdpa_provider.engine import graphs  # noqa: E402
from cudnn_sdpa_provider.tools.bench import cases, inputs, measure, paths  # noqa: E402

DEFAULT = "gqa_b1_h32kv8_s16384_d128_causal,b4_h16_s4096_d128_causal,b16_h16_s1024_d64_causal,varlen_n16_h16_d128_causal"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    noted: list = []  # (graph, plan) as the package notes them: at each build, and when tuning switches
    note = counters.note_plan
    counters.note_plan = lambda config, name: (noted.append((config, name)), note(config, name))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"frontend {graphs.backend_info()[0]}; median ms of {args.repeats} calls after 5 warm-up calls; "
          "ratio = heuristic / autotuned (above 1: autotune is faster)")
    print(f"{'case':34} {'mode':8} {'round':>5} {'heuristic':>10} {'autotuned':>10} {'ratio':>6} {'1st call':>9}  plans")
    for case in cases.select(args.shapes.split(",")):
        if case.kind not in ("dense", "varlen", "padded") or inputs.unavailable(case):
            print(f"{case.name:34} skipped: {inputs.unavailable(case) or 'not an attention case'}")
            continue
        sets = inputs.make_sets(case)
        for mode in ("fwd", "fwd_bwd"):
            step = paths.step(case, mode, "provider")
            for rnd in range(1, args.rounds + 1):
                times, first, plans = {}, 0.0, {}
                for tune in ("0", "1"):
                    os.environ[env.AUTOTUNE] = tune
                    graphs.clear_cache()
                    noted.clear()
                    with csp.enable():
                        torch.cuda.synchronize()
                        t0 = perf_counter()
                        step(sets[0])  # builds (and with autotune, tunes) the graphs
                        torch.cuda.synchronize()
                        first = (perf_counter() - t0) * 1e3 if tune == "1" else first
                        times[tune] = statistics.median(measure.event_times(step, sets, args.repeats, 5))
                    plans[tune] = dict(noted)  # the last note per graph: the plan that ran
                print(f"{case.name:34} {mode:8} {rnd:>5} {times['0']:10.3f} {times['1']:10.3f} "
                      f"{times['0'] / times['1']:6.3f} {first:8.0f}ms  "
                      + "; ".join(f"{config.split(' ')[0]} {plans['0'].get(config, '?')} -> {name}"
                                  for config, name in plans["1"].items()), flush=True)
        del sets
        torch.cuda.empty_cache()
    os.environ.pop(env.AUTOTUNE, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
