"""The telemetry file: ``stats().to_dict()`` plus a ``"meta"`` key (versions, device, time)."""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import tempfile

__all__ = ["report_data", "write_report", "report_path_problem"]


def report_data() -> dict:
    import torch

    from .. import __version__
    from . import activation
    from ..core.counters import stats

    snapshot = stats()
    data = snapshot.to_dict()
    meta = {
        "provider": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "enabled": activation.enabled(),
        "device": None,
        # cuDNN graphs this process built (and cuDNN rejected), and the host time the builds took
        "graph_builds": {"built": int(snapshot.builds["built"]), "rejected": int(snapshot.builds["rejected"]),
                         "build_ms": round(float(snapshot.builds["build_ms"]), 1)},
    }
    if torch.cuda.is_available():
        from ..engine.machine import capabilities
        from ..core.support import version_str

        caps = capabilities()
        meta.update(
            device=caps.device_name,
            compute_capability=list(caps.compute_capability or ()),
            cudnn=version_str(caps.cudnn_version),
            cudnn_frontend=caps.frontend_version,
        )
    refused = snapshot.refused_dict()
    if refused:  # strict mode: the calls it refused (also counted under fallback) and why
        meta["refused"] = refused
    data["meta"] = meta
    return data


def report_path_problem(path: str) -> str | None:
    """Why the report cannot be written to ``path``, or None when it can. Leaves nothing behind.

    Checked by creating and removing a temporary file beside ``path``: permission bits alone do
    not say it (root ignores them; a read-only mount does not).
    """
    if not path:
        return "the path is empty"
    if os.path.isdir(path):
        return "it is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{parent} is not a directory" if os.path.exists(parent) else f"its directory {parent} does not exist"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".cudnn-sdpa-probe-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def write_report(path: str) -> None:
    """Write the telemetry JSON atomically: a temporary file beside ``path``, renamed over it.

    On any failure (an OSError naming the problem) neither a partial report nor the temporary
    file is left behind.
    """
    text = json.dumps(report_data(), indent=2, sort_keys=True) + "\n"
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # 0o666: the umask applies, as to open()
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
