"""Run 8 diagnostic (results/gpu-runs.md): the fuzz case whose dSink was off (seed 683). Which input is wrong:
our O, our LSE, or neither? Prints dSink from each combination of ours and the fp32 reference. GPU only."""
import math, sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import tests.gpu.test_reliability as T
import cudnn_sdpa_provider as csp
from cudnn_sdpa_provider.ops import reference
from cudnn_sdpa_provider.core import rows

cfg = dict(dtype=torch.bfloat16, b=2, h_k=1, group=1, v_heads_same=False, s_q=64, s_kv=17, dims=(128, 128),
           mask="band", sinks=True, padded="yes", order="bhsd", odd="slice", seed=683)
for odd in ("slice", "no"):
    cfg["odd"] = odd
    gen = torch.Generator(device="cuda").manual_seed(683)
    q = T._make(cfg, 1, 64, 128, gen); k = T._make(cfg, 1, 17, 128, gen); v = T._make(cfg, 1, 17, 128, gen)
    sinks = torch.randn(1, device="cuda", generator=gen).requires_grad_()
    lq = torch.randint(1, 65, (2,), device="cuda", generator=gen, dtype=torch.int32)
    lk = torch.randint(1, 18, (2,), device="cuda", generator=gen, dtype=torch.int32)
    go = torch.randn(2, 1, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(scale=1 / math.sqrt(128), window=(7, 5), bottom_right=False)
    out, lse = csp.attention(q, k, v, sinks=sinks, seq_lens_q=lq, seq_lens_kv=lk, return_lse=True, **kw)
    out.backward(go)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    sf = sinks.detach().float().requires_grad_()
    rout, rlse = reference.dense(qf, kf, vf, sinks=sf, seq_len_q=lq, seq_len_kv=lk, **kw)
    rout.backward(go.float())
    print(f"== odd={odd} lens q {lq.tolist()} kv {lk.tolist()}; dsinks ours {sinks.grad.tolist()} ref {sf.grad.tolist()}")
    dead = rows.dead_rows(64, 17, (7, 5), False, lq, lk, out.device).view(2, 64)
    live = ~dead
    o, ro = out.detach().float().view(2, 64, 128), rout.detach().view(2, 64, 128)
    l, rl = lse.detach().float().view(2, 64), rlse.detach().view(2, 64)
    print("live rows per batch", live.sum(1).tolist())
    print("max |lse - ref| on live rows", ((l - rl).abs() * live).max().item())
    print("max |O - ref| per row (live) top 5", torch.topk(((o - ro).abs().amax(-1) * live).flatten(), 5))
    print("max |O| on dead rows", (o.abs().amax(-1) * dead).max().item())
    g = go.float().view(2, 64, 128)
    def ds(O, L):
        d = (g * O).sum(-1)
        p = torch.exp(sf.detach().view(1, 1) - L)
        return -(torch.where(live, p * d, torch.zeros_like(d))).sum().item()
    print("dsink from ref O/ref LSE", ds(ro, rl), "our O/ref LSE", ds(o, rl), "ref O/our LSE", ds(ro, l), "ours/ours", ds(o, l))
    contrib = torch.where(live, torch.exp(sf.detach() - l) * (g * o).sum(-1), torch.zeros_like(l))
    rcontrib = torch.where(live, torch.exp(sf.detach() - rl) * (g * ro).sum(-1), torch.zeros_like(l))
    bad = torch.topk((contrib - rcontrib).abs().flatten(), 5)
    print("worst row contributions (idx b*64+i):", bad.indices.tolist(), bad.values.tolist())
    for idx in bad.indices.tolist()[:3]:
        b_, i_ = divmod(idx, 64)
        print(f"   b={b_} i={i_} lse {l[b_, i_].item():.4f} ref {rl[b_, i_].item():.4f} |O| {o[b_, i_].abs().max().item():.4f} ref {ro[b_, i_].abs().max().item():.4f}")
