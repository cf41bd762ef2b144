#!/usr/bin/env bash
# compute-sanitizer (memcheck) over a small sweep of the folded, length-bucketed dense graphs (GPU box):
#   OUT=/tmp/out bash scripts/sanitize_folded.sh [LENGTH ...]
#   bash scripts/sanitize_folded.sh --verdict LOG RC     (only the verdict on a log already written)
# Runs scripts/folded_sweep.py (decode and prefill, forward and backward, at each LENGTH; default
# 2^k - 1, 2^k, 2^k + 1 for k = 6..8) under `compute-sanitizer --tool memcheck`, with the folded
# graphs forced on and PyTorch's caching allocator off (each tensor its own cudaMalloc, so a read or
# write past a tensor is past an allocation, which memcheck reports). Writes OUT/sanitize-folded.log
# (the sanitizer's and the sweep's output) and OUT/sanitize-folded-verdict.txt (one line).
# compute-sanitizer is taken from SANITIZER, else PATH, else /usr/local/cuda/bin. TIMEOUT (default 540 s)
# bounds the whole run, under the GPU tier's 600 s per device call, so the verdict is written even when
# the sweep is cut (then pass fewer lengths); a sanitizer still alive 30 s after its TERM is killed.
# Exit status:
#   0  PASS: the sanitizer's ERROR SUMMARY says 0 errors and the sweep finished (SWEEP OK);
#   1  FAIL: the sanitizer reported errors;
#   3  FAIL: no errors reported, but the sweep failed, was killed, or the log has no ERROR SUMMARY;
#   4  compute-sanitizer was not found (nothing was run);
#   2  usage error.
set -u

EXIT_ERRORS=1
EXIT_USAGE=2
EXIT_SWEEP=3
EXIT_NO_SANITIZER=4

# verdict LOG RC: print the one-line verdict for a sanitizer log and the exit status the run had;
# return the script's exit status for it.
verdict() {
  local log=$1 rc=$2 summary errors first
  summary=$(grep -E '^========= ERROR SUMMARY: [0-9]+ errors?' "$log" | tail -n 1)
  if [ -z "$summary" ]; then
    echo "FAIL: no ERROR SUMMARY in $log (the sanitizer did not finish; exit status $rc)"
    return $EXIT_SWEEP
  fi
  errors=$(echo "$summary" | sed -E 's/^========= ERROR SUMMARY: ([0-9]+) errors?.*/\1/')
  if [ "$errors" -gt 0 ]; then
    first=$(grep -E '^========= [A-Z]' "$log" | grep -vE '^========= (COMPUTE-SANITIZER|ERROR SUMMARY|LEAK SUMMARY|Target application returned)' \
      | head -n 1 | sed -E 's/^========= //')
    echo "FAIL: compute-sanitizer memcheck reported $errors error(s); first: ${first:-see the log}"
    return $EXIT_ERRORS
  fi
  if [ "$rc" -ne 0 ] || ! grep -q '^SWEEP OK ' "$log"; then
    echo "FAIL: 0 sanitizer errors, but the sweep did not finish (exit status $rc; last line: $(grep -v '^=========' "$log" | tail -n 1))"
    return $EXIT_SWEEP
  fi
  echo "PASS: compute-sanitizer memcheck, 0 errors; $(grep '^SWEEP OK ' "$log" | tail -n 1 | sed -E 's/^SWEEP OK //') served"
  return 0
}

if [ "${1:-}" = "--verdict" ]; then
  [ $# -eq 3 ] && [ -r "$2" ] || { echo "usage: sanitize_folded.sh --verdict LOG RC" >&2; exit $EXIT_USAGE; }
  verdict "$2" "$3"
  exit $?
fi
case "${1:-}" in -*) echo "usage: sanitize_folded.sh [LENGTH ...] | --verdict LOG RC" >&2; exit $EXIT_USAGE;; esac

OUT=${OUT:-./sanitize-out}
mkdir -p "$OUT" || exit $EXIT_USAGE
log="$OUT/sanitize-folded.log"
verdict_file="$OUT/sanitize-folded-verdict.txt"

sanitizer=${SANITIZER:-}
if [ -z "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer || true)
  [ -n "$sanitizer" ] || { [ -x /usr/local/cuda/bin/compute-sanitizer ] && sanitizer=/usr/local/cuda/bin/compute-sanitizer; }
fi
if [ -z "$sanitizer" ] || [ ! -x "$sanitizer" ]; then
  msg="compute-sanitizer not found (${SANITIZER:+SANITIZER=$SANITIZER is not executable; }not on PATH, not /usr/local/cuda/bin/compute-sanitizer): install the CUDA toolkit's compute-sanitizer or set SANITIZER=/path/to/compute-sanitizer"
  echo "sanitize_folded: $msg" >&2
  echo "NOT RUN: $msg" > "$verdict_file"
  exit $EXIT_NO_SANITIZER
fi

sweep=${SWEEP:-$(dirname "$0")/folded_sweep.py}  # SWEEP: a stand-in (tests)
echo "sanitize_folded: $sanitizer --tool memcheck ${PYTHON:-python3} $sweep $*" >&2
CUDNN_SDPA_PROVIDER_SHAPE_BUCKETS=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  timeout --kill-after=30 "${TIMEOUT:-540}" "$sanitizer" --tool memcheck --print-limit "${PRINT_LIMIT:-100}" \
  "${PYTHON:-python3}" "$sweep" "$@" > "$log" 2>&1
rc=$?
line=$(verdict "$log" "$rc")
status=$?
echo "$line" | tee "$verdict_file"
exit $status
