"""GPU tier: operands built the way model code builds them, against native PyTorch and fp32 (issue #14).

``CSP_LAYOUT_EXAMPLES`` generated configurations (default 1000; tests/layouts.py: fused QKV / KV
views, heads split from one linear output, head-dim slices, transposes and permutations, expanded
heads / queries / batch, storage offsets and unaligned rows, q is k, grad_out of its own layout;
F.scaled_dot_product_attention inside ``enable()``, ``csp.attention`` dense and packed, and
``varlen_attn`` in every argument form this torch has; GQA, masks, dropout, causal alignments;
forward and backward), deterministic in ``CSP_LAYOUT_SEED``. Each configuration is checked by
tests/layout_runner.py (accuracy by the FlashAttention rule per tensor, strides equal native's, no
NaN, counters) in batches of ``CSP_LAYOUT_BATCH``, each batch in a child process
(tests/layout_batches.py), so a CUDA error or a segfault fails its batch naming the configuration
that was running, and the rest of the batch (in a fresh child) and the other batches still run.

Budget: about 0.5 s per configuration in one child on an H200 (configurations come in families of
``CSP_LAYOUT_VARIANTS`` that share their graphs, so builds are shared), plus a child's start-up;
with 6 children at once, 855 configurations ran in 96 s (GPU run 24). ``CSP_LAYOUT_JOBS`` (default
4) batches run at once (each its own child process, so one's crash cannot touch
another). A batch may take ``CSP_LAYOUT_BATCH_TIMEOUT`` seconds and ``CSP_LAYOUT_RESTARTS`` fresh
children after crashes; the file stops at ``CSP_LAYOUT_DEADLINE`` seconds: a batch still running
then is cut (the configuration it was running is reported as a crash, those after it as not
run), one not started fails. Only the batches
pytest selected (``-k batch3``) run.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

from tests import layouts
from tests.layout_batches import Batches

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("CSP_LAYOUT_EXAMPLES", "1000"))
BATCH = int(os.environ.get("CSP_LAYOUT_BATCH", "125"))
SEED = int(os.environ.get("CSP_LAYOUT_SEED", "14"))
VARIANTS = int(os.environ.get("CSP_LAYOUT_VARIANTS", "4"))
BATCH_TIMEOUT = float(os.environ.get("CSP_LAYOUT_BATCH_TIMEOUT", "180"))
DEADLINE = float(os.environ.get("CSP_LAYOUT_DEADLINE", "450"))
RESTARTS = int(os.environ.get("CSP_LAYOUT_RESTARTS", "3"))  # fresh children per batch after crashes
JOBS = max(int(os.environ.get("CSP_LAYOUT_JOBS", "4")), 1)  # batches (child processes) at once
# Generation only inspects torch's signatures: nothing here touches CUDA at collection.
BATCHES = layouts.split(layouts.generate(EXAMPLES, SEED, layouts.capabilities("cuda"), VARIANTS), BATCH)
NAME = "test_generated_layouts_agree_with_native"


@pytest.fixture(scope="module")
def batch_runs(request, tmp_path_factory):
    """Every selected batch, ``JOBS`` at a time (tests/layout_batches.py ``Batches``)."""
    selected = sorted(item.callspec.params["index"] for item in request.session.items
                      if item.originalname == NAME and hasattr(item, "callspec"))
    workdirs = {index: tmp_path_factory.mktemp(f"batch{index}") for index in selected}  # not thread-safe
    runs = Batches({index: BATCHES[index] for index in selected}, workdirs, "cuda", jobs=JOBS, deadline=DEADLINE,
                   batch_timeout=BATCH_TIMEOUT, restarts=RESTARTS)
    yield runs
    runs.close()  # after -x or ^C, batches not started never start


def _outcomes(result) -> dict:
    """How the configurations were counted ('dense_fwd=served dense_bwd=served': n), for the record."""
    return dict(collections.Counter(result.ok.values()).most_common())


@pytest.mark.parametrize("index", range(len(BATCHES)), ids=[f"batch{i}" for i in range(len(BATCHES))])
def test_generated_layouts_agree_with_native(index, batch_runs, record_property):
    batch = BATCHES[index]
    result = batch_runs.result(index)
    if result is None:
        pytest.fail(f"batch {index} (configs {batch[0]['id']}..{batch[-1]['id']}) not run: the file's "
                    f"{DEADLINE:.0f} s (CSP_LAYOUT_DEADLINE) were spent before it started")
    record_property("layout_configs_ok", len(result.ok))
    record_property("layout_batch_seconds", round(result.seconds, 1))
    record_property("layout_outcomes", json.dumps(_outcomes(result)))
    problems = result.problems(batch)
    assert not problems, f"{len(problems)} problem(s) in batch {index} ({len(result.ok)} ok):\n" + "\n".join(
        problems[:20])
    assert len(result.ok) == len(batch)
