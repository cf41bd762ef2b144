"""Known-bad cuDNN configurations: what a cuDNN release is publicly known (an issue) or measured by
this project (a GPU run in results/) to crash on or compute wrong, as data. The provider never
sends such a graph to cuDNN; the call falls back with ``cudnn_known_issue``.

``known_issue(cudnn_version, compute_capability, problem)`` is the one predicate, evaluated twice:
on the user's call (``support.reasons``: the counters, ``explain()``, the doctor) and on the graph
actually built (``graphs.plan``, before cuDNN sees it), whose dims may differ from the call's: a
bucketed packed graph is built for a longer S than the call's, a repaired or folded graph for other
dims. A crash that takes the process is the worst thing this package can do, so where an issue's
reach is unclear a row covers more than its reproducer (a fallback costs speed, not the process).

Each row: the public issue, the first affected release, the first release known to be fixed (None:
none known yet; the row then covers every later release), what goes wrong, where (in words, for
docs/support.md), and the predicate on a ``support.Problem`` (kind, backward, B, H, S, D, dtypes)
and the compute capability. Imports nothing heavy (``support`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .reasons import Reason, Slug

__all__ = ["KnownIssue", "KNOWN_ISSUES", "known_issue", "applicable"]


@dataclass(frozen=True)
class KnownIssue:
    issue: str  # the public reference, "owner/repo#number", or this project's GPU run in results/
    first: int  # first affected cuDNN (cuDNN's encoding, 92600 = 9.26.0)
    fixed: int | None  # first release known to be fixed; None: none known
    summary: str  # what goes wrong
    where: str  # the predicate in words
    applies: Callable[[object], bool]  # the predicate on a support.Problem
    min_cc: tuple[int, int] | None = None  # the oldest GPU affected; None: every GPU

    def covers(self, cudnn_version: int | None, compute_capability: "tuple[int, int] | None" = None) -> bool:
        """Whether the release is in [first, fixed) and the GPU is affected. An unknown version (a
        described machine without one) is "the newest behaviour, no version gates"
        (``machine.describe_device``): not covered; an unknown GPU is covered by GPU-less rows only."""
        if cudnn_version is None or cudnn_version < self.first:
            return False
        if self.fixed is not None and cudnn_version >= self.fixed:
            return False
        return self.min_cc is None or (compute_capability is not None and compute_capability >= self.min_cc)

    @property
    def versions(self) -> str:
        first = _version(self.first)
        return f">= {first}, no fix known" if self.fixed is None else f"{first} to before {_version(self.fixed)}"

    def message(self, cudnn_version: int) -> str:
        return f"{self.issue}: {self.summary} on cuDNN {_version(cudnn_version)} ({self.where})"


def _version(v: int) -> str:
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


def _planning_segfault(p) -> bool:
    # Reported at B = H_q = H_kv = S_q = 1, S_kv = 128, D = 64, bf16, non-causal on H200 (9.26.0.51),
    # crashing in create_execution_plans before anything runs; reproduced on 9.28.1 through this
    # package. Which dims matter is not known: every single-row (B * H_q == 1) backward with
    # S_q == 1 is kept off cuDNN, whatever S_kv, D, dtype or GPU.
    return p.backward and p.s_q == 1 and p.batch * p.h_q == 1


def _decode_backward_nan(p) -> bool:
    # Reported at B 1, H 2, S_q 1, S_kv 128, D 64, bf16, non-causal, with strongly negative scores
    # (every dK/dV element NaN; deterministic too; a padding mask with full lengths avoids it in the
    # reported case). The scores are data, unknown when the graph is chosen: every S_q == 1 backward.
    return p.backward and p.s_q == 1


def _decode_forward(p) -> bool:
    # pytorch#193893: cuDNN decode silently corrupts greedy generation on B200; PyTorch turns cuDNN
    # decode off on Blackwell (its 2.15.0 message: "cuDNN SDPA decode is disabled for cuDNN versions
    # 9.19-9.25.0 (except 9.24.1) on SM 10.x and 11.x"). No release is confirmed fixed in the issue,
    # so from 9.19 on, on sm_100 and newer (``min_cc``).
    return not p.backward and p.s_q == 1


def _fp8_padded_backward(p) -> bool:
    # Measured on an H100 with cuDNN 9.19 (this project's runs 64-65, results/gpu-run65-fp8-diag.jsonl),
    # B 4, H 8, S 2048, lengths 1000/517/2048/77, causal, dense and packed alike:
    # - H_q != H_k (8/2): dK 43-64% off (of max |dK|) in a fresh process; dQ, dV and the
    #   full-length sequence within bounds; B 2 at lengths 1000/517 in S 1024 within bounds;
    # - H_q == H_k: within bounds in a fresh process, but dK 50-78% and dV 31-75% off once the
    #   allocator's small-block pool held stale values (1e30, or what earlier tests left); with the
    #   amax outputs zeroed dV was right and dK still 15-26% off, with or without a zeroed workspace.
    # What the kernel reads is not known: every padded FP8 backward is kept off cuDNN.
    return p.kind == "fp8" and p.backward and p.padded


def _fp8_empty_sequence(p) -> bool:
    # Measured on an H100 with cuDNN 9.19 (run 65): a padded FP8 call with a zero-length sequence
    # faulted in the packed forward (cudaErrorIllegalInstruction: the CUDA context is lost) and hung
    # the dense forward past 120 s. The lengths are data: the FP8 ops read them (one host sync a
    # padded call) and set ``empty_sequence`` on the call's problem; under CUDA graph capture, where
    # they cannot be read, every padded call counts as having one.
    return p.kind == "fp8" and p.padded and p.empty_sequence


#: The table (docs/support.md lists it; ``cudnn-sdpa doctor`` shows the rows that apply to its machine).
KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue("NVIDIA/cudnn-frontend#1071", 92600, None,
               "SDPA backward plan creation segfaults (the process dies)",
               "a backward with S_q == 1 and B * H_q == 1; reported at B = H = S_q = 1, S_kv = 128, D = 64, bf16, "
               "sm_90", _planning_segfault),
    KnownIssue("NVIDIA/cudnn-frontend#1072", 92500, 92700,
               "SDPA backward returns NaN dK/dV with very negative scores",
               "a backward with S_q == 1; reported at B 1, H 2, S_q 1, S_kv 128, D 64, bf16, sm_90, on 9.25.1 and "
               "9.26.0", _decode_backward_nan),
    KnownIssue("pytorch/pytorch#194927", 91900, None,
               "cuDNN SDPA decode corrupts generation on Blackwell (pytorch#193893)",
               "a forward with S_q == 1 on sm_100 or newer", _decode_forward, min_cc=(10, 0)),
    KnownIssue("cudnn-sdpa-provider run 65 (FP8 padded backward)", 91400, None,
               "FP8 SDPA backward with a padding mask returns wrong dK/dV",
               "an FP8 backward with seq_lens (or packed); measured at B 4, H 8 and 8/2, S 2048, causal, sm_90, "
               "cuDNN 9.19 (GQA always; without GQA after earlier work left stale device memory)",
               _fp8_padded_backward, min_cc=(9, 0)),
    KnownIssue("cudnn-sdpa-provider run 65 (FP8 zero-length sequence)", 91400, None,
               "FP8 SDPA with a zero-length sequence faults (illegal instruction) or hangs",
               "an FP8 call with seq_lens (or packed) where a length is 0 (or, under CUDA graph capture, where the "
               "lengths cannot be read); measured on sm_90, cuDNN 9.19",
               _fp8_empty_sequence, min_cc=(9, 0)),
)


def known_issue(cudnn_version: int | None, compute_capability: "tuple[int, int] | None", problem) -> Reason | None:
    """The first known-bad row that covers this release, GPU and problem (the call's, or the graph's
    own dims), as a ``cudnn_known_issue`` reason; None when none does."""
    for row in KNOWN_ISSUES:
        if row.covers(cudnn_version, compute_capability) and row.applies(problem):
            return Reason(Slug.CUDNN_KNOWN_ISSUE.value, row.message(cudnn_version))
    return None


def applicable(cudnn_version: int | None, compute_capability: "tuple[int, int] | None") -> list[KnownIssue]:
    """The rows that apply to a machine with this cuDNN and GPU (the doctor's list)."""
    return [row for row in KNOWN_ISSUES if row.covers(cudnn_version, compute_capability)]
