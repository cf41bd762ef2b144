"""Numerical helpers shared by the test tiers: one tolerance table, errors relative to each
tensor's magnitude, failures that name the worst element."""

from __future__ import annotations

import contextlib
import warnings

import torch

#: Relative (to max|ref|) tolerance per dtype for outputs; gradients get GRAD_FACTOR more.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
GRAD_FACTOR = 2.0


def rel_error(actual: torch.Tensor, ref: torch.Tensor) -> tuple[float, tuple]:
    """max|actual - ref| / max|ref|, and where it is worst. NaN must appear in both or neither."""
    a, r = actual.double(), ref.double()
    if r.numel() == 0:
        return 0.0, ()
    nan_a, nan_r = torch.isnan(a), torch.isnan(r)
    if not torch.equal(nan_a, nan_r):
        worst = tuple(torch.nonzero(nan_a ^ nan_r)[0].tolist())
        return float("inf"), worst
    a, r = a.masked_fill(nan_a, 0.0), r.masked_fill(nan_r, 0.0)
    diff = (a - r).abs()
    scale = r.abs().max().item() or 1.0
    flat = int(diff.argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return diff.max().item() / scale, worst


def assert_rel_close(actual, ref, tol: float, name: str) -> None:
    assert actual.shape == ref.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    err, worst = rel_error(actual, ref)
    assert err <= tol, (
        f"{name}: max|err|/max|ref| = {err:.3e} > {tol:.1e} at {worst}: "
        f"got {actual[worst].item():.6g}, want {ref[worst].item():.6g}"
    )


def grad_tol(dtype, group: int = 1) -> float:
    """GQA dK/dV sum over the group of query heads, so their error grows with the group size."""
    return TOL[dtype] * GRAD_FACTOR * max(1.0, group**0.5)


def poison_allocator(device, nbytes: int = 256 << 20, small_blocks: int = 4096) -> None:
    """Fill the caching allocator's next blocks with NaN so an output a kernel forgot to write, or a
    buffer it reads before writing, shows up as NaN instead of a lucky zero: one large block of
    ``nbytes``, and ``small_blocks`` 512-byte blocks of the small-block pool (allocations up to
    1 MiB: amax outputs, lengths, small workspaces), which a large block never reaches. Runs 64-65
    found cuDNN's FP8 backward folding into stale small blocks (results/gpu-run65-fp8-diag.jsonl)."""
    junk = torch.full((nbytes // 4,), float("nan"), device=device)
    small = [torch.full((128,), float("nan"), device=device)
             for _ in range(small_blocks if torch.device(device).type == "cuda" else 0)]
    del junk, small


def make_dense(b, h_q, h_k, h_v, s_q, s_kv, d_qk, d_v, dtype, device, order="bhsd", requires_grad=True, gen=None):
    """Random q, k, v stored in ``order`` (a permutation of 'bhsd'), viewed as (B, H, S, D)."""
    def one(h, s, d):
        sizes = dict(b=b, h=h, s=s, d=d)
        storage = torch.randn([sizes[c] for c in order], dtype=torch.float32, device=device, generator=gen)
        t = storage.to(dtype).permute([order.index(c) for c in "bhsd"])
        return t.detach().requires_grad_(requires_grad)

    return one(h_q, s_q, d_qk), one(h_k, s_kv, d_qk), one(h_v, s_kv, d_v)


@contextlib.contextmanager
def no_host_syncs():
    """Any synchronizing CUDA call inside raises (``torch.cuda.set_sync_debug_mode("error")``);
    the mode is restored on exit, also when the block fails. PyTorch's once-per-process "prototype
    feature" warning on entering the mode is not a failure."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


#: torch releases whose ``opcheck`` AOT test reads ``.grad`` of its own clones of our inputs.
_OPCHECK_READS_CLONE_GRAD = (2, 14)


def opcheck(op, args) -> None:
    """``torch.library.opcheck(op, args)`` on exactly these inputs, strides included.

    Workaround for torch >= 2.14: opcheck's ``test_aot_dispatch_dynamic`` clones every input
    (torch/testing/_internal/optests/aot_autograd.py, ``_clone_input_for_aot_autograd``), so an input
    that requires grad becomes a non-leaf clone, and fake-tensor conversion then reads that clone's
    ``.grad`` (torch/_subclasses/meta_utils.py, ``safe_grad``). ``safe_grad`` hides the resulting
    warning by swapping ``warnings.showwarning``, which cannot stop a warning that the warning filters
    (our ``filterwarnings = error``) turn into an exception first; the same happens for
    ``aten::sin`` on a leaf input, so no choice of inputs avoids it. Only that one message is ignored,
    only inside opcheck; ``test_ops_cpu.py::test_opcheck_clone_grad_workaround_is_still_needed``
    fails once a torch release no longer needs it, and then this can go."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < _OPCHECK_READS_CLONE_GRAD:
        torch.library.opcheck(op, args)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        torch.library.opcheck(op, args)


def region(fn):
    """fn()'s result and the counters it moved: {path: fallback reasons} (served must stay 0 on CPU)."""
    from cudnn_sdpa_provider.core import counters

    before = counters.stats()
    result = fn()
    delta = (counters.stats() - before).to_dict()
    assert all(e["served"] == 0 for e in delta.values()), delta
    return result, {p: e["fallback"] for p, e in delta.items() if e["fallback"]}
