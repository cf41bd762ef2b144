"""What cuDNN's per-tensor FP8 SDPA backward (``sdpa_fp8_backward``) does on this GPU, before the
package builds on it: which variants build (GQA, padding by lengths, head dims, an E5M2 dO), how far
its dQ/dK/dV are from an fp32 computation on the same FP8 values, what its amax_dP measures (dP or
dS = P * (dP - D) * attn_scale), and what an FP8 output does when its scale overflows (saturates at
448 or NaN). GPU, Hopper or newer; frontend 1.28+.

    python3 scripts/fp8_bwd_probe.py

One line per case; exit status 1 when no case could be measured. The package serves no call here.
"""

from __future__ import annotations

import sys

import cudnn
import torch

E4M3 = 448.0
F = cudnn.data_type.FLOAT


def scalar(g, name):
    return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=F)


def packed(shape):
    b, h, s, d = shape
    return [h * s * d, s * d, d, 1]


def quant(t, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), (1.0 / scale).reshape(1, 1, 1, 1)


def case(name, b, h, hk, s, d, causal=True, lens=None, do_dtype=torch.float8_e4m3fn, overflow=False):
    gen = torch.Generator(device="cuda").manual_seed(s + d + hk)
    q, k, v, dout = (torch.randn(*shape, device="cuda", generator=gen) for shape in
                     ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), (b, h, s, d)))
    (q8, dq_), (k8, dk_), (v8, dv_) = quant(q), quant(k), quant(v)
    do8, ddo = quant(dout, do_dtype)
    one = torch.ones(1, 1, 1, 1, device="cuda")
    scale_s, descale_s = one * 256, one / 256
    amax_v = v8.float().abs().amax() * dv_
    scale_o = (0.875 * E4M3 / amax_v).reshape(1, 1, 1, 1)
    attn = d ** -0.5
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    E4 = cudnn.data_type.FP8_E4M3
    padkw = {}
    # ---- forward
    g = cudnn.pygraph(io_data_type=E4, intermediate_data_type=F, compute_data_type=F, handle=handle)
    tq = g.tensor(name="q", dim=[b, h, s, d], stride=packed((b, h, s, d)), data_type=E4)
    tk = g.tensor(name="k", dim=[b, hk, s, d], stride=packed((b, hk, s, d)), data_type=E4)
    tv = g.tensor(name="v", dim=[b, hk, s, d], stride=packed((b, hk, s, d)), data_type=E4)
    sc = [scalar(g, n) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
    if lens is not None:
        sq = g.tensor(name="sq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        skv = g.tensor(name="skv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        padkw = dict(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
    o, st, am_s, am_o = g.sdpa_fp8(tq, tk, tv, *sc, generate_stats=True, attn_scale=attn, use_causal_mask=causal,
                                   **padkw)
    o.set_output(True).set_dim([b, h, s, d]).set_stride(packed((b, h, s, d))).set_data_type(E4)
    st.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(F)
    for t in (am_s, am_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(F)
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    o8 = torch.full((b, h, s, d), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    lse = torch.full((b, h, s, 1), float("nan"), device="cuda")
    amax_s, amax_o = torch.full_like(one, float("nan")), torch.full_like(one, float("nan"))
    lq = torch.tensor(lens or [s] * b, device="cuda", dtype=torch.int32).view(b, 1, 1, 1)
    pack = {tq: q8, tk: k8, tv: v8, o: o8, st: lse, am_s: amax_s, am_o: amax_o}
    pack.update(zip(sc, (dq_, dk_, dv_, descale_s, scale_s, scale_o)))
    if lens is not None:
        pack.update({sq: lq, skv: lq})
    ws = torch.empty(max(g.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
    g.execute(pack, ws, handle=handle)
    # ---- fp32 reference on the FP8 values (frontend's reference semantics)
    group = h // hk
    qf, kf, vf = q8.float() * dq_, (k8.float() * dk_).repeat_interleave(group, 1), (v8.float() * dv_).repeat_interleave(group, 1)
    dof = do8.float() * ddo
    sc_ = qf @ kf.transpose(-1, -2) * attn
    mask = torch.zeros(s, s, dtype=torch.bool, device="cuda")
    if causal:
        mask = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)
    mask = mask.expand(b, 1, s, s).clone()
    if lens is not None:
        for i, n in enumerate(lens):
            mask[i, :, :, n:] = True
    sc_ = sc_.masked_fill(mask, float("-inf"))
    p = sc_.softmax(-1).nan_to_num()
    if lens is not None:
        for i, n in enumerate(lens):
            p[i, :, n:] = 0
            dof[i, :, n:] = 0
    ref_o = p @ vf
    got_o = o8.float() / scale_o
    rows = torch.ones(b, 1, s, 1, dtype=torch.bool, device="cuda")
    if lens is not None:
        for i, n in enumerate(lens):
            rows[i, :, n:] = False
    o_err = ((got_o - ref_o).abs() * rows).amax().item() / ref_o.abs().amax().item()
    dP = dof @ vf.transpose(-1, -2)
    D = (got_o * dof).sum(-1, keepdim=True)
    dS = p * (dP - D) * attn
    dV = (p.transpose(-1, -2) @ dof).view(b, hk, group, s, d).sum(2)
    dQ = dS @ kf
    dK = (dS.transpose(-1, -2) @ qf).view(b, hk, group, s, d).sum(2)
    # ---- backward
    g2 = cudnn.pygraph(io_data_type=E4, intermediate_data_type=F, compute_data_type=F, handle=handle)
    DOT = cudnn.data_type.FP8_E5M2 if do_dtype == torch.float8_e5m2 else E4
    bq = g2.tensor(name="q", dim=[b, h, s, d], stride=packed((b, h, s, d)), data_type=E4)
    bk = g2.tensor(name="k", dim=[b, hk, s, d], stride=packed((b, hk, s, d)), data_type=E4)
    bv = g2.tensor(name="v", dim=[b, hk, s, d], stride=packed((b, hk, s, d)), data_type=E4)
    bo = g2.tensor(name="o", dim=[b, h, s, d], stride=packed((b, h, s, d)), data_type=E4)
    bdo = g2.tensor(name="do", dim=[b, h, s, d], stride=packed((b, h, s, d)), data_type=DOT)
    bst = g2.tensor(name="st", dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=F)
    names = ("dq", "dk", "dv", "do_", "ddo", "ds", "ddp", "ss", "sdq", "sdk", "sdv", "sdp")
    bsc = [scalar(g2, n) for n in names]
    padkw2 = {}
    if lens is not None:
        sq2 = g2.tensor(name="sq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        skv2 = g2.tensor(name="skv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        padkw2 = dict(use_padding_mask=True, seq_len_q=sq2, seq_len_kv=skv2)
    outs = g2.sdpa_fp8_backward(bq, bk, bv, bo, bdo, bst, *bsc, attn_scale=attn, use_causal_mask=causal, **padkw2)
    tdq, tdk, tdv, a_dq, a_dk, a_dv, a_dp = outs[:7]
    for t, hh in ((tdq, h), (tdk, hk), (tdv, hk)):
        t.set_output(True).set_dim([b, hh, s, d]).set_stride(packed((b, hh, s, d))).set_data_type(E4)
    for t in (a_dq, a_dk, a_dv, a_dp):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(F)
    g2.validate(); g2.build_operation_graph(); g2.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g2.check_support(); g2.build_plans()
    amaxes = [dQ.abs().amax(), dK.abs().amax(), dV.abs().amax()]
    shrink = 64.0 if overflow else 0.5
    s_dq, s_dk, s_dv = ((E4M3 * shrink / a).reshape(1, 1, 1, 1) for a in amaxes)
    s_dp = (E4M3 * 0.5 / dS.abs().amax()).reshape(1, 1, 1, 1)
    d8 = [torch.full((b, hh, s, d), float("nan"), device="cuda").to(torch.float8_e4m3fn) for hh in (h, hk, hk)]
    am = [torch.full_like(one, float("nan")) for _ in range(4)]
    pk = {bq: q8, bk: k8, bv: v8, bo: o8, bdo: do8, bst: lse}
    pk.update(zip(bsc, (dq_, dk_, dv_, 1 / scale_o, ddo, descale_s, 1 / s_dp, scale_s, s_dq, s_dk, s_dv, s_dp)))
    pk.update(zip((tdq, tdk, tdv), d8))
    pk.update(zip((a_dq, a_dk, a_dv, a_dp), am))
    if lens is not None:
        pk.update({sq2: lq, skv2: lq})
    ws2 = torch.empty(max(g2.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
    g2.execute(pk, ws2, handle=handle)
    torch.cuda.synchronize()
    errs = []
    for t8, sc8, ref in zip(d8, (s_dq, s_dk, s_dv), (dQ, dK, dV)):
        got = t8.float() / sc8
        errs.append(((got - ref).abs() * rows).nan_to_num(1e9).amax().item() / ref.abs().amax().item())
    sat = ""
    if overflow:
        raw = d8[0].float()
        sat = f" overflow: NaN {int(torch.isnan(raw).sum())} |raw|max {raw.abs().nan_to_num(0).amax().item():.0f}"
    print(f"{name}: fwd o err {o_err:.4f} amax_o {amax_o.item():.4f} (ref {ref_o.abs().amax().item():.4f}) "
          f"amax_s {amax_s.item():.4f} (ref P {p.amax().item():.4f}) | bwd err dQ {errs[0]:.4f} dK {errs[1]:.4f} "
          f"dV {errs[2]:.4f} | amax dq/dk/dv {am[0].item():.4g}/{am[1].item():.4g}/{am[2].item():.4g} "
          f"(ref {amaxes[0].item():.4g}/{amaxes[1].item():.4g}/{amaxes[2].item():.4g}) amax_dP {am[3].item():.4g} "
          f"(ref dP {dP.abs().amax().item():.4g}, dS {dS.abs().amax().item():.4g}){sat}", flush=True)
    return True


CASES = [
    ("B2 H8 S1024 d128 causal", dict(b=2, h=8, hk=8, s=1024, d=128)),
    ("B2 H8 S1024 d128 non-causal", dict(b=2, h=8, hk=8, s=1024, d=128, causal=False)),
    ("GQA H8/2", dict(b=2, h=8, hk=2, s=1024, d=128)),
    ("padded lens 1000/517", dict(b=2, h=8, hk=8, s=1024, d=128, lens=[1000, 517])),
    ("d64", dict(b=2, h=8, hk=8, s=1024, d=64)),
    ("d256", dict(b=2, h=8, hk=8, s=1024, d=256)),
    ("S=1000 (not a multiple of 64)", dict(b=2, h=8, hk=8, s=1000, d=128)),
    ("dO e5m2", dict(b=2, h=8, hk=8, s=1024, d=128, do_dtype=torch.float8_e5m2)),
    ("dQ scale 128x too large", dict(b=2, h=8, hk=8, s=1024, d=128, overflow=True)),
]


def main() -> int:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}, "
          f"frontend {cudnn.__version__}")
    ok = 0
    for name, kw in CASES:
        try:
            ok += case(name, **kw)
        except Exception as exc:
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
