"""Decode over a KV cache on bare cuDNN graphs: the query heads of a KV group as query rows (GPU).

Issue #28 serves a decode call at a new KV length on the folded graph (``engine/folded.py``): the
(batch, KV head) pairs become a ragged batch of ``n = B * H_kv`` folds, each fold's ``G = H_q / H_kv``
query heads its head dim, one query row, K and V one head at a ragged offset, the padding mask giving
the real length. Its kernel ran at about half the dense graph's speed at long S (the issue's bare
measurement: 0.077 against 0.040 ms at S 4096). At S_q = 1 a group's G query heads can instead be
declared as G query rows of one head: Q (n, 1, G, D), the same memory, with the padding mask's
``seq_len_q = G`` and no causal mask (a one-row decode call under a bottom-right causal mask sees
every key, as with none). Then each fold's K and V are one head read by all G rows at once.

This builds, with ``cudnn.pygraph`` only (no package code), three forward graphs for
(B, H_q/H_kv, 1, D) bf16 over a contiguous (B, H_kv, S, D) cache:

* ``dense``: the exact graph, built at each S;
* ``heads``: the folded graph as the package declares it today, built once at the bucket S_b;
* ``rows``: the group as query rows, built once at S_b;

and at each S of ``--lengths``, for each graph: the build time (ms; the folded ones at their first
length only), the CUDA-event time per execute over back-to-back executes queued behind a GPU sleep
(device time, the host hidden; median of ``--rounds``),
and the largest error of O against an fp32 reference relative to its largest magnitude. K and V
are views of a buffer that holds NaN past the cache's end, and O is poisoned with NaN before each
checked execute: a read past a length or an element left unwritten shows as NaN.

    python3 scripts/decode_rows_probe.py [--shape 8,32,8,128] [--lengths 17,1000,3001,4000,4096]
                                         [--calls 100] [--rounds 5]

Exit status: 0; 1 when a served result is NaN or more than 2% of max off the reference; 4 without
CUDA or nvidia-cudnn-frontend. A graph cuDNN declines is printed as such (not a failure).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

TOLERANCE = 0.02  # bf16 output against fp32, relative to max |reference|
#: GPU sleep queued before each timed round, per execute (about 60 us at 1.7 GHz): longer than the host
#: takes to issue one, so the events time the kernels, not the host
SLEEP_CYCLES_PER_CALL = 100_000
_Q, _K, _V, _O, _SEQ_Q, _SEQ_KV, _RAG_K, _RAG_V = range(1, 9)


def parse_ints(text: str, n: int | None, what: str) -> tuple[int, ...]:
    """Comma-separated positive ints (exactly ``n`` of them where given)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or (n is not None and len(values) != n):
        count = f"{n} " if n is not None else ""
        raise argparse.ArgumentTypeError(f"{what} takes {count}comma-separated positive ints, got {text!r}")
    return values


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """B,H_q,H_kv,D, H_kv dividing H_q."""
    shape = parse_ints(text, 4, "--shape (B,H_q,H_kv,D)")
    if shape[1] % shape[2]:
        raise argparse.ArgumentTypeError(f"--shape: H_kv must divide H_q, got {text!r}")
    return shape


def bucket(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _graph(cudnn, handle, variant: str, b: int, h: int, hk: int, s: int, d: int):
    """(graph, build ms) for one variant, or (None, the error) where cuDNN declines it."""
    g_ = h // hk
    n = b * hk
    bf16, i32 = cudnn.data_type.BFLOAT16, cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    kw = {"attn_scale": d ** -0.5, "generate_stats": False}
    if variant == "dense":
        q_dim, q_stride = [b, h, 1, d], [h * d, d, d, 1]
        kv_dim, kv_stride = [b, hk, s, d], [hk * s * d, s * d, d, 1]
    else:
        if variant == "heads":  # the group's query heads as the head dim (today's fold)
            q_dim, q_stride = [n, g_, 1, d], [g_ * d, d, d, 1]
        else:  # the same memory as G query rows of one head
            q_dim, q_stride = [n, 1, g_, d], [g_ * d, g_ * d, d, 1]
        kv_dim, kv_stride = [n, 1, s, d], [s * d, s * d, d, 1]
    q = g.tensor(name="q", dim=q_dim, stride=q_stride, data_type=bf16, uid=_Q)
    k = g.tensor(name="k", dim=kv_dim, stride=kv_stride, data_type=bf16, uid=_K)
    v = g.tensor(name="v", dim=kv_dim, stride=kv_stride, data_type=bf16, uid=_V)
    if variant != "dense":
        for t, uid in ((k, _RAG_K), (v, _RAG_V)):
            t.set_ragged_offset(g.tensor(name=f"rag{uid}", dim=[n + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                                         uid=uid))
        kw.update(use_padding_mask=True,
                  seq_len_q=g.tensor(name="seq_q", dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=_SEQ_Q),
                  seq_len_kv=g.tensor(name="seq_kv", dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32,
                                      uid=_SEQ_KV))
    o, _ = g.sdpa(q, k, v, **kw)
    o.set_output(True).set_uid(_O).set_dim(q_dim).set_stride(q_stride).set_data_type(bf16)
    start = time.perf_counter()
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as exc:  # noqa: BLE001 - a declined graph is a finding
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return g, (time.perf_counter() - start) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(8, 32, 8, 128), help="B,H_q,H_kv,D")
    parser.add_argument("--lengths", type=lambda t: parse_ints(t, None, "--lengths"),
                        default=(17, 1000, 3001, 4000, 4096))
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args(argv)
    try:
        import cudnn
    except ImportError:
        cudnn = None
    if cudnn is None or not torch.cuda.is_available():
        print("decode_rows_probe: needs a CUDA GPU and nvidia-cudnn-frontend", file=sys.stderr)
        return 4
    b, h, hk, d = a.shape
    g_, n = h // hk, b * hk
    s_b = bucket(max(a.lengths))
    dev = torch.device("cuda")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, frontend "
          f"{cudnn.__version__}: decode q ({b}, {h}, 1, {d}) over K/V ({b}, {hk}, S, {d}) bf16; folded graphs built "
          f"at S_b {s_b}; {a.rounds} rounds of {a.calls} executes")
    gen = torch.Generator(device=dev).manual_seed(0)
    folded = {v: _graph(cudnn, handle, v, b, h, hk, s_b, d) for v in ("heads", "rows")}
    status = 0
    for s in a.lengths:
        # the cache, then NaN canaries as long as the bucket: a read past a fold's length shows
        store = torch.full((2, n * s * d + s_b * d), float("nan"), device=dev, dtype=torch.bfloat16)
        kv = store[:, :n * s * d].view(2, b, hk, s, d)
        kv.copy_(torch.randn(kv.shape, device=dev, dtype=torch.bfloat16, generator=gen))
        k, v = kv[0], kv[1]
        q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        graphs = {"dense": _graph(cudnn, handle, "dense", b, h, hk, s, d), **folded}
        offsets = (torch.arange(n + 1, device=dev, dtype=torch.int32) * (s * d))
        lengths = {"heads": 1, "rows": g_}
        for variant, (g, built) in graphs.items():
            if g is None:
                print(f"  S {s:5d} {variant:5s} declined: {built}")
                continue
            o = torch.full_like(q, float("nan"))
            pack = {_Q: q, _K: k, _V: v, _O: o}
            if variant != "dense":
                pack.update({_RAG_K: offsets, _RAG_V: offsets,
                             _SEQ_Q: torch.full((n, 1, 1, 1), lengths[variant], device=dev, dtype=torch.int32),
                             _SEQ_KV: torch.full((n, 1, 1, 1), s, device=dev, dtype=torch.int32)})
            workspace = torch.empty(max(int(g.get_workspace_size()), 1), device=dev, dtype=torch.uint8)
            g.execute(pack, workspace, handle=handle)
            torch.cuda.synchronize()
            error = ((o.float() - ref).abs().max() / ref.abs().max()).item()  # NaN where unwritten or past a length
            bad = not error <= TOLERANCE
            status = max(status, int(bad))
            times = []
            for _ in range(a.rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * a.calls)  # the executes queue behind it: device time only
                start.record()
                for _ in range(a.calls):
                    g.execute(pack, workspace, handle=handle)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / a.calls)
            build = f"build {built:7.1f} ms" if variant == "dense" or s == a.lengths[0] else " " * 16
            print(f"  S {s:5d} {variant:5s} {build}  {statistics.median(times) * 1e3:8.1f} us per execute  error "
                  f"{error:.4f}{'  OVER/NaN' if bad else ''}")
    return status


if __name__ == "__main__":
    sys.exit(main())
