"""The only reader of ``os.environ``. Parsing is pure; bad values warn and fall back to defaults.

====================================================  ==========================================
Variable                                              Meaning
====================================================  ==========================================
``CUDNN_SDPA_PROVIDER``                               ``1`` (or on/true/yes) enable at startup,
                                                      ``strict`` enable in strict mode, ``0``
                                                      (or off/false/no/empty) leave off.
``CUDNN_SDPA_PROVIDER_REPORT``                        Path: write the telemetry JSON at exit.
``CUDNN_SDPA_PROVIDER_LOG``                           ``warning`` (default), ``info``, ``debug``:
                                                      level of the ``cudnn_sdpa_provider`` logger.
``CUDNN_SDPA_PROVIDER_CACHE_SIZE``                    Graphs kept per thread (LRU), default 256.
``CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB``    Limit for the O(S^2) deterministic-backward
                                                      workspace of cuDNN < 9.25; default: half of
                                                      the device's free memory.
``CUDNN_SDPA_PROVIDER_AUTOTUNE``                      ``1`` (or on/true/yes): build every plan of a
                                                      graph and keep the fastest on its first call
                                                      (``tuning``); ``0`` (default) the heuristic's.
``CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS``                 ``auto`` (default): a dense call at a new
                                                      sequence length reuses the graph of its
                                                      power-of-two length bucket (lengths that are
                                                      powers of two keep their exact graph unless
                                                      the bucket's is built; only where the GPU
                                                      sweeps passed, ``folded.VERIFIED``); ``1``
                                                      always the bucket's; ``0`` an exact graph
                                                      per length (and every F.sdpa ``attn_mask``
                                                      kept as a bias: ``ops.bias_lengths``).
``CUDNN_SDPA_PROVIDER_FP8_QUANT``                     ``auto`` (default): FP8 quantisation of
                                                      bf16/fp16/fp32 tensors in Triton kernels on
                                                      CUDA where triton imports and the GPU is in
                                                      ``fp8_quant.VERIFIED`` (sm_90), else
                                                      in aten ops; ``triton``, ``compiled``
                                                      (torch.compile) or ``torch`` force one
                                                      (``ops.fp8_quant``).
====================================================  ==========================================
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

__all__ = [
    "ACTIVATION",
    "REPORT",
    "LOG",
    "CACHE_SIZE",
    "DETERMINISTIC_WORKSPACE_MB",
    "AUTOTUNE",
    "SHAPE_BUCKETS",
    "FP8_QUANT",
    "VARIABLES",
    "Parsed",
    "parse_activation",
    "parse_log_level",
    "parse_positive_int",
    "parse_flag",
    "activation",
    "report_path",
    "log_level",
    "cache_size",
    "deterministic_workspace_mb",
    "autotune",
    "parse_shape_buckets",
    "shape_buckets",
    "parse_fp8_quant",
    "fp8_quant",
    "invalid",
    "warn_invalid",
]

ACTIVATION = "CUDNN_SDPA_PROVIDER"
REPORT = "CUDNN_SDPA_PROVIDER_REPORT"
LOG = "CUDNN_SDPA_PROVIDER_LOG"
CACHE_SIZE = "CUDNN_SDPA_PROVIDER_CACHE_SIZE"
DETERMINISTIC_WORKSPACE_MB = "CUDNN_SDPA_PROVIDER_DETERMINISTIC_WORKSPACE_MB"
AUTOTUNE = "CUDNN_SDPA_PROVIDER_AUTOTUNE"
SHAPE_BUCKETS = "CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS"
FP8_QUANT = "CUDNN_SDPA_PROVIDER_FP8_QUANT"
#: Every variable, in the order of docs/ways-in.md's table (tests/test_docs.py checks that table against it).
VARIABLES = (ACTIVATION, REPORT, LOG, CACHE_SIZE, DETERMINISTIC_WORKSPACE_MB, AUTOTUNE, SHAPE_BUCKETS, FP8_QUANT)
_FP8_QUANT = ("auto", "triton", "compiled", "torch")

_ON = ("1", "on", "true", "yes")
_OFF = ("", "0", "off", "false", "no")
_LEVELS = ("warning", "info", "debug")
DEFAULT_CACHE_SIZE = 256


class Parsed(NamedTuple):
    value: object
    warning: str | None


def parse_activation(raw: str | None) -> Parsed:
    """``"off"``, ``"on"`` or ``"strict"``; anything else is off, with a warning naming the valid values."""
    text = (raw or "").strip().lower()
    if text in _OFF:
        return Parsed("off", None)
    if text in _ON:
        return Parsed("on", None)
    if text == "strict":
        return Parsed("strict", None)
    return Parsed(
        "off",
        f"{ACTIVATION}={raw!r} is not a valid value; use 1 (enable), strict (enable, raise on fallback) "
        "or 0 (off). The provider stays off.",
    )


def parse_log_level(raw: str | None) -> Parsed:
    text = (raw or "").strip().lower()
    if text == "":
        return Parsed(None, None)
    if text in _LEVELS:
        return Parsed(text, None)
    return Parsed(None, f"{LOG}={raw!r} is not a valid value; use one of {list(_LEVELS)}.")


def parse_positive_int(name: str, raw: str | None, default: int | None, default_text: str | None = None) -> Parsed:
    """A positive integer; anything else is ``default``, with a warning naming what is valid and
    the default (``default_text`` where the default is not a number, e.g. computed later)."""
    text = (raw or "").strip()
    if text == "":
        return Parsed(default, None)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        return Parsed(default, f"{name}={raw!r} is not a positive integer; using {default_text or default}.")
    return Parsed(value, None)


def parse_flag(name: str, raw: str | None) -> Parsed:
    """True for 1/on/true/yes, False for 0/off/false/no/empty; anything else False, with a warning."""
    text = (raw or "").strip().lower()
    if text in _ON:
        return Parsed(True, None)
    if text in _OFF:
        return Parsed(False, None)
    return Parsed(False, f"{name}={raw!r} is not a valid value; use 1 (on) or 0 (off). It stays off.")


_warned: set[str] = set()  # each message once per process, whichever reader comes first


def _warn(message: str, stacklevel: int) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def _read(parsed: Parsed) -> object:
    if parsed.warning:
        _warn(parsed.warning, stacklevel=3)
    return parsed.value


def activation() -> str:
    return _read(parse_activation(os.environ.get(ACTIVATION)))  # type: ignore[return-value]


def report_path() -> str | None:
    return (os.environ.get(REPORT) or "").strip() or None


def log_level() -> str | None:
    return _read(parse_log_level(os.environ.get(LOG)))  # type: ignore[return-value]


def cache_size() -> int:
    return _read(parse_positive_int(CACHE_SIZE, os.environ.get(CACHE_SIZE), DEFAULT_CACHE_SIZE))  # type: ignore[return-value]


_WORKSPACE_DEFAULT = "the default (half of the device's free memory)"


def deterministic_workspace_mb() -> int | None:
    return _read(_parse_workspace(os.environ.get(DETERMINISTIC_WORKSPACE_MB)))  # type: ignore[return-value]


def _parse_workspace(raw: str | None) -> Parsed:
    return parse_positive_int(DETERMINISTIC_WORKSPACE_MB, raw, None, _WORKSPACE_DEFAULT)


def autotune() -> bool:
    return _read(parse_flag(AUTOTUNE, os.environ.get(AUTOTUNE)))  # type: ignore[return-value]


def parse_shape_buckets(raw: str | None) -> Parsed:
    """``"auto"`` (default, also empty), ``"on"`` (1/on/true/yes) or ``"off"`` (0/off/false/no)."""
    text = (raw or "").strip().lower()
    if text in ("", "auto"):
        return Parsed("auto", None)
    if text in _ON:
        return Parsed("on", None)
    if text in _OFF:
        return Parsed("off", None)
    return Parsed("auto", f"{SHAPE_BUCKETS}={raw!r} is not a valid value; use auto, 1 or 0. Using auto.")


@functools.lru_cache(maxsize=16)
def _shape_buckets_parsed(raw: str | None) -> Parsed:
    return parse_shape_buckets(raw)


def shape_buckets() -> str:
    # read at each new length's binding (``folded.mode``): the parse is kept per raw value
    return _read(_shape_buckets_parsed(os.environ.get(SHAPE_BUCKETS)))  # type: ignore[return-value]


def parse_fp8_quant(raw: str | None) -> Parsed:
    """``"auto"`` (default, also empty), ``"triton"``, ``"compiled"`` or ``"torch"``; anything
    else is auto, with a warning naming the valid values."""
    text = (raw or "").strip().lower()
    if text in ("",) + _FP8_QUANT:
        return Parsed(text or "auto", None)
    return Parsed("auto", f"{FP8_QUANT}={raw!r} is not a valid value; use one of {list(_FP8_QUANT)}. Using auto.")


def fp8_quant() -> str:
    return _read(parse_fp8_quant(os.environ.get(FP8_QUANT)))  # type: ignore[return-value]


def invalid(environ) -> list[str]:
    """The warnings for the invalid values in ``environ`` (a mapping), one per variable, in
    ``VARIABLES`` order (the report path takes any path: it is checked when written)."""
    parsed = [
        parse_activation(environ.get(ACTIVATION)),
        parse_log_level(environ.get(LOG)),
        parse_positive_int(CACHE_SIZE, environ.get(CACHE_SIZE), DEFAULT_CACHE_SIZE),
        _parse_workspace(environ.get(DETERMINISTIC_WORKSPACE_MB)),
        parse_flag(AUTOTUNE, environ.get(AUTOTUNE)),
        parse_shape_buckets(environ.get(SHAPE_BUCKETS)),
        parse_fp8_quant(environ.get(FP8_QUANT)),
    ]
    return [p.warning for p in parsed if p.warning]


def warn_invalid(skip: tuple[str, ...] = (ACTIVATION,)) -> None:
    """Warn now about every invalid value (but those of ``skip``, already read), instead of when a
    GPU path first reads it: on a CPU machine the last four are never read."""
    for message in invalid({k: v for k, v in os.environ.items() if k not in skip}):
        _warn(message, stacklevel=2)
