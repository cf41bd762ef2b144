"""The known-bad cuDNN rows (core/known_issues.py) against the cuDNN this machine runs, each in a child
process: PyTorch alone (F.sdpa, its cuDNN backend forced), csp.attention with the table switched off
(what a call would do without the guard), and with it on (what the provider does):

    python3 scripts/known_issue_repro.py            # one JSON line per row and mode

Rows tried: cudnn-frontend #1071 (backward at B = H = S_q = 1, S_kv = 128, D = 64, bf16: plan creation
segfaults on cuDNN >= 9.26) and #1072 (backward at B 1, H 2, S_q 1, S_kv 128, D 64, bf16 with very
negative scores: NaN dK/dV on 9.25.1 and 9.26). A child that dies shows as its exit code (-11: SIGSEGV);
one that lives reports what served the backward and the gradients' error against fp32.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = """
import json, sys, torch
import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import known_issues
from cudnn_sdpa_provider.engine import machine
from cudnn_sdpa_provider.ops import reference

row, mode = sys.argv[1], sys.argv[2]
if mode == "off":
    known_issues.KNOWN_ISSUES = ()
version = machine.capabilities(torch.cuda.current_device()).cudnn_version
gen = torch.Generator(device="cuda").manual_seed(0)
h = 1 if row == "1071" else 2
q = torch.randn(1, h, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
k = torch.randn(1, h, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
v = torch.randn(1, h, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
if row == "1072":  # very negative scores: every key leans along u, q against it (scores about -40)
    u = torch.randn(64, device="cuda", generator=gen)
    u = u / u.norm()
    k = (k.float() + 10.0 * u).to(torch.bfloat16)
    q = (-30.0 * u).expand(1, h, 1, 64).to(torch.bfloat16).contiguous()
q, k, v = (t.requires_grad_() for t in (q, k, v))
go = torch.randn(1, h, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
before = csp.stats()
print(json.dumps({"row": row, "mode": mode, "cudnn": version, "stage": "before backward"}), flush=True)
if mode == "torch":  # PyTorch alone, its cuDNN backend forced
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
else:
    out = csp.attention(q, k, v)
out.backward(go)
torch.cuda.synchronize()
region = (csp.stats() - before).to_dict()
leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
ref, _ = reference.dense(*leaves, scale=64 ** -0.5)
ref.backward(go.float())
errs = {}
for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), (t.grad for t in leaves)):
    errs["d" + name] = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
print(json.dumps({"row": row, "mode": mode, "cudnn": version, "dense_bwd": region["dense_bwd"],
                  "nonfinite_grads": int(sum((~torch.isfinite(t.grad)).sum().item() for t in (q, k, v))),
                  "rel_err": errs}), flush=True)
"""


def main() -> int:
    for row in ("1071", "1072"):
        for guard in ("torch", "off", "on"):
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), row, guard], capture_output=True,
                                  text=True, timeout=600)
            last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            print(json.dumps({"row": row, "mode": guard, "exit": proc.returncode,
                              "result": json.loads(last[-1]) if last else None,
                              "stderr_tail": proc.stderr[-300:] if proc.returncode else ""}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
