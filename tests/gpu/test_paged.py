"""GPU tier: a dense query over a paged KV cache (``csp.attention(block_table=)``): decode and
chunked prefill served on cuDNN's paged graph, against an fp32 loop reference that reads every key
through the table and against native F.sdpa on the gathered cache (same inputs); fallbacks with
their reasons; bad tables in a child process (a read outside the cache would end it); CUDA graphs
and torch.compile."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.core import counters
from tests.paged_support import make_paged, paged_reference
from tests.util import TOL, assert_rel_close, grad_tol, poison_allocator

pytestmark = pytest.mark.gpu
DEV = "cuda"
REPO = pathlib.Path(__file__).resolve().parents[2]

#: (name, make_paged kwargs, attention kwargs)
CASES = [
    ("decode_gqa_bs16", dict(b=4, h_q=8, h_k=2, s_q=1, d=128, block_size=16, max_blocks=32), {}),
    ("decode_fa_layout", dict(b=4, h_q=8, h_k=2, s_q=1, d=128, block_size=16, max_blocks=32, fa_layout=True), {}),
    ("decode_causal_br", dict(b=3, h_q=8, h_k=8, s_q=1, d=64, block_size=64, max_blocks=8),
     dict(is_causal=True, bottom_right=True)),
    ("decode_mqa_bs1", dict(b=2, h_q=8, h_k=1, s_q=1, d=128, block_size=1, max_blocks=300), {}),
    ("decode_d256_bs256", dict(b=2, h_q=4, h_k=2, s_q=1, d=256, block_size=256, max_blocks=4), {}),
    ("decode_fp16", dict(b=4, h_q=8, h_k=2, s_q=1, d=128, block_size=16, max_blocks=32, dtype=torch.float16), {}),
    ("prefill_causal_br_ragged_q", dict(b=3, h_q=8, h_k=2, s_q=64, d=128, block_size=16, max_blocks=16,
                                        lens_q=[64, 17, 0], lens_kv=[256, 40, 9]), dict(is_causal=True, bottom_right=True)),
    ("prefill_noncausal", dict(b=2, h_q=8, h_k=2, s_q=128, d=128, block_size=32, max_blocks=8), {}),
    ("prefill_window_fa_layout", dict(b=2, h_q=8, h_k=2, s_q=64, d=128, block_size=16, max_blocks=16, fa_layout=True),
     dict(window=(50, 0), bottom_right=True)),
    ("prefill_sinks", dict(b=2, h_q=8, h_k=2, s_q=64, d=128, block_size=16, max_blocks=16),
     dict(is_causal=True, bottom_right=True, sinks=True)),
]


def _native(q, k_cache, v_cache, table, lens_q, lens_kv, window, bottom_right):
    """PyTorch's own SDPA on the gathered cache with a boolean mask (what a user without paged
    attention runs), in q's dtype; rows that see no key are set to 0 as the provider defines them."""
    b, h_q, s_q, _ = q.shape
    m, block_size = table.shape[1], k_cache.shape[2]
    k = k_cache[table.long()].permute(0, 2, 1, 3, 4).reshape(b, k_cache.shape[1], m * block_size, -1)
    v = v_cache[table.long()].permute(0, 2, 1, 3, 4).reshape(b, v_cache.shape[1], m * block_size, -1)
    i = torch.arange(s_q, device=DEV).view(1, 1, -1, 1)
    j = torch.arange(m * block_size, device=DEV).view(1, 1, 1, -1)
    lq, lk = lens_q.view(-1, 1, 1, 1).long(), lens_kv.view(-1, 1, 1, 1).long()
    pos = i + (lk - lq if bottom_right else 0)
    allowed = (j < lk) & (i < lq)
    if window[1] >= 0:
        allowed &= j <= pos + window[1]
    if window[0] >= 0:
        allowed &= j >= pos - window[0]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=h_q != k.shape[1])
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0)


def _window(kw):
    return (-1, 0) if kw.get("is_causal") else kw.get("window", (-1, -1))


@pytest.mark.parametrize("name,shape,kw", CASES, ids=[c[0] for c in CASES])
@torch.no_grad()
def test_paged_served_and_equal_to_reference_and_native(name, shape, kw):
    gen = torch.Generator(device=DEV).manual_seed(3)
    dtype = shape.pop("dtype", torch.bfloat16)
    q, kc, vc, table, lq, lk = make_paged(**shape, dtype=dtype, device=DEV, gen=gen)
    kw = dict(kw)
    sinks = torch.randn(q.shape[1], device=DEV, generator=gen) if kw.pop("sinks", False) else None
    window, bottom_right = _window(kw), kw.get("bottom_right", False)
    poison_allocator(DEV)
    before = counters.stats()
    out = csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_q=lq, seq_lens_kv=lk, sinks=sinks, **kw)
    torch.cuda.synchronize()
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 1, "fallback": {}}, delta
    ref = paged_reference(q, kc, vc, table, lq, lk, window=window, bottom_right=bottom_right, sinks=sinks,
                          dtype=torch.float32)
    assert_rel_close(out.float(), ref, TOL[dtype], f"{name}: out vs fp32 reference")
    rows = torch.arange(q.shape[2], device=DEV).view(1, 1, -1, 1) >= lq.view(-1, 1, 1, 1)
    assert torch.all(out.masked_select(rows) == 0), "rows past seq_lens_q must be 0"
    if sinks is None:
        native = _native(q, kc, vc, table, lq, lk, window, bottom_right)
        assert_rel_close(out.float(), native.float(), TOL[dtype], f"{name}: out vs native F.sdpa on the gathered cache")


@torch.no_grad()
def test_paged_output_follows_q_dimension_order():
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, kc, vc, table, lq, lk = make_paged(2, 8, 2, 32, 128, 16, 8, device=DEV, gen=gen)
    q_bshd = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D) storage
    out = csp.attention(q_bshd, kc, vc, block_table=table, seq_lens_kv=lk, is_causal=True, bottom_right=True,
                        kv_layout="HND")
    assert out.stride() == torch.empty_like(q_bshd).stride()
    ref = paged_reference(q, kc, vc, table, lq, lk, window=(-1, 0), bottom_right=True, dtype=torch.float32)
    assert_rel_close(out.float(), ref, TOL[torch.bfloat16], "out of a BSHD query")


@pytest.mark.parametrize("block_size", [4, 16])
@torch.no_grad()
def test_an_nhd_cache_is_served_in_place_and_equals_the_hnd_reading(block_size):
    """kv_layout="NHD": a (N, block_size, H_kv, D) cache (FlashAttention's, vLLM's) served on the
    paged graph as its transposed view, with the answer of the same logical cache stored HND
    (issue #29; block size 4 with H_q 8, H_kv 2 is the issue's case, whose shape fits both)."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    q, kc, vc, table, lq, lk = make_paged(3, 8, 2, 5, 128, block_size, 64 // block_size, device=DEV, gen=gen,
                                          lens_q=[5, 1, 3])
    nhd_k, nhd_v = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    before = counters.stats()
    hnd = csp.attention(q, kc, vc, block_table=table, seq_lens_q=lq, seq_lens_kv=lk, kv_layout="HND",
                        is_causal=True, bottom_right=True)
    nhd = csp.attention(q, nhd_k, nhd_v, block_table=table, seq_lens_q=lq, seq_lens_kv=lk, kv_layout="NHD",
                        is_causal=True, bottom_right=True)
    torch.cuda.synchronize()
    assert (counters.stats() - before).to_dict()["paged_fwd"] == {"served": 2, "fallback": {}}
    ref = paged_reference(q, kc, vc, table, lq, lk, window=(-1, 0), bottom_right=True, dtype=torch.float32)
    assert_rel_close(nhd.float(), ref, TOL[torch.bfloat16], "NHD cache vs fp32 reference")
    assert_rel_close(nhd.float(), hnd.float(), TOL[torch.bfloat16], "NHD vs HND reading of the same cache")


@torch.no_grad()
def test_block_size_not_a_power_of_two_falls_back_with_its_reason():
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, kc, vc, table, lq, lk = make_paged(2, 8, 2, 1, 128, 48, 6, device=DEV, gen=gen)
    before = counters.stats()
    out = csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk)
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 0, "fallback": {"paged_block_size": 1}}, delta
    ref = paged_reference(q, kc, vc, table, lq, lk, dtype=torch.float32)
    assert_rel_close(out.float(), ref, TOL[torch.bfloat16], "block size 48 on the composite")


def test_paged_call_with_grad_runs_the_composite_and_its_gradients_are_right():
    gen = torch.Generator(device=DEV).manual_seed(6)
    q, kc, vc, table, lq, lk = make_paged(2, 4, 2, 8, 64, 16, 4, device=DEV, gen=gen)
    leaves = [t.detach().requires_grad_() for t in (q, kc, vc)]
    before = counters.stats()
    out = csp.attention(*leaves, kv_layout="HND", block_table=table, seq_lens_kv=lk, is_causal=True, bottom_right=True)
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 0, "fallback": {"paged_backward": 1}}, delta
    go = torch.randn_like(out)
    out.backward(go)
    refs = [t.detach().float().requires_grad_() for t in (q, kc, vc)]
    ref = paged_reference(*refs, table, lq, lk, window=(-1, 0), bottom_right=True, dtype=torch.float32)
    ref.backward(go.float())
    assert_rel_close(out.detach().float(), ref.detach(), TOL[torch.bfloat16], "out")
    for name, t, r in zip(("dq", "dk_cache", "dv_cache"), leaves, refs):
        assert_rel_close(t.grad.float(), r.grad, grad_tol(torch.bfloat16, 2), name)


def test_validate_true_raises_for_a_used_entry_outside_the_cache():
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, kc, vc, table, lq, lk = make_paged(2, 8, 2, 1, 128, 16, 4, device=DEV, gen=gen, lens_kv=[64, 20])
    table[1, 1] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]"):
        csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk, validate=True)


BAD_TABLE_CHILD = """
import torch, cudnn_sdpa_provider as csp
from tests.paged_support import make_paged, paged_reference
gen = torch.Generator(device="cuda").manual_seed(8)
q, kc, vc, table, lq, lk = make_paged(4, 8, 2, 1, 128, 16, 64, device="cuda", gen=gen, lens_kv=[1000, 600, 900, 1000])
unused = table.clone()
table[0, 3] = 10**9          # far outside the cache
table[1, 0] = -7
lk[2] = 64 * 16 + 5          # past the table's capacity
table[3, 63] = 10**9         # outside the cache, but row 3's 1000 keys use blocks 0..62 only
out = csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk, validate=False)
torch.cuda.synchronize()     # an illegal read would raise here (and poison the context)
assert torch.isnan(out[:3]).all(), "rows 0-2 must be NaN"
ref_lk = lk.clone(); ref_lk[2] = 0  # the reference reads row 2's table only within its capacity
ref = paged_reference(q, kc, vc, unused, lq, ref_lk, dtype=torch.float32)
err = (out[3].float() - ref[3]).abs().max().item() / ref[3].abs().max().item()
assert err < 2e-2, err
print("child ok", csp.stats().to_dict()["paged_fwd"])
"""


def test_bad_tables_and_lengths_give_nan_rows_and_never_read_outside_the_cache(tmp_path):
    path = tmp_path / "bad_table.py"
    path.write_text(textwrap.dedent(BAD_TABLE_CHILD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"child exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "child ok {'served': 1, 'fallback': {}}" in proc.stdout, proc.stdout


@torch.no_grad()
def test_decode_captured_in_a_cuda_graph_replays_with_new_values():
    gen = torch.Generator(device=DEV).manual_seed(9)
    q, kc, vc, table, lq, lk = make_paged(4, 8, 2, 1, 128, 16, 32, device=DEV, gen=gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the graph is built before capture
        csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = counters.stats()
    with torch.cuda.graph(graph):
        out = csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk)
    for step in range(3):
        q.copy_(torch.randn(q.shape, device=DEV, generator=gen))
        kc.copy_(torch.randn(kc.shape, device=DEV, generator=gen))
        table.copy_(table[torch.randperm(table.shape[0], device=DEV, generator=gen)])
        lk.copy_(torch.randint(1, 32 * 16 + 1, lk.shape, device=DEV, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_reference(q, kc, vc, table, lq, lk, dtype=torch.float32)
        assert_rel_close(out.float(), ref, TOL[torch.bfloat16], f"replay {step}")
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 1, "fallback": {}}, delta  # Python ran at capture only


@torch.no_grad()
def test_compiled_decode_is_served_on_every_call():
    gen = torch.Generator(device=DEV).manual_seed(10)
    q, kc, vc, table, lq, lk = make_paged(4, 8, 2, 1, 128, 16, 32, device=DEV, gen=gen)

    def decode(q, kc, vc, table, lk):
        return csp.attention(q, kc, vc, kv_layout="HND", block_table=table, seq_lens_kv=lk)

    compiled = torch.compile(decode, fullgraph=True)
    compiled(q, kc, vc, table, lk)
    before = counters.stats()
    for _ in range(3):
        out = compiled(q, kc, vc, table, lk)
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 3, "fallback": {}}, delta
    assert_rel_close(out.float(), decode(q, kc, vc, table, lk).float(), 1e-6, "compiled vs eager")


@torch.no_grad()
def test_strided_table_and_lengths_are_read_as_their_values():
    gen = torch.Generator(device=DEV).manual_seed(11)
    q, kc, vc, table, lq, lk = make_paged(4, 8, 2, 1, 128, 16, 16, device=DEV, gen=gen)
    table_t = table.t().contiguous().t()  # same values, column-major
    pairs = torch.stack([lk, lk], dim=1)  # lengths as a strided column
    out = csp.attention(q, kc, vc, kv_layout="HND", block_table=table_t, seq_lens_kv=pairs[:, 0])
    ref = paged_reference(q, kc, vc, table, lq, lk, dtype=torch.float32)
    assert_rel_close(out.float(), ref, TOL[torch.bfloat16], "strided table and lengths")


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_packed_queries_over_a_paged_cache_served_and_equal_to_the_reference(causal):
    """varlen_attn's form (torch 2.11 has no paged varlen_attn: the same path through csp.attention)."""
    gen = torch.Generator(device=DEV).manual_seed(12)
    lens_q = [64, 1, 0, 17]
    q4, kc, vc, table, lq, lk = make_paged(4, 8, 2, 64, 128, 16, 16, device=DEV, gen=gen, fa_layout=True,
                                           lens_q=lens_q, lens_kv=[200, 31, 5, 17])
    packed = torch.cat([q4[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_q)])
    cu = torch.tensor([0, 64, 65, 65, 82], dtype=torch.int32, device=DEV)
    kw = dict(is_causal=True, bottom_right=True) if causal else {}
    poison_allocator(DEV)
    before = counters.stats()
    out = csp.attention(packed, kc, vc, block_table=table, cu_seqlens_q=cu, max_seqlen_q=64, seq_lens_kv=lk,
                        kv_layout="HND", **kw)
    delta = (counters.stats() - before).to_dict()
    assert delta["paged_fwd"] == {"served": 1, "fallback": {}}, delta
    ref = paged_reference(q4, kc, vc, table, lq, lk, window=(-1, 0) if causal else (-1, -1), bottom_right=causal,
                          dtype=torch.float32)
    want = torch.cat([ref[b, :, :n].transpose(0, 1) for b, n in enumerate(lens_q)])
    assert out.stride() == torch.empty_like(packed).stride()
    assert_rel_close(out.float(), want, TOL[torch.bfloat16], "packed queries over the cache")
