"""The telemetry file: ``stats().to_dict()`` plus a ``"meta"`` key (versions, device, time)."""

from __future__ import annotations

import datetime
import json
import os
import platform

__all__ = ["report_data", "write_report"]


def report_data() -> dict:
    import torch

    from . import __version__, activation
    from .counters import stats

    data = stats().to_dict()
    meta = {
        "provider": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "enabled": activation.enabled(),
        "device": None,
    }
    if torch.cuda.is_available():
        from .support import capabilities, version_str

        caps = capabilities()
        meta.update(
            device=caps.device_name,
            compute_capability=list(caps.compute_capability or ()),
            cudnn=version_str(caps.cudnn_version),
            cudnn_frontend=caps.frontend_version,
        )
    data["meta"] = meta
    return data


def write_report(path: str) -> None:
    """Write the telemetry JSON atomically (a partial file is never left behind)."""
    data = report_data()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)
