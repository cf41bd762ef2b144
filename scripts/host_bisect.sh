#!/usr/bin/env bash
# Host cost of several copies of the package on one GPU machine, side by side (GPU box):
#   bash scripts/host_bisect.sh DIR [DIR ...]        (ROUNDS=2 CALLS=1000 by default)
# Each DIR holds a cudnn_sdpa_provider/ (e.g. `git archive <commit> cudnn_sdpa_provider | tar -x -C DIR`,
# made on the development machine: the GPU box gets no .git). For ROUNDS rounds, every DIR in turn
# runs `scripts/host_profile.py --quick` (the F.sdpa rows through the public API, with
# CSP_UNDER_TEST=DIR) in a process of its own, so the copies alternate on the same host; then one line
# per DIR and round (forward and forward+backward, provider and native, wall us per call, and the
# forward+backward's CPU us of all threads), and each DIR's medians over the rounds.
set -u
[ $# -gt 0 ] || { echo "usage: host_bisect.sh DIR [DIR ...]" >&2; exit 2; }
profile=${PROFILE:-$(dirname "$0")/host_profile.py}  # PROFILE: a stand-in (tests)
out=$(mktemp -d)
for round in $(seq "${ROUNDS:-2}"); do
  for dir in "$@"; do
    [ -d "$dir/cudnn_sdpa_provider" ] || { echo "host_bisect: $dir has no cudnn_sdpa_provider/" >&2; exit 2; }
    ROUND=$round CSP_UNDER_TEST=$(cd "$dir" && pwd) timeout 120 python3 "$profile" --quick --calls "${CALLS:-1000}" \
      > "$out/$(basename "$dir")-$round.txt" 2>&1
  done
done
# One line per copy and round; host_profile's rows end "wall CPU" (CPU: every thread's, the host
# work without the hand-off waits between threads), then each copy's medians over its rounds.
printf '%-24s %5s %10s %10s %14s %14s %14s %14s\n' copy round "native fwd" "prov. fwd" "native f+b" "prov. f+b" \
  "native f+b cpu" "prov. f+b cpu"
for dir in "$@"; do
  for round in $(seq "${ROUNDS:-2}"); do
    f="$out/$(basename "$dir")-$round.txt"
    v() { grep -F "$1" "$f" | grep -v "forward+backward" | awk '{print $(NF-1)}'; }
    w() { grep -F "$1 forward+backward" "$f" | awk -v c="$2" '{print $(NF-c)}'; }
    printf '%-24s %5s %10s %10s %14s %14s %14s %14s\n' "$(basename "$dir")" "$round" \
      "$(v 'native cuDNN F.sdpa forward')" "$(v 'provider F.sdpa forward')" "$(w 'native cuDNN F.sdpa' 1)" \
      "$(w 'provider F.sdpa' 1)" "$(w 'native cuDNN F.sdpa' 0)" "$(w 'provider F.sdpa' 0)"
  done
done | tee "$out/table.txt"
echo "medians over the rounds:"
python3 - "$out/table.txt" "$@" <<'PY'
import os, statistics, sys
rows = [line.split() for line in open(sys.argv[1]).read().splitlines()]
for d in sys.argv[2:]:
    name = os.path.basename(d.rstrip("/"))
    mine = [r[2:] for r in rows if r[0] == name and len(r) == 8]
    cols = [statistics.median(float(x) for x in c) for c in zip(*mine)] if mine else []
    print(f"{name:<24} {'med':>5} " + " ".join(f"{m:{10 if i < 2 else 14}.1f}" for i, m in enumerate(cols))
          + f"  ({len(mine)} rounds)")
PY
