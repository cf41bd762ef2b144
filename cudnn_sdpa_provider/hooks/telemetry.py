"""The telemetry file: ``stats().to_dict()`` plus a ``"meta"`` key (versions, device, time).

Where the file goes is what a user expects of ``> FILE`` in a shell, with two safeguards:

- a new or regular file is written atomically (a temporary file beside it, renamed over it), keeping
  the old file's permission bits (and owner and group where the process may set them);
- a symlink is followed: its target is written, the link stays;
- a character device (``/dev/null``, a terminal) or a FIFO is written directly, never replaced
  (writing as root used to swap the system's ``/dev/null`` for a regular file);
- this process's own stdout or stderr (``/dev/stdout``, whatever it is) gets the report after what
  the program printed there: written to the descriptor, never a new file;
- refused, in one line: a directory, a block device (a disk is never a report), a socket, a
  regular file with no write permission bit (read-only: kept, even for root), and anything the
  process may not write.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import platform
import stat
import sys
import tempfile
from typing import NamedTuple

__all__ = ["report_data", "write_report", "report_path_problem", "ReportPathError"]

_PACKAGE = __name__.partition(".")[0]


class ReportPathError(OSError):
    """The report cannot be written to this path; ``strerror`` says why in a few words."""


def _installed_version(name: str) -> str | None:
    from importlib import metadata  # here: the startup hook imports this module

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def report_data() -> dict:
    """The report. Imports nothing new: a script that never imported torch gets all-zero counters
    (and ``enabled: false``) without paying for a torch import at exit."""
    from .. import __version__
    from ..core.counters import stats

    torch = sys.modules.get("torch")
    activation = sys.modules.get(f"{_PACKAGE}.hooks.activation")
    snapshot = stats()
    data = snapshot.to_dict()
    meta = {
        "provider": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else _installed_version("torch"),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "enabled": bool(activation is not None and activation.enabled()),
        "device": None,
        # cuDNN graphs this process built (and cuDNN rejected), and the host time the builds took
        "graph_builds": {"built": int(snapshot.builds["built"]), "rejected": int(snapshot.builds["rejected"]),
                         "build_ms": round(float(snapshot.builds["build_ms"]), 1)},
    }
    if torch is not None and torch.cuda.is_available():
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


class _Target(NamedTuple):
    kind: str  # "new" (no file yet), "regular" (replaced atomically), "stream" (device or FIFO: written
    #            directly), "stdio" (this process's stdout or stderr: written to that descriptor)
    path: str  # for new and regular: the real path (symlinks resolved), where the rename happens
    st: os.stat_result | None


_REFUSED_KINDS = {
    stat.S_ISDIR: "it is a directory",
    stat.S_ISBLK: "it is a block device (a disk is never overwritten with a report)",
    stat.S_ISSOCK: "it is a socket (give a file, a FIFO or a character device)",
}


def _target(path: str) -> _Target:
    """What is at ``path`` and how to write it; ``ReportPathError`` (one line) when it must not be."""
    if not path:
        raise ReportPathError(errno.EINVAL, "the path is empty", path)
    try:
        st = os.stat(path)  # follows symlinks: the link's target is what gets written
    except (FileNotFoundError, NotADirectoryError):  # _new_file says which folder is missing
        return _new_file(path)
    except OSError as exc:  # a symlink loop, a component that is not a directory, ...
        raise ReportPathError(exc.errno, _reason(exc), path) from None
    if _stdio_fd(st) is not None:
        return _Target("stdio", path, st)
    for test, why in _REFUSED_KINDS.items():
        if test(st.st_mode):
            raise ReportPathError(errno.EINVAL, why, path)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        if not os.access(path, os.W_OK):
            raise ReportPathError(errno.EACCES, "permission denied", path)
        return _Target("stream", path, st)
    if not stat.S_ISREG(st.st_mode):
        raise ReportPathError(errno.EINVAL, f"it is not a regular file (mode {oct(st.st_mode)})", path)
    if not st.st_mode & 0o222:  # root could write it, but the user marked it read-only: keep it
        raise ReportPathError(errno.EACCES, f"it is read-only (mode {stat.S_IMODE(st.st_mode):04o})", path)
    if not os.access(path, os.W_OK):
        raise ReportPathError(errno.EACCES, "permission denied", path)
    real = os.path.realpath(path)
    _check_directory(os.path.dirname(real), path)
    return _Target("regular", real, st)


def _stdio_fd(st: os.stat_result) -> int | None:
    """1 or 2 when ``st`` is this process's stdout or stderr (``/dev/stdout``, or the file it is
    redirected to): replacing that file would lose what the program printed before."""
    for fd in (1, 2):
        try:
            own = os.fstat(fd)
        except OSError:
            continue
        if (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return None


def _new_file(path: str) -> _Target:
    real = os.path.realpath(path)  # a dangling symlink: its target is created, as `> link` does
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        why = f"{parent} is not a directory" if os.path.exists(parent) else f"its directory {parent} does not exist"
        raise ReportPathError(errno.ENOENT, why, path)
    _check_directory(parent, path)
    return _Target("new", real, None)


def _check_directory(parent: str, path: str) -> None:
    """The atomic write needs a new file beside the report: try one (permission bits alone do not
    say it: root ignores them, a read-only mount does not)."""
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".cudnn-sdpa-probe-")
    except OSError as exc:
        raise ReportPathError(exc.errno, f"cannot create a file in {parent}: {_reason(exc)}", path) from None
    os.close(fd)
    os.unlink(probe)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def report_path_problem(path: str) -> str | None:
    """Why the report cannot be written to ``path``, or None when it can. Leaves nothing behind."""
    try:
        _target(path)
    except ReportPathError as exc:
        return exc.strerror
    return None


def write_report(path: str) -> None:
    """Write the telemetry JSON to ``path`` (see the module docstring for each kind of path).

    ``ReportPathError`` (an OSError) when the path must not be written. On any failure neither a
    partial report nor a temporary file is left behind, and an existing report is kept.
    """
    text = json.dumps(report_data(), indent=2, sort_keys=True) + "\n"
    target = _target(path)
    if target.kind == "stdio":
        _write_stdio(_stdio_fd(target.st), text)
    elif target.kind == "stream":
        _write_stream(path, text)
    else:
        _replace(target, text)


def _write_stdio(fd: int, text: str) -> None:
    stream = {1: sys.stdout, 2: sys.stderr}[fd]
    if stream is not None:
        stream.flush()  # what the program printed comes first
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]


def _write_stream(path: str, text: str) -> None:
    # O_NONBLOCK only for the open: a FIFO that no process reads fails at once (ENXIO) instead of
    # hanging the exit; the writes then block as usual. No O_CREAT, no O_TRUNC: nothing is replaced.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        why = "no process is reading the FIFO" if exc.errno == errno.ENXIO else _reason(exc)
        raise ReportPathError(exc.errno, why, path) from None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _replace(target: _Target, text: str) -> None:
    parent = os.path.dirname(target.path)
    tmp = os.path.join(parent, f".{os.path.basename(target.path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # 0o666: the umask applies, as to open()
    try:
        with os.fdopen(fd, "w") as fh:
            if target.st is not None:
                _keep_owner_and_mode(fh.fileno(), target.st)
            fh.write(text)
        os.replace(tmp, target.path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _keep_owner_and_mode(fd: int, st: os.stat_result) -> None:
    if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except PermissionError:  # only root may give a file away: it becomes the writer's
            pass
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
