"""GPU tier: scripts/multi_gpu.py with one rank on one GPU (NCCL), where every check, context
parallelism included (a ring of one), must pass with every call served. The 2-GPU run is
`torchrun --nproc-per-node 2` on a 2-GPU host; the CPU tier's two gloo ranks are
tests/test_multi_gpu_script.py, whose helpers these use."""

from __future__ import annotations

import pytest

from tests.test_multi_gpu_script import _ranks, _torchrun


@pytest.mark.gpu
def test_one_gpu_rank_every_check_served(tmp_path):
    result = _torchrun(tmp_path, 1, "--device", "cuda")
    assert result.returncode == 0, result.stdout + result.stderr
    (rank,) = _ranks(tmp_path, 1)
    for kind in ("ddp", "fsdp2", "cp"):
        assert rank["checks"][kind]["ok"], rank["checks"][kind]
        assert "skipped" not in rank["checks"][kind]
