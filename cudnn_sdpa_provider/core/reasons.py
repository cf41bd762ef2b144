"""Fallback reason slugs: the public, stable vocabulary of the telemetry.

Every slug is a member of ``Slug`` (a ``str`` enum: ``Slug.DTYPE == "dtype"``) and has exactly one
meaning, given with what to do about it in ``CATALOG``. Slugs never change meaning; messages may.
When a slug is split, the old name keeps one of its meanings and ``CATALOG`` says where the others
went (``cudnn_version`` before 0.2 also covered what is now ``cudnn_feature`` and ``cudnn_bug``).
docs/telemetry.md is generated from this table (``python -m cudnn_sdpa_provider.tools.docgen``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Slug", "Reason", "CATALOG", "PATHS"]

#: The paths: op names, counter keys, CLI rows and test ids all use these names. ``paged_fwd`` is
#: ``csp.attention`` with a ``block_table`` (a paged KV cache; forward only); ``fp8_fwd`` and
#: ``fp8_bwd`` are ``csp.fp8`` (FP8 operands with per-tensor scales).
PATHS = ("dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd", "paged_fwd", "fp8_fwd", "fp8_bwd")


class Slug(str, enum.Enum):
    """The reason slugs. Each member's value is the slug string the counters and reports use."""

    NOT_ENABLED = "not_enabled"
    NO_CUDA = "no_cuda"
    CUDNN_UNAVAILABLE = "cudnn_unavailable"
    CUDNN_VERSION = "cudnn_version"
    CUDNN_FEATURE = "cudnn_feature"
    CUDNN_BUG = "cudnn_bug"
    CUDNN_KNOWN_ISSUE = "cudnn_known_issue"
    COMPUTE_CAPABILITY = "compute_capability"
    DTYPE = "dtype"
    HEAD_DIM = "head_dim"
    GQA_HEADS = "gqa_heads"
    ATTN_BIAS = "attn_bias"
    DROPOUT = "dropout"
    DROPOUT_RECOMPUTE = "dropout_recompute"
    SINK_BACKWARD_RAGGED = "sink_backward_ragged"
    SINK_DECODE = "sink_decode"
    SEQ_LEN_ONE_BACKWARD = "seq_len_one_backward"
    EMPTY = "empty"
    RAGGED_OFFSET_OVERFLOW = "ragged_offset_overflow"
    DETERMINISTIC_WORKSPACE = "deterministic_workspace"
    GRAPH_NOT_SUPPORTED = "graph_not_supported"
    TORCH_SELECTION = "torch_selection"
    BACKEND_DISABLED = "backend_disabled"
    RANK = "rank"
    SOFTCAP = "softcap"
    PAGED_KV = "paged_kv"
    PAGED_BLOCK_SIZE = "paged_block_size"
    PAGED_BACKWARD = "paged_backward"
    UNSUPPORTED_ARGUMENT = "unsupported_argument"

    def __str__(self) -> str:
        return self.value


class Reason(NamedTuple):
    """Why a call is not served by this package's cuDNN graphs: a slug and a message for humans."""

    slug: str
    message: str

    def __str__(self) -> str:
        return f"{self.slug}: {self.message}"


#: slug -> (what it means, what to do about it). Exactly one entry per ``Slug`` member.
CATALOG: dict[str, tuple[str, str]] = {
    Slug.NOT_ENABLED.value: (
        "The provider was not enabled when the call ran.",
        "Wrap the code in `with cudnn_sdpa_provider.enable():` or set CUDNN_SDPA_PROVIDER=1.",
    ),
    Slug.NO_CUDA.value: (
        "The inputs are not on a CUDA device (or this machine has no CUDA).",
        "Move the tensors to an NVIDIA GPU; CPU calls always run on PyTorch's kernels.",
    ),
    Slug.CUDNN_UNAVAILABLE.value: (
        "nvidia-cudnn-frontend is not importable, or the cuDNN library cannot be loaded.",
        "Install nvidia-cudnn-frontend>=1.28 and a cuDNN 9 runtime (extras cu12/cu13); run `cudnn-sdpa doctor`.",
    ),
    Slug.CUDNN_VERSION.value: (
        "The cuDNN backend is older than the oldest version the provider builds graphs for, or is a withdrawn "
        "release. (Before 0.2 this slug also covered what `cudnn_feature` and `cudnn_bug` now count.)",
        "Upgrade cuDNN (`cudnn-sdpa doctor` shows the loaded version).",
    ),
    Slug.CUDNN_FEATURE.value: (
        "The call uses a feature this cuDNN version does not have (e.g. attention sinks before 9.13).",
        "Upgrade cuDNN (`cudnn-sdpa doctor` names the version each feature needs).",
    ),
    Slug.CUDNN_BUG.value: (
        "This cuDNN release has a known bug for this configuration, so the call is not sent to it.",
        "Upgrade cuDNN; docs/support.md lists the releases and configurations.",
    ),
    Slug.CUDNN_KNOWN_ISSUE.value: (
        "The call, or the graph built for it, is a configuration this cuDNN release is publicly known to crash "
        "on or compute wrong (the known-issues table: each row names its public issue). Checked again on the "
        "graph actually built, so a graph built for other dims than the call's is covered too. (Before the "
        "table, the cuDNN 9.26 backward-planning crash at B = H = S_q = 1 counted as `cudnn_bug`.)",
        "Nothing to do: the call runs on the aten composite (PyTorch's own cuDNN kernels share the cuDNN "
        "bug, so they are not used for it); docs/support.md lists the rows and their issues, "
        "`cudnn-sdpa doctor` the ones that apply to this machine.",
    ),
    Slug.COMPUTE_CAPABILITY.value: (
        "The GPU is older than the call needs: cuDNN SDPA needs Ampere (sm_80), FP8 attention Hopper (sm_90).",
        "Nothing to do on this GPU.",
    ),
    Slug.DTYPE.value: (
        "The inputs are not all float16 or all bfloat16 (cuDNN SDPA has no float32 path); for FP8 attention, "
        "q, k, v are not float8_e4m3fn (or dO not e4m3fn/e5m2).",
        "Run attention in fp16/bf16 (autocast does this); quantise FP8 operands with `csp.fp8.quantize`.",
    ),
    Slug.HEAD_DIM.value: (
        "A head dimension is not a multiple of 8, exceeds 256, or is not what this GPU's backward supports.",
        "Use head dims that are multiples of 8 up to 256 (128 for backward before Hopper; exactly 128 for the FP8 "
        "backward on Hopper).",
    ),
    Slug.GQA_HEADS.value: (
        "The number of query heads is not a multiple of the key/value heads.",
        "Use H_q divisible by H_k and by H_v.",
    ),
    Slug.ATTN_BIAS.value: (
        "The attention mask/bias has a shape, dtype or gradient requirement the provider does not serve.",
        "Pass a bias of shape (1|B, 1|H, S_q, S_kv) that does not require grad, or per-sequence lengths.",
    ),
    Slug.DROPOUT.value: (
        "Dropout is not served on this path (packed inputs, p >= 1, or the dropout debug mask).",
        "Use dropout_p=0, or accept PyTorch's kernel for these calls.",
    ),
    Slug.DROPOUT_RECOMPUTE.value: (
        "A dropout forward that can be recomputed (activation checkpointing: saved-tensor hooks active, grad "
        "disabled, or inside a backward pass) runs on PyTorch's kernel, so that the recomputation draws the "
        "same dropout mask as the forward wherever it runs.",
        "Nothing to do: the gradients are right. Without checkpointing the dropout forward is served.",
    ),
    Slug.SINK_BACKWARD_RAGGED.value: (
        "The backward of attention sinks on packed (varlen) inputs needs cuDNN >= 9.26.",
        "Upgrade cuDNN, or use dense padded inputs with seq_len_q/seq_len_kv.",
    ),
    Slug.SINK_DECODE.value: (
        "Attention sinks are not supported when S_q == 1.",
        "Nothing to do; the call runs on the composite fallback.",
    ),
    Slug.SEQ_LEN_ONE_BACKWARD.value: (
        "cuDNN has no backward for S_q == S_kv == 1.",
        "Nothing to do; the call runs on PyTorch's kernel.",
    ),
    Slug.EMPTY.value: (
        "An input has zero elements.",
        "Nothing to do; PyTorch handles empty inputs.",
    ),
    Slug.RAGGED_OFFSET_OVERFLOW.value: (
        "A packed (varlen) operand is too large for cuDNN's int32 ragged offsets.",
        "Split the batch.",
    ),
    Slug.DETERMINISTIC_WORKSPACE.value: (
        "The deterministic backward on this cuDNN needs an O(B*H*S_q*S_kv) workspace above the limit.",
        "Raise CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB, upgrade to cuDNN >= 9.25, or turn off deterministic mode.",
    ),
    Slug.GRAPH_NOT_SUPPORTED.value: (
        "cuDNN rejected the graph at build time (its message is logged once).",
        "Run with CUDNN_SDPA_PROVIDER_LOG=info to see cuDNN's message; report it if the configuration should work.",
    ),
    Slug.TORCH_SELECTION.value: (
        "PyTorch's SDPA selector sent the call to a backend other than cuDNN.",
        "Check the inputs with `cudnn_sdpa_provider.explain(q, k, v, ...)`; PyTorch's own cuDNN checks rejected them.",
    ),
    Slug.BACKEND_DISABLED.value: (
        "The user's own backend selection excludes cuDNN (`sdpa_kernel([...])` without CUDNN_ATTENTION, or "
        "`torch.backends.cuda.enable_cudnn_sdp(False)`). The provider never overrides it.",
        "Include SDPBackend.CUDNN_ATTENTION in the selection if the call should run on cuDNN.",
    ),
    Slug.RANK.value: (
        "F.scaled_dot_product_attention got inputs that are not 4-D (B, H, S, D); PyTorch runs them on its math kernel.",
        "Pass (B, H, S, D) tensors (add a batch dim), or use cudnn_sdpa_provider.attention.",
    ),
    Slug.SOFTCAP.value: (
        "Attention logit soft-capping (Gemma 2) is not served: cuDNN's SDPA graph has no softcap.",
        "Nothing to do; the layer runs its own eager attention (counted as this fallback).",
    ),
    Slug.PAGED_KV.value: (
        "A varlen_attn call with seqused_k or block_table but not both is not served (a paged KV cache, "
        "block_table with seqused_k, is served on cuDNN's paged graph since the paged path came in; before, "
        "this slug counted those calls too).",
        "Nothing to do; it runs on PyTorch's kernel (seqused_k alone: per-sequence key counts on packed keys).",
    ),
    Slug.PAGED_BLOCK_SIZE.value: (
        "A paged KV cache (csp.attention with block_table) whose block size is not a power of 2; cuDNN's paged "
        "attention reads power-of-2 blocks only.",
        "Allocate the cache in blocks of 1, 2, 4, ..., 256 tokens; the call runs on the composite (a gather).",
    ),
    Slug.PAGED_BACKWARD.value: (
        "A paged KV call (csp.attention with block_table) whose inputs require grad: cuDNN's paged attention "
        "is a forward (inference) graph with no backward.",
        "Run decode under torch.no_grad()/inference_mode(); with grad the composite (a gather) computes it.",
    ),
    Slug.UNSUPPORTED_ARGUMENT.value: (
        "The call passes an argument the provider does not serve (the message names it), e.g. an argument a "
        "newer torch added to varlen_attn; it is never ignored.",
        "Nothing to do; the call runs on PyTorch's kernel. Report it if the argument should be served.",
    ),
}
