"""Summarise a GPU-tier run: junit counts per frontend version plus the machine's versions (JSON)."""

import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def junit_counts(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    counts["failed_tests"] = failed
    figures = {f"{c.get('classname')}::{c.get('name')}": {p.get("name"): p.get("value") for p in c.iter("property")}
               for s in suites for c in s.iter("testcase") if c.find("properties") is not None}
    if figures:
        counts["figures"] = figures  # record_property values (e.g. the memory soak's drift)
    return counts


def machine():
    info = {}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["cudnn_torch"] = torch.backends.cudnn.version()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = list(torch.cuda.get_device_capability(0))
        import cudnn

        info["cudnn_backend"] = cudnn.backend_version()
    except Exception as exc:  # report, never fail the summary
        info["error"] = repr(exc)
    return info


def _config_id(rest: str):
    """The "id" of the JSON configuration a log line starts with, or None (a line a dying child did
    not finish, or a configuration without an id)."""
    try:
        cfg, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    return cfg.get("id") if isinstance(cfg, dict) else None


def fuzz_counts(path):
    """{kind: {"ok": n, "FAIL": n}} from a CSP_FUZZ_LOG file (one line per configuration tried;
    hypothesis's shrinking of a failure adds FAIL lines). Kinds that write "START" before each
    configuration (the layout batches, tests/layout_batches.py) also get "crash": the configurations
    whose START no ok/FAIL line of the same id ended, because the process died on them. Lines are
    paired by id, so children that run at once and interleave their lines are counted right."""
    counts, started = {}, {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 2)
            if len(parts) < 2:
                continue
            kind, status = parts[:2]
            cid = _config_id(parts[2]) if len(parts) > 2 else None
            bucket = counts.setdefault(kind, {})
            if status == "START":
                bucket.setdefault("crash", 0)
                started.setdefault(kind, set()).add(cid)
                continue
            started.get(kind, set()).discard(cid)
            bucket[status] = bucket.get(status, 0) + 1
    for kind, still_open in started.items():
        counts[kind]["crash"] += len(still_open)
    return counts


def main(out):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "junit-*.xml"))):
        version = os.path.basename(path)[len("junit-"):-len(".xml")]
        runs[version] = junit_counts(path)
    for path in sorted(glob.glob(os.path.join(out, "fuzz-*.log"))):
        version = os.path.basename(path)[len("fuzz-"):-len(".log")]
        runs.setdefault(version, {})["fuzz_configs"] = fuzz_counts(path)
    print(json.dumps({"machine": machine(), "frontends": runs}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
