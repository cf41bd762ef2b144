"""The one place that asks the machine what it has: ``capabilities()``, cached per device.

``describe_device()`` turns a user's description of another machine (for ``explain(device=...)``:
"what would a GPU with cuDNN X do") into ``support.Capabilities`` without touching any GPU.
"""

from __future__ import annotations

import functools

from ..core.support import Capabilities

__all__ = ["capabilities", "describe_device", "cached_capabilities"]


@functools.lru_cache(maxsize=None)
def cached_capabilities(device_index: int | None = None) -> Capabilities:
    """Ask the machine once per device: CUDA, compute capability, cuDNN versions."""
    import torch

    if not torch.cuda.is_available():
        return Capabilities(cuda=False, unavailable="CUDA is not available")
    index = torch.cuda.current_device() if device_index is None else device_index
    cc = tuple(torch.cuda.get_device_capability(index))
    name = torch.cuda.get_device_name(index)
    from . import graphs

    frontend, backend, problem = graphs.backend_info()
    return Capabilities(cuda=True, compute_capability=cc, cudnn_version=backend,  # type: ignore[arg-type]
                        frontend_version=frontend, unavailable=problem, device_name=name)


def capabilities(device_index: int | None = None) -> Capabilities:
    """The capabilities of CUDA device ``device_index`` (None: the current one)."""
    return cached_capabilities(device_index)


_DEVICE_KEYS = ("compute_capability", "cudnn_version", "name")


def describe_device(device) -> Capabilities:
    """Capabilities of a described machine: a ``support.Capabilities`` as is, or a mapping with
    ``compute_capability`` ((major, minor), required), ``cudnn_version`` (int like 91900, or a
    string like "9.19.0"; default: the newest behaviour, no version gates) and ``name``."""
    if isinstance(device, Capabilities):
        return device
    if not isinstance(device, dict):
        raise TypeError(f"device must be a support.Capabilities or a dict with keys {list(_DEVICE_KEYS)}, "
                        f"got {type(device).__name__}")
    unknown = sorted(set(device) - set(_DEVICE_KEYS))
    if unknown:
        raise ValueError(f"device has unknown keys {unknown}; valid keys: {list(_DEVICE_KEYS)}")
    cc = device.get("compute_capability")
    if (not isinstance(cc, (tuple, list)) or len(cc) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)):
        raise ValueError(f"device['compute_capability'] must be a pair of ints like (9, 0), got {cc!r}")
    return Capabilities(cuda=True, compute_capability=(int(cc[0]), int(cc[1])),
                        cudnn_version=_cudnn_version(device.get("cudnn_version")),
                        device_name=str(device.get("name", "described device")))


def _cudnn_version(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10000:
        return value
    if isinstance(value, str):
        parts = value.split(".")
        if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
            major, minor, patch = (int(p) for p in (parts + ["0"])[:3])
            return major * 10000 + minor * 100 + patch
    raise ValueError(f"device['cudnn_version'] must be an int like 91900 or a string like '9.19.0', got {value!r}")
