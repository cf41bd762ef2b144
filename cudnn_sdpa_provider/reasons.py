"""Fallback reason slugs: the public, stable vocabulary of the telemetry.

Slugs are snake_case and never change meaning; messages may. ``CATALOG`` maps each slug to
(what it means, what to do about it); docs/telemetry.md is generated from it
(``python -m cudnn_sdpa_provider.docgen``) and CI checks that the page is current.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Reason", "CATALOG", "PATHS"]

#: The four paths: op names, counter keys, CLI rows and test ids all use these names.
PATHS = ("dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd")


class Reason(NamedTuple):
    """Why a call is not served by this package's cuDNN graphs."""

    slug: str
    message: str

    def __str__(self) -> str:
        return f"{self.slug}: {self.message}"


CATALOG: dict[str, tuple[str, str]] = {
    "not_enabled": (
        "The provider was not enabled when the call ran.",
        "Wrap the code in `with cudnn_sdpa_provider.enable():` or set CUDNN_SDPA_PROVIDER=1.",
    ),
    "no_cuda": (
        "The inputs are not on a CUDA device (or this machine has no CUDA).",
        "Move the tensors to an NVIDIA GPU; CPU calls always run on PyTorch's kernels.",
    ),
    "cudnn_unavailable": (
        "nvidia-cudnn-frontend is not importable, or the cuDNN library cannot be loaded.",
        "Install nvidia-cudnn-frontend>=1.28 and a cuDNN 9 runtime (extras cu12/cu13); run `cudnn-sdpa doctor`.",
    ),
    "cudnn_version": (
        "This cuDNN version lacks the feature, or has a known bug for this configuration.",
        "Upgrade cuDNN (`cudnn-sdpa doctor` names the version each feature needs).",
    ),
    "compute_capability": (
        "The GPU is older than Ampere (sm_80); cuDNN SDPA needs sm_80 or newer.",
        "Nothing to do on this GPU.",
    ),
    "dtype": (
        "The inputs are not all float16 or all bfloat16 (cuDNN SDPA has no float32 path).",
        "Run attention in fp16/bf16 (autocast does this).",
    ),
    "head_dim": (
        "A head dimension is not a multiple of 8, exceeds 256, or exceeds what this GPU's backward supports.",
        "Use head dims that are multiples of 8 up to 256 (128 for backward before Hopper).",
    ),
    "gqa_heads": (
        "The number of query heads is not a multiple of the key/value heads.",
        "Use H_q divisible by H_k and by H_v.",
    ),
    "attn_bias": (
        "The attention mask/bias has a shape, dtype or gradient requirement the provider does not serve.",
        "Pass a bias of shape (1|B, 1|H, S_q, S_kv) that does not require grad, or per-sequence lengths.",
    ),
    "dropout": (
        "Dropout is not served on this path.",
        "Use dropout_p=0, or accept PyTorch's kernel for these calls.",
    ),
    "sink_backward_ragged": (
        "The backward of attention sinks on packed (varlen) inputs needs cuDNN >= 9.26.",
        "Upgrade cuDNN, or use dense padded inputs with seq_len_q/seq_len_kv.",
    ),
    "sink_decode": (
        "Attention sinks are not supported when S_q == 1.",
        "Nothing to do; the call runs on the composite fallback.",
    ),
    "seq_len_one_backward": (
        "cuDNN has no backward for S_q == S_kv == 1.",
        "Nothing to do; the call runs on PyTorch's kernel.",
    ),
    "empty": (
        "An input has zero elements.",
        "Nothing to do; PyTorch handles empty inputs.",
    ),
    "ragged_offset_overflow": (
        "A packed (varlen) operand is too large for cuDNN's int32 ragged offsets.",
        "Split the batch.",
    ),
    "deterministic_workspace": (
        "The deterministic backward on this cuDNN needs an O(B*H*S_q*S_kv) workspace above the limit.",
        "Raise CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB, upgrade to cuDNN >= 9.25, or turn off deterministic mode.",
    ),
    "graph_not_supported": (
        "cuDNN rejected the graph at build time (its message is logged once).",
        "Run with CUDNN_SDPA_PROVIDER_LOG=info to see cuDNN's message; report it if the configuration should work.",
    ),
    "torch_selection": (
        "PyTorch's SDPA selector sent the call to a backend other than cuDNN.",
        "Check the inputs with `cudnn_sdpa_provider.explain(q, k, v, ...)`; PyTorch's own cuDNN checks rejected them.",
    ),
    "rank": (
        "F.scaled_dot_product_attention got inputs that are not 4-D (B, H, S, D); PyTorch runs them on its math kernel.",
        "Pass (B, H, S, D) tensors (add a batch dim), or use cudnn_sdpa_provider.attention.",
    ),
    "softcap": (
        "Attention logit soft-capping (Gemma 2) is not served: cuDNN's SDPA graph has no softcap.",
        "Nothing to do; the layer runs its own eager attention (counted as this fallback).",
    ),
    "paged_kv": (
        "A varlen_attn call with seqused_k / block_table (a paged KV cache) is not served.",
        "Nothing to do; it runs on PyTorch's flash kernel.",
    ),
}
