"""Where the packed FP8 backward goes wrong on the GPU: each case in its own process (a fault there
loses only that process), with CUDA_LAUNCH_BLOCKING=1 so a fault names the kernel launch that made it.

Cases:
- ``packed``: ``csp.fp8.attention`` on packed (T, H, D) bf16 inputs, as tests/gpu/test_fp8_varlen_gpu.py,
  with errors per tensor and per sequence against fp32 (max |got - ref| / max |ref| of that slice);
  ``contig`` makes the padded backward operands contiguous BHSD (the op pads to a BSHD view).
- ``dense``: the dense FP8 forward+backward with seq_lens (tests/gpu/test_fp8.py's served-and-bounded
  test) at the packed case's lengths and bucketed S, or (``full``) at (4, 8, 2048, 128) without a mask.
- ``dense_e2e``: dense ``csp.fp8.attention`` from bf16 at (1, 8, S, 128), the from-bf16 error at that S.
- variants: ``poison`` leaves the small-block pool holding 1e30 before each call, ``amax0`` zeroes
  the engine's amax outputs (now the package's own behaviour); ``z4`` has a user's empty sequence.

    python3 scripts/fp8_varlen_diag.py [fresh|stale|unpadded]   # one case set (SETS), a subprocess and a
                                                                  # JSON line per case

The package's own rules now keep the padded backward and zero lengths off cuDNN (core.known_issues),
so the ``dense`` padded cases report that fallback instead of cuDNN's answer; lift the rows
(``known_issues.KNOWN_ISSUES``) to see cuDNN's again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

LENS = {"b4": (1000, 517, 2048, 77), "b3": (1000, 517, 77), "eq": (1024, 1024), "b2": (1000, 517),
        "z4": (1000, 0, 517, 77)}


def _variants(flags):
    """``poison``: the small-block pool is left holding 1e30 (small tensors a kernel forgot to write, or
    read before writing, show it); ``amax0``: the FP8 engine's amax outputs start at 0."""
    import torch
    from cudnn_sdpa_provider.engine import fp8_cudnn

    if "amax0" in flags:
        fp8_cudnn._amax_buffers = lambda n, device: [torch.zeros((1, 1, 1, 1), device=device) for _ in range(n)]
    if "poison" in flags:
        junk = [torch.full((128,), 1e30, device="cuda") for _ in range(4096)]
        del junk


def _packed(name, lens_id, scaling, contig, flags=""):
    import torch
    import cudnn_sdpa_provider as csp
    from cudnn_sdpa_provider.core import counters
    from cudnn_sdpa_provider.ops import fp8_varlen
    from tests.gpu import test_fp8_varlen_gpu as t

    if contig:
        pad = fp8_varlen.Placement.pad
        fp8_varlen.Placement.pad = lambda self, x, side: pad(self, x, side).contiguous()
    lens = LENS[lens_id]
    c, total = t.CASES[name], sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(total, h, 128, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for h in (c["h"], c["hk"], c["hk"]))
    go = torch.randn(total, c["h"], 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    recipe = csp.fp8.Recipe(scaling=scaling)
    before = counters.stats()
    rows = []
    for step in range(2):
        _variants(flags)
        for x in (q, k, v):
            x.grad = None
        out = csp.fp8.attention(q, k, v, cu_seqlens_q=t._cu(lens), max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
                                is_causal=c["causal"], recipe=recipe)
        out.backward(go)
        torch.cuda.synchronize()
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        want = t._fp32_per_sequence(*leaves, lens, c["causal"])
        want.backward(go.float())
        got = [out] + [x.grad for x in (q, k, v)]
        ref = [want] + [x.grad for x in leaves]
        per_seq, start = [], 0
        for n in lens:
            per_seq.append([round(t._rel(g[start:start + n], r[start:start + n]), 4) if n else None
                            for g, r in zip(got, ref)])
            start += n
        rows.append({"step": step, "whole": [round(t._rel(g, r), 4) for g, r in zip(got, ref)],
                     "per_sequence": per_seq})
    return {"stats": (counters.stats() - before).to_dict(), "steps": rows}


def _dense(name, lens_id, flags=""):
    from cudnn_sdpa_provider.engine.packed import seqlen_bucket
    from tests.gpu import test_fp8 as t

    causal = name != "non_causal"
    hk = 2 if name == "gqa_8_2" else 8
    if lens_id == "full":  # no padding mask, (4, 8, 2048, 128)
        shape = dict(b=4, h=8, hk=hk, s=2048, d=128)
    else:
        lens = LENS[lens_id]
        shape = dict(b=len(lens), h=8, hk=hk, s=seqlen_bucket(max(lens)), d=128, lens=lens)
    _variants(flags)
    t.poison_allocator = lambda device: _variants(flags)
    t.test_fp8_forward_and_backward_served_and_within_fp8_bounds(name, shape, dict(is_causal=True) if causal else {})
    return {"shape": shape}


def _dense_e2e(name, s):
    """csp.fp8.attention on dense (1, 8, S, 128) bf16 (no padding): the from-bf16 error at this S."""
    import torch
    import torch.nn.functional as F
    import cudnn_sdpa_provider as csp
    from tests.gpu import test_fp8 as t

    causal = name != "non_causal"
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 8, s, 128, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    go = torch.randn(1, 8, s, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    recipe = csp.fp8.Recipe()
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        out = csp.fp8.attention(q, k, v, is_causal=causal, recipe=recipe)
        out.backward(go)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    want.backward(go.float())
    return {"whole": [round(t._rel(g, r), 4) for g, r in zip([out] + [x.grad for x in (q, k, v)],
                                                             [want] + [x.grad for x in leaves])]}


def _one(argv):
    kind = argv[0]
    try:
        if kind == "dense_e2e":
            res = _dense_e2e(argv[1], int(argv[2]))
        elif kind == "packed":
            res = _packed(argv[1], argv[2], argv[3], argv[4] == "contig", argv[5] if len(argv) > 5 else "")
        else:
            res = _dense(argv[1], argv[2], argv[3] if len(argv) > 3 else "")
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the report is the point
        res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}", "where": traceback.format_exc()[-1500:]}
    print("RESULT " + json.dumps(res), flush=True)


#: The case sets of run 65 (results/gpu-run65-fp8-diag.jsonl): 65a "fresh" (every case in a fresh
#: process), 65b/65c "stale" (the small-block pool left stale, amax zeroed or not, zero lengths),
#: 65d "unpadded" (dense backwards without a padding mask under stale memory).
SETS = {
    "fresh": [["dense", "causal", "b2"], ["dense", "causal", "b4"], ["dense", "causal", "b3"], ["dense", "gqa_8_2", "b4"]]
    + [["packed", "causal", lens, "current", "view"] for lens in ("b4", "b2", "eq", "b3")]
    + [["packed", "causal", "b4", "current", "contig"], ["packed", "causal", "b2", "current", "contig"],
       ["packed", "gqa_8_2", "b4", "current", "view"], ["packed", "gqa_8_2", "b4", "current", "contig"],
       ["packed", "non_causal", "b4", "current", "view"], ["packed", "causal", "b4", "delayed", "view"],
       ["packed", "causal", "b2", "delayed", "view"], ["dense_e2e", "non_causal", "2048"],
       ["dense_e2e", "non_causal", "1024"], ["dense_e2e", "causal", "2048"]],
    "stale": [["packed", "causal", "b4", "current", "view", "poison"],
              ["packed", "causal", "b4", "current", "view", "poison+amax0"],
              ["dense", "causal", "b4", "poison"], ["dense", "causal", "b4", "poison+amax0"],
              ["dense", "gqa_8_2", "b4", "amax0"], ["dense", "gqa_8_2", "b2"],
              ["packed", "gqa_8_2", "b4", "current", "view", "amax0"],
              ["packed", "causal", "b4", "delayed", "view", "poison"],
              ["packed", "causal", "b4", "delayed", "view", "poison+amax0"],
              ["packed", "causal", "z4", "current", "view"], ["dense", "causal", "z4"]],
    "unpadded": [["dense", "causal", "full", "poison"], ["dense", "gqa_8_2", "full", "poison"],
                 ["dense", "non_causal", "full", "poison"]],
}


def main():
    if len(sys.argv) > 1 and sys.argv[1] not in SETS:
        _one(sys.argv[1:])
        return
    cases = SETS[sys.argv[1] if len(sys.argv) > 1 else "fresh"]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for case in cases:
        try:
            p = subprocess.run([sys.executable, __file__, *case], capture_output=True, text=True, env=env, timeout=120)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"ok": False, "rc": p.returncode,
                                                           "stderr": p.stderr[-1500:]}
            extra = [ln for ln in p.stdout.splitlines() if "err vs fp32" in ln]
            if extra:
                res["printed"] = extra
            res["rc"] = p.returncode
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": "timeout 120 s"}
        print(json.dumps({"case": case, **res}), flush=True)


if __name__ == "__main__":
    main()
