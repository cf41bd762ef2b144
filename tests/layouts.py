"""Operands built the way model code builds them, for the layout differential tests (issue #14).

Device-agnostic and importable without CUDA: the GPU tier (tests/gpu/test_layouts.py) and the CPU
tier (tests/test_layout_builders.py) share it. A configuration is a plain JSON-able dict made by
``generate`` from a seed; ``build`` turns one into q, k, v, grad_out (and mask / cu_seqlens) on a
device. q, k and v are views of leaf buffers that require grad, as a projection's output would be.

Each of q, k and v takes a layout class of its own (``DENSE_SOLO`` / ``VARLEN_SOLO``: storage order,
head-dim slice, expanded dim), unless a *group* builds several from one buffer:

  fused3        qkv.view(..., 3, H, D).unbind(...)       q, k, v share one buffer
  chunk3        x.view(..., H, 3 * D).chunk(3, -1)        head stride 3 * D
  linear_split  one linear output split by heads          token stride (H_q + 2 H_kv) * D (GQA too)
  kv_fused2     kv.view(..., 2, H_kv, D).unbind(...)      k, v share one buffer
  alias_qk      q is k (self-attention on one tensor)     alias_qkv: q is k is v

Every buffer may start at a storage offset (``offsets``: 8 elements keeps 16-byte alignment, 1 does
not), and sliced classes take ``wide`` extra head-dim elements (4 makes rows that are not 16-byte
aligned). grad_out has a layout class of its own (``DENSE_GO`` / ``VARLEN_GO``).
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field

import torch

__all__ = ["Operands", "build", "capabilities", "generate", "split", "DENSE_SOLO", "VARLEN_SOLO", "GROUPS"]

# class -> (storage order of the logical letters, head-dim slice "lo"/"hi"/None, expanded letter or None)
DENSE_SOLO = {
    "bhsd": ("bhsd", None, None),
    "bshd": ("bshd", None, None),  # BSHD seen as BHSD: model code's .transpose(1, 2)
    "sbhd": ("sbhd", None, None),
    "hbsd": ("hbsd", None, None),
    "bhds": ("bhds", None, None),  # head dim not innermost (a K kept transposed for a matmul)
    "slice_lo": ("bshd", "lo", None),  # x[..., :d] of a wider last dim: token stride != H * D
    "slice_hi": ("bshd", "hi", None),  # x[..., w:]
    "expand_heads": ("bhsd", None, "h"),  # stride 0 over heads (GQA via expand)
    "expand_seq": ("bhsd", None, "s"),  # stride 0 over queries / keys
    "expand_batch": ("bhsd", None, "b"),
}
VARLEN_SOLO = {
    "thd": ("thd", None, None),
    "htd": ("htd", None, None),  # HTD seen as THD
    "tdh": ("tdh", None, None),  # head dim not innermost
    "slice_lo": ("thd", "lo", None),
    "slice_hi": ("thd", "hi", None),
    "expand_heads": ("thd", None, "h"),
    "expand_tokens": ("thd", None, "t"),
}
GROUPS = ("none", "fused3", "chunk3", "linear_split", "kv_fused2", "alias_qk", "alias_qkv")
#: grad_out classes: a solo class, or "col" (the `.t()` of a (H*D, tokens) matrix, as a next layer's
#: backward can hand it over: head-dim stride = the token count).
DENSE_GO = {"bhsd": "bhsd", "bshd": "bshd", "col": None, "broadcast": "expand_heads", "slice": "slice_lo",
            "offset": "bhsd"}
VARLEN_GO = {"thd": "thd", "htd": "htd", "col": None, "broadcast": "expand_heads", "slice": "slice_lo",
             "offset": "thd"}
DENSE_MASKS = ("none", "causal", "bool", "float", "bool_pad")
ATTENTION_WINDOWS = ("none", "causal", "causal_br", "window", "window_br")
VARLEN_WINDOWS = ("none", "causal", "window")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Operands:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    go: torch.Tensor
    leaves: list = field(default_factory=list)  # the buffers q, k, v are views of
    mask: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None

    @property
    def inputs(self) -> list:
        """q, k, v without repeats (an aliased q is k appears once): what gradients are taken of."""
        seen, out = set(), []
        for t in (self.q, self.k, self.v):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    @property
    def names(self) -> list[str]:
        """'dq', 'dk', 'dv', or 'dq+dk' for an aliased tensor, matching ``inputs``."""
        return ["d" + "+d".join(n for n, t in zip("qkv", (self.q, self.k, self.v)) if t is x) for x in self.inputs]


# ----------------------------------------------------------------------------------- builders


class _Source:
    """Random leaf buffers from one seeded generator (never zeros: inputs are randn)."""

    def __init__(self, seed: int, dtype, device):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.dtype, self.device = dtype, device
        self.leaves: list = []

    def flat(self, n: int, grad: bool = True) -> torch.Tensor:
        t = torch.randn(n, generator=self.gen, device=self.device).to(self.dtype).requires_grad_(grad)
        if grad:
            self.leaves.append(t)
        return t

    def buffer(self, sizes, offset: int, grad: bool = True) -> torch.Tensor:
        return self.flat(math.prod(sizes) + offset, grad)[offset:].view(sizes)


def _solo(src: _Source, spec, sizes: dict, logical: str, offset: int, wide: int, grad: bool = True):
    order, cut, expanded = spec
    storage = [1 if c == expanded else sizes[c] for c in order]
    if cut:
        storage[-1] += wide  # sliced classes keep d innermost
    t = src.buffer(storage, offset, grad)
    if cut == "lo":
        t = t[..., : sizes["d"]]
    elif cut == "hi":
        t = t[..., wide:]
    t = t.permute([order.index(c) for c in logical])
    return t.expand([sizes[c] for c in logical]) if expanded else t


def _grouped(src: _Source, cfg, prefix: list, kv_prefix: list, to_logical, offset: int):
    """q, k, v (None where the group does not build it) from one buffer of shape (*prefix, ...);
    ``kv_prefix`` is the keys' (tokens or batch and S_kv), for the group that builds k and v only."""
    group, d, h_q, h_kv = cfg["group"], cfg["d"], cfg["h_q"], cfg["h_kv"]
    n = len(prefix)
    if group == "fused3":
        parts = src.buffer(prefix + [3, h_q, d], offset).unbind(n)
    elif group == "chunk3":
        parts = src.buffer(prefix + [h_q, 3 * d], offset).chunk(3, -1)
    elif group == "linear_split":
        flat = src.buffer(prefix + [(h_q + 2 * h_kv) * d], offset)
        heads = (h_q, h_kv, h_kv)
        parts = [p.view(prefix + [h, d]) for p, h in zip(flat.split([h * d for h in heads], -1), heads)]
    elif group == "kv_fused2":
        parts = (None,) + tuple(src.buffer(kv_prefix + [2, h_kv, d], offset).unbind(len(kv_prefix)))
    else:
        return None, None, None
    return tuple(None if p is None else to_logical(p) for p in parts)


def _dense_sizes(cfg, which: str) -> dict:
    h = cfg["h_q"] if which == "q" else cfg["h_kv"]
    s = cfg["s_q"] if which == "q" else cfg["s_kv"]
    return dict(b=cfg["b"], h=h, s=s, d=cfg["d"])


def _varlen_sizes(cfg, which: str) -> dict:
    lens = cfg["lens_q"] if which == "q" else cfg["lens_kv"]
    return dict(t=sum(lens), h=cfg["h_q"] if which == "q" else cfg["h_kv"], d=cfg["d"])


def build(cfg: dict, device) -> Operands:
    """q, k, v, grad_out (and mask / cu_seqlens) for one configuration, on ``device``."""
    varlen = cfg["api"] in ("varlen_attn", "attention_varlen")
    src = _Source(cfg["seed"], DTYPES[cfg["dtype"]], device)
    solo, logical, sizes = (VARLEN_SOLO, "thd", _varlen_sizes) if varlen else (DENSE_SOLO, "bhsd", _dense_sizes)
    prefix = [sum(cfg["lens_q"])] if varlen else [cfg["b"], cfg["s_q"]]
    kv_prefix = [sum(cfg["lens_kv"])] if varlen else [cfg["b"], cfg["s_kv"]]
    to_logical = (lambda x: x) if varlen else (lambda x: x.transpose(1, 2))
    offsets = cfg["offsets"]
    grouped = _grouped(src, cfg, prefix, kv_prefix, to_logical, offsets[0])
    made = {}
    for i, name in enumerate("qkv"):
        made[name] = grouped[i]
        if made[name] is None:
            made[name] = _solo(src, solo[cfg[name]], sizes(cfg, name), logical, offsets[i], cfg["wide"])
    if cfg["group"] in ("alias_qk", "alias_qkv"):
        made["k"] = made["q"]
    if cfg["group"] == "alias_qkv":
        made["v"] = made["q"]
    go = _grad_out(src, cfg, varlen, sizes(cfg, "q"), logical)
    ops = Operands(made["q"], made["k"], made["v"], go, list(src.leaves))
    if varlen:
        ops.cu_q, ops.cu_k = (_cu(cfg[key], device) for key in ("lens_q", "lens_kv"))
    elif cfg.get("mask") in ("bool", "float", "bool_pad"):
        ops.mask = _mask(src, cfg)
    return ops


def _grad_out(src: _Source, cfg, varlen: bool, sizes: dict, logical: str) -> torch.Tensor:
    kind = cfg["go"]
    table, solo = (VARLEN_GO, VARLEN_SOLO) if varlen else (DENSE_GO, DENSE_SOLO)
    if kind == "col":
        tokens = sizes["t"] if varlen else sizes["b"] * sizes["s"]
        m = src.flat(sizes["h"] * sizes["d"] * tokens, grad=False).view(sizes["h"] * sizes["d"], tokens).t()
        if varlen:
            return m.view(sizes["t"], sizes["h"], sizes["d"])
        return m.view(sizes["b"], sizes["s"], sizes["h"], sizes["d"]).transpose(1, 2)
    offset = 1 if kind == "offset" else 0
    return _solo(src, solo[table[kind]], sizes, logical, offset, sizes["d"], grad=False)


def _mask(src: _Source, cfg) -> torch.Tensor:
    """An attention mask that leaves every query at least one key (key 0), so no row is NaN natively."""
    b, h, s_q, s_kv = cfg["b"], cfg["h_q"], cfg["s_q"], cfg["s_kv"]
    if cfg["mask"] == "bool_pad":  # a key-padding mask broadcast over queries (stride 0), as HF builds it
        keep = torch.rand(b, 1, 1, s_kv, generator=src.gen, device=src.device) < 0.8
        keep[..., 0] = True
        return keep.expand(b, 1, s_q, s_kv)
    mb, mh = cfg["mask_dims"]
    shape = [s_q, s_kv] if mb == 0 else [b if mb > 1 else 1, h if mh > 1 else 1, s_q, s_kv]
    if cfg["mask"] == "bool":
        keep = torch.rand(shape, generator=src.gen, device=src.device) < 0.75
        keep[..., 0] = True
        return keep
    return torch.randn(shape, generator=src.gen, device=src.device).to(src.dtype)


def _cu(lens, device) -> torch.Tensor:
    return torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------- generation

#: (b, h_q, h_kv, s_q, s_kv); s_q <= s_kv, so no bottom-right window leaves a query without keys.
DENSE_SHAPES = ((2, 4, 4, 128, 128), (1, 8, 8, 256, 256), (3, 4, 4, 64, 64), (2, 8, 2, 128, 128),
                (2, 4, 1, 200, 200), (1, 8, 8, 1, 256), (2, 4, 4, 64, 200), (1, 8, 2, 17, 17))
VARLEN_LENS = ((100, 28), (64, 64, 64), (1, 200, 55), (128,), (17, 230, 9), (31, 64, 100, 61))
VARLEN_HEADS = ((4, 4), (8, 2), (2, 2), (8, 8))
API_WEIGHTS = {"sdpa": 4, "attention": 2, "varlen_attn": 3, "attention_varlen": 2}
GROUP_WEIGHTS = {"none": 5, "fused3": 3, "chunk3": 1, "linear_split": 2, "kv_fused2": 2}


def capabilities(device: str) -> dict:
    """What the configurations may use here: the APIs, and the keyword arguments this torch's
    ``varlen_attn`` takes (2.11 and later releases differ; only what exists is generated)."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = sorted(inspect.signature(varlen_attn).parameters)
    except Exception:  # no torch.nn.attention.varlen in this torch
        params = []
    apis = ["sdpa", "attention", "attention_varlen"] + (["varlen_attn"] if device == "cuda" and params else [])
    return {"device": device, "apis": apis, "varlen_params": params}


def _pick(rng: random.Random, weights: dict):
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def _fits(group: str, h_q: int, h_kv: int, same_tokens: bool) -> bool:
    if group in ("fused3", "chunk3", "alias_qk", "alias_qkv"):
        return h_q == h_kv and same_tokens
    if group == "linear_split":
        return same_tokens
    return True


def _family(rng: random.Random, caps: dict, sizes: dict) -> dict:
    """The structural part of a configuration (what a graph is built for)."""
    api = _pick(rng, {a: w for a, w in API_WEIGHTS.items() if a in caps["apis"]})
    cfg = {"api": api, "dtype": rng.choice(["bfloat16", "bfloat16", "float16"]), "d": rng.choice([64, 128]),
           "wide": rng.choice([4, 8, 32, 64])}
    if api in ("varlen_attn", "attention_varlen"):
        _varlen_family(rng, caps, cfg, sizes["varlen"])
        same_tokens, solo = cfg["lens_q"] == cfg["lens_kv"], VARLEN_SOLO
    else:
        b, cfg["h_q"], cfg["h_kv"], s_q, s_kv = rng.choice(sizes["dense"])
        cfg.update(b=b, s_q=s_q, s_kv=s_kv)
        _dense_family(rng, cfg)
        same_tokens, solo = s_q == s_kv, DENSE_SOLO
    groups = {g: w for g, w in GROUP_WEIGHTS.items() if _fits(g, cfg["h_q"], cfg["h_kv"], same_tokens)}
    cfg["group"] = _pick(rng, groups)
    for name in "qkv":
        cfg[name] = rng.choice(list(solo))
    cfg["aliasable"] = cfg["group"] == "none" and rng.random() < 0.5 and _fits("alias_qk", cfg["h_q"], cfg["h_kv"],
                                                                              same_tokens)
    if cfg["aliasable"]:  # variants may make q and k (and v) one tensor
        cfg["k"] = cfg["q"]
        cfg["v"] = cfg["q"] if rng.random() < 0.4 else cfg["v"]
    cfg["scale"] = rng.choice([None, None, 0.1]) if api != "varlen_attn" or "scale" in caps["varlen_params"] else None
    # strides (and, through repairs, alignment) are part of a graph's key: these belong to the family
    cfg["offsets"] = [rng.choice([0, 0, 8, 1]) for _ in range(3)]
    cfg["go"] = rng.choice(list(VARLEN_GO if solo is VARLEN_SOLO else DENSE_GO))
    return cfg


def _dense_family(rng: random.Random, cfg: dict) -> None:
    if cfg["api"] == "sdpa":
        cfg["mask"] = rng.choice(DENSE_MASKS)
        cfg["mask_dims"] = rng.choice([[1, 1], [2, 1], [1, 2], [2, 2], [0, 0]])  # 1 / B (H) per dim; 0: 2-D
        cfg["dropout_p"] = 0.25 if cfg["mask"] in ("none", "causal") and rng.random() < 0.3 else 0.0
    else:
        cfg["window"] = rng.choice(ATTENTION_WINDOWS)
        cfg["window_w"] = rng.choice([16, 63])


def _varlen_family(rng: random.Random, caps: dict, cfg: dict, all_lens) -> None:
    params = caps["varlen_params"]
    lens = list(rng.choice(all_lens))
    cfg["lens_q"] = lens
    cfg["lens_kv"] = lens if rng.random() < 0.7 else [n + rng.choice([0, 5, 40]) for n in lens]
    heads = [hq for hq in VARLEN_HEADS if hq[0] == hq[1] or cfg["api"] == "attention_varlen" or "enable_gqa" in params]
    cfg["h_q"], cfg["h_kv"] = rng.choice(heads)
    windows = [w for w in VARLEN_WINDOWS
               if cfg["api"] == "attention_varlen" or w != "window" or "window_size" in params]
    cfg["window"] = rng.choice(windows)
    cfg["window_w"] = rng.choice([16, 63])
    forms = [f for f in ("window_size", "is_causal") if f in params] if cfg["api"] == "varlen_attn" else ["window"]
    cfg["causal_form"] = "window_size" if cfg["window"] == "window" else rng.choice(forms)
    cfg["bottom_right"] = cfg["api"] == "varlen_attn" or rng.random() < 0.8  # FlashAttention's alignment


def _variant(rng: random.Random, family: dict, caps: dict) -> dict:
    """A configuration of ``family``: its own data, aliasing, backward inside or after the scope, LSE
    returned or not; nothing that changes the graph."""
    cfg = dict(family, seed=rng.randrange(2**16))
    cfg["bwd_in_scope"] = rng.random() < 0.7
    if cfg["aliasable"] and rng.random() < 0.6:
        cfg["group"] = "alias_qkv" if cfg["v"] == cfg["q"] and rng.random() < 0.5 else "alias_qk"
    cfg["return_lse"] = cfg["api"] != "sdpa" and rng.random() < 0.3 and (
        cfg["api"] != "varlen_attn" or "return_aux" in caps["varlen_params"])
    return cfg


def generate(n: int, seed: int, caps: dict, variants: int = 4, sizes: dict | None = None) -> list[dict]:
    """``n`` configurations, deterministic in ``seed``: families of ``variants`` configurations that
    share a structure, so built graphs (the dominant cost on the GPU) are shared (``_variant``).
    Ids run 0..n-1. ``sizes`` ({"dense": shapes, "varlen": lengths}) replaces
    ``DENSE_SHAPES`` / ``VARLEN_LENS`` (the CPU tier's smaller ones)."""
    rng = random.Random(seed)
    sizes = sizes or {"dense": DENSE_SHAPES, "varlen": VARLEN_LENS}
    out: list[dict] = []
    while len(out) < n:
        family = _family(rng, caps, sizes)
        for _ in range(min(variants, n - len(out))):
            out.append(dict(_variant(rng, family, caps), id=len(out), family=len(out) // max(variants, 1)))
    return out


def split(configs: list, size: int) -> list[list]:
    """Consecutive batches of at most ``size`` (families stay mostly together)."""
    return [configs[i:i + size] for i in range(0, len(configs), max(size, 1))]
