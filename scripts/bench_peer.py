"""``cudnn-sdpa bench`` with nvidia's ``cudnn.torch`` provider as one more path, for comparison only.

    python3 scripts/bench_peer.py [bench options]     e.g. --shapes b16_h16_s1024_d64_causal --json peer.json

The package never imports ``cudnn.torch`` (it is a peer, not a dependency); this script does, and
only inside the ``nvidia_cudnn_torch`` path: the peer's overrides (frontend 1.32+:
``cudnn.torch.install_sdpa_overrides()``) are registered while that path runs, with
``sdpa_kernel(CUDNN_ATTENTION)``, and removed after. Dense and varlen cases get the path; where the
frontend has no ``cudnn.torch`` (1.28), the row is ``skipped`` with the import error.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cudnn_sdpa_provider.tools import cli  # noqa: E402


@contextlib.contextmanager
def nvidia_cudnn_torch():
    import cudnn.torch as peer
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # On torch <= 2.12 a second Python override of an op raises. The provider's backward override
    # stays registered while a forward it served can still be differentiated, i.e. until the
    # autograd graphs of its rows are gone; they may sit in reference cycles, so collect first
    # (docs/troubleshooting.md, "Backward after the scope exits").
    gc.collect()
    handle = peer.install_sdpa_overrides()
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            yield
    finally:
        handle.remove()


if __name__ == "__main__":
    sys.exit(cli.main(["bench", *sys.argv[1:]], bench_peers={"nvidia_cudnn_torch": nvidia_cudnn_torch}))
