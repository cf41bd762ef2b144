"""GPU tier: the known-bad cuDNN table on a real cuDNN (issue #27 item 3).

The cudnn-frontend #1071 shape (a backward at B = H = S_q = 1, S_kv = 128, D = 64, bf16) segfaults
cuDNN >= 9.26 while planning. Through the provider it must fall back (``cudnn_known_issue``) with
correct gradients on those releases, and be served below them. It runs in a child process: a
regression would kill the process, and must show as a failure with its config, not a dead run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu
REPO = pathlib.Path(__file__).resolve().parent.parent.parent

CHILD = """
import torch
import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.engine import machine
from cudnn_sdpa_provider.ops import reference

version = machine.capabilities(torch.cuda.current_device()).cudnn_version
gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
k = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
v = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
go = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
print("explain", [r.slug for r in csp.explain(q, k, v, through_sdpa=False)["dense_bwd"]], flush=True)
before = csp.stats()
out = csp.attention(q, k, v)
out.backward(go)
torch.cuda.synchronize()
region = (csp.stats() - before).to_dict()
leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
ref, _ = reference.dense(*leaves, scale=0.125)
ref.backward(go.float())
for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
    err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    assert err < 4e-2, err
print("version", version, "dense_bwd", region["dense_bwd"], flush=True)
"""


def test_the_1071_backward_falls_back_instead_of_crashing(tmp_path):
    path = tmp_path / "known_issue_1071.py"
    path.write_text(textwrap.dedent(CHILD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    version = int(proc.stdout.split("version ")[1].split()[0])
    if version >= 92500:  # #1071 from 9.26, and #1072 (any S_q == 1 backward) on 9.25-9.26
        assert "explain ['cudnn_known_issue']" in proc.stdout, proc.stdout
        assert "dense_bwd {'served': 0, 'fallback': {'cudnn_known_issue': 1}}" in proc.stdout, proc.stdout
    else:
        assert "dense_bwd {'served': 1, 'fallback': {}}" in proc.stdout, proc.stdout


SDPA_CHILD = """
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import cudnn_sdpa_provider as csp

gen = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
k = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
v = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
with csp.enable(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    before = csp.stats()
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    torch.cuda.synchronize()
    print("dense_bwd", (csp.stats() - before).to_dict()["dense_bwd"], flush=True)
from cudnn_sdpa_provider.engine import machine
from cudnn_sdpa_provider.ops import reference
leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
ref, _ = reference.dense(*leaves, scale=0.125)
ref.sum().backward()
for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
    err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
    assert err < 4e-2, err
print("version", machine.capabilities(torch.cuda.current_device()).cudnn_version, flush=True)
"""


def test_the_1071_backward_through_f_sdpa_does_not_crash(tmp_path):
    # The F.sdpa route's usual fallback is PyTorch's own cuDNN backward kernel, on the same cuDNN,
    # which segfaults at this shape on 9.28.1 (GPU run 51): a known-issue row runs on the composite.
    path = tmp_path / "known_issue_1071_sdpa.py"
    path.write_text(textwrap.dedent(SDPA_CHILD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "dense_bwd {" in proc.stdout, proc.stdout
    version = int(proc.stdout.split("version ")[1].split()[0])
    if version >= 92500:
        assert "dense_bwd {'served': 0, 'fallback': {'cudnn_known_issue': 1}}" in proc.stdout, proc.stdout
