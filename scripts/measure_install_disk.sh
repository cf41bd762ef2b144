#!/bin/bash
# The disk a CI session's torch install needs: free disk sampled every 0.5 s while
# `pip install torch==VERSION nvidia-cudnn-frontend==1.28.0` runs in a fresh venv, as noxfile.py's
# sessions install (no pip cache, no constraints file). Prints the peak use and the venv's size.
# usage: bash scripts/measure_install_disk.sh VERSION [WORKDIR]   (results/install-weight.md)
set -u
v=$1; w=${2:-/tmp/measure-install}; mkdir -p $w; d=$w/venv-$v; rm -rf $d; : > $w/empty.txt
base=$(df --output=avail -B1M "$w" | tail -1)
python3 -m venv $d
( while true; do df --output=avail -B1M "$w" | tail -1; sleep 0.5; done ) > $w/samples-$v &
s=$!
t0=$(date +%s)
PIP_CONSTRAINT=$w/empty.txt PIP_NO_CACHE_DIR=1 $d/bin/pip install -q torch==$v nvidia-cudnn-frontend==1.28.0 > $w/log-$v 2>&1; rc=$?
t1=$(date +%s)
kill $s
min=$(sort -n $w/samples-$v | head -1)
echo "torch $v rc=$rc base_free_MB=$base min_free_MB=$min peak_use_MB=$((base-min)) venv=$(du -sm $d | cut -f1)MB secs=$((t1-t0))"
rm -rf $d
