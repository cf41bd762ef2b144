#!/usr/bin/env bash
# The whole GPU tier, for the H200 test machine (device tool) or any CUDA box:
#   GPU tests with each nvidia-cudnn-frontend wheel in .whl/ (default 1.32.0 and 1.28.0),
#   then, with BENCH=1, the benchmark. Logs, junit XML and summary.json go to $OUT.
# Usage: OUT=/tmp/out bash scripts/gpu_tier.sh   (FRONTENDS="1.32.0" to run one, SKIP_SLOW=1, FUZZ_EXAMPLES=N,
#        PYTEST_ARGS="..." extra pytest options (split on spaces), PYTEST_K="expr" a pytest -k expression,
#        LAYOUT_EXAMPLES=N generated layout configurations on the first frontend (LAYOUT_EXAMPLES_OTHERS
#        on the others), LAYOUT_BATCH=N configurations per child process, LAYOUT_JOBS=N
#        children at once, BENCH=1 BENCH_ARGS="--quick")
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
FRONTENDS=${FRONTENDS:-"1.32.0 1.28.0"}
status=0
first=1
for fe in $FRONTENDS; do
  # The full fuzz budget (issue: >= 500 configurations per run) on the first frontend, a smaller
  # one on the others.
  if [ $first = 1 ]; then export CSP_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-500}; else export CSP_FUZZ_EXAMPLES=${FUZZ_EXAMPLES_OTHERS:-100}; fi
  # The layout differential tests (issue #14: >= 1000 configurations per run) likewise.
  if [ $first = 1 ]; then export CSP_LAYOUT_EXAMPLES=${LAYOUT_EXAMPLES:-1000}; else export CSP_LAYOUT_EXAMPLES=${LAYOUT_EXAMPLES_OTHERS:-250}; fi
  export CSP_LAYOUT_BATCH=${LAYOUT_BATCH:-125} CSP_LAYOUT_JOBS=${LAYOUT_JOBS:-4}
  first=0
  site=${SITE_ROOT:-/tmp}/csp-fe-$fe
  rm -rf "$site"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/nvidia_cudnn_frontend-"$fe"-*.whl; then
    echo "gpu_tier: cannot install nvidia-cudnn-frontend $fe from .whl/" | tee "$OUT/log-$fe.txt"
    status=1
    continue
  fi
  echo "== nvidia-cudnn-frontend $fe ==" | tee "$OUT/log-$fe.txt"
  marks="gpu"
  [ "${SKIP_SLOW:-0}" = 1 ] && marks="gpu and not slow"
  export CSP_FUZZ_LOG="$OUT/fuzz-$fe.log"
  PYTHONPATH="$site:$PWD" timeout "${TIMEOUT:-1200}" python3 -m pytest tests -m "$marks" --gpu -q -p no:cacheprovider \
    --junitxml="$OUT/junit-$fe.xml" ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/log-$fe.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
PYTHONPATH="${SITE_ROOT:-/tmp}/csp-fe-${FRONTENDS%% *}:$PWD" python3 scripts/gpu_summary.py "$OUT" > "$OUT/summary.json"
if [ "${BENCH:-0}" = 1 ]; then
  PYTHONPATH="${SITE_ROOT:-/tmp}/csp-fe-${FRONTENDS%% *}:$PWD" python3 -m cudnn_sdpa_provider bench ${BENCH_ARGS:-} \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.txt"
fi
cat "$OUT/summary.json"
exit $status
