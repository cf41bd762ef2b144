"""Exceptions of the public API. Imports nothing heavy."""

from __future__ import annotations

__all__ = ["NotSupportedError", "FallbackError"]


class NotSupportedError(RuntimeError):
    """cuDNN (or this package's graphs) cannot serve this call.

    Raised by the engine ops before any work is done, or when cuDNN rejects a graph at build time.
    ``reason`` is a stable slug (see ``cudnn_sdpa_provider.core.reasons``) that the provider records
    when it falls back; ``detail`` is free text (for ``graph_not_supported``, cuDNN's message).
    """

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"[{reason}] {detail}")

    def __reduce__(self):
        return (type(self), (self.reason, self.detail))


class FallbackError(RuntimeError):
    """Strict mode: the provider would have fallen back instead of running on cuDNN.

    ``path`` is one of dense_fwd / dense_bwd / varlen_fwd / varlen_bwd, ``reasons`` the reason
    slugs, ``inputs`` a description of the call (shapes, dtypes, strides, flags).
    """

    def __init__(self, path: str, reasons: list[str], inputs: str, details: list[str] | None = None):
        self.path = path
        self.reasons = list(reasons)
        self.inputs = inputs
        self.details = list(details or [])
        lines = [f"cudnn-sdpa-provider (strict): {path} would fall back; reasons: {', '.join(self.reasons)}"]
        lines += [f"  - {d}" for d in self.details]
        lines.append(f"  inputs: {inputs}")
        super().__init__("\n".join(lines))

    def one_line(self) -> str:
        """The refusal in one line: the path, the reason slugs and their details (not the inputs)."""
        line = str(self).splitlines()[0]
        return line + (f" ({'; '.join(self.details)})" if self.details else "")

    def __reduce__(self):
        return (type(self), (self.path, self.reasons, self.inputs, self.details))
