#!/usr/bin/env bash
# A newer cuDNN on a GPU machine without network (results/gpu-runs.md, run 52: cuDNN 9.28.1 over
# torch 2.11's 9.19), in three steps:
#
#   bash scripts/newer_cudnn.sh fetch [VERSION]   # here, with network: download nvidia-cudnn-cu13==VERSION
#                                                 # (default 9.28.1.4, a 517 MB cp312 wheel) and split it
#                                                 # into parts of at most 44 MB under .cudnn-parts/
#   bash scripts/newer_cudnn.sh stash PART        # on the GPU machine, once per part, one device call
#                                                 # each, back to back (the machine keeps /tmp for the
#                                                 # 30 s it stays up): copies the carried part to /tmp
#   bash scripts/newer_cudnn.sh install           # on the GPU machine: joins the parts, checks the
#                                                 # wheel's sha256, copies its nvidia/cudnn/lib/* over
#                                                 # the folder torch loads cuDNN from, prints the versions
#
# .cudnn-parts/ must be ignored by git (.git/info/exclude). Each stash call carries its part and the
# two small files: carry [".cudnn-parts/part-03", ".cudnn-parts/wheel.name", ".cudnn-parts/wheel.sha256"]
# (a device call carries at most 64 MiB). CUDNN_LIB overrides the folder install writes into.
set -euo pipefail
cmd=${1:?usage: newer_cudnn.sh fetch [VERSION] | stash PART | install}
parts=.cudnn-parts
stash=${CUDNN_STASH:-/tmp/cudnn-parts}
case "$cmd" in
  fetch)
    version=${2:-9.28.1.4}
    rm -rf "$parts" && mkdir -p "$parts/dl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$parts/dl" "nvidia-cudnn-cu13==$version"
    wheel=$(ls "$parts"/dl/*.whl)
    sha256sum "$wheel" | awk '{print $1}' > "$parts/wheel.sha256"
    basename "$wheel" > "$parts/wheel.name"
    split -b 44m -d -a 2 "$wheel" "$parts/part-"
    rm -rf "$parts/dl"
    ls -l "$parts"
    ;;
  stash)
    part=${2:?stash needs a part file (.cudnn-parts/part-NN)}
    mkdir -p "$stash"
    cp "$part" "$stash/"
    for f in wheel.sha256 wheel.name; do [ -f "$parts/$f" ] && cp "$parts/$f" "$stash/"; done
    ls -l "$stash"
    ;;
  install)
    [ -f "$stash/wheel.name" ] && [ -f "$stash/wheel.sha256" ] || { echo "newer_cudnn: no wheel.name/wheel.sha256 in $stash" >&2; exit 2; }
    wheel="$stash/$(cat "$stash/wheel.name")"
    cat "$stash"/part-* > "$wheel"
    echo "$(cat "$stash/wheel.sha256")  $wheel" | sha256sum -c - || { echo "newer_cudnn: a part is missing or damaged" >&2; exit 3; }
    lib=${CUDNN_LIB:-$(python3 -c "import os, nvidia; print([p for p in nvidia.__path__ if os.path.isdir(p + '/cudnn/lib')][0] + '/cudnn/lib')")}
    rm -rf "$stash/unpacked" && mkdir -p "$stash/unpacked"
    python3 -m zipfile -e "$wheel" "$stash/unpacked"
    cp -f "$stash"/unpacked/nvidia/cudnn/lib/* "$lib/"
    echo "copied $(ls "$stash"/unpacked/nvidia/cudnn/lib | wc -l) files into $lib"
    python3 -c "import torch; print('torch sees cuDNN', torch.backends.cudnn.version())" || true
    ;;
  *)
    echo "newer_cudnn: unknown command $cmd (fetch, stash, install)" >&2
    exit 2
    ;;
esac
