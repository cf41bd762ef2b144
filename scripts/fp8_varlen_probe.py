"""Issue #30: does cuDNN serve FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward``) on packed (varlen,
THD) operands? The package has no FP8 varlen graph. This builds them through ``cudnn.pygraph`` as
``engine/packed.py`` declares the bf16 ragged graphs (a nominal (B, H, S_max, D) tensor with
token-major strides, each sequence found by a ragged offset, cu_seqlens x token stride in
elements, and the lengths as a padding mask) and ``engine/fp8_cudnn.py`` the dense FP8 ones, and
reports what cuDNN did with each configuration. GPU, Hopper or newer; frontend 1.28+.

    python3 scripts/fp8_varlen_probe.py [--lens 1000,517,2048,77] [--heads 8] [--dim 128] [--seed 0]
                                        [--configs NAME,...] [--json PATH] [--in-process]

Configurations (``CONFIGS``): first the control, the same sequences as a padded (B, H, S_max, D)
batch (the dense FP8 graph with a padding mask, which the package serves: if it does not run, the
probe is broken, exit status 1); then packed (T, H, D) operands: causal and not, GQA, the softmax
stats ragged (T, H) or padded (B, H, S_max, 1), head dim 64, an inference forward without stats.
Each runs in a process of its own (a fault cannot hide the next ones; ``--in-process``: all in
this one). The forward, and when it ran, the backward at scales from the reference's amax
(power-of-2 scales, as csp.fp8's recipe: FP8 max / (2 x amax)).

A pass is "rejected" (cuDNN refused the graph at build: its message), "failed" (built, but running
or reading it raised), "crashed" (its process died), "skipped" (the forward did not run) or "ran":
then the error of each output against fp32 attention on the dequantised FP8 operands
(max |got - ref| / max |ref| over the real tokens; the stats' largest absolute error), whether
that is within the dense FP8 path's bounds (``BOUNDS``: tests/test_fp8.py's FWD_REF_TOL and
BWD_REF_TOL) and whether the rows past the last sequence kept their NaN canary (packed layouts:
nothing written outside the sequences). The backward reads the forward's O, canary rows included,
so one that reads past the last sequence comes out NaN (error inf). ``--json`` writes the same
with the versions. The package serves no call here; its ``csp.fp8.quantize`` makes the FP8 operands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from cudnn_sdpa_provider.fp8 import quantize  # noqa: E402

E4M3_MAX = 448.0
SCALE_S = 256.0  # P in [0, 1] stored x 256, as csp.fp8 (DEFAULT_SCALE_S)
O_HEADROOM = 0.875  # O's scale: FP8 max x 0.875 / max |V|, as csp.fp8
TAIL = 64  # packed outputs get this many rows past the last sequence, filled with a NaN canary
NAN_BYTE = 0x7F  # float8_e4m3fn NaN
BOUNDS = {"o": 0.07, "dq": 0.1, "dk": 0.1, "dv": 0.1}  # the dense FP8 graphs' bounds against the same reference
EXIT_NO_CUDA, EXIT_CONTROL_FAILED = 4, 1
#: Seconds one configuration's process may run (it builds and runs two graphs: seconds). Well under
#: the GPU tier's 600 s per device call, so a hung configuration is recorded and the next ones run.
CHILD_TIMEOUT_S = 180


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    packed: bool = True  # (T, H, D) with ragged offsets; False: the padded (B, H, S_max, D) control
    causal: bool = True
    kv_group: int = 1  # H_q / H_kv
    dim: int | None = None  # None: --dim
    stats: str = "ragged"  # "ragged" (T, H) | "padded" (B, H, S_max, 1) | "none" (inference: no backward)


CONFIGS = (
    Config("padded_control", packed=False, stats="padded"),
    Config("packed_causal"),
    Config("packed_full", causal=False),
    Config("packed_causal_gqa", kv_group=4),
    Config("packed_causal_stats_padded", stats="padded"),
    Config("packed_causal_d64", dim=64),
    Config("packed_causal_inference", stats="none"),
)
BY_NAME = {c.name: c for c in CONFIGS}


# ------------------------------------------------------------------------------- arguments


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _configs(text: str) -> list[Config]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {bad or names}. Available: {list(BY_NAME)}")
    return [BY_NAME[n] for n in dict.fromkeys(names)]


def _positive(text: str) -> int:
    (value,) = _ints(text)
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lens", type=_ints, default=[1000, 517, 2048, 77],
                   help="sequence lengths (default 1000,517,2048,77)")
    p.add_argument("--heads", type=_positive, default=8,
                   help="query heads, a multiple of 4 for the GQA config (default 8)")
    p.add_argument("--dim", type=_positive, default=128,
                   help="head dim (default 128: sm_90's FP8 backward serves no other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", type=_configs, default=list(CONFIGS), help=f"comma-separated, from {','.join(BY_NAME)}")
    p.add_argument("--json", metavar="PATH", help="write the summary there")
    p.add_argument("--in-process", action="store_true", help="run every configuration in this process")
    args = p.parse_args(argv)
    if any(c.kv_group > 1 for c in args.configs) and args.heads % 4:
        p.error(f"--heads {args.heads}: the GQA configuration needs a multiple of 4")
    return args


# ------------------------------------------------------------------------ layouts and reference


def s_max(lens) -> int:
    """The nominal sequence extent: the longest length rounded up to a power of 2 (as engine/packed.py)."""
    return 1 << (max(lens) - 1).bit_length()


def cu_seqlens(lens, device="cpu") -> torch.Tensor:
    return torch.tensor([0] + list(lens), dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def to_padded(x: torch.Tensor, lens, s: int) -> torch.Tensor:
    """Packed (T, H, D) -> padded (B, H, s, D), zeros past each length."""
    out = x.new_zeros((len(lens), x.shape[1], s, x.shape[2]))
    start = 0
    for b, n in enumerate(lens):
        out[b, :, :n] = x[start:start + n].transpose(0, 1)
        start += n
    return out


def to_packed(x: torch.Tensor, lens) -> torch.Tensor:
    """Padded (B, H, S, D) -> packed (sum(lens), H, D)."""
    return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])


def reference(q, k, v, do, lens, causal: bool, scale: float, o_for_d=None) -> dict:
    """Attention on packed (T, H, D) q, (T, H_kv, D) k, v per sequence (top-left causal), with the
    backward written out as cuDNN computes it: o, lse (T, H), dq, dk, dv and ``amax_ds`` (max |dS|,
    dS = P (dP - D) x scale, which cuDNN stores in FP8 before dQ and dK). ``o_for_d``: the O that
    D = rowsum(dO O) reads (cuDNN's stored one; default the exact O). In q's dtype."""
    group = q.shape[1] // k.shape[1]
    outs = {n: [] for n in ("o", "lse", "dq", "dk", "dv")}
    amax_ds, start = q.new_zeros(()), 0
    for n in lens:
        sl = slice(start, start + n)
        start += n
        qs, dos = q[sl].transpose(0, 1), do[sl].transpose(0, 1)
        ks, vs = (t[sl].transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = scores.logsumexp(-1, keepdim=True)
        p = (scores - lse).exp()
        o = p @ vs
        o_d = o if o_for_d is None else o_for_d[sl].transpose(0, 1)
        ds = p * (dos @ vs.transpose(-1, -2) - (dos * o_d).sum(-1, keepdim=True)) * scale
        amax_ds = torch.maximum(amax_ds, ds.abs().amax())
        dk, dv = ds.transpose(-1, -2) @ qs, p.transpose(-1, -2) @ dos
        fold = lambda t: t.unflatten(0, (-1, group)).sum(1).transpose(0, 1)  # noqa: E731 - GQA: sum each group
        outs["o"].append(o.transpose(0, 1))
        outs["lse"].append(lse[..., 0].transpose(0, 1))
        outs["dq"].append((ds @ ks).transpose(0, 1))
        outs["dk"].append(fold(dk))
        outs["dv"].append(fold(dv))
    return {**{n: torch.cat(ts) for n, ts in outs.items()}, "amax_ds": amax_ds}


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (inf when ``got`` has a NaN or inf where ``ref`` is finite)."""
    diff = (got.double() - ref.double()).abs()
    if not torch.isfinite(diff).all():
        return float("inf")
    return diff.max().item() / (ref.abs().max().item() or 1.0)


def pow2_scale(amax: float, margin: float = 2.0) -> float:
    """FP8 max / (margin x amax) rounded down to a power of 2 (1 for amax 0)."""
    if amax <= 0:
        return 1.0
    return 2.0 ** int(torch.floor(torch.log2(torch.tensor(E4M3_MAX / (margin * amax)))).item())


# ----------------------------------------------------------------------------- the summary


def summarize(args, results: list[dict], meta: dict) -> dict:
    """The JSON document: meta (versions, arguments), one entry per configuration, and whether any
    packed configuration's forward / backward ran within the bounds."""
    packed = [r for r in results if r["packed"]]

    def served(direction):
        return any(r[direction]["status"] == "ran" and r[direction].get("within_bounds") for r in packed)

    return {"meta": {**meta, "lens": list(args.lens), "heads": args.heads, "dim": args.dim, "seed": args.seed},
            "configs": results, "packed_forward_served": served("forward"),
            "packed_backward_served": served("backward")}


def line(r: dict) -> str:
    """One configuration on one line."""
    parts = []
    for direction in ("forward", "backward"):
        d = r[direction]
        text = f"{direction} {d['status']}"
        if d["status"] == "ran":
            text += " " + " ".join(f"{k} {v:.4f}" for k, v in d["errors"].items())
            text += "" if d["within_bounds"] else " (OUT OF BOUNDS)"
            if d.get("tail_untouched") is False:
                text += " (WROTE PAST THE LAST SEQUENCE)"
        elif d.get("message"):
            text += f": {d['message']}"
        parts.append(text)
    return f"{r['name']}: " + " | ".join(parts)


def pass_result(status: str, message: str | None = None, **extra) -> dict:
    return {"status": status, "message": message, **extra}


def control_ran(results: list[dict]) -> bool:
    return any(not r["packed"] and r["forward"]["status"] == "ran" for r in results)


# ------------------------------------------------------------------------------------ cuDNN


class _Graph:
    """One pygraph with uids handed out in order; ``build`` runs cuDNN's checks and plan build."""

    def __init__(self, cudnn, handle):
        self.cudnn, self.handle, self.next = cudnn, handle, 1
        t = cudnn.data_type
        self.g = cudnn.pygraph(io_data_type=t.FP8_E4M3, intermediate_data_type=t.FLOAT, compute_data_type=t.FLOAT,
                               handle=handle)
        self.buffers: dict = {}

    def uid(self) -> int:
        self.next += 1
        return self.next

    def input(self, name, dims, strides, dtype, buf):
        uid = self.uid()
        self.buffers[uid] = buf
        return self.g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=dtype, uid=uid)

    def output(self, t, dims, strides, dtype, buf):
        uid = self.uid()
        self.buffers[uid] = buf
        t.set_output(True).set_uid(uid).set_dim(list(dims)).set_stride(list(strides)).set_data_type(dtype)
        return t

    def scalar(self, name, value: float, device):
        return self.input(name, (1, 1, 1, 1), (1, 1, 1, 1), self.cudnn.data_type.FLOAT,
                          torch.full((1, 1, 1, 1), float(value), dtype=torch.float32, device=device))

    def index(self, name, values: torch.Tensor):
        n = values.numel()
        return self.input(name, (n, 1, 1, 1), (1, 1, 1, 1), self.cudnn.data_type.INT32, values.view(n, 1, 1, 1))

    def build(self):
        h = self.cudnn.heur_mode
        self.g.validate()
        self.g.build_operation_graph()
        self.g.create_execution_plans([h.A, h.FALLBACK])
        self.g.check_support()
        self.g.build_plans()

    def run(self, device):
        workspace = torch.empty(max(int(self.g.get_workspace_size()), 1), dtype=torch.uint8, device=device)
        self.g.execute(self.buffers, workspace, handle=self.handle)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()


@dataclasses.dataclass
class Problem:
    """One configuration's sizes; ``packed`` operands (T, H, D) or the padded control's (B, H, S, D)."""

    cfg: Config
    lens: list
    h: int
    hk: int
    d: int
    device: str

    @property
    def b(self) -> int:
        return len(self.lens)

    @property
    def t(self) -> int:
        return sum(self.lens)

    @property
    def s(self) -> int:
        return s_max(self.lens)

    @property
    def scale(self) -> float:
        return self.d ** -0.5

    def layout(self, heads: int, d: int) -> tuple[tuple, tuple]:
        """(dims, strides) cuDNN is told: token-major (the batch stride never stepped: ragged offsets
        place each sequence) or the padded batch's contiguous BHSD."""
        if self.cfg.packed:
            return (self.b, heads, self.s, d), (self.s * heads * d, d, heads * d, 1)
        return (self.b, heads, self.s, d), (heads * self.s * d, self.s * d, d, 1)

    def stats_layout(self) -> tuple[tuple, tuple]:
        if self.cfg.stats == "ragged":
            return (self.b, self.h, self.s, 1), (self.s * self.h, 1, self.h, 1)  # (T, H) token-major
        return (self.b, self.h, self.s, 1), (self.h * self.s, self.s, 1, 1)


def problem(cfg: Config, args, device) -> Problem:
    return Problem(cfg, list(args.lens), args.heads, args.heads // cfg.kv_group, cfg.dim or args.dim, device)


@dataclasses.dataclass
class Operands:
    """FP8 q, k, v, dO (packed) with their descales, and the dequantised fp32 values."""

    fp8: dict
    descale: dict
    real: dict


def make_operands(p: Problem, seed: int) -> Operands:
    gen = torch.Generator(device=p.device).manual_seed(seed)
    shapes = {"q": (p.t, p.h, p.d), "k": (p.t, p.hk, p.d), "v": (p.t, p.hk, p.d), "do": (p.t, p.h, p.d)}
    fp8, descale, real = {}, {}, {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=gen, device=p.device, dtype=torch.bfloat16)
        fp8[name], descale[name] = quantize(x)
        real[name] = fp8[name].float() * descale[name]
    return Operands(fp8, descale, real)


def _fp8_in(p: Problem, x8: torch.Tensor) -> torch.Tensor:
    return x8 if p.cfg.packed else to_padded(x8.view(torch.uint8), p.lens, p.s).view(torch.float8_e4m3fn)


def _fp8_out(p: Problem, heads: int, d: int) -> torch.Tensor:
    shape = (p.t + TAIL, heads, d) if p.cfg.packed else (p.b, heads, p.s, d)
    return torch.full(shape, NAN_BYTE, dtype=torch.uint8, device=p.device).view(torch.float8_e4m3fn)


def _read(p: Problem, buf: torch.Tensor) -> torch.Tensor:
    """The real tokens of an output buffer, packed."""
    return buf[: p.t] if p.cfg.packed else to_packed(buf, p.lens)


def _tail_untouched(p: Problem, bufs) -> bool | None:
    if not p.cfg.packed:
        return None
    return all(bool((b[p.t:].view(torch.uint8) == NAN_BYTE).all()) if b.dtype == torch.float8_e4m3fn
               else bool(torch.isnan(b[p.t:]).all()) for b in bufs)


def _operand(G: _Graph, p: Problem, name: str, buf: torch.Tensor, heads: int, dtype, cu: torch.Tensor):
    t = G.input(name, *p.layout(heads, p.d), dtype, buf)
    if p.cfg.packed:
        t.set_ragged_offset(G.index(f"rag_{name}", cu * (heads * p.d)))
    return t


def _mask(G: _Graph, p: Problem, lens: torch.Tensor) -> dict:
    return dict(attn_scale=p.scale, use_causal_mask=p.cfg.causal, use_padding_mask=True,
                seq_len_q=G.index("seq_q", lens), seq_len_kv=G.index("seq_kv", lens.clone()))


def _stats_out(G: _Graph, p: Problem, stats, cu) -> torch.Tensor:
    dims, strides = p.stats_layout()
    buf = torch.full((p.t + TAIL, p.h) if p.cfg.stats == "ragged" else dims, float("nan"), device=p.device)
    G.output(stats, dims, strides, G.cudnn.data_type.FLOAT, buf)
    if p.cfg.stats == "ragged":
        stats.set_ragged_offset(G.index("rag_stats", cu * p.h))
    return buf


def forward_pass(cudnn, handle, p: Problem, ops: Operands) -> tuple[dict, dict | None]:
    """(the forward's result, what the backward needs, or None when it did not run)."""
    G, fp8t = _Graph(cudnn, handle), cudnn.data_type.FP8_E4M3
    cu, lens = cu_seqlens(p.lens, p.device), torch.tensor(p.lens, dtype=torch.int32, device=p.device)
    q, k, v = (_operand(G, p, n, _fp8_in(p, ops.fp8[n]), heads, fp8t, cu)
               for n, heads in (("q", p.h), ("k", p.hk), ("v", p.hk)))
    scale_o = pow2_scale(ops.real["v"].abs().max().item() / O_HEADROOM, margin=1.0)
    factors = [G.input(f"descale_{n}", (1, 1, 1, 1), (1, 1, 1, 1), cudnn.data_type.FLOAT,
                       ops.descale[n].reshape(1, 1, 1, 1).float()) for n in ("q", "k", "v")]
    factors += [G.scalar(n, x, p.device) for n, x in (("descale_s", 1 / SCALE_S), ("scale_s", SCALE_S),
                                                      ("scale_o", scale_o))]
    o, stats, amax_s, amax_o = G.g.sdpa_fp8(q, k, v, *factors, generate_stats=p.cfg.stats != "none",
                                            **_mask(G, p, lens))
    o_buf = _fp8_out(p, p.h, p.d)
    G.output(o, *p.layout(p.h, p.d), fp8t, o_buf)
    if p.cfg.packed:
        o.set_ragged_offset(G.index("rag_o", cu * (p.h * p.d)))
    stats_buf = _stats_out(G, p, stats, cu) if p.cfg.stats != "none" else None
    for t, n in ((amax_s, "amax_s"), (amax_o, "amax_o")):
        G.output(t, (1, 1, 1, 1), (1, 1, 1, 1), cudnn.data_type.FLOAT, torch.zeros((1, 1, 1, 1), device=p.device))
    try:
        G.build()
    except Exception as exc:  # noqa: BLE001 - cuDNN's refusal is the finding
        return pass_result("rejected", f"{type(exc).__name__}: {exc}".strip()), None
    try:
        G.run(p.device)
        ref = reference(ops.real["q"], ops.real["k"], ops.real["v"], ops.real["do"], p.lens, p.cfg.causal, p.scale)
        got_o = _read(p, o_buf).float() / scale_o
        errors = {"o": rel_error(got_o, ref["o"])}
        if stats_buf is not None:
            got = stats_buf[: p.t] if p.cfg.stats == "ragged" else to_packed(stats_buf, p.lens)[..., 0]
            diff = (got - ref["lse"]).abs().max().item()
            errors["lse_abs"] = diff if diff == diff else float("inf")
        within = errors["o"] <= BOUNDS["o"]
        tail = _tail_untouched(p, [o_buf] + ([stats_buf] if stats_buf is not None and p.cfg.stats == "ragged" else []))
    except Exception as exc:  # noqa: BLE001 - recorded: the next configuration still runs
        return pass_result("failed", f"{type(exc).__name__}: {exc}".strip()), None
    if not p.cfg.packed:  # as csp.fp8 hands a padded O to its backward: 0 past each length
        past = torch.arange(p.s, device=p.device).view(1, 1, -1, 1) >= lens.view(-1, 1, 1, 1)
        o_buf.view(torch.uint8).masked_fill_(past, 0)
    state = {"o_buf": o_buf, "stats_buf": stats_buf, "scale_o": scale_o, "got_o": got_o, "ref": ref}
    return pass_result("ran", errors=errors, within_bounds=within, tail_untouched=tail), state


def backward_pass(cudnn, handle, p: Problem, ops: Operands, fwd: dict) -> dict:
    G, t = _Graph(cudnn, handle), cudnn.data_type
    cu, lens = cu_seqlens(p.lens, p.device), torch.tensor(p.lens, dtype=torch.int32, device=p.device)
    q, k, v = (_operand(G, p, n, _fp8_in(p, ops.fp8[n]), heads, t.FP8_E4M3, cu)
               for n, heads in (("q", p.h), ("k", p.hk), ("v", p.hk)))
    o = _operand(G, p, "o", fwd["o_buf"], p.h, t.FP8_E4M3, cu)
    do = _operand(G, p, "do", _fp8_in(p, ops.fp8["do"]), p.h, t.FP8_E4M3, cu)
    stats = G.input("stats", *p.stats_layout(), t.FLOAT, fwd["stats_buf"])
    if p.cfg.stats == "ragged":
        stats.set_ragged_offset(G.index("rag_stats", cu * p.h))
    ref = reference(ops.real["q"], ops.real["k"], ops.real["v"], ops.real["do"], p.lens, p.cfg.causal, p.scale,
                    o_for_d=fwd["got_o"])
    scales = {n: pow2_scale(ref[n].abs().max().item()) for n in ("dq", "dk", "dv")}
    scales["dp"] = pow2_scale(ref["amax_ds"].item())
    descale = lambda n: ops.descale[n].reshape(1, 1, 1, 1).float()  # noqa: E731
    factors = [G.input(f"descale_{n}", (1, 1, 1, 1), (1, 1, 1, 1), t.FLOAT, descale(n)) for n in ("q", "k", "v")]
    factors += [G.scalar("descale_o", 1 / fwd["scale_o"], p.device),
                G.input("descale_do", (1, 1, 1, 1), (1, 1, 1, 1), t.FLOAT, descale("do")),
                G.scalar("descale_s", 1 / SCALE_S, p.device), G.scalar("descale_dp", 1 / scales["dp"], p.device),
                G.scalar("scale_s", SCALE_S, p.device)]
    factors += [G.scalar(f"scale_{n}", scales[n], p.device) for n in ("dq", "dk", "dv", "dp")]
    dq, dk, dv, *amax = G.g.sdpa_fp8_backward(q, k, v, o, do, stats, *factors, **_mask(G, p, lens))[:7]
    bufs = {}
    for name, tensor, heads in (("dq", dq, p.h), ("dk", dk, p.hk), ("dv", dv, p.hk)):
        bufs[name] = _fp8_out(p, heads, p.d)
        G.output(tensor, *p.layout(heads, p.d), t.FP8_E4M3, bufs[name])
        if p.cfg.packed:
            tensor.set_ragged_offset(G.index(f"rag_{name}", cu * (heads * p.d)))
    for a in amax:
        G.output(a, (1, 1, 1, 1), (1, 1, 1, 1), t.FLOAT, torch.zeros((1, 1, 1, 1), device=p.device))
    try:
        G.build()
    except Exception as exc:  # noqa: BLE001 - cuDNN's refusal is the finding
        return pass_result("rejected", f"{type(exc).__name__}: {exc}".strip())
    try:
        G.run(p.device)
        errors = {n: rel_error(_read(p, bufs[n]).float() / scales[n], ref[n]) for n in ("dq", "dk", "dv")}
        within = all(errors[n] <= BOUNDS[n] for n in errors)
        return pass_result("ran", errors=errors, within_bounds=within, tail_untouched=_tail_untouched(p, bufs.values()))
    except Exception as exc:  # noqa: BLE001 - recorded: the next configuration still runs
        return pass_result("failed", f"{type(exc).__name__}: {exc}".strip())


# ------------------------------------------------------------------------------------ runs


def describe(cfg: Config, args) -> dict:
    p = problem(cfg, args, "cpu")
    return {"name": cfg.name, "packed": cfg.packed, "causal": cfg.causal, "h_q": p.h, "h_kv": p.hk, "dim": p.d,
            "stats": cfg.stats, "s_max": p.s, "tokens": p.t}


def run_config(cfg: Config, args, cudnn, handle, device) -> dict:
    """One configuration, forward then (when it ran and has stats) backward; never raises."""
    out = describe(cfg, args)
    try:
        p = problem(cfg, args, device)
        ops = make_operands(p, args.seed)
        out["forward"], state = forward_pass(cudnn, handle, p, ops)
        if state is None:
            out["backward"] = pass_result("skipped", "the forward did not run")
        elif cfg.stats == "none":
            out["backward"] = pass_result("skipped", "an inference forward (no stats): no backward")
        else:
            out["backward"] = backward_pass(cudnn, handle, p, ops, state)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the next configuration runs
        out.setdefault("forward", pass_result("failed", f"{type(exc).__name__}: {exc}".strip()))
        out.setdefault("backward", pass_result("skipped", "the forward did not run"))
    return out


def run_isolated(cfg: Config, args) -> dict:
    """``run_config`` in a child process: a fault there is recorded as "crashed"."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--configs", cfg.name, "--json", path,
               "--lens", ",".join(map(str, args.lens)), "--heads", str(args.heads), "--dim", str(args.dim),
               "--seed", str(args.seed)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            said = (done.stderr or done.stdout).strip()[-400:]
        except subprocess.TimeoutExpired:
            said = f"no answer in {CHILD_TIMEOUT_S:g} s"
        if os.path.exists(path):
            with open(path) as fh:
                return json.load(fh)["configs"][0]
    return {**describe(cfg, args), "forward": pass_result("crashed", said),
            "backward": pass_result("skipped", "the forward did not run")}


def meta(cudnn) -> dict:
    return {"gpu": torch.cuda.get_device_name(), "compute_capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn_backend": cudnn.backend_version(),
            "cudnn_frontend": cudnn.__version__, "command": " ".join(sys.argv)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_varlen_probe: needs a CUDA GPU", file=sys.stderr)
        return EXIT_NO_CUDA
    import cudnn

    info = meta(cudnn)
    print(f"{info['gpu']}, torch {info['torch']}, cuDNN {info['cudnn_backend']}, frontend {info['cudnn_frontend']}; "
          f"lengths {args.lens}, H {args.heads}, D {args.dim}", flush=True)
    results = []
    if args.in_process:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for cfg in args.configs:
        r = run_config(cfg, args, cudnn, handle, "cuda") if args.in_process else run_isolated(cfg, args)
        results.append(r)
        print(line(r), flush=True)
        torch.cuda.empty_cache()
    summary = summarize(args, results, info)
    print(f"packed FP8 forward served: {summary['packed_forward_served']}, backward: "
          f"{summary['packed_backward_served']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
            fh.write("\n")
    has_control = any(not c.packed for c in args.configs)
    return EXIT_CONTROL_FAILED if has_control and not control_ran(results) else 0


if __name__ == "__main__":
    sys.exit(main())
