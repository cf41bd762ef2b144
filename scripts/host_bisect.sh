#!/usr/bin/env bash
# Host cost of several copies of the package on one GPU machine, side by side (GPU box):
#   bash scripts/host_bisect.sh DIR [DIR ...]        (ROUNDS=2 CALLS=1000 by default)
# Each DIR holds a cudnn_sdpa_provider/ (e.g. `git archive <commit> cudnn_sdpa_provider | tar -x -C DIR`,
# made on the development machine: the GPU box gets no .git). For ROUNDS rounds, every DIR in turn
# runs `scripts/host_profile.py --quick` (the F.sdpa rows through the public API, with
# CSP_UNDER_TEST=DIR) in a process of its own, so the copies alternate on the same host; then one line
# per DIR and round: forward and forward+backward, provider and native, in us per call.
set -u
[ $# -gt 0 ] || { echo "usage: host_bisect.sh DIR [DIR ...]" >&2; exit 2; }
profile=${PROFILE:-$(dirname "$0")/host_profile.py}  # PROFILE: a stand-in (tests)
out=$(mktemp -d)
for round in $(seq "${ROUNDS:-2}"); do
  for dir in "$@"; do
    [ -d "$dir/cudnn_sdpa_provider" ] || { echo "host_bisect: $dir has no cudnn_sdpa_provider/" >&2; exit 2; }
    CSP_UNDER_TEST=$(cd "$dir" && pwd) timeout 120 python3 "$profile" --quick --calls "${CALLS:-1000}" \
      > "$out/$(basename "$dir")-$round.txt" 2>&1
  done
done
printf '%-24s %5s %12s %12s %16s %16s\n' copy round "native fwd" "provider fwd" "native fwd+bwd" "provider fwd+bwd"
for dir in "$@"; do
  for round in $(seq "${ROUNDS:-2}"); do
    f="$out/$(basename "$dir")-$round.txt"
    v() { grep -F "$1" "$f" | grep -v "forward+backward" | awk '{print $NF}'; }
    w() { grep -F "$1 forward+backward" "$f" | awk '{print $NF}'; }
    printf '%-24s %5s %12s %12s %16s %16s\n' "$(basename "$dir")" "$round" "$(v 'native cuDNN F.sdpa forward')" \
      "$(v 'provider F.sdpa forward')" "$(w 'native cuDNN F.sdpa')" "$(w 'provider F.sdpa')"
  done
done
