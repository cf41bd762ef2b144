"""The inputs each case's paths run on: random bf16 tensors (fresh per case, never zeros, the same
on every run: the generator is seeded from the case's name), or a model and a batch for the
training steps. Also why a case cannot run here (``unavailable``)."""

from __future__ import annotations

import copy
import itertools
import math
import zlib

import torch

from .cases import Case, llama_config
from .fp8_case import MIN_SETS as _FP8_MIN_SETS

__all__ = ["AttnSet", "StepSet", "HFSet", "make_sets", "set_bytes", "set_count", "padding_mask", "unavailable"]

ROTATE_BYTES = 256 << 20  # input sets rotate until they span this much: > 5x the 50 MB L2 of an H100/H200
MAX_SETS = 8
_HF_MIN_MAJOR = 5  # the package's transformers integration needs transformers 5


class AttnSet:
    """One input set: q, k, v, grad_out (requiring grad) and detached views for the fwd mode;
    ``cu`` (varlen prefix sums), ``lens`` and ``mask`` (padded: real lengths, and the boolean
    padding+causal mask the native paths get)."""

    def __init__(self, q, k, v, g, cu=None, lens=None, mask=None):
        self.q, self.k, self.v = (t.requires_grad_() for t in (q, k, v))
        self.qd, self.kd, self.vd = q.detach(), k.detach(), v.detach()
        self.g, self.cu, self.lens, self.mask = g, cu, lens, mask


class StepSet:
    """A step case's input: a bf16 ``demo.TinyGQA`` and one batch of tokens."""

    def __init__(self, case: Case, gen: torch.Generator):
        from ..demo import TinyGQA

        torch.manual_seed(_seed(case))
        dim = case.h_q * case.head_dim
        self.model = TinyGQA(dim=dim, heads=case.h_q, kv_heads=case.h_kv, layers=case.layers)
        self.model = self.model.to(device="cuda", dtype=torch.bfloat16)
        self.tokens = torch.randint(0, 256, (case.batch, case.seq + 1), generator=gen, device="cuda")


class HFSet:
    """An ``hf_llama`` case's input: one right-padded batch (``ids``; ``mask`` 1 on the case's real
    lengths, 0 after; ``labels`` = ids with -100 on padding, so padding carries no loss) and, per
    ``attn_implementation``, a ``LlamaForCausalLM`` built from ``cases.llama_config`` with random
    weights (no download), each from the same seed, so every implementation has the same weights.
    A model is built on first use (``model(impl)``): the caller's scope must have registered the
    implementation by then."""

    def __init__(self, case: Case, gen: torch.Generator, device: str = "cuda", dtype=torch.bfloat16):
        from transformers import LlamaConfig

        self.config = LlamaConfig(**llama_config(case))
        self.seed, self.device, self.dtype = _seed(case), torch.device(device), dtype
        lens = torch.tensor(case.seq_lens, device=device)
        self.ids = torch.randint(0, self.config.vocab_size, (case.batch, case.seq), generator=gen, device=device)
        self.mask = (torch.arange(case.seq, device=device)[None, :] < lens[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self._models: dict = {}

    def model(self, impl: str):
        if impl not in self._models:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(self.seed)
            with torch.device(self.device):  # weights initialized where they run
                # A config of its own: the model records its attention implementation there.
                model = AutoModelForCausalLM.from_config(copy.deepcopy(self.config), attn_implementation=impl,
                                                         dtype=self.dtype)
            self._models[impl] = model.train()
        return self._models[impl]


def _seed(case: Case) -> int:
    return zlib.crc32(case.name.encode())


def unavailable(case: Case) -> str | None:
    """Why none of the case's paths can run in this environment (None: they can). Only ``hf_llama``
    cases have a requirement: transformers >= 5, importable."""
    if case.kind != "hf_llama":
        return None
    try:
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: F401
    except ImportError as exc:
        return (f"transformers is not importable ({exc}); the Hugging Face Llama case needs transformers >= "
                f"{_HF_MIN_MAJOR}: pip install 'transformers>={_HF_MIN_MAJOR}'")
    major = transformers.__version__.split(".")[0]
    if not major.isdigit() or int(major) < _HF_MIN_MAJOR:
        return f"the Hugging Face Llama case needs transformers >= {_HF_MIN_MAJOR}, found {transformers.__version__}"
    return None


def _shapes(case: Case) -> tuple[tuple, tuple]:
    if case.kind == "varlen":
        t = sum(case.seq_lens)
        return (t, case.h_q, case.head_dim), (t, case.h_kv, case.head_dim)
    return (case.batch, case.h_q, case.seq, case.head_dim), (case.batch, case.h_kv, case.seq, case.head_dim)


def set_bytes(case: Case, mode: str = "fwd_bwd") -> int:
    """Bytes of one input set: bf16 q, k, v (and grad_out for fwd_bwd), the padded cases' bool mask;
    hf_llama: the token batch (ids, mask and labels, int64)."""
    if case.kind == "hf_llama":
        return 3 * 8 * case.batch * case.seq
    sq, skv = _shapes(case)
    elems = math.prod(sq) * (2 if mode == "fwd_bwd" else 1) + 2 * math.prod(skv)
    mask = case.batch * case.seq * case.seq if case.kind == "padded" else 0  # bool, 1 byte
    return 2 * elems + mask  # bf16


def set_count(case: Case) -> int:
    """Attention input sets to rotate through: enough to span ``ROTATE_BYTES`` (at most ``MAX_SETS``),
    at least 1, and for an fp8 case at least ``fp8_case.MIN_SETS`` (its sets are refilled after each
    call: the next call must read another one)."""
    low = _FP8_MIN_SETS if case.kind == "fp8" else 1
    return max(low, min(MAX_SETS, math.ceil(ROTATE_BYTES / set_bytes(case))))


def padding_mask(lens: torch.Tensor, s: int, causal: bool) -> torch.Tensor:
    """(B, 1, S, S) bool: key j visible to query i iff j < length (and j <= i when causal), the mask
    a Hugging Face model builds for a right-padded batch."""
    j = torch.arange(s, device=lens.device)
    mask = (j < lens[:, None])[:, None, None, :]
    if causal:
        mask = mask & (j[None, :] <= j[:, None])
    return mask.expand(len(lens), 1, s, s).contiguous()


def make_sets(case: Case) -> list:
    """The case's input sets on the GPU: enough attention sets to rotate past L2, or one step set."""
    gen = torch.Generator(device="cuda").manual_seed(_seed(case))  # fresh per case, reproducible
    if case.kind == "step":
        return [StepSet(case, gen)]
    if case.kind == "hf_llama":
        return [HFSet(case, gen)]
    sq, skv = _shapes(case)
    extra = {}
    if case.kind == "varlen":
        extra["cu"] = torch.tensor([0, *itertools.accumulate(case.seq_lens)], dtype=torch.int32, device="cuda")
    if case.kind == "padded":
        lens = torch.tensor(case.seq_lens, dtype=torch.int32, device="cuda")
        extra.update(lens=lens, mask=padding_mask(lens, case.seq, case.causal))
    n = set_count(case)

    def rnd(shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    return [AttnSet(rnd(sq), rnd(skv), rnd(skv), rnd(sq), **extra) for _ in range(n)]
