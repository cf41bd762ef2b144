"""Per-path call counters: served, or fallback by reason slug. Thread-safe, data only.

Counts are made where the work runs (inside the kernels that execute, never in traced Python),
so torch.compile neither recompiles nor under-counts compiled regions because of them.

``stats().to_dict()`` is exactly::

    {"dense_fwd": {"served": int, "fallback": {reason_slug: int, ...}}, ... every path in PATHS ...}

In strict mode a refused call is counted in ``fallback[reason]`` (it did not run on cuDNN, and the
slug says why) and also in ``stats().refused``, so an audit shows what was refused and why.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType

from .reasons import PATHS

__all__ = ["Stats", "record", "stats", "reset_stats", "log_once", "note_plan", "note_build", "register_drain",
           "PLANS_KEPT"]

log = logging.getLogger("cudnn_sdpa_provider")

_lock = threading.Lock()
_served = {p: 0 for p in PATHS}
_fallback: dict[str, dict[str, int]] = {p: {} for p in PATHS}
_refused: dict[str, dict[str, int]] = {p: {} for p in PATHS}
_plans: "OrderedDict[str, str]" = OrderedDict()
_builds = {"built": 0, "rejected": 0, "build_ms": 0.0}
_logged: set = set()
#: Counts kept on a device (``fp8_saturated``: FP8 calls whose delayed scale would have clipped),
#: by name: the function that moves what accrued there since its last call to the host.
_drains: dict = {}
_extra = {"fp8_saturated": 0}

#: Configurations whose plan ``report()`` lists (the most recently built): a long generation or a
#: dynamic-padding run must not grow the report, nor this process, without bound.
PLANS_KEPT = 32


def record(path: str, reason: str | None = None, refused: bool = False) -> None:
    """Count one call on ``path``: served when ``reason`` is None, else a fallback for ``reason``
    (``refused``: strict mode raised instead of falling back; counted in both)."""
    with _lock:
        if reason is None:
            _served[path] += 1
            return
        bucket = _fallback[path]
        bucket[reason] = bucket.get(reason, 0) + 1
        if refused:
            bucket = _refused[path]
            bucket[reason] = bucket.get(reason, 0) + 1


def note_plan(config: str, plan_name: str) -> None:
    """Remember which cuDNN plan served a configuration (``report()`` shows the ``PLANS_KEPT`` most
    recent)."""
    with _lock:
        _plans[config] = plan_name
        _plans.move_to_end(config)
        while len(_plans) > PLANS_KEPT:
            _plans.popitem(last=False)


def note_build(seconds: float, rejected: bool = False) -> None:
    """Count one cuDNN graph build (or cuDNN's rejection of one) and the host time it took."""
    with _lock:
        _builds["rejected" if rejected else "built"] += 1
        _builds["build_ms"] += seconds * 1e3


def register_drain(name: str, drain) -> None:
    """``drain(discard: bool) -> int`` moves the count ``name`` accrued on the devices to the
    host; ``stats()`` calls it (a host-device sync where there is something to read), so the
    calls that count never wait for the device."""
    with _lock:
        _drains[name] = drain


def _drain(discard: bool = False) -> None:
    with _lock:
        found = list(_drains.items())
    for name, drain in found:
        try:
            n = drain(discard)
        except Exception as error:  # a device that cannot be read now (shutting down): its count waits
            log_once(("drain", name), logging.WARNING, "cudnn_sdpa_provider: could not read %s: %s", name, error)
            continue
        if n and not discard:
            with _lock:
                _extra[name] = _extra.get(name, 0) + n


def log_once(key, level: int, message: str, *args) -> None:
    """Log ``message`` the first time ``key`` is seen (one line per distinct configuration)."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, message, *args)


@dataclass(frozen=True)
class Stats:
    """An immutable snapshot. ``a - b`` (or ``a.diff(b)``) gives the counts of a region."""

    served: MappingProxyType = field(default_factory=lambda: MappingProxyType({p: 0 for p in PATHS}))
    fallback: MappingProxyType = field(default_factory=lambda: MappingProxyType({p: MappingProxyType({}) for p in PATHS}))
    plans: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    refused: MappingProxyType = field(default_factory=lambda: MappingProxyType({p: MappingProxyType({}) for p in PATHS}))
    builds: MappingProxyType = field(default_factory=lambda: MappingProxyType({"built": 0, "rejected": 0,
                                                                                "build_ms": 0.0}))
    #: FP8 calls (a delayed-scaling quantisation of q, k, v or dO, or a delayed-scaling backward)
    #: whose scale, chosen from the amax history, would have clipped (docs/fp8.md says what each
    #: recipe then does); not part of ``to_dict()``, whose keys are the paths.
    fp8_saturated: int = 0

    def to_dict(self) -> dict:
        return {p: {"served": int(self.served[p]), "fallback": dict(self.fallback[p])} for p in PATHS}

    def refused_dict(self) -> dict:
        """{path: {reason: n}} of the calls strict mode refused (paths with none are left out)."""
        return {p: dict(self.refused[p]) for p in PATHS if self.refused[p]}

    def total(self, path: str) -> int:
        """Calls on ``path`` (one of ``PATHS``), served or not."""
        return int(self.served[_path(path)]) + sum(self.fallback[path].values())

    def fallbacks(self, path: str) -> int:
        return sum(self.fallback[_path(path)].values())

    def diff(self, earlier: "Stats") -> "Stats":
        if not isinstance(earlier, Stats):
            raise TypeError(f"can only subtract Stats, got {type(earlier).__name__}")
        served = {p: self.served[p] - earlier.served[p] for p in PATHS}
        builds = {k: self.builds[k] - earlier.builds[k] for k in self.builds}
        return Stats(MappingProxyType(served), _delta(self.fallback, earlier.fallback), self.plans,
                     _delta(self.refused, earlier.refused), MappingProxyType(builds),
                     self.fp8_saturated - earlier.fp8_saturated)

    __sub__ = diff

    def rows(self) -> list[tuple[str, int, int, str]]:
        """(path, served, fallback total, 'reason=n, ...') per path: the data of ``report()``; a
        reason strict mode refused reads 'reason=n (refused m)'."""
        out = []
        for p in PATHS:
            items = sorted(self.fallback[p].items(), key=lambda x: (-x[1], x[0]))
            refused = self.refused[p]
            reasons = ", ".join(f"{r}={n}" + (f" (refused {refused[r]})" if refused.get(r) else "") for r, n in items)
            out.append((p, int(self.served[p]), self.fallbacks(p), reasons or "-"))
        return out


def _path(path: str) -> str:
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; valid paths: {list(PATHS)}")
    return path


def _delta(mine_all, theirs_all) -> MappingProxyType:
    out = {}
    for p in PATHS:
        mine, theirs = mine_all[p], theirs_all[p]
        delta = {r: mine.get(r, 0) - theirs.get(r, 0) for r in set(mine) | set(theirs)}
        out[p] = MappingProxyType({r: n for r, n in delta.items() if n})
    return MappingProxyType(out)


def stats() -> Stats:
    """A snapshot of the counters since the process started (or the last ``reset_stats()``)."""
    _drain()
    with _lock:
        served = MappingProxyType(dict(_served))
        fallback = MappingProxyType({p: MappingProxyType(dict(_fallback[p])) for p in PATHS})
        refused = MappingProxyType({p: MappingProxyType(dict(_refused[p])) for p in PATHS})
        plans = MappingProxyType(dict(_plans))
        builds = MappingProxyType(dict(_builds))
        saturated = _extra["fp8_saturated"]
    return Stats(served, fallback, plans, refused, builds, saturated)


def reset_stats() -> None:
    """Zero every counter (the plan list, the build counts and the log-once memory are kept)."""
    _drain(discard=True)
    with _lock:
        _extra["fp8_saturated"] = 0
        for p in PATHS:
            _served[p] = 0
            _fallback[p] = {}
            _refused[p] = {}


def format_table(s: Stats) -> str:
    """The report table (plain text). Data comes from ``Stats.rows()``."""
    rows = [("path", "served", "fallback", "fallback reasons")] + [(p, str(a), str(b), c) for p, a, b, c in s.rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
    b = s.builds
    if b["built"] or b["rejected"]:
        lines.append("")
        lines.append(f"cuDNN graphs built: {b['built']} ({b['build_ms']:.0f} ms of host time)"
                     + (f", rejected by cuDNN: {b['rejected']}" if b["rejected"] else ""))
    if s.fp8_saturated:
        lines.append("")
        lines.append(f"FP8 calls whose delayed scale would have clipped: {s.fp8_saturated} (docs/fp8.md)")
    if s.plans:
        lines.append("")
        lines.append(f"cuDNN plans (the {PLANS_KEPT} configurations built last):" if len(s.plans) >= PLANS_KEPT
                     else "cuDNN plans:")
        lines += [f"  {plan}  <- {config}" for config, plan in sorted(s.plans.items())]
    return "\n".join(lines)
