#!/usr/bin/env bash
# Several parts of the GPU tier at once on one machine, each a scripts/gpu_tier.sh run of its own
# (own frontend install under ${TMPDIR:-/tmp}/csp-parallel-<name>, own $OUT/<name>/ logs, junit, summary.json):
#   OUT=/tmp/out bash scripts/gpu_parallel.sh NAME=EXPR [NAME=EXPR ...]
# EXPR is the part's pytest -k expression (PYTEST_K), e.g.
#   bash scripts/gpu_parallel.sh layouts=test_layouts lifecycles=test_lifecycles \
#        tier="not fuzzed and not test_layouts and not test_lifecycles"
# Every other gpu_tier.sh knob (FRONTENDS, SKIP_SLOW, TIMEOUT, LAYOUT_JOBS, CSP_LAYOUT_DEADLINE, ...)
# passes through from the environment to every part. Exit status: 0 when every part passed, else 1.
# Tests only: benchmarks time the machine, so run them alone (docs/gpu-tier.md).
set -u
OUT=${OUT:-$PWD/gpu-out}
TIER=${TIER:-$(dirname "$0")/gpu_tier.sh}
[ $# -gt 0 ] || { echo "usage: gpu_parallel.sh NAME=EXPR [NAME=EXPR ...]" >&2; exit 2; }
names=() pids=()
for part in "$@"; do
  name=${part%%=*} expr=${part#*=}
  case $name in ''|*[!A-Za-z0-9_-]*) echo "gpu_parallel: bad part name '$name' (letters, digits, - and _)" >&2; exit 2;; esac
  [ "$name" != "$part" ] || { echo "gpu_parallel: '$part' is not NAME=EXPR" >&2; exit 2; }
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" SITE_ROOT="${TMPDIR:-/tmp}/csp-parallel-$name" PYTEST_K="$expr" bash "$TIER" > "$OUT/$name/tier.txt" 2>&1 &
  names+=("$name") pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then result=passed; else result=failed; status=1; fi
  echo "== ${names[$i]}: $result ($(tail -n 1 "$OUT/${names[$i]}/log-"*.txt 2>/dev/null | grep -E 'passed|failed|error' | tail -n 1))"
done
exit $status
