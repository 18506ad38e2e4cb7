#!/bin/sh
# Side-by-side: one V4-Flash CSA-layer decode step at context 65,536, sparsemla
# (prepared fast path, Go) and PyTorch on the CPU (fp32, OpenBLAS), on the same
# inputs, same machine, one run. Installs PyTorch from Debian if missing.
#
#   sh bench/compare.sh [outdir]        (from the repository root; needs root for apt-get)
set -eu
out=${1:-/tmp/csastep}
PY=/usr/bin/python3
if ! $PY -c 'import torch, numpy' 2>/dev/null; then
	apt-get update
	apt-get install -y python3-torch python3-numpy libopenblas0-pthread
fi
export GOFLAGS=-mod=mod
go run ./bench/csastep -out "$out"
echo "--- PyTorch, default OpenMP settings"
$PY bench/torch_step.py "$out" --threads "$(nproc)"
# OpenBLAS's threads and spinning OpenMP workers fight over the cores; a
# passive wait policy is PyTorch's best configuration measured here.
echo "--- PyTorch, OMP_WAIT_POLICY=PASSIVE (its fastest setting here)"
OMP_WAIT_POLICY=PASSIVE $PY bench/torch_step.py "$out" --threads "$(nproc)"
