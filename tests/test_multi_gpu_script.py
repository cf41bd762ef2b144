"""scripts/multi_gpu.py under torchrun (Multi-GPU issue).

CPU tier: two ranks on gloo; DDP and FSDP2 with the provider on equal the provider off, every
attention call counted (falling back with ``no_cuda``), context parallelism skipped with its reason.
The GPU tier's one-rank run is tests/gpu/test_multi_gpu_gpu.py; the 2-GPU run is
`torchrun --nproc-per-node 2` on a 2-GPU host.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "multi_gpu.py"


def _torchrun(tmp_path, nproc: int, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDNN_SDPA_PROVIDER")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), "--out", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _ranks(tmp_path, n: int) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def test_two_cpu_ranks_ddp_and_fsdp2_equal_provider_off(tmp_path):
    result = _torchrun(tmp_path, 2, "--device", "cpu", "--steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all ranks: ok" in result.stdout, result.stdout
    for rank in _ranks(tmp_path, 2):
        assert rank["world"] == 2
        for kind in ("ddp", "fsdp2"):
            check = rank["checks"][kind]
            assert check["ok"] and check["loss_rel_err"] <= 1e-5, check
            assert len(check["losses_on"]) == 3
            for path in ("dense_fwd", "dense_bwd"):  # 3 steps x 2 layers, each counted with its reason
                assert check["telemetry"][path] == {"served": 0, "fallback": {"no_cuda": 6}}, check["telemetry"]
        assert rank["checks"]["cp"] == {"ok": True, "skipped": "context parallelism runs the cuDNN op on CUDA only"}


def test_bad_arguments_are_usage_errors(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--checks", "ddp,nope"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "unknown ['nope']; choose from ddp, fsdp2, cp" in result.stderr
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu"], capture_output=True, text=True,
                            timeout=120, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert result.returncode == 2 and "run it under torchrun" in result.stderr
