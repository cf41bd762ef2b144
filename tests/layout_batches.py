"""Layout configurations in child processes, so a crash is caught and named (issue #14).

``python -m tests.layout_batches SPEC.json`` runs the configurations of SPEC (device, log path,
configurations, kind) one after another through ``layout_runner.run_config``, writing
"layouts START {cfg}" before each and "layouts ok {cfg} <counters>" / "layouts FAIL {cfg} <why>"
after it, to the batch's log and to CSP_FUZZ_LOG (scripts/gpu_summary.py counts them; a START
without an end line is a crash). After a CUDA error that loses the context it stops with exit code
``CONTEXT_LOST``. ``run_batch`` (the parent) runs a child, turns one that died into a crash naming
the configuration that was running, and resumes past it in a fresh child.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

if __name__ == "__main__" and os.environ.get("CSP_UNDER_TEST"):
    # ``python -m`` puts the repository first on sys.path; the package under test goes before it.
    sys.path.insert(0, os.environ["CSP_UNDER_TEST"])

import torch  # noqa: E402

from tests.layout_runner import run_config  # noqa: E402

__all__ = ["BatchResult", "Batches", "run_batch", "log_line", "main", "CONTEXT_LOST"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONTEXT_LOST = 3  # the child's exit code after a CUDA error that poisons the context


def log_line(path, status: str, cfg: dict, extra: str = "", kind: str = "layouts") -> None:
    """One line to the batch log and to CSP_FUZZ_LOG (which scripts/gpu_summary.py counts)."""
    text = f"{kind} {status} {json.dumps(cfg, sort_keys=True)}" + (f" {extra}" if extra else "") + "\n"
    for target in {path, os.environ.get("CSP_FUZZ_LOG")} - {None, ""}:
        with open(target, "a") as f:
            f.write(text)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:4000]


def _context_lost(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device=device).add_(1).item()
    except Exception:
        return True
    return False


def main(argv=None) -> int:
    spec = json.loads(pathlib.Path((argv or sys.argv[1:])[0]).read_text())
    device, log, kind = spec["device"], spec["log"], spec.get("kind", "layouts")
    inject = os.environ.get("CSP_LAYOUT_TEST_INJECT") == "1"  # the runner's own CPU test only
    for cfg in spec["configs"]:
        log_line(log, "START", cfg, kind=kind)
        if inject and cfg.get("inject") == "abort":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # die at once, without a core dump
            os.abort()
        try:
            outcome = run_config(cfg, device)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()  # a sticky CUDA error surfaces here at the latest
        except Exception as exc:
            log_line(log, "FAIL", cfg, _why(exc), kind=kind)
            if _context_lost(device):
                return CONTEXT_LOST
            continue
        log_line(log, "ok", cfg, outcome, kind=kind)
    return 0


@dataclass
class BatchResult:
    ok: dict = field(default_factory=dict)  # id -> what was counted
    failed: dict = field(default_factory=dict)  # id -> why
    crashed: list = field(default_factory=list)  # (id or None, how)
    not_run: list = field(default_factory=list)
    seconds: float = 0.0

    def problems(self, configs) -> list[str]:
        by_id = {c["id"]: c for c in configs}
        lines = [f"config {i} FAIL: {why}\n    {json.dumps(by_id.get(i))}" for i, why in self.failed.items()]
        lines += [f"config {i} CRASH ({how})\n    {json.dumps(by_id.get(i))}" for i, how in self.crashed]
        if self.not_run:
            lines.append(f"configs not run: {self.not_run}")
        return lines


def _events(path: pathlib.Path):
    if not path.exists():
        return
    decoder = json.JSONDecoder()
    for line in path.read_text().splitlines():
        try:
            _, status, rest = line.split(" ", 2)
            cfg, end = decoder.raw_decode(rest)
        except ValueError:  # a line the dying child did not finish
            continue
        yield status, cfg["id"], rest[end:].strip()


def _child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [env.get("CSP_UNDER_TEST", ""), str(ROOT), env.get("PYTHONPATH", "")]  # see test_lifecycles
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _attempt(pending, workdir: pathlib.Path, n: int, device, seconds: float, kind: str):
    spec, log = workdir / f"attempt{n}.json", workdir / f"attempt{n}.log"
    spec.write_text(json.dumps({"device": device, "log": str(log), "configs": pending, "kind": kind}))
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.layout_batches", str(spec)], cwd=ROOT, env=_child_env(),
                              capture_output=True, text=True, timeout=max(seconds, 1))
        return proc.returncode, (proc.stdout + proc.stderr)[-3000:], list(_events(log))
    except subprocess.TimeoutExpired:
        return None, f"timed out: killed after the batch's {seconds:.0f} s", list(_events(log))


def run_batch(configs, workdir, device, timeout: float, restarts: int = 2, kind: str = "layouts") -> BatchResult:
    """Run ``configs`` in a child process; after a crash, resume in a fresh one past the configuration
    that crashed (at most ``restarts`` times, within ``timeout`` seconds in all). ``kind`` is the
    first word of the log lines."""
    workdir, start, result = pathlib.Path(workdir), time.monotonic(), BatchResult()
    pending = list(configs)
    for n in range(restarts + 1):
        rc, tail, events = _attempt(pending, workdir, n, device, timeout - (time.monotonic() - start), kind)
        running = None
        for status, cid, extra in events:
            running = cid if status == "START" else None
            if status in ("ok", "FAIL"):
                (result.ok if status == "ok" else result.failed)[cid] = extra
        pending = [c for c in pending if c["id"] not in result.ok and c["id"] not in result.failed]
        if rc == 0 and not pending:
            break
        if running is not None:
            result.crashed.append((running, f"the child died while it ran (exit {rc}): {tail}"))
        elif rc == CONTEXT_LOST and events:
            running = events[-1][1]
            result.crashed.append((running, "the CUDA context was lost after it; the child stopped"))
        else:
            result.crashed.append((None, f"the child stopped outside any configuration (exit {rc}): {tail}"))
        pending = [c for c in pending if c["id"] != running]
        if running is None or rc is None:  # nothing to resume past, or out of time
            break
    result.not_run = [c["id"] for c in pending]
    result.seconds = time.monotonic() - start
    return result


class Batches:
    """Batches of configurations run ``jobs`` at a time, each in its own child (``run_batch``), from
    threads that only wait on their children. ``result(i)`` waits for batch ``i``: its
    ``BatchResult``, or None when ``deadline`` seconds (counted from the start) had passed before it
    started; a batch that starts gets at most the time left to the deadline. ``close()`` cancels
    the batches not started yet and waits for those running."""

    def __init__(self, batches: dict, workdirs: dict, device, *, jobs: int, deadline: float, batch_timeout: float,
                 restarts: int, kind: str = "layouts"):
        self._start = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=max(jobs, 1))

        def job(index):
            left = deadline - (time.monotonic() - self._start)
            if left <= 0:
                return None
            return run_batch(batches[index], workdirs[index], device, timeout=min(batch_timeout, left),
                             restarts=restarts, kind=kind)

        self._runs = {index: self._pool.submit(job, index) for index in sorted(batches)}

    def result(self, index):
        return self._runs[index].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


if __name__ == "__main__":
    sys.exit(main())
