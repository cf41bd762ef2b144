"""Every cuDNN plan for the graphs the provider builds at the bench's GPU-bound shapes, timed (GPU).

    python3 scripts/plan_sweep.py [--cases varlen,b4_h16_s4096_d128_causal] [--repeats 20] [--json FILE]
    python3 scripts/plan_sweep.py --cases "" --fp8 4,32,8,8192,128,causal [--fp8 ...]

For each case (the bench's case names; default: the varlen case and three dense ones), the
provider runs the call once (forward, then forward+backward) and the script records each graph it
executed, with the buffers of that call. Then, per graph, it builds a fresh copy from the same key
with every plan cuDNN offers (heuristic modes A, B and FALLBACK, ``build_plan_policy.ALL``) and
times each plan on those buffers: CUDA events around each execute, after warm-up, median of
``--repeats``. The provider's own choice (the first plan of mode A that builds) is marked, so the
output says whether a faster plan exists for that graph and by how much.

``--fp8 B,H_q,H_kv,S,D[,causal]`` (repeatable) does the same for the FP8 graphs of one
``csp.fp8.attention`` forward+backward from bf16 randn inputs (the default, current, recipe), the backward as
one whole-batch graph (``fp8_cudnn.ROW_SPLIT_CAUSAL`` off). Timed executes
reuse that call's buffers; the amax outputs accumulate across them, which changes no kernel's work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudnn  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

import cudnn_sdpa_provider as csp  # noqa: E402
from cudnn_sdpa_provider.engine import fp8_cudnn, graphs, tuning  # noqa: E402
from cudnn_sdpa_provider.tools.bench import MATRIX  # noqa: E402

DEFAULT_CASES = ("varlen_n16_h16_d128_causal", "b4_h16_s4096_d128", "b4_h16_s4096_d128_causal",
                 "gqa_b1_h32kv8_s16384_d128_causal")


def _run_case(case) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    if case.kind == "varlen":
        lens = torch.tensor(case.seq_lens)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        cu, total = cu.cuda(), int(cu[-1])
        q, k, v, go = (rand(total, case.h_q, case.head_dim) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = varlen_attn(*leaves, cu, cu, case.seq, case.seq, window_size=(-1, 0) if case.causal else (-1, -1))
    else:
        q = rand(case.batch, case.h_q, case.seq, case.head_dim)
        k, v = (rand(case.batch, case.h_kv, case.seq, case.head_dim) for _ in range(2))
        go = torch.randn_like(q)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=case.causal, enable_gqa=case.h_q != case.h_kv)
    torch.autograd.grad(out, leaves, go)
    torch.cuda.synchronize()


def _run_fp8(spec: str) -> None:
    fp8_cudnn.ROW_SPLIT_CAUSAL = False  # sweep the whole-batch backward graph
    *dims, last = spec.split(",")
    causal = last == "causal"
    b, h, hk, s, d = (int(x) for x in (dims if causal else dims + [last]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, hk, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    out = csp.fp8.attention(q, k, v, is_causal=causal, recipe=csp.fp8.Recipe())
    out.backward(torch.randn(out.shape, device="cuda", generator=gen, dtype=torch.bfloat16))
    torch.cuda.synchronize()


def _time_us(fn, repeats: int) -> float:
    return tuning.cuda_timer(fn, warmup=3, repeats=repeats) * 1e3  # the package's autotune timer


def _sweep(key, uids, buffers, repeats: int) -> list[dict]:
    handle = graphs._handle(key.device)
    with torch.cuda.device(key.device):
        build = graphs._build_fp8 if isinstance(key, graphs.Fp8Key) else \
            graphs._build_bwd if isinstance(key, graphs.BwdKey) else graphs._build_fwd
        g = build(key, handle)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
    rows, seen = [], set()
    for i in range(g.get_execution_plan_count()):
        try:
            name = g.get_plan_name_at_index(i)
        except Exception as exc:  # noqa: BLE001 - a plan without a name is still timed
            name = f"<index {i}: {type(exc).__name__}>"
        if name in seen:
            continue
        seen.add(name)
        try:
            ws_size = int(g.get_workspace_size_plan_at_index(i))
            ws = torch.empty(max(ws_size, 1), dtype=torch.uint8, device="cuda")
            us = _time_us(lambda: g.execute_plan_at_index(list(buffers), ws, index=i, handle=handle,
                                                          tensor_uids=list(uids)), repeats)
            rows.append({"index": i, "plan": name, "us": round(us, 1), "workspace": ws_size})
        except Exception as exc:  # noqa: BLE001 - a plan that does not build or run is reported, not fatal
            rows.append({"index": i, "plan": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fp8", action="append", default=[], metavar="B,H_q,H_kv,S,D[,causal]")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    by_name = {c.name: c for c in MATRIX}
    wanted = [(by_name[n].name, lambda c=by_name[n]: _run_case(c)) for n in args.cases.split(",") if n]
    wanted += [(f"fp8_{spec}", lambda spec=spec: _run_fp8(spec)) for spec in args.fp8]
    calls: dict = {}  # id(plan) -> (key, plan, uids, buffers) of its last execute
    real_execute = graphs.execute

    def recording(p, uids, buffers, device, stream):
        # the key from this thread's cache (a backward runs on autograd's device thread, whose cache it is)
        key = next(k for k, found in graphs._state()["plans"].items() if found is p)
        calls[id(p)] = (key, p, uids, tuple(buffers))
        return real_execute(p, uids, buffers, device, stream)

    results = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, "
          f"frontend {cudnn.__version__}; device us per execute, median of {args.repeats}", flush=True)
    for name, run_case in wanted:
        calls.clear()
        graphs.execute = recording
        try:
            with csp.enable():
                run_case()
        finally:
            graphs.execute = real_execute
        for key, plan, uids, buffers in calls.values():
            label = f"{name}: {graphs.describe(key)}"
            rows = _sweep(key, uids, buffers, args.repeats)
            results[label] = {"provider_plan": plan.name, "plans": rows}
            print(f"\n{label}\n  provider's plan: {plan.name}", flush=True)
            for r in sorted(rows, key=lambda r: r.get("us", float("inf"))):
                mark = "  <- provider" if r["plan"] == plan.name else ""
                text = f"{r['us']:9.1f} us  ws {r['workspace']:>10}" if "us" in r else f"{'':>26}{r['error']}"
                print(f"  {text}  {r['plan']}{mark}", flush=True)
        graphs.clear_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
