"""What the bench measures: the cases, each kind's paths and baseline, the presets, the flop counts,
and the checks of the options. Pure data; nothing here imports torch or touches CUDA.

Paths by kind:
  dense    provider       F.sdpa inside ``cudnn_sdpa_provider.enable()``
           native_cudnn   provider off, ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` (PyTorch's C++ cuDNN path)
           flash          provider off, ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
           efficient      provider off, ``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``
  varlen   provider       ``varlen_attn`` inside ``enable()``
           native_varlen  provider off, ``varlen_attn`` (FlashAttention varlen in torch 2.11-2.13)
  padded   (a right-padded causal batch, as Hugging Face models pass it)
           provider       ``csp.attention`` with per-sequence lengths (cuDNN skips the padded tiles)
           provider_bias  F.sdpa with the boolean padding+causal mask inside ``enable()`` (a cuDNN bias graph)
           native_cudnn, efficient   F.sdpa with the same mask, provider off, that backend forced
           native         the same, PyTorch choosing the backend (what a model gets by default)
  step     (a training step of ``demo.TinyGQA``: forward, loss, backward)
           provider, native   eager steps (native: provider off, PyTorch choosing the backend)
           provider_graphed   the same step captured once in a CUDA graph under the provider (after
                              warm-up steps that build every cuDNN graph), then ``graph.replay()``
  hf_llama (a training step of Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig``, random
           weights, on a right-padded batch whose padded labels are -100)
           native         ``attn_implementation="sdpa"``, provider off
           provider       the same model inside ``enable()`` (transformers' boolean mask: the cuDNN bias path)
           provider_hf    ``integrations.transformers.register()``, then ``attn_implementation="cudnn"``
                          (right padding reaches cuDNN as per-sequence lengths), provider not enabled
  fp8      (FP8 attention end to end from bf16 activations, issue #30; ``fp8_case`` runs it)
           native         F.sdpa, provider off, PyTorch choosing the backend (the baseline)
           provider       F.sdpa inside ``enable()`` (bf16 on cuDNN)
           fp8_delayed    ``csp.fp8.attention`` with ``Recipe(scaling="delayed")``
           fp8_current    ``csp.fp8.attention`` with ``Recipe(scaling="current")``

Modes: ``fwd`` (inference: inputs do not require grad, so no logsumexp is computed) and ``fwd_bwd``
(forward, then ``torch.autograd.grad`` with a random grad_out; nothing accumulates into ``.grad``).
Training steps (``step``, ``hf_llama``) have ``fwd_bwd`` only.

Groups: cases outside the default matrix, run by naming the group (``select(["fp8"])``,
``cudnn-sdpa bench --shapes fp8``) or the case. ``fp8`` is ten FP8 end-to-end cases (``FP8_MATRIX``);
it is not in the default run, which stays the provider against the native paths (the group is 80
rows of long sequences, and its FP8 paths need Hopper or newer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable

__all__ = ["Case", "Preset", "MATRIX", "MODES", "DEFAULT", "QUICK", "QUICK_CASES", "BASELINE", "select",
           "quick_matrix", "check_modes", "check_settings", "fwd_flops", "flops", "expected_calls", "llama_config",
           "FP8_MATRIX", "GROUPS", "KNOWN", "audited", "listing"]

MODES = ("fwd", "fwd_bwd")
DENSE_PATHS = ("provider", "native_cudnn", "flash", "efficient")
VARLEN_PATHS = ("provider", "native_varlen")
PADDED_PATHS = ("provider", "provider_bias", "native_cudnn", "native", "efficient")
STEP_PATHS = ("provider", "provider_graphed", "native")
HF_PATHS = ("provider", "provider_hf", "native")
FP8_PATHS = ("native", "provider", "fp8_delayed", "fp8_current")
PATHS = {"dense": DENSE_PATHS, "varlen": VARLEN_PATHS, "padded": PADDED_PATHS, "step": STEP_PATHS,
         "hf_llama": HF_PATHS, "fp8": FP8_PATHS}
#: Each kind's baselines for ``vs_native``, in order of preference (the first one that ran).
BASELINE = {"dense": ("native_cudnn",), "varlen": ("native_varlen",), "padded": ("native_cudnn", "native"),
            "step": ("native",), "hf_llama": ("native",), "fp8": ("native",)}
#: Paths whose calls the counters must show served: the provider's (``provider*``) and the FP8 ones
#: (``fp8_*``, counted as ``fp8_fwd`` / ``fp8_bwd``). An exception on one of them is an error, never
#: a skip: only PyTorch's own paths may decline a shape.
AUDITED_PREFIXES = ("provider", "fp8_")
#: Kinds whose unit is a whole training step: fwd_bwd only, no attention flop count.
STEP_KINDS = ("step", "hf_llama")
#: Peer paths (``run(peers=...)``) are added to these kinds only (the others pass masks or models).
PEER_KINDS = ("dense", "varlen")
#: fwd+bwd counts 3.5x the forward's flops: the forward is 2 matmuls (Q K^T, P V), the backward 5
#: (Q K^T recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q). The convention of
#: FlashAttention's benchmarks/benchmark_flash_attention.py (``flops(..., mode="fwd_bwd")``).
BWD_FACTOR = 3.5
#: hf_llama cases: Llama 2's vocabulary size (LlamaConfig's default).
HF_VOCAB = 32000


@dataclass(frozen=True)
class Preset:
    repeats: int
    warmup: int
    host_calls: int


DEFAULT = Preset(repeats=30, warmup=5, host_calls=300)
QUICK = Preset(repeats=5, warmup=2, host_calls=50)


@dataclass(frozen=True)
class Case:
    """One shape. ``seq`` is S (dense, padded, steps) or the longest sequence (varlen); ``seq_lens``
    are the varlen sequences' lengths or the padded batch's real lengths."""

    name: str
    kind: str  # a key of PATHS
    batch: int
    h_q: int
    h_kv: int
    seq: int
    head_dim: int
    causal: bool
    seq_lens: tuple[int, ...] = ()
    host: bool = False  # also measure the host cost per call
    layers: int = 1  # attention calls per step (training steps: the model's layers)

    @property
    def gqa(self) -> bool:
        return self.h_q != self.h_kv

    @property
    def paths(self) -> tuple[str, ...]:
        return PATHS[self.kind]

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd_bwd",) if self.kind in STEP_KINDS else MODES

    def describe(self) -> str:
        heads = f"H={self.h_q}" + (f"/{self.h_kv} (GQA)" if self.gqa else "")
        lens = self.seq_lens
        if self.kind == "varlen":
            shape = f"varlen {len(lens)} seqs of {min(lens)}..{max(lens)} ({sum(lens)} tokens)"
        elif self.kind == "padded":
            shape = f"B={self.batch} S={self.seq} {self._padding()}"
        elif self.kind == "step":
            shape = f"training step of demo.TinyGQA ({self.layers} layers), B={self.batch} S={self.seq}"
        elif self.kind == "fp8":
            shape = f"FP8 end to end from bf16 activations, B={self.batch} S={self.seq}"
        elif self.kind == "hf_llama":
            cfg = llama_config(self)
            shape = (f"training step of HF LlamaForCausalLM ({self.layers} layers, hidden {cfg['hidden_size']}, "
                     f"MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}), B={self.batch} S={self.seq} "
                     f"{self._padding()}")
        else:
            shape = f"B={self.batch} S={self.seq}"
        extra = ", host cost" if self.host else ""
        return f"{shape} {heads} D={self.head_dim}{' causal' if self.causal else ''}{extra}"

    def _padding(self) -> str:
        lens = self.seq_lens
        pad = 1 - sum(lens) / (self.batch * self.seq)
        return f"right-padded to lengths {min(lens)}..{max(lens)} ({pad:.0%} padding)"


def varlen_lengths(n: int = 16, low: int = 128, high: int = 4096, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)  # fixed seed: the same mix on every run and machine
    return tuple(rng.randint(low, high) for _ in range(n))


def padded_lengths(batch: int, seq: int, mean_pad: float = 0.25) -> tuple[int, ...]:
    """Real lengths whose padding runs evenly from none to 2 x ``mean_pad`` of ``seq`` (mean ``mean_pad``)."""
    return tuple(seq - round(seq * 2 * mean_pad * i / (batch - 1)) for i in range(batch))


def llama_intermediate(hidden: int, multiple_of: int = 256) -> int:
    """The SwiGLU width of Meta's Llama reference code (``FeedForward`` in llama/model.py): 2/3 of
    4 x hidden, rounded up to a multiple of 256 (5632 at hidden 2048, TinyLlama-1.1B's width)."""
    width = int(2 * 4 * hidden / 3)
    return multiple_of * -(-width // multiple_of)


def llama_config(case: Case) -> dict:
    """``LlamaConfig`` keyword arguments of an ``hf_llama`` case: hidden = H_q x D, no dropout."""
    hidden = case.h_q * case.head_dim
    return dict(vocab_size=HF_VOCAB, hidden_size=hidden, intermediate_size=llama_intermediate(hidden),
                num_hidden_layers=case.layers, num_attention_heads=case.h_q, num_key_value_heads=case.h_kv,
                head_dim=case.head_dim, max_position_embeddings=case.seq, attention_dropout=0.0)


def _dense(b: int, h: int, s: int, d: int, causal: bool) -> Case:
    return Case(f"b{b}_h{h}_s{s}_d{d}" + ("_causal" if causal else ""), "dense", b, h, h, s, d, causal)


def _hf_llama(layers: int, b: int, h: int, kv: int, s: int, d: int) -> Case:
    return Case(f"hf_llama_l{layers}_d{h * d}_b{b}_s{s}_padded", "hf_llama", b, h, kv, s, d, True,
                seq_lens=padded_lengths(b, s), layers=layers)


_LENS = varlen_lengths()

#: The default matrix: six GPU-bound dense shapes (three sizes, causal and not), a Llama-3 GQA long
#: sequence, a varlen mix, a padded Llama-3 GQA batch (lengths against the mask), the tiny shape
#: whose time is all host cost, a small training step (eager against CUDA-graph replay), and a
#: Hugging Face Llama training step (4 layers, hidden 2048, 16/4 heads, B=4 x S=2048 right-padded)
#: with a tiny variant of it (2 layers, hidden 256, B=2 x S=256) that runs in seconds.
MATRIX: tuple[Case, ...] = (
    *(_dense(b, h, s, d, c) for b, h, s, d in ((4, 16, 4096, 128), (16, 16, 1024, 64), (2, 16, 8192, 128))
      for c in (False, True)),
    Case("gqa_b1_h32kv8_s16384_d128_causal", "dense", 1, 32, 8, 16384, 128, True),
    Case("varlen_n16_h16_d128_causal", "varlen", len(_LENS), 16, 16, max(_LENS), 128, True, seq_lens=_LENS),
    Case("padded_b8_h32kv8_s4096_d128_causal", "padded", 8, 32, 8, 4096, 128, True,
         seq_lens=padded_lengths(8, 4096)),
    Case("tiny_b1_h2_s128_d64_causal", "dense", 1, 2, 2, 128, 64, True, host=True),
    Case("step_tinygqa_b2_s128", "step", 2, 4, 2, 128, 64, True, host=True, layers=2),
    _hf_llama(4, 4, 16, 4, 2048, 128),
    _hf_llama(2, 2, 4, 1, 256, 64),
)
QUICK_CASES = ("b16_h16_s1024_d64_causal", "varlen_n16_h16_d128_causal", "tiny_b1_h2_s128_d64_causal")


def _fp8(b: int, h: int, kv: int, s: int, causal: bool) -> Case:
    heads = f"h{h}" + (f"kv{kv}" if kv != h else "")
    return Case(f"fp8_b{b}_{heads}_s{s}_d128" + ("_causal" if causal else ""), "fp8", b, h, kv, s, 128, causal)


#: The ``fp8`` group (issue #30): (1, 32, S, 128) at S = 4k, 8k, 16k, and the GQA batch shape
#: (4, 32/8, S, 128) at S = 4k and 8k, where the issue's targets change (>= 1.0x at 4k, >= 1.3x
#: forward and >= 1.15x forward+backward from 8k); each causal and not. GQA at 16k is left out: it
#: is four times the work of the B=1 16k case, the costliest of the group, at a length that case covers.
FP8_MATRIX: tuple[Case, ...] = (
    *(_fp8(1, 32, 32, s, c) for s in (4096, 8192, 16384) for c in (False, True)),
    *(_fp8(4, 32, 8, s, c) for s in (4096, 8192) for c in (False, True)),
)
#: Case groups outside the default matrix, selected by name.
GROUPS: dict[str, tuple[Case, ...]] = {"fp8": FP8_MATRIX}
#: Every case ``select`` knows: the default matrix, then each group's.
KNOWN: tuple[Case, ...] = MATRIX + tuple(c for cases in GROUPS.values() for c in cases)


def audited(path: str) -> bool:
    """Whether ``path``'s calls are counted and must all be served (``AUDITED_PREFIXES``)."""
    return path.startswith(AUDITED_PREFIXES)


def listing() -> list[tuple[str, str]]:
    """(name, description) for ``--list``: the default matrix, then each group (a line naming it,
    then its cases)."""
    out = [(c.name, c.describe()) for c in MATRIX]
    for group, cases in GROUPS.items():
        out.append((group, f"group of {len(cases)} cases, not in the default run: --shapes {group}"))
        out += [(c.name, f"{c.describe()} [{group}]") for c in cases]
    return out


def select(names: Iterable | None = None) -> list[Case]:
    """Cases by name or group name (a group stands for its cases, in order; ``Case`` objects pass
    through); ``None`` is the default matrix. A case named twice (itself and in its group) runs once."""
    if names is None:
        return list(MATRIX)
    if isinstance(names, (str, Case)):
        names = [names]
    by_name = {c.name: c for c in KNOWN}
    out = []
    for n in names:
        if isinstance(n, Case):
            out.append(n)
        elif n in GROUPS:
            out += GROUPS[n]
        elif n in by_name:
            out.append(by_name[n])
        else:
            raise ValueError(f"unknown bench case {n!r}. Available cases: {list(by_name)}. Available groups: "
                             f"{list(GROUPS)}")
    if not out:
        raise ValueError(f"no bench case selected. Available cases: {list(by_name)}. Available groups: "
                         f"{list(GROUPS)}")
    return list(dict.fromkeys(out))


def quick_matrix() -> list[Case]:
    return select(QUICK_CASES)


def check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(modes))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or modes!r}. Available modes: {list(MODES)}")
    return modes


def check_settings(repeats: int, warmup: int, host_calls: int) -> Preset:
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0), ("host_calls", host_calls, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return Preset(repeats, warmup, host_calls)


def check_peers(peers: dict | None) -> dict:
    """A copy of ``run(peers=...)``; ValueError for a name that is a built-in path, ``provider*`` or
    ``fp8_*`` (``audited``: a peer's calls are not the provider's)."""
    peers = dict(peers or {})
    for name in peers:
        if not isinstance(name, str) or audited(name) or any(name in p for p in PATHS.values()):
            raise ValueError(f"peer path name {name!r} must be a new name (not a built-in path, not 'provider*' "
                             f"or 'fp8_*')")
    return peers


def case_paths(case: Case, peers: Iterable[str] = ()) -> tuple[str, ...]:
    """The case's paths, then the peer paths where they apply."""
    return case.paths + (tuple(peers) if case.kind in PEER_KINDS else ())


def fwd_flops(case: Case) -> float | None:
    """Forward flops: 4*H_q*D per (query, key) pair (QK^T and PV), half the pairs when causal;
    None for training steps (a step is more than attention)."""
    if case.kind in STEP_KINDS:
        return None
    pairs = sum(n * n for n in case.seq_lens) if case.seq_lens else case.batch * case.seq * case.seq
    total = 4 * case.h_q * pairs * case.head_dim
    return float(total // 2 if case.causal else total)


def flops(case: Case, mode: str) -> float | None:
    f = fwd_flops(case)
    return None if f is None else f * (BWD_FACTOR if mode == "fwd_bwd" else 1.0)


def expected_calls(case: Case, mode: str, python_calls: int) -> int:
    """Attention calls the counters must show for ``python_calls`` steps run through Python."""
    return python_calls * case.layers * (2 if mode == "fwd_bwd" else 1)  # a forward and a backward each
